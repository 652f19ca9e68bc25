//! Hostile clients for `fastlane llm bench --url … --attack N`: while the measured load runs,
//! N connections of each kind below are kept open against the server (each one that ends is
//! replaced), and what the server answered each kind is counted.
//!
//! - `no_key_trickle`: no API key, a 1 MB body declared and trickled a byte a second (once
//!   answered, a second's pause before the next connection);
//! - `slow_headers`: a request's headers trickled a byte a second;
//! - `never_reads`: a valid key (`--attack-key`), a long streamed request, nothing read;
//! - `max_prompt`: a valid key, a prompt near the context window, four 256-byte stop
//!   strings, the whole response read;
//! - `burst_429`: a valid key of a small-bucket interactive tenant (`--attack-burst-key`), a
//!   request a second on each connection (mostly answered 429).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The kinds, in report order.
pub const KINDS: [&str; 5] =
    ["no_key_trickle", "slow_headers", "never_reads", "max_prompt", "burst_429"];

/// What to attack with.
#[derive(Debug, Clone)]
pub struct Attack {
    /// Connections of each kind kept open.
    pub per_kind: usize,
    /// A valid key (its tenant takes `never_reads` and `max_prompt`).
    pub key: String,
    /// A valid key of a tenant with a small bucket (`burst_429`).
    pub burst_key: String,
    /// The kinds that attack (a subset of [`KINDS`]).
    pub kinds: Vec<&'static str>,
}

/// `names` as kinds of [`KINDS`]; an unknown name is an error that lists the known ones.
pub fn kinds(names: &[String]) -> anyhow::Result<Vec<&'static str>> {
    names
        .iter()
        .map(|n| {
            KINDS.iter().copied().find(|k| k == n).ok_or_else(|| {
                anyhow::anyhow!("--attack-kinds: unknown kind {n:?} (known: {})", KINDS.join(","))
            })
        })
        .collect()
}

/// Per kind: connections opened, and the HTTP statuses answered (0: closed without one).
#[derive(Debug, Default, Clone, Serialize)]
pub struct KindReport {
    /// Connections opened.
    pub opened: u64,
    /// Status → count.
    pub statuses: BTreeMap<u16, u64>,
}

/// The attack's counts, per kind.
pub type Report = BTreeMap<&'static str, KindReport>;

type Shared = Arc<Mutex<Report>>;

fn count(r: &Shared, kind: &'static str, status: Option<u16>) {
    let mut r = r.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let k = r.entry(kind).or_default();
    match status {
        None => k.opened += 1,
        Some(s) => *k.statuses.entry(s).or_default() += 1,
    }
}

async fn status_of(s: &mut tokio::net::TcpStream) -> u16 {
    let mut head = [0u8; 12];
    match s.read_exact(&mut head).await {
        Ok(_) => std::str::from_utf8(&head[9..12]).ok().and_then(|v| v.parse().ok()).unwrap_or(0),
        Err(_) => 0,
    }
}

fn post(addr: &str, key: Option<&str>, body: &str) -> String {
    let auth = key.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
    format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// One connection of `kind`, to its end (bounded by the server's limits, or `stop`).
async fn one(addr: &str, kind: &'static str, a: &Attack, stop: &AtomicBool, r: &Shared) {
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        tokio::time::sleep(Duration::from_millis(100)).await;
        return;
    };
    count(r, kind, None);
    let tick = Duration::from_secs(1);
    let status = match kind {
        "no_key_trickle" => {
            let head =
                "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n";
            let _ = s.write_all(head.as_bytes()).await;
            // One byte a second until the server answers (it should at once).
            let mut status = 0;
            while !stop.load(Ordering::Relaxed) {
                tokio::select! {
                    st = status_of(&mut s) => { status = st; break; }
                    _ = tokio::time::sleep(tick) => {
                        if s.write_all(b"x").await.is_err() { break; }
                    }
                }
            }
            // Then a second before the next: N connections, N keyless requests a second. An
            // attacker reconnecting as fast as the CPU allows is a connection flood, which
            // the threat model leaves to the network in front (docs/serving.md).
            tokio::time::sleep(tick).await;
            status
        }
        "slow_headers" => {
            let head = format!("GET /v1/models HTTP/1.1\r\nHost: {addr}\r\nX-Slow: ");
            let mut status = 0;
            for b in head.bytes().chain(std::iter::repeat(b'a')) {
                if stop.load(Ordering::Relaxed) || s.write_all(&[b]).await.is_err() {
                    break;
                }
                tokio::select! {
                    st = status_of(&mut s) => { status = st; break; }
                    _ = tokio::time::sleep(tick) => {}
                }
            }
            status
        }
        "never_reads" => {
            let body = r#"{"prompt": "never read", "max_tokens": 2048, "stream": true, "ignore_eos": true}"#;
            let _ = s.write_all(post(addr, Some(&a.key), body).as_bytes()).await;
            // Held, unread, until the server closes it or the run ends.
            let mut probe = [0u8; 1];
            while !stop.load(Ordering::Relaxed) {
                match tokio::time::timeout(tick, s.peek(&mut probe)).await {
                    Ok(Ok(0)) | Ok(Err(_)) => break,
                    // Data waits unread: look again in a second.
                    Ok(Ok(_)) => tokio::time::sleep(tick).await,
                    Err(_) => {}
                }
            }
            0
        }
        "max_prompt" => {
            let stop_strings: Vec<String> = (0..4).map(|i| format!("{i}").repeat(256)).collect();
            let body = serde_json::json!({"prompt": "p".repeat(3000), "max_tokens": 64,
                "stop": stop_strings, "ignore_eos": true})
            .to_string();
            let _ = s.write_all(post(addr, Some(&a.key), &body).as_bytes()).await;
            let st = status_of(&mut s).await;
            let mut sink = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut sink)).await;
            st
        }
        _ => {
            let body = r#"{"prompt": "burst", "max_tokens": 1}"#;
            let _ = s.write_all(post(addr, Some(&a.burst_key), body).as_bytes()).await;
            let st = status_of(&mut s).await;
            // One request a second per connection: N connections, N requests a second.
            tokio::time::sleep(tick).await;
            st
        }
    };
    count(r, kind, Some(status));
}

/// Runs the attack until `stop` is set; the counts.
pub async fn run(addr: String, a: Attack, stop: Arc<AtomicBool>) -> Report {
    let report: Shared = Arc::new(Mutex::new(Report::new()));
    let mut tasks = Vec::new();
    for kind in a.kinds.clone() {
        for _ in 0..a.per_kind {
            let (addr, a, stop, r) = (addr.clone(), a.clone(), stop.clone(), report.clone());
            tasks.push(tokio::spawn(async move {
                // Bounded by `stop`: each turn is one connection.
                while !stop.load(Ordering::Relaxed) {
                    one(&addr, kind, &a, &stop, &r).await;
                }
            }));
        }
    }
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A connection that holds on (a trickled body, a stream nobody reads) can outlast the
    // measurement by minutes: after 5 s the counts are taken and the rest are cut.
    tokio::time::sleep(Duration::from_secs(5)).await;
    for t in &tasks {
        t.abort();
    }
    let r = report.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
    r
}

/// [`run`] on a thread of its own with its own runtime, at niceness +10: the attackers stand
/// for other machines, so the measured client (another thread, on the same core in
/// `scripts/bench-attack.sh`) must not wait behind them, neither in a shared runtime's queue
/// nor for the CPU. Join the handle for the counts once `stop` is set.
pub fn spawn(
    addr: String,
    a: Attack,
    stop: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<Report>> {
    std::thread::Builder::new().name("llm-attack".into()).spawn(move || {
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        // SAFETY: setpriority on the calling thread's id; lowering one's own priority needs
        // no privilege, and a failure only leaves the attack at the client's priority.
        unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 10) };
        match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(rt) => rt.block_on(run(addr, a, stop)),
            Err(e) => {
                log::warn!("attack runtime: {e}");
                Report::new()
            }
        }
    })
}

/// The keyless request [`probe`] sends: answered 401 by any server at once.
const PROBE: &[u8] = b"POST /v1/completions HTTP/1.1\r\nHost: probe\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}";

/// Latencies of keyless requests sent every `1 / rate` s for `secs` s, each on a fresh
/// connection (connect, send, read the answer to its end); requests that failed or got no
/// answer within 10 s are counted apart. What the HTTP layer alone costs a new client: the
/// same probe measures our server and [`FloorServer`].
pub async fn probe(addr: String, rate: f64, secs: f64) -> (Vec<Duration>, u64) {
    let start = tokio::time::Instant::now();
    let n = (rate * secs).floor() as u64;
    // Each probe is spawned when it is due (open loop: a slow answer does not delay the next)
    // and collected once done, so only those in flight are held.
    let mut tasks = tokio::task::JoinSet::new();
    let (mut lat, mut failed) = (Vec::new(), 0);
    let mut collect = |r: Result<Option<Duration>, tokio::task::JoinError>| match r {
        Ok(Some(d)) => lat.push(d),
        _ => failed += 1,
    };
    for i in 0..n {
        tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 / rate)).await;
        while let Some(r) = tasks.try_join_next() {
            collect(r);
        }
        let addr = addr.clone();
        tasks.spawn(async move {
            let t0 = std::time::Instant::now();
            let answer = async {
                let mut s = tokio::net::TcpStream::connect(&addr).await?;
                s.set_nodelay(true)?;
                s.write_all(PROBE).await?;
                let mut sink = Vec::new();
                s.read_to_end(&mut sink).await?;
                Ok::<_, std::io::Error>(sink.starts_with(b"HTTP/1.1 "))
            };
            match tokio::time::timeout(Duration::from_secs(10), answer).await {
                Ok(Ok(true)) => Some(t0.elapsed()),
                _ => None,
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        collect(r);
    }
    lat.sort();
    (lat, failed)
}

/// The physical floor of the HTTP layer under attack: one thread, pinned to a core, that
/// accepts, reads once, writes a fixed 401 and closes each connection (no parsing, no
/// routing, no epoll): less than any server does for a connection it refuses. Meant for the
/// kinds that are refused at once by any server (`burst_429`, `no_key_trickle`): a kind that a
/// server holds (`slow_headers`, `never_reads`, `max_prompt`) reconnects at once when the
/// floor refuses it, and becomes another attack. Attacked and
/// probed like our server, it shows what the attack costs a quiet client on this machine
/// with no server work in the way.
#[derive(Debug)]
pub struct FloorServer {
    /// Where it listens (loopback, a free port).
    pub addr: std::net::SocketAddr,
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<(u64, Duration)>,
}

const FLOOR_ANSWER: &[u8] = b"HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\ncontent-length: 36\r\nconnection: close\r\n\r\n{\"error\":{\"message\":\"no API key\"}}";

/// The calling thread's CPU time.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec into `ts`, on our stack.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

impl FloorServer {
    /// Starts it on a free loopback port, its thread pinned to `core` (`--floor-core`).
    pub fn start(core: usize) -> anyhow::Result<FloorServer> {
        use std::io::{Read, Write};
        use std::os::fd::AsRawFd;
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        let fd = listener.as_raw_fd();
        fastlane_daemon::http::set_int_option(fd, libc::IPPROTO_TCP, libc::TCP_NODELAY, 1);
        // SAFETY: listen on a listening socket only sets its backlog, here the one our server
        // asks for (`fastlane_daemon::http::LISTEN_BACKLOG`; `bind` asked for 128).
        let backlog =
            unsafe { libc::listen(fd, fastlane_daemon::http::LISTEN_BACKLOG as libc::c_int) };
        anyhow::ensure!(backlog == 0, "floor server: listen: {}", std::io::Error::last_os_error());
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new().name("floor-server".into()).spawn(move || {
            let pinned = crate::pin::pin_to(core, "--floor-core");
            let failed = pinned.is_err();
            let _ = ready_tx.send(pinned);
            if failed {
                return (0, Duration::ZERO);
            }
            let cpu0 = thread_cpu();
            let mut served = 0u64;
            let mut buf = vec![0u8; 64 << 10];
            // Bounded by `stop` (set, then one connection wakes the accept).
            while !flag.load(Ordering::Relaxed) {
                let Ok((mut c, _)) = listener.accept() else { continue };
                // One read, waiting for the request a moment only: a client that has sent
                // nothing by then is answered all the same.
                let _ = c.set_read_timeout(Some(Duration::from_millis(20)));
                let _ = c.read(&mut buf);
                let _ = c.write_all(FLOOR_ANSWER);
                served += 1;
            }
            (served, thread_cpu() - cpu0)
        })?;
        ready_rx.recv()??;
        Ok(FloorServer { addr, stop, thread })
    }

    /// Stops it: the connections it answered and the CPU time its thread spent.
    pub fn stop(self) -> (u64, Duration) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = std::net::TcpStream::connect(self.addr);
        self.thread.join().unwrap_or((0, Duration::ZERO))
    }
}

/// `VmRSS`, `VmHWM` (kB) and `Threads` of process `pid`, from `/proc`, and its CPU time
/// (`cpu_s`, user + system, from `/proc/PID/stat`).
pub fn process_usage(pid: u32) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command (which may hold spaces) end with ')': utime and stime are
    // the 14th and 15th fields, in clock ticks.
    let rest: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = |i: usize| rest.get(i).and_then(|v| v.parse::<u64>().ok());
    // SAFETY: sysconf reads a constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let cpu_s = (ticks(11)? + ticks(12)?) as f64 / hz;
    let field = |name: &str| -> Option<u64> {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
    };
    Some(serde_json::json!({"rss_kb": field("VmRSS:")?, "hwm_kb": field("VmHWM:")?,
        "threads": field("Threads:")?, "cpu_s": cpu_s}))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    #[test]
    fn the_floor_answers_every_probe_and_counts_its_connections() {
        let core = fastlane_util::cpu::process_cpus()[0];
        let floor = super::FloorServer::start(core).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let (lat, failed) = rt.block_on(super::probe(floor.addr.to_string(), 50.0, 0.2));
        assert_eq!((lat.len(), failed), (10, 0), "every probe answered");
        assert!(lat.windows(2).all(|w| w[0] <= w[1]), "sorted");
        let s = crate::llm_load::probe_summary(&lat, failed);
        assert!(s["p99_ms"].as_f64().unwrap() <= s["max_ms"].as_f64().unwrap());
        let (served, cpu) = floor.stop();
        // The ten probes and the connection that wakes the accept to stop it.
        assert_eq!(served, 11);
        assert!(cpu > Duration::ZERO);
    }

    #[test]
    fn a_processs_cpu_time_is_read_from_proc() {
        let u = super::process_usage(std::process::id()).unwrap();
        assert!(u["cpu_s"].as_f64().unwrap() >= 0.0);
        assert!(u["threads"].as_u64().unwrap() >= 1);
    }
}
