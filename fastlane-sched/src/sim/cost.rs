//! Step-time model of Llama-3.1-8B (bf16) on one NVIDIA A100-SXM4-40GB.
//!
//! A step reads the weights once and the KV of every sequence in the batch, and does
//! `2 × params` FLOPs per token plus attention. Its time is the larger of the memory time
//! and the compute time (a roofline), each at a measured efficiency:
//!
//! ```text
//! mem_ns     = (weight_bytes + kv_tokens_read × kv_bytes_per_token) / (hbm_bytes_per_s × hbm_efficiency)
//! compute_ns = (batch_tokens × flops_per_token + attention_pairs × attn_flops_per_pair)
//!              / (flops_peak × mfu_prefill)
//! step_ns    = step_overhead_ns + max(mem_ns, compute_ns)
//! ```
//!
//! Where every constant comes from is in `docs/scheduler.md` ("Cost model"); the short form
//! is on each field of [`CostModel::a100_40gb_llama31_8b`].

use crate::{PreemptCosts, StepKind, StepPlan, BLOCK_TOKENS};

/// The engine cost model. All rates in bytes/s and FLOP/s; times in ns.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// Weight bytes read per step.
    pub weight_bytes: f64,
    /// HBM bandwidth (datasheet).
    pub hbm_bytes_per_s: f64,
    /// Achieved fraction of HBM bandwidth in decode.
    pub hbm_efficiency: f64,
    /// Dense bf16 tensor-core peak (datasheet).
    pub flops_peak: f64,
    /// Achieved fraction of peak in prefill.
    pub mfu_prefill: f64,
    /// Linear-layer FLOPs per token (2 × parameters).
    pub flops_per_token: f64,
    /// Attention FLOPs per (query token, context token) pair: 4 × layers × hidden.
    pub attn_flops_per_pair: f64,
    /// KV bytes per token (2 × layers × kv_heads × head_dim × 2 bytes).
    pub kv_bytes_per_token: u64,
    /// Fixed per-step cost beyond the roofline.
    pub step_overhead_ns: f64,
    /// GPU memory, bytes.
    pub gpu_bytes: f64,
    /// vLLM's `gpu_memory_utilization`.
    pub gpu_memory_utilization: f64,
    /// Activation / workspace reserve at the profiled peak, bytes.
    pub activation_reserve_bytes: f64,
}

impl CostModel {
    /// Llama-3.1-8B bf16 on one A100-SXM4-40GB (sources in `docs/scheduler.md`).
    pub fn a100_40gb_llama31_8b() -> Self {
        Self {
            // 8.03e9 parameters (Meta's model card) × 2 bytes.
            weight_bytes: 16.06e9,
            // NVIDIA A100 datasheet, 40 GB SXM: 1,555 GB/s.
            hbm_bytes_per_s: 1.555e12,
            // vLLM on an A100-40GB, Llama-3.1-8B bf16, one request: ~75 tok/s, "roughly 77 % of
            // the memory-bandwidth ceiling" (johnmusgrave.com, vLLM throughput-latency sweep).
            hbm_efficiency: 0.77,
            // NVIDIA A100 datasheet: 312 TFLOPS dense BF16.
            flops_peak: 312e12,
            // Assumption (see docs): prefill at 55 % MFU, within the 50–60 % that large-batch
            // GEMMs reach on A100; gives ~95 ms for a 1,024-token prefill.
            mfu_prefill: 0.55,
            flops_per_token: 2.0 * 8.03e9,
            // 4 × 32 layers × 4,096 hidden (QKᵀ and AV, 2 FLOPs per MAC).
            attn_flops_per_pair: 4.0 * 32.0 * 4096.0,
            // 2 × 32 layers × 8 KV heads × 128 dims × 2 bytes = 128 KiB.
            kv_bytes_per_token: 131_072,
            step_overhead_ns: 0.0,
            gpu_bytes: 40.0 * 1024.0 * 1024.0 * 1024.0,
            // vLLM's default.
            gpu_memory_utilization: 0.9,
            // Assumption: activation peak of a 2,048-token step plus CUDA graphs.
            activation_reserve_bytes: 2.0e9,
        }
    }

    /// Bytes of one 16-token KV block.
    pub fn block_bytes(&self) -> u64 {
        self.kv_bytes_per_token * u64::from(BLOCK_TOKENS)
    }

    /// KV blocks that fit: `utilization × memory − weights − activation reserve`.
    pub fn kv_blocks(&self) -> u32 {
        let free = self.gpu_bytes * self.gpu_memory_utilization
            - self.weight_bytes
            - self.activation_reserve_bytes;
        (free.max(0.0) / self.block_bytes() as f64) as u32
    }

    /// GPU time to prefill one token (linear layers only; what recomputation costs).
    pub fn prefill_ns_per_token(&self) -> f64 {
        self.flops_per_token / (self.flops_peak * self.mfu_prefill) * 1e9
    }

    /// Time of a step running `plan`.
    pub fn step_ns(&self, plan: &StepPlan) -> u64 {
        let mut kv_tokens_read = 0f64;
        let mut pairs = 0f64;
        for item in &plan.items {
            let ctx = f64::from(item.context_tokens);
            match item.kind {
                StepKind::Decode => {
                    kv_tokens_read += ctx + 1.0;
                    pairs += ctx + 1.0;
                }
                StepKind::Prefill { tokens } => {
                    let n = f64::from(tokens);
                    kv_tokens_read += ctx + n;
                    // Causal: query i sees ctx + i keys.
                    pairs += n * ctx + n * (n + 1.0) / 2.0;
                }
            }
        }
        let tokens = f64::from(plan.prefill_tokens + plan.decode_tokens);
        let mem_s = (self.weight_bytes + kv_tokens_read * self.kv_bytes_per_token as f64)
            / (self.hbm_bytes_per_s * self.hbm_efficiency);
        let compute_s = (tokens * self.flops_per_token + pairs * self.attn_flops_per_pair)
            / (self.flops_peak * self.mfu_prefill);
        (self.step_overhead_ns + mem_s.max(compute_s) * 1e9).round() as u64
    }

    /// The scheduler's swap-or-recompute numbers, given the swap cost per byte.
    pub fn preempt_costs(&self, swap_ns_per_byte: f64, swap_fixed_ns: u64) -> PreemptCosts {
        PreemptCosts {
            prefill_ns_per_token: self.prefill_ns_per_token(),
            swap_ns_per_byte,
            swap_fixed_ns,
            kv_bytes_per_token: self.kv_bytes_per_token,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{SeqId, StepItem};

    fn plan(items: &[(StepKind, u32)]) -> StepPlan {
        let mut p = StepPlan::default();
        for (i, &(kind, ctx)) in items.iter().enumerate() {
            p.items.push(StepItem { seq: SeqId(i as u64), tenant: 0, kind, context_tokens: ctx });
            match kind {
                StepKind::Decode => p.decode_tokens += 1,
                StepKind::Prefill { tokens } => p.prefill_tokens += tokens,
            }
        }
        p
    }

    #[test]
    fn matches_the_published_points() {
        let m = CostModel::a100_40gb_llama31_8b();
        // One decode at short context: ~13.3 ms (75 tok/s).
        let d1 = m.step_ns(&plan(&[(StepKind::Decode, 1100)])) as f64 / 1e6;
        assert!((12.5..14.5).contains(&d1), "{d1} ms");
        // Batch 8 decodes barely cost more (memory bound).
        let d8 = m.step_ns(&plan(&[(StepKind::Decode, 1100); 8])) as f64 / 1e6;
        assert!(d8 < 1.15 * d1, "{d8} vs {d1}");
        // A 4,000-token prefill stalls for ~0.4 s; a 512 chunk for ~50 ms.
        let p4k = m.step_ns(&plan(&[(StepKind::Prefill { tokens: 4000 }, 0)])) as f64 / 1e6;
        let p512 = m.step_ns(&plan(&[(StepKind::Prefill { tokens: 512 }, 0)])) as f64 / 1e6;
        assert!((300.0..450.0).contains(&p4k), "{p4k} ms");
        assert!((40.0..60.0).contains(&p512), "{p512} ms");
        assert!((9000..10500).contains(&m.kv_blocks()), "{}", m.kv_blocks());
    }
}
