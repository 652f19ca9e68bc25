//! What the writer drains: one producer ring (a [`Journal`](super::Journal) of its own), or the
//! rings of every producer attached to the journal service.
//!
//! A journal's single ring carries *global* seqs: its producer numbers the records and the
//! writer checks them. A service producer numbers its records *locally* (1, 2, 3, … in its own
//! control block); the writer gives each record the next global seq as it frames it, writes
//! the producer's id into the frame's `flags`, and, when a flush makes a global seq durable,
//! publishes in each producer's control block how far *its* records are durable. For that
//! every source keeps a few checkpoints `(batch, global seq, local seq)`, one per batch that
//! holds its records: at most a pending, a writing and two flushing batches are unacknowledged
//! at once, so a fixed array of [`CHECKPOINTS`] suffices (and a full one only delays an
//! acknowledgement to a later flush, never advances one early).
//!
//! A source that sends something impossible (a bad record, a corrupt ring, a wrong local seq)
//! is shut off alone: its records before the fault are written and acknowledged, its control
//! block says `ProducerFault`, the other sources go on. A source whose producer went away
//! (the service saw its socket close) is drained and then dropped.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use fastlane_ring::shm::Consumer;

use super::control::{Control, STATE_CLOSED, STATE_PRODUCER_FAULT};
use super::JournalError;

/// Unacknowledged batches one source can be in at once (see the module docs).
pub(crate) const CHECKPOINTS: usize = 8;

/// Counters of one attached producer, shared with the service's metrics.
#[derive(Debug, Default)]
pub struct ProducerCounters {
    /// Records framed.
    pub records: AtomicU64,
    /// Payload bytes framed.
    pub bytes: AtomicU64,
    /// Local seq acknowledged durable.
    pub durable_local: AtomicU64,
    /// Set when the writer shut the producer's ring off.
    pub faulted: AtomicBool,
    /// Set when the writer dropped the ring (drained after detach, or faulted).
    pub gone: AtomicBool,
}

/// One ring the writer drains.
pub(crate) struct Source {
    pub(crate) consumer: Consumer,
    /// The producer's own control block (service producers); `None` for a journal's single
    /// ring, whose seqs are the global ones and whose durable seq is the journal's.
    pub(crate) control: Option<Control>,
    /// Written into each frame's `flags`.
    pub(crate) id: u32,
    /// The last seq taken from this ring (local for service producers).
    pub(crate) last_local: u64,
    /// `(batch, global seq, local seq)`, oldest first, `len` of them from `first`.
    checkpoints: [(u64, u64, u64); CHECKPOINTS],
    first: usize,
    len: usize,
    /// Why the ring was shut off, if it was.
    pub(crate) fault: Option<JournalError>,
    /// Set (by the service) when the producer detached: drain, then drop.
    pub(crate) detached: Option<Arc<AtomicBool>>,
    pub(crate) counters: Option<Arc<ProducerCounters>>,
}

impl Source {
    /// The single ring of a [`Journal`](super::Journal): global seqs, continuing after
    /// `last_seq`.
    pub(crate) fn single(consumer: Consumer, last_seq: u64) -> Source {
        Source {
            consumer,
            control: None,
            id: 0,
            last_local: last_seq,
            checkpoints: [(0, 0, 0); CHECKPOINTS],
            first: 0,
            len: 0,
            fault: None,
            detached: None,
            counters: None,
        }
    }

    /// A service producer's ring: local seqs from 1, acknowledged through `control`.
    pub(crate) fn attached(
        consumer: Consumer,
        control: Control,
        id: u32,
        detached: Arc<AtomicBool>,
        counters: Arc<ProducerCounters>,
    ) -> Source {
        Source {
            consumer,
            control: Some(control),
            id,
            last_local: 0,
            checkpoints: [(0, 0, 0); CHECKPOINTS],
            first: 0,
            len: 0,
            fault: None,
            detached: Some(detached),
            counters: Some(counters),
        }
    }

    /// Whether the writer assigns the global seqs of this ring's records.
    pub(crate) fn assigns(&self) -> bool {
        self.control.is_some()
    }

    /// Notes that `batch` now holds this source's records up to `local`, framed as `global`.
    pub(crate) fn checkpoint(&mut self, batch: u64, global: u64, local: u64) {
        if self.len > 0 {
            let newest = (self.first + self.len - 1) % CHECKPOINTS;
            if self.checkpoints[newest].0 == batch || self.len == CHECKPOINTS {
                // Same batch, or (never expected) full: move the newest forward. Its records
                // are then acknowledged with the later ones, never before they are durable.
                self.checkpoints[newest] = (batch, global, local);
                return;
            }
        }
        let at = (self.first + self.len) % CHECKPOINTS;
        self.checkpoints[at] = (batch, global, local);
        self.len += 1;
    }

    /// Every global seq up to `durable` is durable: acknowledges this producer's records that
    /// it covers. Returns whether anything was published.
    pub(crate) fn publish(&mut self, durable: u64) -> bool {
        let mut local = None;
        while self.len > 0 && self.checkpoints[self.first].1 <= durable {
            local = Some(self.checkpoints[self.first].2);
            self.first = (self.first + 1) % CHECKPOINTS;
            self.len -= 1;
        }
        let Some(local) = local else { return false };
        if let Some(c) = &self.control {
            c.publish_durable(local);
        }
        if let Some(k) = &self.counters {
            k.durable_local.store(local, Ordering::Relaxed);
        }
        true
    }

    /// Nothing of this source's is waiting for a flush.
    pub(crate) fn acknowledged(&self) -> bool {
        self.len == 0
    }

    /// Shuts the ring off: the producer's control block says so.
    pub(crate) fn shut_off(&mut self, why: JournalError) {
        if let Some(c) = &self.control {
            c.set_state(STATE_PRODUCER_FAULT);
        }
        if let Some(k) = &self.counters {
            k.faulted.store(true, Ordering::Relaxed);
        }
        self.fault = Some(why);
    }

    /// The producer went away (or the ring was shut off) and everything it sent is
    /// acknowledged: the writer may drop the ring.
    pub(crate) fn finished(&self) -> bool {
        let gone = self.fault.is_some()
            || self.detached.as_ref().is_some_and(|d| d.load(Ordering::Acquire));
        gone && self.control.is_some() && self.acknowledged()
    }

    /// Counts framed records.
    pub(crate) fn count(&self, records: u64, bytes: u64) {
        if let Some(k) = &self.counters {
            k.records.fetch_add(records, Ordering::Relaxed);
            k.bytes.fetch_add(bytes, Ordering::Relaxed);
        }
    }
}

impl Drop for Source {
    fn drop(&mut self) {
        if let Some(c) = &self.control {
            if self.fault.is_none() {
                c.set_state(STATE_CLOSED);
            }
        }
        if let Some(k) = &self.counters {
            k.gone.store(true, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fastlane_ring::shm::ShmRing;

    fn source() -> Source {
        let ring = ShmRing::create_memfd("src-test", 4096).unwrap();
        let c = ring.consumer().unwrap();
        let control = Control::create_memfd([0; 16], 64, crate::Durability::Local, 1, 0).unwrap();
        Source::attached(
            c,
            control,
            7,
            Arc::new(AtomicBool::new(false)),
            Arc::new(ProducerCounters::default()),
        )
    }

    /// A flush acknowledges a producer's records exactly up to the last one it covers, and a
    /// batch framed in several steps keeps one checkpoint.
    #[test]
    fn publish_acknowledges_only_what_the_flush_covers() {
        let mut s = source();
        // Batch 1 holds local 1..=3 as global 10..=12 (framed in two steps), batch 2 local
        // 4..=5 as global 20..=21.
        s.checkpoint(1, 11, 2);
        s.checkpoint(1, 12, 3);
        s.checkpoint(2, 21, 5);
        assert!(!s.publish(11), "global 12 is not durable yet: nothing of batch 1 published");
        assert_eq!(s.control.as_ref().unwrap().durable_seq(), 0);
        assert!(s.publish(15));
        assert_eq!(s.control.as_ref().unwrap().durable_seq(), 3);
        assert!(!s.acknowledged());
        assert!(s.publish(21));
        assert_eq!(s.control.as_ref().unwrap().durable_seq(), 5);
        assert!(s.acknowledged());
    }

    /// More outstanding batches than checkpoints: the newest moves forward, so an
    /// acknowledgement comes late, never early.
    #[test]
    fn a_full_checkpoint_array_delays_never_advances() {
        let mut s = source();
        for b in 0..(CHECKPOINTS as u64 + 3) {
            s.checkpoint(b, 100 + b, 1 + b);
        }
        // The last slot now says global 110 → local 11; globals 107..=109 were folded into it.
        assert!(s.publish(108));
        let acked = s.control.as_ref().unwrap().durable_seq();
        assert!(acked <= 9, "acknowledged local {acked} though global 109 is not durable");
        assert!(s.publish(110));
        assert_eq!(s.control.as_ref().unwrap().durable_seq(), 11);
    }
}
