//! The Llama-architecture decoder: RMSNorm, rotary embeddings, grouped-query attention over
//! the paged KV pool, SwiGLU MLP. One forward pass runs a whole step: decode tokens and
//! prefill chunks of different sequences as rows of one batch.

use std::cell::RefCell;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use fastlane_kvswap::{BlockId, DType, KvGeometry};
use rayon::prelude::*;

use crate::config::LlamaConfig;
use crate::error::LlmError;
use crate::kernels::{self, matmul, rms_norm, silu_mul, PackedMatrix, Rope};
use crate::kv::KvPool;
use crate::tokenizer::Tokenizer;
use crate::weights::{
    tensor_shapes, LayerTensor, RandomPreset, RandomWeights, SafetensorsDir, TensorSource, EMBED,
    FINAL_NORM, LM_HEAD,
};

/// Tokens per KV block (the scheduler's block size).
pub const TOKENS_PER_BLOCK: usize = fastlane_sched::BLOCK_TOKENS as usize;

struct Layer {
    attn_norm: Vec<f32>,
    /// Q | K | V stacked.
    qkv: PackedMatrix,
    o: PackedMatrix,
    mlp_norm: Vec<f32>,
    /// gate | up stacked.
    gate_up: PackedMatrix,
    down: PackedMatrix,
}

impl Layer {
    /// This layer's first half (number `li`) over every row of the batch, in place on `s.x`:
    /// attention (norm, QKV, RoPE, K and V into the pool, causal attention, output
    /// projection, residual). [`Layer::mlp`] is the second half.
    fn attention(
        &self,
        m: &Model,
        li: usize,
        items: &[BatchItem<'_>],
        pool: &KvPool,
        s: &mut Scratch,
        abort: &AbortCheck<'_>,
    ) -> bool {
        let (layer, cfg) = (self, &m.cfg);
        let (hd, nh, nkv) = (cfg.head_dim(), cfg.num_attention_heads, cfg.kv_heads());
        let h = cfg.hidden_size;
        let qkv_w = (nh + 2 * nkv) * hd;
        let t = s.rows_item.len();
        rms_norm(&s.x, &layer.attn_norm, cfg.rms_norm_eps as f32, t, &mut s.h);
        matmul(&s.h, t, &layer.qkv, &mut s.qkv);
        // RoPE on the query and key heads, then K and V into the pool.
        for r in 0..t {
            let pos = s.rows_pos[r];
            let row = &mut s.qkv[r * qkv_w..(r + 1) * qkv_w];
            for head in 0..nh + nkv {
                m.rope.apply(&mut row[head * hd..(head + 1) * hd], pos);
            }
            let it = &items[s.rows_item[r]];
            for kvh in 0..nkv {
                let k = &row[(nh + kvh) * hd..(nh + kvh + 1) * hd];
                let v = &row[(nh + nkv + kvh) * hd..(nh + nkv + kvh + 1) * hd];
                pool.write(it.blocks, li, kvh, pos, k, v);
            }
        }
        if !m.attention(li, items, pool, s, abort) {
            return false;
        }
        matmul(&s.attn, t, &layer.o, &mut s.proj);
        for (x, p) in s.x[..t * h].iter_mut().zip(&s.proj[..t * h]) {
            *x += p;
        }
        true
    }

    /// Layer `li` over every row of the batch, in place on `s.x`: attention, then the MLP.
    /// `abort(2 * li + 1)` is asked by every (row, head) task of the attention (at a long
    /// context a layer's attention alone can take tens of milliseconds on a CPU) and once
    /// more between the two halves; `false`: it said stop, the layer did not finish.
    fn forward(
        &self,
        m: &Model,
        li: usize,
        items: &[BatchItem<'_>],
        pool: &KvPool,
        s: &mut Scratch,
        abort: &AbortCheck<'_>,
    ) -> bool {
        if !self.attention(m, li, items, pool, s, abort) || abort(2 * li + 1) {
            return false;
        }
        self.mlp(m, s);
        true
    }

    /// This layer's second half over every row, in place on `s.x`: the MLP (norm, gate and
    /// up, SiLU, down, residual).
    fn mlp(&self, m: &Model, s: &mut Scratch) {
        let (layer, cfg) = (self, &m.cfg);
        let (h, inter) = (cfg.hidden_size, cfg.intermediate_size);
        let t = s.rows_item.len();
        rms_norm(&s.x, &layer.mlp_norm, cfg.rms_norm_eps as f32, t, &mut s.h);
        matmul(&s.h, t, &layer.gate_up, &mut s.gu);
        silu_mul(&s.gu, t, inter, &mut s.act);
        matmul(&s.act, t, &layer.down, &mut s.proj);
        for (x, p) in s.x[..t * h].iter_mut().zip(&s.proj[..t * h]) {
            *x += p;
        }
    }
}

/// A loaded model.
pub struct Model {
    cfg: LlamaConfig,
    name: String,
    random: bool,
    embed: Vec<f32>,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: PackedMatrix,
    rope: Rope,
    tokenizer: Tokenizer,
    /// BLAKE3 of the config and every tensor as loaded (f32): what pins the K/V it computes.
    digest: [u8; 32],
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("name", &self.name)
            .field("layers", &self.layers.len())
            .finish()
    }
}

/// One sequence's rows in a step.
#[derive(Debug, Clone, Copy)]
pub struct BatchItem<'a> {
    /// Input token ids (a prefill chunk, or the one token of a decode).
    pub tokens: &'a [u32],
    /// Position of the first of them (tokens before it are in the KV cache).
    pub start_pos: usize,
    /// The sequence's block table (covers `start_pos + tokens.len()` positions).
    pub blocks: &'a [BlockId],
    /// Whether the logits of the last row are wanted (a token is sampled from them).
    pub want_logits: bool,
}

/// The check [`Model::forward_abortable`] asks (with the check's number) whether to give
/// the pass up; called from the pool's threads too, so it must be cheap and `Sync`.
pub type AbortCheck<'a> = dyn Fn(usize) -> bool + Sync + 'a;

/// How a [`Model::forward_abortable`] pass ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forward {
    /// Every layer and the output head ran: this many logit rows are in `scratch.logits`.
    Done(usize),
    /// The abort check said stop before layer `layer` ran, or halfway through it. K and V of
    /// the step's rows were written into the pool for layers `0..=layer` at most, and
    /// `scratch.logits` holds nothing
    /// of this pass. Positions the pass wrote are rewritten, bit for bit, when they are
    /// computed again (the kernels are batch-invariant); until then nothing reads them
    /// (attention reads positions a completed step wrote, or its own rows).
    Aborted {
        /// The first layer that did not run.
        layer: usize,
    },
}

/// Reusable buffers of the forward pass (grown to the largest step seen, then reused).
#[derive(Debug, Default)]
pub struct Scratch {
    x: Vec<f32>,
    h: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gu: Vec<f32>,
    act: Vec<f32>,
    rows_item: Vec<usize>,
    rows_pos: Vec<usize>,
    last_rows: Vec<usize>,
    /// Logits of the rows that wanted them, `[rows][vocab]`, in item order.
    pub logits: Vec<f32>,
}

fn grow(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}

/// Where one head's keys and values of one sequence and layer are.
struct KvRef<'a> {
    pool: &'a KvPool,
    blocks: &'a [BlockId],
    layer: usize,
    kv_head: usize,
}

/// One query head's attention over positions `0..=pos`: scores in ascending position,
/// softmax, weighted sum of values in ascending position (a fixed order: batch-invariant).
/// The AVX-512 kernel where it applies, else the lane code (the same bits either way).
fn attend(q: &[f32], kv: &KvRef<'_>, pos: usize, scale: f32, sc: &mut Vec<f32>, out: &mut [f32]) {
    let key = |j| kv.pool.key(kv.blocks, kv.layer, kv.kv_head, j);
    let value = |j| kv.pool.value(kv.blocks, kv.layer, kv.kv_head, j);
    if !kernels::attend_head(q, pos + 1, key, value, scale, sc, out) {
        attend_lanes(q, kv, pos, scale, sc, out);
    }
}

kernels::multiversion! {
    /// [`attend`] in the lane code.
    fn attend_lanes(q: &[f32], kv: &KvRef<'_>, pos: usize, scale: f32, sc: &mut Vec<f32>, out: &mut [f32]) = attend_impl;
}

#[inline(always)]
fn attend_impl(
    q: &[f32],
    kv: &KvRef<'_>,
    pos: usize,
    scale: f32,
    sc: &mut Vec<f32>,
    out: &mut [f32],
) {
    sc.clear();
    let mut max = f32::NEG_INFINITY;
    for j in 0..=pos {
        let v = kernels::dot(q, kv.pool.key(kv.blocks, kv.layer, kv.kv_head, j)) * scale;
        max = max.max(v);
        sc.push(v);
    }
    let mut sum = 0.0f32;
    for v in sc.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    out.fill(0.0);
    for (j, &e) in sc.iter().enumerate() {
        kernels::axpy(out, e, kv.pool.value(kv.blocks, kv.layer, kv.kv_head, j));
    }
    let inv = 1.0 / sum;
    for o in out.iter_mut() {
        *o *= inv;
    }
}

/// Folds one tensor (name, length, f32 bits) into the model digest.
fn hash_tensor(h: &mut blake3::Hasher, name: &str, data: &[f32]) {
    h.update(&(name.len() as u64).to_le_bytes());
    h.update(name.as_bytes());
    h.update(&(data.len() as u64).to_le_bytes());
    let mut buf = [0u8; 4096];
    for chunk in data.chunks(buf.len() / 4) {
        for (dst, v) in buf.chunks_exact_mut(4).zip(chunk) {
            dst.copy_from_slice(&v.to_le_bytes());
        }
        h.update(&buf[..chunk.len() * 4]);
    }
}

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

impl Model {
    /// Loads `random:tiny` / `random:small` (seeded) or a model directory.
    pub fn load(spec: &str, seed: u64) -> Result<Model, LlmError> {
        if let Some(p) = RandomPreset::parse(spec) {
            let w = RandomWeights::new(p.config(), seed);
            return Model::from_source(w.config().clone(), &w, spec.to_string(), true);
        }
        if spec.starts_with("random:") {
            return Err(LlmError::UnknownModel { name: spec.to_string() });
        }
        Model::load_dir(Path::new(spec))
    }

    /// Loads a Hugging Face model directory.
    pub fn load_dir(dir: &Path) -> Result<Model, LlmError> {
        let cfg = LlamaConfig::from_dir(dir)?;
        let src = SafetensorsDir::open(dir)?;
        // A directory written by `fastlane llm make-random` carries the byte vocabulary.
        let random = cfg.vocab_size >= 258 && cfg.bos_token_id == Some(crate::tokenizer::BOS);
        let mut m = Model::from_source(cfg, &src, dir.display().to_string(), random)?;
        let tok = dir.join("tokenizer.json");
        if tok.exists() {
            m.tokenizer = Tokenizer::from_file(&tok)?;
        } else if !random {
            log::warn!(
                "{}: no tokenizer.json: text is byte-tokenized, which this model was not trained on; give token ids",
                dir.display()
            );
        }
        Ok(m)
    }

    /// Builds the model from any tensor source; every tensor is checked against the shape
    /// the config implies.
    pub fn from_source(
        cfg: LlamaConfig,
        src: &dyn TensorSource,
        name: String,
        random: bool,
    ) -> Result<Model, LlmError> {
        cfg.validate().map_err(|reason| LlmError::Config { path: src.origin(), reason })?;
        let shapes = tensor_shapes(&cfg);
        // The model's identity for content-addressed KV blocks: config and weights, in the
        // order they are read (fixed by the code below).
        let hasher = std::cell::RefCell::new(blake3::Hasher::new_derive_key(
            "fastlane-llm model weights v1",
        ));
        hasher.borrow_mut().update(serde_json::to_string(&cfg).unwrap_or_default().as_bytes());
        let get = |n: &str| -> Result<Vec<f32>, LlmError> {
            let want = &shapes[n];
            let t = src.tensor(n)?.ok_or_else(|| LlmError::Tensor {
                path: src.origin(),
                tensor: n.to_string(),
                reason: "missing".into(),
            })?;
            if &t.shape != want {
                return Err(LlmError::Tensor {
                    path: src.origin(),
                    tensor: n.to_string(),
                    reason: format!("shape {:?}, config.json implies {:?}", t.shape, want),
                });
            }
            hash_tensor(&mut hasher.borrow_mut(), n, &t.data);
            Ok(t.data)
        };
        let (h, inter) = (cfg.hidden_size, cfg.intermediate_size);
        let hd = cfg.head_dim();
        let (q, kv) = (cfg.num_attention_heads * hd, cfg.kv_heads() * hd);
        let embed = get(EMBED)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            // Read in this order: the model digest hashes the tensors as they are read.
            let t = |which: LayerTensor| get(&which.name(l));
            let (wq, wk, wv) = (t(LayerTensor::Q)?, t(LayerTensor::K)?, t(LayerTensor::V)?);
            let (wg, wu) = (t(LayerTensor::Gate)?, t(LayerTensor::Up)?);
            layers.push(Layer {
                attn_norm: t(LayerTensor::InputNorm)?,
                qkv: PackedMatrix::pack_stacked(&[(&wq, q), (&wk, kv), (&wv, kv)], h),
                o: PackedMatrix::pack(&t(LayerTensor::O)?, h, q),
                mlp_norm: t(LayerTensor::PostAttentionNorm)?,
                gate_up: PackedMatrix::pack_stacked(&[(&wg, inter), (&wu, inter)], h),
                down: PackedMatrix::pack(&t(LayerTensor::Down)?, h, inter),
            });
        }
        let lm = if cfg.tie_word_embeddings { embed.clone() } else { get(LM_HEAD)? };
        let lm_head = PackedMatrix::pack(&lm, cfg.vocab_size, h);
        let rope = Rope::new(hd, cfg.rope_theta, cfg.max_position_embeddings);
        let norm = get(FINAL_NORM)?;
        let digest = *hasher.borrow().finalize().as_bytes();
        Ok(Model {
            norm,
            digest,
            embed,
            layers,
            lm_head,
            rope,
            tokenizer: Tokenizer::Bytes,
            name,
            random,
            cfg,
        })
    }

    /// A name that pins what this model computes: `fastlane-llm:` and the hex BLAKE3 of its
    /// config and every tensor as loaded. Two processes that load the same weights (any path,
    /// any dtype that converts to the same f32) get the same id; the prefix cache's block
    /// keys start from it.
    pub fn model_id(&self) -> String {
        let mut s = String::with_capacity(14 + 64);
        s.push_str("fastlane-llm:");
        for b in self.digest {
            s.push_str(&format!("{b:02x}"));
        }
        s
    }

    /// The config.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// The name it was loaded by (`random:tiny` or the directory).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether it is a random-weight model (not a language model: its text means nothing).
    pub fn is_random(&self) -> bool {
        self.random
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Vocabulary size.
    pub fn vocab(&self) -> usize {
        self.cfg.vocab_size
    }

    /// Context window.
    pub fn max_positions(&self) -> usize {
        self.cfg.max_position_embeddings
    }

    /// Bytes of weights one decode step reads (every matrix once, plus the norms).
    pub fn weight_bytes(&self) -> u64 {
        let mut b = self.lm_head.bytes() as u64 + 4 * self.norm.len() as u64;
        for l in &self.layers {
            b += (l.qkv.bytes() + l.o.bytes() + l.gate_up.bytes() + l.down.bytes()) as u64;
            b += 4 * (l.attn_norm.len() + l.mlp_norm.len()) as u64;
        }
        b
    }

    /// Multiply-adds of the matrices per token (for FLOP counts: ×2).
    pub fn matmul_fmas_per_token(&self) -> u64 {
        let mut f = (self.lm_head.n() * self.lm_head.k()) as u64;
        for l in &self.layers {
            for m in [&l.qkv, &l.o, &l.gate_up, &l.down] {
                f += (m.n() * m.k()) as u64;
            }
        }
        f
    }

    /// The paged KV geometry this model needs (f32 K and V, [`TOKENS_PER_BLOCK`] tokens a
    /// block).
    pub fn kv_geometry(&self) -> KvGeometry {
        KvGeometry {
            layers: self.cfg.num_hidden_layers as u32,
            kv_heads: self.cfg.kv_heads() as u32,
            head_dim: self.cfg.head_dim() as u32,
            dtype: DType::F32,
            tokens_per_block: TOKENS_PER_BLOCK as u32,
        }
    }

    /// The matrices as (name, n, k) for benchmarks of the same shapes.
    pub fn matrix_shapes(&self) -> Vec<(&'static str, usize, usize)> {
        let l = &self.layers[0];
        vec![
            ("qkv", l.qkv.n(), l.qkv.k()),
            ("o", l.o.n(), l.o.k()),
            ("gate_up", l.gate_up.n(), l.gate_up.k()),
            ("down", l.down.n(), l.down.k()),
            ("lm_head", self.lm_head.n(), self.lm_head.k()),
        ]
    }

    /// Runs one step. K and V of every input row are written into the pool at the row's
    /// position; the logits of the last row of each item with `want_logits` land in
    /// `scratch.logits`, in item order. Returns the number of logit rows.
    ///
    /// Batch-invariant: a row's K, V and logits are bit-identical whatever else is in the
    /// batch, and whether its context was written by a prefill chunk, a decode or a
    /// recompute (kernels docs).
    pub fn forward(
        &self,
        items: &[BatchItem<'_>],
        pool: &KvPool,
        s: &mut Scratch,
    ) -> Result<usize, LlmError> {
        match self.forward_abortable(items, pool, s, &|_| false)? {
            Forward::Done(n) => Ok(n),
            // Cannot happen: the check above never says stop.
            Forward::Aborted { layer } => Err(LlmError::Stopped {
                reason: format!("forward pass aborted before layer {layer} with no abort check"),
            }),
        }
    }

    /// [`forward`](Self::forward) that can be given up between layers and within one:
    /// before each layer `l` (the first included) `abort(2 * l)` is called, by each (row,
    /// head) task of its attention (on the pool's threads) and between its attention and
    /// its MLP `abort(2 * l + 1)`; when it returns `true` the pass stops there and returns
    /// [`Forward::Aborted`]. The check is the caller's (an atomic load, say): no allocation
    /// or lock is added here. Validation errors come before any
    /// layer, as for `forward`.
    pub fn forward_abortable(
        &self,
        items: &[BatchItem<'_>],
        pool: &KvPool,
        s: &mut Scratch,
        abort: &AbortCheck<'_>,
    ) -> Result<Forward, LlmError> {
        let cfg = &self.cfg;
        let (hd, nh, nkv) = (cfg.head_dim(), cfg.num_attention_heads, cfg.kv_heads());
        let (h, inter, vocab) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
        let qkv_w = (nh + 2 * nkv) * hd;
        s.rows_item.clear();
        s.rows_pos.clear();
        s.last_rows.clear();
        for (i, it) in items.iter().enumerate() {
            let end = it.start_pos + it.tokens.len();
            if it.tokens.is_empty() || end > self.rope.positions() {
                return Err(LlmError::BadRequest {
                    reason: format!("positions {}..{end} outside the context window", it.start_pos),
                });
            }
            if it.blocks.len() * TOKENS_PER_BLOCK < end {
                return Err(LlmError::BadRequest {
                    reason: format!("{} blocks cannot hold {end} positions", it.blocks.len()),
                });
            }
            if let Some(&bad) = it.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(LlmError::BadRequest {
                    reason: format!("token id {bad} ≥ vocab {vocab}"),
                });
            }
            pool.check_blocks(it.blocks)?;
            for (j, _) in it.tokens.iter().enumerate() {
                s.rows_item.push(i);
                s.rows_pos.push(it.start_pos + j);
            }
            if it.want_logits {
                s.last_rows.push(s.rows_item.len() - 1);
            }
        }
        let t = s.rows_item.len();
        grow(&mut s.x, t * h);
        grow(&mut s.h, t * h);
        grow(&mut s.qkv, t * qkv_w);
        grow(&mut s.attn, t * nh * hd);
        grow(&mut s.proj, t * h);
        grow(&mut s.gu, t * 2 * inter);
        grow(&mut s.act, t * inter);
        let mut r = 0;
        for it in items {
            for &tok in it.tokens {
                let tok = tok as usize;
                s.x[r * h..(r + 1) * h].copy_from_slice(&self.embed[tok * h..(tok + 1) * h]);
                r += 1;
            }
        }
        for (li, layer) in self.layers.iter().enumerate() {
            if abort(2 * li) || !layer.forward(self, li, items, pool, s, abort) {
                return Ok(Forward::Aborted { layer: li });
            }
        }
        let n = s.last_rows.len();
        // Gather the rows that sample into h, final norm, output head.
        for (i, &r) in s.last_rows.iter().enumerate() {
            s.proj[i * h..(i + 1) * h].copy_from_slice(&s.x[r * h..(r + 1) * h]);
        }
        rms_norm(&s.proj, &self.norm, cfg.rms_norm_eps as f32, n, &mut s.h);
        grow(&mut s.logits, n * vocab);
        matmul(&s.h, n, &self.lm_head, &mut s.logits);
        Ok(Forward::Done(n))
    }

    /// Causal attention of every row over its sequence's cached positions `0..=pos`, one
    /// task per (row, head), keys in ascending position (fixed order: batch-invariant).
    /// `abort(2 * layer + 1)` is asked before each task; once it says stop the remaining
    /// tasks are skipped and `false` is returned (the output is then garbage: the step is
    /// given up).
    fn attention(
        &self,
        layer: usize,
        items: &[BatchItem<'_>],
        pool: &KvPool,
        s: &mut Scratch,
        abort: &AbortCheck<'_>,
    ) -> bool {
        let cfg = &self.cfg;
        let (hd, nh, nkv) = (cfg.head_dim(), cfg.num_attention_heads, cfg.kv_heads());
        let qkv_w = (nh + 2 * nkv) * hd;
        let group = nh / nkv;
        let scale = 1.0 / (hd as f32).sqrt();
        let t = s.rows_item.len();
        let (qkv, rows_item, rows_pos) = (&s.qkv, &s.rows_item, &s.rows_pos);
        let stopped = AtomicBool::new(false);
        let work = |idx: usize, out: &mut [f32]| {
            // Relaxed: the flag only saves the remaining tasks the check; the check itself
            // is what decides.
            if stopped.load(Ordering::Relaxed) || abort(2 * layer + 1) {
                stopped.store(true, Ordering::Relaxed);
                return;
            }
            let (r, head) = (idx / nh, idx % nh);
            let blocks = items[rows_item[r]].blocks;
            let q = &qkv[r * qkv_w + head * hd..r * qkv_w + (head + 1) * hd];
            let kv = KvRef { pool, blocks, layer, kv_head: head / group };
            SCORES.with(|sc| attend(q, &kv, rows_pos[r], scale, &mut sc.borrow_mut(), out));
        };
        let attn = &mut s.attn[..t * nh * hd];
        let ctx: usize = rows_pos.iter().map(|p| p + 1).sum();
        if ctx * nh * hd < 1 << 16 {
            attn.chunks_mut(hd).enumerate().for_each(|(i, o)| work(i, o));
        } else {
            attn.par_chunks_mut(hd).enumerate().for_each(|(i, o)| work(i, o));
        }
        !stopped.into_inner()
    }
}
