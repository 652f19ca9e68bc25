//! The completion ring of backends that finish every request inside `submit` (the RAM disk,
//! the synchronous file backend; io_uring for the requests it refuses before the kernel):
//! `submit` stores the outcome, `complete` drains it in order. Allocated once per queue; no
//! allocation, no lock per request. [`inline_block_queue!`] writes the `BlockQueue` impl that
//! the inline backends share.

use super::Completion;

/// A fixed-size FIFO of finished requests, one slot per request the queue may hold.
#[derive(Debug)]
pub(crate) struct InlineCompletions {
    /// `depth` entries, allocated once.
    done: Box<[Completion]>,
    /// Index of the oldest undrained completion.
    head: usize,
    /// Undrained completions (== requests in flight, for an inline backend).
    len: usize,
}

impl InlineCompletions {
    /// Room for `depth` undrained completions. `depth` must be at least 1 (the queues check
    /// the depth their callers ask for and report it as an error before calling this).
    pub(crate) fn new(depth: usize) -> InlineCompletions {
        assert!(depth > 0, "inline completion ring of depth 0");
        InlineCompletions {
            done: vec![Completion::EMPTY; depth].into_boxed_slice(),
            head: 0,
            len: 0,
        }
    }

    /// Every slot holds an undrained completion: `submit` must hand the request back.
    pub(crate) fn is_full(&self) -> bool {
        self.len == self.done.len()
    }

    /// Undrained completions.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// No undrained completion.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Store a completion. The caller checked `is_full` first; a push into a full ring is
    /// our bug, not the guest's.
    pub(crate) fn push(&mut self, c: Completion) {
        assert!(!self.is_full(), "push into a full inline completion ring");
        let slot = (self.head + self.len) % self.done.len();
        self.done[slot] = c;
        self.len += 1;
    }

    /// Move up to `out.len()` completions, oldest first, into `out`; how many.
    pub(crate) fn drain(&mut self, out: &mut [Completion]) -> usize {
        let n = self.len.min(out.len());
        for c in out.iter_mut().take(n) {
            *c = self.done[self.head];
            self.head = (self.head + 1) % self.done.len();
        }
        self.len -= n;
        n
    }
}

/// `impl BlockQueue for $queue` for a backend that finishes every request inside `submit`:
/// the type has `done: InlineCompletions` and `unsafe fn execute(&mut self, &BlockRequest) ->
/// Result<u32, BlockError>` with `submit`'s contract.
macro_rules! inline_block_queue {
    ($queue:ty) => {
        impl $crate::BlockQueue for $queue {
            unsafe fn submit<'a>(
                &mut self,
                req: $crate::BlockRequest<'a>,
            ) -> Result<(), $crate::QueueFull<'a>> {
                if self.done.is_full() {
                    return Err($crate::QueueFull(req));
                }
                // SAFETY: our caller upholds the `submit` contract, which is what `execute`
                // needs.
                let result = unsafe { self.execute(&req) };
                self.done.push($crate::Completion { tag: req.tag, result });
                Ok(())
            }

            fn kick(&mut self) -> std::io::Result<()> {
                Ok(())
            }

            fn complete(&mut self, out: &mut [$crate::Completion]) -> usize {
                self.done.drain(out)
            }

            fn wait(&mut self, _timeout: Option<std::time::Duration>) -> std::io::Result<()> {
                // Everything submitted has already finished.
                Ok(())
            }

            fn in_flight(&self) -> u32 {
                self.done.len() as u32
            }
        }
    };
}
pub(crate) use inline_block_queue;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_with_wrap() {
        let mut r = InlineCompletions::new(3);
        for round in 0..4u64 {
            for i in 0..3 {
                assert!(!r.is_full());
                r.push(Completion { tag: round * 10 + i, result: Ok(i as u32) });
            }
            assert!(r.is_full());
            let mut out = [Completion::EMPTY; 2];
            assert_eq!(r.drain(&mut out), 2);
            assert_eq!((out[0].tag, out[1].tag), (round * 10, round * 10 + 1));
            assert_eq!(r.drain(&mut out), 1);
            assert_eq!(out[0].tag, round * 10 + 2);
            assert_eq!(r.drain(&mut out), 0);
            assert_eq!(r.len(), 0);
        }
    }
}
