//! One connection: reading frames, `HELLO` and the engine ops, replies; and the refusal of a
//! peer that may not be served.

use super::*;

/// Answers a peer that may not be served: reads its first frame (bounded in time), replies
/// to it with `code` and `msg` in the peer's protocol version, and closes.
pub(super) fn refuse(mut stream: UnixStream, code: ErrorCode, msg: &str) {
    let _ = stream.set_read_timeout(Some(Duration::from_millis(50)));
    let deadline = Instant::now() + REFUSE_READ_WAIT;
    let mut hb = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN && Instant::now() < deadline {
        match stream.read(&mut hb[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(_) => {}
        }
    }
    let mut version = proto::VERSION;
    let (mut op, mut req_id) = (proto::op::HELLO, 0);
    if got == HEADER_LEN && hb[0..4] == MAGIC.to_le_bytes() {
        version = u16::from_le_bytes([hb[4], hb[5]]);
        op = u16::from_le_bytes([hb[6], hb[7]]) & !proto::REPLY;
        req_id = u32::from_le_bytes([hb[8], hb[9], hb[10], hb[11]]);
        // Drain the payload so the close does not reset the reply away.
        let mut left =
            (u32::from_le_bytes([hb[12], hb[13], hb[14], hb[15]]) as usize).min(PAYLOAD_MAX);
        let mut sink = [0u8; 4096];
        while left > 0 && Instant::now() < deadline {
            let want = left.min(sink.len());
            match stream.read(&mut sink[..want]) {
                Ok(0) => break,
                Ok(n) => left -= n,
                Err(_) => {}
            }
        }
    }
    let frame = error_frame(version, op, req_id, code, msg);
    let _ = stream.write_all(&frame);
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

/// A reply frame carrying an error status and message, in protocol `version`.
fn error_frame(version: u16, op: u16, req_id: u32, code: ErrorCode, msg: &str) -> Vec<u8> {
    let mut payload = (code as u32).to_le_bytes().to_vec();
    payload.extend_from_slice(msg.as_bytes());
    payload.truncate(PAYLOAD_MAX);
    let h = Header { op: op | proto::REPLY, req_id, len: payload.len() as u32 };
    let mut frame = h.encode_version(version).to_vec();
    frame.extend_from_slice(&payload);
    frame
}

enum ReadErr {
    Closed,
    Proto(ProtoError),
    /// A well-formed header of another protocol version.
    Version {
        version: u16,
        op: u16,
        req_id: u32,
    },
}

impl Conn {
    pub(super) fn run(mut self) {
        let _ = self.stream.set_read_timeout(Some(Duration::from_millis(100)));
        let mut buf = vec![0u8; HEADER_LEN + PAYLOAD_MAX];
        loop {
            match self.read_frame(&mut buf) {
                Ok((h, req)) => {
                    self.counters.requests.fetch_add(1, Ordering::Relaxed);
                    if self.handle(h, req).is_err() {
                        break;
                    }
                }
                Err(ReadErr::Closed) => break,
                Err(ReadErr::Version { version, op, req_id }) => {
                    log::warn!(
                        "kv serve: connection {} speaks protocol version {version}, not {}; \
                         closing it",
                        self.id,
                        proto::VERSION
                    );
                    self.counters.protocol_errors.fetch_add(1, Ordering::Relaxed);
                    let msg = format!(
                        "kv serve speaks protocol version {} (per-connection device pools, \
                         HELLO with slab size and namespace); this client speaks version \
                         {version}: upgrade the client",
                        proto::VERSION
                    );
                    let f = error_frame(version, op, req_id, ErrorCode::VersionUnsupported, &msg);
                    let _ = (&self.stream).write_all(&f);
                    let _ = self.stream.shutdown(std::net::Shutdown::Write);
                    break;
                }
                Err(ReadErr::Proto(e)) => {
                    log::warn!(
                        "kv serve: connection {} sent a bad frame ({e}); closing it",
                        self.id
                    );
                    self.counters.protocol_errors.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            }
        }
        self.release_pins();
        let mut e = self.engine();
        for s in &self.seqs {
            let _ = e.drop_seq(self.seq(*s));
        }
        drop(e);
        // Dropping cancelled what had not started; wait (bounded, the lock taken per slice)
        // for what had, so that the slab is idle and can go back to the pool now.
        let deadline = Instant::now() + DRAIN_WAIT_MAX;
        let tickets: Vec<u64> = self.tickets.drain().collect();
        for t in tickets {
            loop {
                let r = self.engine().wait(Ticket(t), Duration::from_millis(1));
                match r {
                    Err(KvSwapError::Timeout { .. })
                        if Instant::now() < deadline && !self.stop.load(Ordering::Relaxed) => {}
                    _ => break,
                }
            }
        }
        if let Some(slab) = self.slab.take() {
            let mut e = self.engine();
            if e.range_idle(slab.range()) {
                // SAFETY: the slab was attached for this connection and not detached; its
                // blocks are owned by no sequence and pinned by no transfer (just checked,
                // under the engine lock, which every allocation and transfer start takes),
                // and only this connection's sequences could allocate in its range.
                if let Err(err) = unsafe { self.device.detach(slab) } {
                    log::error!("kv serve: connection {}: giving back {slab:?}: {err}", self.id);
                }
            } else {
                // Not under the engine lock: `reclaim_draining` takes this list's lock first.
                drop(e);
                log::warn!(
                    "kv serve: connection {} closed with transfers in flight; its {slab:?} \
                     is reclaimed once they drain",
                    self.id
                );
                lock_draining(&self.draining).push(slab);
            }
        }
        log::debug!(
            "kv serve: connection {} (pid {} uid {}, namespace {:?}) closed",
            self.id,
            self.cred.pid,
            self.cred.uid,
            self.namespace
        );
    }

    /// Gives back the slabs of closed connections whose transfers have drained since.
    fn reclaim_draining(&self) {
        let mut draining = lock_draining(&self.draining);
        if draining.is_empty() {
            return;
        }
        let mut e = self.engine();
        draining.retain(|slab| {
            if !e.range_idle(slab.range()) {
                return true;
            }
            // SAFETY: the slab was attached for a connection that is gone and was put here
            // instead of being detached; no live connection allocates in its range, and the
            // engine (locked) reports its blocks unowned and unpinned.
            match unsafe { self.device.detach(*slab) } {
                Ok(()) => false,
                Err(err) => {
                    log::error!("kv serve: giving back {slab:?}: {err}");
                    true
                }
            }
        });
    }

    fn hello(&mut self, blocks: u32, namespace: &str) -> Result<(Vec<u8>, OwnedFd), Refusal> {
        if self.slab.is_some() {
            return Err((ErrorCode::Other, "HELLO twice on one connection".into()));
        }
        let ns = self
            .config
            .namespace_for(&self.cred, namespace)
            .map_err(|m| (ErrorCode::NamespaceRefused, m))?;
        let want = if blocks == 0 { self.config.conn_blocks_default } else { blocks };
        if want > self.config.conn_blocks_max {
            return Err((
                ErrorCode::QuotaExceeded,
                format!(
                    "asked for a slab of {want} blocks; this server allows at most {} per \
                     connection",
                    self.config.conn_blocks_max
                ),
            ));
        }
        self.reclaim_draining();
        let (slab, fd) = self.device.attach(want).map_err(|e| match e {
            KvSwapError::DeviceFull { free, .. } => (
                ErrorCode::DeviceFull,
                format!(
                    "no free run of {want} blocks in the device pool (largest {free}); other \
                     connections hold the rest"
                ),
            ),
            e => (ErrorCode::of(&e), e.to_string()),
        })?;
        let reply = HelloReply {
            block_bytes: self.device.block_bytes() as u64,
            first_block: slab.first,
            blocks: slab.blocks,
            map_len: (slab.blocks as usize * self.device.block_bytes()) as u64,
            namespace: ns.clone(),
        };
        log::info!(
            "kv serve: connection {} (pid {} uid {} gid {}) in namespace {ns:?} holds blocks \
             {}..{}",
            self.id,
            self.cred.pid,
            self.cred.uid,
            self.cred.gid,
            slab.first,
            slab.first + slab.blocks
        );
        self.slab = Some(slab);
        self.namespace = Some(ns);
        Ok((reply.encode(), fd))
    }

    /// The shared engine, locked.
    ///
    /// The lock is poisoned only when another connection's thread panicked while it held it,
    /// i.e. inside a `SwapEngine` call: an assertion of ours failed, never a peer's input
    /// (requests are validated before they reach the engine). Going on with an engine left
    /// half-updated could hand one sequence's blocks to another, so this thread stops too.
    #[allow(clippy::expect_used)]
    pub(super) fn engine(&self) -> MutexGuard<'_, SwapEngine> {
        self.engine.lock().expect("kv serve: engine lock poisoned by a panic in the engine")
    }

    fn read_exact(&mut self, out: &mut [u8]) -> Result<(), ReadErr> {
        let mut got = 0;
        while got < out.len() {
            if self.stop.load(Ordering::Relaxed) {
                return Err(ReadErr::Closed);
            }
            match self.stream.read(&mut out[got..]) {
                Ok(0) => return Err(ReadErr::Closed),
                Ok(n) => got += n,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock
                            | std::io::ErrorKind::TimedOut
                            | std::io::ErrorKind::Interrupted
                    ) => {}
                Err(_) => return Err(ReadErr::Closed),
            }
        }
        Ok(())
    }

    fn read_frame(&mut self, buf: &mut [u8]) -> Result<(Header, Request), ReadErr> {
        self.read_exact(&mut buf[..HEADER_LEN])?;
        let h = match Header::decode(&buf[..HEADER_LEN]) {
            Ok(h) => h,
            Err(ProtoError::BadVersion(version)) => {
                return Err(ReadErr::Version {
                    version,
                    op: u16::from_le_bytes([buf[6], buf[7]]) & !proto::REPLY,
                    req_id: u32::from_le_bytes([buf[8], buf[9], buf[10], buf[11]]),
                })
            }
            Err(e) => return Err(ReadErr::Proto(e)),
        };
        let end = HEADER_LEN + h.len as usize;
        self.read_exact(&mut buf[HEADER_LEN..end])?;
        let req = Request::decode(h.op, &buf[HEADER_LEN..end]).map_err(ReadErr::Proto)?;
        Ok((h, req))
    }

    fn seq(&self, s: u32) -> SeqId {
        SeqId(self.id << 32 | u64::from(s))
    }

    fn reply(
        &mut self,
        h: Header,
        body: Result<Vec<u8>, Refusal>,
        fd: Option<RawFd>,
    ) -> std::io::Result<()> {
        let mut payload = Vec::with_capacity(64);
        match body {
            Ok(b) => {
                payload.extend_from_slice(&(ErrorCode::Ok as u32).to_le_bytes());
                payload.extend_from_slice(&b);
            }
            Err((code, msg)) => {
                payload.extend_from_slice(&(code as u32).to_le_bytes());
                payload.extend_from_slice(msg.as_bytes());
            }
        }
        let rh = Header { op: h.op | proto::REPLY, req_id: h.req_id, len: payload.len() as u32 };
        let mut frame = rh.encode().to_vec();
        frame.extend_from_slice(&payload);
        match fd {
            // SCM_RIGHTS: the fd rides on the first bytes; a short send finishes without it.
            Some(fd) => {
                let sent =
                    self.stream.send_with_fd(&frame[..], fd).map_err(std::io::Error::from)?;
                (&self.stream).write_all(&frame[sent..])
            }
            None => self.stream.write_all(&frame),
        }
    }

    fn handle(&mut self, h: Header, req: Request) -> std::io::Result<()> {
        let blocks = |v: &[u32]| v.iter().map(|b| BlockId(*b)).collect::<Vec<_>>();
        let slab = match (&req, self.slab) {
            (Request::Hello { blocks, namespace }, _) => {
                return match self.hello(*blocks, namespace) {
                    // The memfd is closed here once sent: the mappings keep the slab alive.
                    Ok((b, fd)) => self.reply(h, Ok(b), Some(fd.as_raw_fd())),
                    Err(r) => self.reply(h, Err(r), None),
                };
            }
            (_, Some(slab)) => slab,
            (_, None) => {
                let msg = format!(
                    "send HELLO first (protocol version {}): it gives this connection its slab \
                     of the device pool",
                    proto::VERSION
                );
                return self.reply(h, Err((ErrorCode::HelloRequired, msg)), None);
            }
        };
        if let Some(r) = self.content_addressed(slab, &req) {
            self.counters.cas_requests.fetch_add(1, Ordering::Relaxed);
            return self.reply(h, r, None);
        }
        let r: Result<Vec<u8>, KvSwapError> = match req {
            Request::Hello { .. } => Ok(Vec::new()),
            Request::Alloc { seq, n } => {
                let r = self.engine().alloc_blocks_in(self.seq(seq), n, slab.range());
                r.map(|v| {
                    self.seqs.insert(seq);
                    let mut b = (v.len() as u32).to_le_bytes().to_vec();
                    for x in v {
                        b.extend_from_slice(&x.0.to_le_bytes());
                    }
                    b
                })
            }
            Request::Free { seq, blocks: bl } => {
                self.engine().free_blocks(self.seq(seq), &blocks(&bl)).map(|_| Vec::new())
            }
            Request::Lookup { seq } => {
                let info = self.engine().lookup(self.seq(seq));
                match info {
                    None => Err(KvSwapError::UnknownSequence { seq: SeqId(u64::from(seq)) }),
                    Some(i) => {
                        let (phase, tier) = match i.phase {
                            SeqPhase::Resident => (0u8, 255u8),
                            SeqPhase::SwappingOut => (1, 255),
                            SeqPhase::Out(t) => (2, t.index() as u8),
                            SeqPhase::Spilling => (3, TierKind::Host.index() as u8),
                            SeqPhase::SwappingIn => (4, 255),
                        };
                        let mut b = vec![phase, tier, 0, 0];
                        b.extend_from_slice(&i.blocks_out.to_le_bytes());
                        b.extend_from_slice(&i.device_blocks.to_le_bytes());
                        Ok(b)
                    }
                }
            }
            Request::PrepareStore { seq, blocks: bl } => {
                let r = self.engine().swap_out(self.seq(seq), &blocks(&bl));
                r.map(|t| {
                    self.tickets.insert(t.0);
                    t.0.to_le_bytes().to_vec()
                })
            }
            Request::PrepareLoad { seq, blocks: bl } => {
                let r = self.engine().swap_in(self.seq(seq), &blocks(&bl));
                r.map(|t| {
                    self.tickets.insert(t.0);
                    t.0.to_le_bytes().to_vec()
                })
            }
            Request::Complete { ticket, timeout_ms } => {
                if !self.tickets.contains(&ticket) {
                    Err(KvSwapError::UnknownTicket { ticket })
                } else {
                    let deadline = Instant::now()
                        + Duration::from_millis(u64::from(timeout_ms)).min(COMPLETE_WAIT_MAX);
                    loop {
                        let r = self.engine().wait(Ticket(ticket), Duration::from_millis(1));
                        match r {
                            Err(KvSwapError::Timeout { .. })
                                if Instant::now() < deadline
                                    && !self.stop.load(Ordering::Relaxed) =>
                            {
                                continue
                            }
                            Err(KvSwapError::Timeout { .. }) => {
                                break Err(KvSwapError::Timeout { ticket })
                            }
                            other => {
                                self.tickets.remove(&ticket);
                                break other.map(|_| Vec::new());
                            }
                        }
                    }
                }
            }
            Request::Touch { seq } => self.engine().touch(self.seq(seq)).map(|_| Vec::new()),
            Request::Drop { seq } => {
                let r = self.engine().drop_seq(self.seq(seq));
                self.seqs.remove(&seq);
                r.map(|_| Vec::new())
            }
            Request::Cancel { ticket } => {
                if !self.tickets.contains(&ticket) {
                    Err(KvSwapError::UnknownTicket { ticket })
                } else {
                    self.engine().cancel(Ticket(ticket)).map(|_| Vec::new())
                }
            }
            Request::Stats => {
                let st = self.engine().stats();
                let mut b = Vec::new();
                for t in &st.tiers {
                    b.extend_from_slice(&t.capacity_bytes.to_le_bytes());
                    b.extend_from_slice(&t.used_bytes.to_le_bytes());
                }
                b.extend_from_slice(&st.device_free.to_le_bytes());
                b.extend_from_slice(&st.device_pinned.to_le_bytes());
                Ok(b)
            }
            // Answered by `content_addressed` above.
            Request::Put { .. }
            | Request::Get { .. }
            | Request::Exists { .. }
            | Request::Pin { .. }
            | Request::Unpin { .. }
            | Request::Evict { .. } => Ok(Vec::new()),
        };
        self.reply(h, r.map_err(|e| (ErrorCode::of(&e), e.to_string())), None)
    }
}

/// The list of slabs waiting to drain. Held only for `Vec` edits and `range_idle`/`detach`
/// calls that return errors rather than panic, so a poisoned lock still holds a valid list.
fn lock_draining(m: &Mutex<Vec<Slab>>) -> MutexGuard<'_, Vec<Slab>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
