//! [`WriterIo::Dsync`](super::WriterIo::Dsync): each batch is one write that is durable when
//! it completes, several in flight, no flushes.
//!
//! # Why writes never overlap, and what a crash can leave
//!
//! A batch is sealed with a padding frame from its end to the next block boundary
//! ([`format::pad_next`]), so every write covers whole blocks `[base, write_end)`. The next
//! batch starts
//!
//! - at `floor(end)`, rewriting the last partial block with the same leading bytes (as the
//!   pipelined writer does), only when **no write is in flight**: the block it rewrites was
//!   written by a write that has completed, so the two never race on the device;
//! - at `write_end` of the batch before, a block of its own, when a write is in flight.
//!
//! So no two writes in flight share a byte. Completions may arrive in any order; the durable
//! seq is published in submission order, only for a prefix of writes that have all
//! completed: a record is acknowledged only when it and every record before it are durable.
//! A crash can leave a later write durable and an earlier one not: recovery's scan stops at
//! the hole (zeroes, or an older version of the block), and everything after it lies within
//! the torn window (every in-flight write is framed within `max_batch_bytes` of the durable
//! end, the bound the pipelined writer keeps), so recovery zeroes it; none of it was
//! acknowledged.
//!
//! # Holding a small batch
//!
//! While a write is in flight, the next batch is submitted only once it reaches the end of
//! its block (or when no write is in flight any more): every batch started during a write
//! takes a block of its own, so submitting each record as it arrives turns a fast stream into
//! one padded 4 KiB FUA write per record or two. Measured on this project's virtio disk
//! (`journal bench-service`, 3 alternating rounds, BENCHMARKS): at 200,000 records/s ack P99
//! 3.8 ms with every batch submitted at once, 0.28–0.51 ms holding, 0.20 ms for the same
//! schedule written with no journal; allowing two small writes in flight before holding
//! brought the 3.7 ms back. A record that arrives during a write waits for it at most; at
//! low rates a write is seldom in flight and nothing changes.
//!
//! # Sharing the block after all
//!
//! A batch begun in a block of its own because a write was in flight is moved back, once
//! every write has completed and before it is submitted, to right after the last frame of
//! the write before (its buffer shifted by that block's leading bytes, which are put in
//! front, as for a batch begun with nothing in flight); with nothing pending, the end itself
//! moves back. Without that a stream whose records arrive during writes took a block per
//! write: at 20,000 records/s of 64 bytes one 4 KiB block per two records, segments filling
//! ~17x faster than the frames' bytes (`journal bench-service --segment-bytes 8M`: 19-20
//! rolls in 4 s before, 1 after). A batch that was submitted in its own block (it filled
//! it) stays there, and so does one too large to take the leading bytes too.
//!
//! # Waiting
//!
//! With writes in flight the writer polls both the completion queue and the rings, without
//! sleeping: a record that arrives during a write is written at once (that is what this mode
//! is for), and on this VM a sleeping thread wakes tens of µs late. After [`SPIN`] it yields
//! between polls, so that a kernel worker sharing its core (io_uring's, for a write the block
//! layer cannot complete inline) gets to run. Idle, it sleeps on the rings as the other modes
//! do.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::super::format::{encode_pad, pad_next, FRAME_HEADER_LEN};
use super::super::io::{AlignedBuf, IO_TIMEOUT};
use super::super::JournalError;
use super::{Batch, Writer, IDLE_SLICE};

/// Writes in flight at once (the queue is opened with depth 4).
pub(super) const WRITES_MAX: usize = 4;
/// How long the busy writer spins before it yields between polls.
const SPIN: Duration = Duration::from_micros(20);

/// The oldest write, if it has completed: the next one whose records may be acknowledged.
/// A write that completed while an earlier one is still in flight waits for it (the durable
/// seq covers a completed prefix of the writes, never a hole).
fn completed_prefix<T: Done>(inflight: &mut VecDeque<T>) -> Option<T> {
    if inflight.front().is_some_and(Done::done) {
        inflight.pop_front()
    } else {
        None
    }
}

/// A write that may have completed.
trait Done {
    fn done(&self) -> bool;
}

impl Done for InFlight {
    fn done(&self) -> bool {
        self.done
    }
}

/// A batch whose write is in flight (or completed out of order, waiting for the ones before
/// it).
struct InFlight {
    tag: u64,
    batch: Batch,
    /// The end of its write (after its padding frame).
    write_end: u64,
    done: bool,
}

impl Writer {
    pub(super) fn run_dsync(&mut self) -> Result<(), JournalError> {
        let len = self.spare.first().map_or(0, AlignedBuf::len);
        // A buffer per write in flight and one for the pending batch.
        while self.spare.len() < WRITES_MAX + 1 {
            self.spare.push(AlignedBuf::new(len));
        }
        let mut inflight: VecDeque<InFlight> = VecDeque::with_capacity(WRITES_MAX);
        let mut next_tag = 1u64;
        let mut fault_published = false;
        // Where the frames ended when a batch had to start in a block of its own (a write was
        // in flight), with that block's leading bytes and the segment's first seq: see
        // "Sharing the block after all" above.
        let mut padded: Option<(u64, u64)> = None;
        let mut padded_carry: Vec<u8> = Vec::with_capacity(self.align() as usize);
        loop {
            self.sync_sources();
            let stopping = self.stop.load(Ordering::Acquire);
            let mut moved = self.reap_dsync(&mut inflight)?;
            if inflight.is_empty() {
                if let Some((end0, first_seq)) = padded.take() {
                    // A roll since (a new segment): nothing to go back to.
                    if first_seq == self.sb.first_seq {
                        self.unpad(end0, &padded_carry);
                    }
                }
            }
            // While a write is in flight the next batch waits until it fills its block or
            // that write completes (see "Holding a small batch" above).
            if inflight.len() < WRITES_MAX
                && (inflight.is_empty() || stopping || self.pending_fills_block())
            {
                if !inflight.is_empty() {
                    // Written in its own block while another write is in flight: it stays
                    // there.
                    padded = None;
                }
                moved |= self.submit_dsync(&mut inflight, &mut next_tag)?;
            }
            let reading = self.fault.is_none() && !self.device_full;
            if reading && self.can_frame() {
                // Only when it moves the end (nothing pending, the end inside a block): the
                // block's leading bytes are kept once, not on every turn of this loop.
                if !inflight.is_empty()
                    && self.pending.is_none()
                    && !self.end.is_multiple_of(self.align())
                {
                    padded_carry.clear();
                    padded_carry.extend_from_slice(&self.carry);
                    padded = Some((self.end, self.sb.first_seq));
                    self.own_block();
                }
                let busy = !inflight.is_empty() || self.pending.is_some();
                let wait = if moved || stopping || busy { None } else { Some(IDLE_SLICE) };
                if self.frame(wait)? > 0 {
                    continue;
                }
                let still_reading = self.fault.is_none() && !self.device_full;
                if stopping && still_reading && inflight.is_empty() && self.pending.is_none() {
                    return Ok(());
                }
                if !moved && !inflight.is_empty() {
                    self.poll_dsync(&mut inflight)?;
                }
                continue;
            }
            if moved {
                continue;
            }
            if !inflight.is_empty() {
                // No room to frame (buffers, torn window) or not reading: the device has the
                // work.
                self.poll_dsync(&mut inflight)?;
                continue;
            }
            if reading {
                // Nothing in flight and no room: only a pending batch can be waiting.
                continue;
            }
            if self.pending.is_some() {
                continue;
            }
            if self.stopped_reading(&mut fault_published, stopping)? {
                return Ok(());
            }
        }
    }

    /// The pending batch reaches the end of its first block (no room left for more than
    /// its padding frame's header).
    fn pending_fills_block(&self) -> bool {
        let align = self.align();
        self.pending.as_ref().is_some_and(|b| b.end - b.base + FRAME_HEADER_LEN as u64 >= align)
    }

    /// A write is in flight: the next batch must not share its last block. Moves the end to
    /// the block after the padding frame that ended that write.
    fn own_block(&mut self) {
        if self.pending.is_some() {
            return;
        }
        let align = self.align();
        if !self.end.is_multiple_of(align) {
            self.end = pad_next(self.end, align);
            self.carry.clear();
        }
    }

    /// Every write has completed since [`own_block`](Self::own_block) moved the end from
    /// `end0` (whose block began with `carry0`): the next write may share that block after
    /// all. Moves the pending batch back to `end0` (or, with none, the end itself), so that
    /// its frames follow the last write's; a batch too large to take the block's leading
    /// bytes as well stays in its own block.
    fn unpad(&mut self, end0: u64, carry0: &[u8]) {
        let align = self.align();
        let base0 = end0 / align * align;
        let keep = (end0 - base0) as usize;
        if keep != carry0.len() {
            return;
        }
        let cap = self.batch_cap();
        let Some(b) = self.pending.as_mut() else {
            self.end = end0;
            self.carry.clear();
            self.carry.extend_from_slice(carry0);
            return;
        };
        let len = (b.end - b.base) as usize;
        if keep + len > cap || b.base != pad_next(end0, align) {
            return;
        }
        let buf = b.buf.as_mut_slice();
        buf.copy_within(0..len, keep);
        buf[..keep].copy_from_slice(carry0);
        b.base = base0;
        b.end = end0 + len as u64;
        self.end = b.end;
        // The last partial block of the moved batch is the next batch's leading bytes.
        self.carry.clear();
        self.carry.extend_from_slice(b.partial_block(align));
    }

    /// Seals the pending batch with a padding frame and submits its write, if there is one.
    fn submit_dsync(
        &mut self,
        inflight: &mut VecDeque<InFlight>,
        next_tag: &mut u64,
    ) -> Result<bool, JournalError> {
        if self.pending.as_ref().is_none_or(|b| b.records == 0) {
            return Ok(false);
        }
        let Some(mut b) = self.pending.take() else { return Ok(false) };
        let align = self.align();
        let used = (b.end - b.base) as usize;
        let write_end = if b.end.is_multiple_of(align) { b.end } else { pad_next(b.end, align) };
        let wlen = (write_end - b.base) as usize;
        let buf = b.buf.as_mut_slice();
        if wlen > used {
            encode_pad(&mut buf[used..used + FRAME_HEADER_LEN]);
            buf[used + FRAME_HEADER_LEN..wlen].fill(0);
        }
        let tag = *next_tag;
        *next_tag += 1;
        self.dev.start_write_fua_tagged(&mut b.buf, wlen, b.base, tag)?;
        self.busy_since.get_or_insert_with(Instant::now);
        self.commits.push(b.last_seq, b.first_framed);
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        self.stats.records.fetch_add(b.records, Ordering::Relaxed);
        self.stats.bytes_written.fetch_add(wlen as u64, Ordering::Relaxed);
        self.stats.end.store(b.end, Ordering::Relaxed);
        inflight.push_back(InFlight { tag, batch: b, write_end, done: false });
        Ok(true)
    }

    /// Takes completions; publishes the seq of every leading write that has completed.
    fn reap_dsync(&mut self, inflight: &mut VecDeque<InFlight>) -> Result<bool, JournalError> {
        let n = self.dev.reap(&mut self.done);
        for i in 0..n {
            let c = self.done[i];
            let Some(w) = inflight.iter_mut().find(|w| w.tag == c.tag) else {
                return Err(JournalError::WriterFailed);
            };
            if let Err(e) = c.result {
                return Err(JournalError::Block { op: "write", offset: w.batch.base, source: e });
            }
            w.done = true;
        }
        // Bounded by the writes in flight.
        while let Some(w) = completed_prefix(inflight) {
            self.flushed_end = self.flushed_end.max(w.write_end);
            let seq = w.batch.last_seq;
            self.spare.push(w.batch.buf);
            self.stats.flushes.fetch_add(1, Ordering::Relaxed);
            self.publish(seq);
        }
        if n > 0 {
            self.busy_since = (!inflight.is_empty()).then(Instant::now);
        }
        Ok(n > 0)
    }

    /// Writes in flight, nothing to frame: polls completions and rings (spin, then yield
    /// between polls) until either moves, bounded by the I/O timeout.
    fn poll_dsync(&mut self, inflight: &mut VecDeque<InFlight>) -> Result<(), JournalError> {
        let start = Instant::now();
        let since = self.busy_since.unwrap_or(start);
        let mut turn = 0u32;
        // Bounded by IO_TIMEOUT.
        loop {
            if self.reap_dsync(inflight)? || inflight.is_empty() || self.ring_ready() {
                return Ok(());
            }
            turn = turn.wrapping_add(1);
            if turn.is_multiple_of(64) {
                if since.elapsed() >= IO_TIMEOUT {
                    return Err(JournalError::Io {
                        op: "write",
                        source: std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            "block request timed out",
                        ),
                    });
                }
                if self.stop.load(Ordering::Acquire) && self.fault.is_some() {
                    return Ok(());
                }
            }
            if start.elapsed() < SPIN {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Done for (u64, bool) {
        fn done(&self) -> bool {
            self.1
        }
    }

    /// Writes 1, 2, 3 in flight; 3 and 2 complete first: nothing is released until 1 has,
    /// then all three in order.
    #[test]
    fn only_a_completed_prefix_is_released() {
        let mut q: VecDeque<(u64, bool)> = [(1, false), (2, false), (3, false)].into();
        q[2].1 = true;
        assert_eq!(completed_prefix(&mut q), None);
        q[1].1 = true;
        assert_eq!(completed_prefix(&mut q), None, "write 2 done, write 1 not: nothing");
        q[0].1 = true;
        let order: Vec<u64> =
            std::iter::from_fn(|| completed_prefix(&mut q)).map(|w| w.0).collect();
        assert_eq!(order, [1, 2, 3]);
        assert!(q.is_empty());
    }
}
