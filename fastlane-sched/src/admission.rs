//! The router: token bucket and concurrency limit per tenant, the bounded router queue,
//! and admission into the scheduler.

use super::{
    blocks_for_tokens, Overflow, Policy, SchedError, Scheduler, Seq, SeqId, State, SwapPort,
    TenantIndex, Tier,
};

/// A request as it reaches the router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Its sequence id (unique).
    pub seq: SeqId,
    /// Tenant.
    pub tenant: TenantIndex,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Tokens to generate (the stream ends after the last one).
    pub output_tokens: u32,
    /// Arrival at the router, ns.
    pub arrival_ns: u64,
    /// Leading prompt tokens whose KV the caller already has (a prefix-cache hit, loaded into
    /// the sequence's blocks before its first step): the first prefill starts after them.
    /// At most `prompt_tokens - 1` is used, so the last prompt token is always computed and
    /// its logits exist. A restart after a recompute preemption computes from 0.
    pub cached_tokens: u32,
}

/// The router's answer to a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// It holds a slot and waits for the scheduler.
    Admitted,
    /// It waits at the router for a bucket token or a slot.
    Queued,
    /// Refused, for this reason.
    Rejected(RejectReason),
}

/// Why the router refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectReason {
    /// Its tenant's token bucket is empty (HTTP 429 with `Retry-After`).
    RateLimited,
    /// Its tenant's router queue is full (HTTP 503; [`Overflow::Reject`] and the queue bound
    /// of [`Overflow::Queue`] also end here).
    QueueFull,
}

impl<P: SwapPort> Scheduler<P> {
    /// A request reaches the router at `now_ns` (its `arrival_ns`).
    pub fn submit(&mut self, now_ns: u64, req: Request) -> Result<Admission, SchedError> {
        let t = req.tenant;
        if t >= self.tenants.len() {
            return Err(SchedError::UnknownTenant { tenant: t });
        }
        if req.prompt_tokens == 0 || req.output_tokens == 0 {
            return Err(SchedError::BadRequest { seq: req.seq, reason: "empty prompt or output" });
        }
        let total = req.prompt_tokens.saturating_add(req.output_tokens);
        if blocks_for_tokens(total) + self.cfg.watermark_blocks > self.cfg.kv_blocks {
            return Err(SchedError::BadRequest {
                seq: req.seq,
                reason: "larger than the KV cache",
            });
        }
        if self.seqs.contains_key(&req.seq) {
            return Err(SchedError::DuplicateSeq { seq: req.seq });
        }
        self.tenants[t].stats.submitted += 1;
        if self.cfg.policy == Policy::Fifo {
            self.admit(now_ns, req);
            return Ok(Admission::Admitted);
        }
        // Keep per-tenant arrival order: nothing overtakes a request held at the router.
        if self.tenants[t].router.is_empty() && self.try_admit(now_ns, req) {
            return Ok(Admission::Admitted);
        }
        let ts = &mut self.tenants[t];
        let reject = match ts.cfg.overflow {
            Overflow::Gate { .. } if ts.bucket.tokens(now_ns) < 1.0 + ts.router.len() as f64 => {
                Some(RejectReason::RateLimited)
            }
            Overflow::Queue { depth_max } | Overflow::Gate { depth_max }
                if ts.router.len() < depth_max =>
            {
                None
            }
            _ => Some(RejectReason::QueueFull),
        };
        match reject {
            None => {
                ts.router.push_back(req);
                ts.stats.queued += 1;
                Ok(Admission::Queued)
            }
            Some(why) => {
                ts.stats.rejected += 1;
                Ok(Admission::Rejected(why))
            }
        }
    }

    /// Bucket and concurrency check; spends the bucket token only if both pass.
    pub(super) fn try_admit(&mut self, now_ns: u64, req: Request) -> bool {
        let ts = &mut self.tenants[req.tenant];
        if ts.inflight >= ts.cfg.concurrency_max || !ts.bucket.has_token(now_ns) {
            return false;
        }
        ts.bucket.spend();
        self.admit(now_ns, req);
        true
    }

    pub(super) fn admit(&mut self, now_ns: u64, req: Request) {
        let ts = &mut self.tenants[req.tenant];
        ts.inflight += 1;
        ts.stats.admitted += 1;
        let tier = if self.cfg.policy == Policy::Fifo { Tier::Batch } else { ts.cfg.tier };
        self.seqs.insert(
            req.seq,
            Seq {
                req,
                tier,
                admitted_ns: now_ns,
                computed: req.cached_tokens.min(req.prompt_tokens.saturating_sub(1)),
                target: req.prompt_tokens,
                generated: 0,
                state: State::Waiting,
                last_token_ns: None,
                start_order: 0,
                abort_pending: false,
            },
        );
        if self.cfg.policy == Policy::Fifo {
            self.fifo.push_back(req.seq);
        } else {
            ts.ready.push_back(req.seq);
        }
    }

    pub(super) fn retry_router(&mut self, now_ns: u64) {
        for t in 0..self.tenants.len() {
            // Bounded by the queue length.
            while let Some(&req) = self.tenants[t].router.front() {
                if !self.try_admit(now_ns, req) {
                    break;
                }
                self.tenants[t].router.pop_front();
            }
        }
    }
}
