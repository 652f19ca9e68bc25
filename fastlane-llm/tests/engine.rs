//! The engine end to end on `random:tiny`: preemption by swap (host tier, NVMe file) and by
//! recompute, forced at random step boundaries, and a corrupted tier block, all give exactly
//! the token ids each request produces alone; so do steps given up between layers
//! (preemptible steps), forced or for real interactive arrivals, which never starve the batch
//! tier; aborts, stops and bad requests end cleanly and the pool's free count returns to its
//! start.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use fastlane_kvswap::testing::MemTier;
use fastlane_kvswap::{CustomTiers, NvmeTierConfig, TierKind};
use fastlane_llm::engine::{EngineCounters, PrefixConfig};
use fastlane_llm::{
    Engine, EngineConfig, FinishReason, GenRequest, Model, PreemptChoice, SamplingParams,
    StreamEvent,
};
use fastlane_sched::{Overflow, Policy, TenantConfig, Tier, TierSteps};

const WAIT: Duration = Duration::from_secs(300);
const MAX_TOKENS: u32 = 20;
const REQUESTS: usize = 64;

/// A request's token ids and the digest of the logits they were sampled from.
type Output = (Vec<u32>, Option<u64>);

fn model() -> Arc<Model> {
    static M: OnceLock<Arc<Model>> = OnceLock::new();
    M.get_or_init(|| Arc::new(Model::load("random:tiny", 7).expect("random:tiny loads"))).clone()
}

/// 64 prompts of 8–119 bytes; every fourth request samples (temperature 0.8, its own seed);
/// a quarter of them, greedy or sampled, have presence and frequency penalties.
fn requests() -> Vec<GenRequest> {
    let m = model();
    (0..REQUESTS)
        .map(|i| {
            let len = 8 + (i * 37) % 112;
            let text: String =
                (0..len).map(|j| (b'a' + ((i * 7 + j * 3) % 26) as u8) as char).collect();
            let mut r = GenRequest::greedy(m.tokenizer().encode(&text).unwrap(), MAX_TOKENS);
            r.digest_logits = true;
            if i % 4 == 3 {
                r.sampling = SamplingParams {
                    temperature: 0.8,
                    top_k: 40,
                    top_p: 0.95,
                    seed: i as u64,
                    ..SamplingParams::default()
                };
            }
            if i % 8 == 1 || i % 8 == 3 {
                // Penalties count the sequence's own tokens: invisible to batching too.
                r.sampling.presence_penalty = 0.6;
                r.sampling.frequency_penalty = 0.4;
            }
            r
        })
        .collect()
}

fn ample() -> EngineConfig {
    EngineConfig { device_blocks: 1024, ..EngineConfig::default() }
}

/// Each request alone on an engine with an ample pool.
fn alone() -> &'static Vec<Output> {
    static A: OnceLock<Vec<Output>> = OnceLock::new();
    A.get_or_init(|| {
        let e = Engine::start(model(), ample()).expect("engine starts");
        let out = requests()
            .into_iter()
            .map(|r| {
                let f = e.submit(r).expect("submit").wait(WAIT).expect("finishes");
                assert_eq!(f.reason, FinishReason::Length);
                assert_eq!(f.preemptions, 0);
                (f.token_ids, f.logits_digest)
            })
            .collect();
        let c = e.shutdown().expect("clean shutdown");
        assert_eq!(c.blocks_free, c.blocks_total);
        out
    })
}

/// All requests at once; returns their tokens and the engine's counters.
fn together(e: Engine) -> (Vec<Output>, EngineCounters) {
    together_with(e, requests())
}

/// `reqs` at once; returns their tokens and the engine's counters.
fn together_with(e: Engine, reqs: Vec<GenRequest>) -> (Vec<Output>, EngineCounters) {
    let streams: Vec<_> = reqs.into_iter().map(|r| e.submit(r).expect("submit")).collect();
    let out = streams
        .iter()
        .map(|s| {
            let f = s.wait(WAIT).expect("finishes");
            assert_eq!(f.reason, FinishReason::Length, "request {}", s.id);
            (f.token_ids, f.logits_digest)
        })
        .collect();
    let c = e.shutdown().expect("clean shutdown");
    assert_eq!(c.blocks_free, c.blocks_total, "every block back in the pool: {c:?}");
    assert_eq!(c.live, 0);
    (out, c)
}

/// Same token ids, and the same logits to the last bit, as each request alone.
fn assert_same(got: &[Output], what: &str) {
    let want = alone();
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.0, w.0, "{what}: request {i}'s tokens differ from its solo run");
        assert!(g.1.is_some());
        assert_eq!(g.1, w.1, "{what}: request {i}'s logits differ from its solo run");
    }
}

/// A pool of 24 blocks for 64 sequences of up to 9 blocks each: most are preempted.
fn tight(preempt: PreemptChoice) -> EngineConfig {
    EngineConfig { device_blocks: 24, preempt, ..EngineConfig::default() }
}

#[test]
fn swap_through_the_host_tier_is_invisible() {
    let e = Engine::start(model(), tight(PreemptChoice::Swap)).unwrap();
    let (got, c) = together(e);
    assert_same(&got, "swap (host)");
    assert!(c.preempt_swap >= 5, "the tight pool must preempt by swap: {c:?}");
    assert!(c.swap_out_bytes_by_tier[0] > 0 && c.swap_out_bytes_by_tier[1] == 0, "{c:?}");
    assert!(c.swap_out_bytes > 0 && c.swap_in_bytes > 0, "{c:?}");
    assert_eq!((c.checksum_mismatches, c.swap_failures), (0, 0));
}

#[test]
fn swap_through_an_nvme_file_is_invisible() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = tight(PreemptChoice::Swap);
    cfg.swap.host_bytes = 0;
    cfg.swap.nvme =
        Some(NvmeTierConfig { path: dir.path().join("kv.tier"), bytes: 64 << 20, depth: 16 });
    let e = Engine::start(model(), cfg).unwrap();
    let (got, c) = together(e);
    assert_same(&got, "swap (nvme)");
    assert!(c.preempt_swap >= 5, "{c:?}");
    assert!(c.swap_out_bytes_by_tier[1] > 0 && c.swap_out_bytes_by_tier[0] == 0, "{c:?}");
    assert!(c.swap_in_bytes > 0, "{c:?}");
}

#[test]
fn recompute_is_invisible() {
    let e = Engine::start(model(), tight(PreemptChoice::Recompute)).unwrap();
    let (got, c) = together(e);
    assert_same(&got, "recompute");
    assert!(c.preempt_recompute >= 5, "{c:?}");
    assert_eq!(c.preempt_swap, 0);
}

#[test]
fn preemption_forced_at_random_step_boundaries_is_invisible() {
    for (preempt, seed) in
        [(PreemptChoice::Swap, 1), (PreemptChoice::Recompute, 2), (PreemptChoice::Auto, 3)]
    {
        let cfg = EngineConfig { chaos: Some((0.5, seed)), preempt, ..ample() };
        let e = Engine::start(model(), cfg).unwrap();
        let (got, c) = together(e);
        assert_same(&got, &format!("forced {preempt:?}"));
        assert!(c.preempt_swap + c.preempt_recompute >= 5, "{c:?}");
        match preempt {
            PreemptChoice::Swap => assert!(c.preempt_swap >= 5 && c.swap_in_bytes > 0, "{c:?}"),
            PreemptChoice::Recompute => assert_eq!(c.preempt_swap, 0, "{c:?}"),
            PreemptChoice::Auto => {}
        }
    }
}

#[test]
fn drr_with_preemption_is_invisible() {
    let cfg = EngineConfig { policy: Policy::DrrPreempt, ..tight(PreemptChoice::Auto) };
    let e = Engine::start(model(), cfg).unwrap();
    let (got, _) = together(e);
    assert_same(&got, "drr+preempt");
}

#[test]
fn a_corrupted_tier_block_is_caught_and_recomputed() {
    let (tier, faults) = MemTier::new(TierKind::Nvme, 64 << 20);
    // The first load from the tier comes back with one byte flipped.
    faults.corrupt_offset.store(100, std::sync::atomic::Ordering::Relaxed);
    faults.corrupt_xor.store(0x40, std::sync::atomic::Ordering::Relaxed);
    let mut cfg = tight(PreemptChoice::Swap);
    cfg.swap.host_bytes = 0;
    let tiers = CustomTiers { nvme: Some(Box::new(tier)), remote: None };
    let e = Engine::start_with_tiers(model(), cfg, tiers).unwrap();
    let (got, c) = together(e);
    assert_same(&got, "corrupted block");
    assert!(c.checksum_mismatches >= 1, "the flipped byte must be caught: {c:?}");
}

#[test]
fn a_vandalised_nvme_tier_file_is_caught_and_recomputed() {
    use std::os::unix::fs::FileExt;
    use std::sync::atomic::{AtomicBool, Ordering};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kv.tier");
    let mut cfg = tight(PreemptChoice::Swap);
    cfg.swap.host_bytes = 0;
    cfg.swap.nvme = Some(NvmeTierConfig { path: path.clone(), bytes: 64 << 20, depth: 16 });
    let e = Engine::start(model(), cfg).unwrap();
    // While the engine runs, another process's worth of damage: the first MiB of the tier
    // file (where the first swapped-out blocks land) is overwritten every 2 ms, so copies read
    // back after a pass no longer match their checksums.
    let stop = Arc::new(AtomicBool::new(false));
    let vandal = {
        let (stop, path) = (stop.clone(), path.clone());
        std::thread::spawn(move || {
            let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            let junk = vec![0xa5u8; 1 << 20];
            let mut passes = 0u64;
            while !stop.load(Ordering::Relaxed) && passes < 100_000 {
                f.write_all_at(&junk, 0).unwrap();
                passes += 1;
                std::thread::sleep(Duration::from_millis(2));
            }
            passes
        })
    };
    let (got, c) = together(e);
    stop.store(true, Ordering::Relaxed);
    assert!(vandal.join().unwrap() > 0);
    assert_same(&got, "vandalised NVMe file");
    assert!(c.checksum_mismatches >= 1, "overwritten copies must fail their checksum: {c:?}");
    assert_eq!(c.checksum_mismatches, c.swap_failures, "every failure here is a mismatch: {c:?}");
}

#[test]
fn stop_strings_stop_ids_and_abort_end_streams_cleanly() {
    let m = model();
    let e = Engine::start(m.clone(), EngineConfig { device_blocks: 64, ..EngineConfig::default() })
        .unwrap();
    // The greedy continuation of a prompt, then stop at a piece of it.
    let prompt = m.tokenizer().encode("the quick brown fox").unwrap();
    let full = e.submit(GenRequest::greedy(prompt.clone(), 24)).unwrap().wait(WAIT).unwrap();
    let stop_at = full.token_ids[5];
    let mut r = GenRequest::greedy(prompt.clone(), 24);
    r.stop_token_ids = vec![stop_at];
    let f = e.submit(r).unwrap().wait(WAIT).unwrap();
    assert_eq!(f.reason, FinishReason::Stop);
    let first = full.token_ids.iter().position(|&t| t == stop_at).unwrap();
    assert_eq!(f.token_ids, full.token_ids[..=first].to_vec());
    // A stop string: the text ends before it.
    if let Some(s) = full.text.get(4..6).filter(|s| !s.is_empty()) {
        let mut r = GenRequest::greedy(prompt.clone(), 24);
        r.stop = vec![s.to_string()];
        let f = e.submit(r).unwrap().wait(WAIT).unwrap();
        assert_eq!(f.reason, FinishReason::Stop);
        assert!(
            !f.text.contains(s) && full.text.starts_with(&f.text),
            "{:?} / {:?}",
            f.text,
            full.text
        );
    }
    // Abort after the first token.
    let s = e.submit(GenRequest::greedy(prompt, 500)).unwrap();
    match s.next(WAIT) {
        Some(StreamEvent::Token { .. }) => {}
        other => panic!("expected a token, got {other:?}"),
    }
    e.abort(s.id);
    let f = s.wait(WAIT).unwrap();
    assert_eq!(f.reason, FinishReason::Abort);
    assert!(f.token_ids.len() < 500);
    let c = e.shutdown().unwrap();
    assert_eq!(c.blocks_free, c.blocks_total, "{c:?}");
}

#[test]
fn aborting_during_swaps_leaks_no_block() {
    let e = Engine::start(model(), tight(PreemptChoice::Swap)).unwrap();
    let streams: Vec<_> = requests().into_iter().map(|r| e.submit(r).unwrap()).collect();
    // Let preemption get going, then abort every other request wherever it is.
    std::thread::sleep(Duration::from_millis(50));
    for s in streams.iter().step_by(2) {
        e.abort(s.id);
    }
    for (i, s) in streams.iter().enumerate() {
        let f = s.wait(WAIT).unwrap();
        if i % 2 == 1 {
            assert_eq!(f.reason, FinishReason::Length);
            assert_eq!(&f.token_ids, &alone()[i].0, "request {i}");
        }
    }
    let c = e.shutdown().unwrap();
    assert_eq!(c.blocks_free, c.blocks_total, "{c:?}");
}

#[test]
fn requests_that_cannot_run_are_refused_with_a_reason() {
    let m = model();
    let e = Engine::start(m.clone(), EngineConfig { device_blocks: 8, ..EngineConfig::default() })
        .unwrap();
    // Longer than the context window: refused at submit.
    let long = vec![65u32; m.max_positions()];
    assert!(e.submit(GenRequest::greedy(long, 4)).is_err());
    // Token ids outside the vocabulary, empty prompts, zero max_tokens, bad sampling.
    assert!(e.submit(GenRequest::greedy(vec![m.vocab() as u32], 4)).is_err());
    assert!(e.submit(GenRequest::greedy(vec![], 4)).is_err());
    assert!(e.submit(GenRequest::greedy(vec![1], 0)).is_err());
    let mut r = GenRequest::greedy(vec![1], 4);
    r.sampling.temperature = -1.0;
    assert!(e.submit(r).is_err());
    // More blocks than the pool has: the stream ends rejected, with the reason.
    let f = e.submit(GenRequest::greedy(vec![65; 200], 4)).unwrap().wait(WAIT).unwrap();
    assert_eq!(f.reason, FinishReason::Rejected);
    assert!(f.text.contains("cannot run"), "{}", f.text);
    // The engine still serves.
    let ok = e.submit(GenRequest::greedy(vec![65; 20], 4)).unwrap().wait(WAIT).unwrap();
    assert_eq!(ok.token_ids.len(), 4);
    let c = e.shutdown().unwrap();
    assert_eq!(c.blocks_free, c.blocks_total);
}

#[test]
fn a_finished_request_holds_its_slot_until_its_stream_is_dropped() {
    // One slot for the only tenant: B cannot start while A's stream is alive, even after A
    // has finished generating; dropping A's stream (the front end does it after the last
    // token is written to the client) lets B run.
    let tenant = fastlane_sched::TenantConfig {
        name: "one".into(),
        tier: fastlane_sched::Tier::Interactive,
        bucket_capacity: 100.0,
        rpm: 6000.0,
        concurrency_max: 1,
        weight: 1,
        overflow: fastlane_sched::Overflow::Gate { depth_max: 4 },
    };
    let cfg = EngineConfig { policy: Policy::Drr, tenants: vec![tenant], ..ample() };
    let e = Engine::start(model(), cfg).unwrap();
    let a = e.submit(GenRequest::greedy(vec![65; 8], 4)).unwrap();
    assert_eq!(a.wait(WAIT).unwrap().token_ids.len(), 4);
    let b = e.submit(GenRequest::greedy(vec![66; 8], 4)).unwrap();
    assert!(b.next(Duration::from_millis(500)).is_none(), "B started while A held the slot");
    drop(a);
    assert_eq!(b.wait(WAIT).unwrap().token_ids.len(), 4, "B ran once A's stream was dropped");
}

/// Tenants without limits: `batch` (index 0, batch tier) and `chat` (index 1, interactive).
fn two_tiers() -> Vec<TenantConfig> {
    let t = |name: &str, tier| TenantConfig {
        name: name.into(),
        tier,
        bucket_capacity: 1e12,
        rpm: 1e12,
        concurrency_max: u32::MAX,
        weight: 1,
        overflow: Overflow::Queue { depth_max: 1 << 20 },
    };
    vec![t("batch", Tier::Batch), t("chat", Tier::Interactive)]
}

const BATCH: usize = 0;
const CHAT: usize = 1;

/// Preemptible steps on, DRR over [`two_tiers`], with the `force_step_aborts` hook.
fn preemptible(force: Option<(u32, usize)>, base: EngineConfig) -> EngineConfig {
    EngineConfig {
        policy: Policy::Drr,
        tenants: two_tiers(),
        preemptible_steps: true,
        force_step_aborts: force,
        ..base
    }
}

/// `requests()`, every fifth on the interactive tenant, the others on the batch tenant.
fn mixed() -> Vec<GenRequest> {
    requests()
        .into_iter()
        .enumerate()
        .map(|(i, r)| GenRequest { tenant: if i % 5 == 0 { CHAT } else { BATCH }, ..r })
        .collect()
}

#[test]
fn separate_and_shared_tier_steps_give_the_same_tokens() {
    // Interactive prompts beside batch work, the tiers kept apart (the default) or sharing
    // steps; with and without preemptible steps, and with a pool tight enough to preempt.
    let runs = [
        (TierSteps::SEPARATE, false, ample()),
        (TierSteps::SEPARATE, true, tight(PreemptChoice::Auto)),
        (TierSteps::Shared, false, ample()),
    ];
    for (tier_steps, preemptible_steps, base) in runs {
        let what = format!("{tier_steps:?}, preemptible steps {preemptible_steps}");
        let cfg = EngineConfig { tier_steps, preemptible_steps, ..preemptible(None, base) };
        // The batch share beside interactive decodes bounded (llm serve's default) where the
        // tiers are kept apart.
        let mixed_batch_tokens = (tier_steps != TierSteps::Shared).then_some(8);
        let cfg = EngineConfig { mixed_batch_tokens, ..cfg };
        let e = Engine::start(model(), cfg).unwrap();
        let (got, c) = together_with(e, mixed());
        assert_same(&got, &what);
        if tier_steps == TierSteps::Shared {
            assert_eq!(c.tier_separate_steps + c.tier_mixed_capped_steps, 0, "{what}: {c:?}");
        } else {
            assert!(c.tier_separate_steps >= 1, "{what}: batch work was kept out: {c:?}");
            assert!(c.tier_mixed_capped_steps >= 1, "{what}: batch work was bounded: {c:?}");
        }
    }
}

#[test]
fn steps_given_up_between_layers_are_invisible() {
    // Every (or every second) step that may be given up is, before the first layer, halfway
    // through the second (its K/V written, its MLP not run), or at the last check (halfway
    // through the last layer: the most K/V written and discarded); the last run with a pool
    // so tight that most sequences are preempted too.
    let runs = [
        (1, 0, Policy::Drr, ample()),
        (2, 3, Policy::Drr, ample()),
        (1, 99, Policy::DrrPreempt, tight(PreemptChoice::Auto)),
    ];
    for (every, check, policy, base) in runs {
        let what = format!("given up every {every} at check {check}, {policy}");
        let cfg = EngineConfig { policy, ..preemptible(Some((every, check)), base) };
        let e = Engine::start(model(), cfg).unwrap();
        let (got, c) = together_with(e, mixed());
        assert_same(&got, &what);
        assert!(c.steps_aborted >= 5, "{what}: steps were given up: {c:?}");
        assert!(c.steps_aborted <= c.steps + 1, "{what}: never two in a row: {c:?}");
        assert!(c.aborted_forward_ns > 0, "{what}: {c:?}");
    }
    // Off: the hook gives nothing up.
    let cfg = EngineConfig { preemptible_steps: false, ..preemptible(Some((1, 0)), ample()) };
    let e = Engine::start(model(), cfg).unwrap();
    let (got, c) = together_with(e, mixed()[..8].to_vec());
    assert_same(&got, "preemptible steps off");
    assert_eq!(c.steps_aborted, 0, "{c:?}");
}

#[test]
fn a_step_given_up_after_its_prefix_blocks_were_loaded_is_invisible() {
    // Eight prompts share a 48-token preamble (3 blocks). The first runs alone and fills the
    // prefix cache; the others load the preamble just before their first prefill, whose step
    // may then be given up: the loaded blocks must still hold the preamble's K/V when the
    // chunk is computed again, and nothing may be loaded or counted twice.
    let m = model();
    let preamble: Vec<u32> = (0..48u32).map(|j| 97 + (j * 5) % 26).collect();
    let prompts: Vec<Vec<u32>> = (0..8u32)
        .map(|i| {
            let mut p = preamble.clone();
            p.extend((0..5 + 5 * i).map(|j| 97 + (i * 3 + j * 7) % 26));
            p
        })
        .collect();
    let reqs: Vec<GenRequest> = prompts
        .iter()
        .map(|p| GenRequest { digest_logits: true, ..GenRequest::greedy(p.clone(), 12) })
        .collect();
    let off = PrefixConfig { enabled: false, ..PrefixConfig::default() };
    let reference = Engine::start(m.clone(), EngineConfig { prefix: off, ..ample() }).unwrap();
    let want: Vec<Output> = reqs
        .iter()
        .map(|r| {
            let f = reference.submit(r.clone()).unwrap().wait(WAIT).unwrap();
            (f.token_ids, f.logits_digest)
        })
        .collect();
    reference.shutdown().unwrap();
    let cfg = EngineConfig {
        chunk_tokens: Some(16),
        batch_tokens_max: 48,
        ..preemptible(Some((1, 2)), ample())
    };
    let e = Engine::start(m, cfg).unwrap();
    let first = e.submit(reqs[0].clone()).unwrap().wait(WAIT).unwrap();
    assert_eq!((first.token_ids, first.logits_digest), want[0].clone());
    let (got, c) = together_with(e, reqs[1..].to_vec());
    for (i, (g, w)) in got.iter().zip(&want[1..]).enumerate() {
        assert_eq!(g, w, "prompt {}: tokens or logits differ from the run without reuse", i + 1);
    }
    assert_eq!(c.prefix_hit_requests, 7, "each hit loaded once: {c:?}");
    assert_eq!(c.prefix_reused_tokens, 7 * 48, "{c:?}");
    assert!(c.steps_aborted >= 3, "{c:?}");
}

#[test]
fn interactive_arrivals_never_starve_the_batch_tier() {
    // Batch requests, and interactive ones arriving from another thread all along. First
    // with the hook giving up every step it may (before the last layer: the most work
    // discarded), then with only the real arrivals giving steps up. Every request finishes
    // with its solo tokens; a step given up is always followed by one that runs to its end;
    // without the hook, an arrival gives up at most one step.
    const ARRIVALS: usize = 24;
    for force in [Some((1, 99)), None] {
        let e = Engine::start(model(), preemptible(force, ample())).unwrap();
        let (batch, chat) = std::thread::scope(|sc| {
            let chat = sc.spawn(|| {
                let streams: Vec<_> = (0..ARRIVALS)
                    .map(|k| {
                        std::thread::sleep(Duration::from_millis(10));
                        let r = GenRequest { tenant: CHAT, ..requests()[k * 2].clone() };
                        (k * 2, e.submit(r).unwrap())
                    })
                    .collect();
                streams.into_iter().map(|(i, s)| (i, s.wait(WAIT).unwrap())).collect::<Vec<_>>()
            });
            let batch: Vec<_> = requests()
                .into_iter()
                .map(|r| e.submit(GenRequest { tenant: BATCH, ..r }).unwrap())
                .collect();
            let batch: Vec<_> = batch.iter().map(|s| s.wait(WAIT).unwrap()).collect();
            (batch, chat.join().unwrap())
        });
        let want = alone();
        for (i, f) in batch.iter().enumerate() {
            assert_eq!(f.reason, FinishReason::Length, "{force:?}: batch request {i}");
            assert_eq!(f.token_ids, want[i].0, "{force:?}: batch request {i}");
        }
        for (i, f) in &chat {
            assert_eq!(f.reason, FinishReason::Length, "{force:?}: chat request {i}");
            assert_eq!(f.token_ids, want[*i].0, "{force:?}: chat request {i}");
        }
        let c = e.shutdown().unwrap();
        assert_eq!(c.blocks_free, c.blocks_total, "{c:?}");
        assert!(c.steps_aborted <= c.steps + 1, "{force:?}: never two in a row: {c:?}");
        match force {
            Some(_) => assert!(c.steps_aborted >= 5, "{c:?}"),
            None => assert!(c.steps_aborted <= ARRIVALS as u64, "at most one per arrival: {c:?}"),
        }
        eprintln!("{force:?}: {} steps, {} given up", c.steps, c.steps_aborted);
    }
}

#[test]
fn protection_between_two_interactive_tenants_changes_no_token() {
    // One tier, no tier rule: `flood` (a bucket of 4 refilled at 100/s, held under half full
    // by its own backlog: unprotected) queues every prompt at once; `quiet` (no limit:
    // protected) sends from another thread all along. With `llm serve`'s protection its
    // chunks get steps without the flood's rows, and its arrivals may give up the flood's
    // prefill steps; every request finishes with its solo tokens and logits, and the
    // protection counters show it applied. Off, nothing is capped.
    let interactive = |name: &str, bucket_capacity: f64, rpm: f64| TenantConfig {
        name: name.into(),
        tier: Tier::Interactive,
        bucket_capacity,
        rpm,
        ..two_tiers()[CHAT].clone()
    };
    const FLOOD: usize = 0;
    const QUIET: usize = 1;
    const ARRIVALS: usize = 16;
    for protect in [Some(fastlane_llm::args::SERVE_PROTECT), None] {
        let cfg = EngineConfig {
            tenants: vec![interactive("flood", 4.0, 6000.0), interactive("quiet", 1e12, 1e12)],
            protect,
            ..preemptible(None, ample())
        };
        let e = Engine::start(model(), cfg).unwrap();
        let (flood, quiet) = std::thread::scope(|sc| {
            let quiet = sc.spawn(|| {
                let streams: Vec<_> = (0..ARRIVALS)
                    .map(|k| {
                        std::thread::sleep(Duration::from_millis(15));
                        let r = GenRequest { tenant: QUIET, ..requests()[k * 4].clone() };
                        (k * 4, e.submit(r).unwrap())
                    })
                    .collect();
                streams.into_iter().map(|(i, s)| (i, s.wait(WAIT).unwrap())).collect::<Vec<_>>()
            });
            let flood: Vec<_> = requests()
                .into_iter()
                .map(|r| e.submit(GenRequest { tenant: FLOOD, ..r }).unwrap())
                .collect();
            let flood: Vec<_> = flood.iter().map(|s| s.wait(WAIT).unwrap()).collect();
            (flood, quiet.join().unwrap())
        });
        let want = alone();
        let what = if protect.is_some() { "protected" } else { "unprotected" };
        for (i, f) in flood.iter().enumerate() {
            assert_eq!(f.reason, FinishReason::Length, "{what}: flood request {i}");
            assert_eq!((&f.token_ids, f.logits_digest), (&want[i].0, want[i].1), "{what}: {i}");
        }
        for (i, f) in &quiet {
            assert_eq!(f.reason, FinishReason::Length, "{what}: quiet request {i}");
            assert_eq!((&f.token_ids, f.logits_digest), (&want[*i].0, want[*i].1), "{what}: {i}");
        }
        let c = e.shutdown().unwrap();
        assert_eq!(c.blocks_free, c.blocks_total, "{c:?}");
        assert!(c.steps_aborted <= c.steps + 1, "{what}: never two in a row: {c:?}");
        let arrivals = (ARRIVALS + REQUESTS) as u64;
        assert!(c.steps_aborted <= arrivals, "{what}: at most one per arrival: {c:?}");
        match protect {
            Some(_) => assert!(c.protect_capped_steps >= 1, "{c:?}"),
            None => assert_eq!((c.protect_capped_steps, c.protect_released_steps), (0, 0)),
        }
        eprintln!(
            "{what}: {} steps, {} given up, {} capped, {} released",
            c.steps, c.steps_aborted, c.protect_capped_steps, c.protect_released_steps
        );
    }
}

#[test]
fn penalties_make_greedy_decoding_of_the_random_model_repeat_less_and_stay_deterministic() {
    let e = Engine::start(model(), ample()).expect("engine starts");
    let m = model();
    let run = |presence: f32, frequency: f32| {
        let mut r = GenRequest::greedy(m.tokenizer().encode("the cat sat on").unwrap(), 48);
        r.sampling.presence_penalty = presence;
        r.sampling.frequency_penalty = frequency;
        r.sampling.logprobs = Some(3);
        let s = e.submit(r).expect("submit");
        let mut logprobs = Vec::new();
        loop {
            match s.next(WAIT).expect("an event") {
                StreamEvent::Token { logprobs: lp, .. } => logprobs.push(lp.expect("asked for")),
                StreamEvent::Done(f) => return (f.token_ids, logprobs),
            }
        }
    };
    let repeats =
        |ids: &[u32]| ids.len() - ids.iter().collect::<std::collections::HashSet<_>>().len();
    let (plain, plain_lp) = run(0.0, 0.0);
    let (strong, strong_lp) = run(2.0, 2.0);
    assert!(repeats(&plain) > 0, "greedy without penalty repeats: {plain:?}");
    assert!(
        repeats(&strong) < repeats(&plain),
        "penalized {strong:?} repeats less than plain {plain:?}"
    );
    assert_eq!(run(2.0, 2.0).0, strong, "deterministic");
    // Greedy picks the most likely token of the distribution logprobs report.
    for (lps, ids) in [(&plain_lp, &plain), (&strong_lp, &strong)] {
        for (lp, id) in lps.iter().zip(ids.iter()) {
            assert_eq!(lp.top[0].0, *id);
            assert_eq!(lp.top[0].1, lp.logprob);
            assert!(lp.top.len() == 3 && lp.top[1].1 <= lp.logprob && lp.logprob <= 0.0);
        }
    }
    e.shutdown().expect("clean shutdown");
}
