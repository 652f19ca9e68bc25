//! Unit tests of the shared-memory ring: framing, wrap-around, corruption, blocking.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::layout::*;
use super::*;
use crate::WaitStrategy;

fn memfd_ring(capacity: usize) -> (ShmRing, Producer, Consumer) {
    let ring = ShmRing::create_memfd("shm-unit", capacity).unwrap();
    let tx = ring.producer().unwrap();
    let rx = ring.consumer().unwrap();
    (ring, tx, rx)
}

/// Drains up to `limit` records into owned copies and releases them.
fn drain(rx: &mut Consumer, limit: usize) -> Vec<(u32, Vec<u8>)> {
    let mut out = Vec::new();
    let mut batch = rx.peek_batch(limit).unwrap();
    while let Some(r) = batch.next_record().unwrap() {
        let mut buf = vec![0u8; r.len()];
        assert_eq!(r.copy_to(&mut buf), r.len());
        out.push((r.record_type(), buf));
    }
    batch.release();
    out
}

fn word_at(ring: &ShmRing, idx: u64) -> (u32, u32) {
    unpack_record_header(ring.shared.record_word(idx).load(Ordering::Relaxed))
}

#[test]
fn framing_header_and_alignment() {
    let (ring, mut tx, mut rx) = memfd_ring(1024);
    let lens = [0usize, 1, 7, 8, 9, 16, 31];
    for (i, &len) in lens.iter().enumerate() {
        let buf = tx.reserve(len).unwrap();
        buf.fill(i as u8 + 1);
        tx.commit(100 + i as u32);
    }
    // Walk the data area by hand: header (len, type), payload rounded up to 8.
    let mut idx = 0u64;
    for (i, &len) in lens.iter().enumerate() {
        assert_eq!(word_at(&ring, idx), (len as u32, 100 + i as u32));
        assert_eq!(idx % 8, 0);
        idx += record_span(len as u64);
    }
    assert_eq!(ring.shared.header().tail.load(Ordering::Relaxed), idx);
    assert_eq!(record_span(0), 8);
    assert_eq!(record_span(1), 16);
    assert_eq!(record_span(8), 16);
    assert_eq!(record_span(9), 24);
    let got = drain(&mut rx, usize::MAX);
    assert_eq!(got.len(), lens.len());
    for (i, (t, payload)) in got.iter().enumerate() {
        assert_eq!(*t, 100 + i as u32);
        assert_eq!(payload, &vec![i as u8 + 1; lens[i]]);
    }
    assert_eq!(ring.shared.header().head.load(Ordering::Relaxed), idx);
}

#[test]
fn wrap_around_writes_a_padding_record_and_keeps_payloads_contiguous() {
    let (ring, mut tx, mut rx) = memfd_ring(256);
    // 3 records of 64 bytes (span 72) leave 40 bytes at the end.
    for i in 0..3u8 {
        tx.try_push(1, &[i; 64]).unwrap();
    }
    assert_eq!(drain(&mut rx, usize::MAX).len(), 3);
    // 48 bytes (span 56) do not fit in 40: padding at 216, the record at 0.
    tx.try_push(2, &[9; 48]).unwrap();
    assert_eq!(word_at(&ring, 216), (40 - 8, PAD_TYPE));
    assert_eq!(word_at(&ring, 0), (48, 2));
    assert_eq!(ring.shared.header().tail.load(Ordering::Relaxed), 256 + 56);
    let mut batch = rx.peek_batch(10).unwrap();
    let r = batch.next_record().unwrap().unwrap();
    assert_eq!(r.as_ptr(), ring.shared.data_ptr(8, 48).cast_const());
    let mut buf = [0u8; 48];
    r.copy_to(&mut buf);
    assert_eq!(buf, [9; 48]);
    // SAFETY: the producer is in this test and writes nothing while the slice lives.
    assert_eq!(unsafe { r.as_bytes() }, &[9; 48]);
    assert!(batch.next_record().unwrap().is_none());
    batch.release();
    assert_eq!(ring.shared.header().head.load(Ordering::Relaxed), 256 + 56);
}

#[test]
fn full_is_not_fatal() {
    let (_ring, mut tx, mut rx) = memfd_ring(256);
    assert_eq!(tx.max_record_len(), 120);
    let mut n = 0;
    let err = loop {
        match tx.try_push(n, &[n as u8; 24]) {
            Ok(()) => n += 1,
            Err(e) => break e,
        }
    };
    assert_eq!(n, 8); // 8 records of span 32 fill 256 bytes
    assert!(matches!(err, ShmError::Full { needed: 32, free: 0 }), "{err:?}");
    assert!(matches!(tx.reserve(0), Err(ShmError::Full { .. })));
    // Release two records: room again.
    let mut batch = rx.peek_batch(2).unwrap();
    while batch.next_record().unwrap().is_some() {}
    batch.release();
    tx.try_push(99, &[1; 24]).unwrap();
    tx.try_push(99, &[1; 24]).unwrap();
    assert!(matches!(tx.try_push(99, &[1; 24]), Err(ShmError::Full { .. })));
    let got = drain(&mut rx, usize::MAX);
    let types: Vec<u32> = got.iter().map(|(t, _)| *t).collect();
    assert_eq!(types, [2, 3, 4, 5, 6, 7, 99, 99]);
}

#[test]
fn too_large_is_refused_up_front() {
    let (_ring, mut tx, _rx) = memfd_ring(256);
    assert!(matches!(tx.reserve(121), Err(ShmError::TooLarge { len: 121, max: 120 })));
    assert!(tx.reserve(120).is_ok());
}

#[test]
fn batch_commit_publishes_once() {
    let (ring, mut tx, mut rx) = memfd_ring(1024);
    for i in 0..5u32 {
        tx.reserve(4).unwrap().copy_from_slice(&i.to_le_bytes());
        tx.stage(i);
    }
    assert_eq!(tx.unpublished_len(), 5 * 16);
    assert_eq!(ring.shared.header().tail.load(Ordering::Relaxed), 0);
    assert!(rx.peek_batch(10).unwrap().is_empty());
    tx.publish();
    assert_eq!(ring.shared.header().tail.load(Ordering::Relaxed), 80);
    // Limit: two records, release them, the rest stays.
    let got = drain(&mut rx, 2);
    assert_eq!(got, vec![(0, 0u32.to_le_bytes().to_vec()), (1, 1u32.to_le_bytes().to_vec())]);
    assert_eq!(ring.shared.header().head.load(Ordering::Relaxed), 32);
    // A batch dropped without release leaves its records.
    {
        let mut batch = rx.peek_batch(10).unwrap();
        assert!(batch.next_record().unwrap().is_some());
    }
    assert_eq!(drain(&mut rx, 10).len(), 3);
}

#[test]
fn abandoned_reservation_is_dropped() {
    let (_ring, mut tx, mut rx) = memfd_ring(256);
    tx.reserve(50).unwrap().fill(1);
    tx.reserve(3).unwrap().copy_from_slice(b"abc");
    tx.commit(5);
    assert_eq!(drain(&mut rx, 10), vec![(5, b"abc".to_vec())]);
}

#[test]
#[should_panic(expected = "without a reservation")]
fn commit_without_reserve_panics() {
    let (_ring, mut tx, _rx) = memfd_ring(256);
    tx.commit(1);
}

/// Random operations on both sides against a `VecDeque` model, with a small ring so that
/// wrap-around, padding and full happen constantly.
#[test]
fn random_operations_match_a_model() {
    let (_ring, mut tx, mut rx) = memfd_ring(512);
    let mut model: VecDeque<(u32, Vec<u8>)> = VecDeque::new();
    let mut staged: Vec<(u32, Vec<u8>)> = Vec::new();
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut seq = 0u32;
    let mut full = 0;
    for _ in 0..50_000 {
        match next() % 4 {
            0 | 1 => {
                let len = (next() % 100) as usize;
                match tx.reserve(len) {
                    Ok(buf) => {
                        for (i, b) in buf.iter_mut().enumerate() {
                            *b = seq.wrapping_add(i as u32) as u8;
                        }
                        let payload = buf.to_vec();
                        if next() % 3 == 0 {
                            tx.stage(seq);
                            staged.push((seq, payload));
                        } else {
                            tx.commit(seq);
                            model.extend(staged.drain(..));
                            model.push_back((seq, payload));
                        }
                        seq += 1;
                    }
                    Err(ShmError::Full { .. }) => {
                        full += 1;
                        tx.publish();
                        model.extend(staged.drain(..));
                    }
                    Err(e) => panic!("{e:?}"),
                }
            }
            2 => {
                tx.publish();
                model.extend(staged.drain(..));
            }
            _ => {
                let limit = (next() % 6) as usize;
                for got in drain(&mut rx, limit) {
                    assert_eq!(Some(got), model.pop_front());
                }
            }
        }
    }
    tx.publish();
    model.extend(staged.drain(..));
    for got in drain(&mut rx, usize::MAX) {
        assert_eq!(Some(got), model.pop_front());
    }
    assert!(model.is_empty());
    assert!(full > 100, "the ring should have been full often ({full})");
}

#[test]
fn open_file_validates_the_header() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ring");
    let ring = ShmRing::create_file(&path, 4096).unwrap();
    assert_eq!(ShmRing::open_file(&path).unwrap().capacity(), 4096);
    assert!(matches!(ShmRing::create_file(&path, 4096), Err(ShmError::Io { op: "link", .. })));
    drop(ring);

    let patch = |off: usize, bytes: &[u8]| {
        let p = dir.path().join(format!("patched-{off}"));
        let mut raw = std::fs::read(&path).unwrap();
        raw[off..off + bytes.len()].copy_from_slice(bytes);
        std::fs::write(&p, raw).unwrap();
        ShmRing::open_file(&p)
    };
    assert!(matches!(patch(OFF_MAGIC, b"NOTARING"), Err(ShmError::BadMagic { .. })));
    assert!(matches!(
        patch(OFF_VERSION, &2u32.to_ne_bytes()),
        Err(ShmError::BadVersion { found: 2, supported: 1 })
    ));
    for bad in [0u64, 100, 32, 1 << 32, u64::MAX] {
        assert!(matches!(
            patch(OFF_CAPACITY, &bad.to_ne_bytes()),
            Err(ShmError::BadCapacity { capacity }) if capacity == bad
        ));
    }
    // A larger capacity than the file holds.
    assert!(matches!(
        patch(OFF_CAPACITY, &8192u64.to_ne_bytes()),
        Err(ShmError::Truncated { len, needed }) if len == 384 + 4096 && needed == 384 + 8192
    ));
    assert!(matches!(
        patch(OFF_DATA_OFFSET, &4096u64.to_ne_bytes()),
        Err(ShmError::BadLayout { data_offset: 4096 })
    ));
    // Impossible cursors are refused at attach.
    let r = patch(OFF_TAIL, &4104u64.to_ne_bytes()).unwrap();
    assert!(matches!(r.consumer(), Err(ShmError::Corrupt { .. })));
    assert!(matches!(r.producer(), Err(ShmError::Corrupt { .. })));
}

#[test]
fn truncated_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ring");
    drop(ShmRing::create_file(&path, 4096).unwrap());
    let f = OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(1000).unwrap();
    assert!(matches!(
        ShmRing::open_file(&path),
        Err(ShmError::Truncated { len: 1000, needed: 4480 })
    ));
    f.set_len(100).unwrap();
    assert!(matches!(ShmRing::open_file(&path), Err(ShmError::Truncated { len: 100, .. })));
    f.set_len(0).unwrap();
    assert!(matches!(ShmRing::open_file(&path), Err(ShmError::Truncated { len: 0, .. })));
}

#[test]
fn create_rejects_bad_capacity() {
    for cap in [0, 8, 63, 100, 4097, (MAX_CAPACITY * 2)] {
        assert!(matches!(ShmRing::create_memfd("x", cap), Err(ShmError::BadCapacity { .. })));
    }
}

#[test]
fn roles_are_claimed_once() {
    let ring = ShmRing::create_memfd("roles", 256).unwrap();
    let tx = ring.producer().unwrap();
    assert!(matches!(ring.producer(), Err(ShmError::RoleTaken { role: Role::Producer, .. })));
    let rx = ring.consumer().unwrap();
    assert!(matches!(ring.consumer(), Err(ShmError::RoleTaken { role: Role::Consumer, .. })));
    drop(tx);
    drop(rx);
    let _tx = ring.producer().unwrap();
    let _rx = ring.consumer().unwrap();
}

#[test]
fn memfd_is_sealed_and_reopens_by_fd() {
    let (ring, mut tx, _rx) = memfd_ring(4096);
    tx.try_push(3, b"over the fd").unwrap();
    let fd = ring.as_fd().try_clone_to_owned().unwrap();
    let file = File::from(fd.try_clone().unwrap());
    assert!(file.set_len(10).is_err(), "shrinking a sealed memfd must fail");
    let other = ShmRing::from_fd(fd).unwrap();
    drop(ring);
    drop(_rx);
    let mut rx = other.consumer().unwrap();
    assert_eq!(drain(&mut rx, 10), vec![(3, b"over the fd".to_vec())]);
}

#[test]
fn from_fd_refuses_an_unsealable_fd() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ring");
    drop(ShmRing::create_file(&path, 4096).unwrap());
    let fd = OwnedFd::from(File::options().read(true).write(true).open(&path).unwrap());
    assert!(matches!(ShmRing::from_fd(fd), Err(ShmError::Unsealed)));
}

#[test]
fn changed_header_is_a_sticky_corruption() {
    let (ring, mut tx, mut rx) = memfd_ring(256);
    tx.try_push(1, b"x").unwrap();
    ring.shared.header().capacity.store(512, Ordering::Relaxed);
    let err = rx.peek_batch(10).unwrap_err();
    assert!(matches!(err, ShmError::Corrupt { what: "header capacity changed", .. }), "{err}");
    ring.shared.header().capacity.store(256, Ordering::Relaxed);
    assert!(matches!(rx.peek_batch(10), Err(ShmError::Corrupt { .. })), "sticky");
    ring.shared.header().magic.store(0, Ordering::Relaxed);
    // The producer only looks at the header on its slow path (when it needs room).
    while tx.try_push(1, b"x").is_ok() {}
    assert!(matches!(
        tx.try_push(1, b"x"),
        Err(ShmError::Corrupt { what: "header magic changed", .. })
    ));
}

#[test]
fn blocking_calls_time_out() {
    let (_ring, mut tx, mut rx) = memfd_ring(256);
    let start = Instant::now();
    let deadline = Some(start + Duration::from_millis(30));
    assert!(matches!(rx.wait_batch(10, deadline), Err(ShmError::Timeout)));
    while tx.try_push(0, &[0; 24]).is_ok() {}
    assert!(matches!(tx.reserve_blocking(24, deadline), Err(ShmError::Timeout)));
    assert!(start.elapsed() >= Duration::from_millis(30));
}

#[test]
fn parked_sides_wake_each_other() {
    let (_ring, mut tx, mut rx) = memfd_ring(256);
    let park = WaitStrategy::SpinYieldPark { spins: 0, yields: 0 };
    tx.set_wait_strategy(park);
    rx.set_wait_strategy(park);
    const N: u32 = 20_000;
    let deadline = Some(Instant::now() + Duration::from_secs(30));
    let producer = std::thread::spawn(move || {
        for i in 0..N {
            let len = (i % 100) as usize;
            tx.push_blocking(i, &vec![i as u8; len], deadline).unwrap();
        }
    });
    let mut expect = 0u32;
    let mut buf = [0u8; 128];
    while expect < N {
        let mut batch = rx.wait_batch(7, deadline).unwrap();
        while let Some(r) = batch.next_record().unwrap() {
            assert_eq!(r.record_type(), expect);
            let n = r.copy_to(&mut buf);
            assert_eq!(n, (expect % 100) as usize);
            assert!(buf[..n].iter().all(|&b| b == expect as u8));
            expect += 1;
        }
        batch.release();
    }
    producer.join().unwrap();
}
