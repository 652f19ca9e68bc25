//! Thin owners of the verbs objects: device context, protection domain, memory region,
//! completion queue (with an optional completion channel) and RC queue pair.
//!
//! Each owner frees its object on drop and holds an `Arc` to the object it was made from, so
//! a queue pair can never outlive its PD or device context. The order the objects go away in
//! is the reverse of creation, which is what libibverbs requires.

use std::ffi::CStr;
use std::fmt;
use std::os::raw::c_int;
use std::ptr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys as ffi;

use crate::error::{RdmaError, Result};

/// The port every rxe and most RoCE devices expose.
pub const PORT_NUM: u8 = 1;

/// Names of the RDMA devices libibverbs can see (empty without a device or a provider).
pub fn device_names() -> Vec<String> {
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid out-pointer; the list is freed below before returning.
    let list = unsafe { ffi::ibv_get_device_list(&mut n) };
    if list.is_null() {
        return Vec::new();
    }
    let mut out = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: libibverbs returned `n` valid entries in `list`.
        let dev = unsafe { *list.wrapping_add(i) };
        // SAFETY: `dev` is a device from the live list; the name lives as long as the list.
        let name = unsafe { ffi::ibv_get_device_name(dev) };
        if !name.is_null() {
            // SAFETY: a NUL-terminated string owned by the list, copied before the free.
            out.push(unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned());
        }
    }
    // SAFETY: `list` came from ibv_get_device_list and is freed once.
    unsafe { ffi::ibv_free_device_list(list) };
    out
}

/// An open device context and what connection setup needs from its port.
pub(crate) struct DeviceInner {
    pub(crate) ctx: *mut ffi::ibv_context,
    pub(crate) name: String,
    pub(crate) gid_index: u8,
    pub(crate) gid: [u8; 16],
    pub(crate) lid: u16,
    pub(crate) active_mtu: ffi::ibv_mtu::Type,
    pub(crate) max_rd_atom: u8,
}

// SAFETY: an ibv_context may be used from any thread (libibverbs locks internally); the
// pointer is only freed in Drop, when no Arc holder is left.
unsafe impl Send for DeviceInner {}
// SAFETY: as above; shared use only calls thread-safe verbs.
unsafe impl Sync for DeviceInner {}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        // SAFETY: every PD/CQ/QP holds an Arc to this, so all of them are gone already.
        unsafe { ffi::ibv_close_device(self.ctx) };
    }
}

/// An open RDMA device (port 1), by name.
#[derive(Clone)]
pub struct Device {
    pub(crate) inner: Arc<DeviceInner>,
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.inner.name)
            .field("gid_index", &self.inner.gid_index)
            .field("active_mtu", &mtu_bytes(self.inner.active_mtu))
            .finish()
    }
}

impl Device {
    /// Opens the device `name` (e.g. `rxe0`), picking the GID index itself: the first
    /// IPv4-mapped GID (what RoCE v2 over an IPv4 netdev needs), else index 0.
    pub fn open(name: &str) -> Result<Self> {
        Self::open_with_gid(name, None)
    }

    /// Opens the device `name` with an explicit GID index (`None`: choose as [`open`]).
    ///
    /// [`open`]: Device::open
    pub fn open_with_gid(name: &str, gid_index: Option<u8>) -> Result<Self> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer; the list is freed before returning.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(RdmaError::NoSuchDevice { name: name.to_owned(), available: Vec::new() });
        }
        let mut available = Vec::new();
        let mut ctx = ptr::null_mut();
        for i in 0..n.max(0) as usize {
            // SAFETY: libibverbs returned `n` valid entries in `list`.
            let dev = unsafe { *list.wrapping_add(i) };
            // SAFETY: `dev` is from the live list.
            let cname = unsafe { ffi::ibv_get_device_name(dev) };
            if cname.is_null() {
                continue;
            }
            // SAFETY: NUL-terminated, owned by the list, copied before the free.
            let dev_name = unsafe { CStr::from_ptr(cname) }.to_string_lossy().into_owned();
            if dev_name == name {
                // SAFETY: `dev` is from the live list; the context outlives the list.
                ctx = unsafe { ffi::ibv_open_device(dev) };
                if ctx.is_null() {
                    let err = RdmaError::last_os("ibv_open_device");
                    // SAFETY: freed once, no entry used afterwards.
                    unsafe { ffi::ibv_free_device_list(list) };
                    return Err(err);
                }
                break;
            }
            available.push(dev_name);
        }
        // SAFETY: `list` came from ibv_get_device_list and is freed once.
        unsafe { ffi::ibv_free_device_list(list) };
        if ctx.is_null() {
            return Err(RdmaError::NoSuchDevice { name: name.to_owned(), available });
        }
        // From here the context is owned by `inner` (closed on every error path by Drop).
        let mut inner = DeviceInner {
            ctx,
            name: name.to_owned(),
            gid_index: 0,
            gid: [0; 16],
            lid: 0,
            active_mtu: ffi::ibv_mtu::IBV_MTU_1024,
            max_rd_atom: 1,
        };

        // SAFETY: all-zero is a valid ibv_port_attr (integers only).
        let mut port: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is open; `port` is a valid out-pointer of the full struct size.
        let ret = unsafe { ffi::___ibv_query_port(ctx, PORT_NUM, &mut port) };
        if ret != 0 {
            return Err(RdmaError::from_ret("ibv_query_port", ret));
        }
        if port.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
            return Err(RdmaError::InvalidArgument {
                op: "Device::open",
                detail: format!("{name} port {PORT_NUM} is not ACTIVE (state {})", port.state),
            });
        }
        inner.lid = port.lid;
        inner.active_mtu = port.active_mtu;

        // SAFETY: all-zero is a valid ibv_device_attr (integers and arrays only).
        let mut dattr: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is open; `dattr` is a valid out-pointer.
        let ret = unsafe { ffi::ibv_query_device(ctx, &mut dattr) };
        if ret != 0 {
            return Err(RdmaError::from_ret("ibv_query_device", ret));
        }
        let atom = dattr.max_qp_rd_atom.min(dattr.max_qp_init_rd_atom).clamp(1, 16);
        inner.max_rd_atom = atom as u8;

        let chosen = match gid_index {
            Some(i) => i,
            None => {
                let mut pick = None;
                for i in 0..port.gid_tbl_len.clamp(0, 256) {
                    if let Ok(g) = query_gid(ctx, i) {
                        if is_ipv4_mapped(&g) {
                            pick = Some(i as u8);
                            break;
                        }
                    }
                }
                pick.unwrap_or(0)
            }
        };
        inner.gid = query_gid(ctx, c_int::from(chosen))?;
        inner.gid_index = chosen;
        Ok(Device { inner: Arc::new(inner) })
    }

    /// The device name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The GID index used for connections.
    pub fn gid_index(&self) -> u8 {
        self.inner.gid_index
    }

    /// The port's active MTU in bytes (the path MTU of every connection).
    pub fn active_mtu_bytes(&self) -> u32 {
        mtu_bytes(self.inner.active_mtu)
    }

    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        // SAFETY: the context is open for as long as `self.inner` lives; the PD keeps a clone.
        let pd = unsafe { ffi::ibv_alloc_pd(self.inner.ctx) };
        if pd.is_null() {
            return Err(RdmaError::last_os("ibv_alloc_pd"));
        }
        Ok(ProtectionDomain { inner: Arc::new(PdInner { pd, dev: self.inner.clone() }) })
    }
}

fn query_gid(ctx: *mut ffi::ibv_context, index: c_int) -> Result<[u8; 16]> {
    // SAFETY: all-zero is a valid ibv_gid (a byte array).
    let mut gid: ffi::ibv_gid = unsafe { std::mem::zeroed() };
    // SAFETY: `ctx` is an open context; `gid` is a valid out-pointer.
    let ret = unsafe { ffi::ibv_query_gid(ctx, PORT_NUM, index, &mut gid) };
    if ret != 0 {
        return Err(RdmaError::last_os("ibv_query_gid"));
    }
    // SAFETY: every bit pattern of the union is a valid byte array.
    Ok(unsafe { gid.raw })
}

fn is_ipv4_mapped(gid: &[u8; 16]) -> bool {
    gid[..10].iter().all(|&b| b == 0) && gid[10] == 0xff && gid[11] == 0xff
}

/// Bytes of an `ibv_mtu` value.
pub(crate) fn mtu_bytes(mtu: ffi::ibv_mtu::Type) -> u32 {
    match mtu {
        ffi::ibv_mtu::IBV_MTU_256 => 256,
        ffi::ibv_mtu::IBV_MTU_512 => 512,
        ffi::ibv_mtu::IBV_MTU_1024 => 1024,
        ffi::ibv_mtu::IBV_MTU_2048 => 2048,
        ffi::ibv_mtu::IBV_MTU_4096 => 4096,
        _ => 0,
    }
}

pub(crate) struct PdInner {
    pub(crate) pd: *mut ffi::ibv_pd,
    pub(crate) dev: Arc<DeviceInner>,
}

// SAFETY: a PD is usable from any thread; freed only in Drop when no holder is left.
unsafe impl Send for PdInner {}
// SAFETY: as above.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: every MR and QP of this PD holds an Arc to it, so they are gone.
        unsafe { ffi::ibv_dealloc_pd(self.pd) };
    }
}

/// A protection domain.
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<PdInner>,
}

impl fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProtectionDomain").field("device", &self.inner.dev.name).finish()
    }
}

/// Access rights of a memory registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Access {
    /// Peers may RDMA WRITE into it.
    pub remote_write: bool,
    /// Peers may RDMA READ from it.
    pub remote_read: bool,
}

impl Access {
    /// Local use only (send source, receive and READ target).
    pub const LOCAL: Access = Access { remote_write: false, remote_read: false };
    /// Peers may WRITE and READ.
    pub const REMOTE_RW: Access = Access { remote_write: true, remote_read: true };

    fn bits(self) -> u32 {
        let mut a = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        if self.remote_write {
            a |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        }
        if self.remote_read {
            a |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        }
        a
    }
}

/// A registered memory region. It does not own the memory it describes: see
/// [`MemoryRegion::register`] for who must keep it alive. [`crate::RegisteredBuffer`] is the
/// safe owner of both.
pub struct MemoryRegion {
    mr: *mut ffi::ibv_mr,
    addr: u64,
    len: usize,
    lkey: u32,
    rkey: u32,
    _pd: Arc<PdInner>,
}

// SAFETY: the MR handle may be used and deregistered from any thread.
unsafe impl Send for MemoryRegion {}
// SAFETY: shared use only reads the copied keys.
unsafe impl Sync for MemoryRegion {}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("lkey", &self.lkey)
            .field("rkey", &self.rkey)
            .finish()
    }
}

impl MemoryRegion {
    /// Registers `len` bytes at `addr` with the device, for local use and the given remote
    /// access.
    ///
    /// # Safety
    ///
    /// The memory `addr..addr + len` must stay allocated (not unmapped, not freed, not
    /// reused for anything that must not be overwritten) until **both** of these are true:
    /// the returned region has been dropped (deregistered), and every work request that names
    /// it — posted locally, or by a peer that holds its rkey — has completed or its queue pair
    /// has been destroyed. The caller keeps it alive; the device may write it at any time in
    /// between, so the caller must not hold a Rust reference (`&`/`&mut`) to it while peers
    /// or posted requests may access it — only raw pointers.
    pub unsafe fn register(
        pd: &ProtectionDomain,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Self> {
        if len == 0 {
            return Err(RdmaError::InvalidArgument {
                op: "ibv_reg_mr",
                detail: "zero length".into(),
            });
        }
        // SAFETY: the PD is live (we hold its Arc); the caller promised the memory outlives
        // the registration and every request naming it.
        let mr = unsafe { ffi::ibv_reg_mr(pd.inner.pd, addr.cast(), len, access.bits() as c_int) };
        if mr.is_null() {
            return Err(RdmaError::last_os("ibv_reg_mr"));
        }
        // SAFETY: `mr` is a valid MR just returned by libibverbs.
        let ffi::ibv_mr { lkey, rkey, .. } = unsafe { *mr };
        Ok(MemoryRegion { mr, addr: addr as u64, len, lkey, rkey, _pd: pd.inner.clone() })
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Always false (zero-length registrations are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Local key (for scatter/gather entries).
    pub fn lkey(&self) -> u32 {
        self.lkey
    }
    /// Remote key (what a peer needs to WRITE/READ it).
    pub fn rkey(&self) -> u32 {
        self.rkey
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: `mr` is a live registration, deregistered once. The memory itself is the
        // owner's concern (see `register`).
        let ret = unsafe { ffi::ibv_dereg_mr(self.mr) };
        if ret != 0 {
            log::warn!("ibv_dereg_mr failed: {}", std::io::Error::from_raw_os_error(ret));
        }
    }
}

/// How a waiter learns about completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PollMode {
    /// Spin on `ibv_poll_cq` (lowest latency, burns a core).
    #[default]
    Busy,
    /// Sleep on the completion channel's file descriptor between polls.
    Event,
}

/// One finished work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The `wr_id` given when posting.
    pub wr_id: u64,
    /// `IBV_WC_SUCCESS` (0) or the error status.
    pub status: u32,
    /// `ibv_wc_opcode` of the request.
    pub opcode: u32,
    /// Bytes received (receives only).
    pub byte_len: u32,
    /// Immediate data (host order), when the request carried some.
    pub imm: Option<u32>,
    /// Provider-specific error detail.
    pub vendor_err: u32,
}

impl Completion {
    /// Whether it succeeded.
    pub fn is_ok(&self) -> bool {
        self.status == ffi::ibv_wc_status::IBV_WC_SUCCESS
    }
}

/// Human name of a completion status.
pub fn status_str(status: u32) -> String {
    // SAFETY: ibv_wc_status_str returns a static string for any value.
    let s = unsafe { ffi::ibv_wc_status_str(status) };
    if s.is_null() {
        return format!("status {status}");
    }
    // SAFETY: a static NUL-terminated string.
    unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
}

pub(crate) struct CqInner {
    pub(crate) cq: *mut ffi::ibv_cq,
    channel: *mut ffi::ibv_comp_channel,
    channel_fd: c_int,
    _dev: Arc<DeviceInner>,
}

// SAFETY: CQ polling and notification are thread-safe in libibverbs; freed only in Drop.
unsafe impl Send for CqInner {}
// SAFETY: as above.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        // SAFETY: the QPs using this CQ hold an Arc to it, so they are destroyed already;
        // events were acknowledged as they were taken.
        unsafe { ffi::ibv_destroy_cq(self.cq) };
        if !self.channel.is_null() {
            // SAFETY: the only CQ on this channel was destroyed just above.
            unsafe { ffi::ibv_destroy_comp_channel(self.channel) };
        }
    }
}

/// A completion queue, with a completion channel when created for [`PollMode::Event`].
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
    wcs: Box<[ffi::ibv_wc]>,
    batch: usize,
    mode: PollMode,
}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue").field("mode", &self.mode).finish()
    }
}

/// Completions polled in one `ibv_poll_cq` call.
const POLL_BATCH: usize = 16;

impl CompletionQueue {
    /// Creates a CQ of `depth` entries on `device`.
    pub fn new(device: &Device, depth: u32, mode: PollMode) -> Result<Self> {
        let ctx = device.inner.ctx;
        let mut channel = ptr::null_mut();
        let mut channel_fd = -1;
        if mode == PollMode::Event {
            // SAFETY: the context is open (we hold the device's Arc).
            channel = unsafe { ffi::ibv_create_comp_channel(ctx) };
            if channel.is_null() {
                return Err(RdmaError::last_os("ibv_create_comp_channel"));
            }
            // SAFETY: `channel` is valid; reading its fd field.
            channel_fd = unsafe { (*channel).fd };
            // SAFETY: fcntl on the channel's own descriptor; non-blocking so a spurious
            // wakeup never blocks in ibv_get_cq_event.
            let flags = unsafe { libc::fcntl(channel_fd, libc::F_GETFL) };
            // SAFETY: as above.
            unsafe { libc::fcntl(channel_fd, libc::F_SETFL, flags | libc::O_NONBLOCK) };
        }
        let depth = depth.clamp(1, 1 << 16) as c_int;
        // SAFETY: context open; channel null or valid and owned by the CqInner built below.
        let cq = unsafe { ffi::ibv_create_cq(ctx, depth, ptr::null_mut(), channel, 0) };
        if cq.is_null() {
            let err = RdmaError::last_os("ibv_create_cq");
            if !channel.is_null() {
                // SAFETY: no CQ uses it.
                unsafe { ffi::ibv_destroy_comp_channel(channel) };
            }
            return Err(err);
        }
        let inner = Arc::new(CqInner { cq, channel, channel_fd, _dev: device.inner.clone() });
        if mode == PollMode::Event {
            // SAFETY: `cq` is valid; arm it for the first event.
            let ret = unsafe { ffi::ibv_req_notify_cq(cq, 0) };
            if ret != 0 {
                return Err(RdmaError::from_ret("ibv_req_notify_cq", ret));
            }
        }
        let wcs = (0..POLL_BATCH)
            // SAFETY: all-zero is a valid ibv_wc (integers and a union of integers).
            .map(|_| unsafe { std::mem::zeroed::<ffi::ibv_wc>() })
            .collect::<Vec<_>>()
            .into_boxed_slice();
        Ok(CompletionQueue { inner, wcs, batch: POLL_BATCH, mode })
    }

    /// Completions taken per poll, 1 to 16 (1 for a receive queue read one message at a
    /// time).
    pub fn set_batch(&mut self, batch: usize) {
        self.batch = batch.clamp(1, POLL_BATCH);
    }

    /// The poll mode it was created with.
    pub fn mode(&self) -> PollMode {
        self.mode
    }

    /// Polls once without waiting; calls `f` for each completion. Returns how many.
    pub fn poll(&mut self, mut f: impl FnMut(Completion)) -> Result<usize> {
        // SAFETY: the CQ is live; `wcs` has POLL_BATCH writable entries.
        let n =
            unsafe { ffi::ibv_poll_cq(self.inner.cq, self.batch as c_int, self.wcs.as_mut_ptr()) };
        if n < 0 {
            return Err(RdmaError::from_ret("ibv_poll_cq", n));
        }
        for wc in &self.wcs[..n as usize] {
            let with_imm = wc.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
            let imm = if with_imm {
                // SAFETY: the IBV_WC_WITH_IMM flag says the union holds imm_data.
                Some(u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data }))
            } else {
                None
            };
            f(Completion {
                wr_id: wc.wr_id,
                status: wc.status,
                opcode: wc.opcode,
                byte_len: wc.byte_len,
                imm,
                vendor_err: wc.vendor_err,
            });
        }
        Ok(n as usize)
    }

    /// Waits until at least one completion was handed to `f`, or `deadline` passes
    /// (`Ok(0)`). Busy mode spins; event mode sleeps on the channel. `check` runs about
    /// every millisecond (e.g. to notice a peer's closed socket) and may end the wait with
    /// an error.
    pub fn wait(
        &mut self,
        deadline: Instant,
        f: &mut dyn FnMut(Completion),
        check: &mut dyn FnMut() -> Result<()>,
    ) -> Result<usize> {
        let mut spins: u32 = 0;
        let mut last_check = Instant::now();
        loop {
            let n = self.poll(&mut *f)?;
            if n > 0 {
                return Ok(n);
            }
            match self.mode {
                PollMode::Busy => {
                    spins = spins.wrapping_add(1);
                    // Instant::now costs ~1 µs under TCG: look at the clock now and then.
                    if !spins.is_multiple_of(256) {
                        std::hint::spin_loop();
                        continue;
                    }
                    let now = Instant::now();
                    if now >= deadline {
                        return Ok(0);
                    }
                    if now.duration_since(last_check) >= Duration::from_millis(1) {
                        check()?;
                        last_check = now;
                    }
                }
                PollMode::Event => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Ok(0);
                    }
                    check()?;
                    let slice = (deadline - now).min(Duration::from_millis(10));
                    self.sleep_for_event(slice)?;
                }
            }
        }
    }

    /// Sleeps up to `max` for a completion event, consumes and acknowledges it and re-arms
    /// the CQ. The caller polls afterwards (events only say "something may be there").
    fn sleep_for_event(&mut self, max: Duration) -> Result<()> {
        let mut pfd = libc::pollfd { fd: self.inner.channel_fd, events: libc::POLLIN, revents: 0 };
        let ms = max.as_millis().clamp(1, i32::MAX as u128) as c_int;
        // SAFETY: one valid pollfd for the channel's descriptor.
        let ret = unsafe { libc::poll(&mut pfd, 1, ms) };
        if ret < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                return Ok(());
            }
            return Err(RdmaError::Verbs { op: "poll(completion channel)", source: e });
        }
        if ret == 0 {
            return Ok(());
        }
        let mut cq = ptr::null_mut();
        let mut cq_ctx = ptr::null_mut();
        // SAFETY: channel valid; out-pointers valid; non-blocking fd so it cannot hang.
        let ret = unsafe { ffi::ibv_get_cq_event(self.inner.channel, &mut cq, &mut cq_ctx) };
        if ret != 0 {
            return Ok(()); // EAGAIN: spurious wakeup.
        }
        // SAFETY: acknowledging the one event just taken from our own CQ.
        unsafe { ffi::ibv_ack_cq_events(cq, 1) };
        // SAFETY: re-arm; completions that arrived before this are found by the next poll.
        let ret = unsafe { ffi::ibv_req_notify_cq(self.inner.cq, 0) };
        if ret != 0 {
            return Err(RdmaError::from_ret("ibv_req_notify_cq", ret));
        }
        Ok(())
    }
}

/// What the peer needs to know about one side of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpEndpoint {
    /// Queue pair number.
    pub qpn: u32,
    /// Initial packet sequence number.
    pub psn: u32,
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// GID (RoCE: the IPv4-mapped address).
    pub gid: [u8; 16],
}

/// Transport settings of an RC queue pair.
#[derive(Debug, Clone, Copy)]
pub struct QpConfig {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Bytes that may be posted inline (copied at post time).
    pub max_inline: u32,
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout per try.
    pub ack_timeout_exp: u8,
    /// Transport retries before the request fails with "retry exceeded" (peer gone).
    pub retry_cnt: u8,
    /// RNR retries (7 = retry forever; waits have their own timeouts).
    pub rnr_retry: u8,
}

impl Default for QpConfig {
    fn default() -> Self {
        // 2^16 × 4.096 µs ≈ 268 ms per try, 7 tries: a vanished peer fails a request after
        // about 2 s, while a guest stalled by a busy host does not trip it.
        QpConfig {
            max_send_wr: 256,
            max_recv_wr: 256,
            max_inline: 64,
            ack_timeout_exp: 16,
            retry_cnt: 7,
            rnr_retry: 7,
        }
    }
}

/// A reliable-connected queue pair.
pub struct QueuePair {
    qp: *mut ffi::ibv_qp,
    qpn: u32,
    psn: u32,
    max_inline: u32,
    config: QpConfig,
    pd: Arc<PdInner>,
    _send_cq: Arc<CqInner>,
    _recv_cq: Arc<CqInner>,
}

// SAFETY: posting and modifying a QP are thread-safe verbs; destroyed only in Drop.
unsafe impl Send for QueuePair {}

impl fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueuePair").field("qpn", &self.qpn).finish()
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: destroyed once. After this returns the device no longer touches any memory
        // the QP's requests named, which is what lets buffer owners free theirs afterwards.
        let ret = unsafe { ffi::ibv_destroy_qp(self.qp) };
        if ret != 0 {
            log::warn!("ibv_destroy_qp failed: {}", std::io::Error::from_raw_os_error(ret));
        }
    }
}

impl QueuePair {
    /// Creates an RC QP in the RESET state and moves it to INIT.
    pub fn new(
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        config: QpConfig,
    ) -> Result<Self> {
        // SAFETY: all-zero is a valid ibv_qp_init_attr (null pointers, integers).
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = send_cq.inner.cq;
        init.recv_cq = recv_cq.inner.cq;
        init.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        init.cap.max_send_wr = config.max_send_wr;
        init.cap.max_recv_wr = config.max_recv_wr;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        init.cap.max_inline_data = config.max_inline;
        // SAFETY: PD and CQs are live and kept alive by the Arcs stored in the QueuePair.
        let qp = unsafe { ffi::ibv_create_qp(pd.inner.pd, &mut init) };
        if qp.is_null() {
            return Err(RdmaError::last_os("ibv_create_qp"));
        }
        // SAFETY: `qp` is valid.
        let qpn = unsafe { (*qp).qp_num };
        let psn = random_psn();
        let this = QueuePair {
            qp,
            qpn,
            psn,
            max_inline: init.cap.max_inline_data,
            config,
            pd: pd.inner.clone(),
            _send_cq: send_cq.inner.clone(),
            _recv_cq: recv_cq.inner.clone(),
        };
        // SAFETY: all-zero is a valid ibv_qp_attr.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = PORT_NUM;
        attr.qp_access_flags = Access::REMOTE_RW.bits();
        let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE
            | ffi::ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
            | ffi::ibv_qp_attr_mask::IBV_QP_PORT
            | ffi::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
        this.modify(&mut attr, mask, "ibv_modify_qp(INIT)")?;
        Ok(this)
    }

    /// This side's connection data.
    pub fn endpoint(&self) -> QpEndpoint {
        QpEndpoint { qpn: self.qpn, psn: self.psn, lid: self.pd.dev.lid, gid: self.pd.dev.gid }
    }

    /// Bytes a send may carry inline.
    pub fn max_inline(&self) -> u32 {
        self.max_inline
    }

    fn modify(
        &self,
        attr: &mut ffi::ibv_qp_attr,
        mask: ffi::ibv_qp_attr_mask,
        op: &'static str,
    ) -> Result<()> {
        // SAFETY: `qp` is live; `attr` is a valid attribute struct for the mask.
        let ret = unsafe { ffi::ibv_modify_qp(self.qp, attr, mask.0 as c_int) };
        if ret != 0 {
            return Err(RdmaError::from_ret(op, ret));
        }
        Ok(())
    }

    /// INIT → RTR → RTS against `remote`.
    pub fn connect(&self, remote: &QpEndpoint) -> Result<()> {
        let dev = &self.pd.dev;
        // SAFETY: all-zero is a valid ibv_qp_attr.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
        attr.path_mtu = dev.active_mtu;
        attr.dest_qp_num = remote.qpn;
        attr.rq_psn = remote.psn;
        attr.max_dest_rd_atomic = dev.max_rd_atom;
        attr.min_rnr_timer = 12;
        attr.ah_attr.is_global = 1;
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.sl = 0;
        attr.ah_attr.src_path_bits = 0;
        attr.ah_attr.port_num = PORT_NUM;
        attr.ah_attr.grh.dgid.raw = remote.gid;
        attr.ah_attr.grh.sgid_index = dev.gid_index;
        attr.ah_attr.grh.hop_limit = 64;
        attr.ah_attr.grh.flow_label = 0;
        attr.ah_attr.grh.traffic_class = 0;
        let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE
            | ffi::ibv_qp_attr_mask::IBV_QP_AV
            | ffi::ibv_qp_attr_mask::IBV_QP_PATH_MTU
            | ffi::ibv_qp_attr_mask::IBV_QP_DEST_QPN
            | ffi::ibv_qp_attr_mask::IBV_QP_RQ_PSN
            | ffi::ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | ffi::ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
        self.modify(&mut attr, mask, "ibv_modify_qp(RTR)")?;

        // SAFETY: all-zero is a valid ibv_qp_attr.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
        attr.timeout = self.config.ack_timeout_exp;
        attr.retry_cnt = self.config.retry_cnt;
        attr.rnr_retry = self.config.rnr_retry;
        attr.sq_psn = self.psn;
        attr.max_rd_atomic = dev.max_rd_atom;
        let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE
            | ffi::ibv_qp_attr_mask::IBV_QP_TIMEOUT
            | ffi::ibv_qp_attr_mask::IBV_QP_RETRY_CNT
            | ffi::ibv_qp_attr_mask::IBV_QP_RNR_RETRY
            | ffi::ibv_qp_attr_mask::IBV_QP_SQ_PSN
            | ffi::ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify(&mut attr, mask, "ibv_modify_qp(RTS)")
    }

    /// Moves the QP to the error state: outstanding requests complete with a flush status.
    pub fn set_error(&self) -> Result<()> {
        // SAFETY: all-zero is a valid ibv_qp_attr.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_ERR;
        self.modify(&mut attr, ffi::ibv_qp_attr_mask::IBV_QP_STATE, "ibv_modify_qp(ERR)")
    }

    /// Posts one send-queue request.
    ///
    /// # Safety
    ///
    /// `local` (if any) must describe memory registered under `local.lkey` that stays
    /// allocated, and is not freed or reused, until this request's completion has been
    /// polled or the QP has been destroyed (for inline sends: until this call returns).
    /// A READ target must in addition not be referenced by any `&`/`&mut` until then.
    pub unsafe fn post_send(&self, wr: &SendRequest, local: Option<Sge>) -> Result<()> {
        let mut sge = sge_of(local);
        // SAFETY: all-zero is a valid ibv_send_wr (null pointers, integers, unions of those).
        let mut swr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        swr.wr_id = wr.wr_id;
        if local.is_some() {
            swr.sg_list = &mut sge;
            swr.num_sge = 1;
        }
        let mut flags = 0u32;
        if wr.signaled {
            flags |= ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        if wr.inline {
            flags |= ffi::ibv_send_flags::IBV_SEND_INLINE.0;
        }
        swr.send_flags = flags;
        match wr.op {
            SendOp::Write { remote_addr, rkey, imm } => {
                swr.opcode = if imm.is_some() {
                    ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM
                } else {
                    ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE
                };
                swr.imm_data_invalidated_rkey_union.imm_data = imm.unwrap_or(0).to_be();
                swr.wr.rdma = ffi::rdma_t { remote_addr, rkey };
            }
            SendOp::Read { remote_addr, rkey } => {
                swr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_READ;
                swr.wr.rdma = ffi::rdma_t { remote_addr, rkey };
            }
            SendOp::Send { imm } => {
                swr.opcode = if imm.is_some() {
                    ffi::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM
                } else {
                    ffi::ibv_wr_opcode::IBV_WR_SEND
                };
                swr.imm_data_invalidated_rkey_union.imm_data = imm.unwrap_or(0).to_be();
            }
        }
        let mut bad = ptr::null_mut();
        // SAFETY: `swr` and `sge` live on this stack frame for the call (the provider copies
        // them into its queue); the caller keeps the memory `sge` names alive until the
        // completion (contract above).
        let ret = unsafe { ffi::ibv_post_send(self.qp, &mut swr, &mut bad) };
        if ret != 0 {
            return Err(RdmaError::from_ret("ibv_post_send", ret));
        }
        Ok(())
    }

    /// Posts one receive.
    ///
    /// # Safety
    ///
    /// `local` (if any) must be registered memory that stays allocated and unreferenced by
    /// `&`/`&mut` until the receive's completion is polled or the QP is destroyed.
    pub unsafe fn post_recv(&self, wr_id: u64, local: Option<Sge>) -> Result<()> {
        let mut sge = sge_of(local);
        let mut rwr =
            ffi::ibv_recv_wr { wr_id, next: ptr::null_mut(), sg_list: ptr::null_mut(), num_sge: 0 };
        if local.is_some() {
            rwr.sg_list = &mut sge;
            rwr.num_sge = 1;
        }
        let mut bad = ptr::null_mut();
        // SAFETY: `rwr`/`sge` are valid for the call; the caller keeps the target alive.
        let ret = unsafe { ffi::ibv_post_recv(self.qp, &mut rwr, &mut bad) };
        if ret != 0 {
            return Err(RdmaError::from_ret("ibv_post_recv", ret));
        }
        Ok(())
    }
}

/// A scatter/gather entry: local registered memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// Start address.
    pub addr: u64,
    /// Length.
    pub len: u32,
    /// Local key of the registration that covers it.
    pub lkey: u32,
}

/// The operation of a send-queue request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// RDMA WRITE, with immediate data when `imm` is set.
    Write {
        /// Remote virtual address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Immediate data (consumes a receive at the peer).
        imm: Option<u32>,
    },
    /// RDMA READ into the local entry.
    Read {
        /// Remote virtual address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// SEND (consumes a receive at the peer).
    Send {
        /// Immediate data.
        imm: Option<u32>,
    },
}

/// One send-queue request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendRequest {
    /// Echoed in the completion.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp,
    /// Ask for a completion.
    pub signaled: bool,
    /// Copy the payload at post time (size ≤ [`QueuePair::max_inline`]).
    pub inline: bool,
}

fn sge_of(local: Option<Sge>) -> ffi::ibv_sge {
    match local {
        Some(l) => ffi::ibv_sge { addr: l.addr, length: l.len, lkey: l.lkey },
        None => ffi::ibv_sge { addr: 0, length: 0, lkey: 0 },
    }
}

fn random_psn() -> u32 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    (t ^ std::process::id().rotate_left(8)) & 0x00ff_ffff
}

/// Maps an error completion to the crate's error.
pub(crate) fn completion_error(op: &'static str, c: &Completion) -> RdmaError {
    use ffi::ibv_wc_status as s;
    match c.status {
        s::IBV_WC_REM_ACCESS_ERR | s::IBV_WC_LOC_PROT_ERR => RdmaError::RemoteAccess {
            op,
            offset: 0,
            len: 0,
            granted: 0,
            remote: c.status == s::IBV_WC_REM_ACCESS_ERR,
        },
        s::IBV_WC_RETRY_EXC_ERR | s::IBV_WC_RNR_RETRY_EXC_ERR | s::IBV_WC_WR_FLUSH_ERR => {
            RdmaError::PeerGone { op, detail: status_str(c.status) }
        }
        _ => RdmaError::Completion { op, status: status_str(c.status), vendor_err: c.vendor_err },
    }
}
