//! Completions: the [`CompletionQueue`] (polled, or woken through its completion channel) and
//! what one finished work request says.

use super::*;

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
