//! Taking chains off the avail ring: parse each one, then finish it here or submit it to the
//! block queue.

use super::*;

impl Worker {
    /// Pop every available chain and start it. Returns how many chains were consumed.
    pub(super) fn drain_avail(&mut self) -> usize {
        let mem = self.mem.memory();
        let vring = self.vring.clone();
        let mut st = vring.get_mut();
        if !st.get_queue().ready() || !st.is_enabled() {
            return 0;
        }
        let mut consumed = 0usize;
        let mut used = 0usize;
        while let Some(chain) = st.get_queue_mut().pop_descriptor_chain(&*mem) {
            let head = chain.head_index();
            // Every chain taken is marked in flight before anything else happens to it, so
            // that after a crash "taken = used + in flight" holds (inflight.rs). A head the
            // guest republished while it is still in flight is not marked again: its entry
            // belongs to the request in flight, and the chain is refused in `start`.
            let republished = self.slots.get(usize::from(head)).is_some_and(|s| s.mem.is_some());
            if !republished {
                if let Some(t) = self.inflight.as_mut() {
                    t.mark(head);
                }
            }
            let descs = chain.into_iter();
            match self.start(&mem, head, descs) {
                Started::Done(len) => {
                    let q = self.config.queue_index;
                    put_used(&mut st, self.inflight.as_ref(), q, head, len, !republished);
                    used += 1;
                    consumed += 1;
                }
                Started::Submitted => consumed += 1,
                Started::Full => {
                    if let Some(t) = self.inflight.as_mut() {
                        t.unmark(head);
                    }
                    st.get_queue_mut().go_to_previous_position();
                    break;
                }
            }
        }
        if used > 0 {
            notify(&mut st);
        }
        drop(st);
        if consumed > used {
            if let Some(q) = self.queue.as_mut() {
                if let Err(e) = q.kick() {
                    error!("queue {}: block queue kick failed: {e}", self.config.queue_index);
                }
            }
        }
        consumed
    }

    /// Parse one chain and either finish it here or submit it.
    pub(super) fn start(
        &mut self,
        mem: &GuestMemoryLoadGuard<GuestMem>,
        head: u16,
        descs: impl IntoIterator<Item = Descriptor>,
    ) -> Started {
        let start = self.config.clock.now();
        let req = match self.parser.parse(&**mem, descs) {
            Ok(req) => req,
            Err(rej) => return self.finish_rejected(mem, head, rej.reason, rej.status),
        };
        let slot_free = self.slots.get(head as usize).is_some_and(|s| s.mem.is_none());
        if !slot_free {
            return self.finish_rejected(mem, head, RejectReason::HeadInFlight, Some(req.status));
        }
        let op = match req.kind {
            RequestKind::GetId => {
                let serial = self.config.serial;
                let used_len = match self.parser.write_id(&**mem, &req, &serial) {
                    Some(n) => {
                        self.finish_ok(mem, &req, start);
                        n + 1
                    }
                    None => {
                        self.finish_status(mem, req.status, VIRTIO_BLK_S_IOERR as u8);
                        self.qstats().failed.fetch_add(1, Ordering::Relaxed);
                        1
                    }
                };
                return Started::Done(used_len);
            }
            RequestKind::Read | RequestKind::Write if req.len == 0 => {
                self.finish_ok(mem, &req, start);
                return Started::Done(1);
            }
            RequestKind::Read => BlockOp::Read,
            RequestKind::Write => BlockOp::Write,
            RequestKind::Flush => BlockOp::Flush,
            RequestKind::Discard => BlockOp::Discard,
            RequestKind::WriteZeroes { unmap } => BlockOp::WriteZeroes { unmap },
        };
        if self.queue.is_none() {
            match self.device.open_queue(u32::from(self.config.queue_size_max)) {
                Ok(q) => self.queue = Some(q),
                Err(e) => {
                    error!(
                        "queue {}: cannot open a block queue: {e}; failing the request",
                        self.config.queue_index
                    );
                    self.finish_status(mem, req.status, VIRTIO_BLK_S_IOERR as u8);
                    self.qstats().failed.fetch_add(1, Ordering::Relaxed);
                    return Started::Done(1);
                }
            }
        }
        let Some(queue) = self.queue.as_mut() else {
            unreachable!("opened above");
        };
        let breq = BlockRequest {
            op,
            offset: req.offset,
            len: req.len,
            segments: self.parser.segments(),
            tag: u64::from(head),
        };
        // SAFETY:
        // - every segment was checked by the parser to lie inside one region of `mem`, and the
        //   slot below keeps a clone of that memory snapshot (an `Arc` of the mappings) until the
        //   completion with this tag is drained in `reap`/`quiesce`, or the block queue is
        //   dropped (it is dropped before the slots: field order), so the memory stays mapped;
        // - the memory is the guest's: the guest promised (by publishing the chain) not to touch
        //   a request's buffers until it is on the used ring, and we do not touch them either;
        //   a guest that breaks that promise only corrupts its own data.
        let submitted = unsafe { queue.submit(breq) };
        match submitted {
            Ok(()) => {
                let used_len = match op {
                    // Read: the data plus the status byte went to the guest.
                    BlockOp::Read => u32::try_from(req.len + 1).unwrap_or(u32::MAX),
                    _ => 1,
                };
                let slot = &mut self.slots[head as usize];
                slot.mem = Some(mem.clone());
                slot.status = req.status;
                slot.used_len = used_len;
                slot.bytes = u32::try_from(req.len).unwrap_or(u32::MAX);
                slot.op = op;
                slot.start = start;
                Started::Submitted
            }
            Err(QueueFull(_)) => Started::Full,
        }
    }

    fn finish_ok(&mut self, mem: &GuestMem, req: &ParsedRequest, start: u64) {
        self.finish_status(mem, req.status, VIRTIO_BLK_S_OK as u8);
        self.qstats().completed.fetch_add(1, Ordering::Relaxed);
        self.record_latency(start);
    }

    fn finish_rejected(
        &mut self,
        mem: &GuestMem,
        head: u16,
        reason: RejectReason,
        status: Option<GuestAddress>,
    ) -> Started {
        self.qstats().reject(reason);
        self.warn_guest(format_args!("{} (head {head})", reason.describe()));
        match status {
            Some(addr) => {
                self.finish_status(mem, addr, reason.status());
                Started::Done(1)
            }
            // No status byte to write: hand the chain back with length 0.
            None => Started::Done(0),
        }
    }

    fn finish_status(&self, mem: &GuestMem, addr: GuestAddress, status: u8) {
        // The parser checked the address lies in guest memory; a failure here means the memory
        // changed under us, and the guest gets what it asked for.
        let _ = mem.write_obj(status, addr);
    }

    fn record_latency(&mut self, start: u64) {
        let clock = self.config.clock;
        let ns = clock.ns_between(start, clock.now());
        self.latency.saturating_record(ns.max(1));
    }
}
