//! The load loop: keeps `qd` requests in flight for a case and records their latencies.

use std::time::{Duration, Instant};

use anyhow::Result;
use fastlane_hist::{HlogWriter, LatencyRecorder};

use super::client::Conn;
use super::clock::Clock;
use super::{BlkBenchError, Pattern, HLOG_INTERVAL, REQUESTS_PER_SECOND_MAX, STALL_TIMEOUT};

pub(super) struct Case<'a> {
    pub(super) name: &'a str,
    pub(super) pattern: Pattern,
    pub(super) qd: u16,
    pub(super) size: u32,
}

pub(super) struct Recording<'a> {
    pub(super) rec: &'a mut LatencyRecorder,
    /// Client time per request of each completion batch (see `client_ns_per_request_p50`).
    pub(super) client: &'a mut LatencyRecorder,
    pub(super) log: Option<&'a mut HlogWriter<std::io::BufWriter<std::fs::File>>>,
    pub(super) progress: bool,
}

pub(super) struct RunResult {
    pub(super) requests: u64,
    pub(super) seconds: f64,
    /// Kicks (eventfd writes) the device asked for.
    pub(super) kicks: u64,
}

/// xorshift64*: cheap, good enough for offsets.
#[derive(Debug)]
pub(super) struct XorShift(u64);

impl XorShift {
    pub(super) fn new(seed: u64) -> XorShift {
        XorShift(seed | 1)
    }

    #[inline]
    pub(super) fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..n` (n > 0), by multiply-shift.
    #[inline]
    pub(super) fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
    }
}

/// Keeps `case.qd` requests in flight for `budget`, then drains. With `recording`, every
/// completion's latency is recorded (and logged per second); without, it is a warm-up.
pub(super) fn drive(
    conn: &mut Conn,
    clock: &Clock,
    case: &Case<'_>,
    budget: Duration,
    mut recording: Option<Recording<'_>>,
    rng: &mut XorShift,
) -> Result<RunResult> {
    let blocks = conn.capacity_bytes / u64::from(case.size);
    let size = u64::from(case.size);
    let stall_ticks = clock.ticks(STALL_TIMEOUT);
    let interval_ticks = clock.ticks(HLOG_INTERVAL);
    let requests_max = (budget.as_secs_f64() * REQUESTS_PER_SECOND_MAX) as u64 + 1024;
    let submit_err = |source| BlkBenchError::Submit { case: case.name.to_string(), source };

    let wall_start = Instant::now();
    if let Some(r) = recording.as_mut() {
        // Start the first interval now (drops nothing: the recorder is fresh).
        let _ = r.rec.take_interval_at(wall_start);
    }
    let start = clock.now();
    let end = start + clock.ticks(budget);
    for slot in 0..case.qd {
        let offset = rng.below(blocks) * size;
        conn.offset[usize::from(slot)] = offset;
        conn.start[usize::from(slot)] = clock.now();
        conn.queue(case.pattern, slot, offset).map_err(submit_err)?;
    }
    let mut kicks = u64::from(conn.kick_if_needed().map_err(submit_err)?);

    let mut in_flight = case.qd;
    let mut stopping = false;
    let mut requests = 0u64;
    let mut last_done = start;
    let mut next_interval = start + interval_ticks;
    let mut last_progress = (start, 0u64);
    let mut idle_polls = 0u32;
    let mut stop_at = end;
    // Bounded: stops submitting at `end` or after `requests_max`; the drain ends when nothing
    // is in flight; a backend that stops answering ends it with `Stalled` after STALL_TIMEOUT.
    while in_flight > 0 {
        conn.done.clear();
        {
            let Conn { queue, done, offset, .. } = &mut *conn;
            for c in queue.completions() {
                done.push(c.context);
                if c.ret != 0 {
                    let slot = usize::from(c.context);
                    return Err(BlkBenchError::IoStatus {
                        case: case.name.to_string(),
                        op: if case.pattern == Pattern::Randread { "read" } else { "write" },
                        offset: offset[slot],
                        len: case.size,
                        status: std::io::Error::from_raw_os_error(-c.ret).to_string(),
                    }
                    .into());
                }
                // virtio-driver drops ids it did not hand out (or already completed), so
                // this never exceeds the requests in flight; stop there all the same.
                if done.len() >= usize::from(in_flight) {
                    break;
                }
            }
        }
        if conn.done.is_empty() {
            idle_polls = idle_polls.wrapping_add(1);
            if idle_polls.is_multiple_of(1024) && clock.now().wrapping_sub(last_done) > stall_ticks
            {
                return Err(
                    BlkBenchError::Stalled { case: case.name.to_string(), in_flight }.into()
                );
            }
            std::hint::spin_loop();
            continue;
        }
        let now = clock.now();
        last_done = now;
        in_flight -= conn.done.len() as u16;
        requests += conn.done.len() as u64;
        if let Some(r) = recording.as_mut() {
            for &slot in &conn.done {
                r.rec.record(clock.ns(now.wrapping_sub(conn.start[usize::from(slot)])));
            }
        }
        if !stopping && (now >= stop_at || requests >= requests_max) {
            stopping = true;
            stop_at = now;
        }
        if !stopping {
            for i in 0..conn.done.len() {
                let slot = conn.done[i];
                let offset = rng.below(blocks) * size;
                conn.offset[usize::from(slot)] = offset;
                conn.start[usize::from(slot)] = clock.now();
                conn.queue(case.pattern, slot, offset).map_err(submit_err)?;
            }
            in_flight += conn.done.len() as u16;
            kicks += u64::from(conn.kick_if_needed().map_err(submit_err)?);
        }
        if let Some(r) = recording.as_mut() {
            let spent = clock.ns(clock.now().wrapping_sub(now));
            r.client.record(spent / conn.done.len() as u64);
        }
        if now >= next_interval {
            next_interval = now + interval_ticks;
            if let Some(r) = recording.as_mut() {
                let iv = r.rec.take_interval();
                if let Some(l) = r.log.as_deref_mut() {
                    l.write_interval(Some(case.name), &iv)?;
                }
                if r.progress {
                    let secs = clock.ns(now - last_progress.0) as f64 / 1e9;
                    eprintln!(
                        "bench blk: {}: {:.0} s, {:.0} IOPS",
                        case.name,
                        clock.ns(now - start) as f64 / 1e9,
                        (requests - last_progress.1) as f64 / secs
                    );
                    last_progress = (now, requests);
                }
            }
        }
    }
    if let Some(r) = recording.as_mut() {
        let iv = r.rec.take_interval();
        if let Some(l) = r.log.as_deref_mut() {
            l.write_interval(Some(case.name), &iv)?;
        }
    }
    // IOPS over the submitting window; requests drained after it are few (< qd) and counted,
    // so measure up to the last completion.
    let seconds = clock.ns(last_done.wrapping_sub(start)) as f64 / 1e9;
    if let Some(r) = recording.as_mut() {
        let _ = r.client.take_interval();
    }
    Ok(RunResult { requests, seconds: seconds.max(1e-9), kicks })
}
