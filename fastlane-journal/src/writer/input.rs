//! The writer's input side: draining the producers' rings into a batch (one ring for a
//! journal, every attached producer's for the service), waiting for records, taking new
//! producers and dropping finished ones.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use fastlane_ring::shm::{doorbell, ShmError};

use super::super::control::{STATE_DEVICE_FULL, STATE_RUNNING};
use super::super::format::{frame_len, FRAME_HEADER_LEN};
use super::super::preprocess::FrameSlot;
use super::super::sources::Source;
use super::super::{JournalError, RECORD_TYPE, SEQ_PREFIX_LEN};
use super::{Batch, Writer};

impl Writer {
    pub(super) fn frame_into(
        &mut self,
        b: &mut Batch,
        wait: Option<Duration>,
    ) -> Result<u64, JournalError> {
        if let Some(w) = wait {
            if !self.wait_records(Instant::now() + w) {
                return Ok(0);
            }
        }
        let n = self.sources.len();
        let mut framed = 0u64;
        let mut pos = (b.end - b.base) as usize;
        for k in 0..n {
            let i = (self.next_source + k) % n;
            if self.sources[i].fault.is_some() {
                continue;
            }
            let (got, room) = self.frame_source(i, b, &mut pos)?;
            framed += got;
            if got > 0 {
                let s = &mut self.sources[i];
                s.checkpoint(b.id, self.last_seq, s.last_local);
            }
            if !room || self.device_full {
                break;
            }
        }
        // The next drain starts at the next ring, so that a busy producer cannot keep the
        // batch full for the others.
        self.next_source = if n == 0 { 0 } else { (self.next_source + 1) % n };
        // The staged frames get their timestamp, chain value and CRC (all of them at once
        // when a card does it); a failure stops the writer before any of them is written.
        let key = self.key;
        self.pre.finish(b.buf.as_mut_slice(), &key, &mut self.head)?;
        b.end = b.base + pos as u64;
        b.records += framed;
        b.last_seq = self.last_seq;
        self.end = b.end;
        Ok(framed)
    }

    /// Frames what ring `i` holds into `b` from `*pos` on. Returns the records framed and
    /// whether the batch still has room (`false`: stop draining for this batch).
    pub(super) fn frame_source(
        &mut self,
        i: usize,
        b: &mut Batch,
        pos: &mut usize,
    ) -> Result<(u64, bool), JournalError> {
        let max_record = self.sb.max_record_bytes as usize;
        let max_frame = frame_len(max_record);
        let cap = self.batch_cap();
        let window_end = self.flushed_end + u64::from(self.sb.max_batch_bytes);
        let dev_end = self.dev.size_bytes.saturating_sub(self.tail_reserve);
        let key = self.key;
        let src = &mut self.sources[i];
        let assigns = src.assigns();
        let mut batch = match src.consumer.peek_batch(usize::MAX) {
            Ok(batch) => batch,
            Err(e) => {
                // A broken ring shuts off only its own producer.
                let e = JournalError::Ring(e);
                if assigns {
                    src.shut_off(e);
                } else {
                    self.fault = Some(e);
                    src.fault = Some(JournalError::ProducerFault);
                }
                return Ok((0, true));
            }
        };
        let mut framed = 0u64;
        let mut bytes = 0u64;
        let mut fault = None;
        let mut room = true;
        let buf = b.buf.as_mut_slice();
        loop {
            // Room for the largest frame in the buffer and in the torn window; near the
            // device's end, one record per batch so that the exact size of the next one
            // decides whether it still fits.
            let at_dev = b.base + *pos as u64;
            // None past the end: the dsync writer's block of its own after a write in flight
            // can start there (frames that end within a header of `dev_end` pad past it).
            let room_dev = dev_end.saturating_sub(at_dev);
            let near_end = max_frame as u64 > room_dev;
            if *pos + max_frame > cap
                || at_dev + max_frame as u64 > window_end
                || (near_end && (framed > 0 || b.records > 0 || *pos > (b.end - b.base) as usize))
            {
                room = false;
                break;
            }
            let rec = match batch.next_record() {
                Ok(Some(r)) => r,
                Ok(None) => break,
                Err(e) => {
                    fault = Some(JournalError::Ring(e));
                    break;
                }
            };
            // The producer is not trusted: type, length and seq are checked before use.
            let n = rec.len();
            if rec.record_type() != RECORD_TYPE
                || n < SEQ_PREFIX_LEN
                || n - SEQ_PREFIX_LEN > max_record
            {
                fault = Some(JournalError::BadRecord {
                    what: "bad record type or length",
                    value: n as u64,
                });
                break;
            }
            let plen = n - SEQ_PREFIX_LEN;
            let fl = frame_len(plen);
            if fl as u64 > room_dev {
                // Only reachable with nothing else in this batch (`near_end`): the ring batch
                // is dropped unreleased, so the record stays in the ring; what was framed
                // before is written and flushed, then the writer stops (or rolls).
                self.device_full = true;
                return Ok((framed, false));
            }
            // One copy out of the mapping: the seq prefix lands in the frame's flags/crc slot
            // (overwritten by `encode_frame`), the payload where the frame wants it.
            let at = *pos + FRAME_HEADER_LEN - SEQ_PREFIX_LEN;
            rec.copy_to(&mut buf[at..at + n]);
            let mut w = [0u8; 8];
            w.copy_from_slice(&buf[at..at + 8]);
            let local = u64::from_le_bytes(w);
            // Strictly increasing, by one (or two: a producer that died between claiming a seq
            // and publishing its record leaves one hole for the next producer).
            if local <= src.last_local || local - src.last_local > 2 {
                fault = Some(JournalError::BadRecord {
                    what: "sequence number out of order",
                    value: local,
                });
                break;
            }
            let seq = if assigns { self.last_seq + 1 } else { local };
            let slot = FrameSlot { pos: *pos, seq, len: plen as u32, flags: src.id };
            self.pre.stage(buf, slot, &key, &mut self.head);
            self.last_seq = seq;
            src.last_local = local;
            *pos += fl;
            framed += 1;
            bytes += plen as u64;
            if near_end {
                room = false;
                break;
            }
        }
        batch.release();
        src.count(framed, bytes);
        if let Some(e) = fault {
            if assigns {
                src.shut_off(e);
            } else {
                self.fault = Some(e);
                src.fault = Some(JournalError::ProducerFault);
            }
        }
        Ok((framed, room))
    }

    /// Waits until a ring holds a record (or a producer arrives), at most until `deadline`:
    /// a journal sleeps on its ring, the service on the doorbell every producer rings.
    /// Returns whether there is something to look at.
    pub(super) fn wait_records(&mut self, deadline: Instant) -> bool {
        match &self.service {
            None => {
                let Some(src) = self.sources.first_mut() else { return false };
                match src.consumer.wait_batch(1, Some(deadline)) {
                    Ok(_) => true,
                    Err(ShmError::Timeout) => false,
                    // Broken: `frame_source` finds out and shuts it off.
                    Err(_) => true,
                }
            }
            Some(svc) => {
                let strategy = self.writer_wait;
                let sources = &mut self.sources;
                let arrived = &svc.arrived;
                doorbell::wait(svc.doorbell.word(), strategy, Some(deadline), || {
                    arrived.load(Ordering::Acquire) || any_ready(sources)
                })
            }
        }
    }

    /// A ring holds a record (or is broken: `frame` reports that).
    pub(super) fn ring_ready(&mut self) -> bool {
        any_ready(&mut self.sources)
    }

    /// Service: takes the producers that arrived, drops those that are gone and fully
    /// acknowledged. Called once per loop turn; no allocation unless a producer arrived.
    pub(super) fn sync_sources(&mut self) {
        let Some(svc) = &self.service else { return };
        // A load first: the swap (a write to the acceptor's line) only when a producer arrived.
        if svc.arrived.load(Ordering::Relaxed) && svc.arrived.swap(false, Ordering::AcqRel) {
            // Bounded: the acceptor sends at most its producer limit.
            while let Ok(src) = svc.incoming.try_recv() {
                if self.out_of_space {
                    if let Some(c) = &src.control {
                        c.set_state(STATE_DEVICE_FULL);
                    }
                }
                self.sources.push(src);
            }
        }
        let mut i = 0;
        while i < self.sources.len() {
            if self.sources[i].finished() && source_drained(&mut self.sources[i]) {
                drop(self.sources.swap_remove(i));
            } else {
                i += 1;
            }
        }
    }
}

impl Writer {
    /// Tells every producer (and the service) whether the journal is out of space.
    pub(super) fn set_out_of_space(&mut self, full: bool) {
        if self.out_of_space == full {
            return;
        }
        self.out_of_space = full;
        let state = if full { STATE_DEVICE_FULL } else { STATE_RUNNING };
        self.control.set_state(state);
        for s in self.sources.iter().filter(|s| s.fault.is_none()) {
            if let Some(c) = &s.control {
                c.set_state(state);
            }
        }
    }
}

/// Some ring holds a record (or is broken).
fn any_ready(sources: &mut [Source]) -> bool {
    sources
        .iter_mut()
        .filter(|s| s.fault.is_none())
        .any(|s| s.consumer.peek_batch(1).map_or(true, |b| !b.is_empty()))
}

/// The ring of a finished source holds nothing more (a faulted one is not read again).
fn source_drained(s: &mut Source) -> bool {
    s.fault.is_some() || s.consumer.peek_batch(1).map_or(true, |b| b.is_empty())
}
