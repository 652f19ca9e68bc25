//! A fault-injecting block device for power-cut tests: writes land in a volatile image and
//! become durable only at a flush; [`FaultDisk::power_cut`] returns what a power cut at this
//! instant could leave on the medium (unflushed writes dropped, or some of them applied and
//! one torn at a random byte). With [`FaultDisk::deferred_flush`] a flush completes only some
//! `complete` calls after it was submitted and then makes durable exactly the writes that had
//! completed before its submission, so writes and flushes overlap as on a real queue. With
//! [`FaultDisk::with_flush_gate`] a closed [`FlushGate`] holds every flush until the test opens
//! it: inside `submit` (as a synchronous `fdatasync` blocks its caller) or in the queue (as an
//! io_uring flush runs on a kernel worker, `wait` sleeping until it completes); in the queue
//! it holds FUA writes too (written, not durable nor completed until it opens).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use fastlane_block::{
    BlockDevice, BlockError, BlockOp, BlockQueue, BlockRequest, Completion, DeviceInfo, QueueFull,
};

#[derive(Debug)]
struct State {
    durable: Vec<u8>,
    volatile: Vec<u8>,
    /// Writes not yet made durable, in submission order: (id, offset, bytes).
    pending: Vec<(u64, u64, Vec<u8>)>,
    next_id: u64,
}

/// How a power cut treats the unflushed writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cut {
    /// All lost.
    DropAll,
    /// A random subset applied in a random order, then one torn at a random byte.
    Tear,
}

#[derive(Debug, Clone)]
pub(crate) struct FaultDisk {
    state: Arc<Mutex<State>>,
    size: u64,
    /// Flushes complete this many `complete` calls after their submission (0: at once).
    flush_delay: u32,
    gate: Option<Arc<FlushGate>>,
}

/// Holds flushes while closed (see the module docs). Every wait on it is bounded by
/// [`GATE_TIMEOUT`], after which a held flush goes through anyway.
#[derive(Debug, Default)]
pub(crate) struct FlushGate {
    closed: Mutex<bool>,
    cv: Condvar,
    /// Flushes held now.
    held: AtomicU32,
    /// Hold inside `submit` (true) or in the queue (false).
    inline: bool,
}

const GATE_TIMEOUT: Duration = Duration::from_secs(10);

impl FlushGate {
    pub(crate) fn close(&self) {
        *self.closed.lock().unwrap_or_else(|p| p.into_inner()) = true;
    }

    pub(crate) fn open(&self) {
        *self.closed.lock().unwrap_or_else(|p| p.into_inner()) = false;
        self.cv.notify_all();
    }

    fn is_open(&self) -> bool {
        !*self.closed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Flushes held at the gate now.
    pub(crate) fn held(&self) -> u32 {
        self.held.load(Ordering::Acquire)
    }

    /// Blocks until the gate is open or `timeout` passed.
    fn wait_open(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut closed = self.closed.lock().unwrap_or_else(|p| p.into_inner());
        while *closed {
            let now = Instant::now();
            if now >= deadline {
                return;
            }
            closed = match self.cv.wait_timeout(closed, deadline - now) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }
}

impl FaultDisk {
    pub(crate) fn new(image: Vec<u8>) -> FaultDisk {
        let size = image.len() as u64;
        let state =
            State { durable: image.clone(), volatile: image, pending: Vec::new(), next_id: 0 };
        FaultDisk { state: Arc::new(Mutex::new(state)), size, flush_delay: 0, gate: None }
    }

    /// Adds a flush gate (open at first); `inline`: a held flush blocks `submit`, else the
    /// queue keeps it and `wait` sleeps until the gate opens or its timeout passes.
    pub(crate) fn with_flush_gate(mut self, inline: bool) -> (FaultDisk, Arc<FlushGate>) {
        let gate = Arc::new(FlushGate { inline, ..FlushGate::default() });
        self.gate = Some(Arc::clone(&gate));
        (self, gate)
    }

    /// The image as the device's reads see it (flushed or not).
    pub(crate) fn volatile(&self) -> Vec<u8> {
        self.lock().volatile.clone()
    }

    /// Makes flushes complete `calls` `complete` calls after submission (writes still
    /// complete at once), so the writer has writes and flushes in flight together.
    pub(crate) fn deferred_flush(mut self, calls: u32) -> FaultDisk {
        self.flush_delay = calls;
        self
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The image a power cut now would leave. `rng` drives the choices.
    pub(crate) fn power_cut(&self, cut: Cut, rng: &mut impl FnMut() -> u64) -> Vec<u8> {
        let st = self.lock();
        let mut img = st.durable.clone();
        if cut == Cut::Tear && !st.pending.is_empty() {
            let mut order: Vec<usize> = (0..st.pending.len()).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, (rng() % (i as u64 + 1)) as usize);
            }
            let applied = (rng() % (order.len() as u64 + 1)) as usize;
            for &i in &order[..applied] {
                let (_, off, bytes) = &st.pending[i];
                img[*off as usize..*off as usize + bytes.len()].copy_from_slice(bytes);
            }
            if applied < order.len() {
                let (_, off, bytes) = &st.pending[order[applied]];
                let torn = (rng() % (bytes.len() as u64 + 1)) as usize;
                img[*off as usize..*off as usize + torn].copy_from_slice(&bytes[..torn]);
            }
        }
        img
    }

    /// The durable image.
    pub(crate) fn durable(&self) -> Vec<u8> {
        self.lock().durable.clone()
    }
}

impl BlockDevice for FaultDisk {
    fn info(&self) -> DeviceInfo {
        DeviceInfo {
            size_bytes: self.size,
            block_size: 512,
            read_only: false,
            discard: false,
            write_zeroes: true,
            volatile_cache: true,
            max_segments: 16,
        }
    }

    fn open_queue(&self, depth: u32) -> std::io::Result<Box<dyn BlockQueue>> {
        Ok(Box::new(FaultQueue {
            disk: self.clone(),
            depth,
            done: VecDeque::new(),
            held: VecDeque::new(),
            fua_held: Vec::new(),
            gated: VecDeque::new(),
        }))
    }
}

struct FaultQueue {
    disk: FaultDisk,
    depth: u32,
    done: VecDeque<Completion>,
    /// Deferred flushes: completion, the last write id it covers, `complete` calls left.
    held: VecDeque<(Completion, Option<u64>, u32)>,
    /// With a flush delay: FUA writes whose completion (and durability: that write's bytes
    /// only) is held for a number of reaps that varies per write, so they complete, and
    /// become durable, out of order. Completion, write id, reaps left.
    fua_held: Vec<(Completion, u64, u32)>,
    /// Flushes held by a closed queue-side gate: completion, last write id, give-up time.
    gated: VecDeque<(Completion, Option<u64>, Instant)>,
}

/// Makes the writes with id <= `upto` durable.
fn make_durable(st: &mut State, upto: Option<u64>) {
    let Some(upto) = upto else { return };
    let pending = std::mem::take(&mut st.pending);
    for (id, o, b) in pending {
        if id <= upto {
            st.durable[o as usize..o as usize + b.len()].copy_from_slice(&b);
        } else {
            st.pending.push((id, o, b));
        }
    }
}

impl FaultQueue {
    /// Carries out `req` on the image; `defer_fua`: a FUA write stays pending (not durable)
    /// until a later flush or its release makes it so.
    fn run(&mut self, req: &BlockRequest<'_>, defer_fua: bool) -> Result<u32, BlockError> {
        let seg_len: u64 = req.segments.iter().map(|s| u64::from(s.len)).sum();
        let len = match req.op {
            BlockOp::Read | BlockOp::Write | BlockOp::WriteFua => seg_len,
            _ => req.len,
        };
        let end = req.offset.checked_add(len).filter(|&e| e <= self.disk.size);
        if req.op != BlockOp::Flush && end.is_none() {
            return Err(BlockError::OutOfRange { offset: req.offset, len });
        }
        let mut st = self.disk.lock();
        let mut off = req.offset as usize;
        match req.op {
            BlockOp::Read => {
                for s in req.segments {
                    let n = s.len as usize;
                    // SAFETY: `submit`'s contract: the segment is valid for writes of `len`
                    // bytes and nobody else touches it until the completion is drained.
                    let dst = unsafe { std::slice::from_raw_parts_mut(s.addr, n) };
                    dst.copy_from_slice(&st.volatile[off..off + n]);
                    off += n;
                }
            }
            BlockOp::Write | BlockOp::WriteFua => {
                let mut bytes = Vec::with_capacity(len as usize);
                for s in req.segments {
                    // SAFETY: `submit`'s contract: the segment is valid for reads of `len`
                    // bytes and nobody writes it until the completion is drained.
                    let src = unsafe { std::slice::from_raw_parts(s.addr, s.len as usize) };
                    bytes.extend_from_slice(src);
                }
                st.volatile[off..off + bytes.len()].copy_from_slice(&bytes);
                if req.op == BlockOp::WriteFua && self.disk.flush_delay == 0 && !defer_fua {
                    // Durable when it completes (now): these bytes only, not the writes
                    // pending before it.
                    st.durable[off..off + bytes.len()].copy_from_slice(&bytes);
                } else {
                    let id = st.next_id;
                    st.next_id += 1;
                    st.pending.push((id, req.offset, bytes));
                }
            }
            BlockOp::WriteZeroes { .. } | BlockOp::Discard => {
                let bytes = vec![0u8; len as usize];
                st.volatile[off..off + bytes.len()].copy_from_slice(&bytes);
                let id = st.next_id;
                st.next_id += 1;
                st.pending.push((id, req.offset, bytes));
            }
            BlockOp::Flush => {
                // Covers what completed before now: every write submitted so far (they
                // complete inline).
                let upto = st.next_id.checked_sub(1);
                make_durable(&mut st, upto);
            }
        }
        Ok(len.min(u64::from(u32::MAX)) as u32)
    }
}

impl BlockQueue for FaultQueue {
    unsafe fn submit<'a>(&mut self, req: BlockRequest<'a>) -> Result<(), QueueFull<'a>> {
        let busy = self.done.len() + self.held.len() + self.gated.len() + self.fua_held.len();
        if busy >= self.depth as usize {
            return Err(QueueFull(req));
        }
        if req.op == BlockOp::Flush {
            if let Some(g) = self.disk.gate.clone().filter(|g| !g.is_open()) {
                if g.inline {
                    g.held.fetch_add(1, Ordering::AcqRel);
                    g.wait_open(GATE_TIMEOUT);
                    g.held.fetch_sub(1, Ordering::AcqRel);
                } else {
                    let upto = self.disk.lock().next_id.checked_sub(1);
                    let c = Completion { tag: req.tag, result: Ok(0) };
                    g.held.fetch_add(1, Ordering::AcqRel);
                    self.gated.push_back((c, upto, Instant::now() + GATE_TIMEOUT));
                    return Ok(());
                }
            }
        }
        if req.op == BlockOp::Flush && self.disk.flush_delay > 0 {
            let upto = self.disk.lock().next_id.checked_sub(1);
            let c = Completion { tag: req.tag, result: Ok(0) };
            self.held.push_back((c, upto, self.disk.flush_delay));
            return Ok(());
        }
        // A closed queue-side gate holds FUA writes too: written (volatile), durable and
        // completed when the gate opens.
        let fua_gate = match &self.disk.gate {
            Some(g) if req.op == BlockOp::WriteFua && !g.inline && !g.is_open() => Some(g.clone()),
            _ => None,
        };
        let result = self.run(&req, fua_gate.is_some());
        if let (Some(g), Ok(_)) = (&fua_gate, &result) {
            let upto = self.disk.lock().next_id.checked_sub(1);
            g.held.fetch_add(1, Ordering::AcqRel);
            let c = Completion { tag: req.tag, result };
            self.gated.push_back((c, upto, Instant::now() + GATE_TIMEOUT));
            return Ok(());
        }
        if req.op == BlockOp::WriteFua && self.disk.flush_delay > 0 && result.is_ok() {
            let id = self.disk.lock().next_id - 1;
            let reaps = 1 + (id.wrapping_mul(2_654_435_761) % u64::from(self.disk.flush_delay));
            self.fua_held.push((Completion { tag: req.tag, result }, id, reaps as u32));
            return Ok(());
        }
        self.done.push_back(Completion { tag: req.tag, result });
        Ok(())
    }

    fn kick(&mut self) -> std::io::Result<()> {
        Ok(())
    }

    fn complete(&mut self, out: &mut [Completion]) -> usize {
        if let Some(g) = self.disk.gate.clone() {
            let open = g.is_open();
            let now = Instant::now();
            while self.gated.front().is_some_and(|h| open || now >= h.2) {
                let (c, upto, _) = self.gated.pop_front().expect("checked");
                make_durable(&mut self.disk.lock(), upto);
                g.held.fetch_sub(1, Ordering::AcqRel);
                self.done.push_back(c);
            }
        }
        for h in self.held.iter_mut() {
            h.2 = h.2.saturating_sub(1);
        }
        let mut i = 0;
        while i < self.fua_held.len() {
            self.fua_held[i].2 = self.fua_held[i].2.saturating_sub(1);
            if self.fua_held[i].2 == 0 {
                let (c, id, _) = self.fua_held.swap_remove(i);
                let mut st = self.disk.lock();
                let at = st.pending.iter().position(|p| p.0 == id);
                if let Some(at) = at {
                    let (_, o, b) = st.pending.remove(at);
                    st.durable[o as usize..o as usize + b.len()].copy_from_slice(&b);
                }
                drop(st);
                self.done.push_back(c);
            } else {
                i += 1;
            }
        }
        while self.held.front().is_some_and(|h| h.2 == 0) {
            let (c, upto, _) = self.held.pop_front().expect("checked");
            make_durable(&mut self.disk.lock(), upto);
            self.done.push_back(c);
        }
        let n = out.len().min(self.done.len());
        for slot in out.iter_mut().take(n) {
            *slot = self.done.pop_front().expect("counted");
        }
        n
    }

    fn wait(&mut self, timeout: Option<std::time::Duration>) -> std::io::Result<()> {
        // Only a gated flush makes this device slow: sleep until the gate opens (or the
        // timeout), as a real queue sleeps until its next completion.
        if let Some(g) = self.disk.gate.clone() {
            if self.done.is_empty()
                && self.held.is_empty()
                && self.fua_held.is_empty()
                && !self.gated.is_empty()
            {
                g.wait_open(timeout.unwrap_or(GATE_TIMEOUT).min(GATE_TIMEOUT));
            }
        }
        Ok(())
    }

    fn in_flight(&self) -> u32 {
        (self.done.len() + self.held.len() + self.gated.len()) as u32
    }
}
