//! The controller: bring-up, the admin queue, identify, queue creation, DMA mappings, failure.
//! Shared by the queues ([`super::queue`]) and the device handle ([`super::device`]), and
//! depends on neither.

use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::cmd::{ControllerId, Cqe, NamespaceId, Sqe};
use super::dma::{DmaRegion, IovaSpace, Mapping, Translations};
use super::pci::VfioPci;
use super::regs::{self, Bar, Cap, PAGE_SIZE};
use super::rings::Rings;
use super::{NvmeError, NvmeOptions};
use fastlane_block::DeviceInfo;

/// Admin queue entries (one command at a time is ever outstanding).
const ADMIN_ENTRIES: u32 = 32;
/// Deepest I/O queue `open_queue` accepts.
pub const NVME_QUEUE_DEPTH_MAX: u32 = 1024;
/// Bound on waiting for a shutdown to finish.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(5);
/// Largest transfer of one command, whatever MDTS says (one PRP list page).
const TRANSFER_CAP: u32 = 1 << 20;

/// The admin queue: its rings and its region (ASQ page, ACQ page, one data page).
struct AdminQueue {
    rings: Rings,
    next_cid: u16,
    // Dropped after `rings` (which points into it): IOMMU unmap, then munmap.
    region: DmaRegion,
}

const ADMIN_ASQ: usize = 0;
const ADMIN_ACQ: usize = PAGE_SIZE * 2;
const ADMIN_DATA: usize = PAGE_SIZE * 3;
const ADMIN_REGION: usize = PAGE_SIZE * 4;

/// Everything queues share; dropped when the device and its last queue are gone.
pub(crate) struct Controller {
    pub(crate) bar: Bar,
    pub(crate) cap: Cap,
    pub(crate) ctrl_id: ControllerId,
    pub(crate) ns: NamespaceId,
    pub(crate) opts: NvmeOptions,
    /// Bytes one command moves at most (MDTS, the options and 1 MiB).
    pub(crate) max_transfer_bytes: u32,
    io_queues: u16,
    qids_used: Mutex<Vec<bool>>,
    /// 0 while healthy, else the errno in-flight requests completed with.
    failed_errno: AtomicI32,
    iovas: Mutex<IovaSpace>,
    xlat: Mutex<Arc<Translations>>,
    /// Bumped (Release) after each change of `xlat`; queues compare (Acquire) per submit.
    pub(crate) xlat_gen: AtomicU64,
    /// Mappings made by `map_external` (not owned by a `DmaBuffer`) with the caller's key
    /// for what backs them, unmapped on drop.
    pub(crate) external: Mutex<Vec<(Mapping, u64)>>,
    /// The counters of the open queues (each written by its queue only).
    transfers_open: Mutex<Vec<Arc<TransferCounters>>>,
    /// The sums of the queues closed so far.
    transfers_closed: TransferCounters,
    admin: Mutex<AdminQueue>,
    // Last: the BAR mapping and the VFIO fds outlive everything above.
    pub(crate) pci: VfioPci,
}

impl std::fmt::Debug for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller")
            .field("bdf", &self.pci.bdf())
            .field("model", &self.ctrl_id.model)
            .field("ns", &self.ns)
            .field("failed_errno", &self.failed_errno.load(Ordering::Relaxed))
            .finish()
    }
}

fn wait_until(
    timeout: Duration,
    what: &'static str,
    mut done: impl FnMut() -> Result<bool, NvmeError>,
) -> Result<(), NvmeError> {
    let start = Instant::now();
    loop {
        if done()? {
            return Ok(());
        }
        if start.elapsed() > timeout {
            return Err(NvmeError::Timeout { what, ms: timeout.as_millis() as u64 });
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// Reads and writes of a device by how their data reached it, summed over its queues.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransferStats {
    /// Requests whose segments went to the device as they were (zero copy: every segment in
    /// mapped memory, in a PRP-compatible layout).
    pub direct_requests: u64,
    /// Requests copied through a queue's bounce pages.
    pub bounced_requests: u64,
    /// Bytes of the bounced requests.
    pub bounced_bytes: u64,
}

/// One queue's transfer counters. Written by the owning queue only (a load and a store, no
/// read-modify-write on the data path); read by anyone (`Relaxed`: statistics, no ordering
/// with other memory is implied).
#[derive(Debug, Default)]
pub(crate) struct TransferCounters {
    direct_requests: AtomicU64,
    bounced_requests: AtomicU64,
    bounced_bytes: AtomicU64,
}

impl TransferCounters {
    /// Count one read or write of `bytes` (single writer: the queue owning the counters).
    pub(crate) fn count(&self, bounced: bool, bytes: u64) {
        let bump =
            |c: &AtomicU64, n: u64| c.store(c.load(Ordering::Relaxed) + n, Ordering::Relaxed);
        if bounced {
            bump(&self.bounced_requests, 1);
            bump(&self.bounced_bytes, bytes);
        } else {
            bump(&self.direct_requests, 1);
        }
    }

    pub(crate) fn load(&self) -> TransferStats {
        TransferStats {
            direct_requests: self.direct_requests.load(Ordering::Relaxed),
            bounced_requests: self.bounced_requests.load(Ordering::Relaxed),
            bounced_bytes: self.bounced_bytes.load(Ordering::Relaxed),
        }
    }

    /// Add `s` (many writers: read-modify-write).
    fn absorb(&self, s: TransferStats) {
        self.direct_requests.fetch_add(s.direct_requests, Ordering::Relaxed);
        self.bounced_requests.fetch_add(s.bounced_requests, Ordering::Relaxed);
        self.bounced_bytes.fetch_add(s.bounced_bytes, Ordering::Relaxed);
    }
}

impl Controller {
    pub(crate) fn bring_up(pci: VfioPci, opts: NvmeOptions) -> Result<Controller, NvmeError> {
        let bar = pci.bar0();
        let cap = Cap(bar.read64(regs::REG_CAP));
        if !cap.nvm_command_set() {
            return Err(NvmeError::Unsupported { what: "NVM command set" });
        }
        if cap.page_size_min_bytes() > PAGE_SIZE as u64 {
            return Err(NvmeError::Unsupported { what: "4 KiB memory pages" });
        }
        let ready_timeout = Duration::from_millis(cap.ready_timeout_ms().max(500));

        // Reset: disable and wait for RDY to drop.
        let cc = bar.read32(regs::REG_CC);
        if cc & regs::CC_EN != 0 {
            bar.write32(regs::REG_CC, cc & !regs::CC_EN);
        }
        wait_until(ready_timeout, "controller disable (CSTS.RDY = 0)", || {
            Ok(bar.read32(regs::REG_CSTS) & regs::CSTS_RDY == 0)
        })?;

        // Admin queue.
        let mut iovas = IovaSpace::default();
        let region = DmaRegion::new(pci.container(), &mut iovas, ADMIN_REGION)?;
        let stride = cap.doorbell_stride_bytes();
        // SAFETY: SQ and CQ lie in `region` (ASQ at 0, 2 pages; ACQ at 2 pages, 1 page:
        // 32 * 64 and 32 * 16 bytes), which `AdminQueue` keeps alive as long as the rings;
        // the doorbells are in BAR0, which the controller (owner of the admin queue) keeps.
        let rings = unsafe {
            Rings::new(
                region.host(ADMIN_ASQ).cast(),
                region.host(ADMIN_ACQ).cast(),
                ADMIN_ENTRIES,
                bar.doorbell(regs::doorbell_offset(0, false, stride)),
                bar.doorbell(regs::doorbell_offset(0, true, stride)),
            )
        };
        bar.write32(regs::REG_INTMS, u32::MAX);
        bar.write32(regs::REG_AQA, ((ADMIN_ENTRIES - 1) << 16) | (ADMIN_ENTRIES - 1));
        bar.write64(regs::REG_ASQ, region.iova(ADMIN_ASQ));
        bar.write64(regs::REG_ACQ, region.iova(ADMIN_ACQ));
        bar.write32(regs::REG_CC, regs::CC_IO_ENTRY_SIZES | regs::CC_EN);
        wait_until(ready_timeout, "controller enable (CSTS.RDY = 1)", || {
            let csts = bar.read32(regs::REG_CSTS);
            if csts & regs::CSTS_CFS != 0 {
                return Err(NvmeError::ControllerFatal { csts });
            }
            Ok(csts & regs::CSTS_RDY != 0)
        })?;
        let mut aq = AdminQueue { rings, next_cid: 0, region };

        let admin_timeout = opts.command_timeout;
        let cid = aq.cid();
        let ctrl_page = aq.region.iova(ADMIN_DATA);
        aq.run(bar, Sqe::identify(cid, 1, 0, ctrl_page), admin_timeout, "identify controller")?;
        let ctrl_id = ControllerId::parse(&aq.read_data());
        let cid = aq.cid();
        aq.run(
            bar,
            Sqe::identify(cid, 0, opts.nsid, ctrl_page),
            admin_timeout,
            "identify namespace",
        )?;
        let ns =
            NamespaceId::parse(&aq.read_data()).ok_or(NvmeError::Namespace { nsid: opts.nsid })?;
        if ns.metadata_bytes != 0 {
            return Err(NvmeError::Unsupported { what: "namespace with metadata" });
        }
        let cid = aq.cid();
        let granted = aq.run(
            bar,
            Sqe::set_num_queues(cid, opts.io_queues_max.max(1)),
            admin_timeout,
            "set features (number of queues)",
        )?;
        let nsqa = (granted.dw0 & 0xffff) as u16;
        let ncqa = (granted.dw0 >> 16) as u16;
        let io_queues = nsqa.min(ncqa).saturating_add(1).min(opts.io_queues_max.max(1));

        let mut max_transfer_bytes = opts.max_transfer_bytes.clamp(PAGE_SIZE as u32, TRANSFER_CAP);
        if ctrl_id.mdts != 0 {
            let mdts = cap.page_size_min_bytes().saturating_mul(1u64 << ctrl_id.mdts.min(20));
            max_transfer_bytes = max_transfer_bytes.min(mdts.min(u64::from(TRANSFER_CAP)) as u32);
        }
        // Whole blocks only.
        max_transfer_bytes -= max_transfer_bytes % ns.block_size;
        if max_transfer_bytes == 0 {
            return Err(NvmeError::Unsupported { what: "block size above the transfer size" });
        }
        log::info!(
            "nvme {}: {} sn {} fw {}, ns {} {} x {} B, mdts {}, oncs {:#x}, vwc {}, {} I/O queues",
            pci.bdf(),
            ctrl_id.model,
            ctrl_id.serial,
            ctrl_id.firmware,
            opts.nsid,
            ns.nsze,
            ns.block_size,
            ctrl_id.mdts,
            ctrl_id.oncs,
            ctrl_id.vwc,
            io_queues
        );
        Ok(Controller {
            bar,
            cap,
            ctrl_id,
            ns,
            opts,
            max_transfer_bytes,
            io_queues,
            qids_used: Mutex::new(vec![false; usize::from(io_queues)]),
            failed_errno: AtomicI32::new(0),
            iovas: Mutex::new(iovas),
            xlat: Mutex::new(Arc::new(Translations::default())),
            xlat_gen: AtomicU64::new(0),
            external: Mutex::new(Vec::new()),
            transfers_open: Mutex::new(Vec::new()),
            transfers_closed: TransferCounters::default(),
            admin: Mutex::new(aq),
            pci,
        })
    }

    /// The errno requests fail with once the controller is failed; 0 while healthy.
    pub(crate) fn failed_errno(&self) -> i32 {
        // Acquire: pairs with the Release in `fail`, which comes after bus mastering was
        // switched off; a queue that sees the flag may hand buffers back.
        self.failed_errno.load(Ordering::Acquire)
    }

    /// Declare the controller failed: stop its DMA, then publish `errno`. Idempotent.
    pub(crate) fn fail(&self, errno: i32, why: &str) {
        if self.failed_errno() != 0 {
            return;
        }
        log::error!("nvme {}: {why}; stopping DMA, failing all requests", self.pci.bdf());
        self.pci.stop_dma();
        let _ = self.failed_errno.compare_exchange(0, errno, Ordering::Release, Ordering::Relaxed);
    }

    /// Read CSTS; a set CFS fails the controller. Returns whether it is (now) failed.
    pub(crate) fn check_fatal(&self) -> bool {
        if self.failed_errno() != 0 {
            return true;
        }
        let csts = self.bar.read32(regs::REG_CSTS);
        // All ones: the device is gone (surprise removal, or BAR access failing).
        if csts == u32::MAX || csts & regs::CSTS_CFS != 0 {
            self.fail(libc::EIO, &format!("controller fatal status (CSTS {csts:#x})"));
            return true;
        }
        false
    }

    fn admin(&self) -> MutexGuard<'_, AdminQueue> {
        self.admin.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Run one admin command; a timeout fails the controller (the admin queue's state is
    /// unknown after it).
    pub(crate) fn admin_cmd(
        &self,
        make: impl FnOnce(u16) -> Sqe,
        what: &'static str,
    ) -> Result<Cqe, NvmeError> {
        let errno = self.failed_errno();
        if errno != 0 {
            return Err(NvmeError::Failed { errno });
        }
        let mut aq = self.admin();
        let cid = aq.cid();
        let r = aq.run(self.bar, make(cid), self.opts.command_timeout, what);
        if let Err(NvmeError::Timeout { .. } | NvmeError::ControllerFatal { .. }) = &r {
            self.fail(libc::ETIMEDOUT, &format!("admin command {what} did not complete"));
        }
        r
    }

    pub(crate) fn alloc_region(&self, len: usize) -> Result<DmaRegion, NvmeError> {
        let mut iovas = self.iovas.lock().unwrap_or_else(|p| p.into_inner());
        DmaRegion::new(self.pci.container(), &mut iovas, len)
    }

    pub(crate) fn take_qid(&self) -> Result<u16, NvmeError> {
        let mut used = self.qids_used.lock().unwrap_or_else(|p| p.into_inner());
        let i = used.iter().position(|u| !u).ok_or(NvmeError::NoQueues { max: self.io_queues })?;
        used[i] = true;
        Ok(i as u16 + 1)
    }

    pub(crate) fn put_qid(&self, qid: u16) {
        let mut used = self.qids_used.lock().unwrap_or_else(|p| p.into_inner());
        used[usize::from(qid) - 1] = false;
    }

    /// The current translation table.
    pub(crate) fn translations(&self) -> Arc<Translations> {
        self.xlat.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub(crate) fn publish(
        &self,
        change: impl FnOnce(&Translations) -> Result<Translations, NvmeError>,
    ) -> Result<(), NvmeError> {
        let mut t = self.xlat.lock().unwrap_or_else(|p| p.into_inner());
        *t = Arc::new(change(&t)?);
        // Release: pairs with the Acquire load in `NvmeQueue::refresh_translations`.
        self.xlat_gen.fetch_add(1, Ordering::Release);
        Ok(())
    }

    /// # Safety
    ///
    /// See [`NvmeDevice::map_external`].
    pub(crate) unsafe fn map_external(
        &self,
        host: *mut u8,
        len: usize,
        owned: bool,
        key: u64,
    ) -> Result<u64, NvmeError> {
        let h = host as usize;
        if !h.is_multiple_of(PAGE_SIZE) || !len.is_multiple_of(PAGE_SIZE) || len == 0 {
            return Err(NvmeError::Unaligned { host: h, len });
        }
        let iova = self.iovas.lock().unwrap_or_else(|p| p.into_inner()).alloc(len)?;
        let m = Mapping { host: h, len, iova };
        // Check overlap before the IOMMU sees it.
        self.translations().with(m)?;
        // SAFETY: the caller keeps `host..host+len` mapped and reference-free until
        // `unmap_external` (this function's contract, passed on).
        unsafe { self.pci.container().vfio_dma_map(iova, len, host) }
            .map_err(|source| NvmeError::DmaMap { iova, len, source })?;
        if let Err(e) = self.publish(|t| t.with(m)) {
            let _ = self.pci.container().vfio_dma_unmap(iova, len);
            return Err(e);
        }
        if !owned {
            self.external.lock().unwrap_or_else(|p| p.into_inner()).push((m, key));
        }
        Ok(iova)
    }

    pub(crate) fn unmap_external(&self, host: usize) -> Result<(), NvmeError> {
        let mut removed = None;
        self.publish(|t| {
            let (t2, m) = t.without(host).ok_or(NvmeError::NotMapped { host })?;
            removed = Some(m);
            Ok(t2)
        })?;
        let m = removed.expect("publish succeeded");
        self.external.lock().unwrap_or_else(|p| p.into_inner()).retain(|x| x.0.host != host);
        self.pci.container().vfio_dma_unmap(m.iova, m.len).map_err(|source| NvmeError::DmaUnmap {
            iova: m.iova,
            len: m.len,
            source,
        })
    }

    /// New counters for a queue being opened.
    pub(crate) fn open_transfer_counters(&self) -> Arc<TransferCounters> {
        let c = Arc::new(TransferCounters::default());
        self.transfers_open.lock().unwrap_or_else(|p| p.into_inner()).push(c.clone());
        c
    }

    /// A queue is closing: fold its counters into the closed sums.
    pub(crate) fn close_transfer_counters(&self, c: &Arc<TransferCounters>) {
        let mut open = self.transfers_open.lock().unwrap_or_else(|p| p.into_inner());
        open.retain(|o| !Arc::ptr_eq(o, c));
        // Under the lock, so that `transfer_stats` never sees the queue twice or not at all.
        self.transfers_closed.absorb(c.load());
    }

    pub(crate) fn transfer_stats(&self) -> TransferStats {
        let open = self.transfers_open.lock().unwrap_or_else(|p| p.into_inner());
        let mut sum = self.transfers_closed.load();
        for c in open.iter() {
            let s = c.load();
            sum.direct_requests += s.direct_requests;
            sum.bounced_requests += s.bounced_requests;
            sum.bounced_bytes += s.bounced_bytes;
        }
        sum
    }

    pub(crate) fn info(&self) -> DeviceInfo {
        let writable = !self.opts.read_only;
        DeviceInfo {
            size_bytes: self.ns.nsze * u64::from(self.ns.block_size),
            block_size: self.ns.block_size,
            read_only: self.opts.read_only,
            discard: writable && self.ctrl_id.dsm(),
            write_zeroes: writable && self.ctrl_id.write_zeroes(),
            volatile_cache: self.ctrl_id.vwc,
            max_segments: self.opts.max_segments,
        }
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        let t = self.transfer_stats();
        log::info!(
            "nvme {}: closing; reads and writes: {} zero copy, {} bounced ({} bytes copied)",
            self.pci.bdf(),
            t.direct_requests,
            t.bounced_requests,
            t.bounced_bytes
        );
        let bar = self.bar;
        if self.failed_errno() == 0 {
            // Normal shutdown: the controller writes back its cache and stops.
            let cc = bar.read32(regs::REG_CC);
            bar.write32(regs::REG_CC, (cc & !regs::CC_SHN_MASK) | regs::CC_SHN_NORMAL);
            let r = wait_until(SHUTDOWN_WAIT, "shutdown", || {
                Ok(bar.read32(regs::REG_CSTS) & regs::CSTS_SHST_MASK == regs::CSTS_SHST_DONE)
            });
            if let Err(e) = r {
                log::warn!("nvme {}: {e}", self.pci.bdf());
            }
        }
        let cc = bar.read32(regs::REG_CC);
        bar.write32(regs::REG_CC, cc & !regs::CC_EN);
        let _ = wait_until(
            Duration::from_millis(self.cap.ready_timeout_ms().max(500)),
            "disable",
            || Ok(bar.read32(regs::REG_CSTS) & regs::CSTS_RDY == 0),
        );
        for (m, _) in self.external.get_mut().unwrap_or_else(|p| p.into_inner()).drain(..) {
            if let Err(e) = self.pci.container().vfio_dma_unmap(m.iova, m.len) {
                log::warn!("unmap of external iova {:#x} failed: {e}", m.iova);
            }
        }
    }
}

impl AdminQueue {
    fn cid(&mut self) -> u16 {
        self.next_cid = self.next_cid.wrapping_add(1);
        self.next_cid
    }

    /// Submit `sqe` and poll for its completion, at most `timeout`.
    fn run(
        &mut self,
        bar: Bar,
        sqe: Sqe,
        timeout: Duration,
        what: &'static str,
    ) -> Result<Cqe, NvmeError> {
        self.rings.push(&sqe);
        self.rings.ring_sq();
        let start = Instant::now();
        let mut polls = 0u32;
        loop {
            if let Some(cqe) = self.rings.pop() {
                self.rings.ring_cq();
                if cqe.cid != sqe.cid() {
                    // A stale completion (an earlier command that timed out): skip it.
                    log::warn!(
                        "admin completion for cid {} while waiting for {}",
                        cqe.cid,
                        sqe.cid()
                    );
                    continue;
                }
                let status = cqe.status();
                return if status.is_success() {
                    Ok(cqe)
                } else {
                    Err(NvmeError::Command { what, status })
                };
            }
            polls += 1;
            if polls.is_multiple_of(256) {
                let csts = bar.read32(regs::REG_CSTS);
                if csts == u32::MAX || csts & regs::CSTS_CFS != 0 {
                    return Err(NvmeError::ControllerFatal { csts });
                }
                if start.elapsed() > timeout {
                    return Err(NvmeError::Timeout { what, ms: timeout.as_millis() as u64 });
                }
                std::thread::yield_now();
            }
            std::hint::spin_loop();
        }
    }

    /// Copy the data page out (after the command that filled it has completed).
    fn read_data(&self) -> [u8; 4096] {
        let mut out = [0u8; 4096];
        // SAFETY: the data page lies in `region` (alive as long as `self`); the command that
        // wrote it has completed and no other admin command is outstanding (we hold the
        // admin lock), so the device is not writing it; a raw copy, no reference to it.
        unsafe {
            std::ptr::copy_nonoverlapping(self.region.host(ADMIN_DATA), out.as_mut_ptr(), 4096)
        };
        out
    }
}
