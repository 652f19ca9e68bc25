//! fastlane-ring against its peers, in one run: `rtrb`, `crossbeam_queue::ArrayQueue`,
//! `std::sync::mpsc::sync_channel`, and a bare atomic ping-pong as the physical floor.
//!
//! ```text
//! cargo bench --bench ring                           # criterion, all groups (about 3 minutes)
//! python3 scripts/bench-report.py ring               # its ratio table for BENCHMARKS.md
//! RING_BENCH_INTERLEAVED=30 cargo bench --bench ring # 30 rounds, every peer once per round
//! ```
//!
//! Groups (criterion ids `group/peer`):
//! - `tput_u64_single`, `tput_rec64_single`: one item per push/pop, 8-byte items and 64-byte
//!   records, producer and consumer on two threads (pinned to cores 0 and 1 when there are two).
//!   Throughput in items per second.
//! - `tput_u64_batch`, `tput_rec64_batch`: chunks of 64 through the zero-copy batch API (only
//!   the rings that have one).
//! - `one_thread_u64`: push a full ring then pop it, on one thread: the push/pop code alone.
//! - `bare` in the throughput groups: the same algorithm with no API around it (module
//!   [`bare`]), the floor of this design on this machine, as `atomic` is for the ping-pong;
//!   `bare_x16` in the chunk groups: the bare ring moving chunks 16 times larger (1024 items),
//!   so that its index traffic is amortised sixteen times further: what is left is moving the
//!   data's cache lines from one core to the other, which no SPSC design over a shared buffer
//!   avoids, so no ring's chunks can be faster than this by more than the noise;
//!   `bare_trait` in the one-at-a-time groups: the same ring through the `Ring` trait and
//!   harness the rings under test use.
//! - `fastlane_escaped`, `rtrb_escaped` in the ping-pong: the echo thread's handles escaped to
//!   the optimiser (see [`pingpong_escaped`]).
//! - `pingpong_u64`: a round trip through two rings; criterion reports the round trip, one-way
//!   latency is half of it. `atomic` is two threads bouncing one `AtomicU64`: no ring can beat
//!   it.
//!
//! Every consumer reads every item it receives (it sums their sequence numbers and checks the
//! sum at the end), as a real consumer would: a benchmark whose consumer never touches the data
//! measures how fast a producer can write its own cache, not a hand-over. A 64-byte record's
//! "sequence number" reads all eight of its words (and a torn record spoils the sum). The
//! popped value is not passed through `black_box`: that spilled each record to a stack slot
//! whose place depended on the build, and in one build, for fastlane only, the slot was not
//! even 8-byte aligned, so every record was stored across two cache lines and read back.
//!
//! Interleaved mode: criterion measures one peer for seconds, then the next, and on this shared
//! 2-core VM the machine changes between them (the same case moves 2-5x from one minute to the
//! next). `RING_BENCH_INTERLEAVED=R` instead runs R rounds of every group, each round running
//! every peer once on the same number of items (in a shuffled order, each timed run right after
//! an untimed 1/20 of it), and prints per peer the best and the median
//! time per item and the median of the per-round ratios to the reference peer (rtrb for
//! throughput, the atomic floor for the ping-pong): ratios of neighbours in time, which is what
//! a drifting machine still allows. `RING_BENCH_JSON=FILE` also writes them as JSON;
//! `RING_BENCH_VERBOSE=1` prints every timed run.
//!
//! fastlane's channels use `WaitStrategy::BusySpin`, like the peers, which cannot park.
//! `fastlane` is driven through `push`/`pop` in the same spin loop the harness gives rtrb and
//! the bare ring (one `spin_loop` hint per failed try): ring against ring. In the
//! one-at-a-time groups and the ping-pong, three more cases wait with fastlane's own blocking
//! calls, which pace their looks at the other side's index (spsc module docs, "Settling"), the
//! way std's channel waits in `send`/`recv`: `fastlane_wait` on both sides
//! (`push_blocking`/`pop_blocking`), `fastlane_popwait` on the consumer's side only (the
//! producer spins on `push` as in `fastlane`), and `fastlane_popwait8`, `fastlane_popwait16`
//! the same with a settle limit of 8 or 16 pauses instead of the default
//! (`spsc::default_settle_limit()`: 1 µs worth of pauses, at most 32; 32 on the VM these
//! numbers come from; the benchmark prints it).
//!
//! Every spin loop here is bounded by the number of items it was asked to move.

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use fastlane::bench::stats::median;

const CAPACITY: usize = 4096;
/// Every peer here spins (none of them can put a waiter to sleep), so fastlane's channels are
/// made with `BusySpin` too: no wake-up bookkeeping on push/pop. `fastlane bench ring` also
/// measures the default (parking) strategy.
const SPIN: fastlane::ring::WaitStrategy = fastlane::ring::WaitStrategy::BusySpin;
const BATCH: usize = 64;
const PINGPONG_CAPACITY: usize = 64;

/// A 64-byte record, as a trading process would append.
#[derive(Clone, Copy, Default)]
#[repr(C, align(8))]
struct Rec64([u64; 8]);

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
        Rec64([i; 8])
    }
    /// The last word, plus how far the other words differ from it (zero for a record written
    /// whole): reads all 64 bytes, and a torn record spoils the checked sum.
    fn seq(&self) -> u64 {
        let s = self.0[7];
        s.wrapping_add(self.0.iter().fold(0, |d, &w| d | (w ^ s)))
    }
}

/// `0 + 1 + … + (n-1)`: what a consumer's sum of sequence numbers must come to.
fn expected_sum(n: u64) -> u64 {
    if n == 0 {
        0
    } else {
        (n as u128 * (n as u128 - 1) / 2) as u64
    }
}

/// One ring under test: both ends, and the non-blocking operations a spinning thread uses.
trait Ring<T: Send + 'static> {
    type Tx: Send + 'static;
    type Rx: Send + 'static;
    fn pair(capacity: usize) -> (Self::Tx, Self::Rx);
    fn try_push(tx: &mut Self::Tx, v: T) -> Result<(), T>;
    fn try_pop(rx: &mut Self::Rx) -> Option<T>;
    /// Pushes `v`, spinning while the ring is full (std's channel blocks instead).
    #[inline(always)]
    fn push(tx: &mut Self::Tx, mut v: T) {
        while let Err(back) = Self::try_push(tx, v) {
            v = back;
            std::hint::spin_loop();
        }
    }
    /// Pops one item, spinning while the ring is empty (std's channel blocks instead).
    #[inline(always)]
    fn pop(rx: &mut Self::Rx) -> T {
        loop {
            if let Some(v) = Self::try_pop(rx) {
                return v;
            }
            std::hint::spin_loop();
        }
    }
}

struct Fastlane;
impl<T: Send + 'static> Ring<T> for Fastlane {
    type Tx = fastlane::ring::spsc::Producer<T>;
    type Rx = fastlane::ring::spsc::Consumer<T>;
    fn pair(capacity: usize) -> (Self::Tx, Self::Rx) {
        fastlane::ring::spsc::channel_with(capacity, SPIN)
    }
    #[inline(always)]
    fn try_push(tx: &mut Self::Tx, v: T) -> Result<(), T> {
        tx.push(v).map_err(|e| e.into_inner())
    }
    #[inline(always)]
    fn try_pop(rx: &mut Self::Rx) -> Option<T> {
        rx.pop().ok()
    }
}

/// fastlane with its blocking calls: `pop_blocking` always, `push_blocking` when `PUSH`; with
/// the default settle limit when `LIMIT` is `u32::MAX`, else that limit.
struct FastlaneWait<const PUSH: bool, const LIMIT: u32 = { u32::MAX }>;
impl<T: Send + 'static, const PUSH: bool, const LIMIT: u32> Ring<T> for FastlaneWait<PUSH, LIMIT> {
    type Tx = fastlane::ring::spsc::Producer<T>;
    type Rx = fastlane::ring::spsc::Consumer<T>;
    fn pair(capacity: usize) -> (Self::Tx, Self::Rx) {
        let (mut tx, mut rx) = <Fastlane as Ring<T>>::pair(capacity);
        if LIMIT != u32::MAX {
            tx.set_settle_limit(LIMIT);
            rx.set_settle_limit(LIMIT);
        }
        (tx, rx)
    }
    #[inline(always)]
    fn try_push(tx: &mut Self::Tx, v: T) -> Result<(), T> {
        Fastlane::try_push(tx, v)
    }
    #[inline(always)]
    fn try_pop(rx: &mut Self::Rx) -> Option<T> {
        Fastlane::try_pop(rx)
    }
    #[inline(always)]
    fn push(tx: &mut Self::Tx, v: T) {
        if !PUSH {
            return Fastlane::push(tx, v);
        }
        if tx.push_blocking(v, None).is_err() {
            panic!("the consumer is gone");
        }
    }
    #[inline(always)]
    fn pop(rx: &mut Self::Rx) -> T {
        match rx.pop_blocking(None) {
            Ok(v) => v,
            Err(e) => panic!("pop_blocking: {e:?}"),
        }
    }
}

/// The bare floor through the same `Ring` trait and `single` harness as the rings under test
/// (`bare` runs its own loop): whatever separates the two is the harness, not a ring.
struct BareRing;
impl<T: Item> Ring<T> for BareRing {
    type Tx = bare::End<T>;
    type Rx = bare::End<T>;
    fn pair(capacity: usize) -> (Self::Tx, Self::Rx) {
        bare::pair(capacity)
    }
    #[inline(always)]
    fn try_push(tx: &mut Self::Tx, v: T) -> Result<(), T> {
        if !tx.room(1) {
            return Err(v);
        }
        tx.write(0, v);
        tx.publish(1);
        Ok(())
    }
    #[inline(always)]
    fn try_pop(rx: &mut Self::Rx) -> Option<T> {
        if !rx.ready(1) {
            return None;
        }
        let v = rx.read(0);
        rx.release(1);
        Some(v)
    }
}

struct Rtrb;
impl<T: Send + 'static> Ring<T> for Rtrb {
    type Tx = rtrb::Producer<T>;
    type Rx = rtrb::Consumer<T>;
    fn pair(capacity: usize) -> (Self::Tx, Self::Rx) {
        rtrb::RingBuffer::new(capacity)
    }
    #[inline(always)]
    fn try_push(tx: &mut Self::Tx, v: T) -> Result<(), T> {
        tx.push(v).map_err(|rtrb::PushError::Full(back)| back)
    }
    #[inline(always)]
    fn try_pop(rx: &mut Self::Rx) -> Option<T> {
        rx.pop().ok()
    }
}

struct Crossbeam;
impl<T: Send + 'static> Ring<T> for Crossbeam {
    type Tx = Arc<crossbeam_queue::ArrayQueue<T>>;
    type Rx = Arc<crossbeam_queue::ArrayQueue<T>>;
    fn pair(capacity: usize) -> (Self::Tx, Self::Rx) {
        let q = Arc::new(crossbeam_queue::ArrayQueue::new(capacity));
        (q.clone(), q)
    }
    #[inline(always)]
    fn try_push(tx: &mut Self::Tx, v: T) -> Result<(), T> {
        tx.push(v)
    }
    #[inline(always)]
    fn try_pop(rx: &mut Self::Rx) -> Option<T> {
        rx.pop()
    }
}

/// std's bounded channel, used the way it is meant to be: `send`/`recv` block.
struct StdSync;
impl<T: Send + 'static> Ring<T> for StdSync {
    type Tx = mpsc::SyncSender<T>;
    type Rx = mpsc::Receiver<T>;
    fn pair(capacity: usize) -> (Self::Tx, Self::Rx) {
        mpsc::sync_channel(capacity)
    }
    fn try_push(tx: &mut Self::Tx, v: T) -> Result<(), T> {
        tx.try_send(v).map_err(|e| match e {
            mpsc::TrySendError::Full(v) | mpsc::TrySendError::Disconnected(v) => v,
        })
    }
    fn try_pop(rx: &mut Self::Rx) -> Option<T> {
        rx.try_recv().ok()
    }
    fn push(tx: &mut Self::Tx, v: T) {
        tx.send(v).expect("receiver alive");
    }
    fn pop(rx: &mut Self::Rx) -> T {
        rx.recv().expect("sender alive")
    }
}

/// Pins the calling thread to the process's CPU `core` (of its first two; nothing on one CPU).
fn pin(core: usize) {
    let _ = fastlane::util::cpu::pin_nth(core);
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

/// `n` items one at a time through ring `R`; the time the consumer took.
fn single<T: Item, R: Ring<T>>(n: u64) -> Duration {
    let (mut tx, mut rx) = R::pair(CAPACITY);
    let mut sum = 0u64;
    let d = run_pair(
        move || {
            for i in 0..n {
                R::push(&mut tx, T::make(i));
            }
        },
        || {
            for _ in 0..n {
                sum = sum.wrapping_add(R::pop(&mut rx).seq());
            }
        },
    );
    assert_eq!(sum, expected_sum(n), "items lost, duplicated or reordered");
    d
}

/// `fn $name<T: Item>(n)`: `n` items (rounded up to chunks of 64) through a ring's zero-copy
/// chunk API. fastlane and rtrb spell that API the same way, but with their own types: a macro
/// rather than a trait over chunk objects that would need generic associated types.
macro_rules! batch_case {
    ($(#[$doc:meta])* $name:ident, $pair:expr) => {
        $(#[$doc])*
        fn $name<T: Item>(n: u64) -> Duration {
            let n = n.div_ceil(BATCH as u64) * BATCH as u64;
            let (mut tx, mut rx) = $pair;
            let mut sum = 0u64;
            let d = run_pair(
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
                                sum = a.iter().chain(b).fold(sum, |s, v| s.wrapping_add(v.seq()));
                                chunk.commit_all();
                                i += BATCH as u64;
                            }
                            Err(_) => std::hint::spin_loop(),
                        }
                    }
                },
            );
            assert_eq!(sum, expected_sum(n), "items lost, duplicated or reordered");
            d
        }
    };
}

batch_case!(
    /// Chunks through fastlane.
    batch_fastlane,
    fastlane::ring::spsc::channel_with::<T>(CAPACITY, SPIN)
);
batch_case!(
    /// Chunks through rtrb.
    batch_rtrb,
    rtrb::RingBuffer::<T>::new(CAPACITY)
);

/// `n` round trips: we push on `ping`, the other thread echoes onto `pong`.
fn pingpong<R: Ring<u64>>(n: u64) -> Duration {
    pingpong_with::<R, false>(n)
}

/// The same, with the echo thread's two handles' addresses passed through `black_box` before
/// its loop (so the optimiser must keep them in memory it cannot see into). Kept as its own
/// case because before commit 488538b it changed fastlane's result and not rtrb's in some
/// builds (1.20x the floor instead of 1.72x in the same process): the plain case's spin loop
/// stored into the handle on every turn (BENCHMARKS.md, fastlane-ring).
fn pingpong_escaped<R: Ring<u64>>(n: u64) -> Duration {
    pingpong_with::<R, true>(n)
}

fn pingpong_with<R: Ring<u64>, const ESCAPE: bool>(n: u64) -> Duration {
    let (mut ping_tx, mut ping_rx) = R::pair(PINGPONG_CAPACITY);
    let (mut pong_tx, mut pong_rx) = R::pair(PINGPONG_CAPACITY);
    run_pair(
        move || {
            if ESCAPE {
                black_box((&mut ping_rx as *mut R::Rx, &mut pong_tx as *mut R::Tx));
            }
            for _ in 0..n {
                let v = R::pop(&mut ping_rx);
                R::push(&mut pong_tx, v);
            }
        },
        || {
            for i in 0..n {
                R::push(&mut ping_tx, i);
                let v = R::pop(&mut pong_rx);
                assert_eq!(v, i, "echo out of order");
            }
        },
    )
}

/// Two threads bouncing one atomic: the floor under any ring's round trip.
fn pingpong_atomic(n: u64) -> Duration {
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
}

/// The floor for the throughput groups: the same algorithm as the rings under test (a
/// power-of-two array, free-running indices published with one Release store, each side caching
/// the other's index, the two indices 128 bytes apart) with no API around it: no handles, no
/// chunk objects, no drop bookkeeping. Whatever a ring costs above this is its own overhead;
/// what this costs is the two cores handing cache lines to each other.
mod bare {
    use std::cell::UnsafeCell;
    use std::mem::MaybeUninit;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[repr(align(128))]
    struct Line(AtomicUsize);

    pub struct Shared<T> {
        head: Line,
        tail: Line,
        slots: Box<[UnsafeCell<MaybeUninit<T>>]>,
    }

    // SAFETY:
    // - Slot `i` is written only by the producer while `i` is between head and head + capacity
    //   and read only by the consumer below the published tail; the Release/Acquire pairs on
    //   `head` and `tail` order those accesses (the same argument as fastlane's spsc).
    unsafe impl<T: Send> Sync for Shared<T> {}

    pub struct End<T> {
        ring: Arc<Shared<T>>,
        mine: usize,
        theirs: usize,
        mask: usize,
    }

    pub fn pair<T: Copy>(capacity: usize) -> (End<T>, End<T>) {
        let capacity = capacity.next_power_of_two();
        let ring = Arc::new(Shared {
            head: Line(AtomicUsize::new(0)),
            tail: Line(AtomicUsize::new(0)),
            slots: (0..capacity).map(|_| UnsafeCell::new(MaybeUninit::uninit())).collect(),
        });
        let end = |ring| End { ring, mine: 0, theirs: 0, mask: capacity - 1 };
        (end(ring.clone()), end(ring))
    }

    impl<T: Copy> End<T> {
        /// Producer: room for `n` more items, refreshing the consumer's index if needed.
        #[inline(always)]
        pub fn room(&mut self, n: usize) -> bool {
            let cap = self.mask + 1;
            if self.mine.wrapping_sub(self.theirs) + n <= cap {
                return true;
            }
            self.theirs = self.ring.head.0.load(Ordering::Acquire);
            self.mine.wrapping_sub(self.theirs) + n <= cap
        }

        /// Producer: writes `v` at position `mine + i` (not yet published).
        #[inline(always)]
        pub fn write(&mut self, i: usize, v: T) {
            let slot = &self.ring.slots[(self.mine + i) & self.mask];
            // SAFETY:
            // - `room` saw the slot free: the consumer published a head past its last read.
            unsafe { (*slot.get()).write(v) };
        }

        /// Producer: publishes `n` written items.
        #[inline(always)]
        pub fn publish(&mut self, n: usize) {
            self.mine = self.mine.wrapping_add(n);
            self.ring.tail.0.store(self.mine, Ordering::Release);
        }

        /// Consumer: at least `n` items readable, refreshing the producer's index if needed.
        #[inline(always)]
        pub fn ready(&mut self, n: usize) -> bool {
            if self.theirs.wrapping_sub(self.mine) >= n {
                return true;
            }
            self.theirs = self.ring.tail.0.load(Ordering::Acquire);
            self.theirs.wrapping_sub(self.mine) >= n
        }

        /// Consumer: the item at position `mine + i`.
        #[inline(always)]
        pub fn read(&self, i: usize) -> T {
            let slot = &self.ring.slots[(self.mine + i) & self.mask];
            // SAFETY:
            // - `ready` saw the producer's Release of a tail past this slot, so nobody writes it
            //   now and it is initialised.
            let v = unsafe { slot.get().read() };
            // SAFETY:
            // - Initialised, as above.
            unsafe { v.assume_init() }
        }

        /// Consumer: hands `n` read slots back.
        #[inline(always)]
        pub fn release(&mut self, n: usize) {
            self.mine = self.mine.wrapping_add(n);
            self.ring.head.0.store(self.mine, Ordering::Release);
        }
    }
}

/// `n` items through the bare ring, `chunk` at a time (1: the single-item floor).
fn bare_floor<T: Item, const CHUNK: usize>(n: u64) -> Duration {
    let n = n.div_ceil(CHUNK as u64) * CHUNK as u64;
    let (mut tx, mut rx) = bare::pair::<T>(CAPACITY);
    let mut sum = 0u64;
    let d = run_pair(
        move || {
            let mut i = 0;
            while i < n {
                if !tx.room(CHUNK) {
                    std::hint::spin_loop();
                    continue;
                }
                for k in 0..CHUNK {
                    tx.write(k, T::make(i + k as u64));
                }
                tx.publish(CHUNK);
                i += CHUNK as u64;
            }
        },
        || {
            let mut i = 0;
            while i < n {
                if !rx.ready(CHUNK) {
                    std::hint::spin_loop();
                    continue;
                }
                for k in 0..CHUNK {
                    sum = sum.wrapping_add(rx.read(k).seq());
                }
                rx.release(CHUNK);
                i += CHUNK as u64;
            }
        },
    );
    assert_eq!(sum, expected_sum(n), "items lost, duplicated or reordered");
    d
}

/// `n` u64 items through ring `R` on this one thread, a full ring at a time (push
/// `CAPACITY`, then pop them): the cost of the push/pop code with no second core involved.
fn one_thread<R: Ring<u64>>(n: u64) -> Duration {
    let (mut tx, mut rx) = R::pair(CAPACITY);
    let laps = n.div_ceil(CAPACITY as u64);
    let mut sum = 0u64;
    let start = Instant::now();
    for lap in 0..laps {
        let base = lap * CAPACITY as u64;
        for i in 0..CAPACITY as u64 {
            R::push(&mut tx, base + i);
        }
        for _ in 0..CAPACITY {
            sum = sum.wrapping_add(black_box(R::pop(&mut rx)));
        }
    }
    let d = start.elapsed();
    assert_eq!(sum, expected_sum(laps * CAPACITY as u64), "items lost or reordered");
    d
}

type Case = (&'static str, fn(u64) -> Duration);

/// A group: its criterion name, the reference peer, items per interleaved round, the peers.
struct Group {
    name: &'static str,
    reference: &'static str,
    throughput: bool,
    items: u64,
    cases: Vec<Case>,
}

fn groups() -> Vec<Group> {
    fn singles<T: Item>() -> Vec<Case> {
        vec![
            ("fastlane", single::<T, Fastlane>),
            ("fastlane_wait", single::<T, FastlaneWait<true>>),
            ("fastlane_popwait", single::<T, FastlaneWait<false>>),
            ("fastlane_popwait8", single::<T, FastlaneWait<false, 8>>),
            ("fastlane_popwait16", single::<T, FastlaneWait<false, 16>>),
            ("rtrb", single::<T, Rtrb>),
            ("crossbeam", single::<T, Crossbeam>),
            ("std_sync_channel", single::<T, StdSync>),
            ("bare", bare_floor::<T, 1>),
            ("bare_trait", single::<T, BareRing>),
        ]
    }
    fn batches<T: Item>() -> Vec<Case> {
        vec![
            ("fastlane", batch_fastlane::<T>),
            ("rtrb", batch_rtrb::<T>),
            ("bare", bare_floor::<T, BATCH>),
            ("bare_x16", bare_floor::<T, { 16 * BATCH }>),
        ]
    }
    let group = |name, reference, throughput, items, cases| Group {
        name,
        reference,
        throughput,
        items,
        cases,
    };
    vec![
        group("tput_u64_single", "rtrb", true, 4_000_000, singles::<u64>()),
        group("tput_rec64_single", "rtrb", true, 2_000_000, singles::<Rec64>()),
        group("tput_u64_batch", "rtrb", true, 32_000_000, batches::<u64>()),
        group(
            "one_thread_u64",
            "rtrb",
            true,
            8 * CAPACITY as u64 * 256,
            vec![("fastlane", one_thread::<Fastlane>), ("rtrb", one_thread::<Rtrb>)],
        ),
        group("tput_rec64_batch", "rtrb", true, 4_096_000, batches::<Rec64>()),
        group(
            "pingpong_u64",
            "atomic",
            false,
            50_000,
            vec![
                ("atomic", pingpong_atomic),
                ("fastlane", pingpong::<Fastlane>),
                ("fastlane_wait", pingpong::<FastlaneWait<true>>),
                ("fastlane_popwait", pingpong::<FastlaneWait<false>>),
                ("fastlane_popwait8", pingpong::<FastlaneWait<false, 8>>),
                ("fastlane_popwait16", pingpong::<FastlaneWait<false, 16>>),
                ("rtrb", pingpong::<Rtrb>),
                ("fastlane_escaped", pingpong_escaped::<Fastlane>),
                ("rtrb_escaped", pingpong_escaped::<Rtrb>),
                ("crossbeam", pingpong::<Crossbeam>),
                ("std_sync_channel", pingpong::<StdSync>),
            ],
        ),
    ]
}

fn criterion_groups(c: &mut Criterion) {
    for grp in groups() {
        let mut g = c.benchmark_group(grp.name);
        if grp.throughput {
            g.throughput(Throughput::Elements(1));
        }
        g.measurement_time(Duration::from_secs(3));
        g.warm_up_time(Duration::from_millis(500));
        for (peer, f) in grp.cases {
            g.bench_function(BenchmarkId::from_parameter(peer), |b| b.iter_custom(f));
        }
        g.finish();
    }
}

/// `RING_BENCH_INTERLEAVED=R`: every peer once per round, R rounds, ratios per round.
fn interleaved(rounds: usize, filter: Option<&str>) {
    let mut json = Vec::new();
    let mut rng = 0x5EED_u64;
    let verbose = std::env::var_os("RING_BENCH_VERBOSE").is_some();
    println!(
        "fastlane's default settle limit on this CPU: {} pauses",
        fastlane::ring::spsc::default_settle_limit()
    );
    for grp in groups() {
        if filter.is_some_and(|f| !grp.name.contains(f)) {
            continue;
        }
        let unit = if grp.throughput { "ns/item" } else { "ns/round trip" };
        let mut times: Vec<Vec<f64>> = vec![Vec::with_capacity(rounds); grp.cases.len()];
        let reference = grp
            .cases
            .iter()
            .position(|(p, _)| *p == grp.reference)
            .expect("the reference peer is in its group");
        for (_, f) in &grp.cases {
            black_box(f(grp.items / 10)); // warm-up: page faults, frequency, code
        }
        for r in 0..rounds {
            eprint!("\r{}: round {}/{rounds}", grp.name, r + 1);
            // A new order every round (so that no peer always follows the same one: after a
            // peer that sleeps, like std's channel, the cores come back from idle), and a short
            // untimed run of the same case right before the timed one.
            let mut order: Vec<usize> = (0..grp.cases.len()).collect();
            for k in (1..order.len()).rev() {
                rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                order.swap(k, ((rng >> 33) % (k as u64 + 1)) as usize);
            }
            for i in order {
                black_box((grp.cases[i].1)(grp.items / 20));
                let d = (grp.cases[i].1)(grp.items);
                times[i].push(d.as_nanos() as f64 / grp.items as f64);
                if verbose {
                    eprintln!("  round {} {}: {:.3} {unit}", r + 1, grp.cases[i].0, times[i][r]);
                }
            }
        }
        eprintln!();
        println!(
            "\n{} ({} rounds of {} items; per-round ratio to {})",
            grp.name, rounds, grp.items, grp.reference
        );
        println!(
            "{:<18} {:>14} {:>14} {:>22}",
            "peer",
            format!("best {unit}"),
            format!("median {unit}"),
            if grp.throughput { "median ratio (thr.)" } else { "median ratio (time)" }
        );
        for (i, (peer, _)) in grp.cases.iter().enumerate() {
            let ratios: Vec<f64> = times[i]
                .iter()
                .zip(&times[reference])
                .map(|(t, r)| if grp.throughput { r / t } else { t / r })
                .collect();
            let ratio = median(ratios);
            let best = times[i].iter().copied().fold(f64::INFINITY, f64::min);
            let med = median(times[i].clone());
            println!("{peer:<18} {best:>14.3} {med:>14.3} {ratio:>21.3}x");
            json.push(format!(
                "{{\"group\":\"{}\",\"peer\":\"{peer}\",\"reference\":\"{}\",\"rounds\":{rounds},\
                 \"items\":{},\"best_ns\":{best:.4},\"median_ns\":{med:.4},\
                 \"median_ratio\":{ratio:.4},\"ratio_is\":\"{}\"}}",
                grp.name,
                grp.reference,
                grp.items,
                if grp.throughput { "throughput" } else { "time" }
            ));
        }
    }
    if let Ok(path) = std::env::var("RING_BENCH_JSON") {
        std::fs::write(&path, format!("[\n{}\n]\n", json.join(",\n")))
            .unwrap_or_else(|e| panic!("writing {path}: {e}"));
        eprintln!("wrote {path}");
    }
}

fn main() {
    let bench_mode = std::env::args().any(|a| a == "--bench");
    if let Some(rounds) = std::env::var("RING_BENCH_INTERLEAVED").ok().and_then(|v| v.parse().ok())
    {
        // Only under `cargo bench`; `cargo test` runs criterion's quick test mode below.
        if bench_mode {
            let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
            interleaved(rounds, filter.as_deref());
            return;
        }
    }
    let mut c = Criterion::default().configure_from_args();
    criterion_groups(&mut c);
    c.final_summary();
}
