//! Where weights come from: a Hugging Face model directory (`*.safetensors`, single or
//! sharded with `model.safetensors.index.json`; f32, bf16 or f16), or a seeded random model
//! (`random:tiny`, `random:small`) generated in memory or written as such a directory.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use safetensors::tensor::{Dtype, Metadata, TensorView};

use crate::config::LlamaConfig;
use crate::error::LlmError;

/// A named tensor's shape and values, converted to f32.
#[derive(Debug, Clone)]
pub struct Tensor {
    /// Shape, as in the checkpoint.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub data: Vec<f32>,
}

/// Something that hands out tensors by their checkpoint names.
pub trait TensorSource {
    /// The tensor, `Ok(None)` when absent; errors name the file and tensor.
    fn tensor(&self, name: &str) -> Result<Option<Tensor>, LlmError>;
    /// Where the tensors come from (for error messages).
    fn origin(&self) -> String;
}

struct Shard {
    path: PathBuf,
    map: memmap2::Mmap,
    header_len: usize,
    meta: Metadata,
}

/// The safetensors files of a model directory, memory-mapped.
pub struct SafetensorsDir {
    dir: PathBuf,
    shards: Vec<Shard>,
    /// Tensor name → shard index.
    index: HashMap<String, usize>,
}

impl std::fmt::Debug for SafetensorsDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsDir")
            .field("dir", &self.dir)
            .field("shards", &self.shards.len())
            .field("tensors", &self.index.len())
            .finish()
    }
}

fn io_err(path: &Path, e: std::io::Error) -> LlmError {
    LlmError::Io { path: path.display().to_string(), source: e }
}

impl SafetensorsDir {
    /// Opens `dir`: `model.safetensors.index.json` names the shards when present, otherwise
    /// every `*.safetensors` file of the directory is read.
    pub fn open(dir: &Path) -> Result<SafetensorsDir, LlmError> {
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|e| io_err(&index_path, e))?;
            let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
                LlmError::Config { path: index_path.display().to_string(), reason: e.to_string() }
            })?;
            let map = v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| {
                LlmError::Config {
                    path: index_path.display().to_string(),
                    reason: "no `weight_map` object".into(),
                }
            })?;
            let mut names: Vec<String> =
                map.values().filter_map(|f| f.as_str().map(str::to_owned)).collect();
            names.sort();
            names.dedup();
            names.into_iter().map(|f| dir.join(f)).collect()
        } else {
            let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|e| io_err(dir, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            v.sort();
            v
        };
        if files.is_empty() {
            return Err(LlmError::Tensor {
                path: dir.display().to_string(),
                tensor: String::new(),
                reason: "no *.safetensors file in the model directory".into(),
            });
        }
        let mut shards = Vec::new();
        let mut index = HashMap::new();
        for path in files {
            let file = std::fs::File::open(&path).map_err(|e| io_err(&path, e))?;
            // SAFETY: the file is mapped read-only; a checkpoint changed under a running
            // engine is outside what we promise (as for every mmap-based loader).
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| io_err(&path, e))?;
            let (header_len, meta) =
                safetensors::SafeTensors::read_metadata(&map[..]).map_err(|e| {
                    LlmError::Tensor {
                        path: path.display().to_string(),
                        tensor: String::new(),
                        reason: format!("not a safetensors file: {e}"),
                    }
                })?;
            for name in meta.tensors().keys() {
                index.insert(name.clone(), shards.len());
            }
            shards.push(Shard { path, map, header_len, meta });
        }
        Ok(SafetensorsDir { dir: dir.to_path_buf(), shards, index })
    }
}

/// Converts little-endian `bytes` of `dtype` to f32.
fn to_f32(dtype: Dtype, bytes: &[u8]) -> Result<Vec<f32>, String> {
    Ok(match dtype {
        Dtype::F32 => {
            bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        }
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        other => return Err(format!("dtype {other:?} is not supported (f32, bf16, f16 are)")),
    })
}

impl TensorSource for SafetensorsDir {
    fn tensor(&self, name: &str) -> Result<Option<Tensor>, LlmError> {
        let Some(&i) = self.index.get(name) else { return Ok(None) };
        let s = &self.shards[i];
        let err = |reason: String| LlmError::Tensor {
            path: s.path.display().to_string(),
            tensor: name.to_string(),
            reason,
        };
        let info = s.meta.info(name).ok_or_else(|| err("listed but not found".into()))?;
        let (a, b) = info.data_offsets;
        let start = 8 + s.header_len;
        let bytes = s
            .map
            .get(start + a..start + b)
            .ok_or_else(|| err(format!("data {a}..{b} runs past the end of the file")))?;
        let elems: usize = info.shape.iter().product();
        if bytes.len() != elems * info.dtype.bitsize() / 8 {
            return Err(err(format!(
                "{} bytes for shape {:?} of {:?}",
                bytes.len(),
                info.shape,
                info.dtype
            )));
        }
        let data = to_f32(info.dtype, bytes).map_err(err)?;
        Ok(Some(Tensor { shape: info.shape.clone(), data }))
    }

    fn origin(&self) -> String {
        self.dir.display().to_string()
    }
}

/// Built-in random models: not language models, only real compute and memory traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RandomPreset {
    /// About 3.4 M parameters, 4 layers: tests and the demo.
    Tiny,
    /// About 125 M parameters (500 MB of f32), 12 layers: larger than the last-level cache,
    /// for benchmarks.
    Small,
}

impl RandomPreset {
    /// `random:tiny` → `Tiny`.
    pub fn parse(name: &str) -> Option<RandomPreset> {
        match name {
            "random:tiny" => Some(RandomPreset::Tiny),
            "random:small" => Some(RandomPreset::Small),
            _ => None,
        }
    }

    /// The preset's name (`random:tiny`).
    pub fn name(self) -> &'static str {
        match self {
            RandomPreset::Tiny => "random:tiny",
            RandomPreset::Small => "random:small",
        }
    }

    /// Its `config.json`. The vocabulary is the byte tokenizer's (256 bytes, BOS, EOS,
    /// padded).
    pub fn config(self) -> LlamaConfig {
        let (vocab, h, inter, layers, heads, kv) = match self {
            RandomPreset::Tiny => (512, 256, 768, 4, 8, 4),
            RandomPreset::Small => (32_000, 768, 2048, 12, 12, 4),
        };
        LlamaConfig {
            architectures: vec!["LlamaForCausalLM".into()],
            model_type: "llama".into(),
            vocab_size: vocab,
            hidden_size: h,
            intermediate_size: inter,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: Some(kv),
            head_dim: None,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_scaling: None,
            max_position_embeddings: 4096,
            tie_word_embeddings: false,
            bos_token_id: Some(crate::tokenizer::BOS),
            eos_token_id: Some(serde_json::json!(crate::tokenizer::EOS)),
            torch_dtype: Some("float32".into()),
            attention_bias: false,
            sliding_window: None,
        }
    }
}

/// Seeded random weights for a config, generated on demand (each tensor from its own
/// stream, so a tensor's values depend only on the seed and its name).
#[derive(Debug, Clone)]
pub struct RandomWeights {
    cfg: LlamaConfig,
    seed: u64,
    shapes: BTreeMap<String, Vec<usize>>,
}

/// The token embedding's tensor name (Hugging Face Llama checkpoints).
pub const EMBED: &str = "model.embed_tokens.weight";
/// The final norm's tensor name.
pub const FINAL_NORM: &str = "model.norm.weight";
/// The output head's tensor name (absent when the config ties it to the embedding).
pub const LM_HEAD: &str = "lm_head.weight";

/// The tensors of one decoder layer: their names and shapes are written here only, for the
/// model that loads them, the random weights that make them and the checks between the two.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerTensor {
    /// RMS norm before attention (`input_layernorm`).
    InputNorm,
    /// RMS norm before the MLP (`post_attention_layernorm`).
    PostAttentionNorm,
    /// Query projection.
    Q,
    /// Key projection.
    K,
    /// Value projection.
    V,
    /// Attention output projection.
    O,
    /// MLP gate projection.
    Gate,
    /// MLP up projection.
    Up,
    /// MLP down projection.
    Down,
}

impl LayerTensor {
    /// Every tensor of a layer.
    pub const ALL: [LayerTensor; 9] = [
        LayerTensor::InputNorm,
        LayerTensor::PostAttentionNorm,
        LayerTensor::Q,
        LayerTensor::K,
        LayerTensor::V,
        LayerTensor::O,
        LayerTensor::Gate,
        LayerTensor::Up,
        LayerTensor::Down,
    ];

    /// Its name in layer `layer`.
    pub fn name(self, layer: usize) -> String {
        let part = match self {
            LayerTensor::InputNorm => "input_layernorm",
            LayerTensor::PostAttentionNorm => "post_attention_layernorm",
            LayerTensor::Q => "self_attn.q_proj",
            LayerTensor::K => "self_attn.k_proj",
            LayerTensor::V => "self_attn.v_proj",
            LayerTensor::O => "self_attn.o_proj",
            LayerTensor::Gate => "mlp.gate_proj",
            LayerTensor::Up => "mlp.up_proj",
            LayerTensor::Down => "mlp.down_proj",
        };
        format!("model.layers.{layer}.{part}.weight")
    }

    /// Its shape (rows × columns; a norm is one vector) under `cfg`.
    pub fn shape(self, cfg: &LlamaConfig) -> Vec<usize> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let hd = cfg.head_dim();
        let (q, kv) = (cfg.num_attention_heads * hd, cfg.kv_heads() * hd);
        match self {
            LayerTensor::InputNorm | LayerTensor::PostAttentionNorm => vec![h],
            LayerTensor::Q => vec![q, h],
            LayerTensor::K | LayerTensor::V => vec![kv, h],
            LayerTensor::O => vec![h, q],
            LayerTensor::Gate | LayerTensor::Up => vec![i, h],
            LayerTensor::Down => vec![h, i],
        }
    }
}

/// Tensor names and shapes of a Llama checkpoint with this config.
pub fn tensor_shapes(cfg: &LlamaConfig) -> BTreeMap<String, Vec<usize>> {
    let (h, v) = (cfg.hidden_size, cfg.vocab_size);
    let mut m = BTreeMap::new();
    m.insert(EMBED.to_string(), vec![v, h]);
    m.insert(FINAL_NORM.to_string(), vec![h]);
    if !cfg.tie_word_embeddings {
        m.insert(LM_HEAD.to_string(), vec![v, h]);
    }
    for l in 0..cfg.num_hidden_layers {
        for t in LayerTensor::ALL {
            m.insert(t.name(l), t.shape(cfg));
        }
    }
    m
}

fn name_hash(name: &str) -> u64 {
    // FNV-1a: stable across builds and platforms (a tensor's stream must not change).
    name.bytes()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

impl RandomWeights {
    /// Weights for `cfg` from `seed`.
    pub fn new(cfg: LlamaConfig, seed: u64) -> RandomWeights {
        let shapes = tensor_shapes(&cfg);
        RandomWeights { cfg, seed, shapes }
    }

    /// The config.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// Writes `dir/config.json`, `dir/tokenizer.json` (the byte vocabulary) and
    /// `dir/model.safetensors` (f32 or bf16), a normal Hugging Face model directory the loader reads like any checkpoint. With `shards > 1` the
    /// tensors are spread over that many files with a `model.safetensors.index.json`.
    pub fn write_dir(&self, dir: &Path, bf16: bool, shards: usize) -> Result<(), LlmError> {
        std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
        let mut cfg = self.cfg.clone();
        cfg.torch_dtype = Some(if bf16 { "bfloat16" } else { "float32" }.into());
        let cfg_path = dir.join("config.json");
        let text = serde_json::to_string_pretty(&cfg).expect("config serialises");
        std::fs::write(&cfg_path, text).map_err(|e| io_err(&cfg_path, e))?;
        let tok_path = dir.join("tokenizer.json");
        let tok = crate::tokenizer::byte_tokenizer_json().to_string();
        std::fs::write(&tok_path, tok).map_err(|e| io_err(&tok_path, e))?;
        let names: Vec<&String> = self.shapes.keys().collect();
        let shards = shards.clamp(1, names.len());
        let per = names.len().div_ceil(shards);
        let mut weight_map = serde_json::Map::new();
        for (si, group) in names.chunks(per).enumerate() {
            let file = if shards == 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{:05}.safetensors", si + 1, shards)
            };
            let mut bufs: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
            for name in group {
                let t = self.tensor(name)?.expect("own name");
                let bytes: Vec<u8> = if bf16 {
                    t.data.iter().flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect()
                } else {
                    t.data.iter().flat_map(|v| v.to_le_bytes()).collect()
                };
                weight_map.insert((*name).clone(), serde_json::Value::String(file.clone()));
                bufs.push(((*name).clone(), t.shape, bytes));
            }
            let dtype = if bf16 { Dtype::BF16 } else { Dtype::F32 };
            let views: Vec<(String, TensorView<'_>)> = bufs
                .iter()
                .map(|(n, s, b)| {
                    (n.clone(), TensorView::new(dtype, s.clone(), b).expect("sizes match"))
                })
                .collect();
            let path = dir.join(&file);
            safetensors::serialize_to_file(views, None, &path).map_err(|e| LlmError::Tensor {
                path: path.display().to_string(),
                tensor: String::new(),
                reason: e.to_string(),
            })?;
        }
        if shards > 1 {
            let idx = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
            let path = dir.join("model.safetensors.index.json");
            std::fs::write(&path, idx.to_string()).map_err(|e| io_err(&path, e))?;
        }
        Ok(())
    }
}

impl TensorSource for RandomWeights {
    fn tensor(&self, name: &str) -> Result<Option<Tensor>, LlmError> {
        let Some(shape) = self.shapes.get(name) else { return Ok(None) };
        let n: usize = shape.iter().product();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(self.seed ^ name_hash(name));
        let data: Vec<f32> = if shape.len() == 1 {
            // Norm weights near 1.
            (0..n).map(|_| 1.0 + rng.random_range(-0.1f32..0.1)).collect()
        } else if name == EMBED {
            (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
        } else {
            // Uniform with the variance of 1/fan_in, so activations keep their scale; the
            // output head a little hotter so greedy decoding is not all ties.
            let fan_in = shape[1] as f32;
            let mut a = (3.0 / fan_in).sqrt();
            if name == LM_HEAD {
                a *= 4.0;
            }
            (0..n).map(|_| rng.random_range(-a..a)).collect()
        };
        Ok(Some(Tensor { shape: shape.clone(), data }))
    }

    fn origin(&self) -> String {
        format!("random weights (seed {})", self.seed)
    }
}
