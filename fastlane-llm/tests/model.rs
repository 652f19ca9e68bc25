//! The model computes what the checkpoint says: logits of a random model written as a normal
//! Hugging Face directory (f32 and bf16, single and sharded) agree with an independent NumPy
//! forward pass over the same files; chunking a prefill changes no bit, nor does a pass given
//! up between layers or inside a layer's attention; a broken directory is a clear error naming the file and tensor.

use std::path::Path;
use std::process::Command;

use fastlane_kvswap::BlockId;
use fastlane_llm::kv::KvPool;
use fastlane_llm::weights::RandomWeights;
use fastlane_llm::{BatchItem, Forward, LlmError, Model, RandomPreset, Scratch, TOKENS_PER_BLOCK};

const PROMPT: usize = 300;
const CHUNK: usize = 64;

fn prompt() -> Vec<u32> {
    // Bytes from a fixed LCG (any ids < 256 are valid byte tokens).
    let mut s = 12345u64;
    (0..PROMPT)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) % 256) as u32
        })
        .collect()
}

/// Logits at the end of each chunk of a chunked prefill: (position, row).
fn chunked_logits(m: &Model, ids: &[u32]) -> Vec<(usize, Vec<f32>)> {
    let blocks: Vec<BlockId> =
        (0..ids.len().div_ceil(TOKENS_PER_BLOCK) as u32).map(BlockId).collect();
    let pool = KvPool::new(&m.kv_geometry(), blocks.len() as u32).unwrap();
    let mut s = Scratch::default();
    let mut out = Vec::new();
    for start in (0..ids.len()).step_by(CHUNK) {
        let end = (start + CHUNK).min(ids.len());
        let item = [BatchItem {
            tokens: &ids[start..end],
            start_pos: start,
            blocks: &blocks,
            want_logits: true,
        }];
        assert_eq!(m.forward(&item, &pool, &mut s).unwrap(), 1);
        out.push((end - 1, s.logits[..m.vocab()].to_vec()));
    }
    out
}

fn numpy_logits(dir: &Path, ids: &[u32], positions: &[usize]) -> Vec<Vec<f64>> {
    let ids_path = dir.join("ids.json");
    let pos_path = dir.join("positions.json");
    std::fs::write(&ids_path, serde_json::to_string(ids).unwrap()).unwrap();
    std::fs::write(&pos_path, serde_json::to_string(positions).unwrap()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/llama_forward.py");
    // Debian's python3-numpy lives under /usr/bin/python3 (PATH's python3 may be another).
    let out = Command::new("/usr/bin/python3")
        .arg(&script)
        .arg(dir)
        .arg(&ids_path)
        .arg(&pos_path)
        .output()
        .expect("/usr/bin/python3 runs (CI installs python3-numpy)");
    assert!(out.status.success(), "reference failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("reference prints JSON")
}

fn check_against_numpy(bf16: bool, shards: usize) {
    let dir = tempfile::tempdir().unwrap();
    RandomWeights::new(RandomPreset::Tiny.config(), 11)
        .write_dir(dir.path(), bf16, shards)
        .unwrap();
    let m = Model::load_dir(dir.path()).unwrap();
    let ids = prompt();
    let ours = chunked_logits(&m, &ids);
    let positions: Vec<usize> = ours.iter().map(|o| o.0).collect();
    let theirs = numpy_logits(dir.path(), &ids, &positions);
    let mut worst = 0.0f64;
    for ((pos, a), b) in ours.iter().zip(&theirs) {
        let scale = b.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        for (x, y) in a.iter().zip(b) {
            let d = (f64::from(*x) - y).abs() / scale;
            worst = worst.max(d);
            assert!(d < 2e-5, "bf16={bf16} position {pos}: {x} vs {y} (relative {d:.2e})");
        }
    }
    // Not vacuous: the logits vary across the vocabulary.
    let row = &ours[0].1;
    assert!(row.iter().any(|v| (v - row[0]).abs() > 0.1));
    eprintln!("bf16={bf16} shards={shards}: worst relative difference {worst:.2e} over positions {positions:?}");
}

#[test]
fn logits_match_numpy_f32_sharded() {
    check_against_numpy(false, 2);
}

#[test]
fn logits_match_numpy_bf16_single_file() {
    check_against_numpy(true, 1);
}

#[test]
fn prefill_chunking_changes_no_bit_and_a_directory_equals_the_in_memory_model() {
    let dir = tempfile::tempdir().unwrap();
    RandomWeights::new(RandomPreset::Tiny.config(), 7).write_dir(dir.path(), false, 1).unwrap();
    let from_dir = Model::load_dir(dir.path()).unwrap();
    let in_mem = Model::load("random:tiny", 7).unwrap();
    let ids = prompt();
    let chunked = chunked_logits(&from_dir, &ids);
    let blocks: Vec<BlockId> =
        (0..ids.len().div_ceil(TOKENS_PER_BLOCK) as u32).map(BlockId).collect();
    let pool = KvPool::new(&in_mem.kv_geometry(), blocks.len() as u32).unwrap();
    let mut s = Scratch::default();
    let item = [BatchItem { tokens: &ids, start_pos: 0, blocks: &blocks, want_logits: true }];
    in_mem.forward(&item, &pool, &mut s).unwrap();
    // The directory carries the byte vocabulary as a tokenizer.json, read by `tokenizers`.
    assert!(matches!(from_dir.tokenizer(), fastlane_llm::tokenizer::Tokenizer::Hf(_)));
    assert_eq!(
        from_dir.tokenizer().encode("héllo").unwrap(),
        in_mem.tokenizer().encode("héllo").unwrap()
    );
    let whole = &s.logits[..in_mem.vocab()];
    let last = &chunked.last().unwrap().1;
    assert!(
        whole.iter().zip(last).all(|(a, b)| a.to_bits() == b.to_bits()),
        "chunked prefill changed the logits"
    );
}

#[test]
fn a_pass_given_up_inside_the_attention_leaves_no_trace() {
    // The attention asks its check before every (row, head) task, so a long context's
    // attention can be given up within it: a stop at the fifth task of layer 1 ends the pass
    // there (the tasks after it do not run), and the prompt computed afterwards over the same
    // blocks gives the logits and K/V bytes of a pass never given up.
    use std::sync::atomic::{AtomicUsize, Ordering};
    let m = Model::load("random:tiny", 7).unwrap();
    let heads = m.config().num_attention_heads;
    let ids = prompt();
    let blocks: Vec<BlockId> =
        (0..ids.len().div_ceil(TOKENS_PER_BLOCK) as u32).map(BlockId).collect();
    let whole = [BatchItem { tokens: &ids, start_pos: 0, blocks: &blocks, want_logits: true }];
    // How often a full pass asks check 3 (layer 1's attention and the check after it).
    let asked = AtomicUsize::new(0);
    let plain = KvPool::new(&m.kv_geometry(), blocks.len() as u32).unwrap();
    let mut s = Scratch::default();
    let out = m
        .forward_abortable(&whole, &plain, &mut s, &|c| {
            if c == 3 {
                asked.fetch_add(1, Ordering::Relaxed);
            }
            false
        })
        .unwrap();
    assert_eq!(out, Forward::Done(1));
    let want = s.logits[..m.vocab()].to_vec();
    let tasks = ids.len() * heads;
    assert_eq!(asked.load(Ordering::Relaxed), tasks + 1, "once per (row, head) task, once after");
    // Given up at the fifth task of layer 1's attention.
    let pool = KvPool::new(&m.kv_geometry(), blocks.len() as u32).unwrap();
    let asked = AtomicUsize::new(0);
    let out = m
        .forward_abortable(&whole, &pool, &mut s, &|c| {
            c == 3 && asked.fetch_add(1, Ordering::Relaxed) >= 4
        })
        .unwrap();
    assert_eq!(out, Forward::Aborted { layer: 1 });
    // The tasks after the stop skip the check (a pool thread may have asked once more).
    let n = asked.load(Ordering::Relaxed);
    assert!(n < 5 + rayon::current_num_threads() + 1 && n < tasks, "asked {n} times of {tasks}");
    let out = m.forward_abortable(&whole, &pool, &mut s, &|_| false).unwrap();
    assert_eq!(out, Forward::Done(1));
    assert!(
        s.logits[..m.vocab()].iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
        "logits changed after a pass given up inside the attention"
    );
    for &b in &blocks {
        assert!(pool.block_bytes_of(b) == plain.block_bytes_of(b), "block {b:?} differs");
    }
}

#[test]
fn a_pass_given_up_between_layers_leaves_no_trace() {
    // Each 64-token chunk of the prefill is first aborted at one of the pass's checks (before
    // layer 0, in its attention, before layer 1, ...: its K/V written for the layers
    // before, and for the layer itself when in its attention), then computed as two 32-token chunks: the second
    // half's positions hold the aborted pass's partial K/V until the second chunk rewrites
    // them. Logits at every 64-token boundary and every K/V byte must equal the plain
    // chunked prefill's.
    let m = Model::load("random:tiny", 7).unwrap();
    let layers = m.config().num_hidden_layers;
    let ids = prompt();
    let want = chunked_logits(&m, &ids);
    let blocks: Vec<BlockId> =
        (0..ids.len().div_ceil(TOKENS_PER_BLOCK) as u32).map(BlockId).collect();
    let pool = KvPool::new(&m.kv_geometry(), blocks.len() as u32).unwrap();
    let plain = KvPool::new(&m.kv_geometry(), blocks.len() as u32).unwrap();
    let mut s = Scratch::default();
    let item = |start: usize, end: usize| BatchItem {
        tokens: &ids[start..end],
        start_pos: start,
        blocks: &blocks,
        want_logits: true,
    };
    for (k, start) in (0..ids.len()).step_by(CHUNK).enumerate() {
        let end = (start + CHUNK).min(ids.len());
        let stop = k % (2 * layers);
        let out = m.forward_abortable(&[item(start, end)], &pool, &mut s, &|c| c == stop).unwrap();
        assert_eq!(out, Forward::Aborted { layer: stop / 2 });
        let mid = (start + CHUNK / 2).min(end);
        for (a, b) in [(start, mid), (mid, end)].into_iter().filter(|(a, b)| a < b) {
            let out = m.forward_abortable(&[item(a, b)], &pool, &mut s, &|_| false).unwrap();
            assert_eq!(out, Forward::Done(1));
        }
        let (pos, row) = &want[k];
        assert_eq!(*pos, end - 1);
        assert!(
            s.logits[..m.vocab()].iter().zip(row).all(|(a, b)| a.to_bits() == b.to_bits()),
            "chunk {k}: logits changed after a pass aborted at check {stop}"
        );
        m.forward(&[item(start, end)], &plain, &mut Scratch::default()).unwrap();
    }
    for &b in &blocks {
        assert!(pool.block_bytes_of(b) == plain.block_bytes_of(b), "block {b:?} differs");
    }
}

fn expect_err(dir: &Path, needle: &str) {
    match Model::load_dir(dir) {
        Ok(_) => panic!("{} loaded, expected an error mentioning {needle:?}", dir.display()),
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains(needle), "error {msg:?} does not mention {needle:?}");
        }
    }
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, v.to_string()).unwrap();
}

#[test]
fn broken_model_directories_are_clear_errors() {
    let fresh = || {
        let d = tempfile::tempdir().unwrap();
        RandomWeights::new(RandomPreset::Tiny.config(), 3).write_dir(d.path(), false, 2).unwrap();
        d
    };
    // Unknown architecture.
    let d = fresh();
    edit_config(d.path(), |v| v["architectures"] = serde_json::json!(["GPT2LMHeadModel"]));
    expect_err(d.path(), "GPT2LMHeadModel");
    // A layer more than the weights have: the missing tensor is named.
    let d = fresh();
    edit_config(d.path(), |v| v["num_hidden_layers"] = serde_json::json!(5));
    expect_err(d.path(), "model.layers.4.");
    // A shape the config does not imply.
    let d = fresh();
    edit_config(d.path(), |v| v["intermediate_size"] = serde_json::json!(512));
    expect_err(d.path(), "mlp.");
    // Unsupported features.
    let d = fresh();
    edit_config(d.path(), |v| v["rope_scaling"] = serde_json::json!({"rope_type": "llama3"}));
    expect_err(d.path(), "rope_scaling");
    // A shard named by the index is gone.
    let d = fresh();
    std::fs::remove_file(d.path().join("model-00002-of-00002.safetensors")).unwrap();
    expect_err(d.path(), "model-00002-of-00002.safetensors");
    // Not JSON / not safetensors.
    let d = fresh();
    std::fs::write(d.path().join("config.json"), "{ not json").unwrap();
    expect_err(d.path(), "config.json");
    let d = fresh();
    std::fs::write(d.path().join("model-00001-of-00002.safetensors"), b"garbage").unwrap();
    expect_err(d.path(), "not a safetensors file");
    // A tensor of a dtype we do not read.
    let d = tempfile::tempdir().unwrap();
    RandomWeights::new(RandomPreset::Tiny.config(), 3).write_dir(d.path(), false, 1).unwrap();
    let bytes = std::fs::read(d.path().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
        .collect();
    for t in &mut owned {
        if t.0 == "model.norm.weight" {
            t.1 = safetensors::Dtype::I32;
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = owned
        .iter()
        .map(|(n, dt, s, b)| {
            (n.clone(), safetensors::tensor::TensorView::new(*dt, s.clone(), b).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &d.path().join("model.safetensors")).unwrap();
    expect_err(d.path(), "model.norm.weight");
    // Unknown random preset.
    assert!(matches!(Model::load("random:huge", 1), Err(LlmError::UnknownModel { .. })));
}
