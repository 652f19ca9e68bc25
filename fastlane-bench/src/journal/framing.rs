//! What framing a record costs the writer, measured alone on the bench's thread.

use std::time::Instant;

use anyhow::Result;
use fastlane_journal::format::{chain_next, encode_frame, frame_len};
use fastlane_journal::{FrameSlot, Preprocess, SoftPreprocess};

/// What framing costs the writer per record, measured alone on this thread (ns/record):
/// the whole frame, then its parts, then BLAKE3 over a 1024-record batch as one input (what
/// a per-batch chain would cost).
pub(super) struct FramingCost {
    pub(super) frame: f64,
    pub(super) chain: f64,
    pub(super) crc: f64,
    pub(super) timestamp: f64,
    pub(super) batch_hash: f64,
}

pub(super) fn framing_cost(record_bytes: usize) -> FramingCost {
    const N: usize = 1024;
    const ROUNDS: usize = 200;
    let fl = frame_len(record_bytes);
    let mut buf = vec![0xA5u8; fl * N];
    let key = [7u8; 32];
    let mut prev = [0u8; 16];
    let pre = SoftPreprocess::default();
    let per = |t: Instant| t.elapsed().as_nanos() as f64 / (N * ROUNDS) as f64;
    let t = Instant::now();
    for r in 0..ROUNDS {
        for i in 0..N {
            let seq = (r * N + i) as u64 + 1;
            let ts = pre.timestamp_ns();
            prev = encode_frame(
                &mut buf[i * fl..],
                &key,
                &prev,
                seq,
                ts,
                0,
                record_bytes,
                &mut |c, d| pre.crc32c_append(c, d),
            );
        }
    }
    let frame = per(t);
    let payload = vec![0x5Au8; record_bytes];
    let t = Instant::now();
    for i in 0..N * ROUNDS {
        prev = chain_next(&key, &prev, i as u64, record_bytes as u32, 0, 0, &payload);
    }
    let chain = per(t);
    let t = Instant::now();
    let mut crc = 0u32;
    for i in 0..N * ROUNDS {
        crc = pre.crc32c_append(crc, &buf[(i % N) * fl..(i % N) * fl + fl]);
    }
    let crc_ns = per(t);
    let t = Instant::now();
    let mut acc = 0u64;
    for _ in 0..N * ROUNDS {
        acc = acc.wrapping_add(pre.timestamp_ns());
    }
    let timestamp = per(t);
    let t = Instant::now();
    for r in 0..ROUNDS {
        prev = chain_next(&key, &prev, r as u64, buf.len() as u32, 0, 0, &buf);
    }
    let batch_hash = per(t);
    std::hint::black_box((prev, crc, acc));
    FramingCost { frame, chain, crc: crc_ns, timestamp, batch_hash }
}

/// ns/record of framing 1024-record batches through `pre`'s stage/finish seam (what the
/// writer calls), measured alone on this thread.
pub(super) fn framing_via(pre: &mut dyn Preprocess, record_bytes: usize) -> Result<f64> {
    const N: usize = 1024;
    const ROUNDS: usize = 100;
    let fl = frame_len(record_bytes);
    let mut buf = vec![0xA5u8; fl * N];
    let key = [7u8; 32];
    let mut head = [0u8; 16];
    let t = Instant::now();
    for r in 0..ROUNDS {
        for i in 0..N {
            let seq = (r * N + i) as u64 + 1;
            let slot = FrameSlot { pos: i * fl, seq, len: record_bytes as u32, flags: 0 };
            pre.stage(&mut buf, slot, &key, &mut head);
        }
        pre.finish(&mut buf, &key, &mut head)?;
    }
    std::hint::black_box(head);
    Ok(t.elapsed().as_nanos() as f64 / (N * ROUNDS) as f64)
}
