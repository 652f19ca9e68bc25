//! Content-addressed KV blocks: keys that name a block by what it holds, not by who holds it.
//!
//! A block of the KV cache is a pure function of the model, the cache geometry and the tokens
//! from the start of the sequence up to the end of that block. So its key is a chain of
//! hashes, as in vLLM's prefix-cache block hashes:
//!
//! ```text
//! ModelDigest = BLAKE3-derive("fastlane kvswap model digest v1",
//!                             len u64 ‖ model id ‖ layers ‖ kv_heads ‖ head_dim ‖ dtype ‖ tokens_per_block)
//! in ns       = BLAKE3-derive("fastlane kvswap prefix namespace v1", digest ‖ len u64 ‖ ns)
//! key[0]      = BLAKE3-derive("fastlane kvswap block key v1", digest ‖ 0x00 ‖ n u32 ‖ tokens[0..n])
//! key[i]      = BLAKE3-derive("fastlane kvswap block key v1", digest ‖ 0x01 ‖ key[i-1] ‖ n u32 ‖ tokens[..])
//! ```
//!
//! (all integers little endian, token ids as `u32`). Two sequences that share their first `k`
//! full blocks of tokens share their first `k` keys, whatever follows; a different model id or
//! geometry gives different keys from the first block on; changing a token in block `i`
//! changes keys `i..` and none before. Partial blocks get no key: only full blocks are shared.
//!
//! A namespace ([`ModelDigest::in_namespace`], e.g. a tenant's prefix group) is a digest of its
//! own: chaining from it gives keys that share nothing with another namespace's, from the first
//! block on, so one namespace cannot find (or time) another's blocks.

use std::fmt;

use crate::geometry::{DType, KvGeometry};

const MODEL_CONTEXT: &str = "fastlane kvswap model digest v1";
const BLOCK_CONTEXT: &str = "fastlane kvswap block key v1";
const NAMESPACE_CONTEXT: &str = "fastlane kv serve namespaced key v1";
const PREFIX_NAMESPACE_CONTEXT: &str = "fastlane kvswap prefix namespace v1";

/// A 32-byte digest of a model id and its KV geometry; every [`BlockKey`] starts from one.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModelDigest(pub [u8; 32]);

/// The content address of one full KV block (see the module doc).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey(pub [u8; 32]);

fn dtype_code(d: DType) -> u32 {
    match d {
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::F32 => 3,
        DType::Fp8 => 4,
    }
}

impl ModelDigest {
    /// The digest of `model_id` (a name that pins the weights, e.g. a repository and revision)
    /// and every field of `geometry`.
    pub fn new(model_id: &str, geometry: &KvGeometry) -> ModelDigest {
        let mut h = blake3::Hasher::new_derive_key(MODEL_CONTEXT);
        // Length-prefixed, so no id can run into the geometry fields that follow it.
        h.update(&(model_id.len() as u64).to_le_bytes());
        h.update(model_id.as_bytes());
        for v in [
            geometry.layers,
            geometry.kv_heads,
            geometry.head_dim,
            dtype_code(geometry.dtype),
            geometry.tokens_per_block,
        ] {
            h.update(&v.to_le_bytes());
        }
        ModelDigest(*h.finalize().as_bytes())
    }

    /// This digest qualified by `namespace` (see the module doc): block keys chained from the
    /// result equal only those of the same model, geometry and namespace. Compute it once per
    /// namespace; it is the digest the chain starts from.
    pub fn in_namespace(&self, namespace: &str) -> ModelDigest {
        let mut h = blake3::Hasher::new_derive_key(PREFIX_NAMESPACE_CONTEXT);
        h.update(&self.0);
        h.update(&(namespace.len() as u64).to_le_bytes());
        h.update(namespace.as_bytes());
        ModelDigest(*h.finalize().as_bytes())
    }
}

impl BlockKey {
    /// The key of the block holding `tokens`, after the block `parent` (`None`: the first block
    /// of a sequence).
    pub fn chain(digest: &ModelDigest, parent: Option<&BlockKey>, tokens: &[u32]) -> BlockKey {
        let mut h = blake3::Hasher::new_derive_key(BLOCK_CONTEXT);
        h.update(&digest.0);
        match parent {
            None => {
                h.update(&[0u8]);
            }
            Some(p) => {
                h.update(&[1u8]);
                h.update(&p.0);
            }
        }
        h.update(&(tokens.len() as u32).to_le_bytes());
        let mut buf = [0u8; 256];
        for chunk in tokens.chunks(buf.len() / 4) {
            for (dst, t) in buf.chunks_exact_mut(4).zip(chunk) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            h.update(&buf[..chunk.len() * 4]);
        }
        BlockKey(*h.finalize().as_bytes())
    }

    /// The store key of a client's 32-byte `key` in `namespace`: `BLAKE3-derive("fastlane kv
    /// serve namespaced key v1", namespace ‖ 0x00 ‖ key)`. `fastlane kv serve` names every
    /// block a client stores or asks for this way, so clients of one namespace share blocks
    /// and no client can name a block of another namespace. A namespace never holds a 0 byte
    /// (`[A-Za-z0-9._:-]`), so no two (namespace, key) pairs hash the same input.
    pub fn in_namespace(namespace: &str, key: &[u8; 32]) -> BlockKey {
        let mut h = blake3::Hasher::new_derive_key(NAMESPACE_CONTEXT);
        h.update(namespace.as_bytes());
        h.update(&[0u8]);
        h.update(key);
        BlockKey(*h.finalize().as_bytes())
    }

    /// Parses 64 hex digits (either case).
    pub fn from_hex(text: &str) -> Option<BlockKey> {
        parse_hex32(text).map(BlockKey)
    }
}

/// The keys of the full blocks of `tokens`, `tokens_per_block` tokens each (pass the
/// geometry's `tokens_per_block`); a trailing partial block gets none, and
/// `tokens_per_block == 0` gives none.
pub fn prefix_keys(digest: &ModelDigest, tokens: &[u32], tokens_per_block: u32) -> Vec<BlockKey> {
    let n = tokens_per_block as usize;
    if n == 0 {
        return Vec::new();
    }
    let mut keys: Vec<BlockKey> = Vec::with_capacity(tokens.len() / n);
    for block in tokens.chunks_exact(n) {
        let key = BlockKey::chain(digest, keys.last(), block);
        keys.push(key);
    }
    keys
}

fn parse_hex32(text: &str) -> Option<[u8; 32]> {
    let bytes = text.as_bytes();
    if bytes.len() != 64 {
        return None;
    }
    let nibble = |c: u8| -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        }
    };
    let mut out = [0u8; 32];
    for (o, pair) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = (nibble(pair[0])? << 4) | nibble(pair[1])?;
    }
    Some(out)
}

fn write_hex(f: &mut fmt::Formatter<'_>, bytes: &[u8; 32]) -> fmt::Result {
    for b in bytes {
        write!(f, "{b:02x}")?;
    }
    Ok(())
}

impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_hex(f, &self.0)
    }
}

impl fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockKey({self})")
    }
}

impl fmt::Display for ModelDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_hex(f, &self.0)
    }
}

impl fmt::Debug for ModelDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ModelDigest({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(n: u32, seed: u32) -> Vec<u32> {
        (0..n).map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(seed) % 128_256).collect()
    }

    #[test]
    fn same_prefix_same_keys() {
        let d = ModelDigest::new("meta-llama/Llama-3.1-8B@main", &KvGeometry::LLAMA31_8B);
        let a = tokens(16 * 5 + 3, 7);
        let mut b = a[..16 * 3].to_vec();
        b.extend(tokens(40, 99));
        let ka = prefix_keys(&d, &a, 16);
        let kb = prefix_keys(&d, &b, 16);
        assert_eq!(ka.len(), 5, "partial block has no key");
        assert_eq!(kb.len(), 5);
        assert_eq!(ka[..3], kb[..3]);
        assert_ne!(ka[3], kb[3]);
        assert_eq!(ka, prefix_keys(&d, &a, 16), "deterministic");
        // Same as chaining by hand.
        let k0 = BlockKey::chain(&d, None, &a[..16]);
        let k1 = BlockKey::chain(&d, Some(&k0), &a[16..32]);
        assert_eq!(ka[..2], [k0, k1]);
        assert!(prefix_keys(&d, &a, 0).is_empty());
        assert!(prefix_keys(&d, &a[..15], 16).is_empty());
    }

    #[test]
    fn model_and_geometry_separate_keys() {
        let g = KvGeometry::LLAMA31_8B;
        let t = tokens(32, 1);
        let base = ModelDigest::new("llama", &g);
        let mut others = vec![
            ModelDigest::new("llama2", &g),
            ModelDigest::new("", &g),
            ModelDigest::new("llama", &KvGeometry::LLAMA31_70B),
        ];
        for f in 0..5 {
            let mut h = g;
            match f {
                0 => h.layers += 1,
                1 => h.kv_heads += 1,
                2 => h.head_dim += 1,
                3 => h.dtype = DType::BF16,
                _ => h.tokens_per_block += 1,
            }
            others.push(ModelDigest::new("llama", &h));
        }
        let kb = prefix_keys(&base, &t, 16);
        for (i, o) in others.iter().enumerate() {
            assert_ne!(*o, base, "digest {i}");
            let ko = prefix_keys(o, &t, 16);
            assert_ne!(ko[0], kb[0], "digest {i}");
            assert_ne!(ko[1], kb[1], "digest {i}");
        }
    }

    #[test]
    fn change_in_block_i_changes_keys_from_i_on() {
        let d = ModelDigest::new("m", &KvGeometry::LLAMA31_8B);
        let t = tokens(16 * 6, 3);
        let k = prefix_keys(&d, &t, 16);
        for i in 0..6 {
            let mut u = t.clone();
            u[i * 16 + 5] ^= 1;
            let ku = prefix_keys(&d, &u, 16);
            assert_eq!(k[..i], ku[..i], "block {i}: keys before it kept");
            for j in i..6 {
                assert_ne!(k[j], ku[j], "block {i}: key {j} must change");
            }
        }
        // Token ids are hashed as u32: 256 and 1 differ even though their low bytes match.
        let a = BlockKey::chain(&d, None, &[256]);
        let b = BlockKey::chain(&d, None, &[1]);
        assert_ne!(a, b);
        // A block's length is part of its key.
        assert_ne!(BlockKey::chain(&d, None, &[0]), BlockKey::chain(&d, None, &[0, 0]));
    }

    #[test]
    fn namespaces_separate_store_keys() {
        let k = [7u8; 32];
        let a = BlockKey::in_namespace("team-a", &k);
        assert_eq!(a, BlockKey::in_namespace("team-a", &k), "deterministic");
        assert_ne!(a, BlockKey::in_namespace("team-b", &k));
        assert_ne!(a, BlockKey::in_namespace("team-a", &[8u8; 32]));
        assert_ne!(a, BlockKey(k), "the client's key is not the store key");
        assert_ne!(BlockKey::in_namespace("", &k), BlockKey::in_namespace("uid:0", &k));
    }

    #[test]
    fn prefix_namespaces_separate_keys_from_the_first_block() {
        let d = ModelDigest::new("m", &KvGeometry::LLAMA31_8B);
        let t = tokens(16 * 3, 5);
        let a = prefix_keys(&d.in_namespace("tenant-a"), &t, 16);
        let b = prefix_keys(&d.in_namespace("tenant-b"), &t, 16);
        for i in 0..3 {
            assert_ne!(a[i], b[i], "block {i}");
        }
        assert_eq!(a, prefix_keys(&d.in_namespace("tenant-a"), &t, 16), "same namespace");
        assert_ne!(d.in_namespace("tenant-a"), d, "a namespace is not the bare digest");
        assert_ne!(d.in_namespace(""), d);
        let other = ModelDigest::new("m2", &KvGeometry::LLAMA31_8B);
        assert_ne!(other.in_namespace("tenant-a"), d.in_namespace("tenant-a"));
    }

    #[test]
    fn hex_round_trip() {
        let d = ModelDigest::new("m", &KvGeometry::LLAMA31_8B);
        let k = BlockKey::chain(&d, None, &tokens(100, 0));
        let s = k.to_string();
        assert_eq!(s.len(), 64);
        assert!(s.bytes().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        assert_eq!(BlockKey::from_hex(&s), Some(k));
        assert_eq!(BlockKey::from_hex(&s.to_ascii_uppercase()), Some(k));
        assert_eq!(BlockKey::from_hex(&s[1..]), None);
        assert_eq!(BlockKey::from_hex(&format!("{}g", &s[1..])), None);
        assert_eq!(d.to_string().len(), 64);
    }
}
