//! The router's admission gate (`fastlane router`): the same rules as the engine's scheduler
//! applies in `llm serve`, in front of an upstream server that has none.
//!
//! - Per tenant: a token bucket (capacity `burst`, refill `rpm / 60` per second) and at most
//!   `max_concurrent` requests in flight. A request whose bucket has no token for it (the
//!   tokens of the tenant's waiting requests are reserved for them) is refused at once
//!   ([`GateError::RateLimited`], HTTP 429). One that has a token but finds no free slot, its
//!   own tenant's or the upstream's, waits in the tenant's queue without spending the token
//!   (at most `queue` waiting; beyond, [`GateError::QueueFull`], HTTP 503).
//! - The upstream gets at most `upstream_slots` requests at a time. When a slot frees, the
//!   next request to dispatch is chosen by deficit round robin on estimated tokens (prompt +
//!   `max_tokens`), weighted by tenant `weight`, the interactive tier before the batch tier;
//!   that is kvswap's [`Drr`] and [`TokenBucket`], the scheduler's own.
//! - While an interactive-tier request has been dispatched and its first response bytes have
//!   not come back ([`Permit::first_bytes`]), batch-tier waiters are not dispatched: the
//!   upstream's next step holds the interactive prompt without new batch prompts beside it
//!   (on a CPU engine every row lengthens the step). Starvation bound: after
//!   [`BATCH_HOLD_MAX`] of holding, batch dispatch goes on until no interactive request
//!   waits for its first bytes.
//! - Reserved interactive slots (`interactive_slots`, `fastlane router --interactive-slots
//!   N`): the batch tier holds at most `upstream_slots - N` of the upstream's slots, so a
//!   batch tenant whose streams never end (a client that never reads, prompts at the context
//!   window) cannot take the slot an interactive request waits for.
//! - With a batch prefill limit (`batch_prefills`, `fastlane router --batch-prefills N`), at
//!   most N batch-tier requests are dispatched whose first response bytes have not come back
//!   (whose prompts the upstream is still computing): on a CPU upstream without tiers, two
//!   batch prompts that arrive together share one step that is twice as long, and an
//!   interactive request that arrives meanwhile waits for all of it.
//! - A [`Permit`] is the slot: it is held until the response's last byte (the proxy keeps it
//!   in the body) and its drop dispatches the next waiter. A waiter whose client goes away is
//!   removed from the queue (or, dispatched meanwhile, gives its token and slot back).
//!
//! The lock is a plain mutex around a few comparisons, never held across an await.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use fastlane_sched::{Drr, TokenBucket};
use tokio::sync::{oneshot, Notify};

use crate::tenants::Tenants;

/// Longest the gate holds batch-tier dispatch back while interactive requests wait for their
/// first bytes.
pub const BATCH_HOLD_MAX: Duration = Duration::from_millis(500);

/// Why the gate refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateError {
    /// The tenant's bucket is empty (429); retry after this many seconds.
    RateLimited {
        /// One refill, rounded up.
        retry_after_s: u64,
    },
    /// The tenant's queue is full (503).
    QueueFull,
}

struct Waiter {
    id: u64,
    cost: u64,
    tx: oneshot::Sender<()>,
}

struct TenantGate {
    bucket: TokenBucket,
    inflight: u32,
    max_concurrent: u32,
    queue_max: usize,
    interactive: bool,
    rpm: f64,
    queue: VecDeque<Waiter>,
}

struct Inner {
    tenants: Vec<TenantGate>,
    /// DRR per tier: interactive, batch.
    drr: [Drr; 2],
    upstream_inflight: usize,
    upstream_max: usize,
    /// Batch-tier requests in flight at the upstream, and the most they may be.
    batch_inflight: usize,
    batch_max: usize,
    next_id: u64,
    /// Each tenant's dispatchable head cost (scratch of `pump`, kept to not allocate).
    heads: Vec<Option<u64>>,
    /// Interactive-tier requests dispatched whose first response bytes have not come back.
    awaiting_first: usize,
    /// Since when batch dispatch has been held back for them (reset when none waits).
    batch_held_since_ns: Option<u64>,
    /// Batch-tier requests dispatched whose first response bytes have not come back.
    batch_awaiting_first: usize,
    /// At most this many of them (`usize::MAX`: no limit).
    batch_prefills: usize,
}

/// The gate.
pub struct Gate {
    inner: Mutex<Inner>,
    start: Instant,
    wake: Arc<Notify>,
    depth: Option<prometheus::IntGaugeVec>,
    names: Vec<String>,
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let i = self.lock();
        f.debug_struct("Gate")
            .field("upstream_inflight", &i.upstream_inflight)
            .field("upstream_max", &i.upstream_max)
            .finish()
    }
}

/// A slot at the upstream, held by one request; dropping it frees the slot.
#[derive(Debug)]
pub struct Permit {
    gate: Arc<Gate>,
    tenant: usize,
    /// An interactive-tier request still waiting for its first response bytes.
    awaiting_first: bool,
}

impl Permit {
    /// The request's first response bytes came back: batch dispatch need not wait for it.
    pub fn first_bytes(&mut self) {
        if self.awaiting_first {
            self.awaiting_first = false;
            let mut i = self.gate.lock();
            i.first_seen(self.tenant);
            self.gate.pump(&mut i);
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut i = self.gate.lock();
        if self.awaiting_first {
            i.first_seen(self.tenant);
        }
        i.release(self.tenant);
        self.gate.pump(&mut i);
    }
}

impl Inner {
    /// A slot of tenant `t` taken: its own, the upstream's, and the batch tier's.
    fn take(&mut self, t: usize) {
        self.tenants[t].inflight += 1;
        self.upstream_inflight += 1;
        if !self.tenants[t].interactive {
            self.batch_inflight += 1;
        }
    }

    /// A slot of tenant `t` given back.
    fn release(&mut self, t: usize) {
        self.tenants[t].inflight -= 1;
        self.upstream_inflight -= 1;
        if !self.tenants[t].interactive {
            self.batch_inflight -= 1;
        }
    }

    /// Whether a request of tenant `t` may take an upstream slot now (the batch tier leaves
    /// the reserved ones).
    fn upstream_free(&self, t: usize) -> bool {
        self.upstream_inflight < self.upstream_max
            && (self.tenants[t].interactive || self.batch_inflight < self.batch_max)
    }

    /// A request of tenant `t` that awaited its first bytes no longer does.
    fn first_seen(&mut self, t: usize) {
        if !self.tenants[t].interactive {
            self.batch_awaiting_first -= 1;
            return;
        }
        self.awaiting_first -= 1;
        if self.awaiting_first == 0 {
            self.batch_held_since_ns = None;
        }
    }

    /// A request of tenant `t` dispatched now awaits its first bytes.
    fn dispatched(&mut self, t: usize) {
        if self.tenants[t].interactive {
            self.awaiting_first += 1;
        } else {
            self.batch_awaiting_first += 1;
        }
    }

    /// Batch-tier dispatch is held now: an interactive request awaits its first bytes, or the
    /// batch prefill limit is reached.
    fn batch_held(&self) -> bool {
        self.awaiting_first > 0 || self.batch_awaiting_first >= self.batch_prefills
    }

    /// A permit of tenant `t` taken now (counted as awaiting its first bytes).
    fn permit(&mut self, gate: &Arc<Gate>, t: usize) -> Permit {
        self.dispatched(t);
        Permit { gate: gate.clone(), tenant: t, awaiting_first: true }
    }
}

/// When a waiting request is dropped: removes it from its queue, or, if the pump dispatched
/// it in the meantime, gives back the token and slots that dispatch counted.
struct Cancel<'a> {
    gate: &'a Gate,
    tenant: usize,
    id: u64,
    armed: bool,
}

impl Drop for Cancel<'_> {
    fn drop(&mut self) {
        if self.armed {
            let mut i = self.gate.lock();
            let queue = &mut i.tenants[self.tenant].queue;
            let before = queue.len();
            queue.retain(|w| w.id != self.id);
            if queue.len() == before {
                // Not in the queue any more: the pump dispatched it (spent its token, counted
                // its slot) after the request went away, before its permit was taken. Undo.
                i.tenants[self.tenant].bucket.refund();
                i.release(self.tenant);
                i.first_seen(self.tenant);
                self.gate.pump(&mut i);
            }
            self.gate.publish_depth(&i, self.tenant);
        }
    }
}

impl Gate {
    /// A gate for `tenants` in front of an upstream that takes `upstream_slots` requests at
    /// a time, `interactive_slots` of them kept for the interactive tier (the batch tier
    /// holds the rest at most; at least one), with at most `batch_prefills` batch-tier
    /// requests awaiting their first bytes (0: no limit); `depth` (optional) is set to each
    /// tenant's queue length as it changes. Spawns the refill task on the current tokio
    /// runtime.
    pub fn new(
        tenants: &Tenants,
        upstream_slots: usize,
        interactive_slots: usize,
        batch_prefills: usize,
        quantum_tokens: u64,
        depth: Option<prometheus::IntGaugeVec>,
    ) -> Arc<Gate> {
        let weights: Vec<u32> = tenants.entries().iter().map(|t| t.weight).collect();
        let g = Arc::new(Gate {
            inner: Mutex::new(Inner {
                tenants: tenants
                    .entries()
                    .iter()
                    .map(|t| TenantGate {
                        bucket: TokenBucket::new(t.burst, t.rpm / 60.0),
                        inflight: 0,
                        max_concurrent: t.max_concurrent,
                        queue_max: t.queue,
                        interactive: !t.is_batch(),
                        rpm: t.rpm,
                        queue: VecDeque::new(),
                    })
                    .collect(),
                drr: [
                    Drr::weighted(&weights, quantum_tokens),
                    Drr::weighted(&weights, quantum_tokens),
                ],
                upstream_inflight: 0,
                upstream_max: upstream_slots.max(1),
                batch_inflight: 0,
                batch_max: upstream_slots.saturating_sub(interactive_slots).max(1),
                next_id: 0,
                heads: Vec::with_capacity(weights.len()),
                awaiting_first: 0,
                batch_held_since_ns: None,
                batch_awaiting_first: 0,
                batch_prefills: if batch_prefills == 0 { usize::MAX } else { batch_prefills },
            }),
            start: Instant::now(),
            wake: Arc::new(Notify::new()),
            depth,
            names: tenants.entries().iter().map(|t| t.name.clone()).collect(),
        });
        // Waiters held only by an empty bucket need a wake-up when it refills: a task that
        // sleeps until the earliest refill (or until told something was queued).
        let weak = Arc::downgrade(&g);
        let wake = g.wake.clone();
        tokio::spawn(async move {
            // Ends when the gate is dropped (no strong reference is kept while sleeping).
            loop {
                let notified = wake.notified();
                tokio::pin!(notified);
                let next = {
                    let Some(g) = weak.upgrade() else { return };
                    let mut i = g.lock();
                    g.pump(&mut i);
                    g.next_refill(&mut i)
                };
                tokio::select! {
                    _ = &mut notified => {}
                    _ = tokio::time::sleep(next.unwrap_or(Duration::from_secs(1))) => {}
                }
            }
        });
        g
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves counters that are still consistent enough to
        // go on with; never propagate the poison.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    fn publish_depth(&self, i: &Inner, t: usize) {
        if let Some(d) = &self.depth {
            d.with_label_values(&[&self.names[t]]).set(i.tenants[t].queue.len() as i64);
        }
    }

    /// Requests in flight at the upstream now.
    pub fn upstream_inflight(&self) -> usize {
        self.lock().upstream_inflight
    }

    /// Requests waiting in `tenant`'s queue now.
    pub fn queued(&self, tenant: usize) -> usize {
        self.lock().tenants.get(tenant).map_or(0, |t| t.queue.len())
    }

    /// Admits a request of `tenant` with estimated `cost` tokens: at once, after waiting in
    /// the tenant's queue, or refused. Cancel-safe: dropping the future leaves the queue.
    pub async fn acquire(self: &Arc<Self>, tenant: usize, cost: u64) -> Result<Permit, GateError> {
        let (id, rx) = {
            let mut i = self.lock();
            let now = self.now_ns();
            let upstream_free = i.upstream_free(tenant);
            let batch_held = i.batch_held();
            let t = &mut i.tenants[tenant];
            if t.bucket.tokens(now) < 1.0 + t.queue.len() as f64 {
                return Err(GateError::RateLimited {
                    retry_after_s: (60.0 / t.rpm).ceil().max(1.0) as u64,
                });
            }
            // A batch request finds batch dispatch held: it waits in its queue (the pump
            // starts the hold's clock).
            let held = !t.interactive && batch_held;
            if t.queue.is_empty() && t.inflight < t.max_concurrent && upstream_free && !held {
                t.bucket.spend();
                i.take(tenant);
                return Ok(i.permit(self, tenant));
            }
            if t.queue.len() >= t.queue_max {
                return Err(GateError::QueueFull);
            }
            let (tx, rx) = oneshot::channel();
            i.next_id += 1;
            let id = i.next_id;
            i.tenants[tenant].queue.push_back(Waiter { id, cost, tx });
            self.publish_depth(&i, tenant);
            (id, rx)
        };
        // The refill task recomputes its sleep: this waiter may need a bucket refill.
        self.wake.notify_one();
        let mut cancel = Cancel { gate: self, tenant, id, armed: true };
        match rx.await {
            // The pump counted the permit (awaiting its first bytes).
            Ok(()) => {
                cancel.armed = false;
                Ok(Permit { gate: self.clone(), tenant, awaiting_first: true })
            }
            // The sender is only dropped by the gate itself when it goes away.
            Err(_) => {
                cancel.armed = false;
                Err(GateError::QueueFull)
            }
        }
    }

    /// Dispatches waiters while the upstream has free slots.
    fn pump(&self, i: &mut Inner) {
        let now = self.now_ns();
        // Bounded: each turn dispatches one waiter or stops.
        while i.upstream_inflight < i.upstream_max {
            let Inner { tenants, heads, .. } = &mut *i;
            heads.clear();
            heads.extend(tenants.iter_mut().map(|t| {
                let ok = t.inflight < t.max_concurrent && t.bucket.has_token(now);
                t.queue.front().filter(|_| ok).map(|w| w.cost)
            }));
            let mut picked = None;
            for (tier, interactive) in [(0, true), (1, false)] {
                let of_tier =
                    |f: usize| i.heads[f].filter(|_| i.tenants[f].interactive == interactive);
                if !interactive
                    && (i.batch_awaiting_first >= i.batch_prefills
                        || i.batch_inflight >= i.batch_max)
                {
                    // The batch prefill limit, or the batch tier holds all the slots it may:
                    // no hold clock, these end with a first byte or a slot given back.
                    break;
                }
                if !interactive
                    && i.awaiting_first > 0
                    && (0..i.heads.len()).any(|f| of_tier(f).is_some())
                {
                    // Batch work waits while an interactive request waits for its first
                    // bytes, for BATCH_HOLD_MAX at most (then until none waits).
                    let since = *i.batch_held_since_ns.get_or_insert(now);
                    if now.saturating_sub(since) < BATCH_HOLD_MAX.as_nanos() as u64 {
                        break;
                    }
                }
                if let Some(f) = i.drr[tier].pick(of_tier) {
                    picked = Some((tier, f));
                    break;
                }
            }
            let Some((tier, f)) = picked else { break };
            let Some(w) = i.tenants[f].queue.pop_front() else { break };
            i.drr[tier].charge(f, w.cost);
            i.tenants[f].bucket.spend();
            i.take(f);
            i.dispatched(f);
            // A request that went away (the send fails, or succeeds with nobody left to take
            // the permit) gives all of this back in its `Cancel`, which is dropped with it.
            let _ = w.tx.send(());
            self.publish_depth(i, f);
        }
    }

    /// Time until the earliest bucket refill a waiting head needs (`None`: none waits on
    /// its bucket).
    fn next_refill(&self, i: &mut Inner) -> Option<Duration> {
        let now = self.now_ns();
        // The end of a batch hold is a wake-up too.
        let hold_end = i
            .batch_held_since_ns
            .filter(|_| i.awaiting_first > 0)
            .map(|since| since + BATCH_HOLD_MAX.as_nanos() as u64)
            .filter(|&at| at > now);
        i.tenants
            .iter_mut()
            .filter(|t| !t.queue.is_empty() && t.inflight < t.max_concurrent)
            .filter_map(|t| t.bucket.next_token_ns(now).filter(|&at| at > now))
            .chain(hold_end)
            .min()
            .map(|at| Duration::from_nanos(at.saturating_sub(now).max(1_000_000)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TENANTS: &str = r#"
[[tenant]]
name = "quiet"
keys = ["q"]
rpm = 6000
burst = 100
max_concurrent = 4
tier = "interactive"

[[tenant]]
name = "flood"
keys = ["f"]
rpm = 6000
burst = 100
max_concurrent = 4
tier = "batch"
"#;

    /// Whether `acquire` of the flood tenant (index 1) completes within `ms`.
    async fn flood_within(g: &Arc<Gate>, ms: u64) -> Option<Permit> {
        tokio::time::timeout(Duration::from_millis(ms), g.acquire(1, 10))
            .await
            .ok()
            .map(|r| r.expect("admitted"))
    }

    #[tokio::test]
    async fn batch_dispatch_waits_for_an_interactive_requests_first_bytes() {
        let g = Gate::new(&Tenants::parse(TENANTS).unwrap(), 8, 0, 0, 256, None);
        // Nothing interactive in flight: batch goes at once.
        let f0 = flood_within(&g, 100).await.expect("batch admitted at once");
        let mut q = g.acquire(0, 10).await.unwrap();
        // The quiet request waits for its first bytes: a batch request waits in its queue.
        let waiting = tokio::spawn({
            let g = g.clone();
            async move { g.acquire(1, 10).await.map(|_| Instant::now()) }
        });
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert!(!waiting.is_finished(), "batch dispatched while the quiet request waited");
        assert_eq!(g.queued(1), 1);
        let first = Instant::now();
        q.first_bytes();
        let at = tokio::time::timeout(Duration::from_secs(2), waiting).await.unwrap().unwrap();
        assert!(at.unwrap() >= first, "dispatched when the first bytes came back");
        // A second call is a no-op; the permit's drop frees the slot once.
        q.first_bytes();
        drop(q);
        drop(f0);
        assert_eq!(g.upstream_inflight(), 0, "every permit's drop freed its slot once");
    }

    #[tokio::test]
    async fn batch_prefill_limit_dispatches_one_batch_request_per_first_bytes() {
        let g = Gate::new(&Tenants::parse(TENANTS).unwrap(), 8, 0, 1, 256, None);
        let mut f0 = flood_within(&g, 100).await.expect("the first batch request goes at once");
        // f0 has no first bytes yet: the next batch request waits, an interactive one does not.
        let mut waiting = Box::pin(g.acquire(1, 10));
        assert!(tokio::time::timeout(Duration::from_millis(100), &mut waiting).await.is_err());
        assert_eq!(g.queued(1), 1);
        let q = tokio::time::timeout(Duration::from_millis(100), g.acquire(0, 10)).await;
        let mut q = q.expect("interactive is not limited").unwrap();
        q.first_bytes();
        assert!(tokio::time::timeout(Duration::from_millis(50), &mut waiting).await.is_err());
        // f0's first bytes dispatch the next one, which is limited in turn.
        f0.first_bytes();
        let mut f1 = tokio::time::timeout(Duration::from_millis(500), &mut waiting)
            .await
            .expect("dispatched on f0's first bytes")
            .unwrap();
        assert!(flood_within(&g, 100).await.is_none(), "f1 awaits its first bytes");
        // A permit dropped before its first bytes (the client went away) also lifts it.
        let next = tokio::spawn({
            let g = g.clone();
            async move { g.acquire(1, 10).await.map(drop) }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!next.is_finished());
        drop(f1);
        tokio::time::timeout(Duration::from_secs(2), next).await.unwrap().unwrap().unwrap();
        f1 = flood_within(&g, 100).await.expect("the limit is free again");
        f1.first_bytes();
        let f2 =
            flood_within(&g, 100).await.expect("a batch request with first bytes is not counted");
        drop((f0, f1, f2, q));
        assert_eq!(g.upstream_inflight(), 0);
    }

    #[tokio::test]
    async fn a_request_gone_between_dispatch_and_permit_gives_its_slot_back() {
        let g = Gate::new(&Tenants::parse(TENANTS).unwrap(), 1, 0, 0, 256, None);
        let first = g.acquire(0, 10).await.unwrap();
        // The second waits for the one upstream slot.
        let mut second = Box::pin(g.acquire(0, 10));
        assert!(tokio::time::timeout(Duration::from_millis(20), &mut second).await.is_err());
        assert_eq!(g.queued(0), 1);
        // The slot frees: the pump dispatches the waiter; its request goes away before it
        // takes the permit.
        drop(first);
        assert_eq!((g.queued(0), g.upstream_inflight()), (0, 1));
        drop(second);
        assert_eq!(g.upstream_inflight(), 0, "the dispatched slot came back");
        let third = tokio::time::timeout(Duration::from_millis(100), g.acquire(0, 10)).await;
        assert!(third.is_ok(), "the slot is usable again");
    }

    #[tokio::test]
    async fn the_batch_tier_leaves_the_reserved_slots_to_the_interactive_tier() {
        // 4 upstream slots, 2 kept for the interactive tier: batch holds 2 at most.
        let g = Gate::new(&Tenants::parse(TENANTS).unwrap(), 4, 2, 0, 256, None);
        let mut held = Vec::new();
        for _ in 0..2 {
            let mut f = flood_within(&g, 100).await.expect("batch within its share");
            f.first_bytes();
            held.push(f);
        }
        // Streams that never end: a third batch request waits though two slots are free.
        let mut third = Box::pin(g.acquire(1, 10));
        assert!(tokio::time::timeout(Duration::from_millis(100), &mut third).await.is_err());
        assert_eq!((g.queued(1), g.upstream_inflight()), (1, 2));
        // The interactive tier gets the reserved slots at once.
        let q1 = tokio::time::timeout(Duration::from_millis(100), g.acquire(0, 10)).await;
        let q2 = tokio::time::timeout(Duration::from_millis(100), g.acquire(0, 10)).await;
        let (mut q1, mut q2) = (q1.expect("reserved").unwrap(), q2.expect("reserved").unwrap());
        q1.first_bytes();
        q2.first_bytes();
        assert_eq!(g.upstream_inflight(), 4);
        // A batch slot given back goes to the waiting batch request; an interactive slot
        // given back is not the batch tier's.
        drop(q1);
        assert!(tokio::time::timeout(Duration::from_millis(100), &mut third).await.is_err());
        drop(held.pop());
        let f = tokio::time::timeout(Duration::from_millis(500), &mut third).await;
        let f = f.expect("dispatched on a batch slot").unwrap();
        drop((f, held, q2));
        assert_eq!(g.upstream_inflight(), 0, "every slot came back once");
        // Reserving every slot still leaves the batch tier one.
        let g = Gate::new(&Tenants::parse(TENANTS).unwrap(), 2, 2, 0, 256, None);
        assert!(flood_within(&g, 100).await.is_some(), "one batch slot at least");
    }

    #[tokio::test]
    async fn the_batch_hold_is_bounded() {
        let g = Gate::new(&Tenants::parse(TENANTS).unwrap(), 8, 0, 0, 256, None);
        // An interactive request that never sends a byte back holds batch for the bound only.
        let _q = g.acquire(0, 10).await.unwrap();
        let t0 = Instant::now();
        let f = flood_within(&g, 3000).await.expect("batch dispatched after the hold bound");
        let waited = t0.elapsed();
        assert!(waited >= BATCH_HOLD_MAX - Duration::from_millis(5), "{waited:?}");
        assert!(waited < BATCH_HOLD_MAX * 3, "{waited:?}");
        // Past the bound batch dispatch goes on while the interactive request still waits.
        let f2 = flood_within(&g, 100).await.expect("no second hold");
        drop((f, f2));
        // A request of the quiet tenant that goes away before its first bytes ends the hold.
        drop(_q);
        let q2 = g.acquire(0, 10).await.unwrap();
        drop(q2);
        assert!(flood_within(&g, 100).await.is_some(), "no interactive request waits");
    }
}
