//! Two threads move sequence numbers through a small typed ring and check that every one arrives
//! once and in order, with single, chunked and blocking operations.
//!
//! 10 million items per test in release builds, 1 million in debug builds. Every wait is
//! bounded: a test that stops making progress for `STALL` fails instead of hanging.
#![cfg(not(loom))]

use std::thread;
use std::time::{Duration, Instant};

use fastlane_ring::spsc::{channel_with, ChunkError, Consumer, PopError, Producer};
use fastlane_ring::WaitStrategy;

const CAPACITY: usize = 64;
const ITEMS: u64 = if cfg!(debug_assertions) { 1_000_000 } else { 10_000_000 };
/// A whole test taking longer than this fails.
const LIMIT: Duration = Duration::from_secs(300);
/// No progress for this long fails the test.
const STALL: Duration = Duration::from_secs(30);

/// Counts failed attempts and fails the test if they go on for longer than `STALL`; yields to
/// the other thread now and then, since these machines have two shared cores.
struct Backoff {
    failures: u32,
    since: Option<Instant>,
    what: &'static str,
}

impl Backoff {
    fn new(what: &'static str) -> Self {
        Backoff { failures: 0, since: None, what }
    }

    fn progress(&mut self) {
        self.failures = 0;
        self.since = None;
    }

    fn fail(&mut self) {
        self.failures += 1;
        if self.failures.is_multiple_of(64) {
            thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
        if self.failures.is_multiple_of(4096) {
            let since = *self.since.get_or_insert_with(Instant::now);
            assert!(since.elapsed() < STALL, "{}: no progress for {STALL:?}", self.what);
        }
    }
}

/// Runs `produce` and `consume` on two threads and fails if they take longer than `LIMIT`.
fn run<T: Send + 'static>(
    strategy: WaitStrategy,
    produce: impl FnOnce(Producer<T>) + Send + 'static,
    consume: impl FnOnce(Consumer<T>),
) {
    let (tx, rx) = channel_with::<T>(CAPACITY, strategy);
    let start = Instant::now();
    let producer = thread::spawn(move || produce(tx));
    consume(rx);
    producer.join().expect("producer panicked");
    let elapsed = start.elapsed();
    assert!(elapsed < LIMIT, "took {elapsed:?}, limit {LIMIT:?}");
    eprintln!("{strategy:?}: {elapsed:?}");
}

fn deadline() -> Option<Instant> {
    Some(Instant::now() + STALL)
}

#[test]
fn single_ops() {
    run::<u64>(
        WaitStrategy::BusySpin,
        |mut tx| {
            let mut backoff = Backoff::new("producer");
            for mut i in 0..ITEMS {
                while let Err(e) = tx.push(i) {
                    i = e.into_inner();
                    backoff.fail();
                }
                backoff.progress();
            }
        },
        |mut rx| {
            let mut backoff = Backoff::new("consumer");
            let mut next = 0;
            while next < ITEMS {
                match rx.pop() {
                    Ok(v) => {
                        assert_eq!(v, next);
                        next += 1;
                        backoff.progress();
                    }
                    Err(PopError::Empty) => backoff.fail(),
                    Err(e) => panic!("{e}"),
                }
            }
            assert_eq!(rx.pop(), Err(PopError::Empty));
        },
    );
}

#[test]
fn chunked_ops() {
    run::<u64>(
        WaitStrategy::BusySpin,
        |mut tx| {
            let mut backoff = Backoff::new("producer");
            let mut next = 0u64;
            let mut round = 0usize;
            while next < ITEMS {
                // Chunk sizes 1..=CAPACITY, cut down to what is free.
                round += 1;
                let want = (round % CAPACITY + 1).min((ITEMS - next) as usize);
                let chunk = match tx.write_chunk_uninit(want) {
                    Ok(chunk) => chunk,
                    Err(ChunkError::TooFewSlots(0)) => {
                        backoff.fail();
                        continue;
                    }
                    Err(ChunkError::TooFewSlots(free)) => tx.write_chunk_uninit(free).unwrap(),
                };
                next += chunk.fill_from_iter(next..ITEMS) as u64;
                backoff.progress();
            }
        },
        |mut rx| {
            let mut backoff = Backoff::new("consumer");
            let mut next = 0u64;
            let mut round = 0usize;
            while next < ITEMS {
                round += 1;
                let want = (round * 7 % CAPACITY + 1).min((ITEMS - next) as usize);
                let chunk = match rx.read_chunk(want) {
                    Ok(chunk) => chunk,
                    Err(ChunkError::TooFewSlots(0)) => {
                        backoff.fail();
                        continue;
                    }
                    Err(ChunkError::TooFewSlots(n)) => rx.read_chunk(n).unwrap(),
                };
                backoff.progress();
                if round.is_multiple_of(2) {
                    // Look in place, then drop them.
                    let (a, b) = chunk.as_slices();
                    for (v, expected) in a.iter().chain(b).zip(next..) {
                        assert_eq!(*v, expected);
                    }
                    next += chunk.len() as u64;
                    chunk.commit_all();
                } else {
                    // Move them out.
                    for v in chunk {
                        assert_eq!(v, next);
                        next += 1;
                    }
                }
            }
            assert!(rx.is_empty());
        },
    );
}

#[test]
fn blocking_ops() {
    run::<u64>(
        WaitStrategy::SpinYieldPark { spins: 64, yields: 32 },
        |mut tx| {
            for i in 0..ITEMS {
                tx.push_blocking(i, deadline()).expect("push stalled");
            }
        },
        |mut rx| {
            for i in 0..ITEMS {
                assert_eq!(rx.pop_blocking(deadline()), Ok(i));
            }
            assert_eq!(rx.pop_blocking(deadline()), Err(PopError::Abandoned));
        },
    );
}

/// The default strategy spins 4096 times before it yields: on these shared two-core machines
/// that costs about 20x the short spin above (37 s against 1.5 s for 10 million items, measured
/// with the machine loaded by other builds), so this one moves fewer items.
#[test]
fn blocking_ops_with_the_default_strategy() {
    let items = ITEMS / 10;
    run::<u64>(
        WaitStrategy::default(),
        move |mut tx| {
            for i in 0..items {
                tx.push_blocking(i, deadline()).expect("push stalled");
            }
        },
        move |mut rx| {
            for i in 0..items {
                assert_eq!(rx.pop_blocking(deadline()), Ok(i));
            }
            assert_eq!(rx.pop_blocking(deadline()), Err(PopError::Abandoned));
        },
    );
}

/// Parks on every wait, so nearly every hand-over goes through the futex handshake. Fewer
/// items: each one may cost two syscalls.
#[test]
fn blocking_ops_that_always_park() {
    let items = ITEMS / 20;
    run::<u64>(
        WaitStrategy::SpinYieldPark { spins: 0, yields: 0 },
        move |mut tx| {
            for i in 0..items {
                tx.push_blocking(i, deadline()).expect("push stalled");
            }
        },
        move |mut rx| {
            for i in 0..items {
                assert_eq!(rx.pop_blocking(deadline()), Ok(i));
            }
            assert_eq!(rx.pop_blocking(deadline()), Err(PopError::Abandoned));
        },
    );
}

/// Chunked writes against blocking single reads, with heap-allocated items so that a slot read
/// twice or overwritten early shows up as a double free or a wrong value.
#[test]
fn chunks_against_blocking_pops_of_boxes() {
    let items = ITEMS / 4;
    run::<Box<u64>>(
        WaitStrategy::SpinYieldPark { spins: 256, yields: 4 },
        move |mut tx| {
            let mut backoff = Backoff::new("producer");
            let mut next = 0u64;
            while next < items {
                let free = tx.slots().min((items - next) as usize).min(13);
                if free == 0 {
                    backoff.fail();
                    continue;
                }
                let chunk = tx.write_chunk_uninit(free).unwrap();
                next += chunk.fill_from_iter((next..items).map(Box::new)) as u64;
                backoff.progress();
            }
        },
        move |mut rx| {
            for i in 0..items {
                assert_eq!(*rx.pop_blocking(deadline()).unwrap(), i);
            }
            assert_eq!(rx.pop_blocking(deadline()), Err(PopError::Abandoned));
        },
    );
}
