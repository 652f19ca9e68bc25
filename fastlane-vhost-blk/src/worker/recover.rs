//! Start-up on the frontend's in-flight region: resubmit what a previous backend left in
//! flight.

use super::*;

impl Worker {
    /// Track this queue's requests in the frontend's in-flight region (call before the
    /// worker first runs, then [`Worker::recover_inflight`]).
    pub fn track_inflight(&mut self, q: InflightQueue) {
        self.inflight = Some(q);
    }

    /// At the queue's start on an in-flight region: repair a torn completion, move the avail
    /// position past everything taken before, and resubmit the requests that were in flight,
    /// in the order they were first taken. Returns how many were resubmitted. On a region it
    /// cannot read, tracking is turned off for this queue (logged) and the queue starts where
    /// the frontend said.
    pub fn recover_inflight(&mut self) -> usize {
        let qi = self.config.queue_index;
        let Some(tracker) = self.inflight.as_mut() else {
            return 0;
        };
        let mem = self.mem.memory();
        let vring = self.vring.clone();
        let mut st = vring.get_mut();
        let (used_ring, desc_table, size) = {
            let q = st.get_queue();
            (q.used_ring(), q.desc_table(), q.size())
        };
        // The used ring's idx (VIRTIO 1.2 §2.7.8: flags u16, idx u16, ring[]), as the guest
        // sees it.
        let used_idx = match GuestAddress(used_ring)
            .checked_add(2)
            .and_then(|a| mem.read_obj::<u16>(a).ok())
        {
            Some(v) => u16::from_le(v),
            None => {
                error!("queue {qi}: used ring at {used_ring:#x} is not in guest memory; in-flight tracking off for this queue");
                self.inflight = None;
                return 0;
            }
        };
        let rec = match tracker.recover(used_idx) {
            Ok(r) => r,
            Err(e) => {
                error!("queue {qi}: in-flight region refused: {e}; tracking off for this queue, it starts where the frontend said");
                self.inflight = None;
                return 0;
            }
        };
        st.get_queue_mut().set_next_avail(rec.next_avail);
        st.get_queue_mut().set_next_used(used_idx);
        let mut submitted = 0usize;
        let mut used = 0usize;
        for &head in &rec.resubmit {
            let walk = ChainWalk::new(&*mem, GuestAddress(desc_table), size, head);
            match self.start(&mem, head, walk) {
                Started::Submitted => submitted += 1,
                Started::Done(len) => {
                    put_used(&mut st, self.inflight.as_ref(), qi, head, len, true);
                    used += 1;
                }
                Started::Full => {
                    // The block queue is fresh and as deep as the largest vring: not reached.
                    error!("queue {qi}: block queue full while resubmitting head {head}; the rest stay in flight");
                    break;
                }
            }
        }
        if used > 0 {
            notify(&mut st);
        }
        drop(st);
        if submitted > 0 {
            if let Some(q) = self.queue.as_mut() {
                if let Err(e) = q.kick() {
                    error!("queue {qi}: block queue kick failed: {e}");
                }
            }
        }
        let n = rec.resubmit.len();
        let qs = self.qstats();
        qs.resubmitted.fetch_add(n as u64, Ordering::Relaxed);
        if rec.torn_repaired {
            qs.torn_repaired.fetch_add(1, Ordering::Relaxed);
        }
        if rec.fresh {
            info!("queue {qi}: in-flight region fresh; tracking every request from used idx {used_idx}");
        } else {
            info!(
                "queue {qi}: in-flight region: resubmitted {n} request(s), resuming at avail idx {} (used idx {used_idx}{})",
                rec.next_avail,
                if rec.torn_repaired { ", a torn completion repaired" } else { "" }
            );
        }
        n
    }
}
