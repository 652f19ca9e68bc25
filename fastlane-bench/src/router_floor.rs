//! `fastlane llm bench --router-floor DIR`: where the quiet tenant's TTFT goes when `fastlane
//! router` is in front of an upstream without tiers (`llm serve --policy fifo`), read from the
//! JSON events both write at `RUST_LOG=trace --log-format json` (scripts/router-floor.sh runs
//! them and the loads). For every quiet request of the loaded run it splits the router's TTFT
//! into the upstream step in flight when the request arrived there, the whole steps between,
//! its own step, and the rest (router, HTTP, sampling); the floor a router cannot go below is
//! in flight + own step.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::Serialize;

/// One event of a JSON log: its wall-clock time (µs since the epoch) and its fields.
struct Event {
    t_us: i64,
    fields: serde_json::Map<String, serde_json::Value>,
}

/// Microseconds since the epoch of an RFC 3339 timestamp as tracing-subscriber writes it
/// (`2026-12-07T00:09:43.147966Z`; an offset `+HH:MM` is honoured too). The calendar is
/// `humantime`'s (UTC only), the offset ours.
fn rfc3339_us(s: &str) -> Option<i64> {
    let (utc, offset_s) = match s.len().checked_sub(6).map(|k| s.split_at(k)) {
        Some((t, o)) if (o.starts_with('+') || o.starts_with('-')) && o.as_bytes()[3] == b':' => {
            let v = o[1..3].parse::<i64>().ok()? * 3600 + o[4..6].parse::<i64>().ok()? * 60;
            (format!("{t}Z"), if o.starts_with('-') { -v } else { v })
        }
        _ => (s.to_string(), 0),
    };
    let t = humantime::parse_rfc3339(&utc).ok()?;
    let us = i64::try_from(t.duration_since(std::time::UNIX_EPOCH).ok()?.as_micros()).ok()?;
    Some(us - offset_s * 1_000_000)
}

/// The events named `event` (`fields.event`) of a JSON log; other lines are skipped.
fn events(log: &str, event: &str) -> Vec<Event> {
    log.lines()
        .filter(|l| l.starts_with('{'))
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| {
            let fields = v.get("fields")?.as_object()?.clone();
            if fields.get("event")?.as_str()? != event {
                return None;
            }
            Some(Event { t_us: rfc3339_us(v.get("timestamp")?.as_str()?)?, fields })
        })
        .collect()
}

fn field(e: &Event, name: &str) -> Result<i64> {
    e.fields
        .get(name)
        .and_then(serde_json::Value::as_i64)
        .with_context(|| format!("event without the integer field {name}: {:?}", e.fields))
}

/// One quiet request's TTFT at the router, split (µs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Split {
    /// TTFT measured by the router.
    pub ttft: i64,
    /// The rest of the upstream step running when the request arrived there.
    pub in_flight: i64,
    /// Whole steps after that one and before the request's own.
    pub between: i64,
    /// The step that computed its prompt and first token.
    pub own_step: i64,
    /// Everything else: router, HTTP, sampling, the first token's bytes.
    pub rest: i64,
    /// in flight + own step: what a router cannot take away before an upstream without tiers.
    pub floor: i64,
}

/// The engine's steps (start, end, carried a prefill) over the loaded run.
fn steps(upstream_log: &str) -> Result<Vec<(i64, i64, bool)>> {
    let mut v = Vec::new();
    for e in events(upstream_log, "step") {
        v.push((e.t_us - field(&e, "step_us")?, e.t_us, field(&e, "prefill_items")? > 0));
    }
    v.sort_unstable();
    Ok(v)
}

/// Splits the TTFT of every quiet request the router saw inside `window` (µs since the
/// epoch). Errors name what a log lacks: no steps, no quiet first bytes.
pub fn split(upstream_log: &str, router_log: &str, window: (i64, i64)) -> Result<Vec<Split>> {
    let (lo, hi) = window;
    let steps = steps(upstream_log)?;
    if steps.is_empty() {
        bail!("no engine `step` events in the upstream's log (RUST_LOG=trace --log-format json?)");
    }
    let starts: Vec<i64> = steps.iter().map(|s| s.0).collect();
    // Submission to the engine: written when the engine thread takes the request, saying how
    // long before that it was submitted.
    let mut arrived = Vec::new();
    for e in events(upstream_log, "request_taken") {
        arrived.push(e.t_us - field(&e, "waited_us")?);
    }
    arrived.sort_unstable();
    let quiet = |e: &Event| e.fields.get("tenant").and_then(|t| t.as_str()) == Some("quiet");
    // Both router events say how long after the request's arrival at the router they were
    // written: a dispatch and a first bytes whose arrivals agree within 1 ms are one request.
    let mut dispatched = Vec::new();
    for e in events(router_log, "dispatched").iter().filter(|e| quiet(e)) {
        if (lo..=hi).contains(&e.t_us) {
            dispatched.push((e.t_us - field(e, "after_us")?, e.t_us));
        }
    }
    dispatched.sort_unstable();
    let mut out = Vec::new();
    for e in events(router_log, "first_bytes").iter().filter(|e| quiet(e)) {
        if !(lo..=hi).contains(&e.t_us) {
            continue;
        }
        let ttft = field(e, "after_us")?;
        let arrival = e.t_us - ttft;
        let k = dispatched.partition_point(|d| d.0 < arrival - 1000);
        let Some(&(da, d)) = dispatched.get(k) else { continue };
        if (da - arrival).abs() > 1000 {
            continue;
        }
        // Its arrival at the upstream: the first engine arrival after the dispatch.
        let a = arrived.get(arrived.partition_point(|&x| x < d)).copied().unwrap_or(d);
        let i = starts.partition_point(|&s| s <= a).checked_sub(1);
        let in_flight = i.map_or(0, |i| (steps[i].1 - a).max(0));
        // Its own step: the last one that started before its first bytes and ended by then.
        let mut j = starts.partition_point(|&s| s <= e.t_us).checked_sub(1);
        while let Some(jj) = j {
            if steps[jj].1 <= e.t_us {
                break;
            }
            j = jj.checked_sub(1);
        }
        let after_i = |x: usize| i.is_none_or(|i| x > i);
        let own_step = j.filter(|&j| after_i(j)).map_or(0, |j| steps[j].1 - steps[j].0);
        let from = i.map_or(0, |i| i + 1);
        let between = match j {
            Some(j) if j > from => steps[from..j].iter().map(|s| s.1 - s.0).sum(),
            _ => 0,
        };
        out.push(Split {
            ttft,
            in_flight,
            between,
            own_step,
            rest: ttft - in_flight - between - own_step,
            floor: in_flight + own_step,
        });
    }
    if out.is_empty() {
        bail!("no quiet request's dispatch and first bytes in the router's log inside the window");
    }
    Ok(out)
}

/// Share of the window's span the upstream spent in steps, and in steps with a prefill.
pub fn busy_shares(upstream_log: &str, window: (i64, i64)) -> Result<(f64, f64)> {
    let busy: Vec<_> =
        steps(upstream_log)?.into_iter().filter(|s| (window.0..=window.1).contains(&s.0)).collect();
    let (Some(first), Some(last)) = (busy.first(), busy.last()) else {
        return Ok((0.0, 0.0));
    };
    let span = (last.1 - first.0).max(1) as f64;
    let total: i64 = busy.iter().map(|s| s.1 - s.0).sum();
    let prefill: i64 = busy.iter().filter(|s| s.2).map(|s| s.1 - s.0).sum();
    Ok((total as f64 / span, prefill as f64 / span))
}

/// The run of scripts/router-floor.sh in `dir` (its files: `up-loaded.log`,
/// `router-loaded.log`, `solo.json`, `loaded.json`, `loaded.from`, `loaded.to`): the summary
/// and every request's split as JSON, and the table on stdout unless `json`.
pub fn report(dir: &Path, json: bool) -> Result<serde_json::Value> {
    let read = |name: &str| {
        std::fs::read_to_string(dir.join(name))
            .with_context(|| format!("reading {}", dir.join(name).display()))
    };
    let secs = |name: &str| -> Result<i64> {
        let v: f64 = read(name)?.trim().parse().with_context(|| format!("{name}: seconds"))?;
        Ok((v * 1e6) as i64)
    };
    let window = (secs("loaded.from")?, secs("loaded.to")?);
    let (up, router) = (read("up-loaded.log")?, read("router-loaded.log")?);
    let parts = split(&up, &router, window)?;
    let (busy, prefill) = busy_shares(&up, window)?;
    let tenant = |run: &str, name: &str| -> Result<serde_json::Value> {
        let v: serde_json::Value = serde_json::from_str(&read(&format!("{run}.json"))?)?;
        v["tenants"]
            .as_array()
            .and_then(|t| t.iter().find(|x| x["tenant"] == name))
            .cloned()
            .with_context(|| format!("no tenant {name} in {run}.json"))
    };
    let num = |v: &serde_json::Value, k: &str| -> Result<f64> {
        v[k].as_f64().with_context(|| format!("no number {k} in {v}"))
    };
    let solo_p99 = num(&tenant("solo", "quiet")?, "ttft_p99_ms")?;
    let loaded_p99 = num(&tenant("loaded", "quiet")?, "ttft_p99_ms")?;
    let flood = num(&tenant("loaded", "flood")?, "completed_per_s")?;
    let q = |f: fn(&Split) -> i64, p: f64| {
        let mut v: Vec<f64> = parts.iter().map(|s| f(s) as f64).collect();
        v.sort_by(f64::total_cmp);
        // Nearest rank as the script computed it: index floor(p * n), capped.
        v[((p * v.len() as f64) as usize).min(v.len() - 1)] / 1e3
    };
    type Get = fn(&Split) -> i64;
    let kinds: [(&str, &str, Get); 6] = [
        ("in_flight", "upstream step in flight at arrival", |s| s.in_flight),
        ("between", "steps between", |s| s.between),
        ("own_step", "its own step", |s| s.own_step),
        ("rest", "rest (router, HTTP, sampling)", |s| s.rest),
        ("ttft", "TTFT at the router", |s| s.ttft),
        ("floor", "floor: in flight + own step", |s| s.floor),
    ];
    let mut parts_ms = serde_json::Map::new();
    for (k, _, f) in kinds {
        parts_ms.insert(k.into(), serde_json::json!({"p50": q(f, 0.5), "p99": q(f, 0.99)}));
    }
    let floor_over_solo = q(|s| s.floor, 0.99) / solo_p99;
    if !json {
        println!(
            "quiet tenant through the router before `llm serve --policy fifo`: {} quiet requests; solo P99 {solo_p99:.1} ms, loaded P99 {loaded_p99:.1} ms ({:.2}x), flood {flood:.2}/s",
            parts.len(),
            loaded_p99 / solo_p99
        );
        println!(
            "upstream busy {:.0}% of the loaded run, in steps with a prefill {:.0}%",
            busy * 100.0,
            prefill * 100.0
        );
        println!("{:<36} {:>8} {:>8}", "part of the TTFT (router-measured)", "P50 ms", "P99 ms");
        for (_, name, f) in kinds {
            println!("{name:<36} {:>8.1} {:>8.1}", q(f, 0.5), q(f, 0.99));
        }
        println!("floor P99 / solo P99: {floor_over_solo:.2}x");
    }
    Ok(serde_json::json!({
        "summary": {
            "quiet_samples": parts.len(),
            "solo_p99_ms": solo_p99,
            "loaded_p99_ms": loaded_p99,
            "loaded_over_solo_p99": loaded_p99 / solo_p99,
            "flood_completed_per_s": flood,
            "upstream_busy_share": busy,
            "upstream_prefill_step_share": prefill,
            "router_ttft_ms": parts_ms,
            "floor_over_solo_p99": floor_over_solo,
        },
        "requests": parts,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_is_read_to_the_microsecond() {
        assert_eq!(rfc3339_us("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(rfc3339_us("1970-01-01T00:00:01.5Z"), Some(1_500_000));
        // 2026-12-07T00:09:43.147966Z = 1796602183 s (date -d ... +%s).
        assert_eq!(rfc3339_us("2026-12-07T00:09:43.147966Z"), Some(1_796_602_183_147_966));
        assert_eq!(rfc3339_us("2026-12-07T01:09:43.147966+01:00"), Some(1_796_602_183_147_966));
        assert_eq!(rfc3339_us("2024-02-29T12:00:00.123456789Z"), Some(1_709_208_000_123_456));
        assert_eq!(rfc3339_us("yesterday"), None);
        assert_eq!(rfc3339_us("2026-12-07T00:09:43"), None);
    }

    /// A JSON log line at `t_us` (µs since the epoch) with these fields.
    fn line(t_us: i64, fields: serde_json::Value) -> String {
        let (s, us) = (t_us.div_euclid(1_000_000), t_us.rem_euclid(1_000_000));
        let (days, sod) = (s / 86_400, s % 86_400);
        assert_eq!(days, 20_429, "the helper writes 2025-12-07 only");
        let ts =
            format!("2025-12-07T{:02}:{:02}:{:02}.{us:06}Z", sod / 3600, sod % 3600 / 60, sod % 60);
        serde_json::json!({"timestamp": ts, "level": "TRACE", "fields": fields}).to_string()
    }

    #[test]
    fn a_requests_ttft_is_split_into_the_steps_around_it() {
        let t0 = 20_429 * 86_400 * 1_000_000i64; // 2025-12-07T00:00:00Z
        assert_eq!(rfc3339_us("2025-12-07T00:00:00Z"), Some(t0));
        let step = |end: i64, dur: i64, prefill: i64| {
            line(
                t0 + end,
                serde_json::json!({"event": "step", "step_us": dur, "prefill_items": prefill}),
            )
        };
        // Steps [0, 10 ms), [10, 20), [20, 30) (its own: a prefill); the request reaches the
        // router at 4 ms, is dispatched at 5 ms, taken by the engine at 6 ms (submitted at 5.5).
        let up = [
            "not json".to_string(),
            step(10_000, 10_000, 0),
            line(t0 + 6_000, serde_json::json!({"event": "request_taken", "waited_us": 500})),
            step(20_000, 10_000, 0),
            step(30_000, 10_000, 1),
        ]
        .join("\n");
        let router = [
            line(
                t0 + 5_000,
                serde_json::json!({"event": "dispatched", "tenant": "quiet", "after_us": 1_000}),
            ),
            line(
                t0 + 31_000,
                serde_json::json!({"event": "first_bytes", "tenant": "quiet", "after_us": 27_000}),
            ),
            line(
                t0 + 31_000,
                serde_json::json!({"event": "first_bytes", "tenant": "flood", "after_us": 9}),
            ),
        ]
        .join("\n");
        let parts = split(&up, &router, (t0, t0 + 60_000)).unwrap();
        assert_eq!(
            parts,
            [Split {
                ttft: 27_000,
                in_flight: 4_500,
                between: 10_000,
                own_step: 10_000,
                rest: 2_500,
                floor: 14_500
            }]
        );
        let (busy, prefill) = busy_shares(&up, (t0 - 20_000, t0 + 60_000)).unwrap();
        assert!(
            (busy - 1.0).abs() < 1e-9 && (prefill - 1.0 / 3.0).abs() < 1e-9,
            "{busy} {prefill}"
        );
        // Outside the window, or without engine steps: an error, not an empty split.
        assert!(split(&up, &router, (t0 + 40_000, t0 + 60_000)).is_err());
        assert!(split("", &router, (t0, t0 + 60_000)).unwrap_err().to_string().contains("step"));
    }
}
