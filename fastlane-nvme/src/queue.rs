//! I/O queue pairs: the SQ/CQ ring mechanics (shared with the admin queue) and
//! [`NvmeQueue`], the [`BlockQueue`] of one worker thread.
//!
//! # One queue's DMA region
//!
//! ```text
//! [ SQ: entries x 64 B ][ CQ: entries x 16 B ][ one page per command slot ][ bounce pages ]
//! ```
//!
//! A command slot's page holds its PRP list (or its Dataset Management ranges). The SQ and
//! CQ have the same number of entries and at most `entries - 1` commands are ever
//! outstanding, so neither ring can overflow. A request takes one request slot (of `depth`)
//! and one or more command slots (a large read or write is split into commands of at most
//! the transfer size; write-zeroes into 65536-block commands).
//!
//! # Hostile completions
//!
//! A completion entry is outside input: its command identifier is checked against the
//! command slots in use, and an entry that names no outstanding command is counted and
//! dropped, never trusted.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::cmd::{admin, nvm, Cqe, Sqe, DSM_RANGES_MAX, DSM_RANGE_BLOCKS_MAX, NLB_MAX};
use super::controller::{Controller, TransferCounters, TransferStats};
use super::dma::{page_round_up, DmaRegion, Translations};
use super::prp::{build_prp, clip, prp_compatible};
use super::regs::{self, PAGE_SIZE};
use super::rings::Rings;
use super::NvmeError;
use fastlane_block::{
    BlockError, BlockOp, BlockQueue, BlockRequest, Completion, QueueFull, Segment,
};

/// Empty polls between two health checks (clock read, CSTS read) while requests are in
/// flight. A poll is one volatile load, so this is microseconds.
const POLLS_PER_CHECK: u32 = 1024;
/// How long dropping a queue waits for its requests before failing the controller.
const DROP_WAIT: Duration = Duration::from_secs(30);

/// One request in flight.
#[derive(Debug)]
struct ReqSlot {
    tag: u64,
    op: BlockOp,
    /// Commands not yet completed.
    pending: u32,
    /// Bytes to report on success.
    bytes: u32,
    /// The first failure among its commands (or the rejection).
    error: Option<BlockError>,
    /// When the controller is declared failed if this request is still pending.
    deadline: Instant,
    /// Bounce pages held (indices into the queue's bounce area), in data order.
    bounce: Vec<u32>,
    /// For a bounced read: the caller's segments to copy into at completion.
    segments: Vec<Segment>,
}

/// A queue pair on an [`super::NvmeDevice`], owned by one thread.
pub struct NvmeQueue {
    ctrl: Arc<Controller>,
    qid: u16,
    rings: Rings,
    nsid: u32,
    block_shift: u32,
    size_bytes: u64,
    max_transfer: u64,
    max_segments: usize,
    read_only: bool,
    discard: bool,
    write_zeroes: bool,
    timeout: Duration,

    reqs: Vec<ReqSlot>,
    free_reqs: Vec<u16>,
    done: VecDeque<u16>,
    /// Command id -> request slot (`u16::MAX`: free).
    cmds: Vec<u16>,
    free_cmds: Vec<u16>,
    free_bounce: Vec<u32>,
    bounce_pages: u32,
    /// Scratch for one request's IOVA chunks.
    chunks: Vec<(u64, u32)>,

    xlat: Arc<Translations>,
    xlat_gen: u64,
    empty_polls: u32,
    /// Completion entries that named no outstanding command.
    spurious: u64,
    /// Zero copy versus bounced reads and writes (this queue writes them, the device sums).
    transfers: Arc<TransferCounters>,
    deleted: bool,

    prp_off: usize,
    bounce_off: usize,
    // Last: dropped after the controller queues are deleted (IOMMU unmap, then munmap).
    region: DmaRegion,
}

impl std::fmt::Debug for NvmeQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmeQueue")
            .field("qid", &self.qid)
            .field("entries", &self.rings.entries)
            .field("in_flight", &self.in_flight())
            .field("spurious", &self.spurious)
            .finish()
    }
}

// SAFETY: `Rings` is `Send` (see there); the rest is owned data and an `Arc` to the
// `Sync` controller. The queue is used by one thread at a time (`&mut self`).
unsafe impl Send for NvmeQueue {}

impl NvmeQueue {
    pub(crate) fn open(ctrl: Arc<Controller>, depth: u32) -> Result<NvmeQueue, NvmeError> {
        let errno = ctrl.failed_errno();
        if errno != 0 {
            return Err(NvmeError::Failed { errno });
        }
        let entries = (depth * 2).clamp(64, 4096).min(ctrl.cap.max_queue_entries());
        let cmd_slots = entries - 1;
        let sq_bytes = page_round_up(entries as usize * 64);
        let cq_bytes = page_round_up(entries as usize * 16);
        let bounce_pages = (page_round_up(ctrl.opts.bounce_bytes) / PAGE_SIZE) as u32;
        let prp_off = sq_bytes + cq_bytes;
        let bounce_off = prp_off + cmd_slots as usize * PAGE_SIZE;
        let region = ctrl.alloc_region(bounce_off + bounce_pages as usize * PAGE_SIZE)?;
        let qid = ctrl.take_qid()?;
        let stride = ctrl.cap.doorbell_stride_bytes();
        // SAFETY: SQ at 0 and CQ at `sq_bytes` hold `entries` entries each inside `region`
        // (zeroed by mmap), which the queue owns and drops last; the doorbells are BAR0's,
        // kept by the controller the queue holds an `Arc` to.
        let rings = unsafe {
            Rings::new(
                region.host(0).cast(),
                region.host(sq_bytes).cast(),
                entries,
                ctrl.bar.doorbell(regs::doorbell_offset(qid, false, stride)),
                ctrl.bar.doorbell(regs::doorbell_offset(qid, true, stride)),
            )
        };
        // Completion queue before its submission queue.
        let cq_iova = region.iova(sq_bytes);
        if let Err(e) =
            ctrl.admin_cmd(|cid| Sqe::create_cq(cid, qid, entries, cq_iova), "create I/O CQ")
        {
            ctrl.put_qid(qid);
            return Err(e);
        }
        let sq_iova = region.iova(0);
        if let Err(e) =
            ctrl.admin_cmd(|cid| Sqe::create_sq(cid, qid, entries, sq_iova, qid), "create I/O SQ")
        {
            let _ = ctrl
                .admin_cmd(|cid| Sqe::delete_queue(admin::DELETE_CQ, cid, qid), "delete I/O CQ");
            ctrl.put_qid(qid);
            return Err(e);
        }
        let info = ctrl.info();
        let max_segments = ctrl.opts.max_segments.max(1) as usize;
        let reqs = (0..depth)
            .map(|_| ReqSlot {
                tag: 0,
                op: BlockOp::Flush,
                pending: 0,
                bytes: 0,
                error: None,
                deadline: Instant::now(),
                bounce: Vec::with_capacity(bounce_pages as usize),
                segments: Vec::with_capacity(max_segments),
            })
            .collect();
        Ok(NvmeQueue {
            qid,
            rings,
            nsid: ctrl.opts.nsid,
            block_shift: ctrl.ns.block_size.trailing_zeros(),
            size_bytes: info.size_bytes,
            max_transfer: u64::from(ctrl.max_transfer_bytes),
            max_segments,
            read_only: info.read_only,
            discard: info.discard,
            write_zeroes: info.write_zeroes,
            timeout: ctrl.opts.command_timeout,
            reqs,
            free_reqs: (0..depth as u16).rev().collect(),
            done: VecDeque::with_capacity(depth as usize),
            cmds: vec![u16::MAX; cmd_slots as usize],
            free_cmds: (0..cmd_slots as u16).rev().collect(),
            free_bounce: (0..bounce_pages).rev().collect(),
            bounce_pages,
            chunks: Vec::with_capacity(max_segments.max(bounce_pages as usize)),
            xlat: ctrl.translations(),
            xlat_gen: ctrl.xlat_gen.load(Ordering::Acquire),
            empty_polls: 0,
            spurious: 0,
            transfers: ctrl.open_transfer_counters(),
            deleted: false,
            prp_off,
            bounce_off,
            region,
            ctrl,
        })
    }

    /// The queue identifier on the controller.
    pub fn qid(&self) -> u16 {
        self.qid
    }

    /// Completion entries seen that named no outstanding command (a misbehaving device).
    pub fn spurious_completions(&self) -> u64 {
        self.spurious
    }

    /// This queue's reads and writes so far, zero copy versus bounced.
    pub fn transfer_stats(&self) -> TransferStats {
        self.transfers.load()
    }

    fn refresh_translations(&mut self) {
        // Acquire: pairs with the Release increment in `Controller::publish`.
        let gen = self.ctrl.xlat_gen.load(Ordering::Acquire);
        if gen != self.xlat_gen {
            self.xlat = self.ctrl.translations();
            self.xlat_gen = gen;
        }
    }

    /// Finish request `slot` at once with `error` (it never reached the device).
    fn reject(&mut self, slot: u16, error: BlockError) {
        let r = &mut self.reqs[usize::from(slot)];
        r.error = Some(error);
        r.pending = 0;
        self.done.push_back(slot);
    }

    fn bounce_host(&self, page: u32) -> *mut u8 {
        self.region.host(self.bounce_off + page as usize * PAGE_SIZE)
    }

    fn bounce_iova(&self, page: u32) -> u64 {
        self.region.iova(self.bounce_off + page as usize * PAGE_SIZE)
    }

    /// Check a request against the device; `Err` is what it completes with.
    fn validate(&self, req: &BlockRequest<'_>) -> Result<u64, BlockError> {
        let writes = !matches!(req.op, BlockOp::Read | BlockOp::Flush);
        if writes && self.read_only {
            return Err(BlockError::ReadOnly);
        }
        let len = match req.op {
            BlockOp::Read | BlockOp::Write | BlockOp::WriteFua => {
                if req.segments.len() > self.max_segments {
                    return Err(BlockError::TooManySegments {
                        count: req.segments.len(),
                        max: self.max_segments,
                    });
                }
                req.segments.iter().map(|s| u64::from(s.len)).sum()
            }
            BlockOp::Flush => return Ok(0),
            BlockOp::Discard if !self.discard => return Err(BlockError::Unsupported),
            BlockOp::WriteZeroes { .. } if !self.write_zeroes => {
                return Err(BlockError::Unsupported)
            }
            BlockOp::Discard | BlockOp::WriteZeroes { .. } => req.len,
        };
        let oob = BlockError::OutOfRange { offset: req.offset, len };
        let end = req.offset.checked_add(len).ok_or(oob)?;
        if end > self.size_bytes
            || len > u64::from(u32::MAX)
                && matches!(req.op, BlockOp::Read | BlockOp::Write | BlockOp::WriteFua)
        {
            return Err(oob);
        }
        let align = 1u64 << self.block_shift;
        if !req.offset.is_multiple_of(align) || len % align != 0 {
            return Err(BlockError::Misaligned { offset: req.offset, len, align: align as u32 });
        }
        Ok(len)
    }

    /// How many commands `req` (of `len` valid bytes) needs.
    fn commands_needed(&self, op: BlockOp, len: u64) -> u64 {
        let blocks = len >> self.block_shift;
        match op {
            BlockOp::Read | BlockOp::Write | BlockOp::WriteFua => len.div_ceil(self.max_transfer),
            BlockOp::Flush => 1,
            BlockOp::WriteZeroes { .. } => blocks.div_ceil(NLB_MAX),
            BlockOp::Discard => {
                blocks.div_ceil(DSM_RANGE_BLOCKS_MAX).div_ceil(DSM_RANGES_MAX as u64)
            }
        }
    }

    fn take_cmd(&mut self, slot: u16) -> u16 {
        let cid = self.free_cmds.pop().expect("command slots counted before issuing");
        self.cmds[usize::from(cid)] = slot;
        cid
    }

    fn prp_page(&self, cid: u16) -> (*mut u64, u64) {
        let off = self.prp_off + usize::from(cid) * PAGE_SIZE;
        (self.region.host(off).cast(), self.region.iova(off))
    }

    /// Issue the commands of request `slot` covering `len` bytes at `offset`, over
    /// `self.chunks` for reads and writes.
    fn issue(&mut self, slot: u16, op: BlockOp, offset: u64, len: u64) {
        let slba0 = offset >> self.block_shift;
        let nsid = self.nsid;
        let mut count = 0u32;
        match op {
            BlockOp::Flush => {
                let cid = self.take_cmd(slot);
                self.rings.push(&Sqe::flush(cid, nsid));
                count = 1;
            }
            BlockOp::Read | BlockOp::Write | BlockOp::WriteFua => {
                let opcode = if op == BlockOp::Read { nvm::READ } else { nvm::WRITE };
                let mut done = 0u64;
                while done < len {
                    let n = (len - done).min(self.max_transfer);
                    let cid = self.take_cmd(slot);
                    let (list, list_iova) = self.prp_page(cid);
                    let (prp1, prp2) = build_prp(clip(&self.chunks, done, n), list_iova, |i, e| {
                        // SAFETY: `i < 512` (build_prp bounds it), inside this command
                        // slot's list page in the queue's region, which the device reads only
                        // after the doorbell; the slot is ours until its completion.
                        unsafe { list.wrapping_add(i).write_volatile(e) }
                    })
                    .expect("layout checked before issuing; transfer size bounds the list");
                    let slba = slba0 + (done >> self.block_shift);
                    let mut sqe = Sqe::rw(opcode, cid, nsid, slba, (n >> self.block_shift) as u32);
                    if op == BlockOp::WriteFua {
                        // Forced Unit Access: complete only once the data is on the medium.
                        sqe.cdw12 |= 1 << 30;
                    }
                    sqe.prp1 = prp1;
                    sqe.prp2 = prp2;
                    self.rings.push(&sqe);
                    done += n;
                    count += 1;
                }
            }
            BlockOp::WriteZeroes { unmap } => {
                let blocks = len >> self.block_shift;
                let mut b = 0u64;
                while b < blocks {
                    let n = (blocks - b).min(NLB_MAX);
                    let cid = self.take_cmd(slot);
                    self.rings.push(&Sqe::write_zeroes(cid, nsid, slba0 + b, n as u32, unmap));
                    b += n;
                    count += 1;
                }
            }
            BlockOp::Discard => {
                let blocks = len >> self.block_shift;
                let mut b = 0u64;
                while b < blocks {
                    let cid = self.take_cmd(slot);
                    let (list, list_iova) = self.prp_page(cid);
                    let mut ranges = 0usize;
                    while b < blocks && ranges < DSM_RANGES_MAX {
                        let n = (blocks - b).min(DSM_RANGE_BLOCKS_MAX);
                        // Range: context attributes (0), block count, starting LBA.
                        let words = [n << 32, slba0 + b];
                        for (k, w) in words.iter().enumerate() {
                            // SAFETY: range `ranges < 256` of 16 bytes lies in this command
                            // slot's page (4096 bytes), ours until its completion.
                            unsafe { list.wrapping_add(ranges * 2 + k).write_volatile(*w) };
                        }
                        b += n;
                        ranges += 1;
                    }
                    self.rings.push(&Sqe::deallocate(cid, nsid, ranges, list_iova));
                    count += 1;
                }
            }
        }
        let r = &mut self.reqs[usize::from(slot)];
        r.pending = count;
        r.deadline = Instant::now() + self.timeout;
    }

    /// Fill `self.chunks` with the request's IOVAs when it can go zero copy.
    fn translate(&mut self, segments: &[Segment]) -> bool {
        self.chunks.clear();
        for s in segments {
            if s.len == 0 {
                continue;
            }
            match self.xlat.lookup(s.addr as usize, s.len as usize) {
                Some(iova) => self.chunks.push((iova, s.len)),
                None => return false,
            }
        }
        prp_compatible(self.chunks.iter().copied())
    }

    /// Finish request `slot`: copy a bounced read back, free its resources, report it.
    fn finish(&mut self, slot: u16) -> Completion {
        let mut r = std::mem::replace(
            &mut self.reqs[usize::from(slot)],
            ReqSlot {
                tag: 0,
                op: BlockOp::Flush,
                pending: 0,
                bytes: 0,
                error: None,
                deadline: Instant::now(),
                bounce: Vec::new(),
                segments: Vec::new(),
            },
        );
        let result = match r.error {
            Some(e) => Err(e),
            None => Ok(r.bytes),
        };
        if result.is_ok() && r.op == BlockOp::Read && !r.bounce.is_empty() {
            let mut page_i = 0usize;
            let mut page_off = 0usize;
            for s in &r.segments {
                let mut done = 0usize;
                while done < s.len as usize {
                    let n = (PAGE_SIZE - page_off).min(s.len as usize - done);
                    // SAFETY:
                    // - source: bounce page `r.bounce[page_i]` in our region, written by the
                    //   device before the completions we have all seen (no DMA into it now);
                    // - destination: the caller's segment, valid and not accessed by anyone
                    //   else until this completion is returned (`submit`'s contract);
                    // - raw copy, no references; `n` stays inside both.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            self.bounce_host(r.bounce[page_i]).wrapping_add(page_off),
                            s.addr.wrapping_add(done),
                            n,
                        )
                    };
                    done += n;
                    page_off += n;
                    if page_off == PAGE_SIZE {
                        page_off = 0;
                        page_i += 1;
                    }
                }
            }
        }
        self.free_bounce.extend(r.bounce.drain(..).rev());
        r.segments.clear();
        // Put the slot (with its pre-allocated vectors) back.
        self.reqs[usize::from(slot)] = ReqSlot { error: None, pending: 0, ..r };
        self.free_reqs.push(slot);
        let tag = self.reqs[usize::from(slot)].tag;
        Completion { tag, result }
    }

    /// Health check while requests are in flight: deadline passed or fatal status fails the
    /// controller. Returns whether it is failed.
    fn check_health(&mut self) -> bool {
        if self.ctrl.check_fatal() {
            return true;
        }
        let now = Instant::now();
        let late = self.reqs.iter().any(|r| r.pending > 0 && now > r.deadline);
        if late {
            self.ctrl.fail(
                libc::ETIMEDOUT,
                &format!("queue {}: a command did not complete in {:?}", self.qid, self.timeout),
            );
        }
        late
    }

    /// The controller is failed (and its DMA stopped): finish everything outstanding.
    fn fail_all(&mut self, errno: i32) {
        for cid in 0..self.cmds.len() {
            let slot = self.cmds[cid];
            if slot == u16::MAX {
                continue;
            }
            self.cmds[cid] = u16::MAX;
            self.free_cmds.push(cid as u16);
            let r = &mut self.reqs[usize::from(slot)];
            r.error.get_or_insert(BlockError::Io(errno));
            r.pending -= 1;
            if r.pending == 0 {
                self.done.push_back(slot);
            }
        }
    }

    fn handle_cqe(&mut self, cqe: Cqe) -> Option<u16> {
        let cid = usize::from(cqe.cid);
        let slot = match self.cmds.get(cid) {
            Some(&s) if s != u16::MAX && cqe.sq_id == self.qid => s,
            _ => {
                self.spurious += 1;
                log::warn!(
                    "queue {}: completion for cid {} sq {} names no outstanding command",
                    self.qid,
                    cqe.cid,
                    cqe.sq_id
                );
                return None;
            }
        };
        self.cmds[cid] = u16::MAX;
        self.free_cmds.push(cid as u16);
        let r = &mut self.reqs[usize::from(slot)];
        let status = cqe.status();
        if !status.is_success() {
            log::debug!("queue {}: tag {} failed: {} ({status:?})", self.qid, r.tag, status.name());
            r.error.get_or_insert(status.to_block_error());
        }
        debug_assert!(r.pending > 0);
        r.pending -= 1;
        (r.pending == 0).then_some(slot)
    }

    fn delete_on_controller(&mut self) {
        if self.deleted {
            return;
        }
        self.deleted = true;
        let qid = self.qid;
        if self.ctrl.failed_errno() == 0 {
            // Submission queue first, then its completion queue.
            let sq = self
                .ctrl
                .admin_cmd(|cid| Sqe::delete_queue(admin::DELETE_SQ, cid, qid), "delete I/O SQ");
            let cq = self
                .ctrl
                .admin_cmd(|cid| Sqe::delete_queue(admin::DELETE_CQ, cid, qid), "delete I/O CQ");
            if let Err(e) = sq.and(cq) {
                log::warn!("queue {qid}: {e}");
                if self.ctrl.failed_errno() == 0 {
                    // The queue may still be live on the device: stop its DMA before the
                    // region is freed.
                    self.ctrl.fail(libc::EIO, &format!("queue {qid} could not be deleted"));
                }
            }
        }
        self.ctrl.put_qid(qid);
    }
}

impl BlockQueue for NvmeQueue {
    unsafe fn submit<'a>(&mut self, req: BlockRequest<'a>) -> Result<(), QueueFull<'a>> {
        let Some(&slot) = self.free_reqs.last() else {
            return Err(QueueFull(req));
        };
        let failed = self.ctrl.failed_errno();
        let verdict =
            if failed != 0 { Err(BlockError::Io(libc::ENODEV)) } else { self.validate(&req) };
        let len = match verdict {
            Ok(len) => len,
            Err(e) => {
                self.free_reqs.pop();
                self.reqs[usize::from(slot)].tag = req.tag;
                self.reject(slot, e);
                return Ok(());
            }
        };
        let rw = matches!(req.op, BlockOp::Read | BlockOp::Write | BlockOp::WriteFua);
        if rw && len == 0 {
            self.free_reqs.pop();
            let r = &mut self.reqs[usize::from(slot)];
            r.tag = req.tag;
            r.bytes = 0;
            self.done.push_back(slot);
            return Ok(());
        }
        let commands = self.commands_needed(req.op, len);
        if commands > self.cmds.len() as u64 {
            self.free_reqs.pop();
            self.reqs[usize::from(slot)].tag = req.tag;
            self.reject(slot, BlockError::Io(libc::E2BIG));
            return Ok(());
        }
        if commands > self.free_cmds.len() as u64 {
            return Err(QueueFull(req));
        }
        let mut bounced = false;
        if rw {
            self.refresh_translations();
            if !self.translate(req.segments) {
                let pages = len.div_ceil(PAGE_SIZE as u64);
                if pages > u64::from(self.bounce_pages) {
                    self.free_reqs.pop();
                    self.reqs[usize::from(slot)].tag = req.tag;
                    self.reject(slot, BlockError::Io(libc::E2BIG));
                    return Ok(());
                }
                if pages > self.free_bounce.len() as u64 {
                    return Err(QueueFull(req));
                }
                bounced = true;
            }
        }
        self.free_reqs.pop();
        let mut r = std::mem::replace(
            &mut self.reqs[usize::from(slot)],
            ReqSlot {
                tag: 0,
                op: BlockOp::Flush,
                pending: 0,
                bytes: 0,
                error: None,
                deadline: Instant::now(),
                bounce: Vec::new(),
                segments: Vec::new(),
            },
        );
        r.tag = req.tag;
        r.op = req.op;
        r.bytes = if rw { len as u32 } else { 0 };
        r.error = None;
        if rw {
            self.transfers.count(bounced, len);
        }
        if bounced {
            self.chunks.clear();
            let pages = len.div_ceil(PAGE_SIZE as u64) as usize;
            for k in 0..pages {
                let page = self.free_bounce.pop().expect("counted above");
                r.bounce.push(page);
                let n = (len as usize - k * PAGE_SIZE).min(PAGE_SIZE);
                self.chunks.push((self.bounce_iova(page), n as u32));
            }
            if matches!(req.op, BlockOp::Write | BlockOp::WriteFua) {
                let mut page_i = 0usize;
                let mut page_off = 0usize;
                for s in req.segments {
                    let mut done = 0usize;
                    while done < s.len as usize {
                        let n = (PAGE_SIZE - page_off).min(s.len as usize - done);
                        // SAFETY:
                        // - source: the caller's segment, valid for `len` and not written by
                        //   anyone while the request is pending (`submit`'s contract);
                        // - destination: our bounce page, which no command in flight uses
                        //   (taken from the free list just now);
                        // - raw copy, no references.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                s.addr.wrapping_add(done),
                                self.bounce_host(r.bounce[page_i]).wrapping_add(page_off),
                                n,
                            )
                        };
                        done += n;
                        page_off += n;
                        if page_off == PAGE_SIZE {
                            page_off = 0;
                            page_i += 1;
                        }
                    }
                }
            } else {
                r.segments.extend_from_slice(req.segments);
            }
        }
        self.reqs[usize::from(slot)] = r;
        // SAFETY (of what the device does next): the commands issued below name either the
        // caller's memory, kept alive and untouched until this request's completion by
        // `submit`'s contract (mapped by `map_external`/`alloc_dma`, whose owners keep the
        // IOMMU mapping until after), or this queue's bounce pages, which stay ours until
        // `finish`; the queue's region outlives every command (Drop waits or stops DMA).
        self.issue(slot, req.op, req.offset, len);
        Ok(())
    }

    fn kick(&mut self) -> std::io::Result<()> {
        self.rings.ring_sq();
        Ok(())
    }

    fn complete(&mut self, out: &mut [Completion]) -> usize {
        let mut n = 0;
        let errno = self.ctrl.failed_errno();
        if errno != 0 {
            self.fail_all(errno);
        }
        while n < out.len() {
            let Some(slot) = self.done.pop_front() else { break };
            out[n] = self.finish(slot);
            n += 1;
        }
        let mut reaped = false;
        while n < out.len() {
            let Some(cqe) = self.rings.pop() else { break };
            reaped = true;
            if let Some(slot) = self.handle_cqe(cqe) {
                out[n] = self.finish(slot);
                n += 1;
            }
        }
        if reaped {
            self.rings.ring_cq();
            self.empty_polls = 0;
        } else if n == 0 && self.in_flight() > 0 {
            self.empty_polls += 1;
            if self.empty_polls >= POLLS_PER_CHECK {
                self.empty_polls = 0;
                if self.check_health() {
                    self.fail_all(self.ctrl.failed_errno());
                }
            }
        }
        n
    }

    fn wait(&mut self, timeout: Option<Duration>) -> std::io::Result<()> {
        self.kick()?;
        let start = Instant::now();
        let mut polls = 0u32;
        loop {
            if self.in_flight() == 0 || !self.done.is_empty() || self.rings.ready() {
                return Ok(());
            }
            polls += 1;
            if polls.is_multiple_of(POLLS_PER_CHECK) {
                if self.check_health() || self.ctrl.failed_errno() != 0 {
                    self.fail_all(self.ctrl.failed_errno());
                    return Ok(());
                }
                if timeout.is_some_and(|t| start.elapsed() >= t) {
                    return Ok(());
                }
            }
            std::hint::spin_loop();
        }
    }

    fn in_flight(&self) -> u32 {
        (self.reqs.len() - self.free_reqs.len()) as u32
    }
}

impl Drop for NvmeQueue {
    fn drop(&mut self) {
        let _ = self.kick();
        let start = Instant::now();
        let mut out = [Completion::EMPTY; 16];
        while self.in_flight() > 0 {
            if start.elapsed() > DROP_WAIT {
                self.ctrl.fail(
                    libc::ETIMEDOUT,
                    &format!("queue {} dropped with requests stuck", self.qid),
                );
                self.fail_all(libc::ETIMEDOUT);
            }
            if self.complete(&mut out) == 0 {
                let _ = self.wait(Some(Duration::from_millis(10)));
            }
        }
        self.delete_on_controller();
        self.ctrl.close_transfer_counters(&self.transfers);
        // `region` drops after this: IOMMU unmap first, then munmap.
    }
}
