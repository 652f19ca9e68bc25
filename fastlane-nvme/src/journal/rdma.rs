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

use fastlane_fpga::crc32c::crc32c;
use fastlane_rdma::{
    ConnectOptions, Device, Durability as MirrorDurability, Mirror, MirrorReplica, RdmaError,
    RegisteredBuffer,
};

use super::replica::{Replica, ReplicaError};

/// Bytes the replica's region holds past the journal image, for the sync note.
pub const NOTE_BYTES: u64 = 4096;
/// Bytes of a sync note: magic, generation, lo, hi, CRC32C of the 32 bytes before it.
const NOTE_LEN: usize = 36;
const NOTE_MAGIC: [u8; 8] = *b"FLJRSYNC";
/// The replica copies the region to its file in pieces of this size.
const COPY_CHUNK: usize = 1 << 20;

fn link(e: RdmaError) -> ReplicaError {
    ReplicaError::Link(e.to_string())
}

fn encode_note(generation: u64, lo: u64, hi: u64) -> [u8; NOTE_LEN] {
    let mut b = [0u8; NOTE_LEN];
    b[0..8].copy_from_slice(&NOTE_MAGIC);
    b[8..16].copy_from_slice(&generation.to_le_bytes());
    b[16..24].copy_from_slice(&lo.to_le_bytes());
    b[24..32].copy_from_slice(&hi.to_le_bytes());
    let crc = crc32c(&b[..32]);
    b[32..36].copy_from_slice(&crc.to_le_bytes());
    b
}

/// A validated sync note: `(generation, lo, hi)`.
fn decode_note(b: &[u8; NOTE_LEN], image_bytes: u64) -> Result<(u64, u64, u64), &'static str> {
    if b[0..8] != NOTE_MAGIC {
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
    let (generation, lo, hi) = (word(8), word(16), word(24));
    if lo > hi || hi > image_bytes {
        return Err("sync note range outside the image");
    }
    Ok((generation, lo, hi))
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
    /// or within the transport's retry time, whichever comes first).
    pub fn connect(
        device: &Device,
        addr: SocketAddr,
        image_bytes: u64,
        mode: MirrorDurability,
        op_timeout: Duration,
    ) -> Result<RdmaReplica, ReplicaError> {
        let options = ConnectOptions { op_timeout, ..ConnectOptions::default() };
        let mirror = Mirror::connect(device, addr, options).map_err(link)?;
        let need = image_bytes + NOTE_BYTES;
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

    fn name(&self) -> &str {
        &self.name
    }
}

/// What one primary's session left at the replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionReport {
    /// Sync requests answered (each after the file was `fdatasync`ed).
    pub syncs: u64,
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
        let mut failure: Option<ReplicaError> = None;
        let image_bytes = self.image_bytes;
        let file = &self.file;
        let mut chunk = vec![0u8; COPY_CHUNK];
        let served = session.serve(stop, &mut |mem: &RegisteredBuffer| {
            let mut raw = [0u8; NOTE_LEN];
            mem.read_at(image_bytes as usize, &mut raw)?;
            let (generation, lo, hi) = match decode_note(&raw, image_bytes) {
                Ok(n) if n.0 > last_generation => n,
                Ok(_) => return Err(protocol("sync note generation did not advance")),
                Err(what) => return Err(protocol(what)),
            };
            last_generation = generation;
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
        let syncs = served.map_err(link)?;
        if syncs == 0 {
            // A read-after-write primary never asks: keep what its writes placed.
            bytes_stored += store(session.memory(), file, 0, image_bytes, &mut chunk)?;
        }
        Ok(Some(SessionReport { syncs, bytes_stored }))
    }
}

fn protocol(detail: &str) -> RdmaError {
    RdmaError::Protocol { op: "journal replica sync", detail: detail.to_owned() }
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
}
