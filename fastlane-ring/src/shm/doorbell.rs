//! A doorbell: one futex word in shared memory that the producers of *several* rings ring and
//! one consumer of all of them sleeps on.
//!
//! A consumer of one ring parks on that ring's own word ([`Consumer::wait_batch`]). A consumer
//! of many rings (the journal service's writer) cannot sleep on many words at once, so its
//! producers publish with [`Producer::commit_ringing`], which wakes the doorbell's word
//! instead of the ring's, and the consumer sleeps with [`wait`]. The handshake is the ring's own
//! (see `wait.rs`): the waiter announces itself in the word, fences, checks every ring, sleeps;
//! a producer publishes, fences, and wakes the word only when someone announced itself. So an
//! idle doorbell costs a producer one fence and one load, as the ring's own wake-up does.
//!
//! The word may be written by any process mapping it. A hostile one can cause a spurious
//! wake-up or a missed one; the waiter's deadline bounds the latter.
//!
//! [`Consumer::wait_batch`]: super::Consumer::wait_batch
//! [`Producer::commit_ringing`]: super::Producer::commit_ringing

use std::time::Instant;

use crate::sync::AtomicU32;
use crate::wait::{ParkFlag, Scope};
use crate::WaitStrategy;

/// Wakes the consumer sleeping on `word` in [`wait`], if one announced itself: one `SeqCst`
/// fence and one load when nobody sleeps, a shared `FUTEX_WAKE` when somebody does.
#[inline]
pub fn ring(word: &AtomicU32) {
    ParkFlag::from_word(word).notify(Scope::Shared);
}

/// Waits with `strategy` until `ready()` returns true or `deadline` passes; returns the last
/// value of `ready()`. `ready` is called many times and must only look (load cursors).
pub fn wait(
    word: &AtomicU32,
    strategy: WaitStrategy,
    deadline: Option<Instant>,
    ready: impl FnMut() -> bool,
) -> bool {
    ParkFlag::from_word(word).wait_until(Scope::Shared, strategy, deadline, ready)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU32;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::super::ShmRing;
    use crate::WaitStrategy;

    /// A consumer parked on the doorbell (not on either ring) is woken by a commit to the
    /// second of two rings, well before its deadline; and with nothing published it sleeps
    /// until the deadline.
    #[test]
    fn a_commit_to_any_ring_wakes_the_doorbell_sleeper() {
        let a = ShmRing::create_memfd("bell-a", 4096).unwrap();
        let b = ShmRing::create_memfd("bell-b", 4096).unwrap();
        let bell = Arc::new(AtomicU32::new(0));
        let mut ca = a.consumer().unwrap();
        let mut cb = b.consumer().unwrap();
        let park = WaitStrategy::SpinYieldPark { spins: 0, yields: 0 };
        // Nothing published: the wait ends at its deadline with `false`.
        let t0 = Instant::now();
        let none = super::wait(&bell, park, Some(t0 + Duration::from_millis(30)), || false);
        assert!(!none);
        assert!(t0.elapsed() >= Duration::from_millis(30));

        let mut pb = b.producer().unwrap();
        let bell2 = Arc::clone(&bell);
        let waker = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            pb.reserve(8).unwrap().fill(7);
            pb.commit_ringing(1, &bell2);
        });
        let t0 = Instant::now();
        let woke = super::wait(&bell, park, Some(t0 + Duration::from_secs(10)), || {
            let a_ready = ca.peek_batch(1).map(|x| !x.is_empty()).unwrap_or(true);
            let b_ready = cb.peek_batch(1).map(|x| !x.is_empty()).unwrap_or(true);
            a_ready || b_ready
        });
        waker.join().unwrap();
        assert!(woke, "the doorbell wait ended without data");
        assert!(t0.elapsed() < Duration::from_secs(5), "woken only by the deadline");
        let mut batch = cb.peek_batch(usize::MAX).unwrap();
        let rec = batch.next_record().unwrap().expect("the record");
        assert_eq!(rec.record_type(), 1);
    }
}
