//! Completions: drain the block queue onto the used ring and signal the guest.

use super::*;

impl Worker {
    /// Drain finished requests onto the used ring. Returns how many.
    pub(super) fn reap(&mut self) -> usize {
        let Some(queue) = self.queue.as_mut() else {
            return 0;
        };
        if queue.in_flight() == 0 {
            return 0;
        }
        let n = queue.complete(&mut self.completions);
        if n == 0 {
            return 0;
        }
        let vring = self.vring.clone();
        let mut st = vring.get_mut();
        for i in 0..n {
            let c = self.completions[i];
            self.finish_completion(&mut st, c);
        }
        notify(&mut st);
        n
    }

    fn finish_completion(&mut self, st: &mut VringState<AtomicMem>, c: Completion) {
        let head = c.tag as u16;
        let slot = self
            .slots
            .get_mut(head as usize)
            .filter(|s| s.mem.is_some() && u64::from(head) == c.tag);
        // A completion for a tag we never submitted is the backend's bug, not the guest's.
        let Some(slot) = slot else {
            debug_assert!(false, "completion for unknown tag {}", c.tag);
            error!(
                "queue {}: block queue completed unknown tag {}",
                self.config.queue_index, c.tag
            );
            return;
        };
        let Some(mem) = slot.mem.take() else {
            return;
        };
        let (status, len) = match c.result {
            Ok(_) => (VIRTIO_BLK_S_OK as u8, slot.used_len),
            Err(BlockError::Unsupported) => (VIRTIO_BLK_S_UNSUPP as u8, 1),
            Err(_) => (VIRTIO_BLK_S_IOERR as u8, 1),
        };
        let _ = mem.write_obj(status, slot.status);
        let qs = self.stats.queue(self.config.queue_index as usize);
        if c.result.is_ok() {
            qs.completed.fetch_add(1, Ordering::Relaxed);
            match slot.op {
                BlockOp::Read if slot.used_len > 1 => {
                    qs.bytes_read.fetch_add(u64::from(slot.bytes), Ordering::Relaxed);
                }
                BlockOp::Read => {}
                BlockOp::Write | BlockOp::WriteFua => {
                    qs.bytes_written.fetch_add(u64::from(slot.bytes), Ordering::Relaxed);
                }
                BlockOp::Flush => {
                    qs.flushes.fetch_add(1, Ordering::Relaxed);
                }
                BlockOp::Discard | BlockOp::WriteZeroes { .. } => {
                    qs.discards.fetch_add(1, Ordering::Relaxed);
                }
            }
        } else {
            qs.failed.fetch_add(1, Ordering::Relaxed);
        }
        let clock = self.config.clock;
        let ns = clock.ns_between(slot.start, clock.now());
        self.latency.saturating_record(ns.max(1));
        put_used(st, self.inflight.as_ref(), self.config.queue_index, head, len, true);
    }
}

/// Put `head` on the used ring, with the in-flight region's protocol around it when the queue
/// is tracked: `last_batch_head` before, the mark cleared (when `clear`) and `used_idx` after.
pub(super) fn put_used(
    st: &mut VringState<AtomicMem>,
    tracker: Option<&InflightQueue>,
    queue_index: u16,
    head: u16,
    len: u32,
    clear: bool,
) {
    if let Some(t) = tracker {
        t.pre_put(head);
    }
    if let Err(e) = st.add_used(head, len) {
        error!("queue {queue_index}: cannot add to the used ring: {e}");
        return;
    }
    if let Some(t) = tracker {
        t.post_put(head, st.get_queue().next_used(), clear);
    }
}

pub(super) fn notify(st: &mut VringState<AtomicMem>) {
    // EVENT_IDX: only when the guest asked (used_event); otherwise always.
    if st.needs_notification().unwrap_or(true) {
        if let Err(e) = st.signal_used_queue() {
            warn!("cannot signal the call eventfd: {e}");
        }
    }
}
