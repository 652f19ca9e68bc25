//! The `fastlane kv serve` wire protocol, version 2 (spec: `docs/kvswap.md`).
//!
//! Every message is a 16-byte header then `len` payload bytes, all little endian:
//!
//! ```text
//! magic u32 = 0x5753_564B ("KVSW")  version u16 = 2  op u16  req_id u32  len u32
//! ```
//!
//! Replies carry `op | 0x8000` and the request's `req_id`; their payload starts with a
//! `status u32` (0 = OK, else an [`ErrorCode`]). The parser treats its input as hostile: it
//! checks magic, version, op, exact payload lengths and counts before it allocates, and a
//! [`ProtoError`] closes that connection only.
//!
//! Version 2 (per-connection device pools): `HELLO` carries the blocks the client wants and
//! its namespace, and its reply the client's own slab of the pool. A version-1 frame is
//! answered with a version-1 error reply ([`ErrorCode::VersionUnsupported`]) and the
//! connection is closed.
//!
//! Content-addressed ops (`PUT`, `GET`, `EXISTS`, `PIN`, `UNPIN`, `EVICT`, ops 12–17) were added
//! within version 2: every earlier op keeps its number and encoding, so a client that never
//! sends them sees no change, and a server without them closes the connection of a client that
//! does (unknown op). Their keys are the client's 32-byte names; the server qualifies each by
//! the connection's namespace before it touches its store.
// Bytes from a peer: errors, not panics.
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

use crate::error::KvSwapError;

/// `"KVSW"` read as a little-endian u32.
pub const MAGIC: u32 = u32::from_le_bytes(*b"KVSW");
/// Protocol version.
pub const VERSION: u16 = 2;
/// Longest namespace name in a `HELLO`.
pub const NAMESPACE_MAX: usize = 128;
/// Header bytes.
pub const HEADER_LEN: usize = 16;
/// Largest payload accepted (requests and replies).
pub const PAYLOAD_MAX: usize = 64 * 1024;
/// Most block ids in one request.
pub const BLOCKS_MAX: usize = (PAYLOAD_MAX - 12) / 4;
/// Reply bit of `op`.
pub const REPLY: u16 = 0x8000;
/// Bytes of a content key.
pub const KEY_BYTES: usize = 32;
/// Most keys in one `EXISTS`/`PIN`/`UNPIN`/`EVICT` (`count u32` then 32 bytes each).
pub const KEYS_MAX: usize = (PAYLOAD_MAX - 4) / KEY_BYTES;
/// Most `(key, block)` pairs in one `PUT`/`GET` (`count u32` then 36 bytes each).
pub const KEY_BLOCKS_MAX: usize = (PAYLOAD_MAX - 4) / (KEY_BYTES + 4);
// The limits fill a payload, and one more would not fit.
const _: () = assert!(4 + (KEY_BYTES + 4) * (KEY_BLOCKS_MAX + 1) > PAYLOAD_MAX);
const _: () = assert!(4 + KEY_BYTES * (KEYS_MAX + 1) > PAYLOAD_MAX);

/// A client's content key: 32 opaque bytes (e.g. a vLLM block hash or a
/// [`BlockKey`](crate::cas::BlockKey)); the server qualifies it by the connection's namespace.
pub type Key = [u8; KEY_BYTES];

/// Per-key answers of `EXISTS`: where the block is, nearest tier first.
pub mod located {
    /// On no tier.
    pub const ABSENT: u8 = 0;
    /// In the server's host memory.
    pub const HOST: u8 = 1;
    /// On the server's NVMe tier.
    pub const NVME: u8 = 2;
    /// In the shared cluster (a hint: a later `GET` may still miss).
    pub const CLUSTER: u8 = 3;
}

/// Operation codes.
pub mod op {
    /// Handshake; the reply carries the memfd of the client's own slab (SCM_RIGHTS).
    pub const HELLO: u16 = 1;
    /// Take device blocks for a sequence.
    pub const ALLOC: u16 = 2;
    /// Give device blocks back.
    pub const FREE: u16 = 3;
    /// Where a sequence is (vLLM: `lookup`).
    pub const LOOKUP: u16 = 4;
    /// Start a swap-out (vLLM: `prepare_store`).
    pub const PREPARE_STORE: u16 = 5;
    /// Wait for a ticket (vLLM: `complete_store` / `complete_load`).
    pub const COMPLETE: u16 = 6;
    /// Start a swap-in (vLLM: `prepare_load`).
    pub const PREPARE_LOAD: u16 = 7;
    /// Mark a sequence used (vLLM: `touch`).
    pub const TOUCH: u16 = 8;
    /// Forget a sequence.
    pub const DROP: u16 = 9;
    /// Cancel a ticket.
    pub const CANCEL: u16 = 10;
    /// Tier accounting.
    pub const STATS: u16 = 11;
    /// Copy blocks of the connection's slab into the content-addressed store under keys.
    pub const PUT: u16 = 12;
    /// Copy blocks found in the store by key into blocks of the connection's slab.
    pub const GET: u16 = 13;
    /// Where each key's block is (absent, host, nvme, cluster).
    pub const EXISTS: u16 = 14;
    /// Keep blocks in the server's host memory until unpinned (or the connection closes).
    pub const PIN: u16 = 15;
    /// Release this connection's pins.
    pub const UNPIN: u16 = 16;
    /// Remove unpinned blocks from the server's own tiers.
    pub const EVICT: u16 = 17;
}

/// Why a frame was refused (the connection is then closed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    /// Not enough bytes yet for a header or the payload it announces.
    #[error("incomplete frame")]
    Incomplete,
    /// Wrong magic.
    #[error("bad magic {0:#x}")]
    BadMagic(u32),
    /// Unsupported version.
    #[error("unsupported version {0}")]
    BadVersion(u16),
    /// Payload longer than [`PAYLOAD_MAX`].
    #[error("payload of {0} bytes is too long")]
    TooLong(u32),
    /// Unknown op.
    #[error("unknown op {0}")]
    BadOp(u16),
    /// The payload does not have the length the op needs.
    #[error("op {op}: payload of {len} bytes, expected {expected}")]
    BadLength {
        /// The op.
        op: u16,
        /// What came.
        len: usize,
        /// What it needs.
        expected: usize,
    },
    /// A field is out of range.
    #[error("op {op}: {what}")]
    BadField {
        /// The op.
        op: u16,
        /// What.
        what: &'static str,
    },
}

/// A message header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Operation (with [`REPLY`] on replies).
    pub op: u16,
    /// Caller's id, echoed in the reply.
    pub req_id: u32,
    /// Payload bytes.
    pub len: u32,
}

impl Header {
    /// Encodes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        self.encode_version(VERSION)
    }

    /// Encodes with another `version` (the server answers a client of an older version in
    /// that version, so that it can read the error).
    pub fn encode_version(&self, version: u16) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&version.to_le_bytes());
        b[6..8].copy_from_slice(&self.op.to_le_bytes());
        b[8..12].copy_from_slice(&self.req_id.to_le_bytes());
        b[12..16].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes and checks magic, version and length.
    pub fn decode(b: &[u8]) -> Result<Header, ProtoError> {
        if b.len() < HEADER_LEN {
            return Err(ProtoError::Incomplete);
        }
        let magic = u32_at(b, 0);
        if magic != MAGIC {
            return Err(ProtoError::BadMagic(magic));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(ProtoError::BadVersion(version));
        }
        let len = u32_at(b, 12);
        if len as usize > PAYLOAD_MAX {
            return Err(ProtoError::TooLong(len));
        }
        Ok(Header { op: u16::from_le_bytes([b[6], b[7]]), req_id: u32_at(b, 8), len })
    }
}

/// A decoded request. Sequence ids are the client's own (the server namespaces them per
/// connection); block lists are device block ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Handshake: the client's slab size and namespace.
    Hello {
        /// Device blocks wanted in the client's own slab; 0: the server's default.
        blocks: u32,
        /// Namespace (empty: the server's default, `uid:<uid>`); at most
        /// [`NAMESPACE_MAX`] bytes of `[A-Za-z0-9._:-]`.
        namespace: String,
    },
    /// Take `n` device blocks for `seq`.
    Alloc {
        /// Sequence.
        seq: u32,
        /// Blocks.
        n: u32,
    },
    /// Give blocks of `seq` back.
    Free {
        /// Sequence.
        seq: u32,
        /// Blocks.
        blocks: Vec<u32>,
    },
    /// Where `seq` is.
    Lookup {
        /// Sequence.
        seq: u32,
    },
    /// Swap `blocks` of `seq` out.
    PrepareStore {
        /// Sequence.
        seq: u32,
        /// Blocks, in order.
        blocks: Vec<u32>,
    },
    /// Wait up to `timeout_ms` for `ticket`.
    Complete {
        /// Ticket.
        ticket: u64,
        /// Bound on the wait (the server caps it at 60 s).
        timeout_ms: u32,
    },
    /// Swap `seq` back into `blocks`.
    PrepareLoad {
        /// Sequence.
        seq: u32,
        /// Blocks, in order.
        blocks: Vec<u32>,
    },
    /// Mark `seq` used.
    Touch {
        /// Sequence.
        seq: u32,
    },
    /// Forget `seq`.
    Drop {
        /// Sequence.
        seq: u32,
    },
    /// Cancel `ticket`.
    Cancel {
        /// Ticket.
        ticket: u64,
    },
    /// Accounting.
    Stats,
    /// Store each block under its key.
    Put {
        /// `(key, device block)` pairs.
        items: Vec<(Key, u32)>,
    },
    /// Fetch each key's block into its device block (a miss leaves the block untouched).
    Get {
        /// `(key, device block)` pairs.
        items: Vec<(Key, u32)>,
    },
    /// Where each key's block is.
    Exists {
        /// Keys.
        keys: Vec<Key>,
    },
    /// Pin each key's block in host memory for this connection.
    Pin {
        /// Keys.
        keys: Vec<Key>,
    },
    /// Release one of this connection's pins of each key.
    Unpin {
        /// Keys.
        keys: Vec<Key>,
    },
    /// Remove each key's (unpinned) block from the server's tiers.
    Evict {
        /// Keys.
        keys: Vec<Key>,
    },
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

fn u64_at(b: &[u8], i: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[i..i + 8]);
    u64::from_le_bytes(a)
}

impl Request {
    /// The op code.
    pub fn op(&self) -> u16 {
        match self {
            Request::Hello { .. } => op::HELLO,
            Request::Alloc { .. } => op::ALLOC,
            Request::Free { .. } => op::FREE,
            Request::Lookup { .. } => op::LOOKUP,
            Request::PrepareStore { .. } => op::PREPARE_STORE,
            Request::Complete { .. } => op::COMPLETE,
            Request::PrepareLoad { .. } => op::PREPARE_LOAD,
            Request::Touch { .. } => op::TOUCH,
            Request::Drop { .. } => op::DROP,
            Request::Cancel { .. } => op::CANCEL,
            Request::Stats => op::STATS,
            Request::Put { .. } => op::PUT,
            Request::Get { .. } => op::GET,
            Request::Exists { .. } => op::EXISTS,
            Request::Pin { .. } => op::PIN,
            Request::Unpin { .. } => op::UNPIN,
            Request::Evict { .. } => op::EVICT,
        }
    }

    /// Decodes a payload for `op`.
    pub fn decode(opc: u16, p: &[u8]) -> Result<Request, ProtoError> {
        let exact = |n: usize| {
            if p.len() == n {
                Ok(())
            } else {
                Err(ProtoError::BadLength { op: opc, len: p.len(), expected: n })
            }
        };
        // seq u32, count u32, count × u32.
        let seq_blocks = || -> Result<(u32, Vec<u32>), ProtoError> {
            if p.len() < 8 {
                return Err(ProtoError::BadLength { op: opc, len: p.len(), expected: 8 });
            }
            let count = u32_at(p, 4) as usize;
            if count > BLOCKS_MAX {
                return Err(ProtoError::BadField { op: opc, what: "block count" });
            }
            exact(8 + 4 * count)?;
            Ok((u32_at(p, 0), (0..count).map(|i| u32_at(p, 8 + 4 * i)).collect()))
        };
        let key_at = |i: usize| {
            let mut k = [0u8; KEY_BYTES];
            k.copy_from_slice(&p[i..i + KEY_BYTES]);
            k
        };
        // count u32, count × stride bytes; the count is checked against `max` and the exact
        // length before anything is allocated.
        let counted = |stride: usize, max: usize| -> Result<usize, ProtoError> {
            if p.len() < 4 {
                return Err(ProtoError::BadLength { op: opc, len: p.len(), expected: 4 });
            }
            let count = u32_at(p, 0) as usize;
            if count > max {
                return Err(ProtoError::BadField { op: opc, what: "key count" });
            }
            exact(4 + stride * count)?;
            Ok(count)
        };
        // count u32, count × (key [u8; 32], block u32).
        let key_blocks = || -> Result<Vec<(Key, u32)>, ProtoError> {
            let count = counted(KEY_BYTES + 4, KEY_BLOCKS_MAX)?;
            Ok((0..count)
                .map(|i| {
                    let at = 4 + (KEY_BYTES + 4) * i;
                    (key_at(at), u32_at(p, at + KEY_BYTES))
                })
                .collect())
        };
        // count u32, count × key [u8; 32].
        let keys = || -> Result<Vec<Key>, ProtoError> {
            let count = counted(KEY_BYTES, KEYS_MAX)?;
            Ok((0..count).map(|i| key_at(4 + KEY_BYTES * i)).collect())
        };
        Ok(match opc {
            op::HELLO => {
                // blocks u32, ns_len u32, ns_len bytes.
                if p.len() < 8 {
                    return Err(ProtoError::BadLength { op: opc, len: p.len(), expected: 8 });
                }
                let ns_len = u32_at(p, 4) as usize;
                if ns_len > NAMESPACE_MAX {
                    return Err(ProtoError::BadField { op: opc, what: "namespace length" });
                }
                exact(8 + ns_len)?;
                let ns = &p[8..];
                if !ns.iter().all(|c| namespace_byte(*c)) {
                    return Err(ProtoError::BadField { op: opc, what: "namespace characters" });
                }
                // All ASCII (checked above), so this is valid UTF-8 and nothing is replaced.
                let namespace = String::from_utf8_lossy(ns).into_owned();
                Request::Hello { blocks: u32_at(p, 0), namespace }
            }
            op::ALLOC => {
                exact(8)?;
                let n = u32_at(p, 4);
                if n as usize > BLOCKS_MAX {
                    return Err(ProtoError::BadField { op: opc, what: "block count" });
                }
                Request::Alloc { seq: u32_at(p, 0), n }
            }
            op::FREE => {
                let (seq, blocks) = seq_blocks()?;
                Request::Free { seq, blocks }
            }
            op::LOOKUP | op::TOUCH | op::DROP => {
                exact(4)?;
                let seq = u32_at(p, 0);
                match opc {
                    op::LOOKUP => Request::Lookup { seq },
                    op::TOUCH => Request::Touch { seq },
                    _ => Request::Drop { seq },
                }
            }
            op::PREPARE_STORE => {
                let (seq, blocks) = seq_blocks()?;
                Request::PrepareStore { seq, blocks }
            }
            op::PREPARE_LOAD => {
                let (seq, blocks) = seq_blocks()?;
                Request::PrepareLoad { seq, blocks }
            }
            op::COMPLETE => {
                exact(12)?;
                Request::Complete { ticket: u64_at(p, 0), timeout_ms: u32_at(p, 8) }
            }
            op::CANCEL => {
                exact(8)?;
                Request::Cancel { ticket: u64_at(p, 0) }
            }
            op::STATS => {
                exact(0)?;
                Request::Stats
            }
            op::PUT => Request::Put { items: key_blocks()? },
            op::GET => Request::Get { items: key_blocks()? },
            op::EXISTS => Request::Exists { keys: keys()? },
            op::PIN => Request::Pin { keys: keys()? },
            op::UNPIN => Request::Unpin { keys: keys()? },
            op::EVICT => Request::Evict { keys: keys()? },
            other => return Err(ProtoError::BadOp(other)),
        })
    }

    /// Encodes the payload.
    pub fn encode_payload(&self, out: &mut Vec<u8>) {
        let seq_blocks = |out: &mut Vec<u8>, seq: u32, blocks: &[u32]| {
            out.extend_from_slice(&seq.to_le_bytes());
            out.extend_from_slice(&(blocks.len() as u32).to_le_bytes());
            for b in blocks {
                out.extend_from_slice(&b.to_le_bytes());
            }
        };
        match self {
            Request::Hello { blocks, namespace } => {
                out.extend_from_slice(&blocks.to_le_bytes());
                out.extend_from_slice(&(namespace.len() as u32).to_le_bytes());
                out.extend_from_slice(namespace.as_bytes());
            }
            Request::Stats => {}
            Request::Alloc { seq, n } => {
                out.extend_from_slice(&seq.to_le_bytes());
                out.extend_from_slice(&n.to_le_bytes());
            }
            Request::Free { seq, blocks }
            | Request::PrepareStore { seq, blocks }
            | Request::PrepareLoad { seq, blocks } => seq_blocks(out, *seq, blocks),
            Request::Lookup { seq } | Request::Touch { seq } | Request::Drop { seq } => {
                out.extend_from_slice(&seq.to_le_bytes())
            }
            Request::Complete { ticket, timeout_ms } => {
                out.extend_from_slice(&ticket.to_le_bytes());
                out.extend_from_slice(&timeout_ms.to_le_bytes());
            }
            Request::Cancel { ticket } => out.extend_from_slice(&ticket.to_le_bytes()),
            Request::Put { items } | Request::Get { items } => {
                out.extend_from_slice(&(items.len() as u32).to_le_bytes());
                for (key, block) in items {
                    out.extend_from_slice(key);
                    out.extend_from_slice(&block.to_le_bytes());
                }
            }
            Request::Exists { keys }
            | Request::Pin { keys }
            | Request::Unpin { keys }
            | Request::Evict { keys } => {
                out.extend_from_slice(&(keys.len() as u32).to_le_bytes());
                for key in keys {
                    out.extend_from_slice(key);
                }
            }
        }
    }

    /// A whole frame (header + payload).
    pub fn encode(&self, req_id: u32) -> Vec<u8> {
        let mut payload = Vec::new();
        self.encode_payload(&mut payload);
        let h = Header { op: self.op(), req_id, len: payload.len() as u32 };
        let mut out = h.encode().to_vec();
        out.extend_from_slice(&payload);
        out
    }
}

/// Whether `c` may appear in a namespace name.
pub fn namespace_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b':' | b'-')
}

/// The payload of a successful `HELLO` reply (after the status): the client's own slab of
/// the device pool, whose memfd rides on the same message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HelloReply {
    /// Bytes per device block.
    pub block_bytes: u64,
    /// Block id of the slab's first block (block ids on the wire are pool-wide).
    pub first_block: u32,
    /// Blocks in the slab.
    pub blocks: u32,
    /// Bytes to map from the memfd (`block_bytes × blocks`).
    pub map_len: u64,
    /// The namespace the connection is in.
    pub namespace: String,
}

impl HelloReply {
    /// Encodes: `block_bytes u64, first_block u32, blocks u32, map_len u64, ns_len u32,
    /// ns_len bytes`.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(28 + self.namespace.len());
        b.extend_from_slice(&self.block_bytes.to_le_bytes());
        b.extend_from_slice(&self.first_block.to_le_bytes());
        b.extend_from_slice(&self.blocks.to_le_bytes());
        b.extend_from_slice(&self.map_len.to_le_bytes());
        b.extend_from_slice(&(self.namespace.len() as u32).to_le_bytes());
        b.extend_from_slice(self.namespace.as_bytes());
        b
    }

    /// Decodes and checks lengths and that `map_len` is the slab's size.
    pub fn decode(p: &[u8]) -> Result<HelloReply, ProtoError> {
        let bad = |what| ProtoError::BadField { op: op::HELLO | REPLY, what };
        if p.len() < 28 {
            return Err(ProtoError::BadLength {
                op: op::HELLO | REPLY,
                len: p.len(),
                expected: 28,
            });
        }
        let ns_len = u32_at(p, 24) as usize;
        if ns_len > NAMESPACE_MAX || p.len() != 28 + ns_len {
            return Err(bad("namespace length"));
        }
        if !p[28..].iter().all(|c| namespace_byte(*c)) {
            return Err(bad("namespace characters"));
        }
        let r = HelloReply {
            block_bytes: u64_at(p, 0),
            first_block: u32_at(p, 8),
            blocks: u32_at(p, 12),
            map_len: u64_at(p, 16),
            namespace: String::from_utf8_lossy(&p[28..]).into_owned(),
        };
        let size = r.block_bytes.checked_mul(u64::from(r.blocks));
        if r.blocks == 0 || size != Some(r.map_len) || r.first_block.checked_add(r.blocks).is_none()
        {
            return Err(bad("slab size"));
        }
        Ok(r)
    }
}

/// Decodes one frame at the start of `buf`: the request and the bytes it used.
pub fn decode_frame(buf: &[u8]) -> Result<(Header, Request, usize), ProtoError> {
    let h = Header::decode(buf)?;
    let end = HEADER_LEN + h.len as usize;
    if buf.len() < end {
        return Err(ProtoError::Incomplete);
    }
    let r = Request::decode(h.op, &buf[HEADER_LEN..end])?;
    Ok((h, r, end))
}

/// The fuzz oracle: decodes `data` as a stream of frames; every frame that decodes must
/// re-encode to exactly the bytes it came from; the first refusal ends the stream (as it
/// ends a connection). Panics on a violation. Returns the frames decoded.
pub fn check_frame_model(data: &[u8]) -> usize {
    let mut rest = data;
    let mut frames = 0;
    while let Ok((h, req, used)) = decode_frame(rest) {
        assert!(used <= rest.len() && used >= HEADER_LEN);
        let again = req.encode(h.req_id);
        assert_eq!(&again[..], &rest[..used], "re-encoding differs");
        rest = &rest[used..];
        frames += 1;
    }
    frames
}

/// Status codes in replies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum ErrorCode {
    /// Success.
    Ok = 0,
    /// Unknown sequence.
    UnknownSequence = 1,
    /// Double swap-out.
    DoubleSwapOut = 2,
    /// Not swapped out.
    NotSwappedOut = 3,
    /// Transfer in flight.
    Busy = 4,
    /// No tier has room.
    TierFull = 5,
    /// Tenant quota.
    QuotaExceeded = 6,
    /// Remote peer gone.
    RemotePeerGone = 7,
    /// Block pinned by a transfer.
    BlockPinned = 8,
    /// Block not the sequence's (or out of range).
    BlockNotOwned = 9,
    /// Block named twice.
    DuplicateBlock = 10,
    /// Device pool full.
    DeviceFull = 11,
    /// Block count differs from the swapped-out copy.
    BlockCountMismatch = 12,
    /// Checksum mismatch on swap-in.
    ChecksumMismatch = 13,
    /// Tier I/O error.
    TierIo = 14,
    /// Cancelled.
    Cancelled = 15,
    /// Unknown ticket.
    UnknownTicket = 16,
    /// Wait timed out (the transfer goes on).
    Timeout = 17,
    /// The peer's credentials are not on the server's allow-list (sent, then closed).
    PeerRefused = 18,
    /// A request other than `HELLO` before a successful `HELLO`.
    HelloRequired = 19,
    /// The namespace asked for at `HELLO` is not open to this peer.
    NamespaceRefused = 20,
    /// The frame's protocol version is not this server's (sent in the peer's version, then
    /// closed).
    VersionUnsupported = 21,
    /// A content-addressed op on a server without a store (`--cas-bytes 0`).
    StoreDisabled = 22,
    /// Anything else.
    Other = 99,
}

impl ErrorCode {
    /// The code for an engine error.
    pub fn of(e: &KvSwapError) -> ErrorCode {
        match e {
            KvSwapError::UnknownSequence { .. } => ErrorCode::UnknownSequence,
            KvSwapError::DoubleSwapOut { .. } => ErrorCode::DoubleSwapOut,
            KvSwapError::NotSwappedOut { .. } => ErrorCode::NotSwappedOut,
            KvSwapError::Busy { .. } => ErrorCode::Busy,
            KvSwapError::TierFull { .. } => ErrorCode::TierFull,
            KvSwapError::QuotaExceeded { .. } => ErrorCode::QuotaExceeded,
            KvSwapError::RemotePeerGone { .. } => ErrorCode::RemotePeerGone,
            KvSwapError::BlockPinned { .. } => ErrorCode::BlockPinned,
            KvSwapError::BlockNotOwned { .. } => ErrorCode::BlockNotOwned,
            KvSwapError::DuplicateBlock { .. } => ErrorCode::DuplicateBlock,
            KvSwapError::DeviceFull { .. } => ErrorCode::DeviceFull,
            KvSwapError::BlockCountMismatch { .. } => ErrorCode::BlockCountMismatch,
            KvSwapError::ChecksumMismatch { .. } => ErrorCode::ChecksumMismatch,
            KvSwapError::TierIo { .. } => ErrorCode::TierIo,
            KvSwapError::Cancelled => ErrorCode::Cancelled,
            KvSwapError::UnknownTicket { .. } => ErrorCode::UnknownTicket,
            KvSwapError::Timeout { .. } => ErrorCode::Timeout,
            _ => ErrorCode::Other,
        }
    }

    /// From the wire.
    pub fn from_u32(v: u32) -> ErrorCode {
        use ErrorCode::*;
        [
            Ok,
            UnknownSequence,
            DoubleSwapOut,
            NotSwappedOut,
            Busy,
            TierFull,
            QuotaExceeded,
            RemotePeerGone,
            BlockPinned,
            BlockNotOwned,
            DuplicateBlock,
            DeviceFull,
            BlockCountMismatch,
            ChecksumMismatch,
            TierIo,
            Cancelled,
            UnknownTicket,
            Timeout,
            PeerRefused,
            HelloRequired,
            NamespaceRefused,
            VersionUnsupported,
            StoreDisabled,
        ]
        .get(v as usize)
        .copied()
        .unwrap_or(Other)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_every_request() {
        let reqs = [
            Request::Hello { blocks: 0, namespace: String::new() },
            Request::Hello { blocks: 7, namespace: "team-a:prod_1.x".into() },
            Request::Alloc { seq: 3, n: 9 },
            Request::Free { seq: 3, blocks: vec![1, 2] },
            Request::Lookup { seq: 4 },
            Request::PrepareStore { seq: 3, blocks: vec![5, 6, 7] },
            Request::Complete { ticket: 99, timeout_ms: 10 },
            Request::PrepareLoad { seq: 3, blocks: vec![] },
            Request::Touch { seq: 1 },
            Request::Drop { seq: 1 },
            Request::Cancel { ticket: 5 },
            Request::Stats,
            Request::Put { items: vec![([1; KEY_BYTES], 4), ([2; KEY_BYTES], 5)] },
            Request::Put { items: vec![] },
            Request::Get { items: vec![([3; KEY_BYTES], u32::MAX)] },
            Request::Exists { keys: vec![[4; KEY_BYTES], [5; KEY_BYTES]] },
            Request::Exists { keys: vec![] },
            Request::Pin { keys: vec![[6; KEY_BYTES]] },
            Request::Unpin { keys: vec![[7; KEY_BYTES]] },
            Request::Evict { keys: vec![[8; KEY_BYTES], [8; KEY_BYTES]] },
            Request::Put { items: vec![([9; KEY_BYTES], 1); KEY_BLOCKS_MAX] },
            Request::Evict { keys: vec![[10; KEY_BYTES]; KEYS_MAX] },
        ];
        for r in reqs {
            let f = r.encode(42);
            let (h, d, used) = decode_frame(&f).unwrap();
            assert_eq!((h.req_id, d, used), (42, r, f.len()));
            for cut in 0..f.len() {
                assert!(decode_frame(&f[..cut]).is_err());
            }
        }
    }

    #[test]
    fn hostile_frames_are_refused() {
        let mut f = Request::PrepareStore { seq: 1, blocks: vec![1] }.encode(1);
        f[23] = 0xff; // count = huge
        assert!(matches!(decode_frame(&f), Err(ProtoError::BadField { .. })));
        let mut f = Request::Stats.encode(1);
        f[12] = 0xff;
        f[13] = 0xff;
        f[14] = 0xff;
        assert!(matches!(decode_frame(&f), Err(ProtoError::TooLong(_))));
        let mut f = Request::Stats.encode(1);
        f[0] = 0;
        assert!(matches!(decode_frame(&f), Err(ProtoError::BadMagic(_))));
        let mut f = Request::Stats.encode(1);
        f[6] = 77;
        assert!(matches!(decode_frame(&f), Err(ProtoError::BadOp(77))));
        let mut f = Request::Stats.encode(1);
        f[4] = 1; // version 1
        assert!(matches!(decode_frame(&f), Err(ProtoError::BadVersion(1))));
        let f = Request::Hello { blocks: 1, namespace: "a/b".into() }.encode(1);
        assert!(matches!(decode_frame(&f), Err(ProtoError::BadField { .. })));
        let mut f = Request::Hello { blocks: 1, namespace: "ab".into() }.encode(1);
        f[20] = 200; // namespace length past the payload and the limit
        assert!(decode_frame(&f).is_err());
    }

    #[test]
    fn hostile_content_addressed_frames_are_refused() {
        assert_eq!((KEY_BLOCKS_MAX, KEYS_MAX), (1820, 2047));
        let with_count = |opc: u16, count: u32, body: usize| {
            let mut p = count.to_le_bytes().to_vec();
            p.resize(4 + body, 0xab);
            let h = Header { op: opc, req_id: 1, len: p.len() as u32 };
            let mut f = h.encode().to_vec();
            f.extend_from_slice(&p);
            f
        };
        for opc in [op::PUT, op::GET] {
            // A count the payload does not carry, a count over the limit, a stray byte, a
            // key cut short, no count at all.
            for (count, body) in [(2, 36), (KEY_BLOCKS_MAX as u32 + 1, 0), (1, 37), (1, 35)] {
                let f = with_count(opc, count, body);
                assert!(
                    matches!(
                        decode_frame(&f),
                        Err(ProtoError::BadLength { .. } | ProtoError::BadField { .. })
                    ),
                    "op {opc} count {count} body {body}"
                );
            }
            let f = Header { op: opc, req_id: 1, len: 3 }.encode().to_vec();
            let mut f3 = f.clone();
            f3.extend_from_slice(&[1, 0, 0]);
            assert!(matches!(decode_frame(&f3), Err(ProtoError::BadLength { .. })));
            let f = with_count(opc, u32::MAX, 0);
            assert!(matches!(decode_frame(&f), Err(ProtoError::BadField { .. })));
        }
        for opc in [op::EXISTS, op::PIN, op::UNPIN, op::EVICT] {
            for (count, body) in [(2, 32), (KEYS_MAX as u32 + 1, 0), (1, 33), (1, 36), (0, 1)] {
                let f = with_count(opc, count, body);
                assert!(decode_frame(&f).is_err(), "op {opc} count {count} body {body}");
            }
            assert_eq!(
                decode_frame(&with_count(opc, 1, 32)).map(|(_, r, _)| r.op()),
                Ok(opc),
                "a well-formed op {opc}"
            );
        }
        // A key-only payload is not a PUT (stride 36, not 32).
        assert!(decode_frame(&with_count(op::PUT, 1, 32)).is_err());
        assert_eq!(ErrorCode::from_u32(22), ErrorCode::StoreDisabled);
        assert_eq!(ErrorCode::from_u32(23), ErrorCode::Other);
    }

    #[test]
    fn hello_reply_round_trips_and_checks_the_slab_size() {
        let r = HelloReply {
            block_bytes: 4096,
            first_block: 8,
            blocks: 4,
            map_len: 4 * 4096,
            namespace: "uid:1000".into(),
        };
        assert_eq!(HelloReply::decode(&r.encode()).unwrap(), r);
        let e = r.encode();
        for cut in 0..e.len() {
            assert!(HelloReply::decode(&e[..cut]).is_err());
        }
        let wrong = HelloReply { map_len: 4096, ..r.clone() };
        assert!(HelloReply::decode(&wrong.encode()).is_err());
        let empty = HelloReply { blocks: 0, map_len: 0, ..r };
        assert!(HelloReply::decode(&empty.encode()).is_err());
    }
}
