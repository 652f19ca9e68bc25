//! The shared-memory ring against a hostile peer.
//!
//! The "peer" writes through a second mapping of the same file or memfd (the way another
//! process would) and puts impossible values into the header and the data area: cursors past
//! the capacity or behind the other cursor, misaligned cursors, huge and misaligned record
//! lengths, bad padding records, a changed magic or capacity. The side under test must answer
//! with the typed error ([`ShmError::Corrupt`] and friends), never panic, and never touch
//! memory outside the data area (every data-area access asserts its bounds, and these tests
//! run with overflow checks in debug builds).
//!
//! Besides the targeted cases: a randomized scribble loop through a second mapping, and a
//! second process that scribbles at random while this one produces and consumes.

// The shared-memory ring needs mmap and futexes; loom builds leave it out.
#![cfg(not(loom))]

use std::fs::File;
use std::os::fd::AsFd;
use std::process::Command;
use std::time::{Duration, Instant};

use fastlane_ring::shm::layout::{
    DATA_OFFSET, MAGIC, OFF_CAPACITY, OFF_CONSUMER_PID, OFF_DATA_WAITER, OFF_HEAD, OFF_MAGIC,
    OFF_PRODUCER_PID, OFF_ROOM_WAITER, OFF_TAIL, OFF_VERSION, PAD_TYPE,
};
use fastlane_ring::shm::{Consumer, Producer, Role, ShmError, ShmRing};
use memmap2::MmapRaw;

/// A second, raw mapping of a ring: the hostile peer's view.
struct Peer {
    map: MmapRaw,
}

impl Peer {
    fn of(ring: &ShmRing) -> Peer {
        let file = File::from(ring.as_fd().try_clone_to_owned().unwrap());
        Peer { map: MmapRaw::map_raw(&file).unwrap() }
    }

    fn of_path(path: &str) -> Peer {
        let file = File::options().read(true).write(true).open(path).unwrap();
        Peer { map: MmapRaw::map_raw(&file).unwrap() }
    }

    fn len(&self) -> usize {
        self.map.len()
    }

    /// A pointer to `size` bytes at `off`, asserted to lie inside the mapping and be aligned.
    fn at(&self, off: usize, size: usize) -> *mut u8 {
        assert!(off.is_multiple_of(size) && off + size <= self.map.len());
        self.map.as_mut_ptr().wrapping_add(off)
    }

    fn write_u64(&self, off: usize, value: u64) {
        let ptr = self.at(off, 8).cast::<u64>();
        // SAFETY:
        // - `at` asserted the 8 bytes lie inside the mapping, aligned (the mapping starts on a
        //   page boundary), and the mapping lives as long as `self`.
        // - The ring under test reads these bytes only atomically or by copy; a volatile write
        //   is what another process's plain store would be.
        unsafe { ptr.write_volatile(value) }
    }

    fn write_u32(&self, off: usize, value: u32) {
        let ptr = self.at(off, 4).cast::<u32>();
        // SAFETY: as in `write_u64`, for 4 aligned bytes inside the mapping.
        unsafe { ptr.write_volatile(value) }
    }

    fn read_u64(&self, off: usize) -> u64 {
        let ptr = self.at(off, 8).cast::<u64>();
        // SAFETY: as in `write_u64`, a read of 8 aligned bytes inside the mapping.
        unsafe { ptr.read_volatile() }
    }

    /// Writes a record header word (`len` low, `type` high) at data-area position `idx`.
    fn record_header(&self, idx: u64, len: u32, record_type: u32) {
        self.write_u64(DATA_OFFSET + idx as usize, u64::from(len) | (u64::from(record_type) << 32));
    }
}

fn ring(capacity: usize) -> (ShmRing, Producer, Consumer, Peer) {
    let ring = ShmRing::create_memfd("hostile", capacity).unwrap();
    let tx = ring.producer().unwrap();
    let rx = ring.consumer().unwrap();
    let peer = Peer::of(&ring);
    (ring, tx, rx, peer)
}

/// Reads every record of one batch (copying it out) and releases it; returns how many.
fn drain(rx: &mut Consumer) -> Result<usize, ShmError> {
    let mut buf = vec![0u8; rx.capacity()];
    let mut batch = rx.peek_batch(usize::MAX)?;
    let mut n = 0;
    while let Some(r) = batch.next_record()? {
        assert!(r.len() <= buf.len());
        assert_eq!(r.copy_to(&mut buf), r.len());
        n += 1;
    }
    batch.release();
    Ok(n)
}

fn corrupt_what<T: std::fmt::Debug>(r: Result<T, ShmError>) -> &'static str {
    match r {
        Err(ShmError::Corrupt { what, .. }) => what,
        other => panic!("expected Corrupt, got {other:?}"),
    }
}

#[test]
fn tail_past_capacity() {
    let (_ring, _tx, mut rx, peer) = ring(256);
    peer.write_u64(OFF_TAIL, 256 + 8);
    assert_eq!(corrupt_what(drain(&mut rx)), "tail more than capacity ahead of head");
    // Sticky, even once the value is plausible again.
    peer.write_u64(OFF_TAIL, 0);
    assert_eq!(corrupt_what(drain(&mut rx)), "tail more than capacity ahead of head");
    peer.write_u64(OFF_TAIL, u64::MAX - 7);
    let (_ring, _tx, mut rx, peer) = ring(256);
    peer.write_u64(OFF_TAIL, u64::MAX - 7);
    assert_eq!(corrupt_what(drain(&mut rx)), "tail more than capacity ahead of head");
}

#[test]
fn cursors_planted_near_the_end_of_u64() {
    let ring = ShmRing::create_memfd("hostile", 256).unwrap();
    let peer = Peer::of(&ring);
    peer.write_u64(OFF_TAIL, u64::MAX - 7);
    peer.write_u64(OFF_HEAD, u64::MAX - 7);
    let mut tx = ring.producer().unwrap();
    let mut rx = ring.consumer().unwrap();
    assert_eq!(corrupt_what(tx.try_push(1, &[0; 8])), "tail would overflow");
    assert_eq!(drain(&mut rx).unwrap(), 0);
    peer.write_u64(OFF_TAIL, 8);
    assert_eq!(corrupt_what(drain(&mut rx)), "tail moved backwards");
}

#[test]
fn tail_behind_head_or_misaligned() {
    let (ring, mut tx, mut rx, peer) = ring(256);
    for _ in 0..4 {
        tx.try_push(1, &[1; 8]).unwrap();
    }
    assert_eq!(drain(&mut rx).unwrap(), 4);
    peer.write_u64(OFF_TAIL, 32);
    assert_eq!(corrupt_what(drain(&mut rx)), "tail moved backwards");
    // A consumer attaching to such a ring is refused.
    drop(rx);
    assert!(matches!(ring.consumer(), Err(ShmError::Corrupt { what: "head ahead of tail", .. })));
    let (_ring, _tx, mut rx, peer) = self::ring(256);
    peer.write_u64(OFF_TAIL, 13);
    assert_eq!(corrupt_what(drain(&mut rx)), "tail misaligned");
}

#[test]
fn huge_record_length() {
    let (_ring, mut tx, mut rx, peer) = ring(256);
    tx.try_push(1, &[7; 16]).unwrap();
    peer.record_header(0, u32::MAX - 10, 1);
    assert_eq!(corrupt_what(drain(&mut rx)), "record runs past end of data area");
    let (_ring, mut tx, mut rx, peer) = ring(256);
    tx.try_push(1, &[7; 16]).unwrap();
    peer.record_header(0, 40, 1); // inside the area, past the published tail
    assert_eq!(corrupt_what(drain(&mut rx)), "record runs past tail");
}

#[test]
fn misaligned_length_shifts_framing_but_stays_inside() {
    // Two records of 16 bytes (span 24 each); the first claims 17 bytes (span 32), so the
    // consumer reads a header out of the second record's payload, which the peer controls.
    for (payload_word, expect) in [
        (0u64, Ok(3)), // len 0 type 0, then the tail lines up
        (u64::from(PAD_TYPE) << 32 | 5, Err("padding record does not reach the end")),
        (64, Err("record runs past tail")),
    ] {
        let (_ring, mut tx, mut rx, peer) = ring(256);
        tx.try_push(1, &[0; 16]).unwrap();
        let mut second = [0u8; 16];
        second[..8].copy_from_slice(&payload_word.to_ne_bytes());
        tx.try_push(2, &second).unwrap();
        peer.record_header(0, 17, 1);
        match expect {
            Ok(n) => assert_eq!(drain(&mut rx).unwrap(), n),
            Err(what) => assert_eq!(corrupt_what(drain(&mut rx)), what),
        }
    }
}

/// A ring whose next record wraps: padding at 216..256, the record at 0. Returns the tail.
fn wrapped(capacity: usize) -> (ShmRing, Producer, Consumer, Peer) {
    let (ring, mut tx, mut rx, peer) = ring(capacity);
    for _ in 0..3 {
        tx.try_push(1, &[1; 64]).unwrap();
    }
    assert_eq!(drain(&mut rx).unwrap(), 3);
    tx.try_push(2, &[2; 48]).unwrap();
    assert_eq!(peer.read_u64(OFF_TAIL), 256 + 56);
    (ring, tx, rx, peer)
}

#[test]
fn bad_padding_records() {
    let (_ring, _tx, mut rx, peer) = wrapped(256);
    peer.record_header(216, 8, PAD_TYPE); // should be 32: up to the end of the area
    assert_eq!(corrupt_what(drain(&mut rx)), "padding record does not reach the end");

    let (_ring, _tx, mut rx, peer) = wrapped(256);
    peer.write_u64(OFF_TAIL, 224); // the padding runs past the published tail
    assert_eq!(corrupt_what(drain(&mut rx)), "padding record runs past tail");

    let (_ring, _tx, mut rx, peer) = wrapped(256);
    peer.record_header(0, 256 - 8, PAD_TYPE); // padding after padding, at position 0
    assert_eq!(corrupt_what(drain(&mut rx)), "padding record at start of data area");

    // A record that would cross the end of the area instead of padding.
    let (_ring, _tx, mut rx, peer) = wrapped(256);
    peer.record_header(216, 40, 3);
    assert_eq!(corrupt_what(drain(&mut rx)), "record runs past end of data area");

    // The untouched ring reads fine.
    let (_ring, _tx, mut rx, _peer) = wrapped(256);
    assert_eq!(drain(&mut rx).unwrap(), 1);
}

#[test]
fn changed_magic_or_capacity() {
    for (off, value, what) in [
        (OFF_MAGIC, 0u64, "header magic changed"),
        (OFF_CAPACITY, 1 << 20, "header capacity changed"),
        (OFF_CAPACITY, u64::MAX, "header capacity changed"),
    ] {
        let (ring, mut tx, mut rx, peer) = ring(256);
        tx.try_push(1, b"x").unwrap();
        peer.write_u64(off, value);
        assert_eq!(corrupt_what(drain(&mut rx)), what);
        // The producer sees it on its slow path, when it looks for room.
        let err = loop {
            match tx.try_push(1, &[0; 100]) {
                Ok(()) => {}
                Err(e) => break e,
            }
        };
        assert_eq!(corrupt_what(Err::<(), _>(err)), what);
        // And attaching to or opening such a ring is refused.
        drop((tx, rx));
        assert!(matches!(ring.producer(), Err(ShmError::Corrupt { .. })));
    }
    // A changed version is noticed the same way.
    let (_ring, mut tx, mut rx, peer) = ring(256);
    tx.try_push(1, b"x").unwrap();
    peer.write_u32(OFF_VERSION, 7);
    assert_eq!(corrupt_what(drain(&mut rx)), "header version changed");
}

#[test]
fn open_refuses_scribbled_headers() {
    let path = format!("/dev/shm/fastlane-hostile-open-{}", std::process::id());
    let _ = std::fs::remove_file(&path);
    let ring = ShmRing::create_file(&path, 4096).unwrap();
    let peer = Peer::of_path(&path);
    drop(ring);
    peer.write_u64(OFF_MAGIC, u64::from_le_bytes(*b"garbage!"));
    assert!(matches!(ShmRing::open_file(&path), Err(ShmError::BadMagic { .. })));
    peer.write_u64(OFF_MAGIC, MAGIC);
    peer.write_u32(OFF_VERSION, 2);
    assert!(matches!(ShmRing::open_file(&path), Err(ShmError::BadVersion { found: 2, .. })));
    peer.write_u32(OFF_VERSION, 1);
    peer.write_u64(OFF_CAPACITY, 4095);
    assert!(matches!(ShmRing::open_file(&path), Err(ShmError::BadCapacity { capacity: 4095 })));
    peer.write_u64(OFF_CAPACITY, 1 << 30);
    assert!(matches!(ShmRing::open_file(&path), Err(ShmError::Truncated { .. })));
    peer.write_u64(OFF_CAPACITY, 4096);
    assert!(ShmRing::open_file(&path).is_ok());
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn head_scribbled_under_the_producer() {
    for (value, what) in [
        (1024i64, "head ahead of published tail"),
        (i64::MIN, "head moved backwards"), // 0
        (-3, "head misaligned"),
    ] {
        // Fill the ring, release half, push one more (the producer now holds head = 128),
        // then release everything: head = tail = 288 in the mapping.
        let (_ring, mut tx, mut rx, peer) = ring(256);
        for _ in 0..8 {
            tx.try_push(1, &[0; 24]).unwrap();
        }
        let mut batch = rx.peek_batch(4).unwrap();
        while batch.next_record().unwrap().is_some() {}
        batch.release();
        tx.try_push(1, &[0; 24]).unwrap();
        assert_eq!(drain(&mut rx).unwrap(), 5);
        let tail = peer.read_u64(OFF_TAIL);
        let head = if value == i64::MIN { 0 } else { tail.wrapping_add_signed(value) };
        peer.write_u64(OFF_HEAD, head);
        // Push until the producer needs the consumer's cursor.
        let err = loop {
            if let Err(e) = tx.try_push(1, &[0; 24]) {
                break e;
            }
        };
        assert_eq!(corrupt_what(Err::<(), _>(err)), what);
        assert!(matches!(tx.reserve(0), Err(ShmError::Corrupt { .. })), "sticky");
    }
}

#[test]
fn park_and_claim_words_are_harmless() {
    let (ring, mut tx, mut rx, peer) = ring(256);
    peer.write_u32(OFF_DATA_WAITER, u32::MAX);
    peer.write_u32(OFF_ROOM_WAITER, 1);
    for i in 0..1000u32 {
        tx.try_push(i, &i.to_le_bytes()).unwrap();
        assert_eq!(drain(&mut rx).unwrap(), 1);
        peer.write_u32(OFF_DATA_WAITER, i);
        peer.write_u32(OFF_ROOM_WAITER, i);
    }
    // A blocking wait with garbage in the park word ends at its deadline.
    peer.write_u32(OFF_DATA_WAITER, 1);
    let deadline = Instant::now() + Duration::from_millis(20);
    assert!(matches!(rx.wait_batch(1, Some(deadline)), Err(ShmError::Timeout)));
    // Claims: a live pid blocks the role, a dead one is taken over.
    drop((tx, rx));
    peer.write_u32(OFF_PRODUCER_PID, 1);
    assert!(matches!(ring.producer(), Err(ShmError::RoleTaken { role: Role::Producer, pid: 1 })));
    let mut dead = Command::new("true").spawn().unwrap();
    let dead_pid = dead.id();
    dead.wait().unwrap();
    peer.write_u32(OFF_CONSUMER_PID, dead_pid);
    assert!(ring.consumer().is_ok());
}

/// xorshift64*: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A value a hostile peer might write: near the real cursors, at the edges, or anything.
fn nasty(rng: &mut Rng, near: u64, capacity: u64) -> u64 {
    match rng.below(8) {
        0 => 0,
        1 => u64::MAX - rng.below(16),
        2 => capacity + rng.below(3) * 8,
        3 => near.wrapping_add(rng.below(64) * 8),
        4 => near.wrapping_sub(rng.below(64) * 8),
        5 => near.wrapping_add(rng.below(16)),
        6 => u64::from(u32::MAX) << 32 | rng.below(capacity * 2),
        _ => rng.next(),
    }
}

/// Scribbles one nasty value somewhere in the ring: mostly record headers and cursors.
fn scribble(rng: &mut Rng, peer: &Peer, capacity: u64) {
    let tail = peer.read_u64(OFF_TAIL);
    let head = peer.read_u64(OFF_HEAD);
    match rng.below(10) {
        0..=4 => {
            // A word in the data area, often exactly where the next record header is.
            let idx = if rng.below(2) == 0 {
                (head % capacity) & !7
            } else {
                rng.below(capacity / 8) * 8
            };
            let word = match rng.below(4) {
                0 => (u64::from(PAD_TYPE) << 32) | rng.below(capacity * 2),
                1 => rng.below(capacity + 64),
                _ => nasty(rng, capacity - idx, capacity),
            };
            peer.write_u64(DATA_OFFSET + idx as usize, word);
        }
        5 | 6 => peer.write_u64(OFF_TAIL, nasty(rng, tail, capacity)),
        7 => peer.write_u64(OFF_HEAD, nasty(rng, head, capacity)),
        8 => peer.write_u32(OFF_DATA_WAITER, rng.next() as u32),
        _ => {
            let off = [OFF_MAGIC, OFF_CAPACITY, OFF_ROOM_WAITER & !7][rng.below(3) as usize];
            peer.write_u64(off, nasty(rng, capacity, capacity));
        }
    }
}

/// Random producer/consumer traffic with random scribbles through a second mapping. Every
/// result must be `Ok`, `Full`, or a typed corruption; a corrupted ring is replaced.
#[test]
fn randomized_scribbles_never_panic() {
    const CAPACITY: u64 = 512;
    const STEPS: usize = 40_000;
    let seed = std::env::var("FASTLANE_SHM_SEED").ok().and_then(|s| s.parse().ok());
    let mut rng = Rng(seed.unwrap_or(0x0DDB_A11C_AFEF_00D5));
    let (mut _r, mut tx, mut rx, mut peer) = ring(CAPACITY as usize);
    let (mut records, mut corrupt, mut rings) = (0usize, 0usize, 1usize);
    let mut payload = [0u8; 256];
    for _ in 0..STEPS {
        let result = match rng.below(8) {
            0..=2 => {
                let len = rng.below(260) as usize;
                match tx.try_push(rng.next() as u32 >> 1, &payload[..len.min(256)]) {
                    Err(ShmError::Full { .. } | ShmError::TooLarge { .. }) | Ok(()) => Ok(()),
                    Err(e) => Err(e),
                }
            }
            3 => {
                let len = rng.below(200) as usize;
                match tx.reserve(len) {
                    Ok(buf) => {
                        buf.fill(rng.next() as u8);
                        if rng.below(2) == 0 {
                            tx.commit(7);
                        } else {
                            tx.stage(7);
                        }
                        Ok(())
                    }
                    Err(ShmError::Full { .. } | ShmError::TooLarge { .. }) => Ok(()),
                    Err(e) => Err(e),
                }
            }
            4 | 5 => drain(&mut rx).map(|n| records += n),
            _ => {
                scribble(&mut rng, &peer, CAPACITY);
                Ok(())
            }
        };
        match result {
            Ok(()) => {}
            Err(ShmError::Corrupt { .. }) => {
                corrupt += 1;
                (_r, tx, rx, peer) = ring(CAPACITY as usize);
                rings += 1;
            }
            Err(e) => panic!("unexpected error {e:?}"),
        }
        payload[rng.below(256) as usize] = rng.next() as u8;
    }
    eprintln!("{records} records read, {corrupt} corruptions found, {rings} rings");
    assert!(corrupt > 100, "the scribbles should have been noticed often ({corrupt})");
    assert!(records > 1000, "traffic should have flowed between scribbles ({records})");
}

/// Set in the hostile child: the ring file to scribble on.
const HOSTILE_ENV: &str = "FASTLANE_SHM_HOSTILE";

/// The hostile process: opens the ring file at the path it is given (the parent replaces it
/// after each corruption), scribbles on it a while, opens it again, for 1.5 s. In a normal
/// test run (no `FASTLANE_SHM_HOSTILE`) this does nothing.
#[test]
fn shm_hostile_child() {
    let Ok(path) = std::env::var(HOSTILE_ENV) else {
        return;
    };
    let mut rng = Rng(u64::from(std::process::id()) | 1);
    let end = Instant::now() + Duration::from_millis(1500);
    let mut writes = 0u64;
    while Instant::now() < end {
        let Ok(file) = File::options().read(true).write(true).open(&path) else {
            std::thread::sleep(Duration::from_millis(1));
            continue;
        };
        let Ok(map) = MmapRaw::map_raw(&file) else { continue };
        if map.len() < DATA_OFFSET + 64 {
            continue;
        }
        let peer = Peer { map };
        let capacity = (peer.len() - DATA_OFFSET) as u64;
        for _ in 0..20 {
            scribble(&mut rng, &peer, capacity);
            writes += 1;
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    eprintln!("hostile child: {writes} scribbles");
}

/// A second process scribbles at random for 1.5 s while this one produces and consumes; after
/// each corruption this side replaces the ring. Nothing may panic or hang.
#[test]
fn hostile_second_process() {
    let path = format!("/dev/shm/fastlane-hostile-{}", std::process::id());
    let fresh_ring = || {
        let _ = std::fs::remove_file(&path);
        ShmRing::create_file(&path, 4096).unwrap()
    };
    let mut ring = fresh_ring();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "shm_hostile_child", "--nocapture", "--test-threads=1", "-q"])
        .env(HOSTILE_ENV, &path)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let (mut ops, mut errors, mut records) = (0u64, 0u64, 0usize);
    let mut rng = Rng(42);
    while child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "hostile child did not finish");
        let attached = ring.producer().and_then(|tx| Ok((tx, ring.consumer()?)));
        let (mut tx, mut rx) = match attached {
            Ok(pair) => pair,
            Err(ShmError::Corrupt { .. } | ShmError::RoleTaken { .. }) => {
                errors += 1;
                ring = fresh_ring();
                continue;
            }
            Err(e) => panic!("attach: {e:?}"),
        };
        for _ in 0..10_000 {
            ops += 1;
            let r = if rng.below(2) == 0 {
                match tx.try_push(1, &[0xAB; 100][..rng.below(100) as usize]) {
                    Err(ShmError::Full { .. }) => Ok(()),
                    r => r,
                }
            } else {
                drain(&mut rx).map(|n| records += n)
            };
            match r {
                Ok(()) => {}
                Err(ShmError::Corrupt { .. }) => {
                    errors += 1;
                    drop((tx, rx));
                    ring = fresh_ring();
                    break;
                }
                Err(e) => panic!("unexpected {e:?}"),
            }
        }
    }
    let status = child.wait().unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(status.success(), "hostile child: {status:?}");
    eprintln!("{ops} operations, {records} records, {errors} corruptions or refused attaches");
    assert!(errors > 0 && records > 0);
}
