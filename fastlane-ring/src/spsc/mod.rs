//! A typed single-producer/single-consumer ring between two threads of one process.
//!
//! [`channel`] (or [`channel_with`], to choose the [`WaitStrategy`]) returns a [`Producer`] and a
//! [`Consumer`]; each may be moved to its own thread. Single items go through
//! [`Producer::push`] / [`Consumer::pop`], batches through [`Producer::write_chunk_uninit`] /
//! [`Consumer::read_chunk`] (zero copy: the caller reads and writes the ring's slots in place),
//! and the `*_blocking` variants wait for the other side with the channel's strategy.
//!
//! # Layout
//!
//! One allocation at construction holds a header and then the slots; nothing allocates
//! afterwards. The header has three 128-byte-aligned parts, so no two of them share a cache line
//! (nor an adjacent-line prefetch pair):
//!
//! - the producer's line: `tail` (next slot to write), and the flag the *consumer* sleeps on;
//! - the consumer's line: `head` (next slot to read), and the flag the *producer* sleeps on;
//! - a cold part: capacity, the "gone" flags and the reference count, written only on drop.
//!
//! Each park flag lives on the line of the side that checks it after every publish (the
//! notifier), so the check is a load from a line the notifier already owns; the sleeper writes
//! it only on its way to sleep.
//!
//! Indices run freely over `usize` and wrap; a slot is `index & (capacity - 1)`, and
//! `tail.wrapping_sub(head)` is the number of items. Each side keeps its own index in a plain
//! field (it is the only writer) and a cached copy of the other side's index, refreshed only when
//! the cached view says the ring is full (producer) or empty (consumer). In the steady state a
//! push or pop therefore touches the slot, its own line, and nothing the other side writes.
//!
//! # Memory ordering
//!
//! - Producer: writes the slot, then `tail.store(Release)`. The consumer's `tail.load(Acquire)`
//!   that observes it makes the slot write visible before the consumer reads the slot.
//! - Consumer: reads (moves out of, or drops) the slot, then `head.store(Release)`. The
//!   producer's `head.load(Acquire)` that observes it orders the consumer's read before the
//!   producer overwrites the slot.
//! - Waking: after each publish the publishing side calls `ParkFlag::notify` on the other side's
//!   flag (one `SeqCst` fence and one relaxed load when nobody sleeps); see `wait.rs` for the
//!   handshake. The notify is skipped altogether on channels whose strategy never parks
//!   ([`WaitStrategy::BusySpin`], [`WaitStrategy::SpinYield`]): there nobody can be asleep on a
//!   flag, since the waiting side re-reads the index itself. Notifying only when the ring was
//!   *observed* empty (or full) is not sound with cached indices: the producer's cached `head` is
//!   stale, so it can believe the ring is non-empty while the consumer has drained it and is
//!   going to sleep (the loom model `parked_consumer_is_woken_by_push_after_it_drained_the_ring`
//!   deadlocks with that scheme), and refreshing `head` on every push would cost a cache miss,
//!   more than the fence it saves.
//!
//! # Settling: how the blocking variants pace their first look
//!
//! A thread that polls an index the other side is busy writing takes that cache line away from
//! it on every look, and the writer's next store waits for the line to come back. A consumer
//! that finds the ring empty while the producer streams items one at a time therefore slows the
//! producer down by looking too often. Measured on a 2-core VM, a consumer in `pop_blocking`
//! moves single u64 items at 1.05-1.52x rtrb's rate, against 0.82-1.05x for `pop` in a spin
//! loop (BENCHMARKS.md, fastlane-ring).
//!
//! So [`Consumer::pop_blocking`] and [`Producer::push_blocking`], when they find nothing to do,
//! first wait `settle` `pause`s before looking again (then wait with the channel's strategy as
//! usual). `settle` adapts to what the call finds when it succeeds: two or more items (or free
//! slots) at once mean the other side was streaming and we looked too early, so `settle` grows
//! (1, 3, 7, ... up to the handle's limit, [`default_settle_limit`] unless changed with
//! `set_settle_limit`); exactly one means it hands over one item at a time, as a request or an
//! answer does, and `settle` halves, down to zero. A ping-pong thus never settles and pays
//! nothing in latency; a stream settles at the limit and its consumer takes items in batches.
//! The cost: an item that arrives alone during a settle waits for the rest of it, at most the
//! limit: by default [`SETTLE_BUDGET_NANOS`] (1 µs) worth of pauses, at most
//! [`SETTLE_MAX_PAUSES`] (32: the limit on the VM above, where 8 and 16 gained nothing when its
//! vCPUs did not share a cache, and 32 did). A limit of 0 turns settling off; a consumer that
//! must never delay a lone item sets it. The non-blocking calls never settle.
//!
//! A loop around a blocking call contains a call (the out-of-line wait), and where the handle's
//! address has escaped (a closure dropped on unwinding is enough) the compiler then keeps the
//! handle's fields in memory rather than registers: a few loads and a store per item. A
//! producer that must not lose that spins on `push` instead.
//!
//! # Syscalls
//!
//! `push`, `pop` and the chunk operations never sleep and never make a syscall, with one
//! exception that is the point of the blocking variants: on a [`WaitStrategy::SpinYieldPark`]
//! channel, when the other side is asleep in a `*_blocking` call, the publish that gives it
//! something to do is followed by one `FUTEX_WAKE`.
//!
//! # Capacity
//!
//! The capacity is rounded up to the next power of two; [`Producer::capacity`] says what it is.
//! Zero panics, as does a capacity whose slots would not fit the address space. Zero-sized
//! types are supported: the ring then only counts, and still holds at most `capacity` items.
//!
//! # Drop
//!
//! Dropping one side marks it gone ([`Producer::is_abandoned`], [`Consumer::is_abandoned`]) and
//! wakes the other side if it sleeps. The side dropped last drops the items still in the ring,
//! each exactly once, and frees the allocation.
//!
//! # Where the code is
//!
//! This file: the layout, the settling, the errors, [`channel_with`] and the release of the
//! allocation; `producer.rs`: [`Producer`] and [`WriteChunkUninit`]; `consumer.rs`:
//! [`Consumer`], [`ReadChunk`] and its iterator; `tests.rs`: the unit tests.

use std::alloc::{self, Layout};
use std::fmt;
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::ptr::{self, NonNull};
use std::time::Instant;

// `CachePadded` aligns (and so pads) each side's line to 128 bytes on x86_64 and aarch64: two
// cache lines, because the adjacent-line prefetcher of x86 parts moves lines in pairs. That is
// the layout the ring's hand-written padding had, so the benchmarks measure the same ring.
use crossbeam_utils::CachePadded;

use crate::sync::{spin_loop, AtomicUsize, Ordering};
use crate::wait::{ParkFlag, Scope, WaitStrategy};

/// The most `pause`s the default settle limit allows (see "Settling" above). On the 2-core AMD
/// VM this was measured on, a limit of 32 moved single u64 items at 1.05-1.52x rtrb's rate in
/// both of its regimes, where 8 and 16 gave 0.57-0.96x when its vCPUs did not share a cache.
pub const SETTLE_MAX_PAUSES: u32 = 32;

/// How long, at most, the default settle limit lets a lone item wait: the limit is as many
/// `pause`s as this CPU runs in this time (measured once per process), capped at
/// [`SETTLE_MAX_PAUSES`]. A `pause` takes from a few to about 140 cycles depending on the CPU,
/// so a limit in pauses alone would bound nothing.
pub const SETTLE_BUDGET_NANOS: u64 = 1_000;

/// The settle limit new handles start with: [`SETTLE_BUDGET_NANOS`] worth of `pause`s on this
/// CPU, at least 1 and at most [`SETTLE_MAX_PAUSES`]. Measured the first time it is asked
/// for (four timings of 128 pauses, some microseconds) and then cached. A preemption during the
/// measurement makes pauses look slower and the limit smaller, never larger. Loom builds never
/// settle: the pauses would only multiply the interleavings to explore.
pub fn default_settle_limit() -> u32 {
    #[cfg(loom)]
    {
        0
    }
    #[cfg(not(loom))]
    {
        use std::sync::atomic::{AtomicU32, Ordering as StdOrdering};
        static LIMIT: AtomicU32 = AtomicU32::new(u32::MAX);
        // Relaxed: the value is a hint computed the same way by whichever thread gets here
        // first; nothing else is published through it.
        let cached = LIMIT.load(StdOrdering::Relaxed);
        if cached != u32::MAX {
            return cached;
        }
        // The fastest of four timings of 128 pauses: a preemption or a cold start only ever
        // makes one slower.
        const SAMPLE: u32 = 128;
        let elapsed = (0..4)
            .map(|_| {
                let start = Instant::now();
                settle_for(SAMPLE);
                u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
            })
            .min()
            .unwrap_or(u64::MAX)
            .max(1);
        let fit = SETTLE_BUDGET_NANOS * u64::from(SAMPLE) / elapsed;
        let limit = fit.clamp(1, u64::from(SETTLE_MAX_PAUSES)) as u32;
        LIMIT.store(limit, StdOrdering::Relaxed);
        limit
    }
}

/// The next `settle` after a blocking call that waited found `batch` items (or free slots).
fn next_settle(settle: u32, batch: usize, limit: u32) -> u32 {
    if batch >= 2 {
        settle.saturating_mul(2).saturating_add(1).min(limit)
    } else {
        settle / 2
    }
}

/// Waits `pauses` spin-loop hints (no syscall, no memory access).
fn settle_for(pauses: u32) {
    for _ in 0..pauses {
        spin_loop();
    }
}

/// `Producer::push_blocking`'s wait: `settle` pauses, then the strategy's wait until the ring
/// whose producer index is `tail` has a free slot or the consumer is gone. False on timeout.
#[inline(never)]
fn wait_for_room(
    h: &Header,
    tail: usize,
    capacity: usize,
    strategy: WaitStrategy,
    settle: u32,
    deadline: Option<Instant>,
) -> bool {
    settle_for(settle);
    h.cons.producer_wait.wait_until(Scope::Private, strategy, deadline, || {
        // Acquire pairs with the Release store of `head` in `Consumer::publish`.
        tail.wrapping_sub(h.cons.head.load(Ordering::Acquire)) < capacity
            // Acquire pairs with the Release store in `Consumer::drop`.
            || h.ctl.consumer_gone.load(Ordering::Acquire) != 0
    })
}

/// `Consumer::pop_blocking`'s wait: `settle` pauses, then the strategy's wait until the
/// producer's index moves past `head` or the producer is gone. False on timeout.
#[inline(never)]
fn wait_for_items(
    h: &Header,
    head: usize,
    strategy: WaitStrategy,
    settle: u32,
    deadline: Option<Instant>,
) -> bool {
    settle_for(settle);
    h.prod.consumer_wait.wait_until(Scope::Private, strategy, deadline, || {
        // Acquire pairs with the Release store of `tail` in `Producer::publish`.
        h.prod.tail.load(Ordering::Acquire) != head
            // Acquire pairs with the Release store in `Producer::drop`.
            || h.ctl.producer_gone.load(Ordering::Acquire) != 0
    })
}

/// [`Producer::push`] could not take the value; it is handed back.
#[derive(Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PushError<T> {
    /// The ring is full (or, from [`Producer::push_blocking`], stayed full until the deadline).
    #[error("ring is full")]
    Full(T),
    /// From [`Producer::push_blocking`] only: the ring is full and the consumer is gone, so it
    /// will never have room.
    #[error("ring is full and its consumer is gone")]
    Abandoned(T),
}

impl<T> PushError<T> {
    /// The value that was not pushed.
    pub fn into_inner(self) -> T {
        match self {
            PushError::Full(value) | PushError::Abandoned(value) => value,
        }
    }
}

impl<T> fmt::Debug for PushError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PushError::Full(_) => f.write_str("Full(..)"),
            PushError::Abandoned(_) => f.write_str("Abandoned(..)"),
        }
    }
}

/// [`Consumer::pop`] found nothing to take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PopError {
    /// The ring is empty (or, from [`Consumer::pop_blocking`], stayed empty until the deadline).
    #[error("ring is empty")]
    Empty,
    /// From [`Consumer::pop_blocking`] only: the ring is empty and the producer is gone, so it
    /// will never have more. (`pop` returns `Empty` here; ask [`Consumer::is_abandoned`].)
    #[error("ring is empty and its producer is gone")]
    Abandoned,
}

/// A chunk of the requested size is not available.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ChunkError {
    /// Only this many slots (free slots for a write chunk, items for a read chunk) are there now.
    #[error("only {0} slots are available")]
    TooFewSlots(usize),
}

/// Written by the producer on every publish.
struct ProducerLine {
    /// The next index the producer writes. Only the producer stores it.
    tail: AtomicUsize,
    /// The consumer sleeps here while the ring is empty; the producer notifies after publishing.
    consumer_wait: ParkFlag,
}

/// Written by the consumer on every publish.
struct ConsumerLine {
    /// The next index the consumer reads. Only the consumer stores it.
    head: AtomicUsize,
    /// The producer sleeps here while the ring is full; the consumer notifies after publishing.
    producer_wait: ParkFlag,
}

/// Written only when a side is dropped.
struct Control {
    /// A power of two.
    capacity: usize,
    /// Non-zero once the producer is dropped.
    producer_gone: AtomicUsize,
    /// Non-zero once the consumer is dropped.
    consumer_gone: AtomicUsize,
    /// Sides not yet dropped; the one that takes it to zero frees the allocation.
    refs: AtomicUsize,
    /// One cell per slot that the model checker tracks: every access to a slot also touches its
    /// cell, so loom reports any two accesses that are not ordered by happens-before.
    #[cfg(loom)]
    shadow: Box<[loom::cell::UnsafeCell<()>]>,
}

/// The start of the allocation; the slots follow it.
struct Header {
    prod: CachePadded<ProducerLine>,
    cons: CachePadded<ConsumerLine>,
    ctl: CachePadded<Control>,
}

impl Header {
    fn new(capacity: usize) -> Self {
        Header {
            prod: CachePadded::new(ProducerLine {
                tail: AtomicUsize::new(0),
                consumer_wait: ParkFlag::new(),
            }),
            cons: CachePadded::new(ConsumerLine {
                head: AtomicUsize::new(0),
                producer_wait: ParkFlag::new(),
            }),
            ctl: CachePadded::new(Control {
                capacity,
                producer_gone: AtomicUsize::new(0),
                consumer_gone: AtomicUsize::new(0),
                refs: AtomicUsize::new(2),
                #[cfg(loom)]
                shadow: (0..capacity).map(|_| loom::cell::UnsafeCell::new(())).collect(),
            }),
        }
    }
}

/// Tells the model checker that this thread reads or writes the slot of `index` now.
#[cfg(loom)]
fn slot_access(header: &Header, index: usize) {
    let shadow = &header.ctl.shadow;
    shadow[index & (shadow.len() - 1)].with_mut(|_| ());
}

#[cfg(not(loom))]
#[inline(always)]
fn slot_access(_header: &Header, _index: usize) {}

/// Asks for the lines of slots `[from, from + n)` in the exclusive state (`prefetchw`, or a
/// plain prefetch on a CPU without it), ahead of writing them. A hint: it never faults and
/// changes nothing the program can see; a no-op off x86-64 and under loom.
#[inline(always)]
fn prefetch_slots_for_write<T>(slots: NonNull<T>, mask: usize, from: usize, n: usize) {
    #[cfg(all(target_arch = "x86_64", not(loom)))]
    {
        let step = (64 / std::mem::size_of::<T>().max(1)).max(1);
        let owned = has_prefetchw();
        let mut i = 0;
        while i < n {
            let p = slot_ptr(slots, mask, from.wrapping_add(i));
            if owned {
                // SAFETY: `prefetchw` (present: `has_prefetchw`) only hints the cache about a
                // line of our own allocation; it reads and writes nothing the program can see
                // and never faults.
                unsafe {
                    std::arch::asm!(
                        "prefetchw [{}]",
                        in(reg) p,
                        options(nostack, preserves_flags, readonly)
                    );
                }
            } else {
                // SAFETY: SSE is part of x86-64; a prefetch is a hint that neither faults nor
                // reads into the program.
                unsafe {
                    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                        p.cast::<i8>(),
                    );
                }
            }
            i += step;
        }
    }
    #[cfg(not(all(target_arch = "x86_64", not(loom))))]
    let _ = (slots, mask, from, n);
}

/// Whether the CPU has `PREFETCHW` (CPUID 8000_0001h, ECX bit 8), asked once.
#[cfg(all(target_arch = "x86_64", not(loom)))]
fn has_prefetchw() -> bool {
    use std::sync::atomic::AtomicU8;
    // 0: not asked yet, 1: no, 2: yes.
    static KNOWN: AtomicU8 = AtomicU8::new(0);
    match KNOWN.load(Ordering::Relaxed) {
        0 => {
            let yes = std::arch::x86_64::__cpuid(0x8000_0000).eax >= 0x8000_0001
                && std::arch::x86_64::__cpuid(0x8000_0001).ecx & (1 << 8) != 0;
            KNOWN.store(if yes { 2 } else { 1 }, Ordering::Relaxed);
            yes
        }
        k => k == 2,
    }
}

/// The allocation for `capacity` slots of `T`, and the offset of the first slot in it.
// The in-process ring (no peer): `channel_with` documents this panic for a capacity whose
// slots do not fit the address space, a caller's bug.
#[allow(clippy::expect_used)]
fn layout_for<T>(capacity: usize) -> (Layout, usize) {
    Layout::array::<T>(capacity)
        .and_then(|slots| Layout::new::<Header>().extend(slots))
        .expect("spsc: capacity overflow")
}

/// The slot of a free-running `index`. Always inside the allocation, so the arithmetic itself
/// is safe; dereferencing the result is up to the caller.
#[inline(always)]
fn slot_ptr<T>(slots: NonNull<T>, mask: usize, index: usize) -> *mut T {
    slots.as_ptr().wrapping_add(index & mask)
}

/// A ring with room for at least `capacity` items (rounded up to a power of two), with the
/// default [`WaitStrategy`] for the blocking variants.
///
/// # Panics
///
/// If `capacity` is zero or the slots would not fit the address space.
///
/// # Examples
///
/// ```
/// let (mut tx, mut rx) = fastlane_ring::spsc::channel::<u64>(3);
/// assert_eq!(tx.capacity(), 4);
/// tx.push(7).unwrap();
/// assert_eq!(rx.pop(), Ok(7));
/// ```
pub fn channel<T>(capacity: usize) -> (Producer<T>, Consumer<T>) {
    channel_with(capacity, WaitStrategy::default())
}

/// Like [`channel`], with the strategy the `*_blocking` variants of both sides wait with.
// The documented panic of a capacity above `usize::MAX / 2 + 1` (in-process, no peer).
#[allow(clippy::expect_used)]
pub fn channel_with<T>(capacity: usize, strategy: WaitStrategy) -> (Producer<T>, Consumer<T>) {
    assert!(capacity > 0, "spsc: a ring needs at least one slot");
    let capacity = capacity.checked_next_power_of_two().expect("spsc: capacity overflow");
    let (layout, slots_offset) = layout_for::<T>(capacity);
    // SAFETY:
    // - `layout` is not zero-sized: it starts with `Header`, three 128-byte parts.
    let base = unsafe { alloc::alloc(layout) };
    let Some(base) = NonNull::new(base) else { alloc::handle_alloc_error(layout) };
    let header = base.cast::<Header>();
    // SAFETY:
    // - `base` is a fresh allocation of `layout`, which `Layout::extend` built starting from
    //   `Layout::new::<Header>()`: offset 0 is in bounds and aligned for `Header`.
    // - Nobody else has a pointer to it yet.
    unsafe { header.as_ptr().write(Header::new(capacity)) };
    // SAFETY:
    // - `slots_offset` comes from `Layout::extend` for this same layout, so `base + slots_offset`
    //   is inside the allocation (or at its end when the slots take no bytes) and aligned for `T`.
    let slots = unsafe { base.add(slots_offset) }.cast::<T>();
    let mask = capacity - 1;
    let parks = matches!(strategy, WaitStrategy::SpinYieldPark { .. });
    let settle_limit = default_settle_limit();
    let producer = Producer {
        header,
        slots,
        mask,
        tail: 0,
        head_cache: 0,
        strategy,
        settle: 0,
        settle_limit,
        parks,
        _owns: PhantomData,
    };
    let consumer = Consumer {
        header,
        slots,
        mask,
        head: 0,
        tail_cache: 0,
        strategy,
        settle: 0,
        settle_limit,
        parks,
        _owns: PhantomData,
    };
    (producer, consumer)
}

/// Drops one side's reference to the ring; the last one drops the items left in it and frees it.
///
/// # Safety
///
/// - `header` and `slots` come from one `channel_with::<T>` call.
/// - Each side calls this exactly once, from its `Drop`, after its last access to the ring.
///
/// Out of line, so that the two `Drop`s, which are inlined, stay a few instructions.
#[inline(never)]
unsafe fn release<T>(header: NonNull<Header>, slots: NonNull<T>) {
    // SAFETY:
    // - The caller still holds its reference, so the allocation is live and `Header` initialised.
    let h = unsafe { header.as_ref() };
    // Release: this side's slot accesses and index stores happen-before the other side's
    // `fetch_sub` that reads this one, i.e. before it drops the leftovers and frees. Acquire
    // (when this is the last side): pairs with the other side's Release `fetch_sub`, so its
    // accesses happen-before ours below.
    if h.ctl.refs.fetch_sub(1, Ordering::AcqRel) != 1 {
        return;
    }
    let capacity = h.ctl.capacity;
    let mask = capacity - 1;
    // Relaxed: the Acquire above already orders both sides' last stores before these loads, and
    // nobody stores to them any more.
    let head = h.cons.head.load(Ordering::Relaxed);
    let tail = h.prod.tail.load(Ordering::Relaxed);
    let len = tail.wrapping_sub(head);
    assert!(len <= capacity, "spsc: corrupt indices head={head} tail={tail}");
    for index in (0..len).map(|i| head.wrapping_add(i)) {
        slot_access(h, index);
        // SAFETY:
        // - Slots in [head, tail) hold values the producer initialised and the consumer has not
        //   taken; both sides are gone, so nobody else reads or writes them.
        // - Each index in the range is visited once, so each value is dropped once.
        unsafe { ptr::drop_in_place(slot_ptr(slots, mask, index)) };
    }
    let (layout, _) = layout_for::<T>(capacity);
    // SAFETY:
    // - This is the last reference; `Header` was written in `channel_with` and is dropped once,
    //   here. `h` is not used after this point.
    unsafe { ptr::drop_in_place(header.as_ptr()) };
    // SAFETY:
    // - Allocated in `channel_with::<T>` with `layout_for::<T>(capacity)`, the same layout.
    unsafe { alloc::dealloc(header.as_ptr().cast::<u8>(), layout) };
}

mod consumer;
mod producer;
#[cfg(all(test, not(loom)))]
mod tests;

pub use consumer::{Consumer, ReadChunk, ReadChunkIntoIter};
pub use producer::{Producer, WriteChunkUninit};
