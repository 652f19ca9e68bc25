//! Batch invariance across instruction sets: KV blocks travel between machines (the cluster
//! tier), and the kernel dispatcher may pick another code path on another machine, so the bits
//! a block holds must not depend on the path, or else the block key must name the path.
//!
//! Measured on an AVX-512 CPU (scalar, AVX2+FMA and AVX-512 all available): the bits are the
//! same on every path (every kernel accumulates with one FMA per term in a fixed order), so the
//! block key does not name the path and machines share blocks whatever their ISA. This test
//! keeps that true: it compares the KV block bytes, the token ids and the bits of every sampled
//! logits row, and the matmul, dot, RMSNorm and SiLU outputs on shapes with edge panels and a
//! K remainder, across every instruction set this CPU offers.
//!
//! `kernels::isa()` is chosen once per process, so each instruction set runs in a child
//! process (this test binary again, `FASTLANE_LLM_ISA=…`, only the child test) that prints what
//! it computed; the parent compares the children.

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use fastlane_kvswap::BlockId;
use fastlane_llm::engine::{block_digest, PrefixConfig};
use fastlane_llm::kernels::{self, PackedMatrix};
use fastlane_llm::kv::KvPool;
use fastlane_llm::{BatchItem, Engine, EngineConfig, FinishReason, GenRequest, Model, Scratch};

/// Set in the child's environment: compute and print the report.
const CHILD_ENV: &str = "FASTLANE_ISA_TEST_CHILD";
const REPORT: &str = "isa-report ";
const MAX_TOKENS: u32 = 16;

/// What one process computed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Report {
    /// `kernels::isa()` as the child saw it.
    isa: String,
    /// The digest block keys start from.
    block_digest: String,
    /// FNV-1a of the bytes of every full KV block of a batched prefill.
    kv_blocks: u64,
    /// FNV-1a of the bits of the kernels' outputs on awkward shapes.
    kernels: u64,
    /// Per prompt: token ids and the digest of every sampled logits row.
    outputs: Vec<(Vec<u32>, u64)>,
}

impl Report {
    fn parse(stdout: &str) -> Report {
        let line = stdout
            .lines()
            .find_map(|l| l.split_once(REPORT).map(|(_, r)| r))
            .unwrap_or_else(|| panic!("the child prints its report, got:\n{stdout}"));
        let mut parts = line.split(' ');
        let mut next = |what: &str| {
            parts.next().unwrap_or_else(|| panic!("report without {what}: {line}")).to_string()
        };
        let hex = |v: String| u64::from_str_radix(&v, 16).expect("a hex digest");
        let isa = next("isa");
        let block_digest = next("block digest");
        let kv_blocks = hex(next("kv blocks"));
        let kernels = hex(next("kernels"));
        let outputs = next("outputs")
            .split(';')
            .map(|o| {
                let (ids, digest) = o.split_once('/').expect("ids/digest");
                let ids = ids.split(',').map(|t| t.parse().expect("token id")).collect();
                (ids, hex(digest.to_string()))
            })
            .collect();
        Report { isa, block_digest, kv_blocks, kernels, outputs }
    }
}

/// FNV-1a, folded over `bytes`.
fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    h
}

const FNV_START: u64 = 0xcbf2_9ce4_8422_2325;

fn fnv_f32(h: u64, v: &[f32]) -> u64 {
    v.iter().fold(h, |h, x| fnv(h, &x.to_bits().to_le_bytes()))
}

/// The instruction sets this CPU can run, as `FASTLANE_LLM_ISA` names them and as
/// `kernels::Isa` prints them.
fn available() -> Vec<(&'static str, &'static str)> {
    let mut v = vec![("scalar", "scalar")];
    #[cfg(target_arch = "x86_64")]
    {
        let fma = std::arch::is_x86_feature_detected!("fma");
        if fma && std::arch::is_x86_feature_detected!("avx2") {
            v.push(("avx2", "avx2+fma"));
        }
        if fma && std::arch::is_x86_feature_detected!("avx512f") {
            v.push(("avx512", "avx512"));
        }
    }
    v
}

/// Runs the child under `isa` and parses its report.
fn run_child(isa: &str) -> Report {
    let exe = std::env::current_exe().expect("the test binary");
    let out = Command::new(exe)
        .args(["--exact", "child_computes_under_its_isa", "--nocapture", "--test-threads", "1"])
        .env(CHILD_ENV, "1")
        .env("FASTLANE_LLM_ISA", isa)
        .output()
        .expect("run the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child under {isa} failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Report::parse(&stdout)
}

/// Prompts of different lengths (full blocks and partial ones) submitted together, so the
/// prefill runs several rows per matmul and the decodes batch.
fn prompts(vocab: u32) -> Vec<Vec<u32>> {
    [40u32, 70, 17, 33]
        .iter()
        .enumerate()
        .map(|(j, &n)| {
            let salt = j as u32 * 977 + 3;
            (0..n).map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(salt) % vocab).collect()
        })
        .collect()
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            let x = i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503);
            (x % 2000) as f32 / 1000.0 - 1.0
        })
        .collect()
}

/// The kernels on shapes random:tiny does not reach: 100 outputs (an edge panel of 4), 300
/// inputs (a K-block and a remainder), 1 to 17 rows (the decode path, the 8-row micro-kernel
/// and its edges), and the lane code on lengths that are not multiples of 16.
fn kernel_digest() -> u64 {
    let (n, k) = (100, 300);
    let w = PackedMatrix::pack(&values(n * k, 1), n, k);
    let mut h = FNV_START;
    for m in [1, 2, 3, 8, 9, 17] {
        let x = values(m * k, m as u32 + 10);
        let mut y = vec![0.0f32; m * n];
        kernels::matmul(&x, m, &w, &mut y);
        h = fnv_f32(h, &y);
    }
    for len in [1, 15, 37, 300] {
        let (a, b) = (values(len, 2), values(len, 3));
        h = fnv_f32(h, &[kernels::dot(&a, &b)]);
        let mut out = values(len, 4);
        kernels::axpy(&mut out, 0.37, &a);
        h = fnv_f32(h, &out);
    }
    let (rows, width) = (3, 100);
    let mut out = vec![0.0f32; rows * width];
    kernels::rms_norm(&values(rows * width, 5), &values(width, 6), 1e-5, rows, &mut out);
    h = fnv_f32(h, &out);
    let inter = 37;
    let mut out = vec![0.0f32; rows * inter];
    kernels::silu_mul(&values(rows * 2 * inter, 7), rows, inter, &mut out);
    fnv_f32(h, &out)
}

/// One batched prefill of two prompts straight through `Model::forward`: the bytes of every
/// full block it wrote (what the prefix cache stores and the cluster tier shares).
fn kv_digest(model: &Model) -> u64 {
    let ps = prompts(model.vocab() as u32);
    let (a, b) = (&ps[0], &ps[1]);
    let pool = KvPool::new(&model.kv_geometry(), 16).expect("a pool");
    let ta: Vec<BlockId> = (0..3).map(BlockId).collect();
    let tb: Vec<BlockId> = (3..8).map(BlockId).collect();
    let items = [
        BatchItem { tokens: a, start_pos: 0, blocks: &ta, want_logits: true },
        BatchItem { tokens: b, start_pos: 0, blocks: &tb, want_logits: true },
    ];
    model.forward(&items, &pool, &mut Scratch::default()).expect("forward");
    let full = ta[..a.len() / 16].iter().chain(&tb[..b.len() / 16]);
    full.fold(FNV_START, |h, &blk| fnv(h, pool.block_bytes_of(blk)))
}

/// The child: does nothing unless [`CHILD_ENV`] is set (the parent sets it).
#[test]
fn child_computes_under_its_isa() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let model = Arc::new(Model::load("random:tiny", 7).expect("random:tiny loads"));
    let cfg = EngineConfig {
        device_blocks: 128,
        prefix: PrefixConfig { enabled: false, ..PrefixConfig::default() },
        ..EngineConfig::default()
    };
    let e = Engine::start(model.clone(), cfg).expect("engine starts");
    let streams: Vec<_> = prompts(model.vocab() as u32)
        .into_iter()
        .map(|p| {
            let mut r = GenRequest::greedy(p, MAX_TOKENS);
            r.digest_logits = true;
            e.submit(r).expect("submit")
        })
        .collect();
    let mut outputs = Vec::new();
    for s in streams {
        let f = s.wait(Duration::from_secs(120)).expect("finishes");
        assert_eq!(f.reason, FinishReason::Length);
        let ids: Vec<String> = f.token_ids.iter().map(u32::to_string).collect();
        outputs.push(format!("{}/{:016x}", ids.join(","), f.logits_digest.expect("digested")));
    }
    e.shutdown().expect("clean shutdown");
    // On a line of its own: libtest has printed the test's name without a newline.
    println!(
        "\n{REPORT}{} {} {:016x} {:016x} {}",
        kernels::isa(),
        block_digest(&model),
        kv_digest(&model),
        kernel_digest(),
        outputs.join(";")
    );
}

#[test]
fn every_instruction_set_computes_the_same_bits_and_keys() {
    let isas = available();
    let mut reports = Vec::new();
    for &(env, shown) in &isas {
        let r = run_child(env);
        assert_eq!(r.isa, shown, "FASTLANE_LLM_ISA={env} is honoured");
        assert_eq!(r.outputs.len(), prompts(512).len());
        assert!(r.outputs.iter().all(|o| o.0.len() == MAX_TOKENS as usize), "{r:?}");
        reports.push(r);
    }
    // The same instruction set twice: the same bits and the same block-key digest.
    assert_eq!(run_child(isas[0].0), reports[0], "{} twice", isas[0].0);
    if isas.len() == 1 {
        eprintln!("only {} on this CPU: nothing to compare across instruction sets", isas[0].0);
    }
    // Across instruction sets: the same bits, so one block-key digest (blocks are shared).
    for (r, (env, _)) in reports.iter().zip(&isas).skip(1) {
        let (base, base_env) = (&reports[0], isas[0].0);
        assert_eq!(r.kernels, base.kernels, "kernel outputs, {env} vs {base_env}");
        assert_eq!(r.kv_blocks, base.kv_blocks, "KV block bytes, {env} vs {base_env}");
        for (i, (a, b)) in r.outputs.iter().zip(&base.outputs).enumerate() {
            assert_eq!(a.0, b.0, "prompt {i}: token ids, {env} vs {base_env}");
            assert_eq!(a.1, b.1, "prompt {i}: logits bits, {env} vs {base_env}");
        }
        assert_eq!(r.block_digest, base.block_digest, "block keys, {env} vs {base_env}");
    }
}
