//! `fastlane journal serve --dir DIR`: the journal service (`fastlane_journal::service`), run
//! as a daemon: stop signals, `sd_notify` readiness, Prometheus metrics, a status line; and
//! `fastlane journal append --service DIR`, a producer that attaches to it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use fastlane_bench::journal::opts::open_device;
use fastlane_daemon::metrics::{counter, gauge, Field};
use fastlane_daemon::signals::StopSignals;
use fastlane_journal::segments::Retention;
use fastlane_journal::service::{Service, ServiceConfig, ServiceStats};
use fastlane_journal::{Durability, JournalError, JournalProducer, COMMIT_BUCKETS_NS};
use fastlane_journal_export::{AccessFiles, ExportAccess, ExportConfig, Exporter};
use fastlane_util::parse_size;

/// `fastlane journal serve`.
#[derive(Debug, Args)]
pub(super) struct ServeArgs {
    /// The segment directory (created if missing, mode 0750). Producers attach through
    /// DIR/journal.sock; who can reach it is decided by the directory's permissions.
    #[arg(long)]
    dir: PathBuf,
    /// Bytes of each segment file (preallocated with written zeroes; the next one is prepared
    /// in the background while the current one fills).
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    segment_bytes: u64,
    /// Which closed segments to keep: any of segments=N, bytes=SIZE, age=DURATION
    /// (e.g. segments=10,age=7d); default: keep all.
    #[arg(long)]
    retain: Option<Retention>,
    /// How fast the next segment's file is prepared in the background, bytes per second (0:
    /// as fast as the device goes); paced so that acks wait behind at most one 512 KiB piece.
    /// The least pace: raised while the segment in use fills fast enough that the spare would
    /// not be ready in time (see --spare-adapt). A roll that finds no spare waits for it
    /// (logged, fastlane_journal_spare_waits_total).
    #[arg(long, default_value = "128M", value_parser = parse_size)]
    spare_rate: u64,
    /// Raise the spare's pace with the rate the segment in use fills (false: always
    /// --spare-rate).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    spare_adapt: bool,
    /// memory (written: survives a crash of this process) or local (flushed: survives a
    /// power cut).
    #[arg(long, default_value = "local")]
    durability: Durability,
    /// Ring of a producer that asks for none (power of two, 4K..256M).
    #[arg(long, default_value = "4M", value_parser = parse_size)]
    ring_bytes: u64,
    /// Most producers attached at once.
    #[arg(long, default_value_t = 64)]
    max_producers: usize,
    /// Users (uid) allowed to attach besides the service's own user and root, comma-separated.
    #[arg(long, value_delimiter = ',')]
    allow_uid: Vec<u32>,
    /// Groups (gid) allowed to attach, comma-separated.
    #[arg(long, value_delimiter = ',')]
    allow_gid: Vec<u32>,
    /// Longest record of a new directory (an existing one keeps its own).
    #[arg(long, default_value = "4096", value_parser = parse_size)]
    max_record_bytes: u64,
    /// Pin the writer thread to this core.
    #[arg(long)]
    writer_core: Option<usize>,
    /// I/O engine of the segment files: uring or sync.
    #[arg(long, default_value = "uring")]
    io: fastlane_vhost_blk::spec::IoEngine,
    /// Serve Prometheus metrics at http://ADDR/metrics (port 0: a free one, logged).
    #[arg(long)]
    metrics: Option<SocketAddr>,
    /// Ship every durable record, in sequence order, to a NATS JetStream stream (three
    /// replicas) on these servers, each message with the journal seq as its Nats-Msg-Id;
    /// on its own thread: a slow or dead cluster shows as export lag, never in the acks.
    /// tls://HOST:PORT refuses servers without TLS. Credentials come from the environment
    /// (FASTLANE_NATS_USER with FASTLANE_NATS_PASSWORD, or FASTLANE_NATS_TOKEN) or the
    /// files below, never from the URL.
    #[arg(long, value_name = "nats://HOST:PORT[,…]")]
    export: Option<String>,
    /// The export's NATS password, alone on one line of a file only its owner may read
    /// (the user from FASTLANE_NATS_USER).
    #[arg(long, value_name = "FILE", requires = "export")]
    export_password_file: Option<PathBuf>,
    /// The export's NATS token, alone on one line of a file only its owner may read.
    #[arg(long, value_name = "FILE", requires = "export")]
    export_token_file: Option<PathBuf>,
    /// PEM CA certificate(s) the NATS servers' certificates are checked against (instead of
    /// the system's roots); implies TLS.
    #[arg(long, value_name = "FILE", requires = "export")]
    export_ca: Option<PathBuf>,
    /// PEM client certificate for servers that verify clients (with --export-key); implies TLS.
    #[arg(long, value_name = "FILE", requires_all = ["export", "export_key"])]
    export_cert: Option<PathBuf>,
    /// PEM private key of --export-cert.
    #[arg(long, value_name = "FILE", requires_all = ["export", "export_cert"])]
    export_key: Option<PathBuf>,
    /// The JetStream stream the export writes.
    #[arg(long, default_value = "FASTLANE_JOURNAL")]
    export_stream: String,
    /// The subject of the exported messages.
    #[arg(long, default_value = "fastlane.journal")]
    export_subject: String,
    /// Replicas of the stream (it is created with this many; an existing one must match).
    #[arg(long, default_value_t = 3)]
    export_replicas: usize,
    /// How the writer does its I/O: dsync (each batch one write durable at completion,
    /// several in flight) or pipelined (a write, then a flush for the batches written).
    #[arg(long, default_value = "dsync", value_parser = fastlane_bench::journal::opts::parse_writer_io)]
    writer_io: fastlane_journal::WriterIo,
    /// Open the segments with O_DIRECT (with dsync: the write needs no page-cache writeback).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    direct: bool,
    /// Log a status line every this many seconds (0: never).
    #[arg(long, default_value_t = 10)]
    status_every: u64,
}

/// The service's counters as metrics.
const SERVICE_FIELDS: &[Field<ServiceStats>] = &[
    counter(
        "fastlane_journal_records_total",
        "Records made durable by the service since start.",
        |s| s.records,
    ),
    counter(
        "fastlane_journal_bytes_written_total",
        "Bytes written to segments since start.",
        |s| s.bytes_written,
    ),
    counter("fastlane_journal_batches_total", "Batch writes (group commit) since start.", |s| {
        s.batches
    }),
    counter("fastlane_journal_flushes_total", "Flushes since start.", |s| s.flushes),
    counter("fastlane_journal_segment_rolls_total", "Segments rolled to since start.", |s| s.rolls),
    counter(
        "fastlane_journal_segment_roll_failures_total",
        "Rolls retried for lack of room.",
        |s| s.roll_failures,
    ),
    counter(
        "fastlane_journal_roll_microseconds_total",
        "Time the writer spent rolling to the next segment (durable acks wait meanwhile).",
        |s| s.roll_time.as_micros() as u64,
    ),
    counter("fastlane_journal_attaches_total", "Producers attached since start.", |s| s.attaches),
    counter(
        "fastlane_journal_attach_refused_total",
        "Attaches refused (credentials, limit, malformed).",
        |s| s.refused,
    ),
    counter(
        "fastlane_journal_producer_faults_total",
        "Producers whose ring was shut off for a bad record.",
        |s| s.faults,
    ),
    gauge("fastlane_journal_durable_seq", "Highest durable global sequence number.", |s| {
        s.durable_seq
    }),
    gauge("fastlane_journal_segment", "Index of the segment being written.", |s| s.segment),
    gauge(
        "fastlane_journal_spare_pace_bytes_per_second",
        "The pace the next segment's file is being written at (0: unpaced or idle).",
        |s| s.spare_pace,
    ),
    counter(
        "fastlane_journal_spare_waits_total",
        "Rolls that found the next segment's file not ready and waited for it.",
        |s| s.spare_waits,
    ),
    counter(
        "fastlane_journal_spare_wait_milliseconds_total",
        "Time rolls waited for the next segment's file.",
        |s| s.spare_wait.as_millis() as u64,
    ),
    counter(
        "fastlane_journal_segments_removed_total",
        "Segments retention removed (off the writer, on the next segment's preparing thread).",
        |s| s.segments_removed,
    ),
    counter(
        "fastlane_journal_retention_failures_total",
        "Retention removals that failed (the files stay until a restart lists them again).",
        |s| s.retention_failures,
    ),
    gauge("fastlane_journal_producers", "Producers attached now.", |s| {
        s.producers.iter().filter(|p| !p.gone).count() as u64
    }),
];

pub(super) fn serve(a: &ServeArgs) -> Result<()> {
    let signals = StopSignals::block()?;
    let ring_bytes = usize::try_from(a.ring_bytes).context("--ring-bytes too large")?;
    let max_record_bytes =
        u32::try_from(a.max_record_bytes).context("--max-record-bytes: at most 16M")?;
    if a.segment_bytes < 4 << 20 {
        bail!("--segment-bytes {}: at least 4M", a.segment_bytes);
    }
    let mut config = ServiceConfig::new(&a.dir);
    config.segment_bytes = a.segment_bytes;
    config.durability = a.durability;
    config.ring_bytes = ring_bytes;
    config.max_record_bytes = max_record_bytes;
    config.max_producers = a.max_producers;
    config.allow_uids = a.allow_uid.clone();
    config.allow_gids = a.allow_gid.clone();
    config.retention = a.retain.unwrap_or_default();
    config.spare_bytes_per_s = a.spare_rate;
    config.spare_adaptive = a.spare_adapt;
    config.writer_core = a.writer_core;
    config.writer_io = a.writer_io;
    let (io, direct) = (a.io, a.direct);
    let warned = Arc::new(AtomicBool::new(false));
    config.open = Arc::new(move |p: &Path| {
        let opened = match open_device(p, io, direct) {
            // A file system without O_DIRECT (tmpfs): the page cache, said once.
            Err(e) if direct => {
                if !warned.swap(true, Ordering::Relaxed) {
                    log::warn!(
                        "{}: no O_DIRECT here ({e:#}); segments use the page cache",
                        p.display()
                    );
                }
                open_device(p, io, false)
            }
            r => r,
        };
        opened.map_err(|e| JournalError::Io {
            op: "open segment",
            source: std::io::Error::other(format!("{}: {e:#}", p.display())),
        })
    });
    // The export's settings and files are checked before the service opens anything.
    let export_config = match &a.export {
        Some(urls) => {
            let mut c = ExportConfig::from_urls(urls).context("--export")?;
            c.stream = a.export_stream.clone();
            c.subject = a.export_subject.clone();
            c.replicas = a.export_replicas;
            c.access = ExportAccess::load(&AccessFiles {
                password_file: a.export_password_file.clone(),
                token_file: a.export_token_file.clone(),
                ca_file: a.export_ca.clone(),
                cert_file: a.export_cert.clone(),
                key_file: a.export_key.clone(),
            })?;
            c.validate().context("--export")?;
            Some(c)
        }
        None => None,
    };
    let service = Service::start(config)
        .with_context(|| format!("journal serve --dir {}", a.dir.display()))?;
    let r = service.recovered();
    log::info!(
        "journal service on {}: {} segment(s), last seq {}{}{}; producers attach at {}",
        a.dir.display(),
        r.segments,
        r.last_seq,
        if r.created { ", new" } else { "" },
        if r.truncated { ", torn tail zeroed" } else { "" },
        a.dir.join(fastlane_journal::service::SOCKET_NAME).display()
    );
    if let Some(advice) = std::fs::canonicalize(&a.dir)
        .ok()
        .zip(std::fs::read_to_string("/proc/self/mountinfo").ok())
        .and_then(|(dir, info)| lazytime_advice(&info, &dir))
    {
        log::info!("{advice}");
    }
    let export = match export_config {
        Some(c) => {
            let what = format!(
                "NATS JetStream at {} (stream {}{}{})",
                c.urls.join(","),
                c.stream,
                if c.tls_required() { ", TLS required" } else { "" },
                match (&c.access.user, &c.access.token) {
                    (Some(u), _) => format!(", user {u}"),
                    (None, Some(_)) => ", token".to_string(),
                    (None, None) => String::new(),
                }
            );
            let source = super::export::DirSource::new(a.dir.clone(), service.durable_view()?);
            let e = Exporter::start(c, Box::new(source)).context("--export: start")?;
            log::info!("exporting to {what}");
            Some(e)
        }
        None => None,
    };
    let export_stats = export.as_ref().map(Exporter::stats_handle);
    let service = Arc::new(service);
    let exporter = fastlane_daemon::metrics::start_if(a.metrics, |f| {
        let fields = f.fields(SERVICE_FIELDS);
        let export_fields = export_stats.as_ref().map(|_| f.fields(super::export::EXPORT_FIELDS));
        let export_stats = export_stats.clone();
        let records = f.counter(
            "fastlane_journal_producer_records_total",
            "Records of one producer made durable or in flight.",
            &["producer", "name"],
        );
        let bytes = f.counter(
            "fastlane_journal_producer_bytes_total",
            "Payload bytes of one producer.",
            &["producer", "name"],
        );
        let acked = f.gauge(
            "fastlane_journal_producer_durable_seq",
            "The producer's own seq acknowledged durable.",
            &["producer", "name"],
        );
        let commit = f.latency(
            "fastlane_journal_commit_latency_seconds",
            "Per batch: from the writer taking its first record out of a ring to publishing it \
             durable (a producer's ack also waits for its record's time in the ring).",
            &[],
        );
        let svc = Arc::clone(&service);
        move || {
            let s = svc.stats();
            fields.update(&s);
            if let (Some(f), Some(h)) = (&export_fields, &export_stats) {
                f.update(&h.get());
            }
            let c = &s.commit_latency;
            let mut cumulative = 0;
            let buckets: Vec<(f64, u64)> = COMMIT_BUCKETS_NS
                .iter()
                .zip(&c.counts)
                .map(|(&ns, &n)| {
                    cumulative += n;
                    (ns as f64 / 1e9, cumulative)
                })
                .collect();
            commit.set_buckets(&[], &buckets, c.count(), c.sum_ns as f64 / 1e9);
            for p in &s.producers {
                let id = p.id.to_string();
                let labels = [id.as_str(), p.name.as_str()];
                fastlane_daemon::metrics::set_total(&records, &labels, p.records);
                fastlane_daemon::metrics::set_total(&bytes, &labels, p.bytes);
                fastlane_daemon::metrics::set_gauge(&acked, &labels, p.durable_local);
            }
        }
    })?;
    let stop = Arc::new(AtomicBool::new(false));
    signals.on_stop_set(&stop)?;
    fastlane_daemon::notify::ready(&format!("journal service, last seq {}", r.last_seq));
    let every = Duration::from_secs(a.status_every);
    let mut last = Instant::now();
    let (mut spare_waits, mut spare_wait) = (0, Duration::ZERO);
    let mut retention_failures = 0;
    // Bounded by the stop signal (or the writer's failure).
    while !stop.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(100));
        if let Err(e) = service.check() {
            log::error!("journal writer stopped: {e}");
            break;
        }
        let (waits, waited) = service.spare_waits();
        if waits > spare_waits {
            log::warn!(
                "a segment roll waited {} ms for the next segment's file ({} such rolls since \
                 start): segments fill faster than it is written; {}",
                waited.saturating_sub(spare_wait).as_millis(),
                waits,
                if a.spare_adapt {
                    "its pace follows the fill already: larger --segment-bytes or a faster disk"
                } else {
                    "--spare-adapt true, a higher --spare-rate or larger --segment-bytes"
                }
            );
            (spare_waits, spare_wait) = (waits, waited);
        }
        let (failures, why) = service.retention_failures();
        if failures > retention_failures {
            log::warn!(
                "retention could not remove a segment: {why} ({failures} failures since start; \
                 the files stay until the service starts again and lists the directory)"
            );
            retention_failures = failures;
        }
        if !every.is_zero() && last.elapsed() >= every {
            last = Instant::now();
            let s = service.stats();
            let lag = export_stats.as_ref().map(|h| h.get());
            log::info!(
                "durable seq {}  records {}  segment {}  producers {}  faults {}{}",
                s.durable_seq,
                s.records,
                s.segment,
                s.producers.iter().filter(|p| !p.gone).count(),
                s.faults,
                lag.map(|e| format!(
                    "  exported {} (lag {}{})",
                    e.exported_seq,
                    e.lag_records,
                    if e.connected { "" } else { ", disconnected" }
                ))
                .unwrap_or_default()
            );
        }
    }
    fastlane_daemon::notify::stopping("draining the producers' rings");
    drop(exporter);
    let service = Arc::into_inner(service).context("metrics thread still holds the service")?;
    let s = service.stop().context("journal writer failed")?;
    log::info!(
        "journal service stopped: durable seq {}, {} records, {} rolls, {} attaches, {} faults",
        s.durable_seq,
        s.records,
        s.rolls,
        s.attaches,
        s.faults
    );
    if let Some(e) = export {
        // The service is stopped: what it made durable while draining is exported now
        // (bounded by the exporter's drain timeout; the rest goes at the next start).
        let e = e.stop();
        log::info!(
            "export stopped: exported seq {} of {}, {} published, {} publish errors",
            e.exported_seq,
            e.durable_seq,
            e.published_total,
            e.publish_errors_total
        );
    }
    Ok(())
}

/// `fastlane journal append --service DIR …`: the same output as appending to a file
/// (each seq, or `ACK n` lines and `DONE n` with `--generate`), the seqs this producer's own.
pub(super) fn append_service(
    dir: &Path,
    records: &[String],
    generate: Option<u64>,
    record_bytes: usize,
    ack_every: Option<u64>,
) -> Result<()> {
    let name = format!("fastlane-append-{}", std::process::id());
    let mut tx = JournalProducer::connect(dir, &name)
        .with_context(|| format!("attach to the journal service at {}", dir.display()))?;
    if let Some(n) = generate {
        let mut last = 0;
        super::records::generate_into(&mut tx, n, record_bytes, ack_every, &mut last)?;
        println!("DONE {last}");
        return Ok(());
    }
    let mut last = 0;
    let mut push = |rec: &[u8]| -> Result<()> {
        last = tx.append_blocking(rec, Duration::from_secs(10))?;
        println!("{last}");
        Ok(())
    };
    if records.is_empty() {
        use std::io::BufRead as _;
        for line in std::io::stdin().lock().lines() {
            push(line?.as_bytes())?;
        }
    } else {
        for r in records {
            push(r.as_bytes())?;
        }
    }
    if last > 0 {
        tx.wait_durable(last, Duration::from_secs(30))?;
    }
    Ok(())
}

/// A note for an operator whose journal directory lies on an ext4 or XFS mount without
/// `lazytime`, from `/proc/self/mountinfo`'s text: each write dirties the segment's mtime,
/// which the file system's periodic journal commit writes with a cache flush; on the dev VM
/// those showed (in some runs) as 3–4 ms stalls of durable writes every 5 s (docs/journal.md).
/// None for other
/// file systems, a `lazytime` mount, or a path no line covers.
fn lazytime_advice(mountinfo: &str, dir: &Path) -> Option<String> {
    // Fields: id parent major:minor root mount-point mount-options ... - fstype source super-options
    let (point, fstype, lazy) = mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let l: Vec<&str> = left.split(' ').collect();
            let r: Vec<&str> = right.split(' ').collect();
            let (point, opts) = (*l.get(4)?, *l.get(5)?);
            let lazy = opts.split(',').chain(r.get(2)?.split(',')).any(|o| o == "lazytime");
            dir.starts_with(point).then_some((point, *r.first()?, lazy))
        })
        .max_by_key(|(point, _, _)| point.len())?;
    if lazy || !matches!(fstype, "ext4" | "xfs") {
        return None;
    }
    Some(format!(
        "{} is on {fstype} at {point} without lazytime: writes change the segment's mtime \
         (once per timer tick), and the inode then goes to disk with the next durable write \
         (ext4 without a journal) or the file system's next journal commit, which can stall \
         durable writes for milliseconds; mounting it with lazytime avoids that \
         (docs/journal.md)",
        dir.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::lazytime_advice;
    use std::path::Path;

    const INFO: &str = "\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
28 27 0:25 / /srv/journal rw,relatime - xfs /dev/vdb rw,lazytime,attr2
29 27 0:26 / /srv/ram rw,relatime - tmpfs tmpfs rw
30 27 0:27 / /srv/lazy rw,relatime,lazytime - ext4 /dev/vdc rw";

    #[test]
    fn advice_only_for_ext4_or_xfs_without_lazytime_on_the_longest_mount() {
        let a = lazytime_advice(INFO, Path::new("/work/j")).expect("ext4 on / without lazytime");
        assert!(a.contains("/work/j is on ext4 at / without lazytime"), "{a}");
        // The longest mount point wins; lazytime in the super options or the mount options.
        assert_eq!(lazytime_advice(INFO, Path::new("/srv/journal/a")), None);
        assert_eq!(lazytime_advice(INFO, Path::new("/srv/lazy/a")), None);
        assert_eq!(
            lazytime_advice(INFO, Path::new("/srv/ram/a")),
            None,
            "tmpfs: no journal commit"
        );
        // "/srv/journalx" is not under "/srv/journal": the root's ext4 applies.
        assert!(lazytime_advice(INFO, Path::new("/srv/journalx")).is_some());
        assert_eq!(lazytime_advice("", Path::new("/x")), None);
        assert_eq!(lazytime_advice("garbage without the separator", Path::new("/x")), None);
    }
}
