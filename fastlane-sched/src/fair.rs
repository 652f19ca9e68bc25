//! Tenant fairness: the admission token bucket and deficit round robin.

/// A token bucket: `capacity` tokens, refilled at `refill_per_s` tokens per second
/// (a tenant's `rpm / 60`). Time is passed in (nanoseconds on any monotonic clock), so the
/// same bucket works on the wall clock and in the simulator.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    capacity: f64,
    tokens: f64,
    refill_per_ns: f64,
    last_ns: u64,
}

impl TokenBucket {
    /// A full bucket.
    pub fn new(capacity: f64, refill_per_s: f64) -> Self {
        let capacity = capacity.max(1.0);
        Self { capacity, tokens: capacity, refill_per_ns: refill_per_s.max(0.0) / 1e9, last_ns: 0 }
    }

    fn refill(&mut self, now_ns: u64) {
        if now_ns > self.last_ns {
            let dt = (now_ns - self.last_ns) as f64;
            self.tokens = (self.tokens + dt * self.refill_per_ns).min(self.capacity);
            self.last_ns = now_ns;
        }
    }

    /// Whether a token is available at `now_ns` (refills first; spends nothing).
    pub fn has_token(&mut self, now_ns: u64) -> bool {
        self.refill(now_ns);
        self.tokens >= 1.0
    }

    /// Spend one token; the caller checked [`has_token`](Self::has_token) at the same time.
    pub fn spend(&mut self) {
        debug_assert!(self.tokens >= 1.0);
        self.tokens -= 1.0;
    }

    /// Give back a token spent on something that did not happen (capped at capacity).
    pub fn refund(&mut self) {
        self.tokens = (self.tokens + 1.0).min(self.capacity);
    }

    /// Capacity B.
    pub fn capacity(&self) -> f64 {
        self.capacity
    }

    /// Tokens now (after refill).
    pub fn tokens(&mut self, now_ns: u64) -> f64 {
        self.refill(now_ns);
        self.tokens
    }

    /// The earliest time at or after `now_ns` when a token is available (`None`: never).
    pub fn next_token_ns(&mut self, now_ns: u64) -> Option<u64> {
        self.refill(now_ns);
        if self.tokens >= 1.0 {
            return Some(now_ns);
        }
        if self.refill_per_ns <= 0.0 {
            return None;
        }
        let wait = ((1.0 - self.tokens) / self.refill_per_ns).ceil() as u64;
        Some(now_ns.saturating_add(wait.max(1)))
    }
}

/// Deficit round robin over a fixed set of flows (tenants), on a cost in tokens.
///
/// Each visit of the cursor adds `quantum` to the flow's deficit; a flow is served while its
/// head's cost fits in its deficit; an empty flow's deficit resets to zero (Shreedhar and
/// Varghese, 1995). Serving is split in [`pick`](Self::pick) and [`charge`](Self::charge) so
/// the caller can decline a pick it cannot place (no KV blocks) without charging for it.
#[derive(Debug)]
pub struct Drr {
    /// Quantum of each flow (`quantum × weight`).
    quanta: Vec<u64>,
    deficit: Vec<u64>,
    cursor: usize,
    topped_up: bool,
}

impl Clone for Drr {
    fn clone(&self) -> Self {
        Self {
            quanta: self.quanta.clone(),
            deficit: self.deficit.clone(),
            cursor: self.cursor,
            topped_up: self.topped_up,
        }
    }

    /// Reuses `self`'s buffers (the scheduler saves its DRR state every step this way).
    fn clone_from(&mut self, src: &Self) {
        self.quanta.clone_from(&src.quanta);
        self.deficit.clone_from(&src.deficit);
        self.cursor = src.cursor;
        self.topped_up = src.topped_up;
    }
}

impl Drr {
    /// `flows` flows, each getting `quantum` tokens per round.
    pub fn new(flows: usize, quantum: u64) -> Self {
        Self::weighted(&vec![1; flows], quantum)
    }

    /// One flow per weight; flow `f` gets `quantum × weights[f]` tokens per round, so
    /// backlogged flows are served in proportion to their weights (a weight of 0 counts as 1).
    pub fn weighted(weights: &[u32], quantum: u64) -> Self {
        let quanta =
            weights.iter().map(|&w| quantum.max(1).saturating_mul(u64::from(w.max(1)))).collect();
        Self { quanta, deficit: vec![0; weights.len()], cursor: 0, topped_up: false }
    }

    /// Current deficit of `flow`.
    pub fn deficit(&self, flow: usize) -> u64 {
        self.deficit[flow]
    }

    fn advance(&mut self) {
        self.cursor = (self.cursor + 1) % self.deficit.len();
        self.topped_up = false;
    }

    /// The next flow to serve, given each flow's head cost (`None`: the flow is empty).
    /// Bounded: rounds needed for the largest head are added in one step, not looped.
    pub fn pick(&mut self, head_cost: impl Fn(usize) -> Option<u64>) -> Option<usize> {
        let n = self.deficit.len();
        if n == 0 {
            return None;
        }
        // At most two passes: the first tops every non-empty flow up once; if none fits
        // after that, fast-forward whole rounds (each flow would get `rounds * quantum`).
        for pass in 0..3 {
            for _ in 0..n {
                let f = self.cursor;
                match head_cost(f) {
                    None => {
                        self.deficit[f] = 0;
                        self.advance();
                    }
                    Some(cost) => {
                        if !self.topped_up {
                            self.deficit[f] = self.deficit[f].saturating_add(self.quanta[f]);
                            self.topped_up = true;
                        }
                        if self.deficit[f] >= cost {
                            return Some(f);
                        }
                        self.advance();
                    }
                }
            }
            if pass == 1 {
                // Nobody fits: add the smallest number of full rounds that lets one fit.
                let rounds = (0..n)
                    .filter_map(|f| {
                        head_cost(f)
                            .map(|c| c.saturating_sub(self.deficit[f]).div_ceil(self.quanta[f]))
                    })
                    .min()?;
                for f in 0..n {
                    if head_cost(f).is_some() {
                        let add = rounds.saturating_mul(self.quanta[f]);
                        self.deficit[f] = self.deficit[f].saturating_add(add);
                    }
                }
            }
        }
        None
    }

    /// The flow [`pick`](Self::pick) would visit first: the first non-empty flow from the
    /// cursor. Changes nothing (for callers that only need to know who is next).
    pub fn peek(&self, head_cost: impl Fn(usize) -> Option<u64>) -> Option<usize> {
        let n = self.deficit.len();
        (0..n).map(|k| (self.cursor + k) % n).find(|&f| head_cost(f).is_some())
    }

    /// Charge `cost` to `flow` after serving its head.
    pub fn charge(&mut self, flow: usize, cost: u64) {
        self.deficit[flow] = self.deficit[flow].saturating_sub(cost);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_refills_at_rate_and_caps_at_capacity() {
        let mut b = TokenBucket::new(2.0, 1.0); // 60 rpm
        assert!(b.has_token(0));
        b.spend();
        b.spend();
        assert!(!b.has_token(0));
        assert_eq!(b.next_token_ns(0), Some(1_000_000_000));
        assert!(!b.has_token(999_000_000));
        assert!(b.has_token(1_000_000_000));
        assert!((b.tokens(100_000_000_000) - 2.0).abs() < 1e-9);
    }

    #[test]
    fn drr_shares_tokens_not_requests() {
        // Flow 0 sends 1000-token requests, flow 1 100-token ones; with both backlogged the
        // token shares must be equal within one request.
        let mut drr = Drr::new(2, 500);
        let cost = [1000u64, 100];
        let mut served = [0u64; 2];
        for _ in 0..2000 {
            let f = drr.pick(|f| Some(cost[f])).unwrap();
            drr.charge(f, cost[f]);
            served[f] += cost[f];
        }
        let diff = served[0].abs_diff(served[1]);
        assert!(diff <= 1000, "{served:?}");
    }

    #[test]
    fn weighted_drr_serves_in_proportion_to_weights() {
        // Weights 3:1, equal request sizes, both backlogged: tokens served 3:1 within one
        // request's cost of the exact share.
        let mut drr = Drr::weighted(&[3, 1], 256);
        let mut served = [0u64; 2];
        for _ in 0..4000 {
            let f = drr.pick(|_| Some(100)).unwrap();
            drr.charge(f, 100);
            served[f] += 100;
        }
        let total = served[0] + served[1];
        let want0 = total * 3 / 4;
        assert!(served[0].abs_diff(want0) <= 3 * 256, "{served:?}");
    }

    #[test]
    fn drr_skips_empty_flows_and_resets_their_deficit() {
        let mut drr = Drr::new(3, 100);
        let f = drr.pick(|f| (f == 2).then_some(350)).unwrap();
        assert_eq!(f, 2);
        assert!(drr.deficit(2) >= 350);
        assert_eq!(drr.deficit(0), 0);
        assert_eq!(drr.pick(|_| None), None);
    }
}
