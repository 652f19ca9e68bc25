//! Prometheus metrics of every daemon: [`Families`] registers counters, gauges and latency
//! histograms and renders them ([`Families::render`], [`render`] for a registry of one's own),
//! and [`Exporter`] is `--metrics ADDR`, the endpoint of the daemons that are not HTTP servers
//! themselves (`fastlane serve`, `fastlane kv serve`, `fastlane rdma serve`).
//!
//! One thread runs a current-thread tokio runtime with the daemons' listener
//! ([`crate::http`]: a header-read timeout, a bound on open connections) and
//! answers `GET /metrics` with the text format 0.0.4; other paths get 404, other methods on
//! `/metrics` 405, a request that is not HTTP a 400 from hyper.
//!
//! Refresh on scrape: the daemon hands [`Exporter::start`] a closure that reads its own
//! counters (atomics, or a stats call under a lock its control path already takes) and sets
//! the families just before they are encoded. The data path does no metric work at all.
//! Scrapes run one at a time, so bringing a counter up to a total ([`set_total`]) never
//! counts twice.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::http::{serve, HttpOptions};
use anyhow::{Context, Result};
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use hdrhistogram::Histogram;
use prometheus::core::{Collector, Desc};
use prometheus::{proto, Encoder, IntCounter, IntGauge, Opts, TextEncoder};
pub use prometheus::{IntCounterVec, IntGaugeVec, Registry};

/// The listener's settings: a scraper sends its headers at once and keeps one connection.
const OPTIONS: HttpOptions = HttpOptions {
    header_timeout: Duration::from_secs(5),
    max_connections: 16,
    drain: Duration::from_secs(1),
    write_timeout: Duration::from_secs(5),
    send_buffer: None,
    accept_hold: None,
};

/// The content type of the text exposition format.
pub const TEXT_FORMAT: &str = "text/plain; version=0.0.4";

fn must<T>(r: prometheus::Result<T>) -> T {
    // Names, labels and the one registration of each are constants of this crate: a failure
    // here is our bug (an invalid or duplicate name), found by the daemons' tests.
    #[allow(clippy::expect_used)]
    r.expect("valid, unique metric definition")
}

/// A daemon's metric families, registered once at start.
#[derive(Debug, Clone, Default)]
pub struct Families {
    registry: Registry,
}

impl Families {
    /// No families yet.
    pub fn new() -> Families {
        Families::default()
    }

    /// A counter family (`name` ends in `_total`) with these label names.
    pub fn counter(&self, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
        let c = must(IntCounterVec::new(Opts::new(name, help), labels));
        must(self.registry.register(Box::new(c.clone())));
        c
    }

    /// A gauge family with these label names.
    pub fn gauge(&self, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
        let g = must(IntGaugeVec::new(Opts::new(name, help), labels));
        must(self.registry.register(Box::new(g.clone())));
        g
    }

    /// A histogram family (`name` ends in `_seconds`) whose values are HdrHistograms of
    /// nanoseconds the daemon already records: set at each refresh with
    /// [`LatencyFamily::set`], exported with the bucket bounds [`LATENCY_BUCKETS_S`].
    pub fn latency(&self, name: &str, help: &str, labels: &[&str]) -> LatencyFamily {
        let desc = must(Desc::new(
            name.to_string(),
            help.to_string(),
            labels.iter().map(|l| l.to_string()).collect(),
            Default::default(),
        ));
        let family = LatencyFamily {
            inner: Arc::new(LatencyInner {
                desc,
                labels: labels.iter().map(|l| l.to_string()).collect(),
                metrics: Mutex::new(Vec::new()),
            }),
        };
        must(self.registry.register(Box::new(family.clone())));
        family
    }

    /// One unlabelled metric per row of `table`, set from a `S` by [`FieldSet::update`].
    pub fn fields<S>(&self, table: &'static [Field<S>]) -> FieldSet<S> {
        let metrics = table
            .iter()
            .map(|f| match f.kind {
                Kind::Counter => {
                    let c = must(IntCounter::new(f.name, f.help));
                    must(self.registry.register(Box::new(c.clone())));
                    Metric::Counter(c)
                }
                Kind::Gauge => {
                    let g = must(IntGauge::new(f.name, f.help));
                    must(self.registry.register(Box::new(g.clone())));
                    Metric::Gauge(g)
                }
            })
            .collect();
        FieldSet { table, metrics }
    }

    /// The text exposition of every family as set now.
    pub fn render(&self) -> String {
        render(&self.registry)
    }

    /// The registry, for families a daemon builds itself (prometheus' own histograms).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }
}

/// The text exposition ([`TEXT_FORMAT`]) of every family in `registry` as set now.
pub fn render(registry: &Registry) -> String {
    let mut buf = Vec::new();
    // Encoding into a Vec cannot fail.
    let _ = TextEncoder::new().encode(&registry.gather(), &mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}

/// Upper bounds (seconds) of the buckets a [`LatencyFamily`] exports: 1 µs to 10 s, three
/// per decade, so both a RAM disk's microseconds and a slow device's milliseconds resolve.
pub const LATENCY_BUCKETS_S: [f64; 22] = [
    1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// A Prometheus histogram family fed from HdrHistograms (ns) at each refresh.
#[derive(Debug, Clone)]
pub struct LatencyFamily {
    inner: Arc<LatencyInner>,
}

#[derive(Debug)]
struct LatencyInner {
    desc: Desc,
    labels: Vec<String>,
    /// (label values, the metric as last set).
    metrics: Mutex<Vec<(Vec<String>, proto::Metric)>>,
}

impl LatencyFamily {
    /// Sets the series `values` (one per label name, in order) from `h`, a histogram of
    /// nanoseconds holding everything recorded so far (it only grows, as a Prometheus
    /// histogram must).
    pub fn set(&self, values: &[&str], h: &Histogram<u64>) {
        let buckets: Vec<(f64, u64)> = LATENCY_BUCKETS_S
            .iter()
            .map(|&ub| {
                // Within the histogram's precision (3 significant digits): a value in the
                // same HdrHistogram bucket as the bound counts as below it.
                (ub, if h.is_empty() { 0 } else { h.count_between(0, (ub * 1e9) as u64) })
            })
            .collect();
        self.set_buckets(values, &buckets, h.len(), h.mean() * h.len() as f64 / 1e9);
    }

    /// Sets the series `values` from cumulative bucket counts `(upper bound in seconds,
    /// observations at or below it)`, the total `count` and the `sum` in seconds: for a daemon
    /// that keeps its own buckets (lock-free counters on its data path).
    pub fn set_buckets(&self, values: &[&str], buckets: &[(f64, u64)], count: u64, sum: f64) {
        let mut hist = proto::Histogram::default();
        hist.set_sample_count(count);
        hist.set_sample_sum(sum);
        let buckets = buckets
            .iter()
            .map(|&(ub, n)| {
                let mut b = proto::Bucket::default();
                b.set_cumulative_count(n);
                b.set_upper_bound(ub);
                b
            })
            .collect();
        hist.set_bucket(buckets);
        let mut m = proto::Metric::default();
        m.set_label(
            self.inner
                .labels
                .iter()
                .zip(values)
                .map(|(n, v)| {
                    let mut l = proto::LabelPair::default();
                    l.set_name(n.clone());
                    l.set_value(v.to_string());
                    l
                })
                .collect(),
        );
        m.set_histogram(hist);
        let values: Vec<String> = values.iter().map(|v| v.to_string()).collect();
        let mut metrics = self.inner.metrics.lock().unwrap_or_else(PoisonError::into_inner);
        match metrics.iter_mut().find(|(v, _)| *v == values) {
            Some(slot) => slot.1 = m,
            None => metrics.push((values, m)),
        }
    }
}

impl Collector for LatencyFamily {
    fn desc(&self) -> Vec<&Desc> {
        vec![&self.inner.desc]
    }

    fn collect(&self) -> Vec<proto::MetricFamily> {
        let mut f = proto::MetricFamily::default();
        f.set_name(self.inner.desc.fq_name.clone());
        f.set_help(self.inner.desc.help.clone());
        f.set_field_type(proto::MetricType::HISTOGRAM);
        let metrics = self.inner.metrics.lock().unwrap_or_else(PoisonError::into_inner);
        f.set_metric(metrics.iter().map(|(_, m)| m.clone()).collect());
        vec![f]
    }
}

/// Brings the counter `labels` of `family` up to `total`, a daemon counter that only grows.
pub fn set_total(family: &IntCounterVec, labels: &[&str], total: u64) {
    let c = family.with_label_values(labels);
    c.inc_by(total.saturating_sub(c.get()));
}

/// Sets the gauge `labels` of `family` (saturating at `i64::MAX`).
pub fn set_gauge(family: &IntGaugeVec, labels: &[&str], value: u64) {
    family.with_label_values(labels).set(i64::try_from(value).unwrap_or(i64::MAX));
}

/// Counter or gauge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only grows: set with [`set_total`]'s rule.
    Counter,
    /// A level now.
    Gauge,
}

/// One field of a daemon's stats struct `S`, exported as its own metric: a table of these
/// makes exporting one more field one line.
#[derive(Debug)]
pub struct Field<S> {
    /// The metric name (`fastlane_…`, counters ending in `_total`).
    pub name: &'static str,
    /// Its `# HELP` text.
    pub help: &'static str,
    /// Counter or gauge.
    pub kind: Kind,
    /// Reads the field.
    pub read: fn(&S) -> u64,
}

/// A counter row of a [`Field`] table.
pub const fn counter<S>(name: &'static str, help: &'static str, read: fn(&S) -> u64) -> Field<S> {
    Field { name, help, kind: Kind::Counter, read }
}

/// A gauge row of a [`Field`] table.
pub const fn gauge<S>(name: &'static str, help: &'static str, read: fn(&S) -> u64) -> Field<S> {
    Field { name, help, kind: Kind::Gauge, read }
}

#[derive(Debug)]
enum Metric {
    Counter(IntCounter),
    Gauge(IntGauge),
}

/// The registered metrics of a [`Field`] table.
#[derive(Debug)]
pub struct FieldSet<S: 'static> {
    table: &'static [Field<S>],
    /// One per row of `table`, in its order.
    metrics: Vec<Metric>,
}

impl<S> FieldSet<S> {
    /// Sets every metric from `s`.
    pub fn update(&self, s: &S) {
        for (m, f) in self.metrics.iter().zip(self.table) {
            let v = (f.read)(s);
            match m {
                Metric::Counter(c) => c.inc_by(v.saturating_sub(c.get())),
                Metric::Gauge(g) => g.set(i64::try_from(v).unwrap_or(i64::MAX)),
            }
        }
    }
}

type Refresh = Box<dyn FnMut() + Send>;

/// What a scrape needs: the families and the daemon's refresh.
struct Scrape {
    families: Families,
    /// Held for the whole scrape: scrapes run one at a time.
    refresh: Mutex<Refresh>,
}

impl Scrape {
    fn render(&self) -> String {
        let mut refresh = self.refresh.lock().unwrap_or_else(PoisonError::into_inner);
        (*refresh)();
        self.families.render()
    }
}

async fn scrape(State(s): State<Arc<Scrape>>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, TEXT_FORMAT)], s.render())
}

/// The running endpoint; dropping it stops the listener and joins its thread.
#[derive(Debug)]
pub struct Exporter {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Exporter {
    /// Binds `addr` (port 0: a free one), logs `metrics on http://ADDR/metrics` at info level
    /// and serves `families` on its own thread, calling `refresh` before each encoding.
    ///
    /// Call it after the daemon has blocked its stop signals: the thread inherits the mask.
    pub fn start(
        addr: SocketAddr,
        families: Families,
        refresh: impl FnMut() + Send + 'static,
    ) -> Result<Exporter> {
        let listener = std::net::TcpListener::bind(addr)
            .with_context(|| format!("--metrics {addr}: cannot bind"))?;
        listener.set_nonblocking(true).context("--metrics: non-blocking listener")?;
        let local = listener.local_addr().context("--metrics: bound address")?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("--metrics: tokio runtime")?;
        let state = Arc::new(Scrape { families, refresh: Mutex::new(Box::new(refresh)) });
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("metrics".into())
            .spawn(move || {
                rt.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(listener) {
                        Ok(l) => l,
                        Err(e) => {
                            log::error!("metrics: listener on {local}: {e}; no metrics served");
                            return;
                        }
                    };
                    let app = Router::new().route("/metrics", get(scrape)).with_state(state);
                    // Ends when the sender is dropped (or used).
                    let shutdown = async {
                        let _ = stopped.await;
                    };
                    serve(listener, app, OPTIONS, shutdown).await;
                });
            })
            .context("--metrics: thread")?;
        let exporter = Exporter { addr: local, stop: Some(stop), thread: Some(thread) };
        log::info!("metrics on http://{}/metrics", exporter.local_addr());
        Ok(exporter)
    }

    /// The address bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Starts the exporter when `--metrics` is given; the closure that builds the refresh runs
/// only then (so a daemon without `--metrics` registers nothing).
pub fn start_if<R: FnMut() + Send + 'static>(
    addr: Option<SocketAddr>,
    build: impl FnOnce(&Families) -> R,
) -> Result<Option<Exporter>> {
    let Some(addr) = addr else { return Ok(None) };
    let families = Families::new();
    let refresh = build(&families);
    Exporter::start(addr, families, refresh).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicU64, Ordering};

    /// One request on a fresh connection, read until the server closes it: the whole
    /// answer. The request asks for `Connection: close`; the write side stays open, since a
    /// server without half-close support (hyper's default) may drop a connection whose read
    /// side reached EOF before it wrote the answer.
    fn http(addr: SocketAddr, request: &[u8]) -> String {
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.write_all(request).unwrap();
        let mut out = Vec::new();
        let _ = c.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    }

    fn get(addr: SocketAddr, path: &str) -> String {
        http(
            addr,
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
    }

    fn value(text: &str, name_and_labels: &str) -> Option<u64> {
        text.lines()
            .find(|l| l.split(' ').next() == Some(name_and_labels))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }

    #[derive(Default)]
    struct Stats {
        done: AtomicU64,
        open: AtomicU64,
    }

    static TABLE: &[Field<Stats>] = &[
        counter("fastlane_test_done_total", "Done", |s| s.done.load(Ordering::Relaxed)),
        gauge("fastlane_test_open", "Open now", |s| s.open.load(Ordering::Relaxed)),
    ];

    #[test]
    fn refreshes_on_scrape_and_refuses_other_requests() {
        let stats = Arc::new(Stats::default());
        let scrapes = Arc::new(AtomicU64::new(0));
        let exporter = start_if(Some("127.0.0.1:0".parse().unwrap()), |f| {
            let fields = f.fields(TABLE);
            let by_op = f.counter("fastlane_test_ops_total", "Ops by op", &["op"]);
            let (stats, scrapes) = (stats.clone(), scrapes.clone());
            move || {
                scrapes.fetch_add(1, Ordering::Relaxed);
                fields.update(&stats);
                set_total(&by_op, &["read"], 2 * stats.done.load(Ordering::Relaxed));
            }
        })
        .unwrap()
        .unwrap();
        let addr = exporter.local_addr();
        assert_ne!(addr.port(), 0);

        stats.done.store(5, Ordering::Relaxed);
        stats.open.store(3, Ordering::Relaxed);
        let text = get(addr, "/metrics");
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        assert!(text.contains("content-type: text/plain; version=0.0.4"), "{text}");
        assert_eq!(value(&text, "fastlane_test_done_total"), Some(5), "{text}");
        assert_eq!(value(&text, "fastlane_test_open"), Some(3), "{text}");
        assert_eq!(value(&text, "fastlane_test_ops_total{op=\"read\"}"), Some(10), "{text}");
        assert!(text.contains("# TYPE fastlane_test_done_total counter"), "{text}");
        assert!(text.contains("# TYPE fastlane_test_open gauge"), "{text}");

        // A gauge goes down, a counter follows its total up and is not counted twice.
        stats.done.store(7, Ordering::Relaxed);
        stats.open.store(1, Ordering::Relaxed);
        let text = get(addr, "/metrics");
        assert_eq!(value(&text, "fastlane_test_done_total"), Some(7), "{text}");
        assert_eq!(value(&text, "fastlane_test_open"), Some(1), "{text}");
        assert_eq!(value(&text, "fastlane_test_ops_total{op=\"read\"}"), Some(14), "{text}");
        assert_eq!(scrapes.load(Ordering::Relaxed), 2);

        // Elsewhere: 404; another method: 405; not HTTP: 400. None refreshes.
        let root = get(addr, "/");
        assert!(root.starts_with("HTTP/1.1 404"), "{root:?}");
        let deeper = get(addr, "/metrics/x");
        assert!(deeper.starts_with("HTTP/1.1 404"), "{deeper:?}");
        let post = http(
            addr,
            b"POST /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
        );
        assert!(post.starts_with("HTTP/1.1 405"), "{post}");
        let junk = http(addr, b"\x00\x01garbage\r\n\r\n");
        assert!(junk.is_empty() || junk.starts_with("HTTP/1.1 400"), "{junk:?}");
        assert_eq!(scrapes.load(Ordering::Relaxed), 2);
        // Still serving.
        assert!(get(addr, "/metrics").starts_with("HTTP/1.1 200"));

        drop(exporter);
        assert!(std::net::TcpStream::connect(addr).is_err(), "listener closed on drop");
    }

    #[test]
    fn off_without_an_address_and_a_bad_address_is_an_error() {
        let built = std::cell::Cell::new(false);
        let none = start_if(None, |_| {
            built.set(true);
            || {}
        })
        .unwrap();
        assert!(none.is_none() && !built.get());
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let err = start_if(Some(addr), |_| || {}).unwrap_err();
        assert!(format!("{err:#}").contains(&format!("--metrics {addr}: cannot bind")), "{err:#}");
    }
}
