//! The reliable-connected [`QueuePair`]: creation, connection (INIT → RTR → RTS) and posting
//! work requests.

use super::*;

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
