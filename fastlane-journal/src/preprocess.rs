//! The preprocessing seam: the timestamp, hash-chain value and CRC32C of each frame.
//!
//! The writer copies a batch's payloads into place and hands each frame to a [`Preprocess`]
//! with [`Preprocess::stage`], then calls [`Preprocess::finish`] once before the batch is
//! written. Two implementations:
//!
//! - [`SoftPreprocess`] frames each record as it is staged, on the writer's core, through
//!   [`crc32c::crc32c_append`] (the `crc32c` crate: SSE4.2, or a table walk) and the card
//!   clock ([`fastlane_fpga::CardClock`], monotonic), offset once to the Unix epoch so frames
//!   carry wall-clock nanoseconds that never go backwards.
//! - [`CardPreprocess`] routes the batch through a card's descriptor rings (the
//!   [`SoftCard`] model today, a BAR-mapped FPGA later): per frame one `OP_TIMESTAMP`, then
//!   — once the host has linked the frame into the hash chain, which the card cannot do — one
//!   `OP_CRC32C` over the header and one over the payload seeded with the header's CRC.
//!   Completions fill in the timestamp and the CRC.
//!
//! # Why the seam is per batch
//!
//! A per-frame call (`timestamp_ns()`, `crc32c_append()`) has to return its value, so a card
//! behind it costs three ring round trips per record: a doorbell, the card noticing it,
//! the completion, the host noticing that. Staging a batch and finishing it once lets the
//! card path keep a window of descriptors in flight (the host links frame *i* while the card
//! checksums frame *i − 1* and stamps frame *i + 1*), and leaves the direct path exactly what
//! it was: it frames at `stage`, and its `finish` does nothing.
//!
//! # Memory handed to the card
//!
//! [`CardPreprocess::finish`] posts descriptors that name the writer's batch buffer by
//! address (IOVA = virtual address, which is what the software model and a VFIO container
//! that maps the writer's two buffers at IOVA = VA use). It returns only after every one of
//! them completed, or after it dropped the card (which stops it: a [`SoftCard`] joins its
//! engine thread), so the card never touches the buffer after `finish` returned. A card that
//! answers late, out of order, with a bad status, or not at all is a [`PreprocessError`]; the
//! card is then stopped for good and the writer stops with
//! [`JournalError::Preprocess`](super::JournalError::Preprocess).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use fastlane_fpga::abi::{self, cpl_status, Completion, Descriptor};
use fastlane_fpga::card::{Card, CardError, SoftCard, SoftCardConfig};
use fastlane_fpga::CardClock;

use super::format::{chain_next, encode_frame, frame_len, Chain, FRAME_HEADER_LEN, FRAME_MAGIC};

/// Where one frame of a batch lies in the writer's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameSlot {
    /// Offset of the frame in the buffer.
    pub pos: usize,
    /// Its seq.
    pub seq: u64,
    /// Payload bytes, already in place at `pos + FRAME_HEADER_LEN`.
    pub len: u32,
    /// The frame's flags: the producer id in format version 2 (0: the journal's own
    /// producer; always 0 in version 1).
    pub flags: u32,
}

/// Fills in what a frame needs from the preprocessing stage: timestamp, chain value, CRC32C.
pub trait Preprocess: Send {
    /// Takes the frame at `frame.pos` of `buf` (payload in place, header bytes undefined)
    /// into the current batch. May frame it at once (and advance `head`), or leave it to
    /// [`finish`](Preprocess::finish). The writer does not touch the frame's bytes, nor
    /// move `buf`, until `finish` returned.
    fn stage(&mut self, buf: &mut [u8], frame: FrameSlot, key: &[u8; 32], head: &mut Chain);

    /// Completes every staged frame of `buf` (the buffer `stage` saw): header, zero padding,
    /// chain value (continuing from `*head`, in staging order) and CRC32C; `*head` ends as the
    /// last frame's chain value. On error the staged frames are garbage and the writer stops.
    fn finish(
        &mut self,
        buf: &mut [u8],
        key: &[u8; 32],
        head: &mut Chain,
    ) -> Result<(), PreprocessError>;

    /// A short name for the CLI.
    fn name(&self) -> &str;
}

/// Why the preprocessing stage failed. The writer stops; what was acknowledged before stays.
#[derive(Debug, thiserror::Error)]
pub enum PreprocessError {
    /// The card refused a descriptor or reported a fault.
    #[error("preprocessing card: {0}")]
    Card(#[from] CardError),
    /// No completion arrived in time (the card has been stopped).
    #[error(
        "preprocessing card: no completion within {waited:?} ({in_flight} descriptors in flight)"
    )]
    Timeout {
        /// Descriptors that were in flight.
        in_flight: usize,
        /// How long the host waited without progress.
        waited: Duration,
    },
    /// A completion carried another tag than the oldest descriptor in flight.
    #[error("preprocessing card: completion tag {got:#x}, expected {expected:#x}")]
    Tag {
        /// The oldest tag in flight.
        expected: u32,
        /// What the card answered.
        got: u32,
    },
    /// A descriptor completed with an error status.
    #[error("preprocessing card: {op} of seq {seq} completed with status {status}")]
    Status {
        /// `timestamp` or `crc32c`.
        op: &'static str,
        /// The frame's seq.
        seq: u64,
        /// The completion's status.
        status: u16,
    },
    /// The card answered something impossible.
    #[error("preprocessing card: {0}")]
    Protocol(&'static str),
    /// An earlier failure stopped the card.
    #[error("preprocessing card stopped after an earlier failure")]
    Stopped,
}

/// CRC32C and card-clock timestamps through `fastlane-fpga`'s direct entry points, framed
/// at `stage`.
#[derive(Debug, Clone, Copy)]
pub struct SoftPreprocess {
    clock: CardClock,
    /// `CLOCK_REALTIME` at the clock's epoch.
    epoch_unix_ns: u64,
}

impl Default for SoftPreprocess {
    fn default() -> Self {
        SoftPreprocess { clock: CardClock::new(), epoch_unix_ns: realtime_ns() }
    }
}

impl SoftPreprocess {
    /// Continues a CRC32C over `data` (`crc32c_append(crc32c(a), b) == crc32c(a ++ b)`).
    #[inline]
    pub fn crc32c_append(&self, crc: u32, data: &[u8]) -> u32 {
        crc32c::crc32c_append(crc, data)
    }

    /// The timestamp for the next frame, ns since the Unix epoch.
    #[inline]
    pub fn timestamp_ns(&self) -> u64 {
        self.epoch_unix_ns.wrapping_add(self.clock.now_ns())
    }
}

impl Preprocess for SoftPreprocess {
    #[inline]
    fn stage(&mut self, buf: &mut [u8], f: FrameSlot, key: &[u8; 32], head: &mut Chain) {
        let ts = self.timestamp_ns();
        *head = encode_frame(
            &mut buf[f.pos..],
            key,
            head,
            f.seq,
            ts,
            f.flags,
            f.len as usize,
            &mut crc32c::crc32c_append,
        );
    }

    fn finish(&mut self, _: &mut [u8], _: &[u8; 32], _: &mut Chain) -> Result<(), PreprocessError> {
        Ok(())
    }

    fn name(&self) -> &str {
        "direct"
    }
}

/// `CLOCK_REALTIME` in ns (a vDSO call, no syscall).
pub fn realtime_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    (ts.tv_sec as u64).wrapping_mul(1_000_000_000).wrapping_add(ts.tv_nsec as u64)
}

/// The three descriptors of a frame, in the low two bits of the tag (the frame's index in
/// the batch above them).
const KIND_TIMESTAMP: u32 = 0;
const KIND_HEADER_CRC: u32 = 1;
const KIND_PAYLOAD_CRC: u32 = 2;
/// Bytes of the header the CRC covers (the CRC field itself is not).
const HEADER_CRC_LEN: usize = 44;
/// Frames per batch the tag can name.
const FRAMES_MAX: usize = 1 << 30;
/// Default bound on a wait for the card without any completion.
pub const CARD_TIMEOUT: Duration = Duration::from_secs(1);
/// Ring sizes of the software card [`CardPreprocess::soft`] starts (1024 entries each).
const SOFT_RING_LOG2: u32 = 10;

/// Frames a batch through a card's descriptor rings (`OP_TIMESTAMP`, `OP_CRC32C`).
#[derive(Debug)]
pub struct CardPreprocess<C: Card + Send = SoftCard> {
    /// `None` once a failure stopped the card.
    card: Option<C>,
    /// Add to the card clock for ns since the Unix epoch.
    epoch_unix_ns: u64,
    timeout: Duration,
    staged: Vec<FrameSlot>,
    /// The buffer the staged frames are in (checked at `finish`: our bug otherwise).
    staged_buf: usize,
    /// Tags posted and not yet completed, oldest first.
    in_flight: VecDeque<u32>,
    descriptors: u64,
}

impl CardPreprocess<SoftCard> {
    /// Starts a software card (1024-entry rings) for the journal.
    pub fn soft() -> Result<Self, PreprocessError> {
        let config = SoftCardConfig {
            desc_ring_log2: SOFT_RING_LOG2,
            cpl_ring_log2: SOFT_RING_LOG2,
            ..SoftCardConfig::default()
        };
        CardPreprocess::new(SoftCard::new(config)?)
    }
}

impl<C: Card + Send> CardPreprocess<C> {
    /// Uses `card` (brought up, idle). Reads the card clock once with an `OP_TIMESTAMP` to
    /// tie it to the Unix epoch.
    pub fn new(mut card: C) -> Result<Self, PreprocessError> {
        if card.in_flight() != 0 {
            return Err(PreprocessError::Protocol("card has descriptors in flight"));
        }
        let before = realtime_ns();
        let stamp = card_clock(&mut card, CARD_TIMEOUT)?;
        let after = realtime_ns();
        // The card stamped somewhere between the two readings: take the middle.
        let mid = before.wrapping_add(after.wrapping_sub(before) / 2);
        Ok(CardPreprocess {
            card: Some(card),
            epoch_unix_ns: mid.wrapping_sub(stamp),
            timeout: CARD_TIMEOUT,
            staged: Vec::with_capacity(4096),
            staged_buf: 0,
            in_flight: VecDeque::with_capacity(1 << SOFT_RING_LOG2),
            descriptors: 0,
        })
    }

    /// Bounds every wait without a completion (default [`CARD_TIMEOUT`]).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Descriptors completed so far.
    pub fn descriptors(&self) -> u64 {
        self.descriptors
    }

    /// The card (`None` after a failure stopped it).
    pub fn card(&self) -> Option<&C> {
        self.card.as_ref()
    }
}

/// One `OP_TIMESTAMP`, waited for: the card clock in ns.
fn card_clock<C: Card>(card: &mut C, timeout: Duration) -> Result<u64, PreprocessError> {
    let desc = Descriptor { op: abi::OP_TIMESTAMP, tag: u32::MAX, ..Descriptor::default() };
    // SAFETY: OP_TIMESTAMP names no memory.
    unsafe { card.post(desc)? };
    let start = Instant::now();
    let mut c = [Completion::default()];
    // Bounded by `timeout`.
    loop {
        if card.completions(&mut c) == 1 {
            if c[0].tag != u32::MAX {
                return Err(PreprocessError::Tag { expected: u32::MAX, got: c[0].tag });
            }
            if c[0].status != cpl_status::OK {
                return Err(PreprocessError::Status {
                    op: "timestamp",
                    seq: 0,
                    status: c[0].status,
                });
            }
            return Ok(c[0].value);
        }
        card.check()?;
        if start.elapsed() > timeout {
            return Err(PreprocessError::Timeout { in_flight: 1, waited: timeout });
        }
        std::thread::yield_now();
    }
}

impl<C: Card + Send> Preprocess for CardPreprocess<C> {
    fn stage(&mut self, buf: &mut [u8], f: FrameSlot, _: &[u8; 32], _: &mut Chain) {
        if self.staged.is_empty() {
            self.staged_buf = buf.as_ptr() as usize;
        }
        debug_assert_eq!(self.staged_buf, buf.as_ptr() as usize, "one buffer per batch");
        self.staged.push(f);
    }

    fn finish(
        &mut self,
        buf: &mut [u8],
        key: &[u8; 32],
        head: &mut Chain,
    ) -> Result<(), PreprocessError> {
        if self.staged.is_empty() {
            return Ok(());
        }
        assert_eq!(self.staged_buf, buf.as_ptr() as usize, "finish on the staged buffer");
        assert!(self.staged.len() < FRAMES_MAX, "batch too large for the tag");
        for f in &self.staged {
            // The writer's own bookkeeping, not input: a frame outside the buffer is our bug.
            assert!(f.pos + frame_len(f.len as usize) <= buf.len(), "frame outside the batch");
        }
        let Some(card) = self.card.as_mut() else {
            self.staged.clear();
            return Err(PreprocessError::Stopped);
        };
        // From here on the buffer is only reached through `base` (the card reads parts of it
        // while the host writes others).
        let base = buf.as_mut_ptr();
        let mut run = Pipeline {
            card,
            base,
            frames: &self.staged,
            key,
            head,
            epoch_unix_ns: self.epoch_unix_ns,
            in_flight: &mut self.in_flight,
            completed: 0,
        };
        let result = run.run(self.timeout);
        self.descriptors += run.completed;
        self.staged.clear();
        if result.is_err() {
            // The card may still hold descriptors naming `buf`: stop it before returning
            // (dropping a SoftCard joins its engine thread; a hardware backend resets the
            // card and waits for quiescence). It stays stopped.
            self.in_flight.clear();
            self.card = None;
        }
        result
    }

    fn name(&self) -> &str {
        "card"
    }
}

/// One batch's trip through the card.
struct Pipeline<'a, C: Card> {
    card: &'a mut C,
    /// The batch buffer; every frame of `frames` lies inside it (checked by `finish`).
    base: *mut u8,
    frames: &'a [FrameSlot],
    key: &'a [u8; 32],
    head: &'a mut Chain,
    epoch_unix_ns: u64,
    in_flight: &'a mut VecDeque<u32>,
    completed: u64,
}

impl<C: Card> Pipeline<'_, C> {
    /// Posts a timestamp for every frame, links each frame as its stamp arrives, posts its
    /// two CRC descriptors, writes the CRC when the second completes. Returns once every
    /// descriptor completed (`in_flight` empty), or with the first error.
    fn run(&mut self, timeout: Duration) -> Result<(), PreprocessError> {
        let n = self.frames.len();
        self.in_flight.clear();
        let mut next_stamp = 0usize;
        let mut linked = 0usize;
        let mut done = 0usize;
        let mut cpl = [Completion::default(); 64];
        let mut last_progress = Instant::now();
        let mut idle = 0u32;
        while done < n {
            // Stamps for the frames not asked for yet, as far as the window allows (each
            // completion below frees a slot and posts at most one descriptor in its place).
            let mut posted = false;
            while next_stamp < n {
                let tag = (next_stamp as u32) << 2 | KIND_TIMESTAMP;
                let desc = Descriptor { op: abi::OP_TIMESTAMP, tag, ..Descriptor::default() };
                // SAFETY: OP_TIMESTAMP names no memory.
                match unsafe { self.card.enqueue(desc) } {
                    Ok(()) => {}
                    Err(CardError::Full(_)) => break,
                    Err(e) => return Err(e.into()),
                }
                self.in_flight.push_back(tag);
                next_stamp += 1;
                posted = true;
            }
            if posted {
                self.card.doorbell();
            }
            let got = self.card.completions(&mut cpl);
            if got == 0 {
                self.card.check()?;
                idle += 1;
                if idle.is_multiple_of(64) {
                    if last_progress.elapsed() > timeout {
                        return Err(PreprocessError::Timeout {
                            in_flight: self.in_flight.len(),
                            waited: timeout,
                        });
                    }
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            idle = 0;
            last_progress = Instant::now();
            for c in &cpl[..got] {
                let Some(expected) = self.in_flight.pop_front() else {
                    return Err(PreprocessError::Protocol("completion with nothing in flight"));
                };
                if c.tag != expected {
                    return Err(PreprocessError::Tag { expected, got: c.tag });
                }
                self.completed += 1;
                let i = (expected >> 2) as usize;
                let f = self.frames[i];
                let kind = expected & 3;
                if c.status != cpl_status::OK {
                    let op = if kind == KIND_TIMESTAMP { "timestamp" } else { "crc32c" };
                    return Err(PreprocessError::Status { op, seq: f.seq, status: c.status });
                }
                match kind {
                    KIND_TIMESTAMP => {
                        // Completions come in posting order, so stamps arrive frame by frame.
                        debug_assert_eq!(i, linked);
                        let ts = self.epoch_unix_ns.wrapping_add(c.value);
                        self.link(f, ts);
                        linked += 1;
                        let at = f.pos;
                        self.post_crc(i, KIND_HEADER_CRC, at, HEADER_CRC_LEN, 0)?;
                    }
                    KIND_HEADER_CRC => {
                        let seed = u32::try_from(c.value)
                            .map_err(|_| PreprocessError::Protocol("CRC32C wider than 32 bits"))?;
                        let at = f.pos + FRAME_HEADER_LEN;
                        let len = frame_len(f.len as usize) - FRAME_HEADER_LEN;
                        self.post_crc(i, KIND_PAYLOAD_CRC, at, len, seed)?;
                    }
                    _ => {
                        let crc = u32::try_from(c.value)
                            .map_err(|_| PreprocessError::Protocol("CRC32C wider than 32 bits"))?;
                        // SAFETY: `pos + 48 <= buf.len()` (checked by `finish`); the card reads
                        // bytes 0..44 and 48.. of this frame, never 44..48, and both of its
                        // CRC descriptors have completed.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                crc.to_le_bytes().as_ptr(),
                                self.base.wrapping_add(f.pos + HEADER_CRC_LEN),
                                4,
                            )
                        };
                        done += 1;
                    }
                }
            }
            self.card.doorbell();
        }
        if !self.in_flight.is_empty() {
            return Err(PreprocessError::Protocol("descriptors left in flight"));
        }
        Ok(())
    }

    /// Writes frame `f`'s header (CRC field aside) and padding, linking it into the chain.
    fn link(&mut self, f: FrameSlot, ts: u64) {
        let len = f.len as usize;
        let total = frame_len(len);
        // SAFETY: `f.pos + total <= buf.len()` (checked by `finish`); the card has no
        // descriptor naming this frame yet (its CRCs are posted after this returns), and the
        // bytes are initialised (the writer's buffer is zeroed at allocation).
        let payload = unsafe {
            std::slice::from_raw_parts(self.base.wrapping_add(f.pos + FRAME_HEADER_LEN), len)
        };
        let chain = chain_next(self.key, self.head, f.seq, f.len, ts, f.flags, payload);
        let mut hdr = [0u8; HEADER_CRC_LEN];
        hdr[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
        hdr[4..8].copy_from_slice(&f.len.to_le_bytes());
        hdr[8..16].copy_from_slice(&f.seq.to_le_bytes());
        hdr[16..24].copy_from_slice(&ts.to_le_bytes());
        hdr[24..40].copy_from_slice(&chain);
        hdr[40..44].copy_from_slice(&f.flags.to_le_bytes());
        let pad = self.base.wrapping_add(f.pos + FRAME_HEADER_LEN + len);
        // SAFETY: as above; the header lies inside the frame, disjoint from every range the
        // card may be reading (other frames).
        unsafe {
            std::ptr::copy_nonoverlapping(
                hdr.as_ptr(),
                self.base.wrapping_add(f.pos),
                HEADER_CRC_LEN,
            )
        };
        // SAFETY: as above, for the padding after the payload (inside the frame).
        unsafe { std::ptr::write_bytes(pad, 0, total - FRAME_HEADER_LEN - len) };
        *self.head = chain;
    }

    /// Posts a CRC32C of `len` bytes at `at` in the buffer, continuing from `seed`.
    fn post_crc(
        &mut self,
        i: usize,
        kind: u32,
        at: usize,
        len: usize,
        seed: u32,
    ) -> Result<(), PreprocessError> {
        let tag = (i as u32) << 2 | kind;
        let desc = Descriptor {
            op: abi::OP_CRC32C,
            tag,
            src_addr: self.base.wrapping_add(at) as u64,
            src_len: len as u32,
            dst_len: seed,
            ..Descriptor::default()
        };
        // SAFETY: the descriptor's memory contract:
        // - `at..at + len` lies inside the batch buffer (checked by `finish`), which `finish`
        //   borrows mutably for its whole run, so it stays allocated and nobody else writes it;
        // - the host does not write these bytes again (the header and padding were written
        //   before this post; the CRC field 44..48 is outside both ranges);
        // - `finish` returns only after this descriptor's completion was reaped, or after it
        //   dropped the card (which stops it).
        match unsafe { self.card.enqueue(desc) } {
            Ok(()) => {
                self.in_flight.push_back(tag);
                Ok(())
            }
            // A completion was just reaped, freeing the slot: a full ring here is the card's
            // (or the queue's) fault.
            Err(CardError::Full(_)) => Err(PreprocessError::Protocol("ring full after a reap")),
            Err(e) => Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU8, Ordering};
    use std::sync::Arc;

    use super::super::format::decode_header;
    use super::*;

    #[test]
    fn crc_matches_the_check_value_and_time_moves_forward() {
        let p = SoftPreprocess::default();
        assert_eq!(p.crc32c_append(0, b"123456789"), 0xE306_9283);
        let a = p.timestamp_ns();
        let b = p.timestamp_ns();
        assert!(b >= a && a > 1_600_000_000_000_000_000);
    }

    /// A batch buffer with `lens.len()` frames, payloads in place; the slots.
    fn batch(lens: &[u32]) -> (Vec<u8>, Vec<FrameSlot>) {
        let total: usize = lens.iter().map(|&l| frame_len(l as usize)).sum();
        let mut buf = vec![0xEEu8; total + 64];
        let mut slots = Vec::new();
        let mut pos = 0;
        for (i, &len) in lens.iter().enumerate() {
            let seq = i as u64 + 1;
            for k in 0..len as usize {
                buf[pos + FRAME_HEADER_LEN + k] =
                    (seq as u8).wrapping_mul(13).wrapping_add(k as u8);
            }
            // Producer ids vary, so the card path is shown to write and chain them.
            slots.push(FrameSlot { pos, seq, len, flags: (seq % 3) as u32 * 0x0101 });
            pos += frame_len(len as usize);
        }
        (buf, slots)
    }

    fn run(
        pre: &mut dyn Preprocess,
        buf: &mut [u8],
        slots: &[FrameSlot],
        head: &mut Chain,
    ) -> Result<(), PreprocessError> {
        let key = [3u8; 32];
        for &s in slots {
            pre.stage(buf, s, &key, head);
        }
        pre.finish(buf, &key, head)
    }

    fn small_card() -> SoftCard {
        // 4-entry rings: a batch wraps them many times.
        let config =
            SoftCardConfig { desc_ring_log2: 2, cpl_ring_log2: 2, ..SoftCardConfig::default() };
        SoftCard::new(config).unwrap()
    }

    #[test]
    fn card_frames_equal_the_direct_path_byte_for_byte() {
        let lens: Vec<u32> =
            (0..300u32).map(|i| [0, 1, 7, 8, 9, 64, 200, 4096][i as usize % 8]).collect();
        let (mut buf, slots) = batch(&lens);
        let mut card = CardPreprocess::new(small_card()).unwrap();
        let genesis = [9u8; 16];
        let mut head = genesis;
        let before = realtime_ns();
        run(&mut card, &mut buf, &slots, &mut head).unwrap();
        let after = realtime_ns();
        assert_eq!(card.descriptors(), 3 * 300);
        // The direct path, given the card's timestamps, writes the same bytes.
        let (mut direct, _) = batch(&lens);
        let key = [3u8; 32];
        let mut dhead = genesis;
        let mut prev_ts = 0;
        for s in &slots {
            let h = decode_header(&buf[s.pos..s.pos + FRAME_HEADER_LEN], 4096).unwrap();
            assert_eq!((h.seq, h.len, h.flags), (s.seq, s.len, s.flags));
            assert!(h.timestamp_ns >= prev_ts, "card stamps go forward");
            // Tied to the Unix epoch within the calibration's error.
            assert!(h.timestamp_ns + 50_000_000 >= before && h.timestamp_ns <= after + 50_000_000);
            prev_ts = h.timestamp_ns;
            dhead = encode_frame(
                &mut direct[s.pos..],
                &key,
                &dhead,
                s.seq,
                h.timestamp_ns,
                s.flags,
                s.len as usize,
                &mut crc32c::crc32c_append,
            );
            let fl = frame_len(s.len as usize);
            assert_eq!(buf[s.pos..s.pos + fl], direct[s.pos..s.pos + fl], "frame seq {}", s.seq);
        }
        assert_eq!(head, dhead);
        // A second batch on the same card continues the chain.
        let (mut buf2, slots2) = batch(&[5, 6]);
        run(&mut card, &mut buf2, &slots2, &mut head).unwrap();
        assert_ne!(head, dhead);
    }

    /// A card double: forwards to a SoftCard and misbehaves on demand.
    struct Faulty {
        inner: SoftCard,
        mode: Arc<AtomicU8>,
    }
    const OK: u8 = 0;
    const SILENT: u8 = 1;
    const HALTED: u8 = 2;
    const BAD_TAG: u8 = 3;
    const BAD_STATUS: u8 = 4;

    impl Card for Faulty {
        unsafe fn enqueue(&mut self, desc: Descriptor) -> Result<(), CardError> {
            // SAFETY: the caller's contract, passed on.
            unsafe { self.inner.enqueue(desc) }
        }
        fn doorbell(&mut self) {
            self.inner.doorbell()
        }
        fn completions(&mut self, out: &mut [Completion]) -> usize {
            match self.mode.load(Ordering::Relaxed) {
                SILENT | HALTED => 0,
                mode => {
                    let n = self.inner.completions(out);
                    for c in &mut out[..n] {
                        if mode == BAD_TAG {
                            c.tag ^= 0x40;
                        } else if mode == BAD_STATUS {
                            c.status = cpl_status::BAD_DESCRIPTOR;
                        }
                    }
                    n
                }
            }
        }
        fn in_flight(&self) -> u32 {
            self.inner.in_flight()
        }
        fn check(&self) -> Result<(), CardError> {
            if self.mode.load(Ordering::Relaxed) == HALTED {
                return Err(CardError::Halted { fault: 1 });
            }
            self.inner.check()
        }
    }

    #[test]
    fn a_misbehaving_card_is_a_typed_error_then_stays_stopped() {
        for mode in [SILENT, HALTED, BAD_TAG, BAD_STATUS] {
            let flag = Arc::new(AtomicU8::new(OK));
            let card = Faulty { inner: small_card(), mode: Arc::clone(&flag) };
            let mut pre =
                CardPreprocess::new(card).unwrap().with_timeout(Duration::from_millis(50));
            let (mut buf, slots) = batch(&[10, 20, 30, 40, 50, 60, 70, 80]);
            let mut head = [0u8; 16];
            run(&mut pre, &mut buf, &slots, &mut head).unwrap();
            flag.store(mode, Ordering::Relaxed);
            let t = Instant::now();
            let err = run(&mut pre, &mut buf, &slots, &mut head).unwrap_err();
            assert!(t.elapsed() < Duration::from_secs(5), "mode {mode}: no hang");
            match (mode, &err) {
                (SILENT, PreprocessError::Timeout { in_flight, .. }) => assert!(*in_flight > 0),
                (HALTED, PreprocessError::Card(CardError::Halted { fault: 1 })) => {}
                (BAD_TAG, PreprocessError::Tag { .. }) => {}
                (BAD_STATUS, PreprocessError::Status { op: "timestamp", seq: 1, status: 2 }) => {}
                _ => panic!("mode {mode}: unexpected {err:?}"),
            }
            assert!(pre.card().is_none(), "the card is stopped");
            flag.store(OK, Ordering::Relaxed);
            let again = run(&mut pre, &mut buf, &slots, &mut head).unwrap_err();
            assert!(matches!(again, PreprocessError::Stopped), "{again:?}");
        }
    }

    mod journal {
        use std::sync::atomic::Ordering;
        use std::sync::Arc;
        use std::time::{Duration, Instant};

        use super::super::super::fault::FaultDisk;
        use super::super::super::format::{check_frame, decode_header};
        use super::super::super::{
            scan, verify, Anchor, Durability, Journal, JournalConfig, JournalError,
        };
        use super::*;

        const T: Duration = Duration::from_secs(10);

        fn config(disk: &FaultDisk, pre: Box<dyn Preprocess>) -> JournalConfig {
            let mut c = JournalConfig::new(Arc::new(disk.clone()), Durability::Local);
            c.ring_bytes = 64 << 10;
            c.max_record_bytes = 1024;
            c.max_batch_bytes = 16 << 10;
            c.preprocess = Some(pre);
            c
        }

        fn payload(seq: u64) -> Vec<u8> {
            (0..(seq * 7 % 300) as usize).map(|i| (seq as u8) ^ (i as u8)).collect()
        }

        #[test]
        fn a_journal_framed_by_the_card_verifies_and_has_the_direct_crcs() {
            let disk = FaultDisk::new(vec![0; 1 << 20]);
            let card = CardPreprocess::new(small_card()).unwrap();
            let j = Journal::create(config(&disk, Box::new(card))).unwrap();
            let mut tx = j.producer().unwrap();
            for i in 1..=1500u64 {
                assert_eq!(tx.append_blocking(&payload(i), T).unwrap(), i);
            }
            tx.wait_durable(1500, T).unwrap();
            drop(tx);
            j.close().unwrap();
            // Reopen with the direct path: the chain continues across the two.
            let j = Journal::open(config(&disk, Box::new(SoftPreprocess::default()))).unwrap();
            assert_eq!(j.recovery().last_seq, 1500);
            let mut tx = j.producer().unwrap();
            for i in 1501..=1600u64 {
                tx.append_blocking(&payload(i), T).unwrap();
            }
            tx.wait_durable(1600, T).unwrap();
            drop(tx);
            j.close().unwrap();
            let img = disk.durable();
            let report = verify(&mut &img[..], Anchor::default()).unwrap();
            assert_eq!((report.records, report.last_seq, report.problem), (1600, 1600, None));
            // Every frame's stored CRC is the one the direct CRC32C computes.
            let mut n = 0;
            scan(&mut &img[..], &mut |v| {
                let at = v.offset as usize;
                let fl = frame_len(v.header.len as usize);
                let frame = &img[at..at + fl];
                let h = decode_header(&frame[..FRAME_HEADER_LEN], 1024).unwrap();
                let direct = crc32c::crc32c_append(
                    crc32c::crc32c(&frame[..HEADER_CRC_LEN]),
                    &frame[FRAME_HEADER_LEN..],
                );
                assert_eq!(h.crc, direct, "seq {}", h.seq);
                assert!(check_frame(frame, &h, true).is_ok());
                assert_eq!(v.payload, payload(v.header.seq));
                n += 1;
                true
            })
            .unwrap();
            assert_eq!(n, 1600);
        }

        #[test]
        fn a_card_that_stops_answering_fails_the_writer_with_a_typed_error() {
            let disk = FaultDisk::new(vec![0; 1 << 20]);
            let flag = Arc::new(AtomicU8::new(OK));
            let card = Faulty { inner: small_card(), mode: Arc::clone(&flag) };
            let pre = CardPreprocess::new(card).unwrap().with_timeout(Duration::from_millis(100));
            let j = Journal::create(config(&disk, Box::new(pre))).unwrap();
            let mut tx = j.producer().unwrap();
            for i in 1..=200u64 {
                tx.append_blocking(&payload(i), T).unwrap();
            }
            tx.wait_durable(200, T).unwrap();
            flag.store(SILENT, Ordering::Relaxed);
            let seq = tx.append_blocking(&payload(201), T).unwrap();
            let t = Instant::now();
            let waited = tx.wait_durable(seq, T);
            assert!(waited.is_err(), "not acknowledged");
            assert!(t.elapsed() < Duration::from_secs(5), "reported, not hung: {:?}", t.elapsed());
            drop(tx);
            match j.close() {
                Err(JournalError::Preprocess(PreprocessError::Timeout { .. })) => {}
                other => panic!("{other:?}"),
            }
            // Everything acknowledged before is intact; nothing after was written.
            let img = disk.durable();
            let report = verify(&mut &img[..], Anchor::default()).unwrap();
            assert_eq!((report.last_seq, report.problem), (200, None));
        }
    }
}
