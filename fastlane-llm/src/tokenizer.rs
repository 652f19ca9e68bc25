//! Text ↔ token ids.
//!
//! - A model directory's `tokenizer.json` is read with Hugging Face's `tokenizers` crate
//!   (pure-Rust regex backend): BPE, WordPiece, Unigram, with the checkpoint's normalizer,
//!   pre-tokenizer, post-processor (BOS) and decoder.
//! - The random models use a byte-level vocabulary: ids 0–255 are the bytes, [`BOS`] and
//!   [`EOS`] follow. `fastlane llm make-random` writes it as a `tokenizer.json` too (a
//!   byte-level BPE without merges whose ids are the bytes), so both paths give the same ids.

use std::path::Path;

use crate::error::LlmError;

/// Beginning of sequence (byte tokenizer).
pub const BOS: u32 = 256;
/// End of sequence (byte tokenizer).
pub const EOS: u32 = 257;

/// A tokenizer.
#[derive(Clone)]
pub enum Tokenizer {
    /// Bytes as ids, [`BOS`] first.
    Bytes,
    /// A `tokenizer.json`.
    Hf(Box<tokenizers::Tokenizer>),
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tokenizer::Bytes => f.write_str("Tokenizer::Bytes"),
            Tokenizer::Hf(t) => write!(f, "Tokenizer::Hf({} tokens)", t.get_vocab_size(true)),
        }
    }
}

impl Tokenizer {
    /// Reads `path` (a `tokenizer.json`).
    pub fn from_file(path: &Path) -> Result<Tokenizer, LlmError> {
        let t = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| LlmError::Tokenizer { reason: format!("{}: {e}", path.display()) })?;
        Ok(Tokenizer::Hf(Box::new(t)))
    }

    /// Token ids of `text`, with the tokenizer's special tokens (BOS).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, LlmError> {
        match self {
            Tokenizer::Bytes => {
                Ok(std::iter::once(BOS).chain(text.bytes().map(u32::from)).collect())
            }
            Tokenizer::Hf(t) => t
                .encode(text, true)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| LlmError::Tokenizer { reason: format!("encoding: {e}") }),
        }
    }

    /// Text of `ids` (special tokens skipped, invalid UTF-8 replaced).
    pub fn decode(&self, ids: &[u32]) -> String {
        match self {
            Tokenizer::Bytes => {
                let bytes: Vec<u8> = ids.iter().filter(|&&i| i < 256).map(|&i| i as u8).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            }
            Tokenizer::Hf(t) => t.decode(ids, true).unwrap_or_default(),
        }
    }

    /// The bytes of one token alone: a byte token's byte, a vocabulary token's text (the
    /// logprobs' `bytes`; special tokens have none).
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        match self {
            Tokenizer::Bytes => u8::try_from(id).map(|b| vec![b]).unwrap_or_default(),
            Tokenizer::Hf(t) => t.decode(&[id], true).unwrap_or_default().into_bytes(),
        }
    }

    /// The text `generated` adds since the last call for this stream (held back while it
    /// ends inside a UTF-8 sequence).
    pub fn piece(&self, generated: &[u32], st: &mut TextStream) -> String {
        match self {
            Tokenizer::Bytes => {
                let Some(&id) = generated.last() else { return String::new() };
                let byte = [id as u8];
                st.push(if id < 256 { &byte[..] } else { &[] })
            }
            Tokenizer::Hf(_) => {
                // Decoding a token alone is wrong for SentencePiece-style vocabularies
                // (leading spaces, byte fallback), and decoding the whole output every token
                // is quadratic. Decode a window instead: the tokens not yet emitted plus the
                // ones of the last piece as context, and emit what the new tokens add to the
                // context's text. Constant work per token.
                let (p, r) = (st.prefix_offset.min(generated.len()), st.read_offset);
                let r = r.clamp(p, generated.len());
                let context = self.decode(&generated[p..r]);
                let window = self.decode(&generated[p..]);
                // An incomplete UTF-8 sequence is held back, but never for more than
                // `HOLD_TOKENS_MAX` tokens (an output of invalid bytes must not grow the
                // window without bound).
                let held = generated.len() - r;
                if window.len() <= context.len()
                    || (window.ends_with('\u{fffd}') && held < HOLD_TOKENS_MAX)
                {
                    return String::new();
                }
                let mut from = context.len();
                while !window.is_char_boundary(from) {
                    from -= 1;
                }
                st.prefix_offset = r;
                st.read_offset = generated.len();
                window[from..].to_string()
            }
        }
    }
}

/// Tokens an incomplete UTF-8 sequence may be held back over (a character is at most 4
/// bytes, so 4 byte-fallback tokens).
const HOLD_TOKENS_MAX: usize = 4;

/// Turns a stream of tokens into text pieces, holding back an incomplete UTF-8 sequence
/// until its last byte arrives.
#[derive(Debug, Default, Clone)]
pub struct TextStream {
    pending: Vec<u8>,
    /// Decoded vocabularies: the first token of the context window ...
    prefix_offset: usize,
    /// ... and the first token not yet emitted.
    read_offset: usize,
}

impl TextStream {
    /// Adds a token's bytes; returns the text that is now complete.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(_) => self.pending.len(),
            Err(e) if e.error_len().is_none() && self.pending.len() - e.valid_up_to() < 4 => {
                e.valid_up_to()
            }
            // An invalid sequence: emit it replaced rather than hold it forever.
            Err(_) => self.pending.len(),
        };
        let out: Vec<u8> = self.pending.drain(..valid).collect();
        String::from_utf8_lossy(&out).into_owned()
    }

    /// Whatever is still held back, replaced.
    pub fn finish(&mut self) -> String {
        let out = std::mem::take(&mut self.pending);
        String::from_utf8_lossy(&out).into_owned()
    }
}

/// GPT-2's byte → printable character map (byte-level BPE vocabularies spell bytes so).
fn byte_char(b: u8) -> char {
    let printable = |b: u8| {
        (b'!'..=b'~').contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    };
    if printable(b) {
        return char::from(b);
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).expect("below 0x200")
}

/// The byte vocabulary as a `tokenizer.json`: byte-level BPE without merges, id = byte,
/// `<s>` = [`BOS`] prepended by the post-processor, `</s>` = [`EOS`].
pub fn byte_tokenizer_json() -> serde_json::Value {
    let vocab: serde_json::Map<String, serde_json::Value> =
        (0..=255u8).map(|b| (byte_char(b).to_string(), serde_json::json!(b))).collect();
    let special = |id: u32, content: &str| {
        serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true})
    };
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(BOS, "<s>"), special(EOS, "</s>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [BOS], "tokens": ["<s>"]}}
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": []}
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_and_streams_hold_partial_utf8() {
        let t = Tokenizer::Bytes;
        let ids = t.encode("héllo").unwrap();
        assert_eq!(ids[0], BOS);
        assert_eq!(t.decode(&ids), "héllo");
        let mut s = TextStream::default();
        let mut out = String::new();
        for i in 1..ids.len() {
            out += &t.piece(&ids[1..=i], &mut s);
        }
        out += &s.finish();
        assert_eq!(out, "héllo");
        let mut s = TextStream::default();
        assert_eq!(s.push(&[0xc3]), "");
        assert_eq!(s.push(&[0xa9]), "é");
    }

    #[test]
    fn the_byte_tokenizer_json_gives_the_byte_ids() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("tokenizer.json");
        std::fs::write(&p, byte_tokenizer_json().to_string()).unwrap();
        let hf = Tokenizer::from_file(&p).unwrap();
        let long = "a long output, ünïcödé ✓ and all, ".repeat(200);
        for text in ["hello world", "héllo, wörld! ✓\n\ttabs", "", &long] {
            assert_eq!(
                hf.encode(text).unwrap(),
                Tokenizer::Bytes.encode(text).unwrap(),
                "{text:?}"
            );
            let ids = hf.encode(text).unwrap();
            assert_eq!(hf.decode(&ids), text);
            // Streaming pieces add up to the text.
            let mut st = TextStream::default();
            let pieces: String = (1..ids.len())
                .map(|i| {
                    let p = hf.piece(&ids[1..=i], &mut st);
                    // The decoded window stays a few tokens long, however long the output.
                    assert!(i - st.prefix_offset <= 2 * HOLD_TOKENS_MAX, "{i} {st:?}");
                    p
                })
                .collect();
            assert_eq!(pieces, text);
        }
        assert!(Tokenizer::from_file(&dir.path().join("missing.json")).is_err());
    }
}
