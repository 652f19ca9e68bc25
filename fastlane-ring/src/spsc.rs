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

/// The writing end of a ring. Move it to the producer thread; it is `Send` (for `T: Send`) but
/// not `Sync`, since every operation takes `&mut self` anyway.
///
/// ```compile_fail
/// fn is_sync<S: Sync>() {}
/// is_sync::<fastlane_ring::spsc::Producer<u64>>();
/// ```
pub struct Producer<T> {
    header: NonNull<Header>,
    slots: NonNull<T>,
    mask: usize,
    /// Our own index; the shared `tail` is a published copy of it.
    tail: usize,
    /// The consumer's `head`, as last loaded.
    head_cache: usize,
    strategy: WaitStrategy,
    /// Pauses before `push_blocking` looks again at a full ring (module docs, "Settling").
    settle: u32,
    /// The most `settle` may grow to.
    settle_limit: u32,
    /// Whether anyone can sleep on a park flag of this channel.
    parks: bool,
    _owns: PhantomData<T>,
}

// SAFETY:
// - The producer hands `T`s to another thread, so it needs `T: Send`, and needs nothing more:
//   everything it shares with the consumer is reached through atomics, or through slots whose
//   exclusive use is handed over by the Release/Acquire pairs on `head` and `tail`.
unsafe impl<T: Send> Send for Producer<T> {}

impl<T> Producer<T> {
    fn header(&self) -> &Header {
        // SAFETY:
        // - The allocation lives until both sides have called `release`, and this side only
        //   does so in its `Drop`.
        unsafe { self.header.as_ref() }
    }

    /// How many items the ring holds when full (a power of two).
    pub fn capacity(&self) -> usize {
        self.mask + 1
    }

    /// The strategy the blocking variants of this channel wait with.
    pub fn strategy(&self) -> WaitStrategy {
        self.strategy
    }

    /// The most `pause`s `push_blocking` waits before its first look at a full ring when the
    /// consumer frees slots in batches (module docs, "Settling"); 0 never settles. Defaults to
    /// [`default_settle_limit`].
    pub fn set_settle_limit(&mut self, pauses: u32) {
        self.settle_limit = pauses;
        self.settle = self.settle.min(pauses);
    }

    fn free_cached(&self) -> usize {
        self.capacity() - self.tail.wrapping_sub(self.head_cache)
    }

    /// Reloads the consumer's index; returns the free slots.
    fn refresh_head(&mut self) -> usize {
        // Acquire pairs with the Release store of `head` in `Consumer::publish`: the consumer
        // finished moving out of (or dropping) every slot below that head before storing it, so
        // we may overwrite them.
        self.head_cache = self.header().cons.head.load(Ordering::Acquire);
        self.free_cached()
    }

    /// Makes every slot below `tail` readable by the consumer and wakes it if it sleeps.
    fn publish(&mut self, tail: usize) {
        self.tail = tail;
        let h = self.header();
        // Release pairs with the Acquire load of `tail` in `Consumer::refresh_tail` (and in the
        // consumer's wait condition): our slot writes happen-before its reads of those slots.
        h.prod.tail.store(tail, Ordering::Release);
        if self.parks {
            h.prod.consumer_wait.notify(Scope::Private);
        }
    }

    /// Appends `value`, or hands it back in [`PushError::Full`] when there is no room.
    /// Never waits and never allocates.
    pub fn push(&mut self, value: T) -> Result<(), PushError<T>> {
        if self.free_cached() == 0 && self.refresh_head() == 0 {
            return Err(PushError::Full(value));
        }
        let index = self.tail;
        slot_access(self.header(), index);
        // SAFETY:
        // - The slot is inside the allocation and aligned (`slot_ptr`).
        // - It is free: `index - head_cache < capacity`, and the consumer will not read it before
        //   the `tail` store in `publish` below. It holds no value (it was never written, or its
        //   value was moved out or dropped before the consumer published a head past it), so
        //   nothing is leaked by overwriting it.
        unsafe { slot_ptr(self.slots, self.mask, index).write(value) };
        self.publish(index.wrapping_add(1));
        Ok(())
    }

    /// Like [`push`](Self::push), but waits with the channel's strategy while the ring is full,
    /// until `deadline` (forever if `None`). Returns [`PushError::Full`] if the deadline passed
    /// and [`PushError::Abandoned`] if the consumer is gone and the ring is full. Before the
    /// first look after finding the ring full it may pause briefly, more when the consumer frees
    /// slots in batches (module docs, "Settling").
    #[inline(always)]
    pub fn push_blocking(
        &mut self,
        mut value: T,
        deadline: Option<Instant>,
    ) -> Result<(), PushError<T>> {
        value = match self.push(value) {
            Ok(()) => return Ok(()),
            Err(e) => e.into_inner(),
        };
        // The wait is out of line and gets the header and copies, never `self`: a call that
        // received the handle's address would make the compiler keep its fields in memory in
        // the caller's loop (see `Drop`). The fast path above stays inline.
        let mut settle = self.settle;
        loop {
            let ready = wait_for_room(
                self.header(),
                self.tail,
                self.capacity(),
                self.strategy,
                settle,
                deadline,
            );
            settle = 0;
            let gone = self.is_abandoned();
            value = match self.push(value) {
                Ok(()) => {
                    self.settle =
                        next_settle(self.settle, self.free_cached() + 1, self.settle_limit);
                    return Ok(());
                }
                Err(e) => e.into_inner(),
            };
            if gone {
                return Err(PushError::Abandoned(value));
            }
            if !ready {
                return Err(PushError::Full(value));
            }
        }
    }

    /// Up to two slices of `n` free slots, to be written in place and then published with
    /// [`WriteChunkUninit::commit`] or [`WriteChunkUninit::fill_from_iter`]. Fails with the
    /// number of free slots if there are fewer than `n`. When there is room for another `n`
    /// after these, it also asks the CPU for that next chunk's lines, for writing (a hint).
    pub fn write_chunk_uninit(&mut self, n: usize) -> Result<WriteChunkUninit<'_, T>, ChunkError> {
        let free = if self.free_cached() < n { self.refresh_head() } else { self.free_cached() };
        if free < n {
            return Err(ChunkError::TooFewSlots(free));
        }
        let start = self.tail & self.mask;
        let first_len = n.min(self.capacity() - start);
        if free >= 2 * n {
            // The next chunk's lines were last read by the consumer, a lap ago: ask for them
            // now, owned, so that their transfer overlaps this chunk's writes (BENCHMARKS.md,
            // fastlane-ring: a few per cent of chunk throughput between cores, mostly for
            // records).
            prefetch_slots_for_write(self.slots, self.mask, self.tail.wrapping_add(n), n);
        }
        for i in 0..n {
            slot_access(self.header(), self.tail.wrapping_add(i));
        }
        Ok(WriteChunkUninit {
            first: slot_ptr(self.slots, self.mask, self.tail).cast::<MaybeUninit<T>>(),
            first_len,
            second: self.slots.as_ptr().cast::<MaybeUninit<T>>(),
            second_len: n - first_len,
            producer: self,
        })
    }

    /// Free slots now (reads the consumer's index).
    pub fn slots(&self) -> usize {
        self.capacity() - self.len()
    }

    /// Items in the ring now (reads the consumer's index).
    pub fn len(&self) -> usize {
        // Acquire pairs with the Release store of `head` in `Consumer::publish`.
        self.tail.wrapping_sub(self.header().cons.head.load(Ordering::Acquire))
    }

    /// Whether the ring is empty now.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the ring is full now.
    pub fn is_full(&self) -> bool {
        self.slots() == 0
    }

    /// Whether the consumer has been dropped.
    pub fn is_abandoned(&self) -> bool {
        // Acquire pairs with the Release store in `Consumer::drop`.
        self.header().ctl.consumer_gone.load(Ordering::Acquire) != 0
    }
}

impl<T> Drop for Producer<T> {
    /// Inlined (and `release` kept out of line) so that no call ever receives the handle's
    /// address. When `drop_in_place::<Producer<Rec64>>` was an out-of-line call, the handle had
    /// escaped, and in the push loop before it the compiler kept `tail`, `head_cache` and the
    /// mask in memory: the park path's futex call might, for all it knew, read or write them.
    /// That was loads and a store per push, and 5-15 % of one-at-a-time throughput
    /// (BENCHMARKS.md, fastlane-ring). The same holds for `Consumer`.
    #[inline(always)]
    fn drop(&mut self) {
        let h = self.header();
        // Release pairs with the Acquire loads of `producer_gone` in the consumer: whoever sees
        // the flag also sees our last `tail` store.
        h.ctl.producer_gone.store(1, Ordering::Release);
        if self.parks {
            // A consumer asleep in `pop_blocking` must wake up to see that we are gone. This is
            // the same handshake as after a publish: the flag store above, then the fence in
            // `notify`, against the consumer's park-flag store, fence, and load of the flag.
            h.prod.consumer_wait.notify(Scope::Private);
        }
        // SAFETY:
        // - `header` and `slots` come from `channel_with`; this is the producer's only call, and
        //   `self` is not used afterwards.
        unsafe { release::<T>(self.header, self.slots) };
    }
}

impl<T> fmt::Debug for Producer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Producer")
            .field("capacity", &self.capacity())
            .field("tail", &self.tail)
            .field("head_cache", &self.head_cache)
            .field("strategy", &self.strategy)
            .field("settle", &self.settle)
            .field("settle_limit", &self.settle_limit)
            .finish_non_exhaustive()
    }
}

/// The reading end of a ring. Move it to the consumer thread; it is `Send` (for `T: Send`) but
/// not `Sync`.
///
/// ```compile_fail
/// fn is_sync<S: Sync>() {}
/// is_sync::<fastlane_ring::spsc::Consumer<u64>>();
/// ```
pub struct Consumer<T> {
    header: NonNull<Header>,
    slots: NonNull<T>,
    mask: usize,
    /// Our own index; the shared `head` is a published copy of it (it may run ahead of the
    /// published copy while a [`ReadChunkIntoIter`] is alive, or after one was forgotten).
    head: usize,
    /// The producer's `tail`, as last loaded.
    tail_cache: usize,
    strategy: WaitStrategy,
    /// Pauses before `pop_blocking` looks again at an empty ring (module docs, "Settling").
    settle: u32,
    /// The most `settle` may grow to.
    settle_limit: u32,
    parks: bool,
    _owns: PhantomData<T>,
}

// SAFETY:
// - The consumer receives `T`s from another thread, so it needs `T: Send`, and nothing more:
//   see `Producer`'s `Send`.
unsafe impl<T: Send> Send for Consumer<T> {}

impl<T> Consumer<T> {
    fn header(&self) -> &Header {
        // SAFETY:
        // - The allocation lives until both sides have called `release`, and this side only
        //   does so in its `Drop`.
        unsafe { self.header.as_ref() }
    }

    /// How many items the ring holds when full (a power of two).
    pub fn capacity(&self) -> usize {
        self.mask + 1
    }

    /// The strategy the blocking variants of this channel wait with.
    pub fn strategy(&self) -> WaitStrategy {
        self.strategy
    }

    /// The most `pause`s `pop_blocking` waits before its first look at an empty ring when the
    /// producer streams (module docs, "Settling"); 0 never settles, for a consumer that would
    /// rather poll than delay a lone item by up to that many pauses. Defaults to
    /// [`default_settle_limit`].
    pub fn set_settle_limit(&mut self, pauses: u32) {
        self.settle_limit = pauses;
        self.settle = self.settle.min(pauses);
    }

    fn avail_cached(&self) -> usize {
        self.tail_cache.wrapping_sub(self.head)
    }

    /// Reloads the producer's index; returns the items available.
    fn refresh_tail(&mut self) -> usize {
        // Acquire pairs with the Release store of `tail` in `Producer::publish`: the producer's
        // writes of every slot below that tail happen-before our reads of them.
        self.tail_cache = self.header().prod.tail.load(Ordering::Acquire);
        self.avail_cached()
    }

    /// Hands every slot below `head` back to the producer and wakes it if it sleeps.
    fn publish(&mut self, head: usize) {
        self.head = head;
        let h = self.header();
        // Release pairs with the Acquire load of `head` in `Producer::refresh_head` (and in the
        // producer's wait condition): our reads of those slots happen-before its overwrites.
        h.cons.head.store(head, Ordering::Release);
        if self.parks {
            h.cons.producer_wait.notify(Scope::Private);
        }
    }

    /// Takes the oldest item, or fails with [`PopError::Empty`]. Never waits.
    pub fn pop(&mut self) -> Result<T, PopError> {
        if self.avail_cached() == 0 {
            // Acquire pairs with the Release store of `tail` in `Producer::publish`, as in
            // `refresh_tail`. Still empty: leave the cache alone, so that a caller spinning on
            // `pop` spins on one load and a compare (no store into the handle per turn).
            let tail = self.header().prod.tail.load(Ordering::Acquire);
            if tail == self.head {
                return Err(PopError::Empty);
            }
            self.tail_cache = tail;
        }
        let index = self.head;
        slot_access(self.header(), index);
        // SAFETY:
        // - The slot is inside the allocation and aligned (`slot_ptr`).
        // - `index < tail_cache`, so the producer initialised it before the `tail` store we
        //   acquired, and will not touch it again before we publish a head past it.
        // - We move the value out and publish a head past it right below, so it is read once.
        let value = unsafe { slot_ptr(self.slots, self.mask, index).read() };
        self.publish(index.wrapping_add(1));
        Ok(value)
    }

    /// The oldest item, left in the ring.
    pub fn peek(&mut self) -> Result<&T, PopError> {
        if self.avail_cached() == 0 && self.refresh_tail() == 0 {
            return Err(PopError::Empty);
        }
        slot_access(self.header(), self.head);
        // SAFETY:
        // - The slot is in bounds, initialised and not touched by the producer, as in `pop`.
        // - The returned borrow holds `&mut self`, so nothing can take the item meanwhile.
        Ok(unsafe { &*slot_ptr(self.slots, self.mask, self.head) })
    }

    /// Like [`pop`](Self::pop), but waits with the channel's strategy while the ring is empty,
    /// until `deadline` (forever if `None`). Returns [`PopError::Empty`] if the deadline passed
    /// and [`PopError::Abandoned`] if the producer is gone and the ring is empty. Before the
    /// first look after finding the ring empty it may pause briefly, more when the producer
    /// streams (module docs, "Settling").
    #[inline(always)]
    pub fn pop_blocking(&mut self, deadline: Option<Instant>) -> Result<T, PopError> {
        if let Ok(value) = self.pop() {
            return Ok(value);
        }
        // Out of line, without `self`, as in `Producer::push_blocking`.
        let mut settle = self.settle;
        loop {
            let ready = wait_for_items(self.header(), self.head, self.strategy, settle, deadline);
            settle = 0;
            // Read the flag before the `pop` below reloads `tail`: if the producer is gone, the
            // flag's Release/Acquire makes its last `tail` visible to that reload, so "empty and
            // gone" really means nothing will ever come.
            let gone = self.is_abandoned();
            if let Ok(value) = self.pop() {
                self.settle = next_settle(self.settle, self.avail_cached() + 1, self.settle_limit);
                return Ok(value);
            }
            if gone {
                return Err(PopError::Abandoned);
            }
            if !ready {
                return Err(PopError::Empty);
            }
        }
    }

    /// Up to two slices holding the `n` oldest items, to be read (or changed) in place and then
    /// removed with [`ReadChunk::commit`], or moved out by iterating over the chunk. Fails with
    /// the number of available items if there are fewer than `n`.
    pub fn read_chunk(&mut self, n: usize) -> Result<ReadChunk<'_, T>, ChunkError> {
        let avail = if self.avail_cached() < n { self.refresh_tail() } else { self.avail_cached() };
        if avail < n {
            return Err(ChunkError::TooFewSlots(avail));
        }
        let start = self.head & self.mask;
        let first_len = n.min(self.capacity() - start);
        for i in 0..n {
            slot_access(self.header(), self.head.wrapping_add(i));
        }
        Ok(ReadChunk {
            first: slot_ptr(self.slots, self.mask, self.head),
            first_len,
            second: self.slots.as_ptr(),
            second_len: n - first_len,
            consumer: self,
        })
    }

    /// Items available now (reads the producer's index).
    pub fn slots(&self) -> usize {
        self.len()
    }

    /// Items in the ring now (reads the producer's index).
    pub fn len(&self) -> usize {
        // Acquire pairs with the Release store of `tail` in `Producer::publish`.
        self.header().prod.tail.load(Ordering::Acquire).wrapping_sub(self.head)
    }

    /// Whether the ring is empty now.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the producer has been dropped. Items it pushed before may still be in the ring.
    pub fn is_abandoned(&self) -> bool {
        // Acquire pairs with the Release store in `Producer::drop`.
        self.header().ctl.producer_gone.load(Ordering::Acquire) != 0
    }
}

impl<T> Drop for Consumer<T> {
    /// Inlined for the same reason as `Producer`'s.
    #[inline(always)]
    fn drop(&mut self) {
        let head = self.head;
        let h = self.header();
        // Publish our own index: after a forgotten `ReadChunkIntoIter` it may be ahead of the
        // shared one, and the slots in between no longer hold values. Release, as in
        // `publish`: a producer that is still alive may reuse those slots once it loads this.
        h.cons.head.store(head, Ordering::Release);
        // Release pairs with the Acquire loads of `consumer_gone` in the producer.
        h.ctl.consumer_gone.store(1, Ordering::Release);
        if self.parks {
            // Wake a producer asleep in `push_blocking`; same handshake as in `Producer::drop`.
            h.cons.producer_wait.notify(Scope::Private);
        }
        // SAFETY:
        // - `header` and `slots` come from `channel_with`; this is the consumer's only call, and
        //   `self` is not used afterwards.
        unsafe { release::<T>(self.header, self.slots) };
    }
}

impl<T> fmt::Debug for Consumer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("capacity", &self.capacity())
            .field("head", &self.head)
            .field("tail_cache", &self.tail_cache)
            .field("strategy", &self.strategy)
            .field("settle", &self.settle)
            .field("settle_limit", &self.settle_limit)
            .finish_non_exhaustive()
    }
}

/// Free slots of a ring, borrowed from its [`Producer`], in up to two slices (the second starts
/// at slot 0 when the chunk wraps). Nothing is published until a `commit`; dropping the chunk
/// publishes nothing (and leaks whatever was written into it).
pub struct WriteChunkUninit<'a, T> {
    first: *mut MaybeUninit<T>,
    first_len: usize,
    second: *mut MaybeUninit<T>,
    second_len: usize,
    producer: &'a mut Producer<T>,
}

impl<T> WriteChunkUninit<'_, T> {
    /// Number of slots in the chunk.
    pub fn len(&self) -> usize {
        self.first_len + self.second_len
    }

    /// Whether the chunk has no slots.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The slots, in ring order: write the first `k` of them and then `commit(k)`.
    pub fn as_mut_slices(&mut self) -> (&mut [MaybeUninit<T>], &mut [MaybeUninit<T>]) {
        // SAFETY:
        // - `first .. first + first_len` is a run of slots inside the allocation (it ends at or
        //   before the last slot), free, and the consumer will not look at them before a commit.
        // - The chunk holds `&mut Producer`, and the slices borrow `&mut self`: no other
        //   reference to these slots exists while they live.
        let first = unsafe { std::slice::from_raw_parts_mut(self.first, self.first_len) };
        // SAFETY:
        // - Same as above for slots `0 .. second_len`; `second_len > 0` only when the chunk
        //   wraps, and then the two runs do not overlap (`first_len + second_len <= capacity`).
        let second = unsafe { std::slice::from_raw_parts_mut(self.second, self.second_len) };
        (first, second)
    }

    /// Publishes the first `n` slots of the chunk (in ring order) to the consumer.
    ///
    /// # Safety
    ///
    /// - The first `n` slots (across both slices) have been initialised.
    ///
    /// # Panics
    ///
    /// If `n > self.len()`.
    pub unsafe fn commit(self, n: usize) {
        assert!(n <= self.len(), "spsc: commit({n}) of a {}-slot chunk", self.len());
        if n > 0 {
            let tail = self.producer.tail.wrapping_add(n);
            self.producer.publish(tail);
        }
    }

    /// Publishes the whole chunk.
    ///
    /// # Safety
    ///
    /// - Every slot of the chunk has been initialised.
    pub unsafe fn commit_all(self) {
        let n = self.len();
        // SAFETY:
        // - The caller promises all `n` slots are initialised.
        unsafe { self.commit(n) };
    }

    /// Moves items from `iter` into the chunk until either runs out, publishes them, and returns
    /// how many there were. If `iter` panics, the items written so far are leaked, not published.
    pub fn fill_from_iter<I: IntoIterator<Item = T>>(mut self, iter: I) -> usize {
        let (first, second) = self.as_mut_slices();
        let mut iter = iter.into_iter();
        let mut written = 0;
        // Two plain loops rather than `first.chain(second).zip(iter)`: a chained iterator
        // checks which half it is in on every item, which costs 3x on 8-byte items.
        for slot in first.iter_mut() {
            let Some(value) = iter.next() else { break };
            slot.write(value);
            written += 1;
        }
        if written == first.len() {
            for slot in second.iter_mut() {
                let Some(value) = iter.next() else { break };
                slot.write(value);
                written += 1;
            }
        }
        // SAFETY:
        // - The loop above initialised exactly the first `written` slots, in ring order.
        unsafe { self.commit(written) };
        written
    }
}

impl<T> fmt::Debug for WriteChunkUninit<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WriteChunkUninit")
            .field("first_len", &self.first_len)
            .field("second_len", &self.second_len)
            .finish_non_exhaustive()
    }
}

/// The oldest items of a ring, borrowed from its [`Consumer`], in up to two slices. Dropping the
/// chunk leaves them in the ring; [`commit`](Self::commit) removes (drops) them; iterating over
/// the chunk moves them out.
pub struct ReadChunk<'a, T> {
    first: *mut T,
    first_len: usize,
    second: *mut T,
    second_len: usize,
    consumer: &'a mut Consumer<T>,
}

impl<'a, T> ReadChunk<'a, T> {
    /// Number of items in the chunk.
    pub fn len(&self) -> usize {
        self.first_len + self.second_len
    }

    /// Whether the chunk has no items.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The items, oldest first.
    pub fn as_slices(&self) -> (&[T], &[T]) {
        // SAFETY:
        // - `first .. first + first_len` are slots inside the allocation that hold values the
        //   producer published (we acquired its `tail` past them) and will not touch before we
        //   publish a head past them, which needs the `&mut Consumer` this chunk holds.
        let first = unsafe { std::slice::from_raw_parts(self.first, self.first_len) };
        // SAFETY:
        // - Same as above for slots `0 .. second_len`, disjoint from the first run.
        let second = unsafe { std::slice::from_raw_parts(self.second, self.second_len) };
        (first, second)
    }

    /// The items, oldest first, to change in place.
    pub fn as_mut_slices(&mut self) -> (&mut [T], &mut [T]) {
        // SAFETY:
        // - As in `as_slices`; and the slices borrow `&mut self`, so they are the only
        //   references to these slots while they live.
        let first = unsafe { std::slice::from_raw_parts_mut(self.first, self.first_len) };
        // SAFETY:
        // - Same as above for slots `0 .. second_len`, disjoint from the first run.
        let second = unsafe { std::slice::from_raw_parts_mut(self.second, self.second_len) };
        (first, second)
    }

    /// Drops the `n` oldest items of the chunk and hands their slots back to the producer.
    ///
    /// # Panics
    ///
    /// If `n > self.len()`. (If dropping an item panics, the remaining items of that slice are
    /// still dropped, those of the other slice leak, and all `n` slots are handed back.)
    pub fn commit(self, n: usize) {
        assert!(n <= self.len(), "spsc: commit({n}) of a {}-item chunk", self.len());
        let (first, second) = (self.first, self.second);
        let in_first = n.min(self.first_len);
        let in_second = n - in_first;
        let guard =
            PublishOnDrop { new_head: self.consumer.head.wrapping_add(n), consumer: self.consumer };
        // SAFETY:
        // - The first `in_first` items of the first run are initialised and ours (see
        //   `as_slices`); `guard` publishes a head past them even if a drop panics, so none is
        //   dropped twice.
        unsafe { ptr::drop_in_place(ptr::slice_from_raw_parts_mut(first, in_first)) };
        // SAFETY:
        // - Same for the first `in_second` items of the second run, which is only non-empty when
        //   the first run was taken whole.
        unsafe { ptr::drop_in_place(ptr::slice_from_raw_parts_mut(second, in_second)) };
        drop(guard);
    }

    /// Drops every item of the chunk and hands the slots back to the producer.
    pub fn commit_all(self) {
        let n = self.len();
        self.commit(n);
    }
}

/// Publishes the consumer's new head when dropped, including on unwind.
struct PublishOnDrop<'a, T> {
    consumer: &'a mut Consumer<T>,
    new_head: usize,
}

impl<T> Drop for PublishOnDrop<'_, T> {
    fn drop(&mut self) {
        if self.new_head != self.consumer.head {
            self.consumer.publish(self.new_head);
        }
    }
}

impl<T> fmt::Debug for ReadChunk<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadChunk")
            .field("first_len", &self.first_len)
            .field("second_len", &self.second_len)
            .finish_non_exhaustive()
    }
}

impl<'a, T> IntoIterator for ReadChunk<'a, T> {
    type Item = T;
    type IntoIter = ReadChunkIntoIter<'a, T>;

    /// Moves the items out, oldest first. The slots of the items taken are handed back to the
    /// producer when the iterator is dropped; items not taken stay in the ring.
    fn into_iter(self) -> Self::IntoIter {
        ReadChunkIntoIter { len: self.len(), left: self.len(), consumer: self.consumer }
    }
}

/// Moves the items of a [`ReadChunk`] out of the ring; see [`ReadChunk::into_iter`].
pub struct ReadChunkIntoIter<'a, T> {
    consumer: &'a mut Consumer<T>,
    /// Items in the chunk.
    len: usize,
    /// Items of the chunk not taken yet; they start at `consumer.head`.
    left: usize,
}

impl<T> Iterator for ReadChunkIntoIter<'_, T> {
    type Item = T;

    fn next(&mut self) -> Option<T> {
        if self.left == 0 {
            return None;
        }
        let c = &mut *self.consumer;
        let index = c.head;
        // SAFETY:
        // - `index` is inside the chunk, so its slot holds a value the producer published and
        //   will not touch before we publish a head past it (see `ReadChunk::as_slices`).
        // - We advance our own head right below, before anything else can read the slot: even
        //   if this iterator is forgotten, `Consumer::drop` publishes that head, so the moved-out
        //   value is never read or dropped again.
        let value = unsafe { slot_ptr(c.slots, c.mask, index).read() };
        c.head = index.wrapping_add(1);
        self.left -= 1;
        Some(value)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl<T> ExactSizeIterator for ReadChunkIntoIter<'_, T> {}

impl<T> Drop for ReadChunkIntoIter<'_, T> {
    fn drop(&mut self) {
        // Hand back the slots of the items taken: `next` already moved our own head past them.
        if self.left != self.len {
            let head = self.consumer.head;
            self.consumer.publish(head);
        }
    }
}

impl<T> fmt::Debug for ReadChunkIntoIter<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadChunkIntoIter").field("left", &self.left).finish_non_exhaustive()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
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
        let (mut tx, rx) =
            channel_with::<u32>(2, WaitStrategy::SpinYieldPark { spins: 0, yields: 0 });
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
}
