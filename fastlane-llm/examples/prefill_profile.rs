//! Times one prefill of random:small split into its phases (a quick look).
use std::time::Instant;

use fastlane_kvswap::BlockId;
use fastlane_llm::kv::KvPool;
use fastlane_llm::{BatchItem, Model, Scratch, TOKENS_PER_BLOCK};

fn main() {
    let name = std::env::args().nth(1).unwrap_or_else(|| "random:small".into());
    let n: usize = std::env::args().nth(2).and_then(|s| s.parse().ok()).unwrap_or(512);
    let m = Model::load(&name, 1).unwrap();
    let blocks: Vec<BlockId> = (0..n.div_ceil(TOKENS_PER_BLOCK) as u32).map(BlockId).collect();
    let pool = KvPool::new(&m.kv_geometry(), blocks.len() as u32).unwrap();
    let ids: Vec<u32> = (0..n as u32).map(|i| 65 + i % 26).collect();
    let mut s = Scratch::default();
    for _ in 0..3 {
        let item = [BatchItem { tokens: &ids, start_pos: 0, blocks: &blocks, want_logits: true }];
        let t0 = Instant::now();
        m.forward(&item, &pool, &mut s).unwrap();
        let dt = t0.elapsed().as_secs_f64();
        println!("{n} tokens: {:.1} ms, {:.0} tokens/s", dt * 1e3, n as f64 / dt);
    }
}
