//! Choosing the next token from logits: greedy, or sampled with temperature, top-k and
//! top-p from a per-request seeded generator (advanced once per generated token, so a
//! preempted sequence draws the same numbers after it resumes); OpenAI's presence and
//! frequency penalties from the counts of the sequence's own generated tokens; and, when
//! asked, the log-probabilities of the chosen token and of the most likely alternatives.
//!
//! Everything a sampler keeps is derived from its own sequence (its seed, the tokens it has
//! generated), never from the batch: output stays batch-invariant.

use std::collections::HashMap;

use rand::{Rng, SeedableRng};

use crate::error::LlmError;

/// The most alternatives a token's log-probabilities list (OpenAI's chat cap).
pub const TOP_LOGPROBS_MAX: u8 = 20;

/// The penalties' range (OpenAI's).
pub const PENALTY_ABS_MAX: f32 = 2.0;

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
    /// Subtracted from the logit of every token generated at least once (OpenAI's
    /// `presence_penalty`, -2 to 2).
    pub presence_penalty: f32,
    /// Times the count of a token generated so far is subtracted from its logit (OpenAI's
    /// `frequency_penalty`, -2 to 2).
    pub frequency_penalty: f32,
    /// `Some(n)`: each token comes with its log-probability and the `n` most likely
    /// alternatives' (at most [`TOP_LOGPROBS_MAX`]).
    pub logprobs: Option<u8>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logprobs: None,
        }
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
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-PENALTY_ABS_MAX..=PENALTY_ABS_MAX).contains(&v) {
                return bad(format!("{name} {v} must be in [-2, 2]"));
            }
        }
        if self.logprobs.is_some_and(|n| n > TOP_LOGPROBS_MAX) {
            return bad(format!("top_logprobs: at most {TOP_LOGPROBS_MAX}"));
        }
        Ok(())
    }

    fn penalized(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
}

/// Log-probabilities of one generated token: log-softmax of the logits after the penalties
/// and before temperature, top-k and top-p (the model's distribution, as OpenAI reports it).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The chosen token's.
    pub logprob: f32,
    /// The most likely tokens and theirs, most likely first (lowest id on ties).
    pub top: Vec<(u32, f32)>,
}

/// A sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    /// Its id.
    pub token: u32,
    /// Its log-probabilities, when the request asked for them.
    pub logprobs: Option<TokenLogprobs>,
}

/// A request's sampler.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: rand_chacha::ChaCha8Rng,
    idx: Vec<usize>,
    /// Times each generated token was generated (penalties only; sized at creation for
    /// `max_tokens` distinct tokens, so it never grows on the data path).
    counts: HashMap<u32, u32>,
}

impl Sampler {
    /// A sampler for `params`, for a request of at most `max_tokens` tokens.
    pub fn new(params: SamplingParams, max_tokens: usize) -> Sampler {
        let counts =
            if params.penalized() { HashMap::with_capacity(max_tokens) } else { HashMap::new() };
        Sampler {
            params,
            rng: rand_chacha::ChaCha8Rng::seed_from_u64(params.seed),
            idx: Vec::new(),
            counts,
        }
    }

    /// Records a token the sequence generated (the engine calls it once per token it
    /// appends to the sequence, so the counts are those of the sequence's own tokens).
    pub fn observe(&mut self, token: u32) {
        if self.params.penalized() {
            *self.counts.entry(token).or_insert(0) += 1;
        }
    }

    /// The next token from one row of logits (the penalties are applied to `logits` in
    /// place).
    pub fn sample(&mut self, logits: &mut [f32]) -> Sampled {
        let p = self.params;
        if p.penalized() {
            // Each counted token's logit is touched once: the map's order does not matter.
            for (&t, &c) in &self.counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= p.presence_penalty + p.frequency_penalty * c as f32;
                }
            }
        }
        let token = self.pick(logits);
        let logprobs = p.logprobs.map(|n| logprobs_of(logits, token, n));
        Sampled { token, logprobs }
    }

    fn pick(&mut self, logits: &[f32]) -> u32 {
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

/// Log-softmax of `logits` at `token`, and the `n` most likely tokens' (one pass for the
/// normalizer in index order, one for the top `n` kept in a fixed array: O(vocab × n) with
/// `n` ≤ [`TOP_LOGPROBS_MAX`], no allocation but the result's).
pub fn logprobs_of(logits: &[f32], token: u32, n: u8) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = logits.iter().map(|l| (l - max).exp()).sum();
    let lse = max + sum.ln();
    let n = usize::from(n.min(TOP_LOGPROBS_MAX)).min(logits.len());
    // `best[..len]`: the most likely so far, sorted by logit descending, lower id first.
    let mut best = [(0u32, f32::NEG_INFINITY); TOP_LOGPROBS_MAX as usize];
    let mut len = 0;
    if n > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if len == n && l <= best[n - 1].1 {
                continue;
            }
            // Ties keep the earlier (lower) id ahead: insert after every logit ≥ this one.
            let at = best[..len].partition_point(|&(_, b)| b >= l);
            let end = len.min(n - 1);
            best.copy_within(at..end, at + 1);
            best[at] = (i as u32, l);
            len = (len + 1).min(n);
        }
    }
    TokenLogprobs {
        logprob: logits.get(token as usize).map_or(f32::NEG_INFINITY, |l| l - lse),
        top: best[..len].iter().map(|&(t, l)| (t, l - lse)).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_max_and_sampling_respects_top_k_and_seed() {
        let logits = [0.1, 3.0, 2.9, -1.0, 3.0];
        assert_eq!(argmax(&logits), 1);
        let p = SamplingParams { temperature: 1.0, top_k: 2, seed: 7, ..Default::default() };
        let mut a = Sampler::new(p, 50);
        let mut b = Sampler::new(p, 50);
        for _ in 0..50 {
            let t = a.sample(&mut logits.clone()).token;
            assert!(t == 1 || t == 4, "top-2 are ids 1 and 4, got {t}");
            assert_eq!(t, b.sample(&mut logits.clone()).token, "same seed, same draws");
        }
        let narrow =
            SamplingParams { temperature: 1.0, top_p: 0.01, seed: 1, ..Default::default() };
        let mut s = Sampler::new(narrow, 1);
        assert_eq!(
            s.sample(&mut logits.clone()).token,
            1,
            "top_p that small keeps the first best only"
        );
        assert!(SamplingParams { temperature: -1.0, ..p }.validate().is_err());
        assert!(SamplingParams { top_p: 0.0, ..p }.validate().is_err());
    }

    #[test]
    fn logprobs_are_the_log_softmax_and_the_top_n_in_order() {
        let logits = [1.0f32, 3.0, 3.0, -2.0, 0.5];
        let lp = logprobs_of(&logits, 4, 3);
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        let want = |l: f32| (f64::from(l) - z.ln()) as f32;
        assert!((lp.logprob - want(0.5)).abs() < 1e-6, "{lp:?}");
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 2, 0], "most likely first, the lower id first on a tie");
        for (t, l) in &lp.top {
            assert!((l - want(logits[*t as usize])).abs() < 1e-6);
        }
        assert!(logprobs_of(&logits, 1, 0).top.is_empty());
        assert_eq!(logprobs_of(&logits, 1, 20).top.len(), logits.len());
        // Against a full sort, on a bigger row with many ties.
        let row: Vec<f32> = (0..1000u32).map(|i| ((i * 7919) % 97) as f32 * 0.25).collect();
        let mut sorted: Vec<u32> = (0..1000).collect();
        sorted.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
        let top: Vec<u32> = logprobs_of(&row, 0, 20).top.iter().map(|t| t.0).collect();
        assert_eq!(top, sorted[..20]);
        // The sampler reports the logprobs of the token it picked.
        let p = SamplingParams { logprobs: Some(2), ..Default::default() };
        let s = Sampler::new(p, 1).sample(&mut logits.to_vec());
        assert_eq!((s.token, s.logprobs.unwrap().top.len()), (1, 2));
    }

    #[test]
    fn penalties_stop_a_greedy_loop_from_repeating() {
        // A fixed "model": the next token's logits depend only on the previous token, and
        // greedy decoding without penalty cycles through a few tokens.
        let vocab = 64usize;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let table: Vec<f32> = (0..vocab * vocab).map(|_| rng.random::<f32>() * 4.0).collect();
        let run = |params: SamplingParams| {
            let mut s = Sampler::new(params, 40);
            let mut out = vec![0u32];
            for _ in 0..40 {
                let prev = *out.last().unwrap() as usize;
                let mut row = table[prev * vocab..(prev + 1) * vocab].to_vec();
                let t = s.sample(&mut row).token;
                s.observe(t);
                out.push(t);
            }
            out.remove(0);
            out
        };
        let distinct = |v: &[u32]| v.iter().collect::<std::collections::HashSet<_>>().len();
        let plain = run(SamplingParams::default());
        assert!(distinct(&plain) < plain.len(), "greedy without penalty repeats: {plain:?}");
        let pres =
            SamplingParams { presence_penalty: 2.0, frequency_penalty: 2.0, ..Default::default() };
        // Logits lie in [0, 4); a penalty of 4 or more pushes a used token below every unused
        // one, so no token repeats within the first `vocab` tokens.
        let strong = run(pres);
        assert_eq!(distinct(&strong), strong.len(), "penalized greedy never repeats: {strong:?}");
        assert_eq!(strong, run(pres), "deterministic");
        assert_eq!(plain[0], strong[0], "the first token has nothing to penalize");
        // Penalties only of 0 leave the sampler on the plain path: the same tokens.
        let zero = SamplingParams { presence_penalty: 0.0, ..Default::default() };
        assert_eq!(run(zero), plain);
        // A negative penalty favours repeats.
        let neg = SamplingParams { frequency_penalty: -2.0, ..Default::default() };
        assert!(distinct(&run(neg)) <= distinct(&plain));
        assert!(SamplingParams { presence_penalty: 2.5, ..pres }.validate().is_err());
        assert!(SamplingParams { frequency_penalty: f32::NAN, ..pres }.validate().is_err());
        assert!(SamplingParams { logprobs: Some(21), ..pres }.validate().is_err());
        assert!(pres.validate().is_ok());
    }
}
