//! fastlane-ring against its peers, in one run: `rtrb`, `crossbeam_queue::ArrayQueue`,
//! `std::sync::mpsc::sync_channel`, and a bare atomic ping-pong as the physical floor.
//!
//! ```text
//! cargo bench --bench ring                  # all groups (about 3 minutes)
//! python3 scripts/bench-report.py ring      # the ratio table for BENCHMARKS.md
//! ```
//!
//! Groups (criterion ids `group/peer`):
//! - `tput_u64_single`, `tput_rec64_single`: one item per push/pop, 8-byte items and 64-byte
//!   records, producer and consumer on two threads (pinned to cores 0 and 1 when there are two).
//!   Throughput in items per second.
//! - `tput_u64_batch`, `tput_rec64_batch`: chunks of 64 through the zero-copy batch API (only
//!   the rings that have one).
//! - `pingpong_u64`: a round trip through two rings; criterion reports the round trip, one-way
//!   latency is half of it. `atomic` is two threads bouncing one `AtomicU64`: no ring can beat
//!   it.
//!
//! fastlane's channels use `WaitStrategy::BusySpin`, like the peers, which cannot park.
//!
//! Every spin loop here is bounded by the number of items criterion asked for.

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

const CAPACITY: usize = 4096;
/// Every peer here spins (none of them can put a waiter to sleep), so fastlane's channels are
/// made with `BusySpin` too: no wake-up bookkeeping on push/pop. `fastlane bench ring` also
/// measures the default (parking) strategy.
const SPIN: fastlane::ring::WaitStrategy = fastlane::ring::WaitStrategy::BusySpin;
const BATCH: usize = 64;

/// A 64-byte record, as a trading process would append.
#[derive(Clone, Copy, Default)]
#[repr(C, align(8))]
struct Rec64([u64; 8]);

impl Rec64 {
    fn new(i: u64) -> Self {
        Rec64([i; 8])
    }
}

trait Item: Copy + Send + 'static {
    fn make(i: u64) -> Self;
    fn seq(&self) -> u64;
}

impl Item for u64 {
    fn make(i: u64) -> Self {
        i
    }
    fn seq(&self) -> u64 {
        *self
    }
}

impl Item for Rec64 {
    fn make(i: u64) -> Self {
        Rec64::new(i)
    }
    fn seq(&self) -> u64 {
        self.0[7]
    }
}

/// Pins the calling thread to one of the process's first two CPUs. The CPU list is read once,
/// before any pinning: `core_affinity::get_core_ids` reads the calling thread's mask, which a
/// pinned thread (and every thread it spawns) has narrowed to one CPU.
fn pin(core: usize) {
    static CORES: std::sync::OnceLock<Vec<core_affinity::CoreId>> = std::sync::OnceLock::new();
    let ids = CORES.get_or_init(|| core_affinity::get_core_ids().unwrap_or_default());
    if ids.len() >= 2 {
        core_affinity::set_for_current(ids[core % ids.len()]);
    }
}

/// Runs `produce` on a second thread (core 0) and `consume` here (core 1), started together;
/// returns the time the consumer took to receive everything.
fn run_pair<P, C>(produce: P, consume: C) -> Duration
where
    P: FnOnce() + Send + 'static,
    C: FnOnce(),
{
    let barrier = Arc::new(Barrier::new(2));
    let b2 = barrier.clone();
    let t = thread::spawn(move || {
        pin(0);
        b2.wait();
        produce();
    });
    pin(1);
    barrier.wait();
    let start = Instant::now();
    consume();
    let elapsed = start.elapsed();
    t.join().expect("producer thread panicked");
    elapsed
}

fn tput_single<T: Item>(c: &mut Criterion, name: &str) {
    let mut g = c.benchmark_group(name);
    g.throughput(Throughput::Elements(1));
    g.measurement_time(Duration::from_secs(3));
    g.warm_up_time(Duration::from_millis(500));

    g.bench_function(BenchmarkId::from_parameter("fastlane"), |b| {
        b.iter_custom(|n| {
            let (mut tx, mut rx) = fastlane::ring::spsc::channel_with::<T>(CAPACITY, SPIN);
            run_pair(
                move || {
                    for i in 0..n {
                        let mut v = T::make(i);
                        while let Err(e) = tx.push(v) {
                            v = e.into_inner();
                            std::hint::spin_loop();
                        }
                    }
                },
                || {
                    for i in 0..n {
                        loop {
                            if let Ok(v) = rx.pop() {
                                debug_assert_eq!(v.seq(), i);
                                black_box(v);
                                break;
                            }
                            std::hint::spin_loop();
                        }
                    }
                },
            )
        })
    });

    g.bench_function(BenchmarkId::from_parameter("rtrb"), |b| {
        b.iter_custom(|n| {
            let (mut tx, mut rx) = rtrb::RingBuffer::<T>::new(CAPACITY);
            run_pair(
                move || {
                    for i in 0..n {
                        let mut v = T::make(i);
                        while let Err(rtrb::PushError::Full(back)) = tx.push(v) {
                            v = back;
                            std::hint::spin_loop();
                        }
                    }
                },
                || {
                    for i in 0..n {
                        loop {
                            if let Ok(v) = rx.pop() {
                                debug_assert_eq!(v.seq(), i);
                                black_box(v);
                                break;
                            }
                            std::hint::spin_loop();
                        }
                    }
                },
            )
        })
    });

    g.bench_function(BenchmarkId::from_parameter("crossbeam"), |b| {
        b.iter_custom(|n| {
            let q = Arc::new(crossbeam_queue::ArrayQueue::<T>::new(CAPACITY));
            let q2 = q.clone();
            run_pair(
                move || {
                    for i in 0..n {
                        let mut v = T::make(i);
                        while let Err(back) = q2.push(v) {
                            v = back;
                            std::hint::spin_loop();
                        }
                    }
                },
                || {
                    for i in 0..n {
                        loop {
                            if let Some(v) = q.pop() {
                                debug_assert_eq!(v.seq(), i);
                                black_box(v);
                                break;
                            }
                            std::hint::spin_loop();
                        }
                    }
                },
            )
        })
    });

    g.bench_function(BenchmarkId::from_parameter("std_sync_channel"), |b| {
        b.iter_custom(|n| {
            let (tx, rx) = mpsc::sync_channel::<T>(CAPACITY);
            run_pair(
                move || {
                    for i in 0..n {
                        tx.send(T::make(i)).expect("receiver alive");
                    }
                },
                || {
                    for i in 0..n {
                        let v = rx.recv().expect("sender alive");
                        debug_assert_eq!(v.seq(), i);
                        black_box(v);
                    }
                },
            )
        })
    });
    g.finish();
}

fn tput_batch<T: Item>(c: &mut Criterion, name: &str) {
    let mut g = c.benchmark_group(name);
    g.throughput(Throughput::Elements(1));
    g.measurement_time(Duration::from_secs(3));
    g.warm_up_time(Duration::from_millis(500));

    g.bench_function(BenchmarkId::from_parameter("fastlane"), |b| {
        b.iter_custom(|n| {
            let n = n.div_ceil(BATCH as u64) * BATCH as u64;
            let (mut tx, mut rx) = fastlane::ring::spsc::channel_with::<T>(CAPACITY, SPIN);
            run_pair(
                move || {
                    let mut i = 0;
                    while i < n {
                        match tx.write_chunk_uninit(BATCH) {
                            Ok(chunk) => {
                                chunk.fill_from_iter((i..i + BATCH as u64).map(T::make));
                                i += BATCH as u64;
                            }
                            Err(_) => std::hint::spin_loop(),
                        }
                    }
                },
                || {
                    let mut i = 0;
                    while i < n {
                        match rx.read_chunk(BATCH) {
                            Ok(chunk) => {
                                let (a, b) = chunk.as_slices();
                                debug_assert_eq!(a[0].seq(), i);
                                black_box((a, b));
                                chunk.commit_all();
                                i += BATCH as u64;
                            }
                            Err(_) => std::hint::spin_loop(),
                        }
                    }
                },
            )
        })
    });

    g.bench_function(BenchmarkId::from_parameter("rtrb"), |b| {
        b.iter_custom(|n| {
            let n = n.div_ceil(BATCH as u64) * BATCH as u64;
            let (mut tx, mut rx) = rtrb::RingBuffer::<T>::new(CAPACITY);
            run_pair(
                move || {
                    let mut i = 0;
                    while i < n {
                        match tx.write_chunk_uninit(BATCH) {
                            Ok(chunk) => {
                                chunk.fill_from_iter((i..i + BATCH as u64).map(T::make));
                                i += BATCH as u64;
                            }
                            Err(_) => std::hint::spin_loop(),
                        }
                    }
                },
                || {
                    let mut i = 0;
                    while i < n {
                        match rx.read_chunk(BATCH) {
                            Ok(chunk) => {
                                let (a, b) = chunk.as_slices();
                                debug_assert_eq!(a[0].seq(), i);
                                black_box((a, b));
                                chunk.commit_all();
                                i += BATCH as u64;
                            }
                            Err(_) => std::hint::spin_loop(),
                        }
                    }
                },
            )
        })
    });
    g.finish();
}

fn pingpong(c: &mut Criterion) {
    let mut g = c.benchmark_group("pingpong_u64");
    g.measurement_time(Duration::from_secs(3));
    g.warm_up_time(Duration::from_millis(500));

    g.bench_function(BenchmarkId::from_parameter("atomic"), |b| {
        b.iter_custom(|n| {
            // Even values: the ball is with the echo thread; odd: with us.
            let ball = Arc::new(AtomicU64::new(1));
            let b2 = ball.clone();
            run_pair(
                move || {
                    for i in 0..n {
                        while b2.load(Ordering::Acquire) != 2 * i + 2 {
                            std::hint::spin_loop();
                        }
                        b2.store(2 * i + 3, Ordering::Release);
                    }
                },
                || {
                    for i in 0..n {
                        ball.store(2 * i + 2, Ordering::Release);
                        while ball.load(Ordering::Acquire) != 2 * i + 3 {
                            std::hint::spin_loop();
                        }
                    }
                },
            )
        })
    });

    g.bench_function(BenchmarkId::from_parameter("fastlane"), |b| {
        b.iter_custom(|n| {
            let (mut ping_tx, mut ping_rx) = fastlane::ring::spsc::channel_with::<u64>(64, SPIN);
            let (mut pong_tx, mut pong_rx) = fastlane::ring::spsc::channel_with::<u64>(64, SPIN);
            run_pair(
                move || {
                    for _ in 0..n {
                        let v = loop {
                            if let Ok(v) = ping_rx.pop() {
                                break v;
                            }
                            std::hint::spin_loop();
                        };
                        while pong_tx.push(v).is_err() {
                            std::hint::spin_loop();
                        }
                    }
                },
                || {
                    for i in 0..n {
                        while ping_tx.push(i).is_err() {
                            std::hint::spin_loop();
                        }
                        loop {
                            if let Ok(v) = pong_rx.pop() {
                                debug_assert_eq!(v, i);
                                break;
                            }
                            std::hint::spin_loop();
                        }
                    }
                },
            )
        })
    });

    g.bench_function(BenchmarkId::from_parameter("rtrb"), |b| {
        b.iter_custom(|n| {
            let (mut ping_tx, mut ping_rx) = rtrb::RingBuffer::<u64>::new(64);
            let (mut pong_tx, mut pong_rx) = rtrb::RingBuffer::<u64>::new(64);
            run_pair(
                move || {
                    for _ in 0..n {
                        let v = loop {
                            if let Ok(v) = ping_rx.pop() {
                                break v;
                            }
                            std::hint::spin_loop();
                        };
                        while pong_tx.push(v).is_err() {
                            std::hint::spin_loop();
                        }
                    }
                },
                || {
                    for i in 0..n {
                        while ping_tx.push(i).is_err() {
                            std::hint::spin_loop();
                        }
                        loop {
                            if let Ok(v) = pong_rx.pop() {
                                debug_assert_eq!(v, i);
                                break;
                            }
                            std::hint::spin_loop();
                        }
                    }
                },
            )
        })
    });

    g.bench_function(BenchmarkId::from_parameter("crossbeam"), |b| {
        b.iter_custom(|n| {
            let ping = Arc::new(crossbeam_queue::ArrayQueue::<u64>::new(64));
            let pong = Arc::new(crossbeam_queue::ArrayQueue::<u64>::new(64));
            let (ping2, pong2) = (ping.clone(), pong.clone());
            run_pair(
                move || {
                    for _ in 0..n {
                        let v = loop {
                            if let Some(v) = ping2.pop() {
                                break v;
                            }
                            std::hint::spin_loop();
                        };
                        while pong2.push(v).is_err() {
                            std::hint::spin_loop();
                        }
                    }
                },
                || {
                    for i in 0..n {
                        while ping.push(i).is_err() {
                            std::hint::spin_loop();
                        }
                        loop {
                            if let Some(v) = pong.pop() {
                                debug_assert_eq!(v, i);
                                break;
                            }
                            std::hint::spin_loop();
                        }
                    }
                },
            )
        })
    });

    g.bench_function(BenchmarkId::from_parameter("std_sync_channel"), |b| {
        b.iter_custom(|n| {
            let (ping_tx, ping_rx) = mpsc::sync_channel::<u64>(64);
            let (pong_tx, pong_rx) = mpsc::sync_channel::<u64>(64);
            run_pair(
                move || {
                    for _ in 0..n {
                        let v = ping_rx.recv().expect("pinger alive");
                        pong_tx.send(v).expect("pinger alive");
                    }
                },
                || {
                    for i in 0..n {
                        ping_tx.send(i).expect("echo alive");
                        let v = pong_rx.recv().expect("echo alive");
                        debug_assert_eq!(v, i);
                    }
                },
            )
        })
    });
    g.finish();
}

fn benches(c: &mut Criterion) {
    tput_single::<u64>(c, "tput_u64_single");
    tput_single::<Rec64>(c, "tput_rec64_single");
    tput_batch::<u64>(c, "tput_u64_batch");
    tput_batch::<Rec64>(c, "tput_rec64_batch");
    pingpong(c);
}

criterion_group!(ring, benches);
criterion_main!(ring);
