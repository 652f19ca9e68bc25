//! The exporter thread: sessions with the stream, the publish pipeline, stop and abort.

use std::collections::VecDeque;
use std::future::IntoFuture;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use async_nats::header::{
    HeaderMap, NATS_EXPECTED_LAST_SEQUENCE, NATS_EXPECTED_STREAM, NATS_MESSAGE_ID,
};
use async_nats::jetstream::context::{
    ContextBuilder, GetStreamErrorKind, PublishAckFuture, PublishError,
};
use async_nats::jetstream::publish::PublishAck;
use async_nats::jetstream::stream::{Config as StreamConfig, LastRawMessageErrorKind, StorageType};
use async_nats::jetstream::{self, ErrorCode};
use tokio::sync::Notify;
use tracing::{debug, error, info, warn};

use crate::config::ExportConfig;
use crate::error::ExportError;
use crate::source::{ExportRecord, RecordSource};
use crate::stats::{ExportMetrics, ExportStats, ExportStatsHandle};

/// Header carrying the record's producer id (decimal).
pub const HEADER_PRODUCER: &str = "Fastlane-Producer";
/// Header carrying the record's journal timestamp in ns (decimal).
pub const HEADER_TIMESTAMP_NS: &str = "Fastlane-Timestamp-Ns";

/// First wait after a failed session; it doubles up to `backoff_max`.
const BACKOFF_MIN: Duration = Duration::from_millis(50);
/// Shortest sleep while idle between reconnection attempts (the source is read after each).
const IDLE_SLICE_MIN: Duration = Duration::from_millis(10);
/// The source's errors are logged the first time and then once per this many.
const SOURCE_ERROR_LOG_EVERY: u64 = 1000;

const RUNNING: u8 = 0;
const DRAIN: u8 = 1;
const ABORT: u8 = 2;

/// What [`Exporter::stop`] and `Drop` tell the thread.
#[derive(Debug, Default)]
struct Control {
    mode: AtomicU8,
    wake: Notify,
}

impl Control {
    fn mode(&self) -> u8 {
        self.mode.load(Ordering::Acquire)
    }

    fn request(&self, mode: u8) {
        self.mode.store(mode, Ordering::Release);
        // A stored permit if the thread is not waiting yet: the request is not lost.
        self.wake.notify_one();
    }
}

/// Ships durable records from a [`RecordSource`] to a JetStream stream on its own thread.
/// See the crate documentation for what it guarantees.
#[derive(Debug)]
pub struct Exporter {
    control: Arc<Control>,
    metrics: Arc<ExportMetrics>,
    thread: Option<JoinHandle<()>>,
}

impl Exporter {
    /// Checks `config` and starts the exporter thread (a current-thread tokio runtime). It
    /// returns at once: connecting, creating or checking the stream and exporting happen on
    /// that thread, retried with backoff for as long as the exporter runs.
    pub fn start(config: ExportConfig, source: Box<dyn RecordSource>) -> Result<Self, ExportError> {
        config.validate()?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(ExportError::Runtime)?;
        let control = Arc::new(Control::default());
        let metrics = Arc::new(ExportMetrics::default());
        let (c, m) = (control.clone(), metrics.clone());
        let thread = std::thread::Builder::new()
            .name("journal-export".into())
            .spawn(move || runtime.block_on(run(config, source, m, c)))
            .map_err(ExportError::Spawn)?;
        Ok(Self { control, metrics, thread: Some(thread) })
    }

    /// The counters now (lock-free loads).
    pub fn stats(&self) -> ExportStats {
        self.stats_handle().get()
    }

    /// A clonable reader of the counters for another thread.
    pub fn stats_handle(&self) -> ExportStatsHandle {
        ExportStatsHandle(self.metrics.clone())
    }

    /// Exports what is durable now, within `drain_timeout`, then stops the thread and returns
    /// the last counters. Records not acknowledged by then stay in the source; the next
    /// exporter sends them.
    pub fn stop(mut self) -> ExportStats {
        self.finish(DRAIN);
        self.stats()
    }

    /// Stops at once, abandoning the publishes in flight (what a crash would do; the next
    /// exporter resumes from what the stream holds). Dropping an exporter does the same.
    pub fn abort(mut self) -> ExportStats {
        self.finish(ABORT);
        self.stats()
    }

    fn finish(&mut self, mode: u8) {
        let Some(thread) = self.thread.take() else { return };
        self.control.request(mode);
        if thread.join().is_err() {
            error!("journal export thread panicked");
        }
        self.metrics.connected.store(false, Ordering::Relaxed);
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        self.finish(ABORT);
    }
}

/// The thread's body: sessions until stopped; a stop bounds the drain by `drain_timeout` and
/// an abort ends everything at the next await.
async fn run(
    cfg: ExportConfig,
    mut source: Box<dyn RecordSource>,
    metrics: Arc<ExportMetrics>,
    control: Arc<Control>,
) {
    let hard_stop = async {
        control.wake.notified().await;
        if control.mode() == DRAIN {
            tokio::time::sleep(cfg.drain_timeout).await;
            warn!(timeout = ?cfg.drain_timeout, "journal export: drain timed out");
        }
    };
    let mut exporter = Run {
        cfg: &cfg,
        source: source.as_mut(),
        m: &metrics,
        control: &control,
        stop_target: None,
        buf: Vec::with_capacity(cfg.batch_max),
    };
    tokio::select! {
        () = exporter.sessions() => {}
        () = hard_stop => {}
    }
    metrics.connected.store(false, Ordering::Relaxed);
}

/// One publish whose ack has not been taken yet.
struct InFlight {
    journal_seq: u64,
    stream_seq: u64,
    ack: Pin<Box<dyn std::future::Future<Output = Result<PublishAck, PublishError>> + Send>>,
}

struct Run<'a> {
    cfg: &'a ExportConfig,
    source: &'a mut dyn RecordSource,
    m: &'a ExportMetrics,
    control: &'a Control,
    /// The durable seq when a stop was first seen: the drain's goal.
    stop_target: Option<u64>,
    buf: Vec<ExportRecord>,
}

impl Run<'_> {
    async fn sessions(&mut self) {
        let mut backoff = BACKOFF_MIN;
        let mut first = true;
        loop {
            if self.drained() {
                return;
            }
            if !first {
                ExportMetrics::add(&self.m.reconnects);
            }
            first = false;
            let before = self.m.exported_seq.load(Ordering::Relaxed);
            match self.session().await {
                Ok(()) => return,
                Err(e) => {
                    self.m.connected.store(false, Ordering::Relaxed);
                    if self.m.exported_seq.load(Ordering::Relaxed) != before {
                        backoff = BACKOFF_MIN;
                    }
                    warn!(error = %e, retry_in = ?backoff, "journal export: session ended");
                    self.idle(backoff).await;
                    backoff = (backoff * 2).min(self.cfg.backoff_max);
                }
            }
        }
    }

    fn refresh_durable(&mut self) -> u64 {
        let durable = self.source.durable_seq();
        ExportMetrics::set(&self.m.durable_seq, durable);
        durable
    }

    /// Whether a stop was asked and everything durable at that moment is in the stream.
    fn drained(&mut self) -> bool {
        if self.control.mode() == RUNNING {
            return false;
        }
        let target = match self.stop_target {
            Some(t) => t,
            None => {
                let t = self.refresh_durable();
                self.stop_target = Some(t);
                t
            }
        };
        self.m.exported_seq.load(Ordering::Relaxed) >= target
    }

    /// Waits `d` while keeping `durable_seq` (and so the lag) current.
    async fn idle(&mut self, d: Duration) {
        let end = tokio::time::Instant::now() + d;
        let slice = self.cfg.poll_interval.max(IDLE_SLICE_MIN);
        loop {
            self.refresh_durable();
            let now = tokio::time::Instant::now();
            if now >= end || self.drained() {
                return;
            }
            tokio::time::sleep(slice.min(end - now)).await;
        }
    }

    /// One connection: set up, then publish until an error (returned) or a finished drain.
    async fn session(&mut self) -> Result<(), ExportError> {
        let cfg = self.cfg;
        let lost = Arc::new(SessionLost::default());
        let client = connect(cfg, lost.clone()).await?;
        let js = ContextBuilder::new()
            .timeout(cfg.ack_timeout)
            .max_ack_inflight(cfg.max_in_flight)
            .backpressure_on_inflight(true)
            .build(client);
        let mut stream = ensure_stream(&js, cfg).await?;
        let (exported, mut stream_seq) = resume_point(&mut stream, cfg).await?;
        ExportMetrics::set(&self.m.exported_seq, exported);
        self.m.connected.store(true, Ordering::Relaxed);
        info!(exported_seq = exported, stream_seq, stream = %cfg.stream, "journal export: session up");

        let mut inflight: VecDeque<InFlight> = VecDeque::with_capacity(cfg.max_in_flight);
        let mut next = exported + 1;
        loop {
            if lost.flag.load(Ordering::Acquire) {
                return Err(ExportError::ConnectionLost);
            }
            // Acks already in, oldest first.
            while let Some(front) = inflight.front_mut() {
                let ready = tokio::select! {
                    biased;
                    r = &mut front.ack => Some(r),
                    () = std::future::ready(()) => None,
                };
                let Some(r) = ready else { break };
                self.take_ack(&inflight[0], r)?;
                inflight.pop_front();
            }
            if inflight.is_empty() && self.drained() {
                return Ok(());
            }
            let durable = self.refresh_durable();
            if inflight.len() < cfg.max_in_flight && next <= durable {
                let room = cfg.batch_max.min(cfg.max_in_flight - inflight.len());
                if self.read_batch(next, room) {
                    for rec in self.buf.drain(..) {
                        let journal_seq = rec.seq;
                        let ack = publish(&js, cfg, rec, stream_seq).await?;
                        stream_seq += 1;
                        next = journal_seq + 1;
                        inflight.push_back(InFlight {
                            journal_seq,
                            stream_seq,
                            ack: ack.into_future(),
                        });
                    }
                    // Let the connection task write what was queued.
                    tokio::task::yield_now().await;
                    continue;
                }
            }
            // Nothing to send now: wait for the oldest ack, for the poll interval if the
            // window has room, or for the connection to drop.
            let has_room = inflight.len() < cfg.max_in_flight;
            match inflight.front_mut() {
                Some(front) => {
                    tokio::select! {
                        r = &mut front.ack => {
                            self.take_ack(&inflight[0], r)?;
                            inflight.pop_front();
                        }
                        () = tokio::time::sleep(cfg.poll_interval), if has_room => {}
                        () = lost.wake.notified() => {}
                    }
                }
                None => {
                    tokio::select! {
                        () = tokio::time::sleep(cfg.poll_interval) => {}
                        () = lost.wake.notified() => {}
                    }
                }
            }
        }
    }

    /// Reads up to `max` records from `next` into `self.buf` and checks them; false (and
    /// counted) when the source failed or broke its contract.
    fn read_batch(&mut self, next: u64, max: usize) -> bool {
        self.buf.clear();
        let res = self.source.read_from(next, max, &mut self.buf);
        // Read after the records: the durable seq may have moved on during the read.
        let durable = self.refresh_durable();
        let problem = match res {
            Err(e) => Some(e.to_string()),
            Ok(()) => check_batch(&self.buf, next, max, durable),
        };
        if let Some(problem) = problem {
            self.buf.clear();
            let n = self.m.source_errors.fetch_add(1, Ordering::Relaxed);
            if n.is_multiple_of(SOURCE_ERROR_LOG_EVERY) {
                error!(from_seq = next, errors = n + 1, %problem, "journal export: record source");
            }
            return false;
        }
        if let Some(first) = self.buf.first() {
            if first.seq > next {
                ExportMetrics::add(&self.m.source_gaps);
                warn!(
                    from_seq = next,
                    first_seq = first.seq,
                    "journal export: the source no longer holds these records; skipped"
                );
            }
        }
        !self.buf.is_empty()
    }

    fn take_ack(
        &self,
        sent: &InFlight,
        r: Result<PublishAck, PublishError>,
    ) -> Result<(), ExportError> {
        let ack = match r {
            Ok(ack) => ack,
            Err(e) => {
                ExportMetrics::add(&self.m.publish_errors);
                return Err(ExportError::Publish { seq: sent.journal_seq, reason: e.to_string() });
            }
        };
        if ack.duplicate {
            // Only a message stored earlier under this Msg-Id answers this way: the stream
            // already has the record (at ack.sequence), but our count of its sequence is now
            // off by one. Resynchronise from what the stream holds.
            ExportMetrics::add(&self.m.duplicates);
            if ack.sequence > 0 {
                ExportMetrics::set(&self.m.exported_seq, sent.journal_seq);
            }
            return Err(ExportError::Resync { seq: sent.journal_seq, stream_seq: ack.sequence });
        }
        if ack.sequence != sent.stream_seq || ack.stream != self.cfg.stream {
            // The Nats-Expected-Last-Sequence check makes this impossible; refuse to count it.
            ExportMetrics::add(&self.m.publish_errors);
            return Err(ExportError::AckMismatch {
                seq: sent.journal_seq,
                want: sent.stream_seq,
                got: ack.sequence,
                stream: ack.stream,
            });
        }
        ExportMetrics::add(&self.m.published);
        ExportMetrics::set(&self.m.exported_seq, sent.journal_seq);
        Ok(())
    }
}

/// The source's answer checked against [`RecordSource::read_from`]'s contract.
fn check_batch(batch: &[ExportRecord], from: u64, max: usize, durable: u64) -> Option<String> {
    if batch.len() > max {
        return Some(format!("returned {} records, asked for at most {max}", batch.len()));
    }
    // The lowest seq the next record may have.
    let mut low = Some(from);
    for r in batch {
        if low.is_none_or(|low| r.seq < low) {
            return Some(format!("seq {} out of order (asked from {from})", r.seq));
        }
        if r.seq > durable {
            return Some(format!("seq {} is above the durable seq {durable}", r.seq));
        }
        low = r.seq.checked_add(1);
    }
    None
}

/// Set by the client's event callback when the connection drops mid-session: in-flight acks
/// are lost with it, so the session ends now instead of after an ack timeout.
#[derive(Debug, Default)]
struct SessionLost {
    flag: AtomicBool,
    wake: Notify,
}

async fn connect(
    cfg: &ExportConfig,
    lost: Arc<SessionLost>,
) -> Result<async_nats::Client, ExportError> {
    let urls = cfg.urls.join(",");
    let mut opts = async_nats::ConnectOptions::new();
    let a = &cfg.access;
    if let (Some(user), Some(password)) = (&a.user, &a.password) {
        opts = opts.user_and_password(user.clone(), password.clone());
    }
    if let Some(token) = &a.token {
        opts = opts.token(token.clone());
    }
    if let Some(ca) = &a.ca_file {
        opts = opts.add_root_certificates(ca.clone());
    }
    if let Some((cert, key)) = &a.client_cert {
        opts = opts.add_client_certificate(cert.clone(), key.clone());
    }
    let opts = opts
        .require_tls(cfg.tls_required())
        .name("fastlane-journal-export")
        .connection_timeout(cfg.connect_timeout)
        .request_timeout(Some(cfg.ack_timeout))
        .event_callback(move |event| {
            let lost = lost.clone();
            async move {
                debug!(%event, "journal export: NATS connection event");
                if matches!(event, async_nats::Event::Disconnected) {
                    lost.flag.store(true, Ordering::Release);
                    lost.wake.notify_one();
                }
            }
        });
    // Each server is tried once per attempt; bound the attempt as a whole too.
    let n = u32::try_from(cfg.urls.len()).unwrap_or(u32::MAX).saturating_add(1);
    let bound = cfg.connect_timeout.saturating_mul(n);
    match tokio::time::timeout(bound, opts.connect(cfg.urls.as_slice())).await {
        Ok(Ok(client)) => Ok(client),
        Ok(Err(e)) => Err(ExportError::Connect { urls, reason: e.to_string() }),
        Err(_) => Err(ExportError::Connect { urls, reason: format!("no answer in {bound:?}") }),
    }
}

/// Gets the stream and checks it, or creates it.
async fn ensure_stream(
    js: &jetstream::Context,
    cfg: &ExportConfig,
) -> Result<jetstream::stream::Stream, ExportError> {
    let stream_err = |reason: String| ExportError::Stream { stream: cfg.stream.clone(), reason };
    match js.get_stream(&cfg.stream).await {
        Ok(stream) => {
            let c = &stream.cached_info().config;
            if !c.subjects.iter().any(|s| s == &cfg.subject) || c.num_replicas != cfg.replicas {
                return Err(ExportError::StreamMismatch {
                    stream: cfg.stream.clone(),
                    subjects: c.subjects.clone(),
                    replicas: c.num_replicas,
                    want_subject: cfg.subject.clone(),
                    want_replicas: cfg.replicas,
                });
            }
            if c.duplicate_window < cfg.duplicate_window {
                warn!(
                    stream = %cfg.stream,
                    has = ?c.duplicate_window,
                    want = ?cfg.duplicate_window,
                    "journal export: the stream's duplicate window is shorter than configured"
                );
            }
            Ok(stream)
        }
        Err(e) => {
            let missing = matches!(
                e.kind(),
                GetStreamErrorKind::JetStream(ref j) if j.error_code() == ErrorCode::STREAM_NOT_FOUND
            );
            if !missing {
                return Err(stream_err(e.to_string()));
            }
            let config = StreamConfig {
                name: cfg.stream.clone(),
                description: Some("FastLane journal records, Nats-Msg-Id = journal seq".into()),
                subjects: vec![cfg.subject.clone()],
                num_replicas: cfg.replicas,
                storage: StorageType::File,
                duplicate_window: cfg.duplicate_window,
                ..Default::default()
            };
            let stream = js.create_stream(config).await.map_err(|e| stream_err(e.to_string()))?;
            info!(stream = %cfg.stream, replicas = cfg.replicas, "journal export: stream created");
            Ok(stream)
        }
    }
}

/// The last journal seq in the stream and the stream's last sequence. Every message the
/// exporter stores carried `Nats-Expected-Last-Sequence`, so the stream holds a gap-free,
/// ordered run of journal seqs and its last message says where to go on.
async fn resume_point(
    stream: &mut jetstream::stream::Stream,
    cfg: &ExportConfig,
) -> Result<(u64, u64), ExportError> {
    let stream_err = |reason: String| ExportError::Stream { stream: cfg.stream.clone(), reason };
    let state = stream.info().await.map_err(|e| stream_err(e.to_string()))?.state.clone();
    if state.messages == 0 {
        // Empty (new, or purged: then everything durable is sent again).
        return Ok((0, state.last_sequence));
    }
    let last = match stream.get_last_raw_message_by_subject(&cfg.subject).await {
        Ok(m) => m,
        Err(e) if matches!(e.kind(), LastRawMessageErrorKind::NoMessageFound) => {
            return Ok((0, state.last_sequence));
        }
        Err(e) => return Err(stream_err(e.to_string())),
    };
    // Outside input: anyone with access may have published on the subject.
    let id = last.headers.get(NATS_MESSAGE_ID).map(|v| v.as_str().to_string());
    let journal_seq = id.as_deref().and_then(|s| s.parse::<u64>().ok()).ok_or_else(|| {
        ExportError::ForeignMessage {
            stream: cfg.stream.clone(),
            stream_seq: last.sequence,
            msg_id: id.clone(),
        }
    })?;
    Ok((journal_seq, state.last_sequence))
}

/// Queues one publish; the ack comes later.
async fn publish(
    js: &jetstream::Context,
    cfg: &ExportConfig,
    rec: ExportRecord,
    expected_last_stream_seq: u64,
) -> Result<PublishAckFuture, ExportError> {
    let mut headers = HeaderMap::new();
    headers.insert(NATS_MESSAGE_ID, rec.seq.to_string());
    headers.insert(NATS_EXPECTED_LAST_SEQUENCE, expected_last_stream_seq.to_string());
    headers.insert(NATS_EXPECTED_STREAM, cfg.stream.as_str());
    headers.insert(HEADER_PRODUCER, rec.producer.to_string());
    headers.insert(HEADER_TIMESTAMP_NS, rec.timestamp_ns.to_string());
    let seq = rec.seq;
    js.publish_with_headers(cfg.subject.clone(), headers, bytes::Bytes::from(rec.payload))
        .await
        .map_err(|e| ExportError::Publish { seq, reason: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(seq: u64) -> ExportRecord {
        ExportRecord { seq, producer: 1, timestamp_ns: 0, payload: vec![] }
    }

    #[test]
    fn batch_contract_is_checked() {
        let ok: Vec<_> = [5, 6, 7].into_iter().map(rec).collect();
        assert_eq!(check_batch(&ok, 5, 3, 7), None);
        // A gap at the start (retired records) is allowed, counted elsewhere.
        assert_eq!(check_batch(&ok, 2, 3, 7), None);
        assert!(check_batch(&ok, 5, 2, 7).unwrap().contains("at most 2"));
        assert!(check_batch(&ok, 6, 3, 7).unwrap().contains("out of order"));
        assert!(check_batch(&ok, 5, 3, 6).unwrap().contains("above the durable"));
        let back: Vec<_> = [5, 7, 6].into_iter().map(rec).collect();
        assert!(check_batch(&back, 5, 3, 9).unwrap().contains("out of order"));
        let twice: Vec<_> = [5, 5].into_iter().map(rec).collect();
        assert!(check_batch(&twice, 5, 3, 9).unwrap().contains("out of order"));
    }
}
