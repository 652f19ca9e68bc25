//! Errors of the inference engine.

use thiserror::Error;

/// Everything that can go wrong loading a model or serving a request.
#[derive(Debug, Error)]
pub enum LlmError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// `config.json` is malformed or describes something we do not run.
    #[error("{path}: {reason}")]
    Config {
        /// The file.
        path: String,
        /// What is wrong (names the field).
        reason: String,
    },
    /// A weight file is malformed, or a tensor is missing, mis-shaped or of a dtype we do not
    /// read.
    #[error("{path}: tensor {tensor:?}: {reason}")]
    Tensor {
        /// The file (or model directory).
        path: String,
        /// The tensor name, as in the checkpoint.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// `tokenizer.json` is missing or unreadable.
    #[error("tokenizer: {reason}")]
    Tokenizer {
        /// What is wrong.
        reason: String,
    },
    /// A `random:` model name we do not know.
    #[error("unknown model {name:?}: give a model directory or one of random:tiny, random:small")]
    UnknownModel {
        /// What was asked for.
        name: String,
    },
    /// A request that cannot be served (too long, empty, bad sampling parameters, too many
    /// blocks).
    #[error("bad request: {reason}")]
    BadRequest {
        /// Why.
        reason: String,
    },
    /// The engine thread is gone (shut down or failed).
    #[error("engine stopped: {reason}")]
    Stopped {
        /// Why.
        reason: String,
    },
    /// The swap engine or the KV pool failed.
    #[error("kvswap: {0}")]
    KvSwap(#[from] fastlane_kvswap::KvSwapError),
    /// The prefix cache could not be set up (its NVMe tier: the file, its size; its cluster
    /// tier: refused credentials, TLS).
    #[error("prefix cache: {reason}")]
    PrefixCache {
        /// What failed (names the file and the step).
        reason: String,
    },
    /// The scheduler refused a configuration or a request.
    #[error("scheduler: {0}")]
    Sched(#[from] fastlane_sched::SchedError),
}
