//! Preemption by swap or recompute (the cost model chooses), swap completions, and
//! requeueing preempted sequences at the front of their tenant's queue.

use super::{
    blocks_for_tokens, tier_index, Ending, Policy, PreemptCosts, SchedError, SchedEvent, Scheduler,
    SeqId, State, SwapDir, SwapPort, TenantIndex, Tier,
};

/// How a sequence was preempted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreemptMode {
    /// Its KV went to the host tier.
    Swap,
    /// Its KV was dropped, to be recomputed.
    Recompute,
}

impl<P: SwapPort> Scheduler<P> {
    pub(super) fn poll_swaps(&mut self, now_ns: u64) {
        let mut done = std::mem::take(&mut self.done);
        done.clear();
        self.port.poll(now_ns, &mut done);
        for d in &done {
            let Some(seq) = self.seqs.get_mut(&d.seq) else { continue };
            match (d.dir, std::mem::replace(&mut seq.state, State::Waiting)) {
                (SwapDir::Out, State::SwappingOut(pinned)) => {
                    self.blocks.unpin(pinned);
                    if d.ok {
                        seq.state = State::SwappedOut;
                    } else {
                        // The host copy failed: the KV is gone from the device's point of
                        // view once unpinned, so recompute it.
                        seq.target = seq.computed.max(seq.target);
                        seq.computed = 0;
                        self.port.drop_seq(d.seq);
                    }
                    let t = seq.req.tenant;
                    self.requeue_front(t, d.seq);
                }
                (SwapDir::In, State::SwappingIn) => {
                    if d.ok {
                        seq.state = State::Running;
                        self.running.push(d.seq);
                    } else {
                        self.blocks.release(d.seq);
                        seq.target = seq.computed.max(seq.target);
                        seq.computed = 0;
                        self.port.drop_seq(d.seq);
                        let t = seq.req.tenant;
                        self.requeue_front(t, d.seq);
                    }
                }
                (_, other) => seq.state = other,
            }
            if self.seqs.get(&d.seq).is_some_and(|s| {
                s.abort_pending && !matches!(s.state, State::SwappingOut(_) | State::SwappingIn)
            }) {
                self.finish_as(d.seq, Ending::Aborted);
            }
        }
        self.done = done;
    }

    pub(super) fn requeue_front(&mut self, tenant: TenantIndex, seq: SeqId) {
        if self.cfg.policy == Policy::Fifo {
            self.fifo.push_front(seq);
        } else {
            self.tenants[tenant].ready.push_front(seq);
        }
    }

    /// The interactive request that would start next (the first interactive tenant, from
    /// the DRR cursor, with a request ready to start), without taking it.
    pub(super) fn peek_interactive(&self) -> Option<SeqId> {
        let tenants = &self.tenants;
        let t = self.drr[tier_index(Tier::Interactive)].peek(|t| {
            let ts = &tenants[t];
            (ts.cfg.tier == Tier::Interactive && !ts.ready.is_empty()).then_some(0)
        })?;
        self.tenants[t].ready.front().copied()
    }

    /// Blocks a waiting sequence needs to start (or resume).
    pub(super) fn start_need(&self, seq: SeqId) -> u32 {
        // A swapped-out sequence comes back into blocks for what it computed and needs the
        // rest of its prefill (if it was preempted mid-prefill) or its next token too.
        match self.seqs.get(&seq) {
            Some(s) => blocks_for_tokens(s.target.max(s.computed + 1)),
            None => 0,
        }
    }

    /// `drr+preempt`: if the next interactive request cannot get blocks, free them by
    /// preempting batch sequences, cheapest first.
    pub(super) fn preempt_for_interactive(&mut self, now_ns: u64) {
        let Some(cand) = self.peek_interactive() else { return };
        let need = self.start_need(cand) + self.cfg.watermark_blocks;
        // Blocks pinned by swap-outs come back on their own; count them as on the way.
        let have = self.blocks.free() + self.blocks.pinned();
        if have >= need {
            return;
        }
        let mut short = need - have;
        let mut victims: Vec<(f64, u64, SeqId, u32)> = self
            .running
            .iter()
            .filter_map(|id| self.seqs.get(id))
            .filter(|s| s.tier == Tier::Batch && matches!(s.state, State::Running))
            .map(|s| {
                let c = &self.cfg.preempt;
                let cost = c.recompute_ns(s.computed).min(c.swap_round_trip_ns(s.computed));
                let held = self.blocks.table(s.req.seq).map_or(0, |t| t.len() as u32);
                (cost, u64::MAX - s.start_order, s.req.seq, held)
            })
            .collect();
        // Cheapest first; newest first among equals.
        victims.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        for (_, _, seq, held) in victims {
            if short == 0 {
                break;
            }
            self.preempt(now_ns, seq);
            short = short.saturating_sub(held);
        }
    }

    /// Preempt a running sequence: swap or recompute by the cost model.
    pub(super) fn preempt(&mut self, now_ns: u64, id: SeqId) {
        self.running.retain(|&r| r != id);
        let Some(seq) = self.seqs.get_mut(&id) else { return };
        let c = self.cfg.preempt;
        let tokens = seq.computed;
        let bytes = u64::from(blocks_for_tokens(tokens)) * c.block_bytes();
        let t = seq.req.tenant;
        let swap = tokens > 0
            && c.swap_round_trip_ns(tokens) < c.recompute_ns(tokens)
            && self.port.can_hold(bytes);
        let mut mode = PreemptMode::Recompute;
        if swap {
            // Only the blocks that hold KV travel; prompt blocks not yet filled are freed.
            let _ = self.blocks.truncate(id, tokens);
            if let Ok(pinned) = self.blocks.pin(id) {
                match self.port.swap_out(now_ns, id, pinned.blocks()) {
                    Ok(()) => {
                        seq.state = State::SwappingOut(pinned);
                        mode = PreemptMode::Swap;
                        self.tenants[t].stats.swap_out_bytes += bytes;
                    }
                    Err(_) => self.blocks.unpin(pinned),
                }
            }
        }
        let stats = &mut self.tenants[t].stats;
        match mode {
            PreemptMode::Swap => stats.preempted_swap += 1,
            PreemptMode::Recompute => {
                stats.preempted_recompute += 1;
                self.blocks.release(id);
                seq.target = seq.target.max(seq.computed);
                seq.computed = 0;
                seq.state = State::Waiting;
                self.requeue_front(t, id);
            }
        }
        self.events.push(SchedEvent::Preempted { seq: id, tenant: t, mode });
    }

    /// Preempts a running sequence now, at a step boundary, by `mode` (`None`: the cost
    /// model decides, as for any preemption). For operators and tests that force preemption
    /// at chosen boundaries. Returns whether the sequence was running.
    pub fn preempt_now(
        &mut self,
        now_ns: u64,
        seq: SeqId,
        mode: Option<PreemptMode>,
    ) -> Result<bool, SchedError> {
        if self.planned {
            return Err(SchedError::Protocol { reason: "preempt_now() inside a step" });
        }
        if !self.running.contains(&seq)
            || !self.seqs.get(&seq).is_some_and(|s| matches!(s.state, State::Running))
        {
            return Ok(false);
        }
        let saved = self.cfg.preempt;
        match mode {
            Some(PreemptMode::Swap) => {
                self.cfg.preempt.prefill_ns_per_token = f64::MAX / 1e6;
            }
            Some(PreemptMode::Recompute) => self.cfg.preempt.prefill_ns_per_token = 0.0,
            None => {}
        }
        self.preempt(now_ns, seq);
        self.cfg.preempt = saved;
        Ok(true)
    }

    /// Replaces the swap-or-recompute cost model (an engine that measures its own costs
    /// while it runs).
    pub fn set_preempt_costs(&mut self, costs: PreemptCosts) {
        self.cfg.preempt = costs;
    }
}
