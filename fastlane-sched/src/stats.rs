//! Per-tenant counters and latency histograms (values in nanoseconds).

use fastlane_hist::Histogram;

/// Highest latency a histogram holds (one hour); larger values are recorded as this.
pub const LATENCY_NS_MAX: u64 = 3_600_000_000_000;

/// A nanosecond histogram with the scheduler's range and 3 significant digits.
pub fn new_histogram() -> Histogram<u64> {
    // Cannot fail: the bounds are constants within hdrhistogram's limits.
    Histogram::new_with_bounds(1, LATENCY_NS_MAX, 3).expect("histogram bounds are valid")
}

/// Record `ns`, clamped into the histogram's range.
pub fn record(h: &mut Histogram<u64>, ns: u64) {
    // Cannot fail: the value is clamped into range.
    let _ = h.record(ns.clamp(1, LATENCY_NS_MAX));
}

/// What happened to one tenant's requests.
#[derive(Debug, Clone)]
pub struct TenantStats {
    /// Arrival at the router → first token.
    pub ttft: Histogram<u64>,
    /// Gap between consecutive tokens of one stream (per-token latency).
    pub token_gap: Histogram<u64>,
    /// Requests that arrived.
    pub submitted: u64,
    /// Requests that got an admission slot.
    pub admitted: u64,
    /// Requests that waited at the router for a bucket token or a slot.
    pub queued: u64,
    /// Requests refused (429).
    pub rejected: u64,
    /// Requests that produced their last token.
    pub completed: u64,
    /// Streams ended by the max-stream-duration fence.
    pub fenced: u64,
    /// Requests the caller aborted ([`Scheduler::abort`](super::Scheduler::abort)): a client
    /// gone, a stop string or an end-of-sequence token before `output_tokens`.
    pub aborted: u64,
    /// Preemptions by swap.
    pub preempted_swap: u64,
    /// Preemptions by recompute.
    pub preempted_recompute: u64,
    /// Bytes swapped out.
    pub swap_out_bytes: u64,
    /// Bytes swapped back in.
    pub swap_in_bytes: u64,
    /// Tokens generated.
    pub output_tokens: u64,
    /// Prompt tokens prefilled (recomputation included).
    pub prefill_tokens: u64,
}

impl Default for TenantStats {
    fn default() -> Self {
        Self {
            ttft: new_histogram(),
            token_gap: new_histogram(),
            submitted: 0,
            admitted: 0,
            queued: 0,
            rejected: 0,
            completed: 0,
            fenced: 0,
            aborted: 0,
            preempted_swap: 0,
            preempted_recompute: 0,
            swap_out_bytes: 0,
            swap_in_bytes: 0,
            output_tokens: 0,
            prefill_tokens: 0,
        }
    }
}

impl TenantStats {
    /// Preemptions of either kind.
    pub fn preemptions(&self) -> u64 {
        self.preempted_swap + self.preempted_recompute
    }
}
