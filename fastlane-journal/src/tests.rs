//! Unit tests of the journal: round trip, power cuts through the fault-injecting device,
//! replication, a hostile producer, verify.

use std::sync::Arc;
use std::time::Duration;

use fastlane_ring::shm::ShmRing;

use super::fault::{Cut, FaultDisk};
use super::*;
use fastlane_block::ram::RamDisk;

const T: Duration = Duration::from_secs(10);

fn payload_for(seq: u64) -> Vec<u8> {
    let len = (seq.wrapping_mul(7) % 200) as usize;
    (0..len).map(|i| (seq as u8).wrapping_add(i as u8).wrapping_mul(31)).collect()
}

fn small_config(dev: Arc<dyn BlockDevice>, durability: Durability) -> JournalConfig {
    let mut c = JournalConfig::new(dev, durability);
    c.ring_bytes = 64 << 10;
    c.max_record_bytes = 1024;
    c.max_batch_bytes = 16 << 10;
    c
}

/// Every record in `img`, in order, checked against `payload_for`.
fn records(img: &[u8]) -> (Vec<u64>, Scan) {
    let mut seqs = Vec::new();
    let s = scan(&mut &img[..], &mut |v| {
        assert_eq!(v.payload, payload_for(v.header.seq), "payload of seq {}", v.header.seq);
        seqs.push(v.header.seq);
        true
    })
    .unwrap();
    (seqs, s)
}

fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed | 1;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

#[test]
fn round_trip_reopen_resumes_numbering() {
    let disk = FaultDisk::new(vec![0; 1 << 20]);
    let j = Journal::create(small_config(Arc::new(disk.clone()), Durability::Local)).unwrap();
    let mut tx = j.producer().unwrap();
    let mut last = 0;
    for i in 1..=500u64 {
        let seq = tx.append_blocking(&payload_for(i), T).unwrap();
        assert_eq!(seq, i);
        last = seq;
    }
    tx.wait_durable(last, T).unwrap();
    assert_eq!(j.durable_seq(), 500);
    drop(tx);
    let stats = j.close().unwrap();
    assert_eq!(stats.records, 500);
    // The flushers take the newest request, so one flush may cover several batches.
    assert!(stats.batches <= 500 && stats.flushes >= 1 && stats.flushes <= stats.batches);
    let (seqs, s) = records(&disk.durable());
    assert_eq!(seqs, (1..=500).collect::<Vec<_>>());
    assert_eq!(s.stop, Stop::Clean);

    let j = Journal::open(small_config(Arc::new(disk.clone()), Durability::Local)).unwrap();
    assert_eq!(j.recovery().last_seq, 500);
    assert_eq!(j.recovery().records, 500);
    assert!(!j.recovery().truncated);
    let mut tx = j.producer().unwrap();
    for i in 501..=700u64 {
        assert_eq!(tx.append_blocking(&payload_for(i), T).unwrap(), i);
    }
    tx.wait_durable(700, T).unwrap();
    drop(tx);
    j.close().unwrap();
    let (seqs, _) = records(&disk.durable());
    assert_eq!(seqs, (1..=700).collect::<Vec<_>>());
    let report = verify(&mut &disk.durable()[..], Anchor::default()).unwrap();
    assert_eq!(report.problem, None, "{report:?}");
    assert_eq!(report.last_seq, 700);
}

#[test]
fn too_large_and_full_are_errors_not_drops() {
    let disk = FaultDisk::new(vec![0; 1 << 20]);
    let mut c = small_config(Arc::new(disk.clone()), Durability::Local);
    c.ring_bytes = 4096;
    let j = Journal::create(c).unwrap();
    let mut tx = j.producer().unwrap();
    assert!(matches!(tx.append(&[0; 1025]), Err(JournalError::TooLarge { len: 1025, max: 1024 })));
    // Fill the ring faster than the writer drains it (at least once), never losing a record.
    let mut acked = Vec::new();
    let mut full = 0;
    let mut seq = 1;
    while seq <= 2000u64 {
        match tx.append(&payload_for(seq)) {
            Ok(s) => {
                assert_eq!(s, seq);
                acked.push(s);
                seq += 1;
            }
            Err(JournalError::Full) => {
                full += 1;
                std::thread::yield_now();
            }
            Err(e) => panic!("{e}"),
        }
    }
    tx.wait_durable(2000, T).unwrap();
    drop(tx);
    j.close().unwrap();
    assert!(full > 0, "a 4 KiB ring should fill up");
    let (seqs, _) = records(&disk.durable());
    assert_eq!(seqs, acked);
}

/// Power cuts at random points: every acknowledged seq survives, recovery returns only whole,
/// consecutive records, and the journal reopens writable after each cut.
#[test]
fn power_cut_never_loses_an_acknowledged_record() {
    power_cuts(0xC0FFEE, 0);
}

/// The same with flushes that complete only several reaps after submission: the pipelined
/// writer then has batch N+1 written (its first block rewriting batch N's last) while batch
/// N's flush is in flight, and two batches unflushed at once. Every acknowledged record must
/// survive, and every cut image must reopen (the unflushed writes stay inside the window that
/// recovery zeroes).
#[test]
fn power_cut_with_flushes_in_flight_never_loses_an_acknowledged_record() {
    power_cuts(0xDEFE44ED, 40);
}

/// The power cuts again with the flusher threads ([`WriterIo::Flusher`]): writes on the
/// writer's queue, flushes (held back as above) on the flushers' own queues.
#[test]
fn power_cut_with_flusher_threads_never_loses_an_acknowledged_record() {
    power_cuts_with(0xF1A5, 40, WriterIo::Flusher);
}

/// The power cuts with [`WriterIo::Dsync`]: writes durable at completion (FUA), several in
/// flight, batches padded to their own blocks while another write is in flight; then with
/// the writes completing, and becoming durable, out of order (a later write on the medium,
/// an earlier one not yet).
#[test]
fn power_cut_with_dsync_writes_never_loses_an_acknowledged_record() {
    power_cuts_with(0xD5C, 0, WriterIo::Dsync);
    power_cuts_with(0xD5C2, 7, WriterIo::Dsync);
}

fn power_cuts(seed: u64, flush_delay: u32) {
    power_cuts_with(seed, flush_delay, WriterIo::Pipelined);
}

/// Appends record 1, waits until its flush is held at the gate, appends record 2, and says
/// whether record 2 reached the device while that flush was still held (then opens the gate
/// and checks both become durable).
fn written_during_held_flush(io: WriterIo, inline_flush: bool, patience: Duration) -> bool {
    let (disk, gate) = FaultDisk::new(vec![0; 1 << 20]).with_flush_gate(inline_flush);
    let mut c = small_config(Arc::new(disk.clone()), Durability::Local);
    c.writer_io = io;
    let j = Journal::create(c).unwrap();
    gate.close();
    let mut tx = j.producer().unwrap();
    assert_eq!(tx.append_blocking(&payload_for(1), T).unwrap(), 1);
    let t0 = std::time::Instant::now();
    while gate.held() == 0 {
        assert!(t0.elapsed() < T, "record 1's flush never reached the device");
        std::thread::sleep(Duration::from_micros(100));
    }
    assert_eq!(tx.append_blocking(&payload_for(2), T).unwrap(), 2);
    let t0 = std::time::Instant::now();
    let mut written = false;
    while t0.elapsed() < patience {
        if records(&disk.volatile()).0.contains(&2) {
            written = true;
            break;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    // Nothing is acknowledged while its flush is held.
    assert_eq!(j.durable_seq(), 0, "acknowledged before the flush completed");
    assert!(gate.held() > 0);
    gate.open();
    tx.wait_durable(2, T).unwrap();
    drop(tx);
    j.close().unwrap();
    assert_eq!(records(&disk.durable()).0, vec![1, 2]);
    written
}

/// A record that arrives while a flush is in flight is written (and its own flush can start)
/// before that flush completes: with the pipelined writer on a device whose flush completes
/// asynchronously (io_uring), and with the flusher threads even when the flush blocks its
/// caller (a synchronous `fdatasync`).
#[test]
fn record_arriving_during_a_flush_is_written_before_the_flush_completes() {
    assert!(written_during_held_flush(WriterIo::Pipelined, false, T));
    assert!(written_during_held_flush(WriterIo::Flusher, false, T));
    assert!(written_during_held_flush(WriterIo::Flusher, true, T));
}

/// Why the flusher threads exist: the pipelined writer on a device whose flush blocks the
/// submitting thread (the inline `sync` engine) cannot write anything until it returns.
#[test]
fn pipelined_writer_is_stuck_behind_an_inline_flush() {
    assert!(!written_during_held_flush(WriterIo::Pipelined, true, Duration::from_millis(300)));
}

/// [`WriterIo::Dsync`]: while a write is in flight, the next batch is held until it fills
/// its block, so records that arrive one by one during a write do not each become a padded
/// block write of their own (on this project's disk that took the 200,000 records/s ack P99
/// from about 0.3 ms to 3.7 ms); once it fills its block it is written without waiting for
/// the write in flight, and everything is durable when that completes.
#[test]
fn dsync_holds_a_small_batch_while_a_write_is_in_flight() {
    let (disk, gate) = FaultDisk::new(vec![0; 1 << 20]).with_flush_gate(false);
    let mut c = small_config(Arc::new(disk.clone()), Durability::Local);
    c.writer_io = WriterIo::Dsync;
    let j = Journal::create(c).unwrap();
    let align = u64::from(j.superblock().write_align);
    gate.close();
    let mut tx = j.producer().unwrap();
    assert_eq!(tx.append_blocking(&payload_for(1), T).unwrap(), 1);
    let t0 = std::time::Instant::now();
    while gate.held() == 0 {
        assert!(t0.elapsed() < T, "record 1's write never reached the device");
        std::thread::sleep(Duration::from_micros(100));
    }
    // Less than a block behind it: held while write 1 is.
    let mut seq = 1u64;
    let mut bytes = 0u64;
    while bytes < align / 2 {
        seq += 1;
        assert_eq!(tx.append_blocking(&payload_for(seq), T).unwrap(), seq);
        bytes += format::frame_len(payload_for(seq).len()) as u64;
    }
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(records(&disk.volatile()).0, vec![1], "records 2..={seq} written at once");
    assert_eq!(gate.held(), 1);
    // Enough to fill the block: written while write 1 is still in flight.
    while bytes + format::FRAME_HEADER_LEN as u64 <= align {
        seq += 1;
        assert_eq!(tx.append_blocking(&payload_for(seq), T).unwrap(), seq);
        bytes += format::frame_len(payload_for(seq).len()) as u64;
    }
    let t0 = std::time::Instant::now();
    while gate.held() < 2 {
        assert!(t0.elapsed() < T, "a full block was not written while write 1 was in flight");
        std::thread::sleep(Duration::from_micros(100));
    }
    assert!(records(&disk.volatile()).0.len() > 1);
    assert_eq!(j.durable_seq(), 0, "acknowledged before its write completed");
    gate.open();
    tx.wait_durable(seq, T).unwrap();
    drop(tx);
    j.close().unwrap();
    assert_eq!(records(&disk.durable()).0, (1..=seq).collect::<Vec<_>>());
}

/// [`WriterIo::Dsync`]: a batch that had to start in a block of its own because a write was
/// in flight moves back behind that write's last frame once it has completed, so a stream
/// of small writes does not take a block each (at 20,000 records/s that made segments fill
/// ~10x faster than the records' bytes).
#[test]
fn dsync_shares_the_block_once_the_write_before_has_completed() {
    let (disk, gate) = FaultDisk::new(vec![0; 1 << 20]).with_flush_gate(false);
    let mut c = small_config(Arc::new(disk.clone()), Durability::Local);
    c.writer_io = WriterIo::Dsync;
    let j = Journal::create(c).unwrap();
    let align = u64::from(j.superblock().write_align);
    let mut tx = j.producer().unwrap();
    let mut seq = 0u64;
    // Rounds of: one record written and held, a few more behind it, the write released.
    for _ in 0..3 {
        gate.close();
        seq += 1;
        assert_eq!(tx.append_blocking(&payload_for(seq), T).unwrap(), seq);
        let t0 = std::time::Instant::now();
        while gate.held() == 0 {
            assert!(t0.elapsed() < T, "record {seq}'s write never reached the device");
            std::thread::sleep(Duration::from_micros(100));
        }
        for _ in 0..3 {
            seq += 1;
            assert_eq!(tx.append_blocking(&payload_for(seq), T).unwrap(), seq);
        }
        std::thread::sleep(Duration::from_millis(50));
        gate.open();
        tx.wait_durable(seq, T).unwrap();
    }
    drop(tx);
    j.close().unwrap();
    let img = disk.durable();
    let mut at = Vec::new();
    let s = scan(&mut &img[..], &mut |v| {
        assert_eq!(v.payload, payload_for(v.header.seq));
        at.push((v.header.seq, v.offset, format::frame_len(v.header.len as usize) as u64));
        true
    })
    .unwrap();
    assert_eq!(at.len() as u64, seq, "{s:?}");
    // 12 records of at most 200 bytes: one block, every frame right after the one before.
    for w in at.windows(2) {
        let ((s0, o0, l0), (s1, o1, _)) = (w[0], w[1]);
        assert_eq!(
            o1,
            o0 + l0,
            "record {s1} at {o1}, not right after record {s0} (ends {})",
            o0 + l0
        );
    }
    assert!(s.end <= format::DATA_OFFSET + align, "the records took more than a block: {s:?}");
}

fn power_cuts_with(seed: u64, flush_delay: u32, io: WriterIo) {
    let mut rng = xorshift(seed);
    // Room for every round's records however they batch: with FUA completions held (the
    // dsync writer, `flush_delay` > 0) many batches are padded to a block of their own, and
    // a run alone on an idle machine took ~4 MiB.
    let mut image = vec![0u8; 8 << 20];
    let mut created = false;
    let mut next_payload_seq = 1u64;
    for round in 0..60 {
        let disk = FaultDisk::new(image.clone()).deferred_flush(flush_delay);
        let mut c = small_config(Arc::new(disk.clone()), Durability::Local);
        c.writer_io = io;
        let j = if created { Journal::open(c).unwrap() } else { Journal::create(c).unwrap() };
        created = true;
        let rec = j.recovery();
        assert_eq!(rec.last_seq + 1, next_payload_seq.max(rec.last_seq + 1));
        next_payload_seq = rec.last_seq + 1;
        let mut tx = j.producer().unwrap();
        let n = 1 + rng() % 300;
        let mut acked = rec.last_seq;
        for _ in 0..n {
            let seq = tx.append_blocking(&payload_for(next_payload_seq), T).unwrap();
            assert_eq!(seq, next_payload_seq);
            next_payload_seq += 1;
            if rng().is_multiple_of(16) {
                tx.wait_durable(seq, T).unwrap();
            }
            acked = acked.max(tx.durable_seq());
        }
        acked = acked.max(j.durable_seq());
        let cut = if round % 2 == 0 { Cut::Tear } else { Cut::DropAll };
        image = disk.power_cut(cut, &mut rng);
        // The writer goes on writing into the old disk; the cut image is what survives.
        drop(tx);
        drop(j);
        let (seqs, _) = records(&image);
        let want: Vec<u64> = (1..=seqs.len() as u64).collect();
        assert_eq!(seqs, want, "round {round}: records must be consecutive from 1");
        assert!(
            seqs.len() as u64 >= acked,
            "round {round}: acked {acked} but only {} recovered",
            seqs.len()
        );
        next_payload_seq = seqs.len() as u64 + 1;
    }
    let disk = FaultDisk::new(image);
    let j = Journal::open(small_config(Arc::new(disk.clone()), Durability::Local)).unwrap();
    j.close().unwrap();
    let report = verify(&mut &disk.durable()[..], Anchor::default()).unwrap();
    assert_eq!(report.problem, None, "{report:?}");
}

#[test]
fn replicated_mirrors_every_byte_and_waits_for_the_replica() {
    let disk = FaultDisk::new(vec![0; 1 << 20]);
    let replica = MemReplica::new(1 << 20).with_sync_delay(Duration::from_millis(1));
    let mut c = small_config(Arc::new(disk.clone()), Durability::Replicated);
    c.replica = Some(Box::new(replica.clone()));
    let j = Journal::create(c).unwrap();
    let mut tx = j.producer().unwrap();
    for i in 1..=300u64 {
        tx.append_blocking(&payload_for(i), T).unwrap();
    }
    tx.wait_durable(300, T).unwrap();
    // Durable at `replicated` means the replica has it too.
    let (seqs, _) = records(&replica.snapshot());
    assert_eq!(seqs.len(), 300);
    drop(tx);
    j.close().unwrap();
    let dev = disk.durable();
    let rep = replica.snapshot();
    let end = verify(&mut &dev[..], Anchor::default()).unwrap().end as usize;
    assert_eq!(dev[..end], rep[..end]);
    assert_eq!(verify(&mut &rep[..], Anchor::default()).unwrap().problem, None);

    let c = small_config(Arc::new(disk), Durability::Replicated);
    assert!(matches!(Journal::open(c), Err(JournalError::Config(_))));
}

#[test]
fn memory_durability_acks_without_a_flush() {
    let disk = FaultDisk::new(vec![0; 1 << 20]);
    let j = Journal::create(small_config(Arc::new(disk.clone()), Durability::Memory)).unwrap();
    let mut tx = j.producer().unwrap();
    let seq = tx.append(b"in the page cache").unwrap_or_else(|_| panic!());
    tx.wait_durable(seq, T).unwrap();
    assert_eq!(j.stats().flushes, 0);
    drop(tx);
    j.close().unwrap();
}

/// Every waiting strategy returns once the seq is durable, times out on a seq nobody appended
/// (within its deadline, not a 10 ms park slice later for the polling ones), and reports a
/// stopped writer instead of waiting.
#[test]
fn wait_durable_with_each_strategy() {
    use fastlane_ring::WaitStrategy;
    let strategies = [
        WaitStrategy::BusySpin,
        WaitStrategy::SpinYield { spins: 16 },
        WaitStrategy::SpinYieldPark { spins: 16, yields: 4 },
    ];
    for (i, w) in strategies.into_iter().enumerate() {
        let disk = FaultDisk::new(vec![0; 1 << 20]);
        let mut c = small_config(Arc::new(disk), Durability::Local);
        c.writer_wait = w;
        let j = Journal::create(c).unwrap();
        let mut tx = j.producer().unwrap();
        for n in 1..=200u64 {
            let seq = tx.append_blocking(&payload_for(n), T).unwrap();
            if n % 50 == 0 {
                tx.wait_durable_with(seq, T, w).unwrap();
                assert!(tx.durable_seq() >= seq, "{w:?}: returned before {seq} was durable");
            }
        }
        j.wait_durable_with(200, T, w).unwrap();
        let t0 = std::time::Instant::now();
        let r = j.wait_durable_with(201, Duration::from_millis(30), w);
        let waited = t0.elapsed();
        assert!(matches!(r, Err(JournalError::Timeout { seq: 201, durable: 200 })), "{w:?}: {r:?}");
        assert!(waited >= Duration::from_millis(30), "{w:?}: gave up after {waited:?}");
        assert!(waited < Duration::from_secs(2), "{w:?}: deadline overrun {waited:?}");
        drop(tx);
        let stats = j.close().unwrap();
        assert_eq!(stats.records, 200, "strategy {i}");
    }
    // A closed journal: every strategy answers at once with the writer's state.
    let disk = FaultDisk::new(vec![0; 1 << 20]);
    let j = Journal::create(small_config(Arc::new(disk), Durability::Local)).unwrap();
    let tx = j.producer().unwrap();
    j.close().unwrap();
    for w in strategies {
        let t0 = std::time::Instant::now();
        let r = tx.wait_durable_with(1, T, w);
        assert!(matches!(r, Err(JournalError::Closed)), "{w:?}: {r:?}");
        assert!(t0.elapsed() < Duration::from_secs(1), "{w:?}: waited {:?}", t0.elapsed());
    }
}

#[test]
fn hostile_producer_stops_the_ring_not_the_writer() {
    let dir = tempfile::tempdir().unwrap();
    let shm = dir.path().join("ring");
    let disk = FaultDisk::new(vec![0; 1 << 20]);
    let mut c = small_config(Arc::new(disk.clone()), Durability::Local);
    c.shm_path = Some(shm.clone());
    let j = Journal::create(c).unwrap();
    {
        let mut tx = JournalProducer::attach(&shm).unwrap();
        for i in 1..=10u64 {
            tx.append(&payload_for(i)).unwrap();
        }
        tx.wait_durable(10, T).unwrap();
    }
    // Raw access to the ring, as a hostile process would have: a record that skips seqs.
    let ring = ShmRing::open_file(&shm).unwrap();
    let mut raw = ring.producer().unwrap();
    let mut rec = 1000u64.to_le_bytes().to_vec();
    rec.extend_from_slice(b"forged");
    raw.try_push(RECORD_TYPE, &rec).unwrap();
    let deadline = std::time::Instant::now() + T;
    while j.control.state() != control::STATE_PRODUCER_FAULT {
        assert!(std::time::Instant::now() < deadline, "writer did not flag the producer");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(matches!(j.wait_durable(11, T), Err(JournalError::ProducerFault)));
    // Bad type and short records are refused the same way (fresh journals).
    drop(raw);
    drop(ring);
    j.close().unwrap();
    let (seqs, _) = records(&disk.durable());
    assert_eq!(seqs, (1..=10).collect::<Vec<_>>());
    for (ty, body) in [(7u32, 11u64.to_le_bytes().to_vec()), (RECORD_TYPE, vec![1, 2, 3])] {
        let mut c = small_config(Arc::new(disk.clone()), Durability::Local);
        c.shm_path = Some(shm.clone());
        let j = Journal::open(c).unwrap();
        let ring = ShmRing::open_file(&shm).unwrap();
        let mut raw = ring.producer().unwrap();
        raw.try_push(ty, &body).unwrap();
        let deadline = std::time::Instant::now() + T;
        while j.control.state() != control::STATE_PRODUCER_FAULT {
            assert!(std::time::Instant::now() < deadline);
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(raw);
        j.close().unwrap();
    }
}

#[test]
fn device_full_is_reported_and_nothing_acked_is_lost() {
    // 4 KiB superblock + room for a few records past the minimum size.
    let sb_min = 4096 + (16 << 10) + 3 * 4096;
    let disk = FaultDisk::new(vec![0; sb_min + 8192]);
    let j = Journal::create(small_config(Arc::new(disk.clone()), Durability::Local)).unwrap();
    let mut tx = j.producer().unwrap();
    let mut appended = 0u64;
    let err = loop {
        match tx.append_blocking(&[0xAB; 1000], Duration::from_millis(200)) {
            Ok(_) => appended += 1,
            Err(e) => break e,
        }
        if appended > 10_000 {
            panic!("device never filled");
        }
    };
    assert!(matches!(err, JournalError::DeviceFull | JournalError::Full), "{err}");
    assert!(matches!(j.wait_durable(appended, T), Err(JournalError::DeviceFull)));
    let durable = j.durable_seq();
    drop(tx);
    assert!(matches!(j.close(), Err(JournalError::DeviceFull)));
    let s = scan(&mut &disk.durable()[..], &mut |_| true).unwrap();
    assert_eq!(s.last_seq, durable);
    assert!(durable > 0);
}

#[test]
fn mid_journal_damage_is_refused_not_truncated() {
    let disk = FaultDisk::new(vec![0; 1 << 20]);
    let j = Journal::create(small_config(Arc::new(disk.clone()), Durability::Local)).unwrap();
    let mut tx = j.producer().unwrap();
    for i in 1..=2000u64 {
        tx.append_blocking(&payload_for(i), T).unwrap();
    }
    tx.wait_durable(2000, T).unwrap();
    drop(tx);
    j.close().unwrap();
    let mut img = disk.durable();
    img[4096 + 100] ^= 1;
    let c = small_config(Arc::new(FaultDisk::new(img)), Durability::Local);
    assert!(matches!(Journal::open(c), Err(JournalError::Corrupt { .. })));
}

#[test]
fn ram_disk_backend_works() {
    let disk = Arc::new(RamDisk::new(1 << 20, 512).unwrap());
    let j = Journal::create(small_config(disk, Durability::Local)).unwrap();
    let mut tx = j.producer().unwrap();
    let s = tx.append(b"x").unwrap();
    tx.wait_durable(s, T).unwrap();
    drop(tx);
    j.close().unwrap();
}

/// [`WriterIo::Dsync`] at the device's end: a write in flight whose frames end less than a
/// frame header before the last usable block boundary, and a record behind it. The next
/// batch's block of its own then starts past the usable end; the room left there is none
/// (the record waits: `DeviceFull`, or a roll in the service), not an underflow (a debug
/// build's writer panicked, release wrapped: 2 of 20 runs of `journal bench-service` with
/// 1 MiB segments).
#[test]
fn dsync_a_write_in_flight_at_the_device_end_leaves_no_room_after_it() {
    let size = 64u64 << 10;
    let (disk, gate) = FaultDisk::new(vec![0; size as usize]).with_flush_gate(false);
    let mut c = small_config(Arc::new(disk.clone()), Durability::Local);
    c.writer_io = WriterIo::Dsync;
    let j = Journal::create(c).unwrap();
    let align = u64::from(j.superblock().write_align);
    let h = format::FRAME_HEADER_LEN as u64;
    // Frames may end at the dsync writer's reserve (two blocks for the last padding frame);
    // these end 8 bytes before it, so the padding after them takes a whole block more.
    let target = size - 2 * align - 8;
    let mut tx = j.producer().unwrap();
    let (mut end, mut seq) = (format::DATA_OFFSET, 0u64);
    // Records made durable one at a time (frames back to back) until one is left to land
    // exactly on `target`; it leaves at least a header and 8 bytes for that last one.
    while target - end - h > 1000 {
        let plen = (target - end - 2 * h - 8).min(1000);
        seq += 1;
        assert_eq!(tx.append_blocking(&vec![7u8; plen as usize], T).unwrap(), seq);
        tx.wait_durable(seq, T).unwrap();
        end += format::frame_len(plen as usize) as u64;
    }
    gate.close();
    let last = vec![9u8; (target - end - h) as usize];
    seq += 1;
    assert_eq!(tx.append_blocking(&last, T).unwrap(), seq);
    let t0 = std::time::Instant::now();
    while gate.held() == 0 {
        assert!(t0.elapsed() < T, "the last record's write never reached the device");
        std::thread::sleep(Duration::from_micros(100));
    }
    // Behind the write in flight: no room for it in this device.
    assert_eq!(tx.append_blocking(&[1u8; 100], T).unwrap(), seq + 1);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(j.durable_seq(), seq - 1, "acknowledged before its write completed");
    gate.open();
    tx.wait_durable(seq, T).unwrap();
    assert!(matches!(j.wait_durable(seq + 1, T), Err(JournalError::DeviceFull)));
    drop(tx);
    assert!(matches!(j.close(), Err(JournalError::DeviceFull)));
    let s = scan(&mut &disk.durable()[..], &mut |_| true).unwrap();
    // The last frame ends at `target`, its padding a block past the reserve's start.
    assert_eq!((s.last_seq, s.end), (seq, format::pad_next(target, align)));
}
