//! Step planning, tier by tier: the interactive tier's decodes, then its prefill chunks
//! shared across its tenants by DRR within the token budget (with latency protection's cap),
//! then the batch tier's decodes and prefills in what is left. FIFO: decodes, then prefills.

use std::collections::VecDeque;

use super::{
    tier_index, Policy, SchedError, Scheduler, SeqId, State, SwapPort, TenantIndex, Tier, TierSteps,
};

/// What a sequence does in a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    /// Prefill `tokens` more prompt (or recompute) tokens.
    Prefill {
        /// Chunk size.
        tokens: u32,
    },
    /// Generate one token.
    Decode,
}

/// One sequence's share of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepItem {
    /// The sequence.
    pub seq: SeqId,
    /// Its tenant.
    pub tenant: TenantIndex,
    /// Prefill chunk or decode.
    pub kind: StepKind,
    /// Tokens already in its KV cache before this step (attention reads them).
    pub context_tokens: u32,
}

/// The batch of one step.
#[derive(Debug, Clone, Default)]
pub struct StepPlan {
    /// Items: the interactive tier's decodes, its prefills, then the batch tier's (FIFO: decodes, then prefills).
    pub items: Vec<StepItem>,
    /// Sum of prefill chunk tokens.
    pub prefill_tokens: u32,
    /// Decode tokens (one per decoding sequence).
    pub decode_tokens: u32,
}

impl StepPlan {
    /// Whether the step has nothing to run.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

impl<P: SwapPort> Scheduler<P> {
    /// Form the batch for a step starting at `now_ns`. Starts swaps and preemptions as
    /// needed. An empty plan means there is nothing to run now (see
    /// [`next_wakeup_ns`](Self::next_wakeup_ns)).
    pub fn schedule(&mut self, now_ns: u64) -> Result<&StepPlan, SchedError> {
        if self.planned {
            return Err(SchedError::Protocol {
                reason: "schedule() twice without complete_step()",
            });
        }
        self.plan = StepPlan::default();
        // What forming the plan charges, saved for `abandon_step` (no allocation after the
        // first step: the saved vectors are reused).
        for (saved, drr) in self.undo.drr.iter_mut().zip(&self.drr) {
            saved.clone_from(drr);
        }
        self.undo.protect_stats = self.protect_stats;
        self.undo.held_since_ns = self.held_since_ns;
        self.undo.tier_held_since_ns = self.tier_held_since_ns;
        self.undo.tier_stats = self.tier_stats;
        self.poll_swaps(now_ns);
        self.fence(now_ns);
        self.retry_router(now_ns);
        if self.cfg.policy == Policy::DrrPreempt {
            self.preempt_for_interactive(now_ns);
        }
        let mut budget = self.cfg.batch_tokens_max;
        let mut seqs_left = self.cfg.batch_seqs_max;
        if self.cfg.policy == Policy::Fifo {
            // Decodes first (a stall hurts them most), then prefills in arrival order.
            self.plan_decodes(now_ns, None, &mut budget, &mut seqs_left);
            self.plan_protection(now_ns, budget);
            self.plan_prefills(Tier::Batch, &mut budget, &mut seqs_left);
            self.plan_new(now_ns, &mut budget, &mut seqs_left);
            return self.finish_plan();
        }
        // The interactive tier's decodes, then its prefills — running ones, then new ones —
        // and only then the batch tier's decodes and prefills: batch work never takes the
        // token budget or the sequence slots an interactive request is waiting for (with as
        // many batch decodes as the step has tokens, an interactive prompt would otherwise
        // wait for batch streams to end).
        self.plan_decodes(now_ns, Some(Tier::Interactive), &mut budget, &mut seqs_left);
        self.plan_protection(now_ns, budget);
        // Each tier's prefill work — chunks of running prefills and new starts alike — gets
        // the step's remaining budget shared across its tenants by deficit round robin.
        let blocked = self.plan_tier(now_ns, Tier::Interactive, false, &mut budget, &mut seqs_left);
        let (batch_budget, mixed) = self.batch_budget(budget);
        budget = budget.min(batch_budget);
        self.plan_decodes(now_ns, Some(Tier::Batch), &mut budget, &mut seqs_left);
        // `drr+preempt` also preempts batch work in compute: while an interactive request
        // waits for or is in its prefill, batch prefill chunks sit the step out (their
        // decodes keep running), so the step it lands in is short.
        let hold_batch = self.cfg.policy == Policy::DrrPreempt
            && self.seqs.values().any(|s| {
                s.tier == Tier::Interactive
                    && s.generated == 0
                    && matches!(s.state, State::Waiting | State::Running)
            });
        let separate = self.separate_tiers(now_ns);
        if mixed && !separate {
            self.tier_stats.mixed_capped_steps += 1;
        }
        if !hold_batch && !separate {
            // An interactive start waiting for blocks keeps batch starts out (it keeps what
            // preemption freed); running batch prefills still get their chunks.
            self.plan_tier(now_ns, Tier::Batch, blocked, &mut budget, &mut seqs_left);
        }
        self.protected_step_alone();
        self.finish_plan()
    }

    /// The batch tier's token budget in this step, out of the `budget` the interactive tier
    /// left, and whether the mixed-step bound set it. Under [`TierSteps::Separate`] (the CPU
    /// mode) batch tokens are priced by attention
    /// ([`SchedConfig::attention_context`](super::SchedConfig::attention_context)) at the
    /// longest batch context in flight, so a step at a long context is no longer than one at
    /// a short one; and when the step already carries interactive work, what they may cost is
    /// [`SchedConfig::mixed_batch_tokens`](super::SchedConfig::mixed_batch_tokens). At least
    /// one token while any budget is left.
    fn batch_budget(&self, budget: u32) -> (u32, bool) {
        let TierSteps::Separate { .. } = self.cfg.tier_steps else { return (budget, false) };
        let mixed = self.cfg.mixed_batch_tokens.filter(|_| !self.plan.is_empty());
        if budget == 0 || (mixed.is_none() && self.cfg.attention_context == 0) {
            return (budget, false);
        }
        // Every batch token of this step attends to at most the longest batch context.
        let mut context = None;
        for s in self.seqs.values().filter(|s| s.tier == Tier::Batch) {
            match s.state {
                State::Running => context = Some(context.unwrap_or(0).max(s.computed)),
                State::Waiting | State::SwappedOut => context = Some(context.unwrap_or(0)),
                _ => {}
            }
        }
        let Some(context) = context else { return (budget, false) };
        let per_token = match self.cfg.attention_context {
            0 => 1.0,
            a => 1.0 + f64::from(context) / f64::from(a),
        };
        let cost = mixed.map_or(budget, |m| m.min(budget));
        (((f64::from(cost) / per_token) as u32).clamp(1, budget), mixed.is_some())
    }

    /// [`TierSteps::Separate`]: when this step carries an interactive-tier prefill, takes the
    /// batch tier's decodes back out of it and says that its prefill stays out too — unless
    /// batch work has been kept out for the hold bound, when this step is shared.
    fn separate_tiers(&mut self, now_ns: u64) -> bool {
        let TierSteps::Separate { hold_ns_max } = self.cfg.tier_steps else { return false };
        let interactive_prefill = self.plan.items.iter().any(|it| {
            matches!(it.kind, StepKind::Prefill { .. })
                && self.seqs.get(&it.seq).is_some_and(|s| s.tier == Tier::Interactive)
        });
        let batch_decodes = self.plan.items.iter().any(|it| {
            it.kind == StepKind::Decode
                && self.seqs.get(&it.seq).is_some_and(|s| s.tier == Tier::Batch)
        });
        let batch_prefill = self.seqs.values().any(|s| {
            s.tier == Tier::Batch
                && (matches!(s.state, State::Waiting | State::SwappedOut)
                    || (matches!(s.state, State::Running) && s.computed < s.target))
        });
        if !interactive_prefill || !(batch_decodes || batch_prefill) {
            self.tier_held_since_ns = None;
            return false;
        }
        let since = *self.tier_held_since_ns.get_or_insert(now_ns);
        if now_ns.saturating_sub(since) >= hold_ns_max {
            self.tier_held_since_ns = None;
            self.tier_stats.released_steps += 1;
            return false;
        }
        self.tier_stats.separate_steps += 1;
        if batch_decodes {
            let seqs = &self.seqs;
            self.plan.items.retain(|it| {
                it.kind != StepKind::Decode
                    || seqs.get(&it.seq).is_none_or(|s| s.tier != Tier::Batch)
            });
            self.plan.decode_tokens =
                self.plan.items.iter().filter(|it| it.kind == StepKind::Decode).count() as u32;
        }
        true
    }

    pub(super) fn finish_plan(&mut self) -> Result<&StepPlan, SchedError> {
        debug_assert_eq!(self.blocks.accounted(), self.blocks.total());
        if !self.plan.is_empty() {
            self.planned = true;
            self.steps += 1;
        }
        Ok(&self.plan)
    }

    /// Running sequences in service order: interactive first, then oldest start first.
    pub(super) fn running_in_order(&self) -> Vec<SeqId> {
        let mut order: Vec<(usize, u64, SeqId)> = self
            .running
            .iter()
            .filter_map(|id| self.seqs.get(id))
            .map(|s| (tier_index(s.tier), s.start_order, s.req.seq))
            .collect();
        order.sort_unstable();
        order.into_iter().map(|(_, _, id)| id).collect()
    }

    pub(super) fn push_item(&mut self, seq: SeqId, kind: StepKind) {
        let Some(s) = self.seqs.get(&seq) else { return };
        self.plan.items.push(StepItem {
            seq,
            tenant: s.req.tenant,
            kind,
            context_tokens: s.computed,
        });
        match kind {
            StepKind::Decode => self.plan.decode_tokens += 1,
            StepKind::Prefill { tokens } => self.plan.prefill_tokens += tokens,
        }
    }

    pub(super) fn chunk_for(&self, remaining: u32, budget: u32) -> u32 {
        match self.cfg.chunk_tokens {
            Some(chunk) => remaining.min(chunk).min(budget),
            // Whole prefill: one prompt per step may exceed the budget.
            None if self.plan.prefill_tokens == 0 => remaining,
            None => {
                if remaining <= budget {
                    remaining
                } else {
                    0
                }
            }
        }
    }

    /// [`chunk_for`](Self::chunk_for), except that a `capped` tenant's chunk never exceeds
    /// `budget` (a whole prompt does not get the "first prefill may exceed" exception).
    pub(super) fn chunk_capped(&self, remaining: u32, budget: u32, capped: bool) -> u32 {
        if !capped {
            return self.chunk_for(remaining, budget);
        }
        match self.cfg.chunk_tokens {
            Some(chunk) => remaining.min(chunk).min(budget),
            None if remaining <= budget => remaining,
            None => 0,
        }
    }

    /// Latency protection: decide which tenants are protected this step and whether the
    /// cap on the others' prefill tokens applies (see [`ProtectConfig`]). `budget` is what
    /// the decodes left.
    pub(super) fn plan_protection(&mut self, now_ns: u64, budget: u32) {
        self.protected.clear();
        self.others_left = None;
        let Some(p) = self.cfg.protect else { return };
        if self.cfg.policy == Policy::Fifo {
            return;
        }
        for ts in &mut self.tenants {
            let fill = ts.bucket.tokens(now_ns) / ts.bucket.capacity();
            self.protected.push(ts.cfg.tier == Tier::Interactive && fill >= p.bucket_frac_min);
        }
        // Prefill work for this step: a running prefill, or a request at the head of a
        // ready queue. A protected tenant's request counts only if it can start now (blocks
        // free, not a swap-in): the cap must not hold the others back for nothing.
        let mut protected_work = false;
        let mut others_work = false;
        for s in self.seqs.values() {
            let t = s.req.tenant;
            if matches!(s.state, State::Running) && s.computed < s.target {
                if self.protected[t] {
                    protected_work = true;
                } else {
                    others_work = true;
                }
            } else if !p.others_decodes && !self.protected[t] && s.decode_ready() {
                // Their decodes are held back too: the hold bound counts their wait.
                others_work = true;
            }
        }
        for (t, ts) in self.tenants.iter().enumerate() {
            let Some(&id) = ts.ready.front() else { continue };
            if !self.protected[t] {
                others_work = true;
            } else if !protected_work {
                let swap_in =
                    self.seqs.get(&id).is_some_and(|s| matches!(s.state, State::SwappedOut));
                protected_work = !swap_in && self.start_chunk(id, budget, false).is_some();
            }
        }
        if !protected_work || !others_work {
            self.held_since_ns = None;
            return;
        }
        let since = *self.held_since_ns.get_or_insert(now_ns);
        if now_ns.saturating_sub(since) >= p.hold_ns_max {
            // Starvation bound: this step is work-conserving, then the cap starts again.
            self.held_since_ns = None;
            self.protect_stats.released_steps += 1;
            return;
        }
        self.protect_stats.capped_steps += 1;
        self.others_left = Some(p.others_prefill_tokens_max);
    }

    /// Latency protection with `others_decodes: false`: a step that carries a protected
    /// tenant's prefill under the cap carries none of the unprotected tenants' decodes (planned
    /// before the cap was known; taken back out here, their blocks kept for the next step).
    fn protected_step_alone(&mut self) {
        let Some(p) = self.cfg.protect else { return };
        if p.others_decodes || self.others_left.is_none() {
            return;
        }
        let protected = &self.protected;
        let is_protected = |t: TenantIndex| protected.get(t).copied().unwrap_or(false);
        let carries = self
            .plan
            .items
            .iter()
            .any(|it| matches!(it.kind, StepKind::Prefill { .. }) && is_protected(it.tenant));
        if !carries {
            return;
        }
        self.plan.items.retain(|it| it.kind != StepKind::Decode || is_protected(it.tenant));
        self.plan.decode_tokens =
            self.plan.items.iter().filter(|it| it.kind == StepKind::Decode).count() as u32;
    }

    /// This step's protected tenants, by index (empty when latency protection is off or no
    /// step was planned): the engine gives up a step without a protected prefill when one of
    /// their requests arrives.
    pub fn protected_tenants(&self) -> &[bool] {
        &self.protected
    }

    /// Whether tenant `t`'s prefill is under the protection cap this step.
    pub(super) fn capped(&self, t: TenantIndex) -> bool {
        self.others_left.is_some() && !self.protected.get(t).copied().unwrap_or(false)
    }

    /// Count `tokens` of tenant `t`'s prefill against the protection cap, if it is capped.
    pub(super) fn charge_cap(&mut self, t: TenantIndex, tokens: u32) {
        if self.capped(t) {
            if let Some(left) = &mut self.others_left {
                *left = left.saturating_sub(tokens);
            }
        }
    }

    pub(super) fn plan_decodes(
        &mut self,
        now_ns: u64,
        tier: Option<Tier>,
        budget: &mut u32,
        seqs_left: &mut u32,
    ) {
        let order = self.running_in_order();
        let mut i = 0;
        while i < order.len() {
            let id = order[i];
            i += 1;
            if *seqs_left == 0 || *budget == 0 {
                break;
            }
            let Some(s) = self.seqs.get(&id) else { continue };
            if !s.decode_ready() || !self.running.contains(&id) || tier.is_some_and(|t| s.tier != t)
            {
                continue;
            }
            let need_tokens = s.computed + 1;
            let my_tier = s.tier;
            // Bounded: each pass preempts one sequence.
            let mut granted = false;
            for _ in 0..=order.len() {
                if self.blocks.grow(id, need_tokens).is_ok() {
                    granted = true;
                    break;
                }
                // Out of blocks: preempt the newest lowest-tier sequence not yet planned.
                let victim = order[i..]
                    .iter()
                    .rev()
                    .copied()
                    .find(|v| self.running.contains(v))
                    .filter(|v| tier_index(self.seqs[v].tier) >= tier_index(my_tier))
                    .unwrap_or(id);
                self.preempt(now_ns, victim);
                if victim == id || self.blocks.free() == 0 {
                    break;
                }
            }
            if granted && self.running.contains(&id) {
                self.push_item(id, StepKind::Decode);
                *budget -= 1;
                *seqs_left -= 1;
            }
        }
    }

    /// Prefills already under way, of one tier.
    pub(super) fn plan_prefills(&mut self, tier: Tier, budget: &mut u32, seqs_left: &mut u32) {
        for id in self.running_in_order() {
            if *seqs_left == 0 || *budget == 0 {
                break;
            }
            let Some(s) = self.seqs.get(&id) else { continue };
            if s.tier != tier || !matches!(s.state, State::Running) || s.computed >= s.target {
                continue;
            }
            if !self.running.contains(&id) {
                continue;
            }
            let chunk = self.chunk_for(s.target - s.computed, *budget);
            let end = s.computed + chunk;
            // The chunk's positions must have blocks (a no-op when they do already).
            if chunk == 0 || self.blocks.grow(id, end).is_err() {
                continue;
            }
            self.push_item(id, StepKind::Prefill { tokens: chunk });
            *budget = budget.saturating_sub(chunk);
            *seqs_left -= 1;
        }
    }

    /// Policy `fifo`: start new sequences in arrival order while blocks and budget last.
    pub(super) fn plan_new(&mut self, now_ns: u64, budget: &mut u32, seqs_left: &mut u32) {
        // Bounded by the number of live sequences: each pass starts one or stops.
        for _ in 0..=self.seqs.len() {
            if *seqs_left == 0 || *budget == 0 {
                return;
            }
            let Some(id) = self.fifo.front().copied() else { return };
            let Some(chunk) = self.start_chunk(id, *budget, false) else { return };
            self.fifo.pop_front();
            self.start(now_ns, id, chunk, budget, seqs_left);
        }
    }

    /// The chunk `id` would start with (0: a swap-in), or `None` if it cannot start now
    /// (no blocks, or a whole prompt that does not fit the budget left).
    pub(super) fn start_chunk(&self, id: SeqId, budget: u32, capped: bool) -> Option<u32> {
        let s = self.seqs.get(&id)?;
        if self.blocks.free() < self.start_need(id) + self.cfg.watermark_blocks {
            return None;
        }
        if matches!(s.state, State::SwappedOut) {
            return Some(0);
        }
        let chunk = self.chunk_capped(s.target.saturating_sub(s.computed), budget, capped);
        (chunk > 0).then_some(chunk)
    }

    /// Start (or resume) `id`, already taken off its queue; `chunk` from
    /// [`start_chunk`](Self::start_chunk).
    pub(super) fn start(
        &mut self,
        now_ns: u64,
        id: SeqId,
        chunk: u32,
        budget: &mut u32,
        seqs_left: &mut u32,
    ) {
        self.order += 1;
        let order = self.order;
        let Some(s) = self.seqs.get_mut(&id) else { return };
        s.start_order = order;
        if matches!(s.state, State::SwappedOut) {
            let tokens = s.computed;
            let t = s.req.tenant;
            // Cannot fail: free >= need checked by start_chunk.
            let _ = self.blocks.grow(id, tokens);
            let table = self.blocks.table(id).unwrap_or(&[]).to_vec();
            // Reserve the rest: the prefill left when it was preempted mid-prefill, or the
            // next token's block (appended after the table the copy lands in).
            let _ = self.blocks.grow(id, s.target.max(tokens + 1));
            match self.port.swap_in(now_ns, id, &table) {
                Ok(()) => {
                    s.state = State::SwappingIn;
                    let bytes = table.len() as u64 * self.cfg.preempt.block_bytes();
                    self.tenants[t].stats.swap_in_bytes += bytes;
                }
                Err(_) => {
                    // The host copy is unusable: recompute instead.
                    self.blocks.release(id);
                    self.port.drop_seq(id);
                    s.target = s.target.max(s.computed);
                    s.computed = 0;
                    s.state = State::Waiting;
                    self.requeue_front(t, id);
                }
            }
            return;
        }
        let target = s.target;
        // Cannot fail: free >= need checked by start_chunk.
        let _ = self.blocks.grow(id, target);
        s.state = State::Running;
        self.running.push(id);
        self.push_item(id, StepKind::Prefill { tokens: chunk });
        *budget = budget.saturating_sub(chunk);
        *seqs_left -= 1;
    }

    /// Policies `drr` and `drr+preempt`: the prefill work of one tier. Each tenant's work is
    /// its running prefills (oldest first), then the requests of its ready queue; deficit
    /// round robin across tenants, on chunk tokens, decides whose next chunk goes into the
    /// step until the budget or the sequence limit runs out. So a tenant with a request
    /// waiting gets its share of this very step, however many prefills another tenant has
    /// under way. A start that cannot get blocks stops all starts of the tier for this step
    /// (nothing smaller behind it takes the blocks it waits for); `starts_blocked` passes
    /// that in from the interactive tier, and the return value passes it on.
    pub(super) fn plan_tier(
        &mut self,
        now_ns: u64,
        tier: Tier,
        mut starts_blocked: bool,
        budget: &mut u32,
        seqs_left: &mut u32,
    ) -> bool {
        let n = self.tenants.len();
        let mut running: Vec<VecDeque<SeqId>> = vec![VecDeque::new(); n];
        for id in self.running_in_order() {
            let Some(s) = self.seqs.get(&id) else { continue };
            if s.tier == tier && matches!(s.state, State::Running) && s.computed < s.target {
                running[s.req.tenant].push_back(id);
            }
        }
        // Each pass plans one item, drops one running prefill that cannot go this step, or
        // blocks the starts; so the bound is never reached before the work runs out.
        let mut heads: Vec<Option<(SeqId, u32, bool)>> = vec![None; n];
        for _ in 0..(2 * self.seqs.len() + n + 2) {
            if *seqs_left == 0 || *budget == 0 {
                break;
            }
            for (t, head) in heads.iter_mut().enumerate() {
                *head = None;
                if self.tenants[t].cfg.tier != tier {
                    continue;
                }
                // Under the protection cap a tenant's chunks fit what the cap leaves.
                let capped = self.capped(t);
                let budget = match self.others_left {
                    Some(left) if capped => left.min(*budget),
                    _ => *budget,
                };
                // Running prefills whose chunk does not fit (whole-prompt mode, or the
                // protection cap) sit out.
                while let Some(&id) = running[t].front() {
                    let left = self.seqs.get(&id).map_or(0, |s| s.target - s.computed);
                    let chunk = self.chunk_capped(left, budget, capped);
                    if chunk > 0 {
                        *head = Some((id, chunk, false));
                        break;
                    }
                    running[t].pop_front();
                }
                if head.is_none() && !starts_blocked {
                    if let Some(&id) = self.tenants[t].ready.front() {
                        let s = &self.seqs[&id];
                        let chunk = if matches!(s.state, State::SwappedOut) {
                            0
                        } else {
                            self.chunk_capped(s.target.saturating_sub(s.computed), budget, capped)
                        };
                        let swapped = matches!(s.state, State::SwappedOut);
                        if swapped || chunk > 0 {
                            *head = Some((id, chunk, true));
                        }
                    }
                }
            }
            let drr = &mut self.drr[tier_index(tier)];
            let Some(t) = drr.pick(|t| heads[t].map(|(_, chunk, _)| u64::from(chunk))) else {
                break;
            };
            let Some((id, chunk, is_start)) = heads[t] else { break };
            if !is_start {
                running[t].pop_front();
                let end = self.seqs.get(&id).map_or(0, |s| s.computed + chunk);
                // The chunk's positions must have blocks (a no-op when they do already).
                if self.blocks.grow(id, end).is_err() {
                    continue;
                }
                let drr = &mut self.drr[tier_index(tier)];
                drr.charge(t, u64::from(chunk));
                self.charge_cap(t, chunk);
                self.push_item(id, StepKind::Prefill { tokens: chunk });
                *budget = budget.saturating_sub(chunk);
                *seqs_left -= 1;
                continue;
            }
            // The head's chunk already fits what the protection cap leaves.
            let capped = self.capped(t);
            let start_budget = if capped { (*budget).min(chunk) } else { *budget };
            match self.start_chunk(id, start_budget, capped) {
                Some(chunk) => {
                    self.drr[tier_index(tier)].charge(t, u64::from(chunk));
                    self.charge_cap(t, chunk);
                    self.tenants[t].ready.pop_front();
                    self.start(now_ns, id, chunk, budget, seqs_left);
                }
                // Wait for blocks; nothing behind it may take them (no starvation by
                // smaller requests, and the interactive tier keeps what preemption freed).
                None => starts_blocked = true,
            }
        }
        starts_blocked
    }
}
