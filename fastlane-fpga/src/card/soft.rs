//! The card: a register BAR, the host side of the rings, and the software model.
//!
//! ```text
//!  host (HostQueue)                          card (SoftCard engine thread / FPGA)
//!  write Descriptor at desc[prod & mask]
//!  DESC_PROD doorbell  ───────────────────▶  sees DESC_PROD, reads desc[cons & mask]
//!                                            runs the op (reads src, writes dst)
//!                                            writes Completion at cpl[cpl_prod & mask],
//!                                            phase_flags last; bumps DESC_CONS, CPL_PROD
//!  reaps while phase == expected  ◀───────
//!  CPL_CONS doorbell (frees the slots) ────▶  card may reuse those completion slots
//! ```
//!
//! ## The seam for hardware
//!
//! [`HostQueue`] speaks the ABI over any [`Bar`]. The software model is
//! `HostQueue<Arc<SoftBar>>` plus an engine thread that plays the card on the same register
//! file. A VFIO backend opens the device's group and container, mmaps BAR0 and wraps it in
//! [`MmioBar`], maps the ring and data buffers with `VFIO_IOMMU_MAP_DMA` (IOVA = the
//! [`DmaBuffer`]'s address, as here) and builds `HostQueue<MmioBar>`: the callers of [`Card`]
//! do not change. What such a backend adds is only the mapping and an interrupt eventfd
//! (`VFIO_DEVICE_SET_IRQS`) in place of polling.

use std::mem::size_of;
use std::mem::{offset_of, ManuallyDrop};
use std::ptr::{self, NonNull};
use std::sync::atomic::{fence, AtomicBool, AtomicU16, AtomicU32, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::abi::{self, cpl_status, ctrl, reg, status, CardFault, Completion, Descriptor};
use super::clock::CardClock;
use super::dma::DmaBuffer;
use fastlane_market::book::{BookConfig, BookStats, OrderBooks};
use fastlane_market::event::Event;
use fastlane_market::filter::SymbolFilter;
use fastlane_market::itch::{decode_at, DecodeStats, Stock};

use super::error::CardError;

/// 32-bit register access to a card's BAR0.
pub trait Bar: Send + Sync {
    /// Read the register at byte `offset`.
    fn read32(&self, offset: usize) -> u32;
    /// Write the register at byte `offset`.
    fn write32(&self, offset: usize, value: u32);
}

impl<B: Bar + ?Sized> Bar for Arc<B> {
    fn read32(&self, offset: usize) -> u32 {
        (**self).read32(offset)
    }
    fn write32(&self, offset: usize, value: u32) {
        (**self).write32(offset, value)
    }
}

/// The software model's register file: atomics shared by the host and the engine thread.
/// Writes are release stores and reads acquire loads, like an uncached MMIO access that
/// orders after the host's earlier stores (the `wmb()` before a doorbell in a C driver).
#[derive(Debug)]
pub struct SoftBar {
    regs: Box<[AtomicU32]>,
    /// The clock behind `CLOCK_LO`/`CLOCK_HI`.
    clock: CardClock,
}

impl SoftBar {
    /// A register file reset to power-on values (ID, VERSION, CAPS set; the rest zero), with a
    /// clock whose epoch is now.
    pub fn new() -> Self {
        Self::with_clock(CardClock::new())
    }

    /// As [`new`](Self::new), with `CLOCK_LO`/`CLOCK_HI` reading `clock`.
    pub fn with_clock(clock: CardClock) -> Self {
        let regs: Box<[AtomicU32]> = (0..abi::BAR_SIZE / 4).map(|_| AtomicU32::new(0)).collect();
        let bar = Self { regs, clock };
        bar.write32(reg::ID, abi::ABI_MAGIC);
        bar.write32(reg::VERSION, abi::ABI_VERSION);
        bar.write32(reg::CAPS, abi::CAPS_ALL);
        bar
    }

    fn at(&self, offset: usize) -> &AtomicU32 {
        // Out-of-range offsets are our bug, not input: the register map is a constant.
        &self.regs[offset / 4]
    }
}

impl Default for SoftBar {
    fn default() -> Self {
        Self::new()
    }
}

impl Bar for SoftBar {
    fn read32(&self, offset: usize) -> u32 {
        if offset == reg::CLOCK_LO {
            // Reading LO samples the clock and latches HI, so LO-then-HI reads one instant.
            let now = self.clock.now_ns();
            self.at(reg::CLOCK_HI).store((now >> 32) as u32, Ordering::Release);
            return now as u32;
        }
        self.at(offset).load(Ordering::Acquire)
    }
    fn write32(&self, offset: usize, value: u32) {
        self.at(offset).store(value, Ordering::Release)
    }
}

/// A memory-mapped BAR (what a VFIO backend gets from mmapping the device's region 0).
#[derive(Debug)]
pub struct MmioBar {
    base: NonNull<u32>,
    len: usize,
}

// SAFETY: MMIO registers have no thread affinity; each access is one volatile 32-bit load or
// store, which the device serialises.
unsafe impl Send for MmioBar {}
// SAFETY: as above; `&MmioBar` only performs volatile single-register accesses.
unsafe impl Sync for MmioBar {}

impl MmioBar {
    /// Wrap a mapping of `len` bytes at `base`.
    ///
    /// # Safety
    /// `base` must be 4-byte aligned and point to a mapping of at least `len` bytes (a BAR
    /// mmapped from a VFIO device fd) that stays mapped for the life of the `MmioBar`, and
    /// nothing else may hold Rust references into it.
    pub unsafe fn new(base: NonNull<u8>, len: usize) -> Self {
        Self { base: base.cast(), len }
    }
}

impl Bar for MmioBar {
    fn read32(&self, offset: usize) -> u32 {
        assert!(offset.is_multiple_of(4) && offset + 4 <= self.len, "register offset {offset:#x}");
        // SAFETY:
        // - in bounds and aligned (asserted above; the base is 4-byte aligned per `new`);
        // - the mapping outlives `self` (contract of `new`); volatile because it is MMIO.
        unsafe { self.base.as_ptr().wrapping_add(offset / 4).read_volatile() }
    }
    fn write32(&self, offset: usize, value: u32) {
        assert!(offset.is_multiple_of(4) && offset + 4 <= self.len, "register offset {offset:#x}");
        // Order earlier stores to DMA memory (descriptors) before the doorbell.
        fence(Ordering::Release);
        // SAFETY: as in `read32`.
        unsafe { self.base.as_ptr().wrapping_add(offset / 4).write_volatile(value) }
    }
}

/// What every card backend offers: the DESIGN card's `post(desc) -> Result<(), Full>` /
/// `completions()` seam.
pub trait Card {
    /// Write a descriptor into the ring without ringing the doorbell.
    ///
    /// # Safety
    /// The descriptor's memory contract: `src_addr..+src_len` must be readable and
    /// `dst_addr..+dst_len` writable (for ops that use them), both must stay valid, `src`
    /// unmodified and `dst` untouched by the host, until the completion carrying this
    /// descriptor's tag has been returned by [`completions`](Card::completions), or the card
    /// has been dropped (not leaked: a leaked card may go on using the memory).
    unsafe fn enqueue(&mut self, desc: Descriptor) -> Result<(), CardError>;

    /// Tell the card about everything enqueued so far (one register write).
    fn doorbell(&mut self);

    /// [`enqueue`](Card::enqueue) then [`doorbell`](Card::doorbell).
    ///
    /// # Safety
    /// As for [`enqueue`](Card::enqueue).
    unsafe fn post(&mut self, desc: Descriptor) -> Result<(), CardError> {
        // SAFETY: the caller upholds `enqueue`'s contract, which is ours.
        unsafe { self.enqueue(desc)? };
        self.doorbell();
        Ok(())
    }

    /// Move finished completions into `out`, oldest first; returns how many.
    fn completions(&mut self, out: &mut [Completion]) -> usize;

    /// Descriptors enqueued and not yet completed.
    fn in_flight(&self) -> u32;

    /// `Err(Halted)` if the card stopped on a fault.
    fn check(&self) -> Result<(), CardError>;
}

/// The host side of one descriptor/completion ring pair over a [`Bar`].
#[derive(Debug)]
pub struct HostQueue<B: Bar> {
    bar: B,
    /// Freed in `Drop` only once the card has quiesced (leaked otherwise).
    desc_ring: ManuallyDrop<DmaBuffer>,
    desc_mask: u32,
    cpl_ring: ManuallyDrop<DmaBuffer>,
    cpl_mask: u32,
    desc_prod: u32,
    desc_prod_rung: u32,
    cpl_head: u32,
    phase: u16,
    in_flight: u32,
}

impl<B: Bar> HostQueue<B> {
    /// Check the card's identity, allocate the rings, reset the card, program and enable it.
    pub fn new(bar: B, desc_log2: u32, cpl_log2: u32) -> Result<Self, CardError> {
        let id = bar.read32(reg::ID);
        if id != abi::ABI_MAGIC {
            return Err(CardError::BadMagic { id });
        }
        let v = bar.read32(reg::VERSION);
        let (major, minor) = ((v >> 16) as u16, v as u16);
        if major != abi::ABI_VERSION_MAJOR {
            return Err(CardError::Version { major, minor });
        }
        for log2 in [desc_log2, cpl_log2] {
            if !(1..=abi::RING_LOG2_MAX).contains(&log2) {
                return Err(CardError::RingSize { log2 });
            }
        }
        let desc_ring = DmaBuffer::new(size_of::<Descriptor>() << desc_log2)?;
        let cpl_ring = DmaBuffer::new(size_of::<Completion>() << cpl_log2)?;
        bar.write32(reg::CONTROL, ctrl::RESET);
        let deadline = Instant::now() + Duration::from_secs(5);
        while bar.read32(reg::CONTROL) & ctrl::RESET != 0 {
            if Instant::now() > deadline {
                return Err(CardError::Timeout { tag: 0, waited: Duration::from_secs(5) });
            }
            std::thread::yield_now();
        }
        bar.write32(reg::DESC_BASE_LO, desc_ring.iova() as u32);
        bar.write32(reg::DESC_BASE_HI, (desc_ring.iova() >> 32) as u32);
        bar.write32(reg::DESC_RING_LOG2, desc_log2);
        bar.write32(reg::CPL_BASE_LO, cpl_ring.iova() as u32);
        bar.write32(reg::CPL_BASE_HI, (cpl_ring.iova() >> 32) as u32);
        bar.write32(reg::CPL_RING_LOG2, cpl_log2);
        bar.write32(reg::CONTROL, ctrl::ENABLE);
        Ok(Self {
            bar,
            desc_ring: ManuallyDrop::new(desc_ring),
            desc_mask: (1 << desc_log2) - 1,
            cpl_ring: ManuallyDrop::new(cpl_ring),
            cpl_mask: (1 << cpl_log2) - 1,
            desc_prod: 0,
            desc_prod_rung: 0,
            cpl_head: 0,
            phase: abi::PHASE_BIT,
            in_flight: 0,
        })
    }

    /// The register BAR.
    pub fn bar(&self) -> &B {
        &self.bar
    }

    /// The card clock from `CLOCK_LO` then `CLOCK_HI` (reading LO latches HI), ns.
    pub fn card_clock_ns(&self) -> u64 {
        let lo = self.bar.read32(reg::CLOCK_LO);
        let hi = self.bar.read32(reg::CLOCK_HI);
        u64::from(hi) << 32 | u64::from(lo)
    }

    /// Descriptor ring entries.
    pub fn desc_entries(&self) -> u32 {
        self.desc_mask + 1
    }

    /// Index the next enqueued descriptor gets (`& (desc_entries - 1)` is its slot).
    pub fn next_index(&self) -> u32 {
        self.desc_prod
    }

    fn window(&self) -> u32 {
        // Never more in flight than completion slots, so the card never waits on us.
        (self.desc_mask + 1).min(self.cpl_mask + 1)
    }
}

impl<B: Bar> Drop for HostQueue<B> {
    fn drop(&mut self) {
        // The card may still read descriptors or write completions: stop it, and free the
        // rings only when it says it has stopped (a card that never answers keeps them).
        self.bar.write32(reg::CONTROL, ctrl::RESET);
        let deadline = Instant::now() + Duration::from_secs(1);
        let quiet = loop {
            if self.bar.read32(reg::STATUS) & status::RUNNING == 0 {
                break true;
            }
            if Instant::now() > deadline {
                break false;
            }
            std::thread::yield_now();
        };
        if quiet {
            // SAFETY: the card is stopped (STATUS.RUNNING clear after RESET) and will not
            // touch the ring again; the field is not used after this.
            unsafe { ManuallyDrop::drop(&mut self.desc_ring) };
            // SAFETY: as above, for the completion ring.
            unsafe { ManuallyDrop::drop(&mut self.cpl_ring) };
        }
    }
}

impl<B: Bar> Card for HostQueue<B> {
    unsafe fn enqueue(&mut self, desc: Descriptor) -> Result<(), CardError> {
        if self.in_flight >= self.window() {
            return Err(CardError::Full(desc));
        }
        let slot = (self.desc_prod & self.desc_mask) as usize;
        // SAFETY:
        // - `slot` < ring entries, so the write is inside `desc_ring` (sized for them);
        // - the card reads this slot only after a DESC_PROD doorbell covering it, and it has
        //   finished reading it: the slot's previous descriptor completed (in_flight < window
        //   and the card completes in order);
        // - the descriptor's own memory contract is the caller's (this fn is unsafe).
        unsafe {
            (self.desc_ring.as_ptr() as *mut Descriptor).wrapping_add(slot).write_volatile(desc);
        }
        self.desc_prod = self.desc_prod.wrapping_add(1);
        self.in_flight += 1;
        Ok(())
    }

    fn doorbell(&mut self) {
        if self.desc_prod != self.desc_prod_rung {
            // Release: the descriptor stores above happen before the card's acquire load of
            // DESC_PROD in `Engine::run` (SoftBar), or before the MMIO write (MmioBar fence).
            self.bar.write32(reg::DESC_PROD, self.desc_prod);
            self.desc_prod_rung = self.desc_prod;
        }
    }

    fn completions(&mut self, out: &mut [Completion]) -> usize {
        let mut n = 0;
        while n < out.len() && self.in_flight > 0 {
            let slot = (self.cpl_head & self.cpl_mask) as usize;
            let entry = (self.cpl_ring.as_ptr() as *mut Completion).wrapping_add(slot);
            // SAFETY:
            // - `entry` is inside `cpl_ring` (slot < entries) and 2-aligned at offset 6;
            // - the card writes `phase_flags` only with an atomic release store (the
            //   `store` in `Engine::complete`), so this acquire load pairs with it.
            let phase_flags =
                unsafe { AtomicU16::from_ptr(phase_ptr(entry)) }.load(Ordering::Acquire);
            if phase_flags & abi::PHASE_BIT != self.phase {
                break;
            }
            // SAFETY: the acquire above orders the card's writes of this entry before this
            // read, and the card does not write the slot again until CPL_CONS passes it.
            out[n] = unsafe { entry.read_volatile() };
            n += 1;
            self.in_flight -= 1;
            self.cpl_head = self.cpl_head.wrapping_add(1);
            if self.cpl_head & self.cpl_mask == 0 {
                self.phase ^= abi::PHASE_BIT;
            }
        }
        if n > 0 {
            // Release: our reads of the reaped entries happen before the card reuses them.
            self.bar.write32(reg::CPL_CONS, self.cpl_head);
        }
        n
    }

    fn in_flight(&self) -> u32 {
        self.in_flight
    }

    fn check(&self) -> Result<(), CardError> {
        if self.bar.read32(reg::STATUS) & status::HALTED != 0 {
            return Err(CardError::Halted { fault: self.bar.read32(reg::ERROR) });
        }
        Ok(())
    }
}

/// Configuration of the software model.
#[derive(Debug, Clone)]
pub struct SoftCardConfig {
    /// log2 of the descriptor ring entries.
    pub desc_ring_log2: u32,
    /// log2 of the completion ring entries.
    pub cpl_ring_log2: u32,
    /// Order book sizing.
    pub book: BookConfig,
    /// Symbols for `ITCH_FILTER` (empty: the filter admits only market-wide messages).
    pub symbols: Vec<Stock>,
}

impl Default for SoftCardConfig {
    fn default() -> Self {
        Self {
            desc_ring_log2: 8,
            cpl_ring_log2: 8,
            book: BookConfig::default(),
            symbols: Vec::new(),
        }
    }
}

/// What the engine saw, handed back when the software card shuts down.
#[derive(Debug)]
pub struct EngineReport {
    /// Descriptors processed.
    pub descriptors: u64,
    /// ITCH decode counters.
    pub decode: DecodeStats,
    /// The books as the card holds them.
    pub books: OrderBooks,
    /// Book counters.
    pub book_stats: BookStats,
    /// Messages the symbol filter dropped.
    pub filtered_out: u64,
}

/// Staging bytes per descriptor slot for [`SoftCard::submit_itch`].
pub const ITCH_STAGING_BYTES: usize = 256;
/// Event slots per descriptor slot for [`SoftCard::submit_itch`].
pub const ITCH_EVENTS_PER_SLOT: usize = 16;

/// The software model of the card: an engine thread behind the real ABI.
#[derive(Debug)]
pub struct SoftCard {
    queue: HostQueue<Arc<SoftBar>>,
    stop: Arc<AtomicBool>,
    engine: Option<JoinHandle<EngineReport>>,
    clock: CardClock,
    /// One staging slot and one event slot per descriptor slot (owned here, so the safe
    /// `submit_itch` hands the card only memory that outlives it).
    staging: DmaBuffer,
    events: DmaBuffer,
}

impl SoftCard {
    /// Start the engine thread and bring the queue up.
    pub fn new(config: SoftCardConfig) -> Result<Self, CardError> {
        let clock = CardClock::new();
        let bar = Arc::new(SoftBar::with_clock(clock));
        let stop = Arc::new(AtomicBool::new(false));
        let entries = 1usize << config.desc_ring_log2.min(abi::RING_LOG2_MAX);
        let staging = DmaBuffer::new(entries * ITCH_STAGING_BYTES)?;
        let events = DmaBuffer::new(entries * ITCH_EVENTS_PER_SLOT * size_of::<Event>())?;
        let engine = Engine {
            bar: Arc::clone(&bar),
            stop: Arc::clone(&stop),
            clock,
            books: OrderBooks::new(config.book),
            filter: SymbolFilter::new(&config.symbols),
            decode: DecodeStats::default(),
            descriptors: 0,
            ring: None,
        };
        let handle = std::thread::Builder::new()
            .name("fastlane-softcard".into())
            .spawn(move || engine.run())
            .map_err(|_| CardError::Alloc { bytes: 0 })?;
        let queue = HostQueue::new(bar, config.desc_ring_log2, config.cpl_ring_log2);
        let queue = match queue {
            Ok(q) => q,
            Err(e) => {
                stop.store(true, Ordering::Release);
                let _ = handle.join();
                return Err(e);
            }
        };
        Ok(Self { queue, stop, engine: Some(handle), clock, staging, events })
    }

    /// The card's clock (same epoch as the engine's).
    pub fn clock(&self) -> CardClock {
        self.clock
    }

    /// The card clock read through the registers (`CLOCK_LO`/`CLOCK_HI`).
    pub fn register_clock_ns(&self) -> u64 {
        self.queue.card_clock_ns()
    }

    /// The register file, for inspection.
    pub fn bar(&self) -> &SoftBar {
        self.queue.bar()
    }

    /// Stop the engine and hand back what it saw. Completions not yet reaped are lost.
    pub fn shutdown(mut self) -> Option<EngineReport> {
        self.halt()
    }

    fn halt(&mut self) -> Option<EngineReport> {
        self.stop.store(true, Ordering::Release);
        self.engine.take().and_then(|h| h.join().ok())
    }

    fn wait_one(&mut self, tag: u32, timeout: Duration) -> Result<Completion, CardError> {
        let start = Instant::now();
        let mut c = [Completion::default()];
        let mut spins = 0u32;
        loop {
            if self.queue.completions(&mut c) == 1 {
                if c[0].tag != tag {
                    return Err(CardError::Protocol { reason: "completion for another tag" });
                }
                return Ok(c[0]);
            }
            self.queue.check()?;
            spins += 1;
            if spins.is_multiple_of(64) {
                if start.elapsed() > timeout {
                    // The card may still hold the caller's pointer: stop it before returning.
                    self.halt();
                    return Err(CardError::Timeout { tag, waited: timeout });
                }
                std::thread::yield_now();
            }
        }
    }

    fn idle(&self) -> Result<(), CardError> {
        if self.engine.is_none() {
            return Err(CardError::Halted { fault: 0 });
        }
        match self.queue.in_flight() {
            0 => Ok(()),
            in_flight => Err(CardError::Busy { in_flight }),
        }
    }

    /// CRC32C of `data` continuing from `seed` (0 to start), computed by the card.
    pub fn crc32c(&mut self, data: &[u8], seed: u32) -> Result<u32, CardError> {
        self.idle()?;
        let tag = self.queue.next_index();
        let desc = Descriptor {
            op: abi::OP_CRC32C,
            tag,
            src_addr: data.as_ptr() as u64,
            src_len: u32::try_from(data.len())
                .map_err(|_| CardError::TooLarge { bytes: data.len(), max: u32::MAX as usize })?,
            dst_len: seed,
            ..Descriptor::default()
        };
        // SAFETY: `data` is borrowed for this whole call and we return only after its
        // completion was reaped, or after `wait_one` stopped the engine (timeout/fault).
        unsafe { self.queue.post(desc)? };
        let c = self.wait_one(tag, Duration::from_secs(10))?;
        Ok(c.value as u32)
    }

    /// The card clock, as stamped by the card (`OP_TIMESTAMP`).
    pub fn timestamp(&mut self) -> Result<u64, CardError> {
        self.idle()?;
        let tag = self.queue.next_index();
        let desc = Descriptor { op: abi::OP_TIMESTAMP, tag, ..Descriptor::default() };
        // SAFETY: OP_TIMESTAMP touches no memory.
        unsafe { self.queue.post(desc)? };
        Ok(self.wait_one(tag, Duration::from_secs(10))?.value)
    }

    /// Copy `frames` (length-prefixed ITCH messages, at most [`ITCH_STAGING_BYTES`]) into the
    /// card-owned staging slot and post an `OP_ITCH` descriptor with `flags`; returns its tag.
    /// Results come back from [`reap_itch`](Self::reap_itch).
    pub fn submit_itch(&mut self, frames: &[u8], flags: u8) -> Result<u32, CardError> {
        if frames.len() > ITCH_STAGING_BYTES {
            return Err(CardError::TooLarge { bytes: frames.len(), max: ITCH_STAGING_BYTES });
        }
        if self.engine.is_none() {
            return Err(CardError::Halted { fault: 0 });
        }
        let tag = self.queue.next_index();
        let slot = (tag & self.queue.desc_mask) as usize;
        let src = self.staging.as_ptr().wrapping_add(slot * ITCH_STAGING_BYTES);
        let dst_bytes = ITCH_EVENTS_PER_SLOT * size_of::<Event>();
        let dst = self.events.as_ptr().wrapping_add(slot * dst_bytes);
        let desc = Descriptor {
            op: abi::OP_ITCH,
            flags,
            tag,
            src_addr: src as u64,
            src_len: frames.len() as u32,
            dst_len: dst_bytes as u32,
            dst_addr: dst as u64,
            ..Descriptor::default()
        };
        if self.queue.in_flight() >= self.queue.window() {
            return Err(CardError::Full(desc));
        }
        // SAFETY:
        // - `src` is slot `slot` of `staging` (entries * ITCH_STAGING_BYTES bytes), and
        //   `frames.len()` <= ITCH_STAGING_BYTES;
        // - the card is not reading this slot: the descriptor that last used it completed
        //   (in-flight < window <= entries, completions in order).
        unsafe { ptr::copy_nonoverlapping(frames.as_ptr(), src, frames.len()) };
        // SAFETY: `staging` and `events` are owned by `self`, and `Drop` stops the engine
        // before they are freed; the slot is not reused before this tag is reaped (above).
        unsafe { self.queue.post(desc)? };
        Ok(tag)
    }

    /// Reap finished `OP_ITCH` descriptors: `f(completion, events)` for each, oldest first.
    /// Returns how many were reaped. Event counts the card reports beyond the slot are
    /// clamped (and reported as a protocol error after the callbacks).
    pub fn reap_itch(
        &mut self,
        mut f: impl FnMut(&Completion, &[Event]),
    ) -> Result<usize, CardError> {
        let mut batch = [Completion::default(); 32];
        let n = self.queue.completions(&mut batch);
        let mut bad = false;
        let mut evs = [Event::default(); ITCH_EVENTS_PER_SLOT];
        for c in &batch[..n] {
            let slot = (c.tag & self.queue.desc_mask) as usize;
            let count = (c.events as usize).min(ITCH_EVENTS_PER_SLOT);
            bad |= count != c.events as usize;
            let base = self.events.as_ptr() as *const Event;
            for (i, e) in evs.iter_mut().enumerate().take(count) {
                // SAFETY:
                // - slot < entries and i < ITCH_EVENTS_PER_SLOT: inside `events`;
                // - the completion was reaped (acquire on its phase), so the card's writes
                //   of these events happened before, and it writes them no more until the
                //   slot is posted again.
                *e = unsafe { base.wrapping_add(slot * ITCH_EVENTS_PER_SLOT + i).read_volatile() };
            }
            f(c, &evs[..count]);
        }
        if bad {
            return Err(CardError::Protocol { reason: "event count beyond the slot" });
        }
        self.queue.check()?;
        Ok(n)
    }
}

impl Card for SoftCard {
    unsafe fn enqueue(&mut self, desc: Descriptor) -> Result<(), CardError> {
        // SAFETY: same contract, passed on.
        unsafe { self.queue.enqueue(desc) }
    }
    fn doorbell(&mut self) {
        self.queue.doorbell()
    }
    fn completions(&mut self, out: &mut [Completion]) -> usize {
        self.queue.completions(out)
    }
    fn in_flight(&self) -> u32 {
        self.queue.in_flight()
    }
    fn check(&self) -> Result<(), CardError> {
        if self.engine.is_none() {
            return Err(CardError::Halted { fault: 0 });
        }
        self.queue.check()
    }
}

impl Drop for SoftCard {
    fn drop(&mut self) {
        // Join before the fields (rings, staging, event buffers) are freed.
        self.halt();
    }
}

struct EngineRing {
    desc: *const Descriptor,
    desc_mask: u32,
    cpl: *mut Completion,
    cpl_mask: u32,
    desc_cons: u32,
    cpl_prod: u32,
    phase: u16,
}

struct Engine {
    bar: Arc<SoftBar>,
    stop: Arc<AtomicBool>,
    clock: CardClock,
    books: OrderBooks,
    filter: SymbolFilter,
    decode: DecodeStats,
    descriptors: u64,
    ring: Option<EngineRing>,
}

// SAFETY: the raw ring pointers in `EngineRing` are addresses the host programmed into the
// BAR (DMA memory owned by the host's `HostQueue`), used only by this thread.
unsafe impl Send for Engine {}

impl Engine {
    fn fault(&self, f: CardFault) {
        self.bar.write32(reg::ERROR, f as u32);
        self.bar.write32(reg::ERROR_COUNT, self.bar.read32(reg::ERROR_COUNT).wrapping_add(1));
        self.bar.write32(reg::STATUS, status::HALTED);
    }

    fn configure(&mut self) -> Option<EngineRing> {
        let base = |lo, hi| u64::from(self.bar.read32(lo)) | u64::from(self.bar.read32(hi)) << 32;
        let desc = base(reg::DESC_BASE_LO, reg::DESC_BASE_HI);
        let cpl = base(reg::CPL_BASE_LO, reg::CPL_BASE_HI);
        let dl = self.bar.read32(reg::DESC_RING_LOG2);
        let cl = self.bar.read32(reg::CPL_RING_LOG2);
        let ok = |a: u64, l: u32| {
            a != 0 && a.is_multiple_of(4096) && (1..=abi::RING_LOG2_MAX).contains(&l)
        };
        if !ok(desc, dl) || !ok(cpl, cl) {
            self.fault(CardFault::BadRingConfig);
            return None;
        }
        Some(EngineRing {
            desc: desc as *const Descriptor,
            desc_mask: (1 << dl) - 1,
            cpl: cpl as *mut Completion,
            cpl_mask: (1 << cl) - 1,
            desc_cons: 0,
            cpl_prod: 0,
            phase: abi::PHASE_BIT,
        })
    }

    fn run(mut self) -> EngineReport {
        let mut idle = 0u32;
        while !self.stop.load(Ordering::Acquire) {
            let control = self.bar.read32(reg::CONTROL);
            if control & ctrl::RESET != 0 {
                self.ring = None;
                for r in [
                    reg::STATUS,
                    reg::ERROR,
                    reg::DESC_PROD,
                    reg::DESC_CONS,
                    reg::CPL_PROD,
                    reg::CPL_CONS,
                ] {
                    self.bar.write32(r, 0);
                }
                self.bar.write32(reg::CONTROL, control & !ctrl::RESET);
                continue;
            }
            let halted = self.bar.read32(reg::STATUS) & status::HALTED != 0;
            if control & ctrl::ENABLE == 0 || halted {
                backoff(&mut idle);
                continue;
            }
            if self.ring.is_none() {
                self.ring = self.configure();
                if self.ring.is_none() {
                    continue;
                }
                self.bar.write32(reg::STATUS, status::RUNNING);
            }
            if self.step(control) {
                idle = 0;
            } else {
                backoff(&mut idle);
            }
        }
        // No longer running: the host may free the rings.
        self.bar.write32(reg::STATUS, 0);
        EngineReport {
            descriptors: self.descriptors,
            decode: self.decode,
            book_stats: *self.books.stats(),
            books: self.books,
            filtered_out: self.filter.dropped(),
        }
    }

    /// Process what the doorbell covers; false if there was nothing to do.
    // The `expect`s re-borrow `self.ring` after `self.execute`/`self.complete` (which need
    // `&mut self`): it is `Some` (checked on entry) and only `run`, between steps, sets it to
    // `None`, so they cannot fail.
    #[allow(clippy::expect_used)]
    fn step(&mut self, control: u32) -> bool {
        let Some(ring) = self.ring.as_mut() else { return false };
        // Acquire: pairs with the host's release store of DESC_PROD in `HostQueue::doorbell`.
        let prod = self.bar.read32(reg::DESC_PROD);
        let pending = prod.wrapping_sub(ring.desc_cons);
        if pending == 0 {
            return false;
        }
        if pending > ring.desc_mask + 1 {
            // The host claims more descriptors than the ring holds: refuse, like hardware.
            self.fault(CardFault::DoorbellOverrun);
            return false;
        }
        let mut did = false;
        for _ in 0..pending {
            let ring = self.ring.as_mut().expect("configured");
            // Completion ring room: the host's CPL_CONS (acquire, pairs with its release).
            let host_cons = self.bar.read32(reg::CPL_CONS);
            if ring.cpl_prod.wrapping_sub(host_cons) > ring.cpl_mask {
                break;
            }
            let slot = (ring.desc_cons & ring.desc_mask) as usize;
            // SAFETY:
            // - the host programmed `desc` as a ring of desc_mask+1 descriptors (checked
            //   non-null and aligned in `configure`) and keeps it alive while enabled;
            // - the slot is covered by the DESC_PROD we acquired, so the host's write of it
            //   happened before; volatile because it is device-visible memory.
            let desc = unsafe { ring.desc.wrapping_add(slot).read_volatile() };
            ring.desc_cons = ring.desc_cons.wrapping_add(1);
            let mut c = self.execute(&desc);
            c.tag = desc.tag;
            self.complete(c);
            did = true;
        }
        let ring = self.ring.as_ref().expect("configured");
        self.bar.write32(reg::DESC_CONS, ring.desc_cons);
        self.bar.write32(reg::CPL_PROD, ring.cpl_prod);
        if did && control & ctrl::IRQ_ENABLE != 0 && self.bar.read32(reg::IRQ_MASK) & 1 == 0 {
            self.bar.write32(reg::IRQ_STATUS, 1);
        }
        did
    }

    // Called only from `step`, while `self.ring` is `Some` (see there): cannot fail.
    #[allow(clippy::expect_used)]
    fn complete(&mut self, mut c: Completion) {
        let ring = self.ring.as_mut().expect("configured");
        c.timestamp_ns = self.clock.now_ns();
        let slot = (ring.cpl_prod & ring.cpl_mask) as usize;
        let entry = ring.cpl.wrapping_add(slot);
        // SAFETY:
        // - `entry` is inside the host's completion ring (slot <= cpl_mask);
        // - the host is not reading it: it is past the host's CPL_CONS (checked in `step`);
        // - fields other than `phase_flags` are plain volatile stores; `phase_flags` is
        //   stored last, atomically with release, pairing with the host's acquire load in
        //   `HostQueue::completions`.
        // Field by field: a wider store would cover the phase word, which the host may be
        // polling; only the final atomic store touches it.
        let tag = entry as *mut u32;
        // SAFETY: (for this and the next three blocks)
        // - `entry` is inside the host's completion ring (slot <= cpl_mask), 8-aligned;
        // - the host is not reading it: it is past the host's CPL_CONS (checked in `step`),
        //   except for the atomic phase word, which only the last store below touches.
        unsafe { tag.write_volatile(c.tag) };
        let status = (entry as *mut u8).wrapping_add(offset_of!(Completion, status)) as *mut u16;
        // SAFETY: as above; bytes 4..6 of the entry.
        unsafe { status.write_volatile(c.status) };
        let tail = (entry as *mut u8).wrapping_add(offset_of!(Completion, value)) as *mut CplTail;
        // SAFETY: as above; `CplTail` covers bytes 8..32 of the entry.
        unsafe {
            tail.write_volatile(CplTail {
                value: c.value,
                events: c.events,
                errors: c.errors,
                timestamp_ns: c.timestamp_ns,
            })
        };
        // SAFETY: as above; the phase word is written last, atomically with release, pairing
        // with the host's acquire load in `HostQueue::completions`.
        let phase = unsafe { AtomicU16::from_ptr(phase_ptr(entry)) };
        phase.store(ring.phase, Ordering::Release);
        ring.cpl_prod = ring.cpl_prod.wrapping_add(1);
        if ring.cpl_prod & ring.cpl_mask == 0 {
            ring.phase ^= abi::PHASE_BIT;
        }
    }

    fn execute(&mut self, d: &Descriptor) -> Completion {
        self.descriptors += 1;
        let mut c = Completion::default();
        match d.op {
            abi::OP_NOP => {}
            abi::OP_TIMESTAMP => c.value = self.clock.now_ns(),
            abi::OP_CRC32C => {
                if d.src_addr == 0 && d.src_len != 0 {
                    c.status = cpl_status::BAD_DESCRIPTOR;
                    return c;
                }
                // SAFETY: the host's `post` contract: `src_addr..+src_len` is readable and
                // unmodified until this completion is reaped; the slice dies within this arm.
                let src = unsafe { src_of(d) };
                c.value = u64::from(crc32c::crc32c_append(d.dst_len, src));
            }
            abi::OP_ITCH => {
                if (d.src_addr == 0 && d.src_len != 0)
                    || (d.dst_len != 0 && (d.dst_addr == 0 || !d.dst_addr.is_multiple_of(8)))
                {
                    c.status = cpl_status::BAD_DESCRIPTOR;
                    return c;
                }
                self.itch(d, &mut c);
            }
            _ => c.status = cpl_status::UNSUPPORTED_OP,
        }
        c
    }

    fn itch(&mut self, d: &Descriptor, c: &mut Completion) {
        // SAFETY: as for OP_CRC32C: the host keeps `src` readable and unmodified until this
        // descriptor's completion is reaped; the slice is dropped when this op returns.
        let src = unsafe { src_of(d) };
        let cap = d.dst_len as usize / size_of::<Event>();
        let dst = d.dst_addr as *mut Event;
        let need = usize::from(d.flags & abi::ITCH_EVENTS != 0)
            + usize::from(d.flags & abi::ITCH_BOOK != 0);
        let mut written = 0usize;
        let mut pos = 0usize;
        let anomalies_before = self.books.stats().anomalies();
        let put = |e: Event, written: &mut usize| {
            // SAFETY: *written < cap, so the event lies in `dst..+dst_len`, which the host's
            // `post` contract makes writable and untouched by the host until completion;
            // `dst` is 8-byte aligned (checked in `execute`).
            unsafe { dst.wrapping_add(*written).write_volatile(e) };
            *written += 1;
        };
        while pos < src.len() {
            if written + need > cap {
                c.status = cpl_status::DST_FULL;
                break;
            }
            let rest = &src[pos..];
            if rest.len() < 2 {
                self.decode.truncated += 1;
                c.errors += 1;
                pos = src.len();
                break;
            }
            let len = usize::from(u16::from_be_bytes([rest[0], rest[1]]));
            let Some(payload) = rest.get(2..2 + len) else {
                self.decode.truncated += 1;
                c.errors += 1;
                pos = src.len();
                break;
            };
            let offset = pos as u64;
            pos += 2 + len;
            self.decode.bytes += 2 + len as u64;
            let m = match decode_at(payload, offset) {
                Ok(m) => m,
                Err(e) => {
                    self.decode.count_error(&e);
                    c.errors += 1;
                    continue;
                }
            };
            self.decode.messages += 1;
            self.decode.by_type[usize::from(m.msg_type)] += 1;
            if d.flags & abi::ITCH_FILTER != 0 && !self.filter.admit(&m) {
                continue;
            }
            if d.flags & abi::ITCH_EVENTS != 0 {
                put(Event::from_message(&m), &mut written);
            }
            if d.flags & abi::ITCH_BOOK != 0 {
                if let Some(t) = self.books.apply(&m) {
                    put(Event::top_of_book(&t, &m), &mut written);
                }
            }
        }
        c.errors += (self.books.stats().anomalies() - anomalies_before) as u32;
        c.value = pos as u64;
        c.events = written as u32;
    }
}

fn backoff(idle: &mut u32) {
    *idle = idle.saturating_add(1);
    if *idle < 64 {
        std::hint::spin_loop();
    } else if *idle < 2048 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// Bytes 8..32 of a completion.
#[repr(C)]
struct CplTail {
    value: u64,
    events: u32,
    errors: u32,
    timestamp_ns: u64,
}

const _: () = assert!(offset_of!(Completion, tag) == 0 && offset_of!(Completion, value) == 8);
const _: () = assert!(size_of::<CplTail>() == 24);

/// The phase word of a completion entry (no dereference: offset arithmetic only).
fn phase_ptr(entry: *mut Completion) -> *mut u16 {
    (entry as *mut u8).wrapping_add(offset_of!(Completion, phase_flags)) as *mut u16
}

/// The input of a descriptor as a slice borrowed for as long as the descriptor.
///
/// # Safety
/// `src_addr..+src_len` must be readable (or `src_len` 0) and not written during the borrow.
unsafe fn src_of(d: &Descriptor) -> &[u8] {
    if d.src_len == 0 || d.src_addr == 0 {
        return &[];
    }
    // SAFETY: the caller's contract (the host's `post` contract for this descriptor).
    unsafe { std::slice::from_raw_parts(d.src_addr as *const u8, d.src_len as usize) }
}
