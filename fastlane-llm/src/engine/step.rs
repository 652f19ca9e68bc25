//! The engine thread's loop: commands in, one scheduled step at a time (inputs, forward pass,
//! sampling, prefix blocks, accounting, delivery), streams out.

use super::*;

/// [`Loop::step_rank`]: the step carries a protected tenant's prefill.
const RANK_PROTECTED: u8 = 0;
/// [`Loop::step_rank`]: its most urgent prefill is an unprotected interactive tenant's.
const RANK_UNPROTECTED: u8 = 1;
/// [`Loop::step_rank`]: batch-tier prefill only, or none.
const RANK_BATCH: u8 = 2;

/// One item of a step as the forward pass takes it.
#[derive(Debug)]
pub(super) struct StepInput {
    /// The sequence.
    pub(super) id: u64,
    /// Its tokens at positions `start..start + tokens.len()`.
    pub(super) tokens: Vec<u32>,
    /// The position of the first token.
    pub(super) start: usize,
    /// Whether the step samples a token for it (a decode, or a prefill that ends the prompt).
    pub(super) want_logits: bool,
    /// Its block table, covering every position up to the last token.
    pub(super) blocks: Vec<BlockId>,
}

pub(super) struct Loop {
    pub(super) model: Arc<Model>,
    pub(super) pool: KvPool,
    pub(super) sched: Scheduler<EnginePort>,
    pub(super) scratch: Scratch,
    pub(super) rx: Receiver<Command>,
    pub(super) live: HashMap<u64, Live>,
    pub(super) counters: Arc<Mutex<EngineCounters>>,
    pub(super) histograms: EngineHistograms,
    pub(super) local: EngineCounters,
    pub(super) start: Instant,
    /// Written at the top of every loop turn ([`Engine::health`] reads it).
    pub(super) beat: Arc<Beat>,
    pub(super) cfg: EngineConfig,
    pub(super) prefill_ns: f64,
    pub(super) swap_ns: f64,
    pub(super) eos: Vec<u32>,
    pub(super) chaos: Option<rand_chacha::ChaCha8Rng>,
    pub(super) prefix: Option<Arc<PrefixStore>>,
    /// Preemptible steps: the submit path's count of interactive arrivals (`None`: off).
    pub(super) arrivals: Option<Arc<Arrivals>>,
    /// Interactive-tier submissions drained from the channel so far.
    pub(super) interactive_seen: u64,
    /// Tenant index → its series of `fastlane_llm_engine_first_token_seconds`.
    pub(super) first_token: Vec<prometheus::Histogram>,
    /// Submissions sent as protected drained so far.
    pub(super) protected_seen: u64,
    /// Steps given up since the last one that ran to its end.
    pub(super) aborts_in_row: u32,
    /// Steps that could have been given up (the `force_step_aborts` hook counts them).
    pub(super) abortable_steps: u64,
    /// `protected_nice`: the engine's threads at a higher priority during protected passes.
    pub(super) boost: Option<Arc<super::boost::Boost>>,
}

impl Loop {
    fn now(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    pub(super) fn run(mut self) -> Result<(), LlmError> {
        if self.cfg.protect.is_some() {
            self.boost = self.cfg.protected_nice.and_then(super::boost::Boost::start).map(Arc::new);
            if let (Some(b), Some(a)) = (&self.boost, &self.arrivals) {
                a.set_boost(b.clone());
            }
        }
        let result = self.serve();
        self.beat.ended.store(true, Ordering::Release);
        // Whatever ended the loop, every open stream gets its end.
        let reason = if result.is_ok() { FinishReason::Abort } else { FinishReason::Error };
        let ids: Vec<u64> = self.live.keys().copied().collect();
        for id in ids {
            let _ = self.sched.abort(SeqId(id));
            self.end(id, reason);
        }
        self.publish();
        if let Err(e) = &result {
            log::error!("engine stopped: {e}");
        }
        result
    }

    fn serve(&mut self) -> Result<(), LlmError> {
        // Bounded: each turn either runs a step or waits on the channel with a timeout.
        loop {
            let idle = self.live.is_empty();
            self.beat.at_ns.store(self.now(), Ordering::Relaxed);
            self.beat.live.store(self.live.len() as u64, Ordering::Relaxed);
            let first = if idle {
                match self.rx.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return Ok(()),
                }
            } else {
                None
            };
            if let Some(c) = first {
                if !self.command(c)? {
                    return Ok(());
                }
            }
            loop {
                match self.rx.try_recv() {
                    Ok(c) => {
                        if !self.command(c)? {
                            return Ok(());
                        }
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => return Ok(()),
                }
            }
            self.maybe_chaos()?;
            let now = self.now();
            let ran = self.step(now)?;
            if let Some(n) = self.cfg.exit_after_steps.filter(|&n| self.local.steps >= n) {
                return Err(LlmError::Stopped {
                    reason: format!("fault injection: {n} steps run"),
                });
            }
            if !ran && !self.live.is_empty() {
                // Waiting for a swap, the bucket, or nothing to do: sleep until the next
                // event the scheduler knows of, a command, or 200 µs.
                let wake = self
                    .sched
                    .next_wakeup_ns(now)
                    .map(|t| t.saturating_sub(now))
                    .unwrap_or(200_000);
                let wait = Duration::from_nanos(wake.clamp(20_000, 200_000));
                match self.rx.recv_timeout(wait) {
                    Ok(c) => {
                        if !self.command(c)? {
                            return Ok(());
                        }
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => return Ok(()),
                }
            }
        }
    }

    /// Ends a live request as aborted (nothing when it already ended).
    fn abort_live(&mut self, id: u64) -> Result<(), LlmError> {
        if self.live.contains_key(&id) {
            self.sched.abort(SeqId(id))?;
            self.end(id, FinishReason::Abort);
        }
        Ok(())
    }

    /// Handles one command; `false` on shutdown.
    fn command(&mut self, c: Command) -> Result<bool, LlmError> {
        match c {
            Command::Shutdown => return Ok(false),
            Command::Abort { id } => self.abort_live(id)?,
            Command::Release { id } => {
                // A stream dropped before its end is aborted first (a no-op when it ended).
                self.abort_live(id)?;
                self.sched.release_slot(SeqId(id));
            }
            Command::Submit { id, req, tx, at, prefix, protected } => {
                let tenant = req.tenant;
                // `scripts/router-floor.sh` reads these events (`--log-format json`).
                tracing::trace!(
                    event = "request_taken",
                    id,
                    tenant = req.tenant,
                    protected,
                    waited_us = at.elapsed().as_micros() as u64,
                    prompt_tokens = req.prompt.len(),
                    "engine: request taken in"
                );
                if self.arrivals.as_ref().is_some_and(|a| a.is_interactive(tenant)) {
                    self.interactive_seen += 1;
                }
                self.protected_seen += u64::from(protected);
                let arrival_ns = at.saturating_duration_since(self.start).as_nanos() as u64;
                let cached_tokens = (prefix.blocks.len() * TOKENS_PER_BLOCK) as u32;
                let r = Request {
                    seq: SeqId(id),
                    tenant,
                    prompt_tokens: req.prompt.len() as u32,
                    output_tokens: req.max_tokens,
                    arrival_ns,
                    cached_tokens,
                };
                let live = Live {
                    sampler: Sampler::new(req.sampling, req.max_tokens as usize),
                    req,
                    generated: Vec::new(),
                    tx,
                    text: String::new(),
                    stream: TextStream::default(),
                    arrived: at,
                    ttft_ns: None,
                    preemptions: 0,
                    digest: 0xcbf2_9ce4_8422_2325,
                    stored_blocks: prefix.blocks.len(),
                    keys: prefix.keys,
                    load: prefix.blocks,
                    cached_tokens,
                };
                match self.sched.submit(self.now().max(arrival_ns), r) {
                    Ok(Admission::Admitted | Admission::Queued) => {
                        self.live.insert(id, live);
                    }
                    Ok(Admission::Rejected(why)) => {
                        self.local.rejected += 1;
                        self.live.insert(id, live);
                        self.end(
                            id,
                            match why {
                                RejectReason::RateLimited => FinishReason::RateLimited,
                                RejectReason::QueueFull => FinishReason::QueueFull,
                            },
                        );
                    }
                    Err(e) => {
                        // A request the scheduler can never run (bigger than the pool, unknown
                        // tenant): the stream ends with the reason as its text.
                        log::warn!("request {id} refused: {e}");
                        let _ = live.tx.send(StreamEvent::Done(Finished {
                            reason: FinishReason::Rejected,
                            token_ids: Vec::new(),
                            text: e.to_string(),
                            prompt_tokens: live.req.prompt.len() as u32,
                            ttft_ns: None,
                            preemptions: 0,
                            logits_digest: None,
                        }));
                        self.local.rejected += 1;
                    }
                }
            }
        }
        Ok(true)
    }

    fn maybe_chaos(&mut self) -> Result<(), LlmError> {
        let Some((p, _)) = self.cfg.chaos else { return Ok(()) };
        let Some(rng) = self.chaos.as_mut() else { return Ok(()) };
        if rng.random::<f64>() >= p || self.live.is_empty() {
            return Ok(());
        }
        let mut ids: Vec<u64> = self.live.keys().copied().collect();
        ids.sort_unstable();
        let pick = ids[rng.random_range(0..ids.len())];
        let mode = match self.cfg.preempt {
            PreemptChoice::Swap => Some(PreemptMode::Swap),
            PreemptChoice::Recompute => Some(PreemptMode::Recompute),
            PreemptChoice::Auto => None,
        };
        let now = self.now();
        self.sched.preempt_now(now, SeqId(pick), mode)?;
        Ok(())
    }

    /// Plans and runs one step; `false` when there was nothing to run.
    fn step(&mut self, now: u64) -> Result<bool, LlmError> {
        let plan = self.sched.schedule(now)?.clone();
        self.publish_protected();
        self.absorb_events();
        if plan.is_empty() {
            self.publish();
            return Ok(false);
        }
        let (inputs, broken) = self.step_inputs(&plan)?;
        self.load_prefixes(&inputs);
        let rows: u64 = inputs.iter().map(|i| i.tokens.len() as u64).sum();
        // A protected tenant's prefill has the core to itself: new connections wait in the
        // listener's backlog until the pass ends (dropped on every path out).
        // And, with `protected_nice`, the engine's threads run it at a higher priority.
        let protected = (self.cfg.accept_hold.is_some() || self.boost.is_some())
            && self.carries_protected(&plan);
        let hold = self.cfg.accept_hold.filter(|_| protected).map(|h| {
            self.local.accept_hold_steps += 1;
            h.hold()
        });
        if let Some(b) = self.boost.as_ref().filter(|_| protected) {
            b.raise();
        }
        // With the trace on: how long the engine's threads waited for a core during the pass.
        let sched_before = tracing::enabled!(tracing::Level::TRACE).then(sched_times);
        let forwarded = self.forward(&plan, &inputs);
        drop(hold);
        let given_up = matches!(forwarded, Ok((Forward::Aborted { .. }, _, _)));
        // A pass given up was given up for a protected arrival, which raised the threads for
        // the abort and is planned next: they stay raised for it.
        if let Some(b) = self.boost.as_ref().filter(|_| protected || !given_up) {
            b.lower();
        }
        let (outcome, fwd_ns, forced) = forwarded?;
        let (oncpu_ns, runq_ns) = sched_before.map_or((0, 0), |(on, wait)| {
            let (on2, wait2) = sched_times();
            (on2.saturating_sub(on), wait2.saturating_sub(wait))
        });
        // One event per step at trace level (the record's timestamp is the step's end):
        // `scripts/router-floor.sh` reads what the engine was doing when a request arrived
        // (`--log-format json`). The fields are only evaluated when trace is on.
        tracing::trace!(
            event = "step",
            step_us = fwd_ns / 1_000,
            prefill_items = plan.items.iter().filter(|it| it.kind != StepKind::Decode).count(),
            prefill_tokens = plan.prefill_tokens,
            decodes = plan.items.iter().filter(|it| it.kind == StepKind::Decode).count(),
            given_up,
            rank = self.step_rank(&plan).map_or(-1, i64::from),
            aborts_in_row = self.aborts_in_row,
            oncpu_us = oncpu_ns / 1_000,
            runq_us = runq_ns / 1_000,
            "engine: step"
        );
        if let Forward::Aborted { layer } = outcome {
            // The step did not happen: nothing was sampled or stored, no cost measured; the
            // K/V written for its positions is rewritten when they are computed again.
            self.aborts_in_row += 1;
            self.local.steps_aborted += 1;
            self.local.aborted_forward_ns += fwd_ns;
            log::debug!(
                "engine: step given up at layer {layer} of {} after {:.2} ms ({} sequences, {rows} rows) {}",
                self.model.config().num_hidden_layers,
                fwd_ns as f64 * 1e-6,
                inputs.len(),
                if forced.map(|c| c / 2) == Some(layer) { "by the test hook" } else { "for an interactive arrival" }
            );
            self.sched.abandon_step()?;
            self.fail_broken(broken)?;
            self.publish();
            return Ok(true);
        }
        self.aborts_in_row = 0;
        let sampled = self.sample(&inputs);
        self.store_prefixes(&inputs);
        self.account_step(&plan, rows, inputs.len(), fwd_ns);
        self.deliver(sampled, broken)?;
        self.publish();
        Ok(true)
    }

    /// The step's items with their tokens and block tables (all tokens of a sequence are
    /// prompt ++ generated; an item covers positions `start..start + tokens.len()`), and the
    /// sequences whose block table does not cover their positions (a scheduler bug: each of
    /// those requests fails after the step, the others go on).
    fn step_inputs(&self, plan: &StepPlan) -> Result<(Vec<StepInput>, Vec<u64>), LlmError> {
        let mut inputs = Vec::with_capacity(plan.items.len());
        let mut broken = Vec::new();
        for it in &plan.items {
            let id = it.seq.0;
            let live = self.live.get(&id).ok_or_else(|| LlmError::Stopped {
                reason: format!("scheduler planned unknown sequence {id}"),
            })?;
            let start = it.context_tokens as usize;
            let n = match it.kind {
                StepKind::Decode => 1,
                StepKind::Prefill { tokens } => tokens as usize,
            };
            let plen = live.req.prompt.len();
            if start + n > plen + live.generated.len() {
                return Err(LlmError::Stopped {
                    reason: format!("step for sequence {id} runs past its tokens ({start}+{n})"),
                });
            }
            let all =
                |i: usize| if i < plen { live.req.prompt[i] } else { live.generated[i - plen] };
            let blocks =
                self.sched.blocks().table(SeqId(id)).map(<[_]>::to_vec).unwrap_or_default();
            if blocks.len() * TOKENS_PER_BLOCK < start + n {
                log::error!(
                    "engine: sequence {id} planned at positions {start}..{} with {} blocks; failing it",
                    start + n,
                    blocks.len()
                );
                broken.push(id);
                continue;
            }
            inputs.push(StepInput {
                id,
                tokens: (start..start + n).map(all).collect(),
                start,
                want_logits: match it.kind {
                    StepKind::Decode => true,
                    StepKind::Prefill { .. } => live.generated.is_empty() && start + n >= plen,
                },
                blocks,
            });
        }
        Ok((inputs, broken))
    }

    /// The forward pass over `inputs`, given up between layers for an interactive arrival
    /// when the step may be ([`Loop::step_abortable`]); its outcome, its duration in ns and
    /// the layer the test hook forced a give-up before, if it did.
    fn forward(
        &mut self,
        plan: &StepPlan,
        inputs: &[StepInput],
    ) -> Result<(Forward, u64, Option<usize>), LlmError> {
        let items: Vec<BatchItem<'_>> = inputs
            .iter()
            .map(|i| BatchItem {
                tokens: &i.tokens,
                start_pos: i.start,
                blocks: &i.blocks,
                want_logits: i.want_logits,
            })
            .collect();
        let t0 = Instant::now();
        let mut forced = None;
        let rank = self.step_rank(plan);
        let outcome = if let Some(rank) = rank.filter(|&r| r >= RANK_UNPROTECTED) {
            let last = (2 * self.model.config().num_hidden_layers).saturating_sub(1);
            if rank == RANK_BATCH {
                // The hook gives up only what an interactive arrival could.
                self.abortable_steps += 1;
                forced = self.cfg.force_step_aborts.and_then(|(every, check)| {
                    (every > 0 && self.abortable_steps.is_multiple_of(u64::from(every)))
                        .then_some(check.min(last))
                });
            }
            let (seen, seen_protected) = (self.interactive_seen, self.protected_seen);
            let a = self.arrivals.as_deref();
            // With latency protection only a protected tenant's arrival gives a step up: an
            // interactive tenant over its rate cannot make the engine throw work away (one
            // abort per admitted request would be its to spend).
            let any_interactive = rank >= RANK_BATCH && self.cfg.protect.is_none();
            let sent = a.filter(|_| any_interactive).map(|a| &a.sent);
            let sent_protected = a.map(|a| &a.sent_protected);
            // At most two atomic loads per check, two checks per layer. Acquire pairs with the Release increments
            // in `Arrivals::sent`: an arrival counted here is in the channel at the next drain.
            let stop = |check: usize| {
                forced == Some(check)
                    || sent_protected.is_some_and(|n| n.load(Ordering::Acquire) > seen_protected)
                    || sent.is_some_and(|n| n.load(Ordering::Acquire) > seen)
            };
            self.model.forward_abortable(&items, &self.pool, &mut self.scratch, &stop)?
        } else {
            Forward::Done(self.model.forward(&items, &self.pool, &mut self.scratch)?)
        };
        Ok((outcome, t0.elapsed().as_nanos() as u64, forced))
    }

    /// One token for each input that wanted logits (rows of the scratch logits in order).
    fn sample(&mut self, inputs: &[StepInput]) -> HashMap<u64, Sampled> {
        let vocab = self.model.vocab();
        let mut sampled = HashMap::new();
        for (row, input) in inputs.iter().filter(|i| i.want_logits).enumerate() {
            // The row is the sequence's own: the sampler applies its penalties in place.
            let logits = &mut self.scratch.logits[row * vocab..(row + 1) * vocab];
            let Some(live) = self.live.get_mut(&input.id) else { continue };
            if live.req.digest_logits {
                for v in logits.iter() {
                    live.digest =
                        (live.digest ^ u64::from(v.to_bits())).wrapping_mul(0x100_0000_01b3);
                }
            }
            sampled.insert(input.id, live.sampler.sample(logits));
        }
        sampled
    }

    /// After a step that ran: the measured prefill cost, the preemption costs, the counters
    /// and histograms.
    fn account_step(&mut self, plan: &StepPlan, rows: u64, sequences: usize, fwd_ns: u64) {
        // Measured costs: prefill ns/token from this step when it was mostly prefill.
        if plan.prefill_tokens >= 16 && plan.prefill_tokens as u64 * 2 >= rows {
            let per = fwd_ns as f64 / rows as f64;
            self.prefill_ns = 0.9 * self.prefill_ns + 0.1 * per;
        }
        // The swap cost stays the start-up calibration: the port sees a transfer end only at
        // the next step boundary, so its wall times include the step and would overstate it.
        let bb = crate::kv::block_bytes(&self.model.kv_geometry());
        self.sched.set_preempt_costs(costs_for(
            self.cfg.preempt,
            self.prefill_ns,
            self.swap_ns,
            bb,
        ));
        self.local.steps += 1;
        self.local.rows += rows;
        self.local.prefill_tokens += u64::from(plan.prefill_tokens);
        self.local.forward_ns += fwd_ns;
        self.histograms.step_seconds.observe(fwd_ns as f64 * 1e-9);
        self.histograms.batch_tokens.observe(rows as f64);
        self.histograms.batch_sequences.observe(sequences as f64);
    }

    /// Ends the step in the scheduler and hands each sequence its token: the scheduler's
    /// events and the sampled tokens must match one to one; stop conditions end streams; the
    /// broken sequences fail.
    fn deliver(
        &mut self,
        mut sampled: HashMap<u64, Sampled>,
        broken: Vec<u64>,
    ) -> Result<(), LlmError> {
        let done_ns = self.now();
        let events: Vec<SchedEvent> = self.sched.complete_step(done_ns)?.to_vec();
        self.sched.clear_events();
        let mut to_stop = Vec::new();
        for ev in events {
            match ev {
                SchedEvent::Token { seq, .. } | SchedEvent::Finished { seq, .. }
                    if broken.contains(&seq.0) => {}
                SchedEvent::Token { seq, .. } => {
                    let Some(tok) = sampled.remove(&seq.0) else {
                        return Err(LlmError::Stopped {
                            reason: format!(
                                "scheduler emitted a token for {} that was not sampled",
                                seq.0
                            ),
                        });
                    };
                    if self.token(seq.0, tok) {
                        to_stop.push(seq.0);
                    }
                }
                SchedEvent::Finished { seq, fenced: false, .. } if to_stop.contains(&seq.0) => {
                    self.end(seq.0, FinishReason::Stop);
                }
                other => self.event(other),
            }
        }
        if let Some((id, _)) = sampled.into_iter().next() {
            return Err(LlmError::Stopped {
                reason: format!("sampled a token for {id} the scheduler did not emit"),
            });
        }
        self.fail_broken(broken)?;
        for id in to_stop {
            if self.live.contains_key(&id) {
                self.sched.abort(SeqId(id))?;
                self.sched.clear_events();
                self.end(id, FinishReason::Stop);
            }
        }
        Ok(())
    }

    /// What may give this step's forward pass up (`None`: nothing: preemptible steps off, or
    /// [`STEP_ABORTS_IN_ROW_MAX`] steps given up in a row, when it runs to its end: no
    /// livelock). Otherwise the step's most urgent prefill: [`RANK_PROTECTED`] (nothing
    /// gives it up), [`RANK_UNPROTECTED`] (an interactive tenant over its rate: a protected
    /// tenant's arrival gives it up) or [`RANK_BATCH`] (batch prefill or none: any interactive
    /// arrival gives it up; with latency protection on, only a protected one).
    fn step_rank(&self, plan: &StepPlan) -> Option<u8> {
        let a = self.arrivals.as_deref()?;
        if self.aborts_in_row >= STEP_ABORTS_IN_ROW_MAX {
            return None;
        }
        let protected = self.sched.protected_tenants();
        let rank = plan
            .items
            .iter()
            .filter(|it| matches!(it.kind, StepKind::Prefill { .. }))
            .map(|it| {
                if protected.get(it.tenant).copied().unwrap_or(false) {
                    RANK_PROTECTED
                } else if a.is_interactive(it.tenant) {
                    // Without protection no arrival gives an interactive prefill up: the
                    // step runs the plain forward pass (no per-layer check).
                    if self.cfg.protect.is_some() {
                        RANK_UNPROTECTED
                    } else {
                        RANK_PROTECTED
                    }
                } else {
                    RANK_BATCH
                }
            })
            .min()
            .unwrap_or(RANK_BATCH);
        Some(rank)
    }

    /// Latency protection: tells the submitting threads which tenants the plan just formed
    /// protects (their arrivals then give up a step without a protected prefill).
    fn carries_protected(&self, plan: &StepPlan) -> bool {
        let protected = self.sched.protected_tenants();
        plan.items.iter().any(|it| {
            matches!(it.kind, StepKind::Prefill { .. })
                && protected.get(it.tenant).copied().unwrap_or(false)
        })
    }

    fn publish_protected(&self) {
        let Some(a) = self.arrivals.as_deref() else { return };
        let now = self.sched.protected_tenants();
        for (t, flag) in a.protected.iter().enumerate() {
            let p = now.get(t).copied().unwrap_or(false);
            // Read first: the cache line is written only when a tenant's state changes.
            if flag.load(Ordering::Relaxed) != p {
                flag.store(p, Ordering::Relaxed);
            }
        }
    }

    /// Fails the requests whose planned item had no blocks for its positions (a scheduler
    /// bug), after the step: the others go on.
    fn fail_broken(&mut self, broken: Vec<u64>) -> Result<(), LlmError> {
        for id in broken {
            if self.live.contains_key(&id) {
                self.sched.abort(SeqId(id))?;
                self.sched.clear_events();
                self.end(id, FinishReason::Error);
            }
        }
        Ok(())
    }

    /// Copies each starting sequence's cached prefix blocks into its first blocks: the
    /// first prefill item of a sequence with a hit starts at `cached_tokens`, so those
    /// positions must hold their K/V before the forward pass reads them.
    fn load_prefixes(&mut self, inputs: &[StepInput]) {
        for StepInput { id, start: ctx, blocks: table, .. } in inputs {
            let Some(live) = self.live.get_mut(id) else { continue };
            if live.load.is_empty() {
                continue;
            }
            // A first prefill after a hit starts exactly there (the scheduler's
            // `cached_tokens`); anything else (a restart from 0) recomputes and drops them.
            if *ctx == live.cached_tokens as usize && table.len() >= live.load.len() {
                for (b, data) in table.iter().zip(&live.load) {
                    self.pool.write_block(*b, data);
                }
                self.local.prefix_hit_requests += 1;
                self.local.prefix_reused_tokens += u64::from(live.cached_tokens);
                let by_tenant = &mut self.local.prefix_reused_tokens_by_tenant;
                if by_tenant.len() <= live.req.tenant {
                    // Once per tenant, at its first hit (tenants are a fixed, short list).
                    by_tenant.resize(live.req.tenant + 1, 0);
                }
                by_tenant[live.req.tenant] += u64::from(live.cached_tokens);
            }
            live.load = Vec::new();
        }
    }

    /// After the forward pass: the full prompt blocks this step completed, not yet in the
    /// cache, are copied into it (host memory now; the cluster put is queued).
    fn store_prefixes(&mut self, inputs: &[StepInput]) {
        let Some(store) = &self.prefix else { return };
        for StepInput { id, tokens: toks, start: ctx, blocks: table, .. } in inputs {
            let Some(live) = self.live.get_mut(id) else { continue };
            let done =
                ((ctx + toks.len()) / TOKENS_PER_BLOCK).min(live.keys.len()).min(table.len());
            let from = live.stored_blocks.min(done);
            for (key, b) in live.keys[from..done].iter().zip(&table[from..done]) {
                if !store.contains(key) {
                    let data: Arc<[u8]> = self.pool.block_bytes_of(*b).into();
                    if store.insert(*key, data) {
                        self.local.prefix_stored_blocks += 1;
                    }
                }
            }
            live.stored_blocks = live.stored_blocks.max(done);
        }
    }

    /// Events outside a step's tokens (preemptions at schedule time, fences, aborts that
    /// completed with a swap).
    fn absorb_events(&mut self) {
        let events: Vec<SchedEvent> = self.sched.events().to_vec();
        self.sched.clear_events();
        for ev in events {
            self.event(ev);
        }
    }

    fn event(&mut self, ev: SchedEvent) {
        match ev {
            SchedEvent::Preempted { seq, mode, .. } => {
                match mode {
                    PreemptMode::Swap => self.local.preempt_swap += 1,
                    PreemptMode::Recompute => self.local.preempt_recompute += 1,
                }
                if let Some(l) = self.live.get_mut(&seq.0) {
                    l.preemptions += 1;
                }
            }
            SchedEvent::Finished { seq, fenced, .. } => {
                if self.live.contains_key(&seq.0) {
                    self.end(
                        seq.0,
                        if fenced { FinishReason::Fenced } else { FinishReason::Length },
                    );
                }
            }
            SchedEvent::Token { .. } => {}
        }
    }

    /// Delivers a token; `true` when the request must stop here.
    fn token(&mut self, id: u64, sampled: Sampled) -> bool {
        let now = Instant::now();
        let Some(l) = self.live.get_mut(&id) else { return false };
        let Sampled { token: tok, logprobs } = sampled;
        l.generated.push(tok);
        l.sampler.observe(tok);
        self.local.generated_tokens += 1;
        if l.ttft_ns.is_none() {
            let ttft = now.saturating_duration_since(l.arrived);
            l.ttft_ns = Some(ttft.as_nanos() as u64);
            tracing::trace!(
                event = "first_token",
                id,
                ttft_us = ttft.as_micros() as u64,
                "engine: first token"
            );
            if let Some(h) = self.first_token.get(l.req.tenant) {
                h.observe(ttft.as_secs_f64());
            }
        }
        let piece = self.model.tokenizer().piece(&l.generated, &mut l.stream);
        let before = l.text.len();
        l.text.push_str(&piece);
        // A stop string may straddle tokens: search the new text with enough of the old.
        let longest = l.req.stop.iter().map(String::len).max().unwrap_or(0);
        let mut from = before.saturating_sub(longest);
        while !l.text.is_char_boundary(from) {
            from -= 1;
        }
        if let Some(cut) = l
            .req
            .stop
            .iter()
            .filter_map(|s| l.text[from..].find(s.as_str()).map(|i| from + i))
            .min()
        {
            l.text.truncate(cut);
            let visible = if cut > before { l.text[before..].to_string() } else { String::new() };
            let _ = l.tx.send(StreamEvent::Token { id: tok, text: visible, logprobs });
            return true;
        }
        let _ = l.tx.send(StreamEvent::Token { id: tok, text: piece, logprobs });
        l.req.stop_token_ids.contains(&tok) || (!l.req.ignore_eos && self.eos.contains(&tok))
    }

    fn end(&mut self, id: u64, reason: FinishReason) {
        let Some(mut l) = self.live.remove(&id) else { return };
        let tail = l.stream.finish();
        if reason != FinishReason::Stop {
            l.text.push_str(&tail);
        }
        match reason {
            FinishReason::Abort => self.local.aborted += 1,
            FinishReason::Rejected | FinishReason::RateLimited | FinishReason::QueueFull => {}
            _ => self.local.finished += 1,
        }
        let _ = l.tx.send(StreamEvent::Done(Finished {
            reason,
            token_ids: l.generated,
            text: l.text,
            prompt_tokens: l.req.prompt.len() as u32,
            ttft_ns: l.ttft_ns,
            preemptions: l.preemptions,
            logits_digest: l.req.digest_logits.then_some(l.digest),
        }));
    }

    fn publish(&mut self) {
        let port: PortStats = self.sched.port().stats();
        let es = self.sched.port().engine().stats();
        self.local.swap_out_bytes = port.out_bytes;
        self.local.swap_in_bytes = port.in_bytes;
        self.local.swap_out_bytes_by_tier = port.out_bytes_by_tier;
        self.local.swap_failures = port.failures;
        self.local.checksum_mismatches = port.checksum_mismatches;
        self.local.spilled_bytes = es.bytes_spilled;
        for (i, t) in es.tiers.iter().enumerate() {
            self.local.tier_used_bytes[i] = t.used_bytes;
        }
        self.local.accepts_held = self.cfg.accept_hold.map_or(0, |h| h.waits());
        self.local.blocks_free = self.sched.blocks().free();
        self.local.blocks_total = self.sched.blocks().total();
        self.local.live = self.live.len() as u64;
        self.local.seqs = self.sched.seq_counts();
        let tiers = self.sched.tier_stats();
        self.local.tier_separate_steps = tiers.separate_steps;
        self.local.tier_released_steps = tiers.released_steps;
        self.local.tier_mixed_capped_steps = tiers.mixed_capped_steps;
        let protect = self.sched.protect_stats();
        self.local.protect_capped_steps = protect.capped_steps;
        self.local.protect_released_steps = protect.released_steps;
        let n = self.sched.tenant_count();
        self.local.queued_by_tenant.resize(n, 0);
        for t in 0..n {
            self.local.queued_by_tenant[t] = self.sched.router_queued_of(t);
        }
        self.local.prefill_ns_per_token = self.prefill_ns;
        self.local.swap_ns_per_byte = self.swap_ns;
        self.local.prefix_cache = self.prefix.as_ref().map(|p| p.stats());
        if let Ok(mut c) = self.counters.lock() {
            *c = self.local.clone();
        }
    }
}

/// On-CPU time and run-queue wait (ns) summed over the engine thread and the threads named like
/// the process (the compute pool's; the idle main thread adds nothing): the first two fields of
/// `/proc/self/task/*/schedstat`. Only read when the trace is on (a few files a step).
fn sched_times() -> (u64, u64) {
    let mut on = 0u64;
    let mut wait = 0u64;
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else { return (0, 0) };
    for e in dir.flatten() {
        let p = e.path();
        let comm = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
        let c = comm.trim();
        if c != "fastlane" && !c.starts_with("fastlane-llm-en") {
            continue;
        }
        if let Ok(s) = std::fs::read_to_string(p.join("schedstat")) {
            let mut it = s.split_whitespace().map(|v| v.parse::<u64>().unwrap_or(0));
            on += it.next().unwrap_or(0);
            wait += it.next().unwrap_or(0);
        }
    }
    (on, wait)
}
