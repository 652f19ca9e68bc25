//! Choosing the next token from logits: greedy, or sampled with temperature, top-k and
//! top-p from a per-request seeded generator (advanced once per generated token, so a
//! preempted sequence draws the same numbers after it resumes).

use rand::{Rng, SeedableRng};

use crate::error::LlmError;

/// How a request picks its tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0: greedy (argmax, lowest id on ties).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches `top_p` (1: all).
    pub top_p: f32,
    /// Seed of the request's generator.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0 }
    }
}

impl SamplingParams {
    /// Checks the ranges (errors name the field).
    pub fn validate(&self) -> Result<(), LlmError> {
        let bad = |reason: String| Err(LlmError::BadRequest { reason });
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad(format!("temperature {} must be ≥ 0", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p {} must be in (0, 1]", self.top_p));
        }
        Ok(())
    }
}

/// A request's sampler.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: rand_chacha::ChaCha8Rng,
    idx: Vec<usize>,
}

impl Sampler {
    /// A sampler for `params`.
    pub fn new(params: SamplingParams) -> Sampler {
        Sampler {
            params,
            rng: rand_chacha::ChaCha8Rng::seed_from_u64(params.seed),
            idx: Vec::new(),
        }
    }

    /// The next token from one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = self.params;
        if p.temperature == 0.0 {
            return argmax(logits);
        }
        // One draw per token whatever the path below, so the stream stays aligned.
        let u: f32 = self.rng.random();
        self.idx.clear();
        self.idx.extend(0..logits.len());
        let by_logit = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
        let k = if p.top_k == 0 { logits.len() } else { p.top_k.min(logits.len()) };
        if k < logits.len() {
            self.idx.select_nth_unstable_by(k - 1, by_logit);
            self.idx.truncate(k);
        }
        self.idx.sort_unstable_by(by_logit);
        let max = logits[self.idx[0]];
        let mut probs: Vec<f32> =
            self.idx.iter().map(|&i| ((logits[i] - max) / p.temperature).exp()).collect();
        let total: f32 = probs.iter().sum();
        let mut keep = probs.len();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, q) in probs.iter().enumerate() {
                acc += q / total;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        probs.truncate(keep);
        let kept: f32 = probs.iter().sum();
        let mut target = u * kept;
        for (i, q) in probs.iter().enumerate() {
            if target < *q {
                return self.idx[i] as u32;
            }
            target -= q;
        }
        self.idx[keep - 1] as u32
    }
}

/// Index of the largest logit, the lowest on ties.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_max_and_sampling_respects_top_k_and_seed() {
        let logits = [0.1, 3.0, 2.9, -1.0, 3.0];
        assert_eq!(argmax(&logits), 1);
        let p = SamplingParams { temperature: 1.0, top_k: 2, top_p: 1.0, seed: 7 };
        let mut a = Sampler::new(p);
        let mut b = Sampler::new(p);
        for _ in 0..50 {
            let t = a.sample(&logits);
            assert!(t == 1 || t == 4, "top-2 are ids 1 and 4, got {t}");
            assert_eq!(t, b.sample(&logits), "same seed, same draws");
        }
        let narrow = SamplingParams { temperature: 1.0, top_k: 0, top_p: 0.01, seed: 1 };
        let mut s = Sampler::new(narrow);
        assert_eq!(s.sample(&logits), 1, "top_p that small keeps the first best only");
        assert!(SamplingParams { temperature: -1.0, ..p }.validate().is_err());
        assert!(SamplingParams { top_p: 0.0, ..p }.validate().is_err());
    }
}
