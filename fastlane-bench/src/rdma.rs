//! `fastlane rdma bench`: RDMA WRITE latency and bandwidth between two processes.
//!
//! `fastlane rdma bench --device rxe0 --listen ADDR` (one process) and
//! `fastlane rdma bench --device rxe0 --connect ADDR` (the other) measure RDMA WRITE latency
//! as perftest's `ib_write_lat` does (a ping-pong of WRITEs, each side polling the last byte of
//! its receive area; one-way latency = round trip / 2, timed with the TSC) for each `--sizes`,
//! and WRITE bandwidth as `ib_write_bw` does (`--bw-depth` WRITEs of `--bw-size` in flight, a
//! completion every 64). The client prints the results (with `--json`, as one JSON object);
//! the parameters travel from the client to the server, so the server needs only `--listen`.

use std::io::{BufRead, BufReader, Write as _};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use fastlane_hist::{format_ns, HlogWriter, LatencyRecorder, Summary};
use fastlane_rdma::{ConnectOptions, Connection, Device, Listener, QpConfig, RdmaError, SendOp};
use fastlane_util::parse_size;
use fastlane_util::tsc::read_tsc as tsc;
use serde::Serialize;

/// Arguments of `fastlane rdma bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// RDMA device name.
    #[arg(long, default_value = "rxe0")]
    device: String,
    /// GID index (default: the first IPv4-mapped GID).
    #[arg(long)]
    gid_index: Option<u8>,
    /// Be the server: wait for one client on this address.
    #[arg(long, conflicts_with = "connect", required_unless_present = "connect")]
    listen: Option<SocketAddr>,
    /// Be the client: connect to a server on this address and report.
    #[arg(long)]
    connect: Option<SocketAddr>,
    /// Message sizes of the latency ping-pong (bytes, K/M suffixes; at most 1M).
    #[arg(long, value_delimiter = ',', default_value = "8,64,512,4K,64K", value_parser = parse_size)]
    sizes: Vec<u64>,
    /// Timed round trips per size (after iters/10 warm-up ones).
    #[arg(long, default_value_t = 1000)]
    iters: u64,
    /// Message size of the bandwidth run.
    #[arg(long, default_value = "64K", value_parser = parse_size)]
    bw_size: u64,
    /// WRITEs in the bandwidth run.
    #[arg(long, default_value_t = 5000)]
    bw_iters: u64,
    /// WRITEs in flight in the bandwidth run.
    #[arg(long, default_value_t = 128)]
    bw_depth: u32,
    /// Write one-way latency histograms (one interval per size, tag `write_<size>B`).
    #[arg(long)]
    hlog: Option<PathBuf>,
    /// Client: print the results as one JSON object on stdout instead of the tables (the
    /// `RESULT` lines go to stderr). The server prints no results either way.
    #[arg(long)]
    json: bool,
}

/// One message size of the latency ping-pong, in `fastlane rdma bench --json`.
#[derive(Debug, Serialize)]
struct LatencyReport {
    size_bytes: usize,
    /// Timed round trips.
    iters: u64,
    /// One-way latency (half of each round trip), ns.
    one_way: Summary,
}

/// The bandwidth run, in `fastlane rdma bench --json`.
#[derive(Debug, Serialize)]
struct BandwidthReport {
    size_bytes: usize,
    /// WRITEs posted.
    iters: u64,
    /// WRITEs in flight.
    depth: u32,
    /// Bytes written (`size_bytes` × `iters`).
    bytes: u64,
    /// From the first post to the last completion.
    elapsed_ns: u64,
    bytes_per_s: f64,
    /// WRITEs per second.
    messages_per_s: f64,
}

impl BandwidthReport {
    /// `iters` WRITEs of `size_bytes`, `depth` in flight, done in `elapsed`.
    fn new(size_bytes: usize, iters: u64, depth: u32, elapsed: Duration) -> Self {
        let bytes = size_bytes as u64 * iters;
        let s = elapsed.as_secs_f64();
        BandwidthReport {
            size_bytes,
            iters,
            depth,
            bytes,
            elapsed_ns: u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX),
            bytes_per_s: bytes as f64 / s,
            messages_per_s: iters as f64 / s,
        }
    }
}

/// What the client of `fastlane rdma bench --json` prints.
#[derive(Debug, Serialize)]
struct RdmaBenchReport {
    device: String,
    gid_index: u8,
    /// The port's active MTU.
    mtu_bytes: u32,
    /// Messages up to this size are sent inline.
    max_inline_bytes: u32,
    latency: Vec<LatencyReport>,
    bandwidth: BandwidthReport,
    /// The one-way latency histograms, if `--hlog` was given.
    hlog: Option<String>,
}

/// Largest latency message (the receive area is this big on both sides).
const LAT_MAX: usize = 1 << 20;
/// The bandwidth run asks for a completion every this many WRITEs.
const BW_SIGNAL_EVERY: u64 = 64;
/// Latency WRITEs ask for a completion every this many (to retire the send queue).
const LAT_SIGNAL_EVERY: u64 = 16;

#[derive(Debug, Clone)]
struct Params {
    sizes: Vec<usize>,
    iters: u64,
    bw_size: usize,
    bw_iters: u64,
    bw_depth: u32,
}

impl Params {
    fn encode(&self) -> String {
        let sizes: Vec<String> = self.sizes.iter().map(|s| s.to_string()).collect();
        format!(
            "sizes={} iters={} bw_size={} bw_iters={} bw_depth={}\n",
            sizes.join(","),
            self.iters,
            self.bw_size,
            self.bw_iters,
            self.bw_depth
        )
    }

    fn decode(line: &str) -> Result<Self> {
        let mut p = Params { sizes: vec![], iters: 0, bw_size: 0, bw_iters: 0, bw_depth: 0 };
        for kv in line.split_whitespace() {
            let (k, v) = kv.split_once('=').context("bad parameter line")?;
            match k {
                "sizes" => {
                    p.sizes = v.split(',').map(str::parse).collect::<Result<_, _>>()?;
                }
                "iters" => p.iters = v.parse()?,
                "bw_size" => p.bw_size = v.parse()?,
                "bw_iters" => p.bw_iters = v.parse()?,
                "bw_depth" => p.bw_depth = v.parse()?,
                _ => bail!("unknown parameter {k}"),
            }
        }
        p.check()?;
        Ok(p)
    }

    fn check(&self) -> Result<()> {
        anyhow::ensure!(!self.sizes.is_empty(), "no sizes");
        anyhow::ensure!(
            self.sizes.iter().all(|&s| (1..=LAT_MAX).contains(&s)),
            "sizes must be 1..=1M"
        );
        anyhow::ensure!(self.sizes.windows(2).all(|w| w[0] < w[1]), "sizes must increase");
        anyhow::ensure!((1..=LAT_MAX).contains(&self.bw_size), "--bw-size must be 1..=1M");
        anyhow::ensure!(self.iters >= 1 && self.iters <= 10_000_000, "--iters out of range");
        anyhow::ensure!(self.bw_iters <= 100_000_000, "--bw-iters out of range");
        anyhow::ensure!((1..=1024).contains(&self.bw_depth), "--bw-depth must be 1..=1024");
        Ok(())
    }
}

/// Runs `fastlane rdma bench`: the server (`--listen`) answers one client; the client
/// (`--connect`) sends the parameters, runs the ping-pong and the bandwidth run, and reports.
pub fn run(a: &BenchArgs) -> Result<()> {
    let dev = Device::open_with_gid(&a.device, a.gid_index)?;
    let params = Params {
        sizes: a.sizes.iter().map(|&s| s as usize).collect(),
        iters: a.iters,
        bw_size: a.bw_size as usize,
        bw_iters: a.bw_iters,
        bw_depth: a.bw_depth,
    };
    let options = |depth: u32| ConnectOptions {
        buffer_len: 2 * LAT_MAX,
        expose_buffer: true,
        qp: QpConfig {
            max_send_wr: depth.max(64) + 16,
            max_recv_wr: 16,
            // perftest's default inline size for the latency tests.
            max_inline: 220,
            ..QpConfig::default()
        },
        op_timeout: Duration::from_secs(30),
        ..ConnectOptions::default()
    };
    if let Some(addr) = a.listen {
        let l = Listener::bind(addr)?;
        eprintln!("fastlane rdma bench: waiting for a client on {}", l.local_addr()?);
        let mut conn = l.accept(&dev, options(1024))?;
        let mut line = String::new();
        BufReader::new(conn.stream()).read_line(&mut line).context("reading parameters")?;
        let p = Params::decode(&line)?;
        let mut tick = 0u8;
        for &size in &p.sizes {
            pingpong(&mut conn, size, p.iters + warmup(p.iters), false, &mut tick, None)?;
        }
        // Bandwidth: the client writes into our memory; we wait for its "done".
        line.clear();
        BufReader::new(conn.stream()).read_line(&mut line).context("waiting for done")?;
        eprintln!("fastlane rdma bench: client done");
        return Ok(());
    }
    let Some(addr) = a.connect else { bail!("give --listen or --connect") };
    params.check()?;
    let mut conn = Connection::connect(&dev, addr, options(params.bw_depth))?;
    conn.stream().write_all(params.encode().as_bytes())?;
    let mut log = match &a.hlog {
        Some(p) => {
            Some(HlogWriter::create(p).with_context(|| format!("creating {}", p.display()))?)
        }
        None => None,
    };
    if !a.json {
        println!(
            "# fastlane rdma bench: {} (GID index {}, MTU {}), inline <= {} B",
            dev.name(),
            dev.gid_index(),
            dev.active_mtu_bytes(),
            conn.max_inline()
        );
        println!("# one-way WRITE latency (ping-pong / 2), {} iterations per size", params.iters);
        println!(
            "{:>8} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "bytes", "p50", "p90", "p99", "max", "avg"
        );
    }
    let mut latency = Vec::new();
    let mut tick = 0u8;
    for &size in &params.sizes {
        let mut rec = LatencyRecorder::with_max(10_000_000_000)?;
        pingpong(&mut conn, size, warmup(params.iters), true, &mut tick, None)?;
        pingpong(&mut conn, size, params.iters, true, &mut tick, Some(&mut rec))?;
        // Close the interval first: `total()` holds finished intervals only.
        let iv = rec.take_interval_at(Instant::now());
        if let Some(l) = log.as_mut() {
            l.write_interval(Some(&format!("write_{size}B")), &iv)?;
        }
        let s = Summary::from_histogram(rec.total());
        let mean_ns = rec.total().mean();
        let result = format!(
            "RESULT lat size={size} iters={} p50_ns={} p99_ns={} avg_ns={mean_ns:.0}",
            params.iters, s.p50_ns, s.p99_ns
        );
        if a.json {
            eprintln!("{result}");
        } else {
            println!(
                "{:>8} {:>10} {:>10} {:>10} {:>10} {:>10}",
                size,
                format_ns(s.p50_ns as f64),
                format_ns(s.p90_ns as f64),
                format_ns(s.p99_ns as f64),
                format_ns(s.max_ns as f64),
                format_ns(mean_ns),
            );
            println!("{result}");
        }
        latency.push(LatencyReport { size_bytes: size, iters: params.iters, one_way: s });
    }
    if let Some(mut l) = log {
        l.flush()?;
    }
    let (bytes, el) = bandwidth(&mut conn, params.bw_size, params.bw_iters, params.bw_depth)?;
    conn.stream().write_all(b"done\n")?;
    let mib_s = bytes as f64 / el.as_secs_f64() / f64::from(1 << 20);
    let mpps = params.bw_iters as f64 / el.as_secs_f64() / 1e6;
    let result = format!(
        "RESULT bw size={} iters={} bytes_per_s={:.0} mib_s={mib_s:.2} mpps={mpps:.6}",
        params.bw_size,
        params.bw_iters,
        bytes as f64 / el.as_secs_f64()
    );
    if a.json {
        eprintln!("{result}");
        let report = RdmaBenchReport {
            device: dev.name().to_string(),
            gid_index: dev.gid_index(),
            mtu_bytes: dev.active_mtu_bytes(),
            max_inline_bytes: conn.max_inline(),
            latency,
            bandwidth: BandwidthReport::new(params.bw_size, params.bw_iters, params.bw_depth, el),
            hlog: a.hlog.as_ref().map(|p| p.display().to_string()),
        };
        let mut out = std::io::stdout().lock();
        serde_json::to_writer_pretty(&mut out, &report)?;
        writeln!(out)?;
        return Ok(());
    }
    println!(
        "# WRITE bandwidth: {} x {} B, {} in flight",
        params.bw_iters, params.bw_size, params.bw_depth
    );
    println!("{:>8} {:>10} {:>12} {:>10}", "bytes", "iters", "MiB/s", "Mpps");
    println!("{:>8} {:>10} {:>12.2} {:>10.4}", params.bw_size, params.bw_iters, mib_s, mpps);
    println!("{result}");
    if let Some(p) = &a.hlog {
        println!("# latency histograms: {} (read with `fastlane hist`)", p.display());
    }
    Ok(())
}

fn warmup(iters: u64) -> u64 {
    (iters / 10).clamp(10, 1000)
}

/// Spins until byte `at` of our buffer equals `want`; bounded by the connection's timeout,
/// and ends early when the peer's socket closes.
fn spin_for(conn: &Connection, at: usize, want: u8) -> Result<()> {
    let mut spins = 0u32;
    let mut deadline = None;
    loop {
        if conn.buffer().read_volatile_u8(at)? == want {
            return Ok(());
        }
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(4096) {
            let now = Instant::now();
            let d = *deadline.get_or_insert(now + conn.options().op_timeout);
            if now >= d {
                return Err(RdmaError::Timeout {
                    op: "ping-pong",
                    after: conn.options().op_timeout,
                }
                .into());
            }
            conn.check_peer()?;
        }
        std::hint::spin_loop();
    }
}

/// `iters` round trips of `size`-byte WRITEs. The client (`initiator`) writes first; each
/// side waits for the last byte of the peer's message in its receive area
/// (`LAT_MAX..LAT_MAX + size`) and answers. `rec` gets one-way latencies (RTT / 2).
fn pingpong(
    conn: &mut Connection,
    size: usize,
    iters: u64,
    initiator: bool,
    tick: &mut u8,
    rec: Option<&mut LatencyRecorder>,
) -> Result<()> {
    let remote = conn.remote();
    let op =
        SendOp::Write { remote_addr: remote.addr + LAT_MAX as u64, rkey: remote.rkey, imm: None };
    let last = LAT_MAX + size - 1;
    let cal_t = Instant::now();
    let cal_c = tsc();
    let mut cycles: Vec<u64> = Vec::with_capacity(if rec.is_some() { iters as usize } else { 0 });
    for i in 0..iters {
        // 1..=255, never 0: a byte not yet written reads 0 (sizes increase, so the last byte
        // of a new size was never written before).
        *tick = if *tick == 255 { 1 } else { *tick + 1 };
        let signaled = (i + 1) % LAT_SIGNAL_EVERY == 0;
        if initiator {
            let t0 = tsc();
            conn.buffer().write_volatile_u8(size - 1, *tick)?;
            conn.post(op, 0, size, signaled)?;
            spin_for(conn, last, *tick)?;
            let t1 = tsc();
            if rec.is_some() {
                cycles.push(t1.wrapping_sub(t0));
            }
        } else {
            spin_for(conn, last, *tick)?;
            conn.buffer().write_volatile_u8(size - 1, *tick)?;
            conn.post(op, 0, size, signaled)?;
        }
        if signaled {
            conn.poll_send()?;
        }
        if conn.in_flight() + LAT_SIGNAL_EVERY >= conn.send_depth() {
            // Retire the send queue (completions are rare: one per LAT_SIGNAL_EVERY).
            while conn.in_flight() >= LAT_SIGNAL_EVERY {
                if conn.poll_send()? == 0 {
                    std::hint::spin_loop();
                }
            }
        }
    }
    // Convert cycles to ns with this run's own calibration (the guest TSC rate is not
    // advertised as constant, so calibrate against the monotonic clock).
    if let Some(rec) = rec {
        let ns = cal_t.elapsed().as_nanos() as f64;
        let cyc = tsc().wrapping_sub(cal_c).max(1) as f64;
        let ns_per_cycle = ns / cyc;
        for c in cycles {
            rec.record((c as f64 * ns_per_cycle / 2.0) as u64);
        }
    }
    Ok(())
}

/// `iters` WRITEs of `size` into the peer's receive area, `depth` in flight, one signaled
/// every BW_SIGNAL_EVERY. Returns (bytes, elapsed).
fn bandwidth(
    conn: &mut Connection,
    size: usize,
    iters: u64,
    depth: u32,
) -> Result<(u64, Duration)> {
    let remote = conn.remote();
    let op =
        SendOp::Write { remote_addr: remote.addr + LAT_MAX as u64, rkey: remote.rkey, imm: None };
    let depth = u64::from(depth).min(conn.send_depth());
    // Drain whatever the latency phase left.
    let drain = Instant::now() + Duration::from_secs(10);
    while conn.in_flight() > 0 {
        if conn.in_flight() < LAT_SIGNAL_EVERY {
            let last = conn.post(op, 0, 1, true)?;
            conn.wait_send("drain", last)?;
            break;
        }
        conn.poll_send()?;
        if Instant::now() > drain {
            bail!("send queue did not drain");
        }
    }
    let start = Instant::now();
    let mut posted = 0u64;
    let deadline = start + Duration::from_secs(300);
    let mut spins = 0u32;
    while posted < iters {
        if conn.in_flight() < depth {
            posted += 1;
            let signaled = posted.is_multiple_of(BW_SIGNAL_EVERY) || posted == iters;
            conn.post(op, 0, size, signaled)?;
        } else if conn.poll_send()? == 0 {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(4096) && Instant::now() > deadline {
                bail!("bandwidth run past 300 s");
            }
        }
    }
    let newest = conn.posted();
    conn.wait_send("rdma write", newest)?;
    Ok((size as u64 * iters, start.elapsed()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_round_trip_and_validate() {
        let p = Params { sizes: vec![8, 64], iters: 10, bw_size: 4096, bw_iters: 5, bw_depth: 8 };
        let q = Params::decode(&p.encode()).unwrap();
        assert_eq!(q.sizes, vec![8, 64]);
        assert_eq!((q.iters, q.bw_size, q.bw_iters, q.bw_depth), (10, 4096, 5, 8));
        assert!(Params::decode("sizes=64,8 iters=1 bw_size=1 bw_iters=1 bw_depth=1").is_err());
        assert!(Params::decode("sizes=8 iters=1 bw_size=1 bw_iters=1 bw_depth=0").is_err());
        assert!(Params::decode("sizes=9999999 iters=1 bw_size=1 bw_iters=1 bw_depth=1").is_err());
    }

    #[test]
    fn json_report_names_its_units() {
        let mut rec = LatencyRecorder::with_max(10_000_000_000).unwrap();
        for ns in [2_000, 2_500, 3_000, 9_000] {
            rec.record(ns);
        }
        // As `run` does: `total()` holds finished intervals only.
        rec.take_interval_at(Instant::now());
        let one_way = Summary::from_histogram(rec.total());
        let report = RdmaBenchReport {
            device: "rxe0".into(),
            gid_index: 1,
            mtu_bytes: 1024,
            max_inline_bytes: 220,
            latency: vec![LatencyReport { size_bytes: 64, iters: 4, one_way }],
            bandwidth: BandwidthReport::new(65536, 1000, 128, Duration::from_millis(500)),
            hlog: None,
        };
        let v: serde_json::Value =
            serde_json::from_str(&serde_json::to_string_pretty(&report).unwrap()).unwrap();
        assert_eq!(v["device"], "rxe0");
        assert_eq!(v["mtu_bytes"], 1024);
        let lat = &v["latency"][0];
        assert_eq!(lat["size_bytes"], 64);
        let w = &lat["one_way"];
        assert_eq!(w["count"], 4);
        let (p50, p99, max) =
            (w["p50_ns"].as_u64().unwrap(), w["p99_ns"].as_u64().unwrap(), w["max_ns"].as_u64());
        assert!((2_400..=2_600).contains(&p50) && p50 <= p99 && Some(p99) <= max, "{w}");
        assert!(w["mean_ns"].as_f64().unwrap() > 0.0);
        let bw = &v["bandwidth"];
        assert_eq!(bw["bytes"], 65536 * 1000);
        assert_eq!(bw["elapsed_ns"], 500_000_000);
        assert_eq!(bw["bytes_per_s"].as_f64(), Some(65536.0 * 2000.0));
        assert_eq!(bw["messages_per_s"].as_f64(), Some(2000.0));
        assert!(v["hlog"].is_null());
    }
}
