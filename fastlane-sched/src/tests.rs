//! Unit tests of the scheduler: admission, chunked prefill, preemption, DRR, protection.

use super::*;

fn costs() -> PreemptCosts {
    PreemptCosts {
        prefill_ns_per_token: 100_000.0,
        swap_ns_per_byte: 0.04,
        swap_fixed_ns: 100_000,
        kv_bytes_per_token: 131_072,
    }
}

fn cfg(policy: Policy, kv_blocks: u32) -> SchedConfig {
    SchedConfig {
        policy,
        kv_blocks,
        watermark_blocks: 1,
        chunk_tokens: Some(512),
        batch_tokens_max: 2048,
        batch_seqs_max: 256,
        drr_quantum_tokens: 512,
        stream_ns_max: None,
        preempt: costs(),
        protect: None,
        tier_steps: TierSteps::Shared,
        mixed_batch_tokens: None,
        attention_context: 0,
    }
}

fn tenant(
    name: &str,
    tier: Tier,
    cap: f64,
    rpm: f64,
    conc: u32,
    overflow: Overflow,
) -> TenantConfig {
    TenantConfig {
        name: name.into(),
        tier,
        bucket_capacity: cap,
        rpm,
        concurrency_max: conc,
        weight: 1,
        overflow,
    }
}

fn port() -> InstantPort {
    InstantPort::new(131_072 * 16, 0.04, 100_000, 1 << 40)
}

fn req(seq: u64, tenant: TenantIndex, prompt: u32, out: u32, at: u64) -> Request {
    Request {
        seq: SeqId(seq),
        tenant,
        prompt_tokens: prompt,
        output_tokens: out,
        arrival_ns: at,
        cached_tokens: 0,
    }
}

/// Run steps of 10 ms until idle or `steps_max`.
fn drain<P: SwapPort>(s: &mut Scheduler<P>, mut now: u64, steps_max: u32) -> u64 {
    for _ in 0..steps_max {
        let empty = s.schedule(now).unwrap().is_empty();
        if empty {
            match s.next_wakeup_ns(now) {
                Some(t) => {
                    now = t.max(now + 1);
                    continue;
                }
                None => return now,
            }
        }
        now += 10_000_000;
        s.complete_step(now).unwrap();
    }
    now
}

#[test]
fn bucket_pass_but_concurrency_fail_keeps_the_token() {
    let t = tenant("a", Tier::Interactive, 2.0, 0.0, 1, Overflow::Reject);
    let mut s = Scheduler::new(cfg(Policy::Drr, 1000), vec![t], port()).unwrap();
    assert_eq!(s.submit(0, req(1, 0, 16, 4, 0)).unwrap(), Admission::Admitted);
    // Slot taken: rejected, and the bucket still has its second token.
    assert_eq!(
        s.submit(0, req(2, 0, 16, 4, 0)).unwrap(),
        Admission::Rejected(RejectReason::QueueFull)
    );
    drain(&mut s, 0, 100);
    assert_eq!(s.stats(0).unwrap().completed, 1);
    assert_eq!(s.submit(1, req(3, 0, 16, 4, 1)).unwrap(), Admission::Admitted);
    drain(&mut s, 1, 100);
    // Now both tokens are spent (rpm 0: no refill).
    assert_eq!(
        s.submit(2, req(4, 0, 16, 4, 2)).unwrap(),
        Admission::Rejected(RejectReason::QueueFull)
    );
    let st = s.stats(0).unwrap();
    assert_eq!((st.admitted, st.rejected, st.completed), (2, 2, 2));
}

#[test]
fn the_gate_tells_an_empty_bucket_from_a_full_queue() {
    // Bucket of 3, no refill, one slot, queue of 1.
    let t = tenant("a", Tier::Interactive, 3.0, 0.0, 1, Overflow::Gate { depth_max: 1 });
    let mut s = Scheduler::new(cfg(Policy::Drr, 1000), vec![t], port()).unwrap();
    assert_eq!(s.submit(0, req(1, 0, 16, 4, 0)).unwrap(), Admission::Admitted);
    // Token left, no slot: waits without spending it.
    assert_eq!(s.submit(0, req(2, 0, 16, 4, 0)).unwrap(), Admission::Queued);
    // A token is left for it too, but the queue is full: 503's reason.
    assert_eq!(
        s.submit(0, req(3, 0, 16, 4, 0)).unwrap(),
        Admission::Rejected(RejectReason::QueueFull)
    );
    drain(&mut s, 0, 200);
    let st = s.stats(0).unwrap();
    assert_eq!(st.completed, 2, "the queued request ran when the slot freed");
    // Two tokens spent, one left: admitted; then the bucket is empty: 429's reason, although
    // the queue has room.
    assert_eq!(s.submit(1, req(4, 0, 16, 4, 1)).unwrap(), Admission::Admitted);
    assert_eq!(
        s.submit(1, req(5, 0, 16, 4, 1)).unwrap(),
        Admission::Rejected(RejectReason::RateLimited)
    );
}

#[test]
fn the_gate_reserves_tokens_for_waiting_requests() {
    // Two tokens, one slot: the first runs (spends one), the second waits holding a claim on
    // the last token, so a third is rate-limited rather than queued on a token it cannot get.
    let t = tenant("a", Tier::Interactive, 2.0, 0.0, 1, Overflow::Gate { depth_max: 8 });
    let mut s = Scheduler::new(cfg(Policy::Drr, 1000), vec![t], port()).unwrap();
    assert_eq!(s.submit(0, req(1, 0, 16, 4, 0)).unwrap(), Admission::Admitted);
    assert_eq!(s.submit(0, req(2, 0, 16, 4, 0)).unwrap(), Admission::Queued);
    assert_eq!(
        s.submit(0, req(3, 0, 16, 4, 0)).unwrap(),
        Admission::Rejected(RejectReason::RateLimited)
    );
}

#[test]
fn router_queue_admits_when_the_bucket_refills() {
    let t = tenant("a", Tier::Interactive, 1.0, 60.0, 8, Overflow::Queue { depth_max: 4 });
    let mut s = Scheduler::new(cfg(Policy::Drr, 1000), vec![t], port()).unwrap();
    assert_eq!(s.submit(0, req(1, 0, 16, 2, 0)).unwrap(), Admission::Admitted);
    assert_eq!(s.submit(0, req(2, 0, 16, 2, 0)).unwrap(), Admission::Queued);
    let end = drain(&mut s, 0, 1000);
    assert!(end >= 1_000_000_000, "second request waited for the refill: {end}");
    let st = s.stats(0).unwrap();
    assert_eq!(st.completed, 2);
    // Its TTFT counts the router wait (≈ 1 s).
    assert!(st.ttft.max() >= 1_000_000_000);
}

#[test]
fn chunked_prefill_splits_a_long_prompt_and_decodes_keep_running() {
    let t = tenant("a", Tier::Interactive, 100.0, 6000.0, 100, Overflow::Reject);
    let mut s = Scheduler::new(cfg(Policy::Drr, 10_000), vec![t], port()).unwrap();
    s.submit(0, req(1, 0, 16, 100, 0)).unwrap();
    let _ = s.schedule(0).unwrap();
    s.complete_step(1).unwrap();
    s.submit(1, req(2, 0, 2000, 1, 1)).unwrap();
    let mut prefill_chunks = Vec::new();
    for k in 0..5u64 {
        let plan = s.schedule(2 + k).unwrap();
        assert!(plan.items.iter().any(|i| i.kind == StepKind::Decode), "decode every step");
        prefill_chunks.extend(plan.items.iter().filter_map(|i| match i.kind {
            StepKind::Prefill { tokens } => Some(tokens),
            StepKind::Decode => None,
        }));
        s.complete_step(3 + k).unwrap();
    }
    assert_eq!(&prefill_chunks[..4], &[512, 512, 512, 464]);
}

#[test]
fn interactive_preempts_batch_by_swap_and_batch_resumes() {
    let tenants = vec![
        tenant("chat", Tier::Interactive, 10.0, 600.0, 10, Overflow::Reject),
        tenant("batch", Tier::Batch, 10.0, 600.0, 10, Overflow::Reject),
    ];
    // 100 blocks: the batch job (1200 + 64 tokens = 79 blocks) leaves too few for chat.
    let mut s = Scheduler::new(cfg(Policy::DrrPreempt, 100), tenants, port()).unwrap();
    s.submit(0, req(1, 1, 1200, 64, 0)).unwrap();
    let mut now = 0;
    for _ in 0..5 {
        let _ = s.schedule(now).unwrap();
        now += 10_000_000;
        s.complete_step(now).unwrap();
    }
    s.submit(now, req(2, 0, 400, 4, now)).unwrap();
    let end = drain(&mut s, now, 10_000);
    let chat = s.stats(0).unwrap();
    let batch = s.stats(1).unwrap();
    assert_eq!(chat.completed, 1);
    assert_eq!(batch.completed, 1, "batch job resumed and finished");
    assert_eq!(batch.preempted_swap, 1);
    assert!(batch.swap_out_bytes > 0 && batch.swap_in_bytes == batch.swap_out_bytes);
    assert!(chat.ttft.max() < 100_000_000, "chat waited {} ns", chat.ttft.max());
    assert!(end > now);
    assert_eq!(s.blocks().free(), 100);
}

#[test]
fn without_preemption_interactive_waits_for_the_batch_job() {
    let tenants = vec![
        tenant("chat", Tier::Interactive, 10.0, 600.0, 10, Overflow::Reject),
        tenant("batch", Tier::Batch, 10.0, 600.0, 10, Overflow::Reject),
    ];
    let mut s = Scheduler::new(cfg(Policy::Drr, 100), tenants, port()).unwrap();
    s.submit(0, req(1, 1, 1200, 64, 0)).unwrap();
    let mut now = 0;
    for _ in 0..5 {
        let _ = s.schedule(now).unwrap();
        now += 10_000_000;
        s.complete_step(now).unwrap();
    }
    s.submit(now, req(2, 0, 400, 4, now)).unwrap();
    drain(&mut s, now, 10_000);
    let chat = s.stats(0).unwrap();
    assert_eq!(s.stats(1).unwrap().preemptions(), 0);
    assert!(chat.ttft.max() > 500_000_000, "chat waited only {} ns", chat.ttft.max());
}

#[test]
fn fence_ends_runaway_streams_and_frees_the_slot() {
    let t = tenant("a", Tier::Interactive, 10.0, 600.0, 1, Overflow::Queue { depth_max: 4 });
    let mut c = cfg(Policy::Drr, 10_000);
    c.stream_ns_max = Some(200_000_000);
    let mut s = Scheduler::new(c, vec![t], port()).unwrap();
    s.submit(0, req(1, 0, 16, 1_000_000, 0)).unwrap_err();
    s.submit(0, req(1, 0, 16, 10_000, 0)).unwrap();
    s.submit(0, req(2, 0, 16, 4, 0)).unwrap();
    drain(&mut s, 0, 10_000);
    let st = s.stats(0).unwrap();
    assert_eq!((st.fenced, st.completed), (1, 1));
    assert_eq!(s.live(), 0);
}

#[test]
fn a_waiting_quiet_prefill_gets_its_share_of_the_next_step() {
    // The flooder has eight long prefills under way: its chunks alone would fill every
    // step's 2,048-token budget for many steps. The quiet tenant's request must get a
    // chunk in the very next step (DRR over the step's prefill budget), not wait behind
    // the flooder's admitted chunks.
    let tenants = vec![
        tenant("flood", Tier::Interactive, 1e9, 1e9, 1000, Overflow::Reject),
        tenant("quiet", Tier::Interactive, 1e9, 1e9, 1000, Overflow::Reject),
    ];
    let mut s = Scheduler::new(cfg(Policy::Drr, 10_000), tenants, port()).unwrap();
    for i in 0..8 {
        s.submit(0, req(i, 0, 8000, 4, 0)).unwrap();
    }
    let mut now = 0;
    for _ in 0..2 {
        let _ = s.schedule(now).unwrap();
        now += 10_000_000;
        s.complete_step(now).unwrap();
    }
    s.submit(now, req(100, 1, 2000, 4, now)).unwrap();
    let plan = s.schedule(now).unwrap();
    let quiet = tenant_tokens(plan, 1).0;
    assert_eq!(quiet, 512, "quiet chunk in the next step: {plan:?}");
    assert_eq!(plan.prefill_tokens, 2048, "the flooder gets the rest (work conserving)");
}

#[test]
fn drr_shares_the_engine_between_a_flooder_and_a_quiet_tenant() {
    let tenants = vec![
        tenant("flood", Tier::Interactive, 1e9, 1e9, 1000, Overflow::Reject),
        tenant("quiet", Tier::Interactive, 1e9, 1e9, 1000, Overflow::Reject),
    ];
    let mut c = cfg(Policy::Drr, 400);
    c.batch_seqs_max = 4;
    let mut s = Scheduler::new(c, tenants, port()).unwrap();
    for i in 0..200 {
        s.submit(0, req(i, 0, 256, 8, 0)).unwrap();
    }
    s.submit(0, req(1000, 1, 256, 8, 0)).unwrap();
    let mut now = 0;
    let mut quiet_first = None;
    for step in 0..400 {
        let _ = s.schedule(now).unwrap();
        now += 10_000_000;
        s.complete_step(now).unwrap();
        if s.stats(1).unwrap().ttft.len() == 1 {
            quiet_first = Some(step);
            break;
        }
    }
    assert!(quiet_first.unwrap() < 10, "quiet tenant served at step {quiet_first:?}");
}
/// Two batch tenants, "heavy" of weight 3 and "light" of weight 1, under DRR (512-token steps,
/// `chunk`-token prefill chunks, 128-token quanta).
fn heavy_and_light(chunk: u32) -> Scheduler<InstantPort> {
    let mut a = tenant("heavy", Tier::Batch, 1e9, 1e9, 1000, Overflow::Reject);
    a.weight = 3;
    let b = tenant("light", Tier::Batch, 1e9, 1e9, 1000, Overflow::Reject);
    let mut c = cfg(Policy::Drr, 100_000);
    c.batch_tokens_max = 512;
    c.chunk_tokens = Some(chunk);
    c.drr_quantum_tokens = 128;
    Scheduler::new(c, vec![a, b], port()).unwrap()
}

#[test]
fn drr_weights_split_the_prefill_budget() {
    // Two backlogged batch tenants with long prompts, weights 3 and 1: over many steps the
    // prefill tokens they get are 3:1 (within a quantum).
    let mut s = heavy_and_light(128);
    for i in 0..40 {
        s.submit(0, req(i, 0, 4096, 1, 0)).unwrap();
        s.submit(0, req(1000 + i, 1, 4096, 1, 0)).unwrap();
    }
    let mut got = [0u32; 2];
    let mut now = 0;
    for _ in 0..200 {
        let plan = s.schedule(now).unwrap();
        for (t, g) in got.iter_mut().enumerate() {
            *g += tenant_tokens(plan, t).0;
        }
        now += 10_000_000;
        s.complete_step(now).unwrap();
    }
    let total = got[0] + got[1];
    assert!(total >= 200 * 500, "the budget was used: {got:?}");
    let share = f64::from(got[0]) / f64::from(total);
    assert!((share - 0.75).abs() < 0.02, "heavy's share {share:.3} of {got:?}");
}

/// Prefill tokens of `tenant` in `plan`, and its decodes.
/// Eight requests of tenant 0 at time 0 (two of 16 prompt tokens and 1,000 out, six of 8,000
/// and 4 out), then two 10 ms steps; returns the time after them.
fn flood_and_two_steps<P: SwapPort>(s: &mut Scheduler<P>) -> u64 {
    for i in 0..2 {
        s.submit(0, req(i, 0, 16, 1000, 0)).unwrap();
    }
    for i in 2..8 {
        s.submit(0, req(i, 0, 8000, 4, 0)).unwrap();
    }
    let mut now = 0;
    for _ in 0..2 {
        let _ = s.schedule(now).unwrap();
        now += 10_000_000;
        s.complete_step(now).unwrap();
    }
    now
}

fn tenant_tokens(plan: &StepPlan, tenant: TenantIndex) -> (u32, u32) {
    plan.items.iter().filter(|i| i.tenant == tenant).fold((0, 0), |(p, d), i| match i.kind {
        StepKind::Prefill { tokens } => (p + tokens, d),
        StepKind::Decode => (p, d + 1),
    })
}

/// A flooder that spent its whole bucket (8 admissions, no refill: unprotected) with two
/// streams decoding and six long prefills under way, and a quiet tenant with a full
/// bucket. Returns the scheduler and the time after the flooder's first steps.
fn flooder_and_quiet(protect: Option<ProtectConfig>) -> (Scheduler<InstantPort>, u64) {
    let mut c = cfg(Policy::Drr, 10_000);
    c.protect = protect;
    flood_tier_and_quiet(Tier::Interactive, c)
}

/// [`flooder_and_quiet`]'s two tenants, the flooder in `flood_tier`, under `c`.
fn flood_tier_and_quiet(flood_tier: Tier, c: SchedConfig) -> (Scheduler<InstantPort>, u64) {
    let tenants = vec![
        tenant("flood", flood_tier, 8.0, 0.0, 1000, Overflow::Reject),
        tenant("quiet", Tier::Interactive, 10.0, 60.0, 1000, Overflow::Reject),
    ];
    let mut s = Scheduler::new(c, tenants, port()).unwrap();
    let now = flood_and_two_steps(&mut s);
    (s, now)
}

#[test]
fn protection_gives_an_under_rate_tenants_chunk_the_step_and_decodes_keep_running() {
    let (mut s, mut now) = flooder_and_quiet(Some(ProtectConfig::default()));
    // Nothing protected to prefill yet: the flooder gets the whole budget.
    let plan = s.schedule(now).unwrap();
    assert_eq!(tenant_tokens(plan, 0), (2046, 2), "work conserving before: {plan:?}");
    now += 10_000_000;
    s.complete_step(now).unwrap();
    s.submit(now, req(100, 1, 2000, 4, now)).unwrap();
    // The quiet request's four chunks (512, 512, 512, 464) each have the step's prefill
    // to themselves; the flooder's decodes still run in every one of them.
    let mut quiet_chunks = Vec::new();
    for _ in 0..4 {
        let plan = s.schedule(now).unwrap();
        let (quiet, _) = tenant_tokens(plan, 1);
        assert_eq!(tenant_tokens(plan, 0), (0, 2), "flooder capped to 0: {plan:?}");
        quiet_chunks.push(quiet);
        now += 10_000_000;
        s.complete_step(now).unwrap();
    }
    assert_eq!(quiet_chunks, [512, 512, 512, 464]);
    assert_eq!(s.stats(1).unwrap().ttft.len(), 1, "first token after the last chunk");
    // The quiet prefill is done: the flooder has the budget again.
    let plan = s.schedule(now).unwrap();
    assert_eq!(tenant_tokens(plan, 0).0, 2048 - plan.decode_tokens);
    assert_eq!(s.protect_stats(), ProtectStats { capped_steps: 4, released_steps: 0 });
}

#[test]
fn protection_without_the_others_decodes_gives_the_quiet_chunk_its_step_alone() {
    let p = ProtectConfig { others_decodes: false, ..ProtectConfig::default() };
    let (mut s, mut now) = flooder_and_quiet(Some(p));
    s.submit(now, req(100, 1, 2000, 4, now)).unwrap();
    for chunk in [512, 512, 512, 464] {
        let plan = s.schedule(now).unwrap();
        assert_eq!(tenant_tokens(plan, 1), (chunk, 0), "{plan:?}");
        assert_eq!(tenant_tokens(plan, 0), (0, 0), "no flooder decode either: {plan:?}");
        assert_eq!(plan.decode_tokens, 0);
        assert_eq!(s.protected_tenants(), &[false, true]);
        now += 10_000_000;
        s.complete_step(now).unwrap();
    }
    // The quiet request decodes now (its own decodes run beside the flooder's work): the
    // flooder's two streams decode again and its prefills have the rest.
    let plan = s.schedule(now).unwrap();
    assert_eq!(tenant_tokens(plan, 0).1, 2, "{plan:?}");
    assert_eq!(tenant_tokens(plan, 1), (0, 1), "{plan:?}");
    assert_eq!(s.protect_stats().capped_steps, 4);
}

#[test]
fn protection_holds_the_others_decodes_no_longer_than_the_bound() {
    // A 40,000-token quiet prompt: with a 100 ms bound (10 ms steps) the flooder's decodes
    // run at least every 11 steps even though its prefills alone would not need the release.
    let p = ProtectConfig {
        hold_ns_max: 100_000_000,
        others_decodes: false,
        ..ProtectConfig::default()
    };
    let (mut s, mut now) = flooder_and_quiet(Some(p));
    s.submit(now, req(100, 1, 40_000, 4, now)).unwrap();
    let mut since = 0;
    for _ in 0..60 {
        let plan = s.schedule(now).unwrap();
        if tenant_tokens(plan, 0).1 > 0 {
            since = 0;
        } else {
            since += 1;
            assert!(since <= 10, "flooder's decodes held more than the bound");
        }
        now += 10_000_000;
        s.complete_step(now).unwrap();
    }
    assert!(s.protect_stats().released_steps >= 5, "{:?}", s.protect_stats());
}

#[test]
fn protection_cap_lets_the_others_add_that_many_prefill_tokens() {
    let p = ProtectConfig { others_prefill_tokens_max: 300, ..ProtectConfig::default() };
    let (mut s, now) = flooder_and_quiet(Some(p));
    s.submit(now, req(100, 1, 2000, 4, now)).unwrap();
    let plan = s.schedule(now).unwrap();
    assert_eq!(tenant_tokens(plan, 1).0, 512);
    assert_eq!(tenant_tokens(plan, 0), (300, 2), "{plan:?}");
}

#[test]
fn without_protection_the_flooder_fills_the_quiet_step() {
    let (mut s, now) = flooder_and_quiet(None);
    s.submit(now, req(100, 1, 2000, 4, now)).unwrap();
    let plan = s.schedule(now).unwrap();
    assert_eq!(tenant_tokens(plan, 1).0, 512);
    assert_eq!(tenant_tokens(plan, 0), (2048 - 512 - 2, 2));
    assert_eq!(s.protect_stats(), ProtectStats::default());
}

#[test]
fn a_tenant_over_its_rate_is_not_protected() {
    // Both tenants spent their buckets: nobody is protected, the step stays work
    // conserving.
    let tenants = vec![
        tenant("flood", Tier::Interactive, 8.0, 0.0, 1000, Overflow::Reject),
        tenant("busy", Tier::Interactive, 2.0, 0.0, 1000, Overflow::Reject),
    ];
    let mut c = cfg(Policy::Drr, 10_000);
    c.protect = Some(ProtectConfig::default());
    let mut s = Scheduler::new(c, tenants, port()).unwrap();
    for i in 0..8 {
        s.submit(0, req(i, 0, 8000, 4, 0)).unwrap();
    }
    s.submit(0, req(100, 1, 2000, 4, 0)).unwrap();
    s.submit(0, req(101, 1, 2000, 4, 0)).unwrap();
    let plan = s.schedule(0).unwrap();
    assert_eq!(plan.prefill_tokens, 2048);
    assert!(tenant_tokens(plan, 0).0 >= 1024, "{plan:?}");
    assert_eq!(s.protect_stats().capped_steps, 0);
}

#[test]
fn protection_releases_one_work_conserving_step_after_the_hold_bound() {
    // The quiet tenant's 40,000-token prompt keeps a protected prefill in every step for
    // 79 steps; with a 100 ms hold bound (10 ms steps) the flooder still gets a full
    // step's prefill share at least every 11 steps.
    let p = ProtectConfig { hold_ns_max: 100_000_000, ..ProtectConfig::default() };
    let (mut s, mut now) = flooder_and_quiet(Some(p));
    s.submit(now, req(100, 1, 40_000, 4, now)).unwrap();
    let mut since_flood = 0;
    let mut released = 0;
    for _ in 0..60 {
        let plan = s.schedule(now).unwrap();
        assert!(tenant_tokens(plan, 1).0 > 0, "quiet prefill in every step");
        let flood = tenant_tokens(plan, 0).0;
        if flood > 0 {
            assert_eq!(flood + 512 + plan.decode_tokens, 2048, "work conserving: {plan:?}");
            released += 1;
            since_flood = 0;
        } else {
            since_flood += 1;
            assert!(since_flood <= 10, "flooder held more than the bound");
        }
        now += 10_000_000;
        s.complete_step(now).unwrap();
    }
    assert!(released >= 5, "{released}");
    assert_eq!(s.protect_stats().released_steps, released);
}

#[test]
fn protection_needs_a_drr_policy_and_sane_settings() {
    let t = || vec![tenant("a", Tier::Interactive, 1.0, 60.0, 1, Overflow::Reject)];
    let mut c = cfg(Policy::Fifo, 100);
    c.protect = Some(ProtectConfig::default());
    assert!(matches!(Scheduler::new(c, t(), port()), Err(SchedError::Config { .. })));
    let mut c = cfg(Policy::Drr, 100);
    c.protect = Some(ProtectConfig { bucket_frac_min: 1.5, ..ProtectConfig::default() });
    assert!(matches!(Scheduler::new(c, t(), port()), Err(SchedError::Config { .. })));
    let mut c = cfg(Policy::Drr, 100);
    c.protect = Some(ProtectConfig { hold_ns_max: 0, ..ProtectConfig::default() });
    assert!(matches!(Scheduler::new(c, t(), port()), Err(SchedError::Config { .. })));
}

/// Every planned item's positions have blocks, through swaps and recomputes forced in
/// the middle of prefills, under each policy (found by the real engine: a sequence
/// swapped out mid-prefill came back with blocks for what it had computed only).
#[test]
fn every_planned_item_has_blocks_for_its_positions() {
    for policy in [Policy::Fifo, Policy::Drr, Policy::DrrPreempt] {
        let tenants = vec![
            tenant("chat", Tier::Interactive, 1e9, 1e9, 100, Overflow::Queue { depth_max: 100 }),
            tenant("batch", Tier::Batch, 1e9, 1e9, 100, Overflow::Queue { depth_max: 100 }),
        ];
        let mut c = cfg(policy, 40);
        c.chunk_tokens = Some(16);
        c.batch_tokens_max = 64;
        let mut s = Scheduler::new(c, tenants, port()).unwrap();
        for i in 0..12u64 {
            s.submit(0, req(i + 1, (i % 2) as usize, 20 + 13 * (i as u32 % 5), 30, 0)).unwrap();
        }
        let mut now = 0;
        let mut forced = 0;
        for step in 0..5_000u64 {
            now += 1_000_000;
            // Force a preemption every few steps, alternating swap and recompute, for a
            // while (forcing it forever would keep the same sequence from finishing).
            if step % 3 == 0 && step < 300 {
                if let Some(&id) = s.running.first() {
                    let mode =
                        if step % 2 == 0 { PreemptMode::Swap } else { PreemptMode::Recompute };
                    if s.preempt_now(now, id, Some(mode)).unwrap() {
                        forced += 1;
                    }
                }
            }
            let plan = s.schedule(now).unwrap().clone();
            for it in &plan.items {
                let n = match it.kind {
                    StepKind::Decode => 1,
                    StepKind::Prefill { tokens } => tokens,
                };
                let held = s.blocks().table(it.seq).map_or(0, |t| t.len() as u32);
                assert!(
                    held * BLOCK_TOKENS >= it.context_tokens + n,
                    "{policy}: step {step}: {:?} needs {} positions, holds {held} blocks",
                    it.seq,
                    it.context_tokens + n
                );
            }
            if !plan.is_empty() {
                s.complete_step(now).unwrap();
            }
            s.clear_events();
            if s.live() == 0 {
                break;
            }
        }
        assert_eq!(s.live(), 0, "{policy}: every request finished");
        assert!(forced > 5, "{policy}: preemption was exercised ({forced})");
        assert_eq!(s.blocks().free(), s.blocks().total());
    }
}

#[test]
fn held_slots_wait_for_release() {
    // One slot; slots are held until released: the second request waits after the first
    // finished, and gets the slot only when the first is released.
    let t = tenant("a", Tier::Interactive, 10.0, 0.0, 1, Overflow::Gate { depth_max: 4 });
    let mut s = Scheduler::new(cfg(Policy::Drr, 1000), vec![t], port()).unwrap();
    s.hold_slots_until_released();
    assert_eq!(s.submit(0, req(1, 0, 16, 2, 0)).unwrap(), Admission::Admitted);
    assert_eq!(s.submit(0, req(2, 0, 16, 2, 0)).unwrap(), Admission::Queued);
    drain(&mut s, 0, 100);
    assert_eq!(s.stats(0).unwrap().completed, 1);
    assert_eq!(s.router_queued_of(0), 1, "still waiting for the held slot");
    assert!(!s.release_slot(SeqId(2)), "a queued request holds no slot");
    assert!(s.release_slot(SeqId(1)));
    assert!(!s.release_slot(SeqId(1)), "released once");
    drain(&mut s, 1, 100);
    assert_eq!(s.stats(0).unwrap().completed, 2);
}

#[test]
fn cached_tokens_start_the_first_prefill_after_them() {
    for policy in [Policy::Fifo, Policy::Drr] {
        let t = tenant("a", Tier::Interactive, 100.0, 6000.0, 100, Overflow::Reject);
        let mut s = Scheduler::new(cfg(policy, 10_000), vec![t], port()).unwrap();
        // 48 of 100 prompt tokens cached: one chunk of 52 at context 48, blocks for all 100.
        s.submit(0, Request { cached_tokens: 48, ..req(1, 0, 100, 3, 0) }).unwrap();
        let plan = s.schedule(0).unwrap().clone();
        assert_eq!(plan.items.len(), 1, "{policy:?}");
        assert_eq!(plan.items[0].context_tokens, 48, "{policy:?}");
        assert_eq!(plan.items[0].kind, StepKind::Prefill { tokens: 52 }, "{policy:?}");
        assert_eq!(plan.prefill_tokens, 52);
        assert_eq!(s.blocks().table(SeqId(1)).unwrap().len(), 7, "{policy:?}: 100 tokens");
        let ev = s.complete_step(1).unwrap();
        assert!(matches!(ev, [SchedEvent::Token { first: true, .. }]), "{policy:?}: {ev:?}");
        s.clear_events();
        // Then decodes at context 100, 101.
        for k in 0..2u32 {
            let plan = s.schedule(2 + u64::from(k)).unwrap().clone();
            assert_eq!(plan.items[0].kind, StepKind::Decode);
            assert_eq!(plan.items[0].context_tokens, 100 + k);
            s.complete_step(3 + u64::from(k)).unwrap();
        }
        assert!(!s.is_live(SeqId(1)), "{policy:?}: finished after 3 tokens");
        assert_eq!(s.stats(0).unwrap().prefill_tokens, 52, "{policy:?}: only the tail");
        assert_eq!(s.blocks().free(), 10_000);
    }
}

#[test]
fn cached_tokens_never_cover_the_last_prompt_token() {
    let t = tenant("a", Tier::Interactive, 100.0, 6000.0, 100, Overflow::Reject);
    let mut s = Scheduler::new(cfg(Policy::Fifo, 100), vec![t], port()).unwrap();
    // The whole prompt (and more) claimed cached: the last token is still computed.
    s.submit(0, Request { cached_tokens: 64, ..req(1, 0, 32, 1, 0) }).unwrap();
    s.submit(0, Request { cached_tokens: 32, ..req(2, 0, 32, 1, 0) }).unwrap();
    let plan = s.schedule(0).unwrap().clone();
    assert_eq!(plan.items.len(), 2);
    for it in &plan.items {
        assert_eq!(it.context_tokens, 31);
        assert_eq!(it.kind, StepKind::Prefill { tokens: 1 });
    }
    let ev = s.complete_step(1).unwrap();
    assert_eq!(ev.iter().filter(|e| matches!(e, SchedEvent::Token { .. })).count(), 2);
    assert_eq!(s.blocks().free(), 100);
}

#[test]
fn cached_tokens_are_recomputed_after_a_recompute_preemption() {
    let t = tenant("a", Tier::Interactive, 100.0, 6000.0, 100, Overflow::Reject);
    let mut s = Scheduler::new(cfg(Policy::Fifo, 100), vec![t], port()).unwrap();
    s.submit(0, Request { cached_tokens: 32, ..req(1, 0, 40, 5, 0) }).unwrap();
    let plan = s.schedule(0).unwrap().clone();
    assert_eq!(plan.items[0].context_tokens, 32);
    s.complete_step(1).unwrap();
    s.clear_events();
    assert!(s.preempt_now(2, SeqId(1), Some(PreemptMode::Recompute)).unwrap());
    // The restart prefills everything it had computed (the 40 prompt tokens; the generated
    // token's KV comes with its decode) from position 0, cached or not.
    let plan = s.schedule(3).unwrap().clone();
    assert_eq!(plan.items[0].context_tokens, 0);
    assert_eq!(plan.items[0].kind, StepKind::Prefill { tokens: 40 });
}

/// Per-tenant counts a finished step records (an abandoned one must record none of them).
fn counts(s: &Scheduler<InstantPort>) -> Vec<(u64, u64, u64, u64, u64, u64)> {
    (0..s.tenant_count())
        .map(|t| {
            let st = s.stats(t).unwrap();
            (
                st.prefill_tokens,
                st.output_tokens,
                st.completed,
                st.ttft.len(),
                st.token_gap.len(),
                st.ttft.max(),
            )
        })
        .collect()
}

#[test]
fn an_abandoned_step_is_planned_again_and_the_new_arrival_joins_it() {
    // The flooder (batch tier) has two streams decoding and six long prefills under way.
    let tenants = vec![
        tenant("flood", Tier::Batch, 1e9, 1e9, 1000, Overflow::Reject),
        tenant("quiet", Tier::Interactive, 1e9, 1e9, 1000, Overflow::Reject),
    ];
    let mut s = Scheduler::new(cfg(Policy::Drr, 10_000), tenants, port()).unwrap();
    let mut now = flood_and_two_steps(&mut s);
    s.clear_events();
    let (steps, before, seqs) = (s.steps(), counts(&s), s.seq_counts());
    let free = s.blocks().free();
    let a = s.schedule(now).unwrap().clone();
    assert_eq!(tenant_tokens(&a, 0), (2046, 2), "{a:?}");
    s.abandon_step().unwrap();
    assert!(s.events().is_empty(), "no token, no finish: {:?}", s.events());
    assert_eq!((s.steps(), s.abandoned_steps()), (steps, 1));
    assert_eq!(counts(&s), before, "nothing recorded for the abandoned step");
    assert_eq!(s.seq_counts(), seqs);
    // Planned again at the same time: the same step, item for item.
    let b = s.schedule(now).unwrap().clone();
    assert_eq!(b.items, a.items);
    assert_eq!((b.prefill_tokens, b.decode_tokens), (a.prefill_tokens, a.decode_tokens));
    assert_eq!(s.blocks().free(), free, "no block granted twice");
    s.abandon_step().unwrap();
    // An interactive request arrives: it goes first; the decodes all stay; the flooder's
    // prefill chunks are those of the abandoned plan at the same positions (the last one
    // may be cut by the budget), so no prefill work was lost or advanced.
    s.submit(now, req(100, 1, 2000, 4, now)).unwrap();
    let c = s.schedule(now).unwrap().clone();
    assert_eq!(tenant_tokens(&c, 1), (512, 0), "{c:?}");
    assert_eq!(tenant_tokens(&c, 0), (2048 - 512 - 2, 2), "{c:?}");
    let decodes = |p: &StepPlan| -> Vec<StepItem> {
        p.items.iter().filter(|i| i.kind == StepKind::Decode).copied().collect()
    };
    assert_eq!(decodes(&c), decodes(&a));
    for it in c.items.iter().filter(|i| i.tenant == 0) {
        assert!(
            a.items.iter().any(|x| x.seq == it.seq && x.context_tokens == it.context_tokens),
            "{it:?} not in the abandoned plan {a:?}"
        );
    }
    now += 10_000_000;
    s.complete_step(now).unwrap();
    assert_eq!(s.steps(), steps + 1);
    assert_eq!(s.stats(0).unwrap().prefill_tokens, before[0].0 + 2048 - 512 - 2);
    assert_eq!(s.stats(1).unwrap().prefill_tokens, 512);
}

#[test]
fn sequences_started_by_an_abandoned_plan_stay_started_and_finish_once() {
    for policy in [Policy::Fifo, Policy::Drr] {
        let t = tenant("a", Tier::Batch, 100.0, 6000.0, 100, Overflow::Reject);
        let mut s = Scheduler::new(cfg(policy, 1000), vec![t], port()).unwrap();
        s.submit(0, req(1, 0, 100, 3, 0)).unwrap();
        s.submit(0, req(2, 0, 700, 3, 0)).unwrap();
        let a = s.schedule(0).unwrap().clone();
        assert_eq!(a.items.len(), 2, "{policy:?}: {a:?}");
        let free = s.blocks().free();
        s.abandon_step().unwrap();
        // Still admitted and running, blocks held, nothing computed.
        let c = s.seq_counts();
        assert_eq!((c.running, c.waiting), (2, 0), "{policy:?}");
        assert_eq!(s.blocks().free(), free, "{policy:?}: blocks stay with the sequences");
        assert_eq!(s.blocks().table(SeqId(2)).unwrap().len(), 44, "{policy:?}: 700 tokens");
        let b = s.schedule(1).unwrap().clone();
        assert_eq!(b.items, a.items, "{policy:?}: the same chunks at the same positions");
        // Then to the end, abandoning every step once.
        let mut now = 2;
        s.complete_step(now).unwrap();
        s.clear_events();
        let mut tokens = 1; // request 1's first token (one 100-token chunk)
        while s.live() > 0 {
            if s.schedule(now).unwrap().is_empty() {
                break;
            }
            s.abandon_step().unwrap();
            let _ = s.schedule(now).unwrap();
            now += 1;
            let ev = s.complete_step(now).unwrap();
            tokens += ev.iter().filter(|e| matches!(e, SchedEvent::Token { .. })).count();
            s.clear_events();
            assert!(now < 100, "{policy:?}: runs to the end");
        }
        assert_eq!(tokens, 6, "{policy:?}: three tokens each, none twice");
        let st = s.stats(0).unwrap();
        assert_eq!((st.prefill_tokens, st.output_tokens, st.completed), (800, 6, 2), "{policy:?}");
        assert_eq!(st.ttft.len(), 2, "{policy:?}");
        assert_eq!(s.steps(), s.abandoned_steps(), "{policy:?}: every step abandoned once");
        assert_eq!(s.blocks().free(), s.blocks().total(), "{policy:?}");
    }
}

/// Runs `make`'s scheduler `steps` steps of 10 ms; with `abandon`, every step is planned,
/// abandoned and planned again at the same time before it completes (and must plan the
/// same items). Returns the completed plans.
fn run_abandoning(
    make: &dyn Fn() -> (Scheduler<InstantPort>, u64),
    steps: u32,
    abandon: bool,
) -> (Vec<Vec<StepItem>>, Scheduler<InstantPort>) {
    let (mut s, mut now) = make();
    let mut plans = Vec::new();
    for step in 0..steps {
        let plan = s.schedule(now).unwrap().items.clone();
        if plan.is_empty() {
            now += 10_000_000;
            continue;
        }
        if abandon {
            s.abandon_step().unwrap();
            let again = s.schedule(now).unwrap().items.clone();
            assert_eq!(again, plan, "step {step}: planned again differently");
        }
        plans.push(plan);
        now += 10_000_000;
        s.complete_step(now).unwrap();
        s.clear_events();
    }
    (plans, s)
}

#[test]
fn abandoning_every_step_once_changes_no_plan_and_no_count() {
    // Latency protection with its hold bound (released steps), then DRR weights 3:1 across
    // two backlogged batch tenants: DRR deficits and protection's timer are given back.
    let protect = || {
        let p = ProtectConfig { hold_ns_max: 100_000_000, ..ProtectConfig::default() };
        let (mut s, now) = flooder_and_quiet(Some(p));
        s.submit(now, req(100, 1, 40_000, 4, now)).unwrap();
        (s, now)
    };
    let weighted = || {
        let mut s = heavy_and_light(96);
        for i in 0..20 {
            s.submit(0, req(i, 0, 1000 + 7 * i as u32, 2, 0)).unwrap();
            s.submit(0, req(1000 + i, 1, 900 + 13 * i as u32, 2, 0)).unwrap();
        }
        (s, 0)
    };
    for (name, make) in [
        ("protect", &protect as &dyn Fn() -> (Scheduler<InstantPort>, u64)),
        ("weighted", &weighted),
    ] {
        let (want, plain) = run_abandoning(make, 80, false);
        let (got, s) = run_abandoning(make, 80, true);
        assert_eq!(got, want, "{name}: the completed steps are the same");
        assert_eq!(counts(&s), counts(&plain), "{name}: tokens and latencies counted once");
        assert_eq!(s.protect_stats(), plain.protect_stats(), "{name}");
        assert_eq!(s.steps(), plain.steps(), "{name}: abandoned steps are not counted");
        assert_eq!(s.abandoned_steps(), got.len() as u64, "{name}");
        assert_eq!(plain.abandoned_steps(), 0, "{name}");
        assert_eq!(s.seq_counts(), plain.seq_counts(), "{name}");
    }
    let (_, s) = run_abandoning(&protect, 80, true);
    assert!(s.protect_stats().released_steps >= 5, "{:?}", s.protect_stats());
}

#[test]
fn complete_and_abandon_need_a_planned_step() {
    let t = tenant("a", Tier::Batch, 100.0, 6000.0, 100, Overflow::Reject);
    let mut s = Scheduler::new(cfg(Policy::Drr, 100), vec![t], port()).unwrap();
    assert!(matches!(s.complete_step(0), Err(SchedError::Protocol { .. })));
    assert!(matches!(s.abandon_step(), Err(SchedError::Protocol { .. })));
    // An empty plan is not a planned step.
    assert!(s.schedule(0).unwrap().is_empty());
    assert!(matches!(s.abandon_step(), Err(SchedError::Protocol { .. })));
    s.submit(0, req(1, 0, 40, 2, 0)).unwrap();
    assert!(!s.schedule(0).unwrap().is_empty());
    assert!(matches!(s.abort(SeqId(1)), Err(SchedError::Protocol { .. })), "inside the step");
    s.abandon_step().unwrap();
    assert!(matches!(s.abandon_step(), Err(SchedError::Protocol { .. })), "abandoned once");
    assert!(matches!(s.complete_step(1), Err(SchedError::Protocol { .. })), "nothing to complete");
    // Between steps again: abort works and frees everything.
    assert!(s.abort(SeqId(1)).unwrap());
    assert_eq!(s.blocks().free(), 100);
    assert_eq!(s.stats(0).unwrap().aborted, 1);
}

/// A batch-tier flooder (two streams decoding, six long prefills under way) and an
/// interactive quiet tenant, under `tier_steps`.
fn batch_flood_and_quiet(tier_steps: TierSteps) -> (Scheduler<InstantPort>, u64) {
    flood_tier_and_quiet(Tier::Batch, SchedConfig { tier_steps, ..cfg(Policy::Drr, 10_000) })
}

#[test]
fn separate_tier_steps_keep_batch_work_out_of_an_interactive_prefills_steps() {
    let (mut s, mut now) = batch_flood_and_quiet(TierSteps::SEPARATE);
    // No interactive work: the batch tier has the whole step, decodes and prefill.
    let plan = s.schedule(now).unwrap();
    assert_eq!(tenant_tokens(plan, 0), (2046, 2), "{plan:?}");
    now += 10_000_000;
    s.complete_step(now).unwrap();
    s.submit(now, req(100, 1, 1000, 4, now)).unwrap();
    // The quiet prompt's two chunks run alone: no batch prefill and no batch decode.
    for chunk in [512, 488] {
        let plan = s.schedule(now).unwrap();
        assert_eq!(tenant_tokens(plan, 1), (chunk, 0), "{plan:?}");
        assert_eq!(tenant_tokens(plan, 0), (0, 0), "batch work kept out: {plan:?}");
        assert_eq!((plan.prefill_tokens, plan.decode_tokens), (chunk, 0));
        now += 10_000_000;
        s.complete_step(now).unwrap();
    }
    assert_eq!(s.stats(1).unwrap().ttft.len(), 1, "first token after the last chunk");
    // Its decodes share steps with the batch tier again (only prefill is kept apart).
    let plan = s.schedule(now).unwrap();
    assert_eq!(tenant_tokens(plan, 1), (0, 1), "{plan:?}");
    assert_eq!(tenant_tokens(plan, 0), (2048 - 3, 2), "{plan:?}");
    assert_eq!(
        s.tier_stats(),
        TierStepStats { separate_steps: 2, released_steps: 0, mixed_capped_steps: 0 }
    );
}

/// Batch work of `plan` (tenant 0) in linear-token equivalents: tokens × (1 + context before
/// the step / `attention`), as the batch budget prices it.
fn batch_cost(plan: &StepPlan, attention: u32) -> f64 {
    let items = plan.items.iter().filter(|i| i.tenant == 0);
    items
        .map(|i| {
            let tokens = match i.kind {
                StepKind::Prefill { tokens } => tokens,
                StepKind::Decode => 1,
            };
            f64::from(tokens) * (1.0 + f64::from(i.context_tokens) / f64::from(attention))
        })
        .sum()
}

#[test]
fn batch_work_is_priced_by_attention_and_bounded_beside_interactive_decodes() {
    let attention = 512;
    let (mut s, mut now) = flood_tier_and_quiet(
        Tier::Batch,
        SchedConfig {
            tier_steps: TierSteps::SEPARATE,
            mixed_batch_tokens: Some(64),
            attention_context: attention,
            ..cfg(Policy::Drr, 10_000)
        },
    );
    // No interactive work: the batch step is priced by attention at the longest batch
    // context (unpriced: 2048 tokens), so it is no longer than one at a short context.
    let plan = s.schedule(now).unwrap();
    let (p, d) = tenant_tokens(plan, 0);
    assert!(p + d < 2048 && batch_cost(plan, attention) <= 2048.0, "{plan:?}");
    now += 10_000_000;
    s.complete_step(now).unwrap();
    s.submit(now, req(100, 1, 1000, 40, now)).unwrap();
    for _ in 0..2 {
        let plan = s.schedule(now).unwrap();
        assert_eq!(tenant_tokens(plan, 0), (0, 0), "the quiet prefill runs alone: {plan:?}");
        now += 10_000_000;
        s.complete_step(now).unwrap();
    }
    // The quiet tenant decodes: each of its steps carries some batch work (the tier moves)
    // but no more than 64 tokens' worth at the batch contexts (without the bound: 2045).
    let mut batch_tokens = 0;
    for step in 0..20 {
        let plan = s.schedule(now).unwrap();
        assert_eq!(tenant_tokens(plan, 1), (0, 1), "{plan:?}");
        let (p, d) = tenant_tokens(plan, 0);
        assert!(p + d >= 1, "step {step}: the batch tier moves: {plan:?}");
        // Priced at the longest batch context, so each planned item costs no more.
        assert!(p + d == 1 || batch_cost(plan, attention) <= 64.0, "{plan:?}");
        batch_tokens += p + d;
        now += 10_000_000;
        s.complete_step(now).unwrap();
    }
    assert!(batch_tokens < 20 * 64, "{batch_tokens}");
    let stats = s.tier_stats();
    assert_eq!((stats.separate_steps, stats.mixed_capped_steps), (2, 20), "{stats:?}");
    // Past a context of 64 × 512 a batch token alone costs more than the bound: one still goes.
    let mut c = cfg(Policy::Drr, 10_000);
    (c.tier_steps, c.mixed_batch_tokens, c.attention_context) = (TierSteps::SEPARATE, Some(64), 1);
    let (mut s, now) = flood_tier_and_quiet(Tier::Batch, c);
    s.submit(now, req(100, 1, 8, 40, now)).unwrap();
    let _ = s.schedule(now).unwrap();
    s.complete_step(now + 1).unwrap();
    let plan = s.schedule(now + 2).unwrap();
    assert_eq!(tenant_tokens(plan, 1), (0, 1), "{plan:?}");
    assert_eq!(tenant_tokens(plan, 0), (0, 1), "one batch token, a decode first: {plan:?}");
}

#[test]
fn shared_tier_steps_fill_the_interactive_step_with_batch_work() {
    let (mut s, now) = batch_flood_and_quiet(TierSteps::Shared);
    s.submit(now, req(100, 1, 1000, 4, now)).unwrap();
    let plan = s.schedule(now).unwrap();
    assert_eq!(tenant_tokens(plan, 1), (512, 0));
    assert_eq!(tenant_tokens(plan, 0), (2048 - 512 - 2, 2), "{plan:?}");
    assert_eq!(s.tier_stats(), TierStepStats::default());
}

#[test]
fn separate_tier_steps_release_one_shared_step_after_the_hold_bound() {
    let (mut s, mut now) = batch_flood_and_quiet(TierSteps::Separate { hold_ns_max: 25_000_000 });
    // A long interactive prompt: many chunks in a row, 10 ms a step.
    s.submit(now, req(100, 1, 512 * 8, 4, now)).unwrap();
    let mut batch_in = Vec::new();
    for _ in 0..6 {
        let plan = s.schedule(now).unwrap();
        assert_eq!(tenant_tokens(plan, 1).0, 512, "the interactive chunk is in every step");
        batch_in.push(tenant_tokens(plan, 0) != (0, 0));
        now += 10_000_000;
        s.complete_step(now).unwrap();
    }
    // Held at 0, 10 and 20 ms; at 30 ms the hold is over: one shared step; then again.
    assert_eq!(batch_in, [false, false, false, true, false, false]);
    assert_eq!(
        s.tier_stats(),
        TierStepStats { separate_steps: 5, released_steps: 1, mixed_capped_steps: 0 }
    );
}

#[test]
fn an_abandoned_separate_step_gives_its_hold_back() {
    let (mut s, now) = batch_flood_and_quiet(TierSteps::SEPARATE);
    s.submit(now, req(100, 1, 1000, 4, now)).unwrap();
    let _ = s.schedule(now).unwrap();
    assert_eq!(s.tier_stats().separate_steps, 1);
    s.abandon_step().unwrap();
    assert_eq!(s.tier_stats(), TierStepStats::default());
    let plan = s.schedule(now + 1).unwrap();
    assert_eq!(tenant_tokens(plan, 0), (0, 0), "planned again, still separate: {plan:?}");
    assert_eq!(tenant_tokens(plan, 1), (512, 0));
}

#[test]
fn separate_tier_steps_with_a_zero_hold_are_refused() {
    let mut c = cfg(Policy::Drr, 100);
    c.tier_steps = TierSteps::Separate { hold_ns_max: 0 };
    let t = vec![tenant("a", Tier::Batch, 1.0, 60.0, 1, Overflow::Reject)];
    assert!(matches!(Scheduler::new(c, t, port()), Err(SchedError::Config { .. })));
}
