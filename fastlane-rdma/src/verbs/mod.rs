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

mod cq;
mod qp;

pub(crate) use cq::completion_error;
use cq::CqInner;
pub use cq::{status_str, Completion, CompletionQueue, PollMode};
pub use qp::{QpConfig, QpEndpoint, QueuePair, SendOp, SendRequest, Sge};

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
