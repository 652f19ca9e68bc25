//! `--verify`: a seeded pattern written over a range, read back and compared.

use std::time::Instant;

use anyhow::Result;

use super::client::Conn;
use super::report::VerifyReport;
use super::{BlkBenchError, Pattern, STALL_TIMEOUT};

/// `--verify`: write the pattern over `[offset, offset + len)`, read it back, compare.
pub(super) fn verify(
    conn: &mut Conn,
    offset: u64,
    len: u64,
    seed: u64,
    qd: u16,
) -> Result<VerifyReport> {
    let size = u64::from(conn.size);
    anyhow::ensure!(
        offset.is_multiple_of(size) && len.is_multiple_of(size),
        "--verify {offset}:{len}: offset and length must be multiples of --size ({size})"
    );
    anyhow::ensure!(
        offset.checked_add(len).is_some_and(|end| end <= conn.capacity_bytes),
        "--verify {offset}:{len}: beyond the disk ({} bytes)",
        conn.capacity_bytes
    );
    anyhow::ensure!(!conn.read_only, "--verify needs a writable disk");
    let t = Instant::now();
    verify_pass(conn, Pattern::Randwrite, offset, len, seed, qd)?;
    let write_seconds = t.elapsed().as_secs_f64();
    let t = Instant::now();
    verify_pass(conn, Pattern::Randread, offset, len, seed, qd)?;
    let read_seconds = t.elapsed().as_secs_f64();
    eprintln!(
        "bench blk: verified {len} bytes at {offset} (seed {seed}): written in {write_seconds:.2} s, \
         read back equal in {read_seconds:.2} s"
    );
    Ok(VerifyReport { offset, len, seed, write_seconds, read_seconds })
}

/// One pass of `--verify`: `op` (Randwrite: write the pattern; Randread: read and compare)
/// over the range in `--size` requests, sequentially, `qd` in flight.
pub(super) fn verify_pass(
    conn: &mut Conn,
    op: Pattern,
    start: u64,
    len: u64,
    seed: u64,
    qd: u16,
) -> Result<()> {
    let case = "verify";
    let size = conn.size as usize;
    let chunks = len / size as u64;
    let mut expect = vec![0u8; size];
    let mut got = vec![0u8; size];
    let mut free: Vec<u16> = (0..qd).rev().collect();
    let (mut next, mut in_flight) = (0u64, 0u16);
    let mut last_done = Instant::now();
    let submit_err = |source| BlkBenchError::Submit { case: case.to_string(), source };
    // Bounded: `chunks` requests, each waited for at most STALL_TIMEOUT.
    while next < chunks || in_flight > 0 {
        let mut queued = false;
        while next < chunks {
            let Some(slot) = free.pop() else { break };
            let off = start + next * size as u64;
            conn.offset[usize::from(slot)] = off;
            let data = conn.slot_ptr(slot);
            if op == Pattern::Randwrite {
                fastlane_util::pattern::fill(seed, off, &mut expect);
                // SAFETY:
                // - `data..data + size` is the slot's range of the shared buffer (alive as
                //   long as `conn`); the slot is free, so no request is reading or writing it;
                // - a raw copy: no reference into memory the backend accesses.
                unsafe { std::ptr::copy_nonoverlapping(expect.as_ptr(), data, size) };
            } else {
                // SAFETY: as above (a free slot of the shared buffer); raw write.
                unsafe { std::ptr::write_bytes(data, 0, size) };
            }
            conn.queue(op, slot, off).map_err(submit_err)?;
            (next, in_flight, queued) = (next + 1, in_flight + 1, true);
        }
        if queued {
            conn.kick_if_needed().map_err(submit_err)?;
        }
        conn.done.clear();
        {
            let Conn { queue, done, offset, .. } = &mut *conn;
            for c in queue.completions() {
                if c.ret != 0 {
                    return Err(BlkBenchError::IoStatus {
                        case: case.to_string(),
                        op: if op == Pattern::Randread { "read" } else { "write" },
                        offset: offset[usize::from(c.context)],
                        len: size as u32,
                        status: std::io::Error::from_raw_os_error(-c.ret).to_string(),
                    }
                    .into());
                }
                done.push(c.context);
                if done.len() >= usize::from(in_flight) {
                    break;
                }
            }
        }
        if conn.done.is_empty() {
            if last_done.elapsed() > STALL_TIMEOUT {
                return Err(BlkBenchError::Stalled { case: case.to_string(), in_flight }.into());
            }
            std::hint::spin_loop();
            continue;
        }
        last_done = Instant::now();
        in_flight -= conn.done.len() as u16;
        for i in 0..conn.done.len() {
            let slot = conn.done[i];
            if op == Pattern::Randread {
                let off = conn.offset[usize::from(slot)];
                // SAFETY: the slot's read has completed, so nothing writes its range any more;
                // a raw copy out of the shared buffer.
                unsafe {
                    std::ptr::copy_nonoverlapping(conn.slot_ptr(slot), got.as_mut_ptr(), size)
                };
                fastlane_util::pattern::fill(seed, off, &mut expect);
                if let Some(i) = got.iter().zip(&expect).position(|(a, b)| a != b) {
                    anyhow::bail!(
                        "--verify: byte {} of the disk reads back {:#04x}, {:#04x} was written",
                        off + i as u64,
                        got[i],
                        expect[i]
                    );
                }
            }
            free.push(slot);
        }
    }
    Ok(())
}
