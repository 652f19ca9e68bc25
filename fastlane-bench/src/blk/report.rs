//! The report: the `--json` structures, the table, and `--compare` of two reports.

use std::io::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use fastlane_hist::{format_ns, Summary};
use serde::{Deserialize, Serialize};

use super::Pattern;

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct ClockReport {
    /// `tsc` or `instant`.
    pub(super) source: String,
    pub(super) ns_per_tick: f64,
    /// Cost of one RDTSC, ns (absent without an invariant TSC).
    pub(super) tsc_call_ns: Option<f64>,
    /// Cost of one `Instant::now()` + `elapsed()`, halved: one clock read, ns.
    pub(super) instant_call_ns: f64,
}

/// Latency figures of one case, ns (a [`Summary`] that can be read back).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub(super) struct Latency {
    pub(super) count: u64,
    pub(super) min_ns: u64,
    pub(super) mean_ns: f64,
    pub(super) p50_ns: u64,
    pub(super) p90_ns: u64,
    pub(super) p99_ns: u64,
    pub(super) p99_9_ns: u64,
    pub(super) max_ns: u64,
}

impl From<Summary> for Latency {
    fn from(s: Summary) -> Latency {
        Latency {
            count: s.count,
            min_ns: s.min_ns,
            mean_ns: s.mean_ns,
            p50_ns: s.p50_ns,
            p90_ns: s.p90_ns,
            p99_ns: s.p99_ns,
            p99_9_ns: s.p99_9_ns,
            max_ns: s.max_ns,
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct CaseReport {
    /// `qd{N}_{pattern}`, also the `--hlog` tag.
    pub(super) name: String,
    pub(super) pattern: Pattern,
    pub(super) qd: u16,
    pub(super) requests: u64,
    pub(super) seconds: f64,
    pub(super) iops: f64,
    pub(super) mib_per_s: f64,
    /// Request latency, from queuing to the completion being seen.
    pub(super) latency: Latency,
    /// Latencies above 10 s (recorded as 10 s).
    pub(super) latency_overflow: u64,
    /// Kicks per request: 1 when the device wants a notification for every request (it
    /// sleeps between them), near 0 when it polls and suppresses them (EVENT_IDX).
    #[serde(default)]
    pub(super) kicks_per_request: f64,
    /// Median over completion batches of the client's time per request between seeing the
    /// batch and having resubmitted it (recording, queuing, kicking), ns: the client's own
    /// share of each round trip. A median, so that preemptions of the client do not count.
    #[serde(default)]
    pub(super) client_ns_per_request_p50: u64,
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct BlkReport {
    pub(super) socket: String,
    pub(super) capacity_bytes: u64,
    pub(super) virtio_features: String,
    pub(super) event_idx: bool,
    pub(super) size_bytes: u32,
    pub(super) seconds_per_case: f64,
    pub(super) warmup_seconds: f64,
    pub(super) pin_core: Option<usize>,
    pub(super) clock: ClockReport,
    /// The `--verify` pass, if one ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) verified: Option<VerifyReport>,
    pub(super) cases: Vec<CaseReport>,
}

/// What `--verify` wrote, read back and found equal.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub(super) struct VerifyReport {
    pub(super) offset: u64,
    pub(super) len: u64,
    pub(super) seed: u64,
    /// Wall time of the write pass and of the read-and-compare pass.
    pub(super) write_seconds: f64,
    pub(super) read_seconds: f64,
}

pub(super) fn print_table(out: &mut impl std::io::Write, r: &BlkReport) -> Result<()> {
    let c = &r.clock;
    if let Some(v) = &r.verified {
        writeln!(
            out,
            "verified: {} bytes at {} (seed {}) written, read back equal",
            v.len, v.offset, v.seed
        )?;
    }
    writeln!(
        out,
        "vhost-user-blk {} ({} MiB, EVENT_IDX {}), {} B requests, one queue, busy-polled, \
         client {}",
        r.socket,
        r.capacity_bytes >> 20,
        if r.event_idx { "on" } else { "off" },
        r.size_bytes,
        r.pin_core.map_or("unpinned".to_string(), |c| format!("on CPU {c}")),
    )?;
    writeln!(
        out,
        "clock: {} (RDTSC {}, Instant {:.1} ns per read)\n",
        c.source,
        c.tsc_call_ns.map_or("n/a".into(), |v| format!("{v:.1} ns")),
        c.instant_call_ns,
    )?;
    writeln!(
        out,
        "{:<16} {:>10} {:>11} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10}",
        "case",
        "requests",
        "IOPS",
        "MiB/s",
        "P50",
        "P90",
        "P99",
        "P99.9",
        "max",
        "client/req",
        "kicks/req"
    )?;
    for k in &r.cases {
        let l = &k.latency;
        writeln!(
            out,
            "{:<16} {:>10} {:>11.0} {:>9.1} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10.3}",
            k.name,
            k.requests,
            k.iops,
            k.mib_per_s,
            format_ns(l.p50_ns as f64),
            format_ns(l.p90_ns as f64),
            format_ns(l.p99_ns as f64),
            format_ns(l.p99_9_ns as f64),
            format_ns(l.max_ns as f64),
            format_ns(k.client_ns_per_request_p50 as f64),
            k.kicks_per_request,
        )?;
    }
    Ok(())
}

pub(super) fn read_report(path: &Path) -> Result<BlkReport> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text)
        .with_context(|| format!("{} is not a `fastlane bench blk --json` report", path.display()))
}

/// One row of the ratio table.
pub(super) struct Row {
    pub(super) case: String,
    pub(super) metric: &'static str,
    pub(super) a: f64,
    pub(super) b: f64,
    /// Latency: lower is better, target is a maximum of B/A; IOPS: a minimum.
    pub(super) lower_is_better: bool,
    pub(super) target: Option<f64>,
}

pub(super) fn compare(
    a_path: &Path,
    b_path: &Path,
    labels: Option<&[String]>,
    p50_target: f64,
) -> Result<()> {
    let (a, b) = (read_report(a_path)?, read_report(b_path)?);
    let name = |p: &Path| p.file_stem().map_or("?".into(), |s| s.to_string_lossy().into_owned());
    let (la, lb) = match labels {
        Some([x, y]) => (x.clone(), y.clone()),
        Some(_) => anyhow::bail!("--labels takes two names: A,B"),
        None => (name(a_path), name(b_path)),
    };
    let mut rows = Vec::new();
    for ca in &a.cases {
        let Some(cb) = b.cases.iter().find(|c| c.name == ca.name) else { continue };
        let lat = |metric, x: u64, y: u64, target| Row {
            case: ca.name.clone(),
            metric,
            a: x as f64,
            b: y as f64,
            lower_is_better: true,
            target,
        };
        // The targets: QD1 P50 at most `p50_target` of the baseline's (0.5 unless given) and
        // P99 at most half; deeper queues at least twice its IOPS.
        let qd1 = ca.qd == 1;
        rows.push(lat("P50", ca.latency.p50_ns, cb.latency.p50_ns, qd1.then_some(p50_target)));
        rows.push(lat("P99", ca.latency.p99_ns, cb.latency.p99_ns, qd1.then_some(0.5)));
        if !qd1 {
            rows.push(Row {
                case: ca.name.clone(),
                metric: "IOPS",
                a: ca.iops,
                b: cb.iops,
                lower_is_better: false,
                target: Some(2.0),
            });
        }
    }
    anyhow::ensure!(!rows.is_empty(), "the two reports have no case in common");
    let mut out = std::io::stdout().lock();
    writeln!(out, "B / A with A = {la} ({}), B = {lb} ({})\n", a.socket, b.socket)?;
    writeln!(
        out,
        "{:<16} {:<6} {:>12} {:>12} {:>7} {:>8} {:>5}",
        "case", "metric", la, lb, "B/A", "target", "met"
    )?;
    let fmt_v = |r: &Row, v: f64| {
        if r.lower_is_better {
            format_ns(v)
        } else {
            format!("{v:.0}")
        }
    };
    for r in &rows {
        let ratio = if r.a > 0.0 { r.b / r.a } else { f64::NAN };
        let (target, met) = match r.target {
            None => (String::new(), ""),
            Some(t) if r.lower_is_better => {
                (format!("<= {t:.2}"), if ratio <= t { "yes" } else { "no" })
            }
            Some(t) => (format!(">= {t:.2}"), if ratio >= t { "yes" } else { "no" }),
        };
        writeln!(
            out,
            "{:<16} {:<6} {:>12} {:>12} {:>7.2} {:>8} {:>5}",
            r.case,
            r.metric,
            fmt_v(r, r.a),
            fmt_v(r, r.b),
            ratio,
            target,
            met
        )?;
    }
    Ok(())
}
