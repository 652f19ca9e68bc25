//! A real JetStream cluster on loopback for the exporter tests, and a reader of the stream.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use fastlane_journal_export::{
    ExportConfig, ExportStats, Exporter, MemorySource, HEADER_PRODUCER, HEADER_TIMESTAMP_NS,
};
use futures_util::StreamExt;

/// Longest wait for a node to report JetStream healthy.
pub const NODE_READY_TIMEOUT: Duration = Duration::from_secs(20);

/// One cluster at a time in a test binary: the machines have two cores.
static ONE_CLUSTER: Mutex<()> = Mutex::new(());

/// Serialises the cluster tests of this binary.
pub fn one_at_a_time() -> MutexGuard<'static, ()> {
    ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner())
}

struct Node {
    name: String,
    client_port: u16,
    cluster_port: u16,
    monitor_port: u16,
    store: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

/// `nodes` nats-server processes forming one JetStream cluster; killed on drop.
pub struct NatsCluster {
    dir: tempfile::TempDir,
    nodes: Vec<Node>,
    secured: bool,
}

/// The user and password of a [`NatsCluster::start_secured`] cluster.
pub const SECURED_USER: &str = "fastlane";
/// See [`SECURED_USER`].
pub const SECURED_PASSWORD: &str = "test-password-1";

fn free_ports(n: usize) -> Vec<u16> {
    // Held together so that no two are the same; a race with another process is possible
    // and shows as a node that does not come up.
    let listeners: Vec<TcpListener> =
        (0..n).map(|_| TcpListener::bind("127.0.0.1:0").expect("bind a free port")).collect();
    listeners.iter().map(|l| l.local_addr().expect("local addr").port()).collect()
}

fn require_nats_server() {
    let ok = Command::new("nats-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "nats-server is not installed (or not on PATH): these tests need a real JetStream \
         cluster. Run .ci/install-deps.sh (as root) to install it, then run the tests again."
    );
}

impl NatsCluster {
    /// Starts `n` nodes and waits until each reports JetStream healthy.
    pub fn start(n: usize) -> Self {
        Self::start_with(n, false)
    }

    /// As [`start`](Self::start), with clients held to TLS whose certificates the nodes
    /// verify (`--tlsverify`; the CA, node certificate and key from
    /// `fastlane_util::testcert` in [`tls_dir`](Self::tls_dir), the node certificate
    /// serving as the client's too) and to [`SECURED_USER`]'s password. Routes between the
    /// nodes stay plain (loopback).
    pub fn start_secured(n: usize) -> Self {
        Self::start_with(n, true)
    }

    fn start_with(n: usize, secured: bool) -> Self {
        require_nats_server();
        let dir = tempfile::tempdir().expect("tempdir");
        if secured {
            fastlane_util::testcert::make(dir.path()).expect("test certificates");
        }
        let ports = free_ports(3 * n);
        let nodes = (0..n)
            .map(|i| Node {
                name: format!("n{i}"),
                client_port: ports[3 * i],
                cluster_port: ports[3 * i + 1],
                monitor_port: ports[3 * i + 2],
                store: dir.path().join(format!("n{i}")),
                log: dir.path().join(format!("n{i}.log")),
                child: None,
            })
            .collect();
        let mut cluster = Self { dir, nodes, secured };
        for i in 0..n {
            cluster.spawn(i);
        }
        for i in 0..n {
            cluster.wait_ready(i);
        }
        cluster
    }

    fn spawn(&mut self, i: usize) {
        let routes: Vec<String> = self
            .nodes
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, n)| format!("nats://127.0.0.1:{}", n.cluster_port))
            .collect();
        let mut secure: Vec<std::ffi::OsString> = Vec::new();
        if self.secured {
            let f = |name: &str| self.dir.path().join(name).into_os_string();
            use fastlane_util::testcert::{CA_FILE, CERT_FILE, KEY_FILE};
            secure.extend(["--tlsverify".into(), "--tlscert".into(), f(CERT_FILE)]);
            secure.extend(["--tlskey".into(), f(KEY_FILE), "--tlscacert".into(), f(CA_FILE)]);
            secure.extend(["--user", SECURED_USER, "--pass", SECURED_PASSWORD].map(Into::into));
        }
        let node = &mut self.nodes[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&node.log)
            .expect("open the node's log");
        let child = Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-n", &node.name, "-js"])
            .args(["-p", &node.client_port.to_string()])
            .args(["-m", &node.monitor_port.to_string()])
            .arg("-sd")
            .arg(&node.store)
            .args(["--cluster_name", "fastlane-test"])
            .args(["--cluster", &format!("nats://127.0.0.1:{}", node.cluster_port)])
            .args(["--routes", &routes.join(",")])
            .args(&secure)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup the log fd"))
            .stderr(log)
            .spawn()
            .expect("spawn nats-server");
        node.child = Some(child);
    }

    /// Waits until node `i` answers `/healthz?js-enabled-only=true` with 200.
    pub fn wait_ready(&mut self, i: usize) {
        let end = Instant::now() + NODE_READY_TIMEOUT;
        let port = self.nodes[i].monitor_port;
        loop {
            if let Some(child) = self.nodes[i].child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    panic!("nats-server {i} exited with {status}: {}", self.log_tail(i));
                }
            }
            if http_status(port, "/healthz?js-enabled-only=true") == Some(200) {
                return;
            }
            assert!(
                Instant::now() < end,
                "nats-server {i} not healthy in {NODE_READY_TIMEOUT:?}: {}",
                self.log_tail(i)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The last lines of node `i`'s log.
    pub fn log_tail(&self, i: usize) -> String {
        let text = std::fs::read_to_string(&self.nodes[i].log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// The client URLs, `nats://127.0.0.1:P` each (`tls://` for a secured cluster).
    pub fn urls(&self) -> Vec<String> {
        let scheme = if self.secured { "tls" } else { "nats" };
        self.nodes.iter().map(|n| format!("{scheme}://127.0.0.1:{}", n.client_port)).collect()
    }

    /// The directory of a secured cluster's CA, certificate and key (`fastlane_util::testcert`).
    pub fn tls_dir(&self) -> &std::path::Path {
        assert!(self.secured, "only a secured cluster has TLS files");
        self.dir.path()
    }

    /// Options of a test client that may talk to this cluster.
    pub fn client_options(&self) -> async_nats::ConnectOptions {
        let opts = async_nats::ConnectOptions::new();
        if !self.secured {
            return opts;
        }
        use fastlane_util::testcert::{CA_FILE, CERT_FILE, KEY_FILE};
        let f = |name: &str| self.dir.path().join(name);
        opts.user_and_password(SECURED_USER.into(), SECURED_PASSWORD.into())
            .add_root_certificates(f(CA_FILE))
            .add_client_certificate(f(CERT_FILE), f(KEY_FILE))
            .require_tls(true)
    }

    /// The URLs as an `--export` value.
    pub fn url_list(&self) -> String {
        self.urls().join(",")
    }

    /// SIGKILLs node `i` and reaps it.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts node `i` again on its ports and store, without waiting.
    pub fn restart(&mut self, i: usize) {
        assert!(self.nodes[i].child.is_none(), "node {i} is running");
        self.spawn(i);
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
        let _ = &self.dir;
    }
}

/// A bare HTTP/1.0 GET; the status code, or None when nothing answered.
fn http_status(port: u16, path: &str) -> Option<u16> {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()?;
    s.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut head = [0u8; 12];
    s.read_exact(&mut head).ok()?;
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}

/// The payload of journal seq `seq` in these tests: 8 to 71 bytes, a function of the seq so
/// that a child process and its parent agree on it.
pub fn payload(seq: u64) -> Vec<u8> {
    let len = 8 + (seq % 64) as usize;
    let mut x = seq.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Producer id of journal seq `seq` in these tests.
pub fn producer(seq: u64) -> u32 {
    (seq % 5) as u32
}

/// Timestamp of journal seq `seq` in these tests.
pub fn timestamp(seq: u64) -> u64 {
    1_700_000_000_000_000_000 + seq * 1000
}

/// Appends records up to and including seq `last`.
pub fn fill(src: &MemorySource, last: u64) {
    loop {
        let next = fastlane_journal_export::RecordSource::durable_seq(src) + 1;
        if next > last {
            return;
        }
        assert_eq!(src.append(producer(next), timestamp(next), payload(next)), next);
    }
}

/// A test config for `cluster`: short timeouts so failures show quickly.
pub fn config(cluster: &NatsCluster) -> ExportConfig {
    let mut cfg = ExportConfig::from_urls(&cluster.url_list()).expect("cluster URLs");
    cfg.ack_timeout = Duration::from_secs(2);
    cfg.connect_timeout = Duration::from_secs(1);
    cfg.backoff_max = Duration::from_millis(500);
    cfg.drain_timeout = Duration::from_secs(10);
    cfg
}

/// Polls `exporter` until `exported_seq >= seq`; panics with the stats after `timeout`.
pub fn wait_exported(exporter: &Exporter, seq: u64, timeout: Duration) -> ExportStats {
    let end = Instant::now() + timeout;
    loop {
        let s = exporter.stats();
        if s.exported_seq >= seq {
            return s;
        }
        assert!(Instant::now() < end, "exported_seq did not reach {seq} in {timeout:?}: {s:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A current-thread runtime for the tests' own client.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
}

/// The index of the node leading `stream` (bounded by `timeout`).
pub fn stream_leader(cluster: &NatsCluster, stream: &str, timeout: Duration) -> usize {
    let (urls, opts) = (cluster.urls(), cluster.client_options());
    let leader = runtime().block_on(async {
        let js = jetstream::new(opts.connect(urls.as_slice()).await.expect("connect"));
        let end = tokio::time::Instant::now() + timeout;
        loop {
            let short = Duration::from_millis(500);
            if let Ok(Ok(mut s)) = tokio::time::timeout(short, js.get_stream(stream)).await {
                if let Ok(Ok(info)) = tokio::time::timeout(short, s.info()).await {
                    if let Some(leader) = info.cluster.as_ref().and_then(|c| c.leader.clone()) {
                        return leader;
                    }
                }
            }
            assert!(tokio::time::Instant::now() < end, "no leader for {stream} in {timeout:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    cluster.nodes.iter().position(|n| n.name == leader).expect("the leader is one of ours")
}

/// One message as read back.
#[derive(Debug)]
pub struct Stored {
    pub stream_seq: u64,
    pub journal_seq: u64,
    pub producer: u32,
    pub timestamp_ns: u64,
    pub payload: Vec<u8>,
}

/// Reads the whole stream back with an ordered consumer (bounded by `timeout`).
pub fn read_stream(cluster: &NatsCluster, stream: &str, timeout: Duration) -> Vec<Stored> {
    let (urls, opts) = (cluster.urls(), cluster.client_options());
    runtime().block_on(async {
        let end = tokio::time::Instant::now() + timeout;
        tokio::time::timeout_at(end, async {
            let client = opts.connect(urls.as_slice()).await.expect("test client connects");
            let js = jetstream::new(client);
            // A cluster that just lost or regained a node may take an election to answer.
            let mut tries = 0;
            let (total, consumer) = loop {
                tries += 1;
                let attempt = async {
                    let mut stream = js.get_stream(stream).await?;
                    let total = stream.info().await?.state.messages;
                    let consumer = stream
                        .create_consumer(jetstream::consumer::pull::OrderedConfig::default())
                        .await?;
                    Ok::<_, async_nats::Error>((total, consumer))
                };
                match attempt.await {
                    Ok(v) => break v,
                    Err(e) if tries < 10 => {
                        eprintln!("read_stream: try {tries}: {e}");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    Err(e) => panic!("read_stream: {e}"),
                }
            };
            let mut msgs = consumer.messages().await.expect("consume");
            let mut out = Vec::with_capacity(total as usize);
            while (out.len() as u64) < total {
                let m = msgs.next().await.expect("stream ended early").expect("message");
                let h = m.headers.as_ref().expect("headers");
                let num = |name: &str| -> u64 {
                    h.get(name).expect(name).as_str().parse().expect("a number")
                };
                out.push(Stored {
                    stream_seq: m.info().expect("info").stream_sequence,
                    journal_seq: num("Nats-Msg-Id"),
                    producer: num(HEADER_PRODUCER) as u32,
                    timestamp_ns: num(HEADER_TIMESTAMP_NS),
                    payload: m.payload.to_vec(),
                });
            }
            out
        })
        .await
        .expect("reading the stream back timed out")
    })
}

/// Asserts the stream holds journal seqs 1..=n exactly once each, in order, with the right
/// producer, timestamp and payload.
pub fn assert_exactly_once(stored: &[Stored], n: u64) {
    assert_eq!(stored.len() as u64, n, "message count");
    for (i, m) in stored.iter().enumerate() {
        let seq = i as u64 + 1;
        assert_eq!(m.journal_seq, seq, "message {i} (stream seq {}) out of place", m.stream_seq);
        assert_eq!(m.payload, payload(seq), "payload of journal seq {seq}");
        assert_eq!(m.producer, producer(seq), "producer of journal seq {seq}");
        assert_eq!(m.timestamp_ns, timestamp(seq), "timestamp of journal seq {seq}");
    }
    for w in stored.windows(2) {
        assert_eq!(w[1].stream_seq, w[0].stream_seq + 1, "stream sequence gap");
    }
}
