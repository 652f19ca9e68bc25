//! Guest-side driver of the engine's remote-tier test (fastlane-llm/tests/remote_guest.rs):
//! runs inside a soft-RoCE QEMU guest (fastlane-llm/tests/vm/guest-llm.sh).
//!
//! - `pool-server ADDR BYTES`: a `fastlane_rdma::PoolServer` (prints `READY`).
//! - `client ADDR`: a small random model; 12 greedy requests, each alone on an ample pool,
//!   then all at once on a pool so small that they are preempted by swap into the remote
//!   tier (no host tier; more swaps forced at random step boundaries): same token ids and
//!   logits, and the swaps really went through the pool.
//!
//! Output: `CHECK name ok|FAIL detail` lines; exit status 1 when any check failed.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fastlane_kvswap::{RemoteTierConfig, SpillPolicy};
use fastlane_llm::weights::RandomWeights;
use fastlane_llm::{Engine, EngineConfig, GenRequest, Model, PreemptChoice, RandomPreset};

use fastlane_guest_tests::driver::{check, remote_main, R};

const WAIT: Duration = Duration::from_secs(600);

/// A model small enough for an emulated CPU: 2 layers, hidden 64.
fn model() -> R<Arc<Model>> {
    let mut cfg = RandomPreset::Tiny.config();
    cfg.hidden_size = 64;
    cfg.intermediate_size = 128;
    cfg.num_hidden_layers = 2;
    cfg.num_attention_heads = 4;
    cfg.num_key_value_heads = Some(2);
    let w = RandomWeights::new(cfg.clone(), 5);
    Model::from_source(cfg, &w, "random:micro".into(), true)
        .map(Arc::new)
        .map_err(|e| e.to_string())
}

fn requests(m: &Model) -> R<Vec<GenRequest>> {
    (0..12)
        .map(|i| {
            let text: String =
                (0..10 + i * 2).map(|j| (b'a' + ((i * 3 + j) % 26) as u8) as char).collect();
            let mut r =
                GenRequest::greedy(m.tokenizer().encode(&text).map_err(|e| e.to_string())?, 40);
            r.digest_logits = true;
            Ok(r)
        })
        .collect()
}

fn client(addr: SocketAddr) -> R<()> {
    let m = model()?;
    let t0 = Instant::now();
    let solo =
        Engine::start(m.clone(), EngineConfig { device_blocks: 64, ..EngineConfig::default() })
            .map_err(|e| e.to_string())?;
    let mut want = Vec::new();
    for r in requests(&m)? {
        let f = solo.submit(r).map_err(|e| e.to_string())?.wait(WAIT).map_err(|e| e.to_string())?;
        want.push((f.token_ids, f.logits_digest));
    }
    solo.shutdown().map_err(|e| e.to_string())?;
    check(
        "llm-solo",
        want.iter().all(|w| w.0.len() == 40),
        format!("12 requests alone in {:?}", t0.elapsed()),
    )?;
    // A pool too small for the sequences' growth (decodes preempt), and swaps forced at random
    // step boundaries on top.
    let mut cfg = EngineConfig {
        device_blocks: 10,
        preempt: PreemptChoice::Swap,
        chaos: Some((0.2, 1)),
        ..EngineConfig::default()
    };
    cfg.swap.host_bytes = 0;
    cfg.swap.spill = SpillPolicy::RemoteOnly;
    cfg.swap.remote = Some(RemoteTierConfig {
        device: std::env::var("RDMA_DEV").unwrap_or_else(|_| "rxe0".into()),
        addr,
        bytes: 4 << 20,
    });
    let e = Engine::start(m.clone(), cfg).map_err(|e| e.to_string())?;
    check(
        "llm-remote-connect",
        true,
        format!("engine up with the remote tier only, kernels {}", fastlane_llm::kernels::isa()),
    )?;
    let streams: Vec<_> = requests(&m)?
        .into_iter()
        .map(|r| e.submit(r))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let mut same = 0;
    for (s, w) in streams.iter().zip(&want) {
        let f = s.wait(WAIT).map_err(|e| e.to_string())?;
        if f.token_ids == w.0 && f.logits_digest == w.1 {
            same += 1;
        } else {
            let at = f.token_ids.iter().zip(&w.0).position(|(a, b)| a != b);
            println!(
                "DIFF request {}: {:?} {:?}, {} tokens (solo {}), first different token at {at:?}, digests equal: {}, preempted {}",
                s.id,
                f.reason,
                f.text,
                f.token_ids.len(),
                w.0.len(),
                f.logits_digest == w.1,
                f.preemptions
            );
        }
    }
    let c = e.shutdown().map_err(|e| e.to_string())?;
    check(
        "llm-remote-swapped",
        c.preempt_swap > 0
            && c.swap_in_bytes > 0
            && c.swap_out_bytes_by_tier[2] == c.swap_out_bytes,
        format!("{} swaps, {} B out, {} B in", c.preempt_swap, c.swap_out_bytes, c.swap_in_bytes),
    )?;
    check(
        "llm-remote-invisible",
        same == 12,
        format!("{same}/12 requests identical to their solo run"),
    )?;
    check(
        "llm-remote-blocks",
        c.blocks_free == c.blocks_total,
        format!("{}/{} free", c.blocks_free, c.blocks_total),
    )
}

fn main() -> ExitCode {
    remote_main("fastlane-llm-remote-check", client)
}
