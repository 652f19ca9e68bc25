//! The swap engine: placement, accounting, tickets, and the worker threads.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fastlane_ring::spsc::{self, Consumer, Producer};
use fastlane_ring::WaitStrategy;

use crate::checksum::ChecksumMode;
use crate::device::{DeviceAllocator, DeviceMemory};
use crate::error::KvSwapError;
use crate::tier::{
    HostTier, HostTierIo, NvmeTierConfig, NvmeTierIo, RemoteTierIo, SlotSpace, TierIo, TierKind,
};
use crate::worker::{sum_table, Done, Job, JobFail, JobOp, Worker, JOB_BLOCKS_MAX};
use crate::{BlockId, SeqId, TenantId, Ticket};

/// Smallest transfer chunk the engine builds when extents allow it.
pub const CHUNK_BYTES_MIN: usize = 512 * 1024;

/// Where cold sequences go when the host tier is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SpillPolicy {
    /// NVMe first, then remote.
    #[default]
    NvmeFirst,
    /// Remote first, then NVMe.
    RemoteFirst,
    /// Only NVMe.
    NvmeOnly,
    /// Only remote.
    RemoteOnly,
    /// Never spill: swap-out fails with `TierFull` when the host tier is full.
    Never,
}

impl SpillPolicy {
    fn order(self) -> &'static [TierKind] {
        match self {
            SpillPolicy::NvmeFirst => &[TierKind::Nvme, TierKind::Remote],
            SpillPolicy::RemoteFirst => &[TierKind::Remote, TierKind::Nvme],
            SpillPolicy::NvmeOnly => &[TierKind::Nvme],
            SpillPolicy::RemoteOnly => &[TierKind::Remote],
            SpillPolicy::Never => &[],
        }
    }
}

/// The remote tier's pool.
#[derive(Debug, Clone)]
pub struct RemoteTierConfig {
    /// RDMA device name (e.g. `rxe0`).
    pub device: String,
    /// Address of `fastlane rdma serve`.
    pub addr: SocketAddr,
    /// Bytes to take from the pool.
    pub bytes: u64,
}

/// How to build a [`SwapEngine`].
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Host tier size in bytes (rounded down to whole blocks; 0: no host tier, swap-outs
    /// go straight to the spill tiers).
    pub host_bytes: u64,
    /// The NVMe tier, if any.
    pub nvme: Option<NvmeTierConfig>,
    /// The remote tier, if any.
    pub remote: Option<RemoteTierConfig>,
    /// Spill order.
    pub spill: SpillPolicy,
    /// Per-block checksum.
    pub checksum: ChecksumMode,
    /// Target bytes per transfer chunk (at least [`CHUNK_BYTES_MIN`]; a chunk is also capped
    /// at 128 blocks).
    pub chunk_bytes: usize,
    /// Jobs each worker ring holds.
    pub ring_capacity: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            host_bytes: 0,
            nvme: None,
            remote: None,
            spill: SpillPolicy::NvmeFirst,
            checksum: ChecksumMode::Fast,
            chunk_bytes: 4 << 20,
            ring_capacity: 256,
        }
    }
}

/// Tiers built by the caller (tests, or anything that wants its own [`TierIo`]).
#[derive(Default)]
pub struct CustomTiers {
    /// Replaces the NVMe tier.
    pub nvme: Option<Box<dyn TierIo>>,
    /// Replaces the remote tier.
    pub remote: Option<Box<dyn TierIo>>,
}

impl std::fmt::Debug for CustomTiers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CustomTiers")
            .field("nvme", &self.nvme.is_some())
            .field("remote", &self.remote.is_some())
            .finish()
    }
}

/// A finished transfer, as `poll` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TicketDone {
    /// The ticket.
    pub ticket: Ticket,
    /// Its sequence.
    pub seq: SeqId,
    /// Swap-out or swap-in.
    pub kind: TransferKind,
    /// The outcome. On error nothing was lost: a failed swap-out leaves the sequence
    /// resident (its device blocks hold the data), a failed swap-in leaves the tier copy.
    pub result: Result<(), KvSwapError>,
}

/// Direction of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferKind {
    /// Device → tier.
    SwapOut,
    /// Tier → device.
    SwapIn,
}

/// Where a sequence is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqPhase {
    /// Its KV lives in device blocks only.
    Resident,
    /// Being copied out.
    SwappingOut,
    /// Swapped out to `tier`.
    Out(TierKind),
    /// Its host copy is being spilled to a lower tier.
    Spilling,
    /// Being copied back in.
    SwappingIn,
}

/// What `lookup` tells about a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqInfo {
    /// Its tenant.
    pub tenant: TenantId,
    /// Where it is.
    pub phase: SeqPhase,
    /// Blocks in its swapped-out copy (0 when none).
    pub blocks_out: u32,
    /// Device blocks it owns.
    pub device_blocks: u32,
}

/// One tier's accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TierStats {
    /// Configured.
    pub present: bool,
    /// Capacity in bytes (whole blocks).
    pub capacity_bytes: u64,
    /// Bytes allocated to sequences (copies and transfers in flight).
    pub used_bytes: u64,
    /// Host tier: page-locked (false when mlock was refused).
    pub locked: bool,
}

/// The engine's accounting, exact at any moment between calls.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EngineStats {
    /// Host, NVMe, remote (index by [`TierKind::index`]).
    pub tiers: [TierStats; 3],
    /// Device blocks in the pool.
    pub device_blocks: u32,
    /// Device blocks free.
    pub device_free: u32,
    /// Device blocks pinned by transfers.
    pub device_pinned: u32,
    /// Swapped-out bytes held per tenant (all tiers), sorted by tenant.
    pub tenant_bytes: Vec<(TenantId, u64)>,
    /// Bytes copied out, in, and spilled, by finished jobs.
    pub bytes_out: u64,
    /// See `bytes_out`.
    pub bytes_in: u64,
    /// See `bytes_out`.
    pub bytes_spilled: u64,
    /// Checksum mismatches seen.
    pub checksum_failures: u64,
    /// Spills started.
    pub spills: u64,
}

#[derive(Debug)]
struct Placement {
    tier: TierKind,
    extents: Vec<(u64, u64)>,
}

impl Placement {
    fn slots(&self) -> u64 {
        self.extents.iter().map(|e| e.1).sum()
    }
}

#[derive(Debug)]
struct Seq {
    tenant: TenantId,
    phase: SeqPhase,
    copy: Option<Placement>,
    blocks_out: u32,
    last_use: u64,
    dropped: bool,
    active: Option<u64>,
}

#[derive(Debug, PartialEq, Eq, Clone, Copy)]
enum Kind {
    Out,
    In,
    Spill { parent: u64 },
}

#[derive(Debug)]
struct TicketState {
    seq: SeqId,
    kind: Kind,
    jobs_left: u32,
    failed: Option<KvSwapError>,
    cancel: Arc<AtomicBool>,
    pinned: Vec<BlockId>,
    /// Out: the slots this ticket owns so far; Spill: the spill-tier slots.
    target: Option<Placement>,
    /// Out: jobs held until a spill frees their host slots, per spill ticket, with the
    /// host extents they take from the victim.
    held: Vec<Held>,
    bytes: u64,
}

/// A spill ticket, the host extents its victim hands over, and the jobs waiting for them.
type Held = (u64, Vec<(u64, u64)>, Vec<Job>);

struct WorkerHandle {
    jobs: Producer<Job>,
    done: Consumer<Done>,
    thread: Option<JoinHandle<()>>,
    outstanding: usize,
    pending: VecDeque<Job>,
    space: SlotSpace,
    capacity: usize,
    locked: bool,
}

/// The KV swap engine. See the crate docs for the model; every method is non-blocking
/// except [`SwapEngine::wait`], which is bounded by its timeout.
pub struct SwapEngine {
    device: Arc<dyn DeviceMemory>,
    alloc: DeviceAllocator,
    block_bytes: usize,
    job_blocks: usize,
    spill: SpillPolicy,
    workers: [Option<WorkerHandle>; 3],
    seqs: HashMap<SeqId, Seq>,
    tickets: HashMap<u64, TicketState>,
    results: HashMap<u64, TicketDone>,
    finished: VecDeque<u64>,
    quotas: HashMap<TenantId, u64>,
    tenant_bytes: HashMap<TenantId, u64>,
    next_ticket: u64,
    clock: u64,
    stats: EngineStats,
    _host: Arc<HostTier>,
}

impl std::fmt::Debug for SwapEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SwapEngine")
            .field("block_bytes", &self.block_bytes)
            .field("seqs", &self.seqs.len())
            .field("tickets", &self.tickets.len())
            .finish()
    }
}

impl SwapEngine {
    /// Builds the engine: maps and locks the host tier, opens the NVMe file (O_DIRECT) and
    /// connects to the remote pool as configured, and starts one worker thread per tier.
    pub fn new(
        config: EngineConfig,
        device: Arc<dyn DeviceMemory>,
    ) -> Result<SwapEngine, KvSwapError> {
        let nvme: Option<Box<dyn TierIo>> = match &config.nvme {
            Some(c) => Some(Box::new(NvmeTierIo::open(c)?)),
            None => None,
        };
        let remote: Option<Box<dyn TierIo>> = match &config.remote {
            Some(c) => Some(Box::new(RemoteTierIo::connect(&c.device, c.addr, c.bytes)?)),
            None => None,
        };
        SwapEngine::with_tiers(config, device, CustomTiers { nvme, remote })
    }

    /// Like [`SwapEngine::new`] with caller-built NVMe/remote tiers (`config.nvme` and
    /// `config.remote` are ignored).
    pub fn with_tiers(
        config: EngineConfig,
        device: Arc<dyn DeviceMemory>,
        tiers: CustomTiers,
    ) -> Result<SwapEngine, KvSwapError> {
        let block_bytes = device.block_bytes();
        if block_bytes == 0 || block_bytes % 4096 != 0 || block_bytes > u32::MAX as usize {
            return Err(KvSwapError::BadConfig { detail: format!("block size {block_bytes}") });
        }
        if config.ring_capacity < 2 {
            return Err(KvSwapError::BadConfig { detail: "ring_capacity < 2".into() });
        }
        let chunk = config.chunk_bytes.max(CHUNK_BYTES_MIN);
        let job_blocks = chunk.div_ceil(block_bytes).clamp(1, JOB_BLOCKS_MAX);
        let host_slots = config.host_bytes / block_bytes as u64;
        let host = Arc::new(HostTier::new((host_slots * block_bytes as u64) as usize)?);
        let host_sums = sum_table(host_slots);
        let mut engine = SwapEngine {
            alloc: DeviceAllocator::new(device.blocks()),
            device: device.clone(),
            block_bytes,
            job_blocks,
            spill: config.spill,
            workers: [None, None, None],
            seqs: HashMap::new(),
            tickets: HashMap::new(),
            results: HashMap::new(),
            finished: VecDeque::new(),
            quotas: HashMap::new(),
            tenant_bytes: HashMap::new(),
            next_ticket: 1,
            clock: 0,
            stats: EngineStats::default(),
            _host: host.clone(),
        };
        let mut ios: Vec<Box<dyn TierIo>> = Vec::new();
        if host_slots > 0 {
            ios.push(Box::new(HostTierIo { tier: host.clone() }));
        }
        ios.extend(tiers.nvme);
        ios.extend(tiers.remote);
        for io in ios {
            let kind = io.kind();
            let slots = if kind == TierKind::Host {
                host_slots
            } else {
                io.capacity_bytes() / block_bytes as u64
            };
            let sums = if kind == TierKind::Host { host_sums.clone() } else { sum_table(slots) };
            let cap = config.ring_capacity;
            let (jp, jc) = spsc::channel_with::<Job>(
                cap,
                WaitStrategy::SpinYieldPark { spins: 64, yields: 16 },
            );
            let (dp, dc) = spsc::channel_with::<Done>(
                cap * 2,
                WaitStrategy::SpinYieldPark { spins: 64, yields: 16 },
            );
            let locked = io.locked();
            let worker = Worker {
                tier: io,
                device: device.clone(),
                host: host.clone(),
                sums: sums.clone(),
                host_sums: host_sums.clone(),
                mode: config.checksum,
                block_bytes,
                jobs: jc,
                done: dp,
            };
            let thread = std::thread::Builder::new()
                .name(format!("kvswap-{kind:?}").to_lowercase())
                .spawn(move || worker.run())
                .map_err(|e| KvSwapError::setup("spawn worker", e))?;
            engine.workers[kind.index()] = Some(WorkerHandle {
                jobs: jp,
                done: dc,
                thread: Some(thread),
                outstanding: 0,
                pending: VecDeque::new(),
                space: SlotSpace::new(slots),
                capacity: cap,
                locked,
            });
        }
        Ok(engine)
    }

    /// Bytes per device block.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// The device memory.
    pub fn device(&self) -> &Arc<dyn DeviceMemory> {
        &self.device
    }

    /// Registers `seq` under `tenant` (sequences are created on first `alloc_blocks` under
    /// tenant 0 otherwise). Refused with `Busy` while it has a copy or a transfer.
    pub fn register_seq(&mut self, seq: SeqId, tenant: TenantId) -> Result<(), KvSwapError> {
        let clock = self.tick();
        let s = self.seqs.entry(seq).or_insert_with(|| Seq::new(tenant, clock));
        if s.copy.is_some() || s.active.is_some() {
            return Err(KvSwapError::Busy { seq });
        }
        s.tenant = tenant;
        Ok(())
    }

    /// Caps the swapped-out bytes `tenant` may hold across tiers (`None`: no cap).
    pub fn set_quota(&mut self, tenant: TenantId, quota_bytes: Option<u64>) {
        match quota_bytes {
            Some(q) => self.quotas.insert(tenant, q),
            None => self.quotas.remove(&tenant),
        };
    }

    /// Hands `n` free device blocks to `seq` (creating it under tenant 0 if new). All or
    /// nothing. Blocks pinned by an in-flight transfer are never among them.
    pub fn alloc_blocks(&mut self, seq: SeqId, n: u32) -> Result<Vec<BlockId>, KvSwapError> {
        let mut out = Vec::with_capacity(n as usize);
        self.alloc_blocks_into(seq, n, &mut out)?;
        Ok(out)
    }

    /// [`SwapEngine::alloc_blocks`] into a caller's vector.
    pub fn alloc_blocks_into(
        &mut self,
        seq: SeqId,
        n: u32,
        out: &mut Vec<BlockId>,
    ) -> Result<(), KvSwapError> {
        let clock = self.tick();
        if self.seqs.get(&seq).is_some_and(|s| s.dropped) {
            return Err(KvSwapError::UnknownSequence { seq });
        }
        self.alloc.alloc(seq, n, out)?;
        self.seqs.entry(seq).or_insert_with(|| Seq::new(TenantId(0), clock));
        Ok(())
    }

    /// Hands the named free device blocks to `seq` (creating it under tenant 0 if new), for
    /// an owner whose own block manager decides which blocks a sequence holds (the inference
    /// engine's scheduler): it adopts a sequence's blocks for one transfer and frees them in
    /// the engine when the ticket is done. All or nothing.
    pub fn adopt_blocks(&mut self, seq: SeqId, blocks: &[BlockId]) -> Result<(), KvSwapError> {
        let clock = self.tick();
        if self.seqs.get(&seq).is_some_and(|s| s.dropped) {
            return Err(KvSwapError::UnknownSequence { seq });
        }
        self.alloc.adopt(seq, blocks)?;
        self.seqs.entry(seq).or_insert_with(|| Seq::new(TenantId(0), clock));
        Ok(())
    }

    /// Gives device blocks of `seq` back to the pool. Refused (nothing freed) with
    /// `BlockPinned` while a transfer reads or writes one of them, and with `BlockNotOwned`
    /// for a block that is not `seq`'s.
    pub fn free_blocks(&mut self, seq: SeqId, blocks: &[BlockId]) -> Result<(), KvSwapError> {
        self.alloc.free(seq, blocks)
    }

    /// Marks `seq` as just used (it becomes the last choice for spilling).
    pub fn touch(&mut self, seq: SeqId) -> Result<(), KvSwapError> {
        let c = self.tick();
        let s = self.seq_mut(seq)?;
        s.last_use = c;
        Ok(())
    }

    /// Where `seq` is, or `None` if unknown.
    pub fn lookup(&self, seq: SeqId) -> Option<SeqInfo> {
        let s = self.seqs.get(&seq).filter(|s| !s.dropped)?;
        let device_blocks = (0..self.alloc.total())
            .filter(|b| self.alloc.owner(BlockId(*b)) == Some(seq))
            .count() as u32;
        Some(SeqInfo { tenant: s.tenant, phase: s.phase, blocks_out: s.blocks_out, device_blocks })
    }

    /// Starts copying `blocks` (in this order) of `seq` out of the device. The blocks stay
    /// `seq`'s and are pinned until the ticket finishes; free them after a successful
    /// swap-out to make room. Lands in the host tier; when it is full, the least recently
    /// used swapped-out sequences spill to the NVMe or remote tier as the policy says; when
    /// that is not possible either, straight to a spill tier, else `TierFull`.
    pub fn swap_out(&mut self, seq: SeqId, blocks: &[BlockId]) -> Result<Ticket, KvSwapError> {
        self.poll_workers();
        let clock = self.tick();
        let s = self.seq_ref(seq)?;
        match s.phase {
            SeqPhase::Resident => {}
            SeqPhase::Out(_) | SeqPhase::SwappingOut => {
                return Err(KvSwapError::DoubleSwapOut { seq })
            }
            SeqPhase::Spilling => return Err(KvSwapError::DoubleSwapOut { seq }),
            SeqPhase::SwappingIn => return Err(KvSwapError::Busy { seq }),
        }
        let tenant = s.tenant;
        self.alloc.check_owned(seq, blocks)?;
        let n = blocks.len() as u64;
        let bytes = n * self.block_bytes as u64;
        let used = self.tenant_bytes.get(&tenant).copied().unwrap_or(0);
        if let Some(&q) = self.quotas.get(&tenant) {
            if used + bytes > q {
                return Err(KvSwapError::QuotaExceeded {
                    tenant,
                    used_bytes: used,
                    needed_bytes: bytes,
                    quota_bytes: q,
                });
            }
        }
        let ticket = self.new_ticket();
        let cancel = Arc::new(AtomicBool::new(false));
        let (tier, own, spills) = self.place(seq, n, &cancel)?;
        // Build jobs over own extents first, then the victims' slots.
        let mut state = TicketState {
            seq,
            kind: Kind::Out,
            jobs_left: 0,
            failed: None,
            cancel: cancel.clone(),
            pinned: blocks.to_vec(),
            target: Some(Placement { tier, extents: own.clone() }),
            held: Vec::new(),
            bytes,
        };
        let mut idx = 0usize;
        let mut now = Vec::new();
        self.build_extent_jobs(ticket, JobOp::Out, &own, blocks, &mut idx, &cancel, &mut now);
        for (spill_ticket, victim_extents) in spills {
            let mut jobs = Vec::new();
            self.build_extent_jobs(
                ticket,
                JobOp::Out,
                &victim_extents,
                blocks,
                &mut idx,
                &cancel,
                &mut jobs,
            );
            state.jobs_left += jobs.len() as u32;
            self.tickets.get_mut(&spill_ticket).expect("spill ticket").kind =
                Kind::Spill { parent: ticket };
            state.held.push((spill_ticket, victim_extents, jobs));
        }
        debug_assert_eq!(idx, blocks.len());
        state.jobs_left += now.len() as u32;
        self.alloc.pin(blocks);
        *self.tenant_bytes.entry(tenant).or_insert(0) += bytes;
        let s = self.seqs.get_mut(&seq).expect("checked");
        s.phase = SeqPhase::SwappingOut;
        s.active = Some(ticket);
        s.blocks_out = n as u32;
        s.last_use = clock;
        self.tickets.insert(ticket, state);
        for j in now {
            self.push_job(tier, j);
        }
        self.maybe_finish(ticket);
        Ok(Ticket(ticket))
    }

    /// Starts copying `seq`'s swapped-out copy into `blocks` (owned by `seq`, as many as were
    /// swapped out, in the same order). The blocks are pinned until the ticket finishes; the
    /// tier copy is released on success and kept on failure.
    pub fn swap_in(&mut self, seq: SeqId, blocks: &[BlockId]) -> Result<Ticket, KvSwapError> {
        self.poll_workers();
        let clock = self.tick();
        let s = self.seq_ref(seq)?;
        let tier = match s.phase {
            SeqPhase::Out(t) => t,
            SeqPhase::Resident => return Err(KvSwapError::NotSwappedOut { seq }),
            SeqPhase::SwappingOut | SeqPhase::SwappingIn | SeqPhase::Spilling => {
                return Err(KvSwapError::Busy { seq })
            }
        };
        if blocks.len() as u32 != s.blocks_out {
            return Err(KvSwapError::BlockCountMismatch {
                seq,
                expected: s.blocks_out,
                got: blocks.len() as u32,
            });
        }
        self.alloc.check_owned(seq, blocks)?;
        if let Some(b) = blocks.iter().find(|b| self.alloc.is_pinned(**b)) {
            return Err(KvSwapError::BlockPinned { block: *b, seq });
        }
        let extents = s.copy.as_ref().expect("Out has a copy").extents.clone();
        let ticket = self.new_ticket();
        let cancel = Arc::new(AtomicBool::new(false));
        let mut jobs = Vec::new();
        let mut idx = 0usize;
        self.build_extent_jobs(ticket, JobOp::In, &extents, blocks, &mut idx, &cancel, &mut jobs);
        self.alloc.pin(blocks);
        let s = self.seqs.get_mut(&seq).expect("checked");
        s.phase = SeqPhase::SwappingIn;
        s.active = Some(ticket);
        s.last_use = clock;
        let bytes = blocks.len() as u64 * self.block_bytes as u64;
        self.tickets.insert(
            ticket,
            TicketState {
                seq,
                kind: Kind::In,
                jobs_left: jobs.len() as u32,
                failed: None,
                cancel,
                pinned: blocks.to_vec(),
                target: None,
                held: Vec::new(),
                bytes,
            },
        );
        for j in jobs {
            self.push_job(tier, j);
        }
        self.maybe_finish(ticket);
        Ok(Ticket(ticket))
    }

    /// Drains worker completions and appends every user ticket that finished to `out`.
    /// Each ticket's result is delivered once: here or by [`SwapEngine::wait`].
    pub fn poll(&mut self, out: &mut Vec<TicketDone>) -> usize {
        self.poll_workers();
        let mut n = 0;
        while let Some(t) = self.finished.pop_front() {
            if let Some(d) = self.results.remove(&t) {
                out.push(d);
                n += 1;
            }
        }
        n
    }

    /// Waits (bounded by `timeout`) for `ticket` and returns its result. `Timeout` leaves
    /// the transfer running; call again or `cancel`.
    pub fn wait(&mut self, ticket: Ticket, timeout: Duration) -> Result<(), KvSwapError> {
        let deadline = Instant::now() + timeout;
        let mut spins = 0u32;
        loop {
            self.poll_workers();
            if let Some(d) = self.results.remove(&ticket.0) {
                self.finished.retain(|t| *t != ticket.0);
                return d.result;
            }
            if !self.tickets.contains_key(&ticket.0) {
                return Err(KvSwapError::UnknownTicket { ticket: ticket.0 });
            }
            if Instant::now() >= deadline {
                return Err(KvSwapError::Timeout { ticket: ticket.0 });
            }
            spins += 1;
            if spins < 2000 {
                std::hint::spin_loop();
            } else if spins < 2200 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }

    /// Cancels a transfer: jobs not started are skipped, and the ticket finishes with
    /// `Cancelled` once the started ones drain (swap-out: the sequence stays resident;
    /// swap-in: the tier copy stays). A ticket that already finished keeps its result.
    pub fn cancel(&mut self, ticket: Ticket) -> Result<(), KvSwapError> {
        if self.results.contains_key(&ticket.0) {
            return Ok(());
        }
        let st = self
            .tickets
            .get_mut(&ticket.0)
            .ok_or(KvSwapError::UnknownTicket { ticket: ticket.0 })?;
        if matches!(st.kind, Kind::Spill { .. }) {
            return Err(KvSwapError::UnknownTicket { ticket: ticket.0 });
        }
        st.cancel.store(true, Ordering::Relaxed);
        st.failed.get_or_insert(KvSwapError::Cancelled);
        self.drop_held(ticket.0);
        self.maybe_finish(ticket.0);
        Ok(())
    }

    /// Forgets `seq`: cancels its transfer, releases its tier copy and frees its device
    /// blocks (blocks pinned by a transfer are freed when that transfer drains).
    pub fn drop_seq(&mut self, seq: SeqId) -> Result<(), KvSwapError> {
        self.seq_ref(seq)?;
        let s = self.seqs.get_mut(&seq).expect("checked");
        s.dropped = true;
        if let Some(t) = s.active {
            if let Some(st) = self.tickets.get_mut(&t) {
                if !matches!(st.kind, Kind::Spill { .. }) {
                    st.cancel.store(true, Ordering::Relaxed);
                    st.failed.get_or_insert(KvSwapError::Cancelled);
                    self.drop_held(t);
                    self.maybe_finish(t);
                }
            }
        }
        self.reap(seq);
        Ok(())
    }

    /// The accounting.
    pub fn stats(&self) -> EngineStats {
        let mut st = self.stats.clone();
        for (i, w) in self.workers.iter().enumerate() {
            if let Some(w) = w {
                let bb = self.block_bytes as u64;
                st.tiers[i] = TierStats {
                    present: true,
                    capacity_bytes: w.space.slots() * bb,
                    used_bytes: (w.space.slots() - w.space.free_slots()) * bb,
                    locked: w.locked,
                };
            }
        }
        st.device_blocks = self.alloc.total();
        st.device_free = self.alloc.free_count();
        st.device_pinned = self.alloc.pinned_count();
        let mut t: Vec<_> =
            self.tenant_bytes.iter().filter(|e| *e.1 > 0).map(|(k, v)| (*k, *v)).collect();
        t.sort();
        st.tenant_bytes = t;
        st
    }

    /// Transfers (user and internal spills) not finished.
    pub fn in_flight(&self) -> usize {
        self.tickets.len()
    }

    // ---- internals ----

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn new_ticket(&mut self) -> u64 {
        let t = self.next_ticket;
        self.next_ticket += 1;
        t
    }

    fn seq_ref(&self, seq: SeqId) -> Result<&Seq, KvSwapError> {
        self.seqs.get(&seq).filter(|s| !s.dropped).ok_or(KvSwapError::UnknownSequence { seq })
    }

    fn seq_mut(&mut self, seq: SeqId) -> Result<&mut Seq, KvSwapError> {
        self.seqs.get_mut(&seq).filter(|s| !s.dropped).ok_or(KvSwapError::UnknownSequence { seq })
    }

    fn space(&mut self, t: TierKind) -> Option<&mut SlotSpace> {
        self.workers[t.index()].as_mut().map(|w| &mut w.space)
    }

    fn free_bytes(&self, t: TierKind) -> u64 {
        self.workers[t.index()]
            .as_ref()
            .map_or(0, |w| w.space.free_slots() * self.block_bytes as u64)
    }

    /// Chooses where `n` blocks of `seq` go. Returns the tier, the extents allocated now, and
    /// the spills started to make room (spill ticket, host extents taken from its victim).
    #[allow(clippy::type_complexity)]
    fn place(
        &mut self,
        seq: SeqId,
        n: u64,
        cancel: &Arc<AtomicBool>,
    ) -> Result<(TierKind, Vec<(u64, u64)>, Vec<(u64, Vec<(u64, u64)>)>), KvSwapError> {
        let _ = cancel;
        let mut own = Vec::new();
        if let Some(h) = self.space(TierKind::Host) {
            if h.alloc(n, &mut own) {
                return Ok((TierKind::Host, own, Vec::new()));
            }
        }
        let host_slots = self.workers[0].as_ref().map_or(0, |w| w.space.slots());
        let spill_order = self.spill.order();
        if n <= host_slots && !spill_order.is_empty() {
            if let Some(r) = self.place_with_spills(seq, n) {
                return Ok(r);
            }
        }
        let mut last = (TierKind::Host, self.free_bytes(TierKind::Host));
        for &t in spill_order {
            if let Some(sp) = self.space(t) {
                if sp.alloc(n, &mut own) {
                    return Ok((t, own, Vec::new()));
                }
                last = (t, self.free_bytes(t));
            }
        }
        Err(KvSwapError::TierFull {
            tier: last.0,
            needed_bytes: n * self.block_bytes as u64,
            free_bytes: last.1,
        })
    }

    #[allow(clippy::type_complexity)]
    fn place_with_spills(
        &mut self,
        seq: SeqId,
        n: u64,
    ) -> Option<(TierKind, Vec<(u64, u64)>, Vec<(u64, Vec<(u64, u64)>)>)> {
        let host_free = self.workers[0].as_ref()?.space.free_slots();
        let mut victims: Vec<(u64, SeqId)> = self
            .seqs
            .iter()
            .filter(|(id, s)| {
                **id != seq
                    && !s.dropped
                    && s.active.is_none()
                    && s.phase == SeqPhase::Out(TierKind::Host)
            })
            .map(|(id, s)| (s.last_use, *id))
            .collect();
        victims.sort();
        // Reserve spill space for victims until enough host slots would be free.
        let mut chosen: Vec<(SeqId, TierKind, Vec<(u64, u64)>)> = Vec::new();
        let mut gain = 0u64;
        for (_, v) in victims {
            if host_free + gain >= n {
                break;
            }
            let need = self.seqs[&v].copy.as_ref().expect("Out has a copy").slots();
            for &t in self.spill.order() {
                let mut ext = Vec::new();
                if self.space(t).is_some_and(|sp| sp.alloc(need, &mut ext)) {
                    chosen.push((v, t, ext));
                    gain += need;
                    break;
                }
            }
        }
        if host_free + gain < n {
            for (_, t, ext) in chosen {
                let sp = self.space(t).expect("allocated there");
                for (a, l) in ext {
                    sp.release(a, l);
                }
            }
            return None;
        }
        let mut own = Vec::new();
        let take_free = host_free.min(n);
        let ok = self.space(TierKind::Host).expect("host").alloc(take_free, &mut own);
        debug_assert!(ok);
        let mut left = n - take_free;
        let mut spills = Vec::new();
        for (v, t, ext) in chosen {
            let host_ext = self.seqs[&v].copy.as_ref().expect("copy").extents.clone();
            // Take the prefix of the victim's host extents that this sequence needs.
            let mut taken = Vec::new();
            for &(a, l) in &host_ext {
                if left == 0 {
                    break;
                }
                let k = l.min(left);
                taken.push((a, k));
                left -= k;
            }
            let st = self.start_spill(v, t, host_ext, ext);
            spills.push((st, taken));
        }
        Some((TierKind::Host, own, spills))
    }

    fn start_spill(
        &mut self,
        victim: SeqId,
        tier: TierKind,
        host_ext: Vec<(u64, u64)>,
        spill_ext: Vec<(u64, u64)>,
    ) -> u64 {
        let ticket = self.new_ticket();
        let cancel = Arc::new(AtomicBool::new(false));
        // Walk both extent lists in lockstep, cutting jobs at either's boundaries.
        let mut jobs = Vec::new();
        let (mut hi, mut ho, mut si, mut so) = (0usize, 0u64, 0usize, 0u64);
        let mut index = 0u32;
        while hi < host_ext.len() && si < spill_ext.len() {
            let hl = host_ext[hi].1 - ho;
            let sl = spill_ext[si].1 - so;
            let k = hl.min(sl).min(self.job_blocks as u64);
            jobs.push(Job {
                ticket,
                op: JobOp::Migrate,
                slot: spill_ext[si].0 + so,
                src_slot: host_ext[hi].0 + ho,
                index,
                count: k as u32,
                blocks: [0; JOB_BLOCKS_MAX],
                cancel: cancel.clone(),
            });
            index += k as u32;
            ho += k;
            so += k;
            if ho == host_ext[hi].1 {
                hi += 1;
                ho = 0;
            }
            if so == spill_ext[si].1 {
                si += 1;
                so = 0;
            }
        }
        let s = self.seqs.get_mut(&victim).expect("victim");
        s.phase = SeqPhase::Spilling;
        s.active = Some(ticket);
        let bytes = u64::from(index) * self.block_bytes as u64;
        self.tickets.insert(
            ticket,
            TicketState {
                seq: victim,
                kind: Kind::Spill { parent: 0 },
                jobs_left: jobs.len() as u32,
                failed: None,
                cancel,
                pinned: Vec::new(),
                target: Some(Placement { tier, extents: spill_ext }),
                held: Vec::new(),
                bytes,
            },
        );
        self.stats.spills += 1;
        for j in jobs {
            self.push_job(tier, j);
        }
        ticket
    }

    /// Jobs for `extents` in order, over `blocks` from position `*idx` on (advanced past them).
    #[allow(clippy::too_many_arguments)]
    fn build_extent_jobs(
        &self,
        ticket: u64,
        op: JobOp,
        extents: &[(u64, u64)],
        blocks: &[BlockId],
        idx: &mut usize,
        cancel: &Arc<AtomicBool>,
        out: &mut Vec<Job>,
    ) {
        for &(start, len) in extents {
            let i = *idx;
            self.build_jobs(
                ticket,
                op,
                start,
                len,
                &blocks[i..i + len as usize],
                i as u32,
                cancel,
                out,
            );
            *idx += len as usize;
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn build_jobs(
        &self,
        ticket: u64,
        op: JobOp,
        start: u64,
        len: u64,
        blocks: &[BlockId],
        index: u32,
        cancel: &Arc<AtomicBool>,
        out: &mut Vec<Job>,
    ) {
        let mut off = 0u64;
        while off < len {
            let k = (len - off).min(self.job_blocks as u64) as usize;
            let mut ids = [0u32; JOB_BLOCKS_MAX];
            for (d, b) in ids.iter_mut().zip(&blocks[off as usize..off as usize + k]) {
                *d = b.0;
            }
            out.push(Job {
                ticket,
                op,
                slot: start + off,
                src_slot: 0,
                index: index + off as u32,
                count: k as u32,
                blocks: ids,
                cancel: cancel.clone(),
            });
            off += k as u64;
        }
    }

    fn push_job(&mut self, tier: TierKind, job: Job) {
        let w = self.workers[tier.index()].as_mut().expect("job for a configured tier");
        w.pending.push_back(job);
        Self::flush(w);
    }

    fn flush(w: &mut WorkerHandle) {
        while w.outstanding < w.capacity {
            let Some(j) = w.pending.pop_front() else { break };
            match w.jobs.push(j) {
                Ok(()) => w.outstanding += 1,
                Err(e) => {
                    w.pending.push_front(e.into_inner());
                    break;
                }
            }
        }
    }

    fn poll_workers(&mut self) {
        for i in 0..3 {
            while let Some(d) = self.next_done(i) {
                self.on_done(d);
            }
        }
    }

    fn next_done(&mut self, i: usize) -> Option<Done> {
        let w = self.workers[i].as_mut()?;
        match w.done.pop() {
            Ok(d) => {
                w.outstanding -= 1;
                Some(d)
            }
            Err(_) => {
                if w.thread.as_ref().is_some_and(|t| t.is_finished()) && w.outstanding > 0 {
                    log::error!("kvswap: worker {i} exited with jobs outstanding");
                }
                Self::flush(w);
                None
            }
        }
    }

    fn on_done(&mut self, d: Done) {
        let Some(st) = self.tickets.get_mut(&d.ticket) else { return };
        st.jobs_left -= 1;
        match d.result {
            Ok(()) => match st.kind {
                Kind::Out => self.stats.bytes_out += d.bytes,
                Kind::In => self.stats.bytes_in += d.bytes,
                Kind::Spill { .. } => self.stats.bytes_spilled += d.bytes,
            },
            Err(f) => {
                let tier = self.seqs.get(&st.seq).and_then(|s| s.copy.as_ref().map(|c| c.tier));
                let tier = st.target.as_ref().map(|p| p.tier).or(tier).unwrap_or(TierKind::Host);
                let e = match f {
                    JobFail::Cancelled => KvSwapError::Cancelled,
                    JobFail::Checksum { index } => {
                        self.stats.checksum_failures += 1;
                        KvSwapError::ChecksumMismatch { seq: st.seq, index, tier }
                    }
                    JobFail::Io { errno }
                        if tier == TierKind::Remote && errno == crate::tier::REMOTE_GONE_ERRNO =>
                    {
                        KvSwapError::RemotePeerGone {
                            detail: "the remote pool stopped answering (connection lost)".into(),
                        }
                    }
                    JobFail::Io { errno } => KvSwapError::TierIo { tier, errno },
                };
                if st.failed.is_none()
                    || st.failed == Some(KvSwapError::Cancelled) && e != KvSwapError::Cancelled
                {
                    st.failed = Some(e);
                }
            }
        }
        self.maybe_finish(d.ticket);
    }

    fn drop_held(&mut self, ticket: u64) {
        let st = self.tickets.get_mut(&ticket).expect("ticket");
        for (_, _, jobs) in &mut st.held {
            st.jobs_left -= jobs.len() as u32;
            jobs.clear();
        }
    }

    fn maybe_finish(&mut self, ticket: u64) {
        let st = self.tickets.get(&ticket).expect("ticket");
        if st.jobs_left > 0 || !st.held.is_empty() {
            return;
        }
        let st = self.tickets.remove(&ticket).expect("ticket");
        let bb = self.block_bytes as u64;
        match st.kind {
            Kind::Out => {
                self.alloc.unpin(&st.pinned);
                let target = st.target.expect("out target");
                let s = self.seqs.get_mut(&st.seq).expect("seq of ticket");
                s.active = None;
                let tenant = s.tenant;
                let result = match st.failed {
                    None => {
                        s.phase = SeqPhase::Out(target.tier);
                        s.copy = Some(target);
                        Ok(())
                    }
                    Some(e) => {
                        s.phase = SeqPhase::Resident;
                        s.blocks_out = 0;
                        self.release(&target);
                        *self.tenant_bytes.entry(tenant).or_insert(0) -= st.bytes;
                        Err(e)
                    }
                };
                self.report(ticket, st.seq, TransferKind::SwapOut, result);
            }
            Kind::In => {
                self.alloc.unpin(&st.pinned);
                let s = self.seqs.get_mut(&st.seq).expect("seq of ticket");
                s.active = None;
                let tenant = s.tenant;
                let result = match st.failed {
                    None => {
                        let copy = s.copy.take().expect("in from a copy");
                        s.phase = SeqPhase::Resident;
                        s.blocks_out = 0;
                        self.release(&copy);
                        *self.tenant_bytes.entry(tenant).or_insert(0) -= st.bytes;
                        Ok(())
                    }
                    Some(e) => {
                        let tier = s.copy.as_ref().expect("copy").tier;
                        s.phase = SeqPhase::Out(tier);
                        Err(e)
                    }
                };
                self.report(ticket, st.seq, TransferKind::SwapIn, result);
            }
            Kind::Spill { parent } => {
                let target = st.target.expect("spill target");
                let s = self.seqs.get_mut(&st.seq).expect("victim");
                s.active = None;
                let ok = st.failed.is_none();
                let old = if ok {
                    let old = s.copy.replace(target).expect("victim copy");
                    s.phase = SeqPhase::Out(s.copy.as_ref().expect("set").tier);
                    Some(old)
                } else {
                    log::warn!(
                        "kvswap: spill of {} failed ({:?}); it stays in host memory",
                        st.seq,
                        st.failed
                    );
                    s.phase = SeqPhase::Out(TierKind::Host);
                    self.release(&target);
                    None
                };
                let _ = bb;
                // Hand the victim's host slots to the parent (or back to the free space).
                #[allow(clippy::type_complexity)]
                let mut hand: Option<(Vec<(u64, u64)>, Vec<Job>)> = None;
                if let Some(p) = self.tickets.get_mut(&parent) {
                    if let Some(i) = p.held.iter().position(|h| h.0 == ticket) {
                        let (_, taken, jobs) = p.held.swap_remove(i);
                        hand = Some((taken, jobs));
                    }
                }
                let parent_ok = self.tickets.get(&parent).is_some_and(|p| p.failed.is_none());
                if let Some(old) = old {
                    let (taken, jobs) = hand.unwrap_or_default();
                    let host = self.workers[0].as_mut().expect("host tier");
                    // Slots of the old copy not taken by the parent go back to free space.
                    for &(a, l) in &old.extents {
                        let mut cur = (a, l);
                        for &(ta, tl) in &taken {
                            if ta == cur.0 && tl <= cur.1 {
                                cur = (cur.0 + tl, cur.1 - tl);
                            }
                        }
                        host.space.release(cur.0, cur.1);
                    }
                    if parent_ok {
                        let p = self.tickets.get_mut(&parent).expect("parent");
                        p.target.as_mut().expect("parent target").extents.extend_from_slice(&taken);
                        for j in jobs {
                            self.push_job(TierKind::Host, j);
                        }
                    } else {
                        if let Some(p) = self.tickets.get_mut(&parent) {
                            p.jobs_left -= jobs.len() as u32;
                        }
                        for (a, l) in taken {
                            host.space.release(a, l);
                        }
                    }
                } else if let Some((_, jobs)) = hand {
                    if let Some(p) = self.tickets.get_mut(&parent) {
                        p.jobs_left -= jobs.len() as u32;
                        p.failed.get_or_insert(st.failed.clone().expect("failed spill"));
                    }
                }
                let seq = st.seq;
                self.reap(seq);
                if self.tickets.contains_key(&parent) {
                    self.maybe_finish(parent);
                }
                return;
            }
        }
        self.reap(st.seq);
    }

    fn report(
        &mut self,
        ticket: u64,
        seq: SeqId,
        kind: TransferKind,
        result: Result<(), KvSwapError>,
    ) {
        self.results.insert(ticket, TicketDone { ticket: Ticket(ticket), seq, kind, result });
        self.finished.push_back(ticket);
    }

    fn release(&mut self, p: &Placement) {
        let sp = self.space(p.tier).expect("placement in a configured tier");
        for &(a, l) in &p.extents {
            sp.release(a, l);
        }
    }

    /// Removes a dropped sequence once nothing is in flight for it.
    fn reap(&mut self, seq: SeqId) {
        let Some(s) = self.seqs.get(&seq) else { return };
        if !s.dropped || s.active.is_some() {
            return;
        }
        let s = self.seqs.remove(&seq).expect("present");
        if let Some(c) = &s.copy {
            self.release(c);
            let bytes = u64::from(s.blocks_out) * self.block_bytes as u64;
            *self.tenant_bytes.entry(s.tenant).or_insert(0) -= bytes;
        }
        let left = self.alloc.free_all_unpinned(seq);
        debug_assert_eq!(left, 0, "dropped sequence still has pinned blocks");
    }
}

impl Seq {
    fn new(tenant: TenantId, clock: u64) -> Seq {
        Seq {
            tenant,
            phase: SeqPhase::Resident,
            copy: None,
            blocks_out: 0,
            last_use: clock,
            dropped: false,
            active: None,
        }
    }
}

impl Drop for SwapEngine {
    fn drop(&mut self) {
        // Closing the job rings lets each worker drain what it started and exit; joining
        // keeps the device and host memory (Arcs held here too) alive until then.
        for w in self.workers.iter_mut().flatten() {
            w.pending.clear();
            let (dead_p, _dead_c) = spsc::channel::<Job>(2);
            drop(std::mem::replace(&mut w.jobs, dead_p));
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostDeviceMemory;

    #[test]
    fn host_tier_checksum_catches_a_flipped_byte() {
        let bb = 64 * 1024;
        let dev = Arc::new(HostDeviceMemory::new(bb, 8).unwrap());
        let config = EngineConfig { host_bytes: 8 * bb as u64, ..EngineConfig::default() };
        let mut e = SwapEngine::new(config, dev.clone()).unwrap();
        let b = e.alloc_blocks(SeqId(1), 3).unwrap();
        let t = e.swap_out(SeqId(1), &b).unwrap();
        e.wait(t, Duration::from_secs(10)).unwrap();
        // The copy sits in host slots 0..3 (first fit); flip a byte of the second block.
        // SAFETY: the offset is inside the host tier mapping (8 blocks of `bb` bytes).
        let byte = unsafe { e._host.base().add(bb + 77) };
        // SAFETY: no transfer is in flight, so nothing else touches that byte now.
        unsafe { *byte ^= 0x40 };
        let t = e.swap_in(SeqId(1), &b).unwrap();
        let r = e.wait(t, Duration::from_secs(10));
        let want = KvSwapError::ChecksumMismatch { seq: SeqId(1), index: 1, tier: TierKind::Host };
        assert_eq!(r, Err(want));
        assert_eq!(e.lookup(SeqId(1)).unwrap().phase, SeqPhase::Out(TierKind::Host));
        assert_eq!(e.stats().checksum_failures, 1);
    }
}
