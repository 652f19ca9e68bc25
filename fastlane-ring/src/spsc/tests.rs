//! Unit tests of the in-process ring.

use super::*;
use std::sync::atomic::AtomicUsize as StdAtomicUsize;
use std::sync::Arc;
use std::time::Duration;

#[test]
fn settle_grows_on_batches_and_decays_on_single_items() {
    let mut settle = 0;
    let mut seen = Vec::new();
    for _ in 0..6 {
        settle = next_settle(settle, 5, 8);
        seen.push(settle);
    }
    assert_eq!(seen, [1, 3, 7, 8, 8, 8][..]);
    for expect in [4, 2, 1, 0, 0] {
        settle = next_settle(settle, 1, 8);
        assert_eq!(settle, expect);
    }
    assert_eq!(next_settle(u32::MAX, 2, 32), 32, "no overflow");
    assert_eq!(next_settle(0, 100, 0), 0, "a limit of 0 never settles");
    assert_eq!(next_settle(7, 100, 32), 15);
}

/// The producer's, the consumer's and the control line each start on their own 128-byte
/// boundary (two cache lines on x86), as with the ring's former hand-written padding.
#[test]
#[cfg(target_arch = "x86_64")]
fn header_lines_are_128_byte_padded() {
    assert_eq!(std::mem::align_of::<Header>(), 128);
    assert_eq!(std::mem::size_of::<CachePadded<ProducerLine>>(), 128);
    assert_eq!(std::mem::size_of::<CachePadded<ConsumerLine>>(), 128);
    assert_eq!(std::mem::size_of::<Header>(), 3 * 128);
}

/// The default limit is a number of pauses that fits the time budget on this CPU: between
/// 1 and the cap, the same on every call, and the fastest of 64 timings of that many pauses
/// is within a few budgets (a preempted calibration only makes the limit smaller).
#[test]
fn default_settle_limit_fits_the_budget() {
    let limit = default_settle_limit();
    assert!((1..=SETTLE_MAX_PAUSES).contains(&limit), "limit {limit}");
    assert_eq!(default_settle_limit(), limit, "cached");
    let (tx, rx) = channel::<u8>(4);
    assert_eq!((tx.settle_limit, rx.settle_limit), (limit, limit));
    let best = (0..64)
        .map(|_| {
            let start = Instant::now();
            settle_for(limit);
            start.elapsed()
        })
        .min()
        .expect("64 timings");
    assert!(
        best.as_nanos() <= u128::from(SETTLE_BUDGET_NANOS) * 4 + 1_000,
        "{limit} pauses took {best:?}"
    );
}

/// A consumer that waits and then finds a batch settles; one that finds a single item
/// stops settling. The same for a producer and freed slots. (The other thread sleeps
/// 50 ms before acting so that the waiting side is already waiting.)
#[test]
fn blocking_calls_settle_on_batches_only() {
    let pause = Duration::from_millis(50);
    let (mut tx, mut rx) = channel_with::<u64>(16, WaitStrategy::BusySpin);
    let producer = std::thread::spawn(move || {
        std::thread::sleep(pause);
        let chunk = tx.write_chunk_uninit(10).expect("room for ten");
        assert_eq!(chunk.fill_from_iter(0..10), 10);
        std::thread::sleep(pause);
        tx.push(10).expect("room");
        tx
    });
    assert_eq!(rx.pop_blocking(None).expect("an item"), 0);
    assert_eq!(rx.settle, 1, "found ten at once");
    for i in 1..10 {
        assert_eq!(rx.pop_blocking(None).expect("an item"), i);
    }
    assert_eq!(rx.settle, 1, "calls that did not wait leave it alone");
    assert_eq!(rx.pop_blocking(None).expect("an item"), 10);
    assert_eq!(rx.settle, 0, "found one alone");

    let mut tx = producer.join().expect("producer thread");
    for i in 0..16 {
        tx.push(i).expect("room");
    }
    let consumer = std::thread::spawn(move || {
        std::thread::sleep(pause);
        let chunk = rx.read_chunk(6).expect("six items");
        chunk.commit_all();
        std::thread::sleep(pause);
        rx.pop().expect("an item");
        rx
    });
    tx.push_blocking(16, None).expect("a slot frees");
    assert_eq!(tx.settle, 1, "six slots freed at once");
    for i in 17..22 {
        tx.push_blocking(i, None).expect("room");
    }
    assert_eq!(tx.settle, 1);
    tx.push_blocking(22, None).expect("a slot frees");
    assert_eq!(tx.settle, 0, "one slot freed");
    let mut rx = consumer.join().expect("consumer thread");

    // A limit of 0: the same batch leaves `settle` at 0.
    rx.set_settle_limit(0);
    while rx.pop().is_ok() {}
    let producer = std::thread::spawn(move || {
        std::thread::sleep(pause);
        let chunk = tx.write_chunk_uninit(10).expect("room for ten");
        assert_eq!(chunk.fill_from_iter(100..110), 10);
        tx
    });
    assert_eq!(rx.pop_blocking(None).expect("an item"), 100);
    assert_eq!(rx.settle, 0, "limit 0");
    drop(producer.join().expect("producer thread"));
}

/// The CPUID probe behind the chunk path's `prefetchw` agrees with the kernel's flag for the
/// same bit (`3dnowprefetch`), and asking twice gives the cached answer.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
#[test]
fn prefetchw_probe_matches_the_kernels_flag() {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap();
    let flags = info.lines().find(|l| l.starts_with("flags")).expect("a flags line");
    let kernel = flags.split_whitespace().any(|f| f == "3dnowprefetch");
    assert_eq!(has_prefetchw(), kernel);
    assert_eq!(has_prefetchw(), kernel);
}

/// Counts its drops in a shared counter; carries an id so tests can check order.
#[derive(Debug)]
struct Counted {
    id: u64,
    drops: Arc<StdAtomicUsize>,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.drops.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

fn counted(id: u64, drops: &Arc<StdAtomicUsize>) -> Counted {
    Counted { id, drops: drops.clone() }
}

fn drops_of(drops: &Arc<StdAtomicUsize>) -> usize {
    drops.load(std::sync::atomic::Ordering::SeqCst)
}

#[test]
fn capacity_is_rounded_up_to_a_power_of_two() {
    for (asked, got) in [(1, 1), (2, 2), (3, 4), (64, 64), (65, 128)] {
        let (tx, rx) = channel::<u8>(asked);
        assert_eq!((tx.capacity(), rx.capacity()), (got, got));
    }
}

#[test]
#[should_panic(expected = "at least one slot")]
fn zero_capacity_panics() {
    let _ = channel::<u8>(0);
}

#[test]
#[should_panic(expected = "capacity overflow")]
fn impossible_capacity_panics() {
    let _ = channel::<u64>(usize::MAX / 4);
}

#[test]
fn header_parts_do_not_share_lines() {
    assert_eq!(std::mem::align_of::<Header>(), 128);
    assert_eq!(std::mem::offset_of!(Header, prod), 0);
    assert_eq!(std::mem::offset_of!(Header, cons), 128);
    assert_eq!(std::mem::offset_of!(Header, ctl), 256);
    assert_eq!(layout_for::<u64>(4).1 % 128, 0, "slots start on their own line");
}

#[test]
fn full_and_empty() {
    let (mut tx, mut rx) = channel::<u32>(4);
    assert!(tx.is_empty() && rx.is_empty());
    assert_eq!(rx.pop(), Err(PopError::Empty));
    for i in 0..4 {
        tx.push(i).unwrap();
    }
    assert!(tx.is_full());
    assert_eq!((tx.len(), tx.slots(), rx.len(), rx.slots()), (4, 0, 4, 4));
    match tx.push(99) {
        Err(PushError::Full(v)) => assert_eq!(v, 99),
        other => panic!("expected Full(99), got {other:?}"),
    }
    assert_eq!(rx.peek(), Ok(&0));
    for i in 0..4 {
        assert_eq!(rx.pop(), Ok(i));
    }
    assert_eq!(rx.pop(), Err(PopError::Empty));
    assert_eq!(tx.slots(), 4);
    tx.push(4).unwrap();
    assert_eq!(rx.pop(), Ok(4));
}

#[test]
fn wraps_around_for_many_laps() {
    let (mut tx, mut rx) = channel::<u64>(4);
    let (mut next_in, mut next_out) = (0u64, 0u64);
    // Batches of 1, 2, 3 and 4 so every slot offset gets to be first, last and in between.
    for lap in 0..10_000u64 {
        let batch = lap % 4 + 1;
        for _ in 0..batch {
            tx.push(next_in).unwrap();
            next_in += 1;
        }
        for _ in 0..batch {
            assert_eq!(rx.pop(), Ok(next_out));
            next_out += 1;
        }
    }
    assert_eq!(next_out, 25_000);
    assert!(rx.is_empty());
}

#[test]
fn indices_wrap_past_usize_max() {
    let (mut tx, mut rx) = channel::<u64>(4);
    // Start both sides just before the indices overflow.
    let start = usize::MAX - 5;
    tx.tail = start;
    tx.head_cache = start;
    rx.head = start;
    rx.tail_cache = start;
    tx.header().prod.tail.store(start, Ordering::Relaxed);
    tx.header().cons.head.store(start, Ordering::Relaxed);
    for round in 0..5u64 {
        for i in 0..4 {
            tx.push(round * 4 + i).unwrap();
        }
        assert!(tx.push(0).is_err());
        assert_eq!(rx.len(), 4);
        for i in 0..4 {
            assert_eq!(rx.pop(), Ok(round * 4 + i));
        }
    }
    assert!(rx.tail_cache < start, "the indices did wrap");
}

#[test]
fn chunks_span_the_wrap() {
    let (mut tx, mut rx) = channel::<u32>(8);
    for i in 0..6 {
        tx.push(i).unwrap();
    }
    for i in 0..6 {
        assert_eq!(rx.pop(), Ok(i));
    }
    // head = tail = 6: a 5-slot chunk is slots 6, 7 then 0, 1, 2.
    let mut chunk = tx.write_chunk_uninit(5).unwrap();
    assert_eq!(chunk.len(), 5);
    let (a, b) = chunk.as_mut_slices();
    assert_eq!((a.len(), b.len()), (2, 3));
    for (slot, v) in a.iter_mut().chain(b.iter_mut()).zip(100..) {
        slot.write(v);
    }
    // SAFETY: all 5 slots were written just above.
    unsafe { chunk.commit_all() };

    assert_eq!(rx.read_chunk(6).unwrap_err(), ChunkError::TooFewSlots(5));
    let chunk = rx.read_chunk(5).unwrap();
    assert_eq!(chunk.as_slices(), (&[100, 101][..], &[102, 103, 104][..]));
    chunk.commit(3);
    assert_eq!(rx.len(), 2);
    let mut chunk = rx.read_chunk(2).unwrap();
    chunk.as_mut_slices().0[0] += 1000;
    assert_eq!(chunk.into_iter().collect::<Vec<_>>(), vec![1103, 104]);
    assert!(rx.is_empty());
    assert_eq!(tx.slots(), 8);
}

#[test]
fn write_chunk_reports_free_slots() {
    let (mut tx, mut rx) = channel::<u32>(4);
    tx.push(1).unwrap();
    assert_eq!(tx.write_chunk_uninit(4).unwrap_err(), ChunkError::TooFewSlots(3));
    assert_eq!(tx.write_chunk_uninit(0).unwrap().fill_from_iter(0..10), 0);
    assert_eq!(rx.pop(), Ok(1));
    assert_eq!(tx.write_chunk_uninit(4).unwrap().len(), 4);
}

#[test]
fn fill_from_iter_commits_only_what_it_wrote() {
    let (mut tx, mut rx) = channel::<u32>(8);
    assert_eq!(tx.write_chunk_uninit(5).unwrap().fill_from_iter([1, 2]), 2);
    assert_eq!(tx.write_chunk_uninit(2).unwrap().fill_from_iter(3..), 2);
    assert_eq!(rx.len(), 4);
    let got: Vec<u32> = rx.read_chunk(4).unwrap().into_iter().collect();
    assert_eq!(got, vec![1, 2, 3, 4]);
}

#[test]
fn uncommitted_chunks_publish_nothing() {
    let (mut tx, mut rx) = channel::<u32>(4);
    {
        let mut chunk = tx.write_chunk_uninit(2).unwrap();
        chunk.as_mut_slices().0[0].write(5);
        // Goes out of scope without a commit.
    }
    assert!(rx.is_empty());
    tx.push(6).unwrap();
    {
        let chunk = rx.read_chunk(1).unwrap();
        assert_eq!(chunk.as_slices().0, &[6]);
        // Goes out of scope without a commit.
    }
    assert_eq!(rx.pop(), Ok(6));
}

#[test]
fn partial_iteration_leaves_the_rest() {
    let (mut tx, mut rx) = channel::<u32>(4);
    for i in 0..4 {
        tx.push(i).unwrap();
    }
    let mut it = rx.read_chunk(3).unwrap().into_iter();
    assert_eq!(it.len(), 3);
    assert_eq!(it.next(), Some(0));
    assert_eq!(it.next(), Some(1));
    drop(it);
    assert_eq!(tx.slots(), 2);
    assert_eq!(rx.pop(), Ok(2));
    assert_eq!(rx.pop(), Ok(3));
}

#[test]
fn abandoned_consumer() {
    let (mut tx, rx) = channel_with::<u32>(2, WaitStrategy::SpinYieldPark { spins: 0, yields: 0 });
    assert!(!tx.is_abandoned());
    drop(rx);
    assert!(tx.is_abandoned());
    // Room left: pushes still succeed (the items are dropped with the ring).
    tx.push(1).unwrap();
    tx.push_blocking(2, None).unwrap();
    assert_eq!(tx.push(3), Err(PushError::Full(3)));
    assert_eq!(tx.push_blocking(4, None), Err(PushError::Abandoned(4)));
}

#[test]
fn abandoned_producer() {
    let (mut tx, mut rx) = channel::<u32>(4);
    tx.push(1).unwrap();
    assert!(!rx.is_abandoned());
    drop(tx);
    assert!(rx.is_abandoned());
    assert_eq!(rx.pop_blocking(None), Ok(1));
    assert_eq!(rx.pop(), Err(PopError::Empty));
    assert_eq!(rx.pop_blocking(None), Err(PopError::Abandoned));
}

#[test]
fn dropping_a_side_wakes_a_parked_peer() {
    let strategy = WaitStrategy::SpinYieldPark { spins: 0, yields: 0 };
    let (tx, mut rx) = channel_with::<u32>(2, strategy);
    let t = std::thread::spawn(move || rx.pop_blocking(None));
    std::thread::sleep(Duration::from_millis(30));
    drop(tx);
    assert_eq!(t.join().unwrap(), Err(PopError::Abandoned));

    let (mut tx, rx) = channel_with::<u32>(1, strategy);
    tx.push(1).unwrap();
    let t = std::thread::spawn(move || tx.push_blocking(2, None));
    std::thread::sleep(Duration::from_millis(30));
    drop(rx);
    assert_eq!(t.join().unwrap(), Err(PushError::Abandoned(2)));
}

#[test]
fn blocking_variants_time_out() {
    let (mut tx, mut rx) = channel::<u32>(1);
    let start = Instant::now();
    assert_eq!(rx.pop_blocking(Some(start + Duration::from_millis(20))), Err(PopError::Empty));
    tx.push(1).unwrap();
    let deadline = Some(Instant::now() + Duration::from_millis(20));
    assert_eq!(tx.push_blocking(2, deadline), Err(PushError::Full(2)));
    assert!(start.elapsed() >= Duration::from_millis(40));
    assert_eq!(rx.pop_blocking(None), Ok(1));
}

#[test]
fn blocking_variants_wake_each_other() {
    let strategy = WaitStrategy::SpinYieldPark { spins: 0, yields: 0 };
    let (mut tx, mut rx) = channel_with::<u64>(2, strategy);
    let t = std::thread::spawn(move || {
        for i in 0..10_000 {
            tx.push_blocking(i, None).unwrap();
        }
    });
    for i in 0..10_000 {
        assert_eq!(rx.pop_blocking(None), Ok(i));
    }
    t.join().unwrap();
}

#[test]
fn leftovers_are_dropped_once_whichever_side_goes_last() {
    for producer_last in [false, true] {
        let drops = Arc::new(StdAtomicUsize::new(0));
        let (mut tx, mut rx) = channel::<Counted>(8);
        for i in 0..6 {
            tx.push(counted(i, &drops)).unwrap();
        }
        let first = rx.pop().unwrap();
        assert_eq!(first.id, 0);
        drop(first);
        rx.read_chunk(2).unwrap().commit(1);
        assert_eq!(drops_of(&drops), 2);
        if producer_last {
            drop(rx);
            assert_eq!(drops_of(&drops), 2, "nothing is dropped while a side lives");
            drop(tx);
        } else {
            drop(tx);
            assert_eq!(drops_of(&drops), 2);
            drop(rx);
        }
        assert_eq!(drops_of(&drops), 6);
    }
}

#[test]
fn leftovers_across_the_wrap_are_dropped_once() {
    let drops = Arc::new(StdAtomicUsize::new(0));
    let (mut tx, mut rx) = channel::<Counted>(4);
    for i in 0..3 {
        tx.push(counted(i, &drops)).unwrap();
    }
    for _ in 0..3 {
        drop(rx.pop().unwrap());
    }
    // Items in slots 3, 0 and 1.
    assert_eq!(
        tx.write_chunk_uninit(3).unwrap().fill_from_iter((3..6).map(|i| counted(i, &drops))),
        3
    );
    drop((tx, rx));
    assert_eq!(drops_of(&drops), 6);
}

#[test]
fn forgotten_iterator_does_not_double_drop() {
    let drops = Arc::new(StdAtomicUsize::new(0));
    let (mut tx, mut rx) = channel::<Counted>(4);
    for i in 0..4 {
        tx.push(counted(i, &drops)).unwrap();
    }
    let mut it = rx.read_chunk(2).unwrap().into_iter();
    let taken = it.next().unwrap();
    std::mem::forget(it);
    assert_eq!(rx.pop().unwrap().id, 1);
    drop(taken);
    assert_eq!(drops_of(&drops), 2);
    let mut it = rx.read_chunk(1).unwrap().into_iter();
    drop(it.next());
    std::mem::forget(it);
    drop((rx, tx));
    assert_eq!(drops_of(&drops), 4);
}

#[test]
fn zero_sized_types_are_counted() {
    let (mut tx, mut rx) = channel::<()>(3);
    assert_eq!(tx.capacity(), 4);
    for _ in 0..4 {
        tx.push(()).unwrap();
    }
    assert_eq!(tx.push(()), Err(PushError::Full(())));
    assert_eq!(rx.read_chunk(4).unwrap().as_slices().0.len() + rx.len(), 8);
    rx.read_chunk(3).unwrap().commit_all();
    assert_eq!(rx.pop(), Ok(()));
    assert_eq!(rx.pop(), Err(PopError::Empty));
}

#[test]
fn zero_sized_drops_are_counted() {
    static DROPS: StdAtomicUsize = StdAtomicUsize::new(0);
    struct Zst;
    impl Drop for Zst {
        fn drop(&mut self) {
            DROPS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
    let (mut tx, rx) = channel::<Zst>(4);
    for _ in 0..3 {
        assert!(tx.push(Zst).is_ok());
    }
    drop((tx, rx));
    assert_eq!(DROPS.load(std::sync::atomic::Ordering::SeqCst), 3);
}

#[test]
fn sides_are_send() {
    fn is_send<S: Send>() {}
    is_send::<Producer<Vec<u8>>>();
    is_send::<Consumer<Vec<u8>>>();
}
