//! `fastlane kv bench`: the host tier against `memcpy` and the NVMe tier against sequential
//! O_DIRECT `pwrite`/`pread` of the same bytes in one run, the remote tier (a `fastlane rdma
//! serve` pool, `--pool`) without a peer, and swap-in latency per tier as `.hlog`; `--json`
//! prints the same results as one JSON object. Also the model-geometry flags `kv serve` shares.

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use fastlane_hist::{HlogWriter, LatencyRecorder, Summary};
use fastlane_kvswap::{
    BlockId, ChecksumMode, EngineConfig, HostDeviceMemory, KvGeometry, NvmeTierConfig,
    RemoteTierConfig, SeqId, SpillPolicy, SwapEngine,
};
use fastlane_util::parse_size;
use serde::Serialize;

/// Model geometry options shared by the subcommands.
#[derive(Debug, Args)]
pub struct ModelArgs {
    /// Built-in model: llama-3.1-8b or llama-3.1-70b (fp16).
    #[arg(long, default_value = "llama-3.1-8b")]
    model: String,
    /// A Hugging Face config.json instead of --model.
    #[arg(long)]
    model_config: Option<PathBuf>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    tokens_per_block: u32,
}

impl ModelArgs {
    /// The geometry these flags name.
    pub fn geometry(&self) -> Result<KvGeometry> {
        let mut g = match &self.model_config {
            Some(p) => {
                let text = std::fs::read_to_string(p).with_context(|| format!("reading {p:?}"))?;
                KvGeometry::from_hf_config(&text, self.tokens_per_block)?
            }
            None => match self.model.as_str() {
                "llama-3.1-8b" => KvGeometry::LLAMA31_8B,
                "llama-3.1-70b" => KvGeometry::LLAMA31_70B,
                m => bail!("unknown model {m:?} (llama-3.1-8b, llama-3.1-70b, or --model-config)"),
            },
        };
        g.tokens_per_block = self.tokens_per_block;
        Ok(g)
    }
}

/// `fastlane kv bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Bytes per sequence (1G = 8K tokens of Llama-3.1-8B).
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    bytes: u64,
    /// Tiers to measure: host, nvme, remote (comma separated).
    #[arg(long, default_value = "host,nvme")]
    tiers: String,
    /// Remote tier: address of the `fastlane rdma serve` pool (needed for tier remote).
    #[arg(long)]
    pool: Option<std::net::SocketAddr>,
    /// RDMA device for the remote tier.
    #[arg(long, default_value = "rxe0")]
    device: String,
    /// File for the NVMe tier and the O_DIRECT baseline (on a filesystem with O_DIRECT).
    #[arg(long, default_value = "kvswap-bench.dat")]
    file: PathBuf,
    /// Bandwidth rounds (best of).
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Swap-in latency samples per tier.
    #[arg(long, default_value_t = 10)]
    samples: u32,
    /// Where to write the swap-in latency histograms.
    #[arg(long, default_value = "kvswap-swapin.hlog")]
    hlog: PathBuf,
    /// Per-block checksum: fast, crc32c, off.
    #[arg(long, default_value = "fast")]
    checksum: String,
    /// Keep the bench file afterwards.
    #[arg(long)]
    keep_file: bool,
    /// Print the results as one JSON object on stdout instead of the table (the per-tier
    /// latency lines go to stderr).
    #[arg(long)]
    json: bool,
}

/// `--checksum`: fast, crc32c or off.
pub fn checksum_mode(s: &str) -> Result<ChecksumMode> {
    ChecksumMode::parse(s).with_context(|| format!("checksum {s:?}: fast, crc32c or off"))
}

fn fill(dev: &HostDeviceMemory) {
    // SAFETY: no engine transfer runs yet; the mapping is len_bytes long.
    let s = unsafe { std::slice::from_raw_parts_mut(dev.base(), dev.len_bytes()) };
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for w in s.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.copy_from_slice(&x.to_le_bytes()[..w.len()]);
    }
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn gibps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / secs(d) / (1u64 << 30) as f64
}

/// Best-of-`rounds` time of `f`.
fn best(rounds: u32, mut f: impl FnMut() -> Result<Duration>) -> Result<Duration> {
    let mut b = Duration::MAX;
    for _ in 0..rounds.max(1) {
        b = b.min(f()?);
    }
    Ok(b)
}

/// A page-aligned, pre-faulted anonymous buffer, unmapped on drop.
struct Buf {
    map: memmap2::MmapRaw,
}

impl Buf {
    fn new(len: usize) -> Result<Buf> {
        Ok(Buf { map: crate::mem::mmap_populated(len)? })
    }

    fn ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }
}

struct Row {
    what: String,
    /// `host`, `nvme` or `remote`.
    tier: &'static str,
    /// `swap-out` or `swap-in`.
    direction: &'static str,
    /// The baseline's time; `None` where there is no peer (the remote tier).
    peer: Option<Duration>,
    ours: Duration,
    bytes: u64,
}

/// One bandwidth row of `fastlane kv bench --json`: a row of the table.
#[derive(Debug, Serialize)]
struct BandwidthReport {
    /// The table's case name, e.g. `host swap-in vs memcpy`.
    case: String,
    /// `host`, `nvme` or `remote`.
    tier: &'static str,
    /// `swap-out` or `swap-in`.
    direction: &'static str,
    /// Bytes moved by one round (ours and the peer's alike).
    bytes: u64,
    /// Best-of-rounds time of the peer (`memcpy`, `O_DIRECT`); absent for the remote tier.
    peer_ns: Option<u64>,
    /// Best-of-rounds time of the tier.
    ours_ns: u64,
    peer_bytes_per_s: Option<f64>,
    ours_bytes_per_s: f64,
    /// Our bandwidth / the peer's (the table's `ratio`); absent without a peer.
    ours_vs_peer: Option<f64>,
}

impl BandwidthReport {
    fn from_row(r: &Row) -> Self {
        let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let rate = |d: Duration| r.bytes as f64 / secs(d);
        BandwidthReport {
            case: r.what.clone(),
            tier: r.tier,
            direction: r.direction,
            bytes: r.bytes,
            peer_ns: r.peer.map(ns),
            ours_ns: ns(r.ours),
            peer_bytes_per_s: r.peer.map(rate),
            ours_bytes_per_s: rate(r.ours),
            ours_vs_peer: r.peer.map(|p| secs(p) / secs(r.ours)),
        }
    }
}

/// The swap-in latency of one tier: `samples` swap-ins of the whole sequence.
#[derive(Debug, Serialize)]
struct SwapInReport {
    /// `host`, `nvme` or `remote` (the `.hlog` tag is `swapin-<tier>`).
    tier: String,
    /// Bytes per swap-in.
    bytes: u64,
    /// Swap-in latency (`count` = samples), ns.
    latency: Summary,
    /// `bytes` / P50 latency.
    bytes_per_s_at_p50: f64,
}

/// What the tiers measured so far: the table's rows and the swap-in latencies.
#[derive(Default)]
struct Results {
    rows: Vec<Row>,
    swap_in: Vec<SwapInReport>,
}

/// What `fastlane kv bench --json` prints.
#[derive(Debug, Serialize)]
struct KvBenchReport {
    /// Bytes of the sequence (a whole number of blocks).
    bytes: u64,
    blocks: u64,
    block_bytes: u64,
    tokens: u64,
    /// Per-block checksum: `fast`, `crc32c` or `off`.
    checksum: String,
    /// Bandwidth rounds per case (best of).
    rounds: u32,
    bandwidth: Vec<BandwidthReport>,
    swap_in: Vec<SwapInReport>,
    /// The swap-in latency histograms (`.hlog`).
    hlog: String,
}

fn swap_round(e: &mut SwapEngine, seq: SeqId, blocks: &[BlockId], out: bool) -> Result<Duration> {
    let t0 = Instant::now();
    let t = if out { e.swap_out(seq, blocks)? } else { e.swap_in(seq, blocks)? };
    e.wait(t, Duration::from_secs(300))?;
    Ok(t0.elapsed())
}

/// One tier's measurement: the same sequence swapped out and in `rounds` times (best of
/// each), then `samples` timed swap-ins for the latency histogram.
struct TierRun {
    seq: SeqId,
    nblocks: u64,
    bytes: u64,
    rounds: u32,
    samples: u32,
    /// `--json`: the latency line goes to stderr.
    json: bool,
}

impl TierRun {
    /// Appends the tier's two rows (`what`: swap-out, swap-in) with the peer's times, if any,
    /// and its swap-in latency; prints the latency line to stdout, or to stderr with `json`.
    fn measure(
        &self,
        e: &mut SwapEngine,
        tag: &'static str,
        what: [&str; 2],
        peers: Option<(Duration, Duration)>,
        results: &mut Results,
        hlog: &mut HlogWriter<std::io::BufWriter<std::fs::File>>,
    ) -> Result<()> {
        let blocks = e.alloc_blocks(self.seq, self.nblocks as u32)?;
        let (mut out_best, mut in_best) = (Duration::MAX, Duration::MAX);
        for _ in 0..self.rounds.max(1) {
            out_best = out_best.min(swap_round(e, self.seq, &blocks, true)?);
            in_best = in_best.min(swap_round(e, self.seq, &blocks, false)?);
        }
        for (what, direction, peer, ours) in [
            (what[0], "swap-out", peers.map(|p| p.0), out_best),
            (what[1], "swap-in", peers.map(|p| p.1), in_best),
        ] {
            let bytes = self.bytes;
            results.rows.push(Row { what: what.into(), tier: tag, direction, peer, ours, bytes });
        }
        let swap_in = latency(e, self.seq, &blocks, self.samples, tag, hlog, self.json)?;
        results.swap_in.push(swap_in);
        Ok(())
    }
}

/// Runs `fastlane kv bench`.
pub fn run(a: &BenchArgs) -> Result<()> {
    let g = a.model.geometry()?;
    let bb = g.block_bytes();
    let nblocks = (a.bytes / bb).max(1);
    let bytes = nblocks * bb;
    let mode = checksum_mode(&a.checksum)?;
    let tiers: Vec<&str> = a.tiers.split(',').map(str::trim).collect();
    eprintln!(
        "fastlane kv bench: {bytes} bytes = {nblocks} blocks of {bb} ({} tokens), checksum \
         {mode:?}, best of {} rounds",
        nblocks * u64::from(g.tokens_per_block),
        a.rounds
    );
    let dev = Arc::new(HostDeviceMemory::new(bb as usize, nblocks as u32)?);
    fill(&dev);
    let mut results = Results::default();
    let mut hlog = HlogWriter::create(&a.hlog)?;
    hlog.write_comment(&format!(
        "fastlane kv bench: swap-in latency of {bytes} bytes per tier, checksum {mode:?}"
    ))?;
    let seq = SeqId(1);
    let run = TierRun { seq, nblocks, bytes, rounds: a.rounds, samples: a.samples, json: a.json };
    for tier in &tiers {
        match *tier {
            "host" => {
                let buf = Buf::new(bytes as usize)?;
                let src = dev.base();
                let len = bytes as usize;
                let copy_out = best(a.rounds, || {
                    let t0 = Instant::now();
                    // SAFETY: src and buf are distinct live mappings of len bytes.
                    unsafe { std::ptr::copy_nonoverlapping(src, buf.ptr(), len) };
                    Ok(t0.elapsed())
                })?;
                let copy_in = best(a.rounds, || {
                    let t0 = Instant::now();
                    // SAFETY: as above, the other direction.
                    unsafe { std::ptr::copy_nonoverlapping(buf.ptr(), src, len) };
                    Ok(t0.elapsed())
                })?;
                drop(buf);
                let config =
                    EngineConfig { host_bytes: bytes, checksum: mode, ..EngineConfig::default() };
                let mut e = SwapEngine::new(config, dev.clone())?;
                let peers = Some((copy_out, copy_in));
                let what = ["host swap-out vs memcpy", "host swap-in vs memcpy"];
                run.measure(&mut e, "host", what, peers, &mut results, &mut hlog)?;
            }
            "nvme" => {
                let (w, r) = odirect_baseline(&a.file, dev.base(), bytes, a.rounds)?;
                let config = EngineConfig {
                    host_bytes: 0,
                    nvme: Some(NvmeTierConfig { path: a.file.clone(), bytes, depth: 16 }),
                    spill: SpillPolicy::NvmeOnly,
                    checksum: mode,
                    ..EngineConfig::default()
                };
                let mut e = SwapEngine::new(config, dev.clone())?;
                let peers = Some((w, r));
                let what = ["nvme swap-out vs O_DIRECT pwrite", "nvme swap-in vs O_DIRECT pread"];
                run.measure(&mut e, "nvme", what, peers, &mut results, &mut hlog)?;
                drop(e);
                if !a.keep_file {
                    let _ = std::fs::remove_file(&a.file);
                }
            }
            "remote" => {
                let Some(addr) = a.pool else {
                    bail!("tier remote needs --pool ADDR (a `fastlane rdma serve` pool)");
                };
                let config = EngineConfig {
                    host_bytes: 0,
                    remote: Some(RemoteTierConfig { device: a.device.clone(), addr, bytes }),
                    spill: SpillPolicy::RemoteOnly,
                    checksum: mode,
                    ..EngineConfig::default()
                };
                let mut e = SwapEngine::new(config, dev.clone())
                    .with_context(|| format!("remote tier: pool {addr} on {}", a.device))?;
                let what = ["remote swap-out (no peer)", "remote swap-in (no peer)"];
                run.measure(&mut e, "remote", what, None, &mut results, &mut hlog)?;
            }
            t => bail!("unknown tier {t:?} (host, nvme, remote)"),
        }
    }
    hlog.flush()?;
    if a.json {
        let report = KvBenchReport {
            bytes,
            blocks: nblocks,
            block_bytes: bb,
            tokens: nblocks * u64::from(g.tokens_per_block),
            checksum: format!("{mode:?}").to_ascii_lowercase(),
            rounds: a.rounds.max(1),
            bandwidth: results.rows.iter().map(BandwidthReport::from_row).collect(),
            swap_in: results.swap_in,
            hlog: a.hlog.display().to_string(),
        };
        let mut out = std::io::stdout().lock();
        serde_json::to_writer_pretty(&mut out, &report)?;
        writeln!(out)?;
        return Ok(());
    }
    println!(
        "{:<36} {:>12} {:>12} {:>8}",
        "case (same bytes, one run)", "peer GiB/s", "ours GiB/s", "ratio"
    );
    for r in &results.rows {
        let ours_s = secs(r.ours);
        let ours = r.bytes as f64 / ours_s / (1u64 << 30) as f64;
        match r.peer.map(secs) {
            Some(p) => println!(
                "{:<36} {:>12.2} {:>12.2} {:>8.2}",
                r.what,
                r.bytes as f64 / p / (1u64 << 30) as f64,
                ours,
                p / ours_s
            ),
            None => println!("{:<36} {:>12} {:>12.2} {:>8}", r.what, "-", ours, "-"),
        }
    }
    println!(
        "swap-in latency histograms (tags swapin-<tier>): {:?}, read with `fastlane hist`",
        a.hlog
    );
    Ok(())
}

/// `samples` timed swap-ins of `blocks` (each after a swap-out): prints one line (to stdout,
/// or to stderr with `json`), writes the histogram to `hlog` and returns the figures.
fn latency(
    e: &mut SwapEngine,
    seq: SeqId,
    blocks: &[BlockId],
    samples: u32,
    tag: &str,
    hlog: &mut HlogWriter<std::io::BufWriter<std::fs::File>>,
    json: bool,
) -> Result<SwapInReport> {
    let mut rec = LatencyRecorder::with_max(600_000_000_000)?;
    let start = Instant::now();
    for _ in 0..samples {
        swap_round(e, seq, blocks, true)?;
        let d = swap_round(e, seq, blocks, false)?;
        rec.record_duration(d);
    }
    let h = rec.current();
    let bytes = blocks.len() as u64 * e.block_bytes() as u64;
    let p50 = Duration::from_nanos(h.value_at_quantile(0.5).max(1));
    let line = format!(
        "{tag} swap-in of {} bytes: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({} samples, {:.2} GiB/s at p50)",
        bytes,
        h.value_at_quantile(0.5) as f64 / 1e6,
        h.value_at_quantile(0.99) as f64 / 1e6,
        h.max() as f64 / 1e6,
        h.len(),
        gibps(bytes, p50)
    );
    if json {
        eprintln!("{line}");
    } else {
        println!("{line}");
    }
    hlog.write_histogram(Some(&format!("swapin-{tag}")), Duration::ZERO, start.elapsed(), h)?;
    Ok(SwapInReport {
        tier: tag.to_string(),
        bytes,
        latency: Summary::from_histogram(h),
        bytes_per_s_at_p50: bytes as f64 / secs(p50),
    })
}

/// Sequential O_DIRECT pwrite then pread of `bytes` from `src`, in 4 MiB calls, on `file`.
fn odirect_baseline(
    file: &PathBuf,
    src: *mut u8,
    bytes: u64,
    rounds: u32,
) -> Result<(Duration, Duration)> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(file)
        .with_context(|| format!("open {file:?} O_DIRECT"))?;
    if f.metadata()?.len() < bytes {
        f.set_len(bytes)?;
    }
    let fd = f.as_raw_fd();
    const CHUNK: u64 = 4 << 20;
    let io = |write: bool| -> Result<Duration> {
        let t0 = Instant::now();
        let mut off = 0u64;
        while off < bytes {
            let n = CHUNK.min(bytes - off) as usize;
            // SAFETY: src..src+bytes is the device mapping (page aligned, alive for the
            // call); offsets and lengths are multiples of 4 KiB.
            let p = unsafe { src.add(off as usize) };
            let r = if write {
                // SAFETY: p names n readable bytes of that mapping for the call.
                unsafe { libc::pwrite(fd, p as *const libc::c_void, n, off as libc::off_t) }
            } else {
                // SAFETY: p names n writable bytes of that mapping, unused by anyone else.
                unsafe { libc::pread(fd, p as *mut libc::c_void, n, off as libc::off_t) }
            };
            if r != n as isize {
                bail!(
                    "O_DIRECT {} at {off}: {}",
                    if write { "pwrite" } else { "pread" },
                    std::io::Error::last_os_error()
                );
            }
            off += n as u64;
        }
        Ok(t0.elapsed())
    };
    let w = best(rounds, || io(true))?;
    let r = best(rounds, || io(false))?;
    Ok((w, r))
}
