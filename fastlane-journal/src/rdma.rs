//! The journal's replica over RDMA (cargo feature `rdma`): [`RdmaReplica`] implements
//! [`Replica`] on `fastlane_rdma`'s write [`Mirror`], and [`RdmaReplicaServer`] is the other
//! end, which keeps the mirrored image in a file so that a replicated journal can be verified
//! (`fastlane journal verify`) on the replica too.
//!
//! # The mapping
//!
//! - [`Replica::write`]`(offset, bytes)` is `mirror.write(offset, bytes)`: RDMA WRITEs into
//!   the replica's registered region at the same offset, in the order posted (one RC queue
//!   pair), returning once the replica's device acknowledged them.
//! - [`Replica::sync`] first writes a *sync note* — the byte range `[lo, hi)` written since
//!   the last sync, with a generation number and a CRC32C — into the `NOTE_BYTES` the region
//!   holds past the journal image, then calls `mirror.sync(mode)`:
//!   - [`MirrorDurability::ReplicaAck`] (default): the replica process reads the note, copies
//!     `[lo, hi)` of the region into its file at the same offsets, `fdatasync`s it, and only
//!     then answers. An acknowledged seq is therefore on the replica's disk.
//!   - [`MirrorDurability::ReadAfterWrite`]: an RDMA READ behind the writes; the bytes are in
//!     the replica's memory, not its disk (the replica process writes the image to its file
//!     when the primary goes away).
//!
//! The note is written after the data on the same queue pair, so when the replica sees the
//! sync request the note and every byte it names are placed. The replica treats the note as
//! hostile input: magic, CRC, generation and bounds are checked before it is used.
//!
//! # Where the replica stands
//!
//! [`Replica::position`] is the same exchange with a *position request* note (its own magic,
//! the next generation, the offset to probe): the replica scans its file
//! ([`image_position`]), writes a CRC-protected answer (blank / not a journal / journal id,
//! records, last seq, end, head, clean, probe) at `ANSWER_AT` past the image, and only then
//! acknowledges; the primary reads the answer back with an RDMA READ and validates it (magic,
//! CRC, the generation it asked with, every enum and bound) before the journal checks it
//! against its own chain. The replica fills its fresh region from its file when a primary
//! connects, so the region and the file agree on everything the primary does not rewrite.
//!
//! # Failure
//!
//! Every RDMA wait is bounded by the connection's `op_timeout`; a replica process that dies
//! shows as [`RdmaError::PeerGone`] (socket closed or transport retries exhausted) or a
//! timeout, which `write`/`sync` turn into [`ReplicaError::Link`]. The journal's writer then
//! stops without publishing anything the replica did not acknowledge: what was acknowledged
//! stays acknowledged, nothing later is.

use std::fs::File;
use std::net::SocketAddr;
use std::os::unix::fs::FileExt;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use crc32c::crc32c;
use fastlane_rdma::{
    ConnectOptions, Device, Durability as MirrorDurability, Mirror, MirrorReplica, PollMode,
    RdmaError, RegisteredBuffer,
};

use super::format::{Chain, DATA_OFFSET};
use super::replica::{
    image_position, FileImage, Replica, ReplicaError, ReplicaJournal, ReplicaPosition,
};

/// Bytes the replica's region holds past the journal image, for the sync note.
pub const NOTE_BYTES: u64 = 4096;
/// Bytes of a sync note: magic, generation, lo, hi, CRC32C of the 32 bytes before it.
const NOTE_LEN: usize = 36;
const NOTE_MAGIC: [u8; 8] = *b"FLJRSYNC";
/// A position request: the same layout, `lo` = the offset to probe (`u64::MAX`: none), `hi` 0.
const POSITION_MAGIC: [u8; 8] = *b"FLJRPOSQ";
/// The replica's answer to a position request, at this offset past the image.
const ANSWER_AT: u64 = 64;
const ANSWER_LEN: usize = 108;
const ANSWER_MAGIC: [u8; 8] = *b"FLJRPOSA";
const STATE_BLANK: u32 = 0;
const STATE_FOREIGN: u32 = 1;
const STATE_JOURNAL: u32 = 2;
const FLAG_CLEAN: u32 = 1;
const FLAG_PROBE: u32 = 2;
const NO_PROBE: u64 = u64::MAX;
/// The replica copies the region to its file in pieces of this size.
const COPY_CHUNK: usize = 1 << 20;

fn link(e: RdmaError) -> ReplicaError {
    ReplicaError::Link(e.to_string())
}

fn encode_note(generation: u64, lo: u64, hi: u64) -> [u8; NOTE_LEN] {
    encode_request(NOTE_MAGIC, generation, lo, hi)
}

fn encode_request(magic: [u8; 8], generation: u64, lo: u64, hi: u64) -> [u8; NOTE_LEN] {
    let mut b = [0u8; NOTE_LEN];
    b[0..8].copy_from_slice(&magic);
    b[8..16].copy_from_slice(&generation.to_le_bytes());
    b[16..24].copy_from_slice(&lo.to_le_bytes());
    b[24..32].copy_from_slice(&hi.to_le_bytes());
    let crc = crc32c(&b[..32]);
    b[32..36].copy_from_slice(&crc.to_le_bytes());
    b
}

/// What the primary asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Request {
    /// Store `[lo, hi)`.
    Sync { generation: u64, lo: u64, hi: u64 },
    /// Report the position, probing this offset.
    Position { generation: u64, probe_end: Option<u64> },
}

/// A validated request note.
fn decode_request(b: &[u8; NOTE_LEN], image_bytes: u64) -> Result<Request, &'static str> {
    if b[0..8] == POSITION_MAGIC {
        let (generation, probe, zero) = decode_fields(b, POSITION_MAGIC)?;
        if zero != 0 || (probe != NO_PROBE && probe > image_bytes) {
            return Err("position request out of bounds");
        }
        let probe_end = (probe != NO_PROBE).then_some(probe);
        return Ok(Request::Position { generation, probe_end });
    }
    let (generation, lo, hi) = decode_note(b, image_bytes)?;
    Ok(Request::Sync { generation, lo, hi })
}

fn encode_answer(generation: u64, p: &ReplicaPosition) -> [u8; ANSWER_LEN] {
    let mut b = [0u8; ANSWER_LEN];
    b[0..8].copy_from_slice(&ANSWER_MAGIC);
    b[8..16].copy_from_slice(&generation.to_le_bytes());
    let state = match p {
        ReplicaPosition::Blank => STATE_BLANK,
        ReplicaPosition::Foreign => STATE_FOREIGN,
        ReplicaPosition::Journal(j) => {
            let flags = if j.clean { FLAG_CLEAN } else { 0 }
                | if j.probe.is_some() { FLAG_PROBE } else { 0 };
            b[20..24].copy_from_slice(&flags.to_le_bytes());
            b[24..40].copy_from_slice(&j.journal_id);
            b[40..48].copy_from_slice(&j.records.to_le_bytes());
            b[48..56].copy_from_slice(&j.last_seq.to_le_bytes());
            b[56..64].copy_from_slice(&j.end.to_le_bytes());
            b[64..80].copy_from_slice(&j.head);
            if let Some((seq, chain)) = j.probe {
                b[80..88].copy_from_slice(&seq.to_le_bytes());
                b[88..104].copy_from_slice(&chain);
            }
            STATE_JOURNAL
        }
    };
    b[16..20].copy_from_slice(&state.to_le_bytes());
    let crc = crc32c(&b[..104]);
    b[104..108].copy_from_slice(&crc.to_le_bytes());
    b
}

/// A validated answer to the position request of `generation`, for an image of
/// `image_bytes`. Everything in it is checked before use; the journal then checks the claim
/// against its own chain.
fn decode_answer(
    b: &[u8; ANSWER_LEN],
    generation: u64,
    image_bytes: u64,
) -> Result<ReplicaPosition, &'static str> {
    let u64_at = |at: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[at..at + 8]);
        u64::from_le_bytes(w)
    };
    let u32_at = |at: usize| {
        let mut w = [0u8; 4];
        w.copy_from_slice(&b[at..at + 4]);
        u32::from_le_bytes(w)
    };
    let chain_at = |at: usize| {
        let mut c: Chain = [0u8; 16];
        c.copy_from_slice(&b[at..at + 16]);
        c
    };
    if b[0..8] != ANSWER_MAGIC {
        return Err("no position answer (bad magic)");
    }
    if u32_at(104) != crc32c(&b[..104]) {
        return Err("position answer checksum mismatch");
    }
    if u64_at(8) != generation {
        return Err("position answer for another request");
    }
    let flags = u32_at(20);
    match u32_at(16) {
        STATE_BLANK | STATE_FOREIGN if flags != 0 => Err("position answer flags without a journal"),
        STATE_BLANK => Ok(ReplicaPosition::Blank),
        STATE_FOREIGN => Ok(ReplicaPosition::Foreign),
        STATE_JOURNAL => {
            if flags & !(FLAG_CLEAN | FLAG_PROBE) != 0 {
                return Err("position answer has unknown flags");
            }
            let end = u64_at(56);
            if end < DATA_OFFSET || end > image_bytes || end % 8 != 0 {
                return Err("position answer end outside the image");
            }
            let mut journal_id = [0u8; 16];
            journal_id.copy_from_slice(&b[24..40]);
            Ok(ReplicaPosition::Journal(ReplicaJournal {
                journal_id,
                records: u64_at(40),
                last_seq: u64_at(48),
                end,
                head: chain_at(64),
                clean: flags & FLAG_CLEAN != 0,
                probe: (flags & FLAG_PROBE != 0).then(|| (u64_at(80), chain_at(88))),
            }))
        }
        _ => Err("position answer has an unknown state"),
    }
}

/// A validated sync note: `(generation, lo, hi)`.
fn decode_note(b: &[u8; NOTE_LEN], image_bytes: u64) -> Result<(u64, u64, u64), &'static str> {
    let (generation, lo, hi) = decode_fields(b, NOTE_MAGIC)?;
    if lo > hi || hi > image_bytes {
        return Err("sync note range outside the image");
    }
    Ok((generation, lo, hi))
}

/// Magic and checksum of a request note: its three words.
fn decode_fields(b: &[u8; NOTE_LEN], magic: [u8; 8]) -> Result<(u64, u64, u64), &'static str> {
    if b[0..8] != magic {
        return Err("bad sync note magic");
    }
    let word = |at: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[at..at + 8]);
        u64::from_le_bytes(w)
    };
    let mut c = [0u8; 4];
    c.copy_from_slice(&b[32..36]);
    if u32::from_le_bytes(c) != crc32c(&b[..32]) {
        return Err("sync note checksum mismatch");
    }
    Ok((word(8), word(16), word(24)))
}

/// The primary's side: a [`Replica`] that mirrors the journal device into a remote
/// [`RdmaReplicaServer`] over RDMA WRITEs.
#[derive(Debug)]
pub struct RdmaReplica {
    mirror: Mirror,
    mode: MirrorDurability,
    image_bytes: u64,
    /// Bytes written since the last sync.
    dirty: Option<(u64, u64)>,
    generation: u64,
    name: String,
}

impl RdmaReplica {
    /// Connects to the replica at `addr` through `device`, for a journal device of
    /// `image_bytes`. `op_timeout` bounds every wait (a dead replica is reported within it,
    /// or within the transport's retry time, whichever comes first); `poll` is how the
    /// writer waits for completions.
    pub fn connect(
        device: &Device,
        addr: SocketAddr,
        image_bytes: u64,
        mode: MirrorDurability,
        op_timeout: Duration,
        poll: PollMode,
    ) -> Result<RdmaReplica, ReplicaError> {
        let options = ConnectOptions { op_timeout, poll, ..ConnectOptions::default() };
        let mirror = Mirror::connect(device, addr, options).map_err(link)?;
        let need = image_bytes.checked_add(NOTE_BYTES).ok_or(ReplicaError::TooSmall {
            offset: 0,
            len: usize::MAX,
            size: mirror.capacity(),
        })?;
        if mirror.capacity() < need {
            return Err(ReplicaError::TooSmall {
                offset: 0,
                len: need as usize,
                size: mirror.capacity(),
            });
        }
        Ok(RdmaReplica {
            mirror,
            mode,
            image_bytes,
            dirty: None,
            generation: 0,
            name: format!("rdma://{addr}"),
        })
    }
}

impl Replica for RdmaReplica {
    fn write(&mut self, offset: u64, bytes: &[u8]) -> Result<(), ReplicaError> {
        let end = offset.checked_add(bytes.len() as u64).filter(|&e| e <= self.image_bytes);
        let Some(end) = end else {
            return Err(ReplicaError::TooSmall {
                offset,
                len: bytes.len(),
                size: self.image_bytes,
            });
        };
        self.mirror.write(offset, bytes).map_err(link)?;
        self.dirty = Some(match self.dirty {
            Some((lo, hi)) => (lo.min(offset), hi.max(end)),
            None => (offset, end),
        });
        Ok(())
    }

    fn sync(&mut self) -> Result<(), ReplicaError> {
        let (lo, hi) = self.dirty.unwrap_or((0, 0));
        self.generation += 1;
        let note = encode_note(self.generation, lo, hi);
        // Behind the data on the same queue pair: placed after every byte it names.
        self.mirror.write(self.image_bytes, &note).map_err(link)?;
        self.mirror.sync(self.mode).map_err(link)?;
        self.dirty = None;
        Ok(())
    }

    fn position(&mut self, probe_end: Option<u64>) -> Result<ReplicaPosition, ReplicaError> {
        self.generation += 1;
        let probe = probe_end.unwrap_or(NO_PROBE);
        let note = encode_request(POSITION_MAGIC, self.generation, probe, 0);
        self.mirror.write(self.image_bytes, &note).map_err(link)?;
        // Always acknowledged by the replica process: it writes the answer before it answers.
        self.mirror.sync(MirrorDurability::ReplicaAck).map_err(link)?;
        let mut raw = [0u8; ANSWER_LEN];
        self.mirror.read_back(self.image_bytes + ANSWER_AT, &mut raw).map_err(link)?;
        decode_answer(&raw, self.generation, self.image_bytes)
            .map_err(|what| ReplicaError::Link(format!("{}: {what}", self.name)))
    }

    fn name(&self) -> &str {
        &self.name
    }
}

/// What one primary's session left at the replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionReport {
    /// Sync requests answered (each after the file was `fdatasync`ed).
    pub syncs: u64,
    /// Position requests answered.
    pub positions: u64,
    /// Bytes copied into the file.
    pub bytes_stored: u64,
}

/// The replica's side: exposes `image_bytes + NOTE_BYTES` of registered memory to one primary
/// at a time and keeps the image in a file.
#[derive(Debug)]
pub struct RdmaReplicaServer {
    replica: MirrorReplica,
    file: File,
    image_bytes: u64,
}

impl RdmaReplicaServer {
    /// Listens on `addr`; `file` (opened read-write) receives the image, `image_bytes` long
    /// (the primary's journal device size).
    pub fn bind(
        device: &Device,
        addr: SocketAddr,
        file: File,
        image_bytes: u64,
    ) -> Result<RdmaReplicaServer, ReplicaError> {
        let size = usize::try_from(image_bytes + NOTE_BYTES)
            .map_err(|_| ReplicaError::Link("image too large".into()))?;
        file.set_len(image_bytes).map_err(|source| ReplicaError::Io { offset: 0, source })?;
        let replica = MirrorReplica::bind(device, addr, size).map_err(link)?;
        Ok(RdmaReplicaServer { replica, file, image_bytes })
    }

    /// How the replica waits for the primary's requests ([`MirrorReplica::with_poll`];
    /// busy polling by default).
    pub fn with_poll(mut self, poll: PollMode) -> RdmaReplicaServer {
        self.replica = self.replica.with_poll(poll);
        self
    }

    /// The listening address.
    pub fn local_addr(&self) -> Result<SocketAddr, ReplicaError> {
        self.replica.local_addr().map_err(link)
    }

    /// Serves one primary: waits up to `accept_timeout` for it (`Ok(None)` if none came),
    /// stores every synced range in the file, returns when it goes away or `stop` is set.
    pub fn serve_one(
        &self,
        accept_timeout: Duration,
        stop: &AtomicBool,
    ) -> Result<Option<SessionReport>, ReplicaError> {
        let mut session = match self.replica.accept(accept_timeout) {
            Ok(s) => s,
            Err(RdmaError::Timeout { .. }) => return Ok(None),
            Err(e) => return Err(link(e)),
        };
        let mut last_generation = 0u64;
        let mut bytes_stored = 0u64;
        let mut syncs = 0u64;
        let mut positions = 0u64;
        let mut failure: Option<ReplicaError> = None;
        let image_bytes = self.image_bytes;
        let file = &self.file;
        let mut chunk = vec![0u8; COPY_CHUNK];
        // The fresh region starts as the file: what the primary reads back, and what a
        // read-after-write session stores at its end, is the replica's content.
        load(session.memory(), file, image_bytes, &mut chunk)?;
        let served = session.serve(stop, &mut |mem: &RegisteredBuffer| {
            let mut raw = [0u8; NOTE_LEN];
            mem.read_at(image_bytes as usize, &mut raw)?;
            let request = decode_request(&raw, image_bytes).map_err(protocol)?;
            let generation = match request {
                Request::Sync { generation, .. } | Request::Position { generation, .. } => {
                    generation
                }
            };
            if generation <= last_generation {
                return Err(protocol("request generation did not advance"));
            }
            last_generation = generation;
            let (lo, hi) = match request {
                Request::Sync { lo, hi, .. } => (lo, hi),
                Request::Position { probe_end, .. } => {
                    let p = match image_position(&mut FileImage(file), probe_end) {
                        Ok(p) => p,
                        Err(source) => {
                            failure = Some(ReplicaError::Io { offset: 0, source });
                            return Err(protocol("replica file read failed"));
                        }
                    };
                    mem.write_at(
                        (image_bytes + ANSWER_AT) as usize,
                        &encode_answer(generation, &p),
                    )?;
                    positions += 1;
                    return Ok(());
                }
            };
            syncs += 1;
            let stored = store(mem, file, lo, hi, &mut chunk);
            match stored {
                Ok(n) => {
                    bytes_stored += n;
                    Ok(())
                }
                Err(e) => {
                    failure = Some(e);
                    Err(protocol("replica file write failed"))
                }
            }
        });
        if let Some(e) = failure {
            return Err(e);
        }
        served.map_err(link)?;
        if syncs == 0 {
            // A read-after-write primary never asks: keep what its writes placed (the region
            // started as the file, so the rest is the file's own content).
            bytes_stored += store(session.memory(), file, 0, image_bytes, &mut chunk)?;
        }
        Ok(Some(SessionReport { syncs, positions, bytes_stored }))
    }
}

fn protocol(detail: &str) -> RdmaError {
    RdmaError::Protocol { op: "journal replica sync", detail: detail.to_owned() }
}

/// Fills `[0, image_bytes)` of the region from the file (zeroes past the file's end).
fn load(
    mem: &RegisteredBuffer,
    file: &File,
    image_bytes: u64,
    chunk: &mut [u8],
) -> Result<(), ReplicaError> {
    let file_len = file.metadata().map_err(|source| ReplicaError::Io { offset: 0, source })?.len();
    let mut off = 0u64;
    while off < image_bytes.min(file_len) {
        let n = ((image_bytes.min(file_len) - off) as usize).min(chunk.len());
        file.read_exact_at(&mut chunk[..n], off)
            .map_err(|source| ReplicaError::Io { offset: off, source })?;
        mem.write_at(off as usize, &chunk[..n]).map_err(link)?;
        off += n as u64;
    }
    Ok(())
}

/// Copies `[lo, hi)` of the region into the file at the same offsets and `fdatasync`s it.
fn store(
    mem: &RegisteredBuffer,
    file: &File,
    lo: u64,
    hi: u64,
    chunk: &mut [u8],
) -> Result<u64, ReplicaError> {
    let mut off = lo;
    while off < hi {
        let n = ((hi - off) as usize).min(chunk.len());
        mem.read_at(off as usize, &mut chunk[..n]).map_err(link)?;
        file.write_all_at(&chunk[..n], off)
            .map_err(|source| ReplicaError::Io { offset: off, source })?;
        off += n as u64;
    }
    file.sync_data().map_err(|source| ReplicaError::Io { offset: lo, source })?;
    Ok(hi - lo)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sync_note_round_trip_and_hostile_notes() {
        let n = encode_note(7, 4096, 8192);
        assert_eq!(decode_note(&n, 1 << 20), Ok((7, 4096, 8192)));
        assert_eq!(decode_note(&n, 8000), Err("sync note range outside the image"));
        for i in 0..NOTE_LEN {
            let mut bad = n;
            bad[i] ^= 1;
            assert!(decode_note(&bad, 1 << 20).is_err(), "flip at {i} accepted");
        }
        let backwards = encode_note(1, 10, 5);
        assert!(decode_note(&backwards, 100).is_err());
    }

    #[test]
    fn position_requests_and_answers_round_trip_and_hostile_ones_are_refused() {
        let q = encode_request(POSITION_MAGIC, 3, 8192, 0);
        let want = Request::Position { generation: 3, probe_end: Some(8192) };
        assert_eq!(decode_request(&q, 1 << 20), Ok(want));
        let none = encode_request(POSITION_MAGIC, 4, NO_PROBE, 0);
        let want = Request::Position { generation: 4, probe_end: None };
        assert_eq!(decode_request(&none, 1 << 20), Ok(want));
        assert!(decode_request(&encode_request(POSITION_MAGIC, 5, 1 << 30, 0), 1 << 20).is_err());
        assert!(decode_request(&encode_request(POSITION_MAGIC, 5, 0, 7), 1 << 20).is_err());

        let j = ReplicaJournal {
            journal_id: [7; 16],
            records: 10,
            last_seq: 10,
            end: 4096 + 800,
            head: [9; 16],
            clean: true,
            probe: Some((4, [1; 16])),
        };
        for p in [ReplicaPosition::Blank, ReplicaPosition::Foreign, ReplicaPosition::Journal(j)] {
            let a = encode_answer(11, &p);
            assert_eq!(decode_answer(&a, 11, 1 << 20), Ok(p));
            assert!(decode_answer(&a, 12, 1 << 20).is_err(), "stale answer accepted");
            for i in 0..ANSWER_LEN {
                let mut bad = a;
                bad[i] ^= 0x10;
                assert!(decode_answer(&bad, 11, 1 << 20).is_err(), "flip at {i} accepted");
            }
        }
        // Well-formed (valid CRC) but impossible: refused, not trusted.
        let hostile = |f: &dyn Fn(&mut [u8; ANSWER_LEN])| {
            let mut a = encode_answer(2, &ReplicaPosition::Journal(j));
            f(&mut a);
            let crc = crc32c(&a[..104]);
            a[104..108].copy_from_slice(&crc.to_le_bytes());
            decode_answer(&a, 2, 1 << 20)
        };
        assert!(hostile(&|a| a[56..64].copy_from_slice(&(2u64 << 20).to_le_bytes())).is_err());
        assert!(hostile(&|a| a[56..64].copy_from_slice(&100u64.to_le_bytes())).is_err());
        assert!(hostile(&|a| a[56..64].copy_from_slice(&4097u64.to_le_bytes())).is_err());
        assert!(hostile(&|a| a[16..20].copy_from_slice(&9u32.to_le_bytes())).is_err());
        assert!(hostile(&|a| a[20..24].copy_from_slice(&4u32.to_le_bytes())).is_err());
        assert!(hostile(&|a| {
            a[16..20].copy_from_slice(&STATE_BLANK.to_le_bytes());
        })
        .is_err());
        assert!(hostile(&|_| {}).is_ok());
    }
}
