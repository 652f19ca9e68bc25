//! KV-cache geometry: how many bytes a token and a block of tokens take, from a model config.

use crate::error::KvSwapError;

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    /// IEEE half precision (2 bytes).
    F16,
    /// bfloat16 (2 bytes).
    BF16,
    /// single precision (4 bytes).
    F32,
    /// 8-bit float (e4m3/e5m2, 1 byte).
    Fp8,
}

impl DType {
    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            DType::F16 | DType::BF16 => 2,
            DType::F32 => 4,
            DType::Fp8 => 1,
        }
    }

    /// Parses a config's dtype name (`float16`, `bfloat16`, `float32`, `fp8`, …).
    pub fn parse(name: &str) -> Option<DType> {
        match name.to_ascii_lowercase().as_str() {
            "float16" | "fp16" | "f16" | "half" => Some(DType::F16),
            "bfloat16" | "bf16" => Some(DType::BF16),
            "float32" | "fp32" | "f32" | "float" => Some(DType::F32),
            "fp8" | "float8" | "fp8_e4m3" | "fp8_e5m2" | "float8_e4m3fn" => Some(DType::Fp8),
            _ => None,
        }
    }
}

/// The shape of one model's paged KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvGeometry {
    /// Transformer layers.
    pub layers: u32,
    /// Key/value heads per layer (grouped-query attention: fewer than query heads).
    pub kv_heads: u32,
    /// Dimension of one head.
    pub head_dim: u32,
    /// Element type.
    pub dtype: DType,
    /// Tokens per paged block.
    pub tokens_per_block: u32,
}

impl KvGeometry {
    /// Llama-3.1-8B: 32 layers, 8 KV heads of 128, fp16, 16-token blocks (128 KiB per token,
    /// 2 MiB per block).
    pub const LLAMA31_8B: KvGeometry = KvGeometry {
        layers: 32,
        kv_heads: 8,
        head_dim: 128,
        dtype: DType::F16,
        tokens_per_block: 16,
    };

    /// Llama-3.1-70B: 80 layers, 8 KV heads of 128, fp16, 16-token blocks (320 KiB per token,
    /// 5 MiB per block).
    pub const LLAMA31_70B: KvGeometry = KvGeometry {
        layers: 80,
        kv_heads: 8,
        head_dim: 128,
        dtype: DType::F16,
        tokens_per_block: 16,
    };

    /// Bytes of K and V for one token across all layers.
    pub fn bytes_per_token(&self) -> u64 {
        2 * u64::from(self.layers)
            * u64::from(self.kv_heads)
            * u64::from(self.head_dim)
            * self.dtype.bytes()
    }

    /// Bytes of one paged block.
    pub fn block_bytes(&self) -> u64 {
        self.bytes_per_token() * u64::from(self.tokens_per_block)
    }

    /// Blocks needed for `tokens` tokens.
    pub fn blocks_for_tokens(&self, tokens: u64) -> u64 {
        tokens.div_ceil(u64::from(self.tokens_per_block.max(1)))
    }

    /// Reads a Hugging Face style `config.json`: `num_hidden_layers`, `num_key_value_heads`
    /// (default: `num_attention_heads`), `head_dim` (default: `hidden_size /
    /// num_attention_heads`), `torch_dtype` (default fp16). `tokens_per_block` is the engine's.
    pub fn from_hf_config(json: &str, tokens_per_block: u32) -> Result<KvGeometry, KvSwapError> {
        let bad = |detail: &str| KvSwapError::BadConfig { detail: detail.to_string() };
        let v: serde_json::Value =
            serde_json::from_str(json).map_err(|e| bad(&format!("config is not JSON: {e}")))?;
        let num = |key: &str| -> Option<u32> {
            v.get(key).and_then(|x| x.as_u64()).and_then(|x| u32::try_from(x).ok())
        };
        let layers = num("num_hidden_layers").ok_or_else(|| bad("no num_hidden_layers"))?;
        let heads = num("num_attention_heads").ok_or_else(|| bad("no num_attention_heads"))?;
        let kv_heads = num("num_key_value_heads").unwrap_or(heads);
        let head_dim = match num("head_dim") {
            Some(d) => d,
            None => {
                let hidden = num("hidden_size").ok_or_else(|| bad("no hidden_size/head_dim"))?;
                if heads == 0 || hidden % heads != 0 {
                    return Err(bad("hidden_size not a multiple of num_attention_heads"));
                }
                hidden / heads
            }
        };
        let dtype = match v.get("torch_dtype").and_then(|x| x.as_str()) {
            Some(name) => DType::parse(name).ok_or_else(|| bad(&format!("dtype {name}")))?,
            None => DType::F16,
        };
        let g = KvGeometry { layers, kv_heads, head_dim, dtype, tokens_per_block };
        if layers == 0 || kv_heads == 0 || head_dim == 0 || tokens_per_block == 0 {
            return Err(bad("zero dimension"));
        }
        Ok(g)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_sizes() {
        let g = KvGeometry::LLAMA31_8B;
        assert_eq!(g.bytes_per_token(), 128 * 1024);
        assert_eq!(g.block_bytes(), 2 * 1024 * 1024);
        assert_eq!(g.blocks_for_tokens(8192), 512);
        assert_eq!(g.blocks_for_tokens(8192) * g.block_bytes(), 1 << 30);
        assert_eq!(KvGeometry::LLAMA31_70B.bytes_per_token(), 320 * 1024);
        assert_eq!(KvGeometry::LLAMA31_70B.block_bytes(), 5 * 1024 * 1024);
    }

    #[test]
    fn hf_config() {
        let cfg = r#"{"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
            "num_key_value_heads": 8, "torch_dtype": "bfloat16"}"#;
        let g = KvGeometry::from_hf_config(cfg, 16).unwrap();
        assert_eq!(g.head_dim, 128);
        assert_eq!(g.dtype, DType::BF16);
        assert_eq!(g.bytes_per_token(), 128 * 1024);
        assert!(KvGeometry::from_hf_config("{}", 16).is_err());
        assert!(KvGeometry::from_hf_config("not json", 16).is_err());
        let bad = r#"{"hidden_size": 100, "num_attention_heads": 3, "num_hidden_layers": 1}"#;
        assert!(KvGeometry::from_hf_config(bad, 16).is_err());
    }
}
