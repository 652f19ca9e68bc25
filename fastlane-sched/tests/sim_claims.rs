//! The claims of issue 8, asserted on simulated runs with fixed seeds (several per claim
//! where the outcome depends on the draw).
//!
//! Swap cost is fixed here (25 GB/s, PCIe 4.0 x16) so the outcome does not depend on this
//! machine's memory bandwidth; the swaps still run through the real kvswap engine.

use fastlane_sched::sim::{run, ScenarioId, SimConfig, SimReport, SwapTiming};
use fastlane_sched::{new_histogram, Policy, ProtectConfig};

const PCIE_NS_PER_BYTE: f64 = 1.0 / 25.0;

fn sim(
    scenario: ScenarioId,
    policy: Policy,
    seconds: f64,
    f: impl FnOnce(&mut SimConfig),
) -> SimReport {
    let mut cfg = SimConfig::new(scenario, policy);
    cfg.seconds = Some(seconds);
    cfg.seed = 42;
    cfg.swap = SwapTiming::Fixed { ns_per_byte: PCIE_NS_PER_BYTE };
    f(&mut cfg);
    run(&cfg).expect("simulation runs")
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

/// Seeds every seed-dependent claim is checked on: a claim has to hold on each (or on
/// their pooled samples), not on one lucky draw.
const SEEDS: [u64; 3] = [1, 7, 42];

fn sim_seed(scenario: ScenarioId, policy: Policy, seconds: f64, seed: u64) -> SimReport {
    sim(scenario, policy, seconds, |c| c.seed = seed)
}

/// Scenario (a) with the quiet tenant alone: the "solo" every (a) claim is measured against.
fn quiet_solo(secs: f64, seed: u64) -> SimReport {
    let mut solo = SimConfig::new(ScenarioId::A, Policy::Fifo);
    solo.seconds = Some(secs);
    solo.seed = seed;
    solo.solo = Some("quiet".into());
    solo.swap = SwapTiming::Fixed { ns_per_byte: PCIE_NS_PER_BYTE };
    run(&solo).expect("simulation runs")
}

/// (a) FIFO starves the quiet tenant (P99 TTFT ≥ 20× solo) and bucket + DRR brings it back
/// close to solo. The issue asked for ≤ 1.15×; plain DRR does not reach it at full length
/// (seed 1, 300 s: 1.34×, and no work-conserving fair share can do better there: see "Which
/// claims hold" in docs/scheduler.md), so for `drr` the test asserts what the mechanism
/// guarantees with a margin: ≤ 1.5× on every seed (measured 1.07–1.23× at 60 s), and ≥ 100×
/// better than FIFO. The ≤ 1.15× claim is asserted with latency protection (`--protect`):
/// see `a_protection_brings_the_quiet_tenant_within_1_15x_of_solo`.
#[test]
fn a_fifo_starves_the_quiet_tenant_and_drr_brings_it_back() {
    let secs = 60.0;
    let p99 = |r: &SimReport| r.tenant("quiet").unwrap().ttft_ns(0.99);
    for seed in SEEDS {
        let solo = quiet_solo(secs, seed);
        let fifo = sim_seed(ScenarioId::A, Policy::Fifo, secs, seed);
        let drr = sim_seed(ScenarioId::A, Policy::Drr, secs, seed);
        let (s, f, d) = (p99(&solo), p99(&fifo), p99(&drr));
        eprintln!(
            "seed {seed}: quiet P99 TTFT solo {:.1} ms, fifo {:.1} ms ({:.0}x), drr {:.1} ms ({:.3}x)",
            ms(s),
            ms(f),
            f as f64 / s as f64,
            ms(d),
            d as f64 / s as f64
        );
        assert!(solo.tenant("quiet").unwrap().stats.ttft.len() >= 20);
        assert!(f as f64 >= 20.0 * s as f64, "seed {seed}: fifo {f} vs solo {s}");
        assert!(d as f64 <= 1.5 * s as f64, "seed {seed}: drr {d} vs solo {s}");
        assert!(f as f64 >= 100.0 * d as f64, "seed {seed}: fifo {f} vs drr {d}");
        // The flooder is held to its bucket: most of its requests got a 429, and it was
        // admitted at most B + rpm/60 per second.
        let flood = drr.tenant("flooder").unwrap();
        assert!(
            flood.stats.rejected > flood.stats.admitted,
            "{:?}",
            (flood.stats.rejected, flood.stats.admitted)
        );
        assert!(flood.stats.admitted as f64 <= 10.0 + secs + 1.0, "{}", flood.stats.admitted);
    }
}

/// (a) with latency protection (`drr` + `--protect`, defaults: cap 0, half-full bucket, 1 s
/// hold): the quiet tenant's P99 TTFT is within 1.15× of solo on every seed, and the price
/// is paid by the flooder alone: its admissions are unchanged (the bucket bounds them) and
/// so are its output tokens; only its prefill waits.
#[test]
fn a_protection_brings_the_quiet_tenant_within_1_15x_of_solo() {
    let secs = 60.0;
    let p99 = |r: &SimReport| r.tenant("quiet").unwrap().ttft_ns(0.99);
    for seed in SEEDS {
        let solo = quiet_solo(secs, seed);
        let drr = sim_seed(ScenarioId::A, Policy::Drr, secs, seed);
        let prot = sim(ScenarioId::A, Policy::Drr, secs, |c| {
            c.seed = seed;
            c.protect = Some(ProtectConfig::default());
        });
        let (s, d, p) = (p99(&solo), p99(&drr), p99(&prot));
        let (fd, fp) = (drr.tenant("flooder").unwrap(), prot.tenant("flooder").unwrap());
        eprintln!(
            "seed {seed}: quiet P99 TTFT solo {:.1} ms, drr {:.1} ms ({:.3}x), drr+protect \
            {:.1} ms ({:.3}x); flooder P99 TTFT {:.1} -> {:.1} ms, {:.1} -> {:.1} tok/s; \
            {} capped steps, {} released",
            ms(s),
            ms(d),
            d as f64 / s as f64,
            ms(p),
            p as f64 / s as f64,
            ms(fd.ttft_ns(0.99)),
            ms(fp.ttft_ns(0.99)),
            fd.tokens_per_s,
            fp.tokens_per_s,
            prot.protect_stats.capped_steps,
            prot.protect_stats.released_steps
        );
        assert!(p as f64 <= 1.15 * s as f64, "seed {seed}: drr+protect {p} vs solo {s}");
        assert!(p <= d, "seed {seed}: protection made it worse: {p} vs drr {d}");
        assert!(prot.protect_stats.capped_steps > 0, "seed {seed}: the cap never applied");
        // The flooder: same admissions, every admitted request served, and its output
        // within 2 % of plain DRR's (the run stops once every first token is out, so
        // streams still decoding then differ a little).
        assert_eq!(fp.stats.admitted, fd.stats.admitted, "seed {seed}");
        assert_eq!(fp.unserved, 0, "seed {seed}");
        let (od, op) = (fd.stats.output_tokens, fp.stats.output_tokens);
        assert!(op as f64 >= 0.98 * od as f64, "seed {seed}: flooder output {op} vs drr {od}");
    }
}

/// (b) Preemption cuts the chat tenant's P99.9 TTFT by ≥ 85 %. The no-preemption tail grows
/// with the batch backlog, i.e. with the run's length (on 120 s runs the cut is 73–86 %
/// depending on the seed), so this runs the full 300 s and compares the P99.9 of the chat
/// TTFTs pooled over three seeds (900 requests; their P99.9 is the pooled worst case, not
/// one seed's). Measured: −91.1 % pooled, −87.6 to −91.4 % per seed.
#[test]
fn b_preemption_cuts_interactive_tail_ttft() {
    let secs = 300.0;
    let mut pooled = [new_histogram(), new_histogram()];
    for seed in SEEDS {
        let no = sim_seed(ScenarioId::B, Policy::Drr, secs, seed);
        let yes = sim_seed(ScenarioId::B, Policy::DrrPreempt, secs, seed);
        let q = |r: &SimReport| r.tenant("chat").unwrap().ttft_ns(0.999);
        let (n, y) = (q(&no), q(&yes));
        let batch = yes.tenant("summarize").unwrap();
        eprintln!(
            "seed {seed}: chat P99.9 TTFT no preemption {:.1} ms, preemption {:.1} ms \
            (-{:.1} %); preemptions swap {} recompute {}, swapped {} MiB, real transfers {}",
            ms(n),
            ms(y),
            100.0 * (1.0 - y as f64 / n as f64),
            batch.stats.preempted_swap,
            batch.stats.preempted_recompute,
            batch.stats.swap_out_bytes >> 20,
            yes.swap.port.transfers
        );
        assert!(batch.stats.preemptions() > 0);
        assert_eq!(yes.swap.port.mismatches, 0);
        // Batch work still gets done.
        assert!(batch.stats.completed > 0);
        // Per seed: a large cut, with room (the claim itself is on the pooled tail).
        assert!((y as f64) <= 0.25 * n as f64, "seed {seed}: preempt {y} vs none {n}");
        pooled[0].add(&no.tenant("chat").unwrap().stats.ttft).unwrap();
        pooled[1].add(&yes.tenant("chat").unwrap().stats.ttft).unwrap();
    }
    let (n, y) = (pooled[0].value_at_quantile(0.999), pooled[1].value_at_quantile(0.999));
    eprintln!(
        "pooled ({} requests): chat P99.9 TTFT {:.1} ms -> {:.1} ms (-{:.1} %)",
        pooled[1].len(),
        ms(n),
        ms(y),
        100.0 * (1.0 - y as f64 / n as f64)
    );
    assert!((y as f64) <= 0.15 * n as f64, "pooled: preempt {y} vs none {n}");
}

#[test]
fn d_chunked_prefill_bounds_the_decode_stall_to_a_chunk() {
    let whole = sim(ScenarioId::D, Policy::Drr, 3.0, |c| c.chunk_tokens = None);
    let chunked = sim(ScenarioId::D, Policy::Drr, 3.0, |c| c.chunk_tokens = Some(512));
    let p99 = |r: &SimReport| r.window_token_gap.as_ref().unwrap().value_at_quantile(0.99);
    let (w, c) = (p99(&whole), p99(&chunked));
    eprintln!(
        "users' P99 token gap during the long prefill: whole {:.1} ms, chunk 512 {:.1} ms",
        ms(w),
        ms(c)
    );
    // Whole prefill: the stall is the 4,000-token prefill (~0.4 s).
    assert!(ms(w) > 300.0, "{w}");
    // Chunked: about one 512-token chunk step (~50-60 ms), far below the stall.
    assert!(ms(c) < 80.0 && (c as f64) < 0.25 * w as f64, "{c}");
}

#[test]
fn c_twenty_tenants_runs_and_drr_protects_the_light_tenants() {
    let fifo = sim(ScenarioId::C, Policy::Fifo, 30.0, |_| {});
    let drr = sim(ScenarioId::C, Policy::Drr, 30.0, |_| {});
    assert_eq!(fifo.tenants.len(), 20);
    // The lightest interactive tenant that sent anything: DRR serves it faster than FIFO.
    let light = drr.tenants.iter().find(|t| !t.stats.ttft.is_empty()).unwrap().name.clone();
    let f = fifo.tenant(&light).unwrap().ttft_ns(0.99);
    let d = drr.tenant(&light).unwrap().ttft_ns(0.99);
    eprintln!("{light} P99 TTFT: fifo {:.1} ms, drr {:.1} ms", ms(f), ms(d));
    assert!(d < f, "{light}: drr {d} fifo {f}");
    // Latency protection does not collapse an overloaded engine: the GPU stays busy (the
    // steps are shorter, not empty), so the output tokens of all 20 tenants stay within a
    // few per cent of plain DRR's.
    let prot =
        sim(ScenarioId::C, Policy::Drr, 30.0, |c| c.protect = Some(ProtectConfig::default()));
    let total = |r: &SimReport| r.tenants.iter().map(|t| t.stats.output_tokens).sum::<u64>();
    let (td, tp) = (total(&drr), total(&prot));
    eprintln!(
        "c: output tokens drr {td}, drr+protect {tp} ({:+.1} %); {} capped steps, {} released",
        100.0 * (tp as f64 / td as f64 - 1.0),
        prot.protect_stats.capped_steps,
        prot.protect_stats.released_steps
    );
    assert!(tp as f64 >= 0.95 * td as f64, "drr {td} drr+protect {tp}");
    assert!(prot.tenants.iter().all(|t| t.stats.completed > 0 || t.stats.submitted == 0));
}

#[test]
fn same_seed_same_result() {
    let a = sim(ScenarioId::A, Policy::Drr, 10.0, |_| {});
    let b = sim(ScenarioId::A, Policy::Drr, 10.0, |_| {});
    for (x, y) in a.tenants.iter().zip(&b.tenants) {
        assert_eq!(x.stats.ttft, y.stats.ttft);
        assert_eq!(x.stats.output_tokens, y.stats.output_tokens);
    }
    assert_eq!(a.steps, b.steps);
}
