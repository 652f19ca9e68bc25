//! Text ↔ token ids.
//!
//! The random models use a byte-level tokenizer: ids 0–255 are the bytes, [`BOS`] and [`EOS`]
//! follow. A model directory's `tokenizer.json` is not read yet: a directory without the
//! byte vocabulary is driven with token ids (`--prompt-ids`), and its output is given as ids.

/// Beginning of sequence (byte tokenizer).
pub const BOS: u32 = 256;
/// End of sequence (byte tokenizer).
pub const EOS: u32 = 257;

/// A tokenizer.
#[derive(Debug, Clone)]
pub enum Tokenizer {
    /// Bytes as ids, [`BOS`] first.
    Bytes,
}

impl Tokenizer {
    /// Token ids of `text`, BOS first.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        match self {
            Tokenizer::Bytes => std::iter::once(BOS).chain(text.bytes().map(u32::from)).collect(),
        }
    }

    /// The bytes a token stands for (empty for special tokens).
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        match self {
            Tokenizer::Bytes if id < 256 => vec![id as u8],
            Tokenizer::Bytes => Vec::new(),
        }
    }

    /// Text of `ids` (invalid UTF-8 replaced).
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().flat_map(|&i| self.token_bytes(i)).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// Turns a stream of token bytes into text pieces, holding back an incomplete UTF-8
/// sequence until its last byte arrives.
#[derive(Debug, Default, Clone)]
pub struct TextStream {
    pending: Vec<u8>,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_and_streams_hold_partial_utf8() {
        let t = Tokenizer::Bytes;
        let ids = t.encode("héllo");
        assert_eq!(ids[0], BOS);
        assert_eq!(t.decode(&ids), "héllo");
        let mut s = TextStream::default();
        let mut out = String::new();
        for id in &ids[1..] {
            out += &s.push(&t.token_bytes(*id));
        }
        out += &s.finish();
        assert_eq!(out, "héllo");
        let mut s = TextStream::default();
        assert_eq!(s.push(&[0xc3]), "");
        assert_eq!(s.push(&[0xa9]), "é");
    }
}
