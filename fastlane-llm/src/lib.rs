//! fastlane-llm: a small, real inference engine under kvswap's scheduler.
//!
//! # What it does
//!
//! - [`model`]: a Llama-architecture decoder (RMSNorm, rotary embeddings, grouped-query
//!   attention, SwiGLU MLP; Llama 2/3 without RoPE scaling, TinyLlama, SmolLM, Mistral
//!   without sliding window) loaded from a Hugging Face directory (`config.json`,
//!   `*.safetensors` single or sharded, f32/bf16/f16) or generated from a seed
//!   (`random:tiny`, `random:small`: not language models, real compute and memory traffic).
//! - [`tokenizer`]: the directory's `tokenizer.json` (Hugging Face `tokenizers`), or the
//!   random models' byte vocabulary; streaming text pieces.
//! - [`kernels`]: batch-invariant f32 kernels (AVX-512 with a bit-identical portable
//!   fallback): a row's result does not depend on the rest of the batch, so preemption,
//!   recompute and batching cannot change a sequence's tokens.
//! - [`kv`]: the paged KV cache in kvswap's device pool, 16-token blocks, one block table per
//!   sequence (the scheduler's).
//! - [`engine`]: the loop that executes `fastlane_sched` plans — continuous batching, chunked
//!   prefill, policies `fifo`, `drr`, `drr+preempt` — with preemption by swap through a real
//!   [`fastlane_kvswap::SwapEngine`] ([`port`]) or by recompute, chosen with costs measured on this
//!   engine. Greedy and sampled decoding, stop strings and ids, abort; optionally
//!   preemptible steps (a forward pass given up between layers for an interactive arrival).
//! - [`server`]: the OpenAI-compatible HTTP front end (tenants, SSE, Prometheus metrics).
//! - [`commands`]: `fastlane llm serve`, `generate` and `make-random`, each its flags and the
//!   function that runs it; [`args`]: the model, engine and listener flags they share (and
//!   `fastlane router`), with their conversion into [`EngineConfig`] and the listener's options.
//!
//! # What it does not do (yet)
//!
//! - No GPU path: K/V and compute are f32 on the CPU.
//! - No RoPE scaling, attention biases or sliding windows (refused with a clear error).

pub mod args;
pub mod commands;
pub mod config;
pub mod engine;
pub mod error;
pub mod kernels;
pub mod kv;
pub mod model;
pub mod port;
pub mod sampling;
pub mod server;
pub mod tokenizer;
pub mod weights;

pub use config::LlamaConfig;
pub use engine::{
    Engine, EngineConfig, EngineCounters, EngineHealth, EngineHistograms, FinishReason, Finished,
    GenRequest, PreemptChoice, Stream, StreamEvent, STALL_AFTER,
};
pub use error::LlmError;
pub use model::{BatchItem, Forward, Model, Scratch, TOKENS_PER_BLOCK};
pub use sampling::SamplingParams;
pub use weights::{RandomPreset, RandomWeights};
