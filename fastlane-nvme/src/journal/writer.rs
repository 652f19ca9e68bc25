//! The journal writer: one thread that drains the record ring in batches, frames the records,
//! writes each batch with one write and (at `local` and above) one flush, mirrors it to the
//! replica in parallel, and publishes the durable sequence number.
//!
//! # The write buffer
//!
//! The writer owns one aligned buffer of `max_batch_bytes + write_align` bytes. `buf[0]` is
//! device offset `base`, the start of the `write_align` block holding the journal's end, so
//! `buf[..end - base]` is the already-durable beginning of that block. A batch appends frames
//! after it, zero-fills to the next block boundary and writes `[base, round_up(end))` in one
//! request: the partially filled last block is rewritten with the same leading bytes each
//! time, so a write torn at any byte leaves those bytes as they were. After the batch the last
//! partial block is moved to the front and becomes the new `base`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fastlane_ring::shm::{Consumer, ShmError};

use super::control::{
    Control, STATE_CLOSED, STATE_DEVICE_FULL, STATE_FAILED, STATE_PRODUCER_FAULT,
};
use super::format::{encode_frame, frame_len, Chain, Durability, Superblock, FRAME_HEADER_LEN};
use super::io::{AlignedBuf, Dev};
use super::preprocess::Preprocess;
use super::replica::Replica;
use super::{JournalError, RECORD_TYPE, SEQ_PREFIX_LEN};

/// Counters the writer keeps (read with [`Journal::stats`](super::Journal::stats)).
#[derive(Debug, Default)]
pub(crate) struct WriterStats {
    pub(crate) batches: AtomicU64,
    pub(crate) records: AtomicU64,
    pub(crate) bytes_written: AtomicU64,
    pub(crate) flushes: AtomicU64,
    pub(crate) end: AtomicU64,
}

/// How long one idle wait on the ring lasts before the writer looks at its stop flag.
const IDLE_SLICE: Duration = Duration::from_millis(5);

pub(crate) struct Writer {
    pub(crate) dev: Dev,
    pub(crate) buf: AlignedBuf,
    pub(crate) base: u64,
    pub(crate) end: u64,
    pub(crate) key: [u8; 32],
    pub(crate) head: Chain,
    pub(crate) last_seq: u64,
    pub(crate) sb: Superblock,
    pub(crate) durability: Durability,
    pub(crate) replica: Option<Box<dyn Replica>>,
    pub(crate) pre: Box<dyn Preprocess>,
    pub(crate) consumer: Consumer,
    pub(crate) control: Control,
    pub(crate) stats: Arc<WriterStats>,
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) core: Option<usize>,
    /// Records in the batch being committed.
    pub(crate) batch_records: u64,
    /// Why the writer stopped reading the ring, if it did.
    pub(crate) fault: Option<JournalError>,
}

impl Writer {
    fn align(&self) -> u64 {
        u64::from(self.sb.write_align)
    }

    /// The thread body. Returns the first fatal error.
    pub(crate) fn run(mut self) -> Result<(), JournalError> {
        if let Some(id) = self.core {
            // Best effort: a core that does not exist leaves the thread unpinned.
            let _ = core_affinity::set_for_current(core_affinity::CoreId { id });
        }
        let result = self.run_loop();
        let state = match &result {
            Ok(()) if self.fault.is_some() => STATE_PRODUCER_FAULT,
            Ok(()) => STATE_CLOSED,
            Err(JournalError::DeviceFull) => STATE_DEVICE_FULL,
            Err(_) => STATE_FAILED,
        };
        self.control.set_state(state);
        result
    }

    fn run_loop(&mut self) -> Result<(), JournalError> {
        loop {
            let stopping = self.stop.load(Ordering::Acquire);
            if self.fault.is_some() {
                if stopping {
                    return Ok(());
                }
                std::thread::sleep(IDLE_SLICE);
                continue;
            }
            let framed = self.frame_batch(stopping)?;
            if framed > 0 {
                self.commit_batch()?;
            } else if stopping {
                return Ok(());
            }
            if self.fault.is_some() {
                // What came before the bad record is durable; say so, then stop reading.
                self.control.set_state(STATE_PRODUCER_FAULT);
            }
        }
    }

    /// Drains up to a buffer's worth of records into frames. Returns how many were framed.
    fn frame_batch(&mut self, stopping: bool) -> Result<u64, JournalError> {
        let max_record = self.sb.max_record_bytes as usize;
        let max_frame = frame_len(max_record);
        let cap = self.sb.max_batch_bytes as usize;
        let dev_end = self.dev.size_bytes;
        let deadline = if stopping { Instant::now() } else { Instant::now() + IDLE_SLICE };
        let batch = if stopping {
            self.consumer.peek_batch(usize::MAX)
        } else {
            self.consumer.wait_batch(usize::MAX, Some(deadline))
        };
        let mut batch = match batch {
            Ok(b) => b,
            Err(ShmError::Timeout) => return Ok(0),
            Err(e) => {
                self.fault = Some(JournalError::Ring(e));
                return Ok(0);
            }
        };
        let key = self.key;
        let mut framed = 0u64;
        let mut pos = (self.end - self.base) as usize;
        let buf = self.buf.as_mut_slice();
        loop {
            // Room for the largest frame in the buffer; near the device's end, one record per
            // batch so that the exact size of the next one decides whether it still fits.
            let room_dev = dev_end - (self.base + pos as u64);
            let near_end = max_frame as u64 > room_dev;
            if pos + max_frame > cap || (near_end && framed > 0) {
                break;
            }
            let rec = match batch.next_record() {
                Ok(Some(r)) => r,
                Ok(None) => break,
                Err(e) => {
                    self.fault = Some(JournalError::Ring(e));
                    break;
                }
            };
            // The producer is not trusted: type, length and seq are checked before use.
            let n = rec.len();
            if rec.record_type() != RECORD_TYPE
                || n < SEQ_PREFIX_LEN
                || n - SEQ_PREFIX_LEN > max_record
            {
                self.fault = Some(JournalError::BadRecord {
                    what: "bad record type or length",
                    value: n as u64,
                });
                break;
            }
            let plen = n - SEQ_PREFIX_LEN;
            let fl = frame_len(plen);
            if fl as u64 > room_dev {
                // Only reachable with nothing framed in this batch (`near_end`): the batch is
                // dropped unreleased, so the record stays in the ring.
                return Err(JournalError::DeviceFull);
            }
            // One copy out of the mapping: the seq prefix lands in the frame's flags/crc slot
            // (overwritten by `encode_frame`), the payload where the frame wants it.
            let at = pos + FRAME_HEADER_LEN - SEQ_PREFIX_LEN;
            rec.copy_to(&mut buf[at..at + n]);
            let mut w = [0u8; 8];
            w.copy_from_slice(&buf[at..at + 8]);
            let seq = u64::from_le_bytes(w);
            // Strictly increasing, by one (or two: a producer that died between claiming a seq
            // and publishing its record leaves one hole for the next producer).
            if seq <= self.last_seq || seq - self.last_seq > 2 {
                self.fault = Some(JournalError::BadRecord {
                    what: "sequence number out of order",
                    value: seq,
                });
                break;
            }
            let ts = self.pre.timestamp_ns();
            let pre = &mut self.pre;
            self.head =
                encode_frame(&mut buf[pos..], &key, &self.head, seq, ts, plen, &mut |c, d| {
                    pre.crc32c_append(c, d)
                });
            self.last_seq = seq;
            pos += fl;
            framed += 1;
            if near_end {
                break;
            }
        }
        batch.release();
        self.end = self.base + pos as u64;
        self.batch_records = framed;
        Ok(framed)
    }

    /// Writes the framed batch (and mirrors it), flushes per the durability level, publishes.
    fn commit_batch(&mut self) -> Result<(), JournalError> {
        let align = self.align();
        let used = (self.end - self.base) as usize;
        let wlen = (used as u64).div_ceil(align) * align;
        let wlen = wlen as usize;
        self.buf.as_mut_slice()[used..wlen].fill(0);
        self.dev.start_write(&mut self.buf, 0, wlen, self.base)?;
        if let Some(r) = self.replica.as_mut() {
            // The kernel only reads the buffer during the write; reading it here too is fine.
            r.write(self.base, &self.buf.as_slice()[..wlen])?;
        }
        self.dev.wait("write", self.base)?;
        if self.durability != Durability::Memory {
            self.dev.start_flush()?;
            if self.durability == Durability::Replicated {
                if let Some(r) = self.replica.as_mut() {
                    r.sync()?;
                }
            }
            self.dev.wait("flush", 0)?;
            self.stats.flushes.fetch_add(1, Ordering::Relaxed);
        }
        self.control.publish_durable(self.last_seq);
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        self.stats.records.fetch_add(self.batch_records, Ordering::Relaxed);
        self.stats.bytes_written.fetch_add(wlen as u64, Ordering::Relaxed);
        self.stats.end.store(self.end, Ordering::Relaxed);
        // Keep the last partial block at the front of the buffer.
        let keep_from = self.end / align * align;
        let from = (keep_from - self.base) as usize;
        let keep = (self.end - keep_from) as usize;
        self.buf.as_mut_slice().copy_within(from..from + keep, 0);
        self.base = keep_from;
        Ok(())
    }
}
