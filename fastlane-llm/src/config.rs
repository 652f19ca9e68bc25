//! The model's `config.json`, field by field as Hugging Face's `LlamaConfig` names them.

use std::path::Path;

use serde::Deserialize;

use crate::error::LlmError;

/// Architectures this engine runs (Hugging Face `architectures[0]`).
pub const SUPPORTED_ARCHITECTURES: &[&str] = &["LlamaForCausalLM", "MistralForCausalLM"];

/// A Llama-architecture decoder's configuration (`config.json`).
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
pub struct LlamaConfig {
    /// `["LlamaForCausalLM"]` and the like.
    #[serde(default)]
    pub architectures: Vec<String>,
    /// `"llama"`, `"mistral"`.
    #[serde(default)]
    pub model_type: String,
    /// Vocabulary size (rows of the embedding and of `lm_head`).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention); defaults to the query heads.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Head dimension; defaults to `hidden_size / num_attention_heads`.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// RMSNorm epsilon.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// RoPE base.
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    /// RoPE scaling (Llama 3.1 `llama3`, linear, …): not supported yet; refused when set.
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// Context window.
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    /// Whether `lm_head` shares the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Beginning-of-sequence token.
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token(s): a number or a list.
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
    /// Checkpoint dtype (informational; the loader reads each tensor's own dtype).
    #[serde(default)]
    pub torch_dtype: Option<String>,
    /// Attention projections with bias (Qwen2-style): not supported; refused when true.
    #[serde(default)]
    pub attention_bias: bool,
    /// Sliding-window attention (Mistral): not supported; refused when set.
    #[serde(default)]
    pub sliding_window: Option<serde_json::Value>,
}

fn default_eps() -> f64 {
    1e-5
}
fn default_theta() -> f64 {
    10_000.0
}
fn default_max_pos() -> usize {
    2048
}

impl LlamaConfig {
    /// Reads and checks `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<LlamaConfig, LlmError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| LlmError::Io { path: path.display().to_string(), source: e })?;
        let cfg: LlamaConfig = serde_json::from_str(&text).map_err(|e| LlmError::Config {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        cfg.validate()
            .map_err(|reason| LlmError::Config { path: path.display().to_string(), reason })?;
        Ok(cfg)
    }

    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Head dimension.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// End-of-sequence ids.
    pub fn eos_ids(&self) -> Vec<u32> {
        match &self.eos_token_id {
            Some(serde_json::Value::Number(n)) => {
                n.as_u64().map(|v| vec![v as u32]).unwrap_or_default()
            }
            Some(serde_json::Value::Array(a)) => {
                a.iter().filter_map(|v| v.as_u64()).map(|v| v as u32).collect()
            }
            _ => Vec::new(),
        }
    }

    /// Context tokens whose attention (scores and weighted values, 4 FLOPs per head
    /// dimension) costs as much as one token's pass through a layer's linear weights (2
    /// FLOPs per weight): what the scheduler prices a long context's token at.
    pub fn attention_context(&self) -> u32 {
        let (h, i) = (self.hidden_size as u64, self.intermediate_size as u64);
        let (hd, nh, nkv) =
            (self.head_dim() as u64, self.num_attention_heads as u64, self.kv_heads() as u64);
        let linear = h * (nh + 2 * nkv) * hd + nh * hd * h + 3 * h * i;
        (linear / (2 * nh * hd).max(1)).clamp(1, u64::from(u32::MAX)) as u32
    }

    /// Parameters (weights) of the model.
    pub fn parameters(&self) -> u64 {
        let (h, i, v) =
            (self.hidden_size as u64, self.intermediate_size as u64, self.vocab_size as u64);
        let hd = self.head_dim() as u64;
        let q = self.num_attention_heads as u64 * hd;
        let kv = self.kv_heads() as u64 * hd;
        let layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h;
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        v * h + self.num_hidden_layers as u64 * layer + h + head
    }

    /// Checks what the engine needs; the reason names the field.
    pub fn validate(&self) -> Result<(), String> {
        match self.architectures.first() {
            Some(a) if SUPPORTED_ARCHITECTURES.contains(&a.as_str()) => {}
            Some(a) => {
                return Err(format!(
                    "architecture {a:?} is not supported (supported: {})",
                    SUPPORTED_ARCHITECTURES.join(", ")
                ))
            }
            None if self.model_type == "llama" || self.model_type == "mistral" => {}
            None => {
                return Err(format!(
                    "no `architectures` and model_type {:?} is not llama",
                    self.model_type
                ))
            }
        }
        let pos = |name: &str, v: usize| {
            if v == 0 {
                Err(format!("{name} must be positive"))
            } else {
                Ok(())
            }
        };
        pos("vocab_size", self.vocab_size)?;
        pos("hidden_size", self.hidden_size)?;
        pos("intermediate_size", self.intermediate_size)?;
        pos("num_hidden_layers", self.num_hidden_layers)?;
        pos("num_attention_heads", self.num_attention_heads)?;
        pos("num_key_value_heads", self.kv_heads())?;
        pos("max_position_embeddings", self.max_position_embeddings)?;
        if !self.num_attention_heads.is_multiple_of(self.kv_heads()) {
            return Err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads,
                self.kv_heads()
            ));
        }
        let hd = self.head_dim();
        if hd == 0 || !hd.is_multiple_of(2) {
            return Err(format!("head_dim {hd} must be even and positive"));
        }
        if self.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
            return Err("rope_scaling is not supported yet (Llama 3.1 `llama3` scaling)".into());
        }
        if self.attention_bias {
            return Err("attention_bias = true (Qwen2-style biases) is not supported".into());
        }
        if self.sliding_window.as_ref().is_some_and(|v| !v.is_null()) {
            return Err("sliding_window attention is not supported".into());
        }
        Ok(())
    }
}
