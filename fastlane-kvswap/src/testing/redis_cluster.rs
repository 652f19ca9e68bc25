//! A real Redis Cluster for tests: six `redis-server` processes (three primaries, three
//! replicas) on free loopback ports, in a fresh temporary directory, stopped on drop.
//!
//! Each node runs with command-line settings only (no config file, so the system's
//! `/etc/redis` and any `redis-server` service the package started do not matter: that one
//! listens on 6379, these on ports the kernel just handed out):
//! `--cluster-enabled yes --cluster-node-timeout 1000 --appendonly no --save ''
//! --maxmemory 64mb --maxmemory-policy allkeys-lru --bind 127.0.0.1`, an explicit
//! `--cluster-port`, and diskless replication without delay so replicas sync at once.
//! `redis-cli --cluster create … --cluster-replicas 1 --cluster-yes` forms the cluster; start
//! returns once every node reports `cluster_state:ok` and every replica's link to its primary
//! is up. Every wait is bounded.
//!
//! `redis-server` and `redis-cli` must be on `PATH` (Debian packages `redis-server` and
//! `redis-tools`; `.ci/install-deps.sh` installs them); without them
//! [`RedisCluster::start`] fails and says so, so tests fail rather than skip.
//!
//! [`RedisCluster::start_with`] can also make the nodes ask for a password (`requirepass`,
//! and `masterauth` for the replicas) and serve TLS only: then a CA and one certificate for
//! every node (subject alternative names `IP:127.0.0.1` and `DNS:localhost`, EC P-256) are
//! made with the `openssl` command (Debian package `openssl`) in the cluster's directory, and
//! each node runs with `--port 0 --tls-port P --tls-cluster yes --tls-replication yes
//! --tls-auth-clients no` (clients need no certificate of their own). Debian's redis-server
//! is built with TLS.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread;
use std::time::{Duration, Instant};

/// Nodes in the cluster.
pub const NODES: usize = 6;
/// `--cluster-node-timeout` of every node, in milliseconds.
pub const NODE_TIMEOUT_MS: u64 = 1000;
const CLI_TIMEOUT: Duration = Duration::from_secs(10);
const START_ATTEMPTS: u32 = 3;

/// What went wrong starting or driving the test cluster.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("redis test cluster: {0}")]
pub struct RedisHarnessError(pub String);

fn err<T>(msg: impl Into<String>) -> Result<T, RedisHarnessError> {
    Err(RedisHarnessError(msg.into()))
}

#[derive(Debug)]
struct Node {
    port: u16,
    bus_port: u16,
    child: Option<Child>,
}

/// A running six-node cluster (see the module doc).
#[derive(Debug)]
pub struct RedisCluster {
    dir: PathBuf,
    nodes: Vec<Node>,
    opts: RedisClusterOptions,
}

/// How the nodes of a [`RedisCluster`] guard themselves; the default: no password, plain TCP.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RedisClusterOptions {
    /// `requirepass` (and `masterauth`) of every node.
    pub password: Option<String>,
    /// Serve TLS only, with a CA and certificates made in the cluster's directory.
    pub tls: bool,
}

/// File names, in the cluster's directory, of the TLS material of a TLS cluster.
pub const TLS_CA_FILE: &str = fastlane_util::testcert::CA_FILE;
const TLS_CERT_FILE: &str = fastlane_util::testcert::CERT_FILE;
const TLS_KEY_FILE: &str = fastlane_util::testcert::KEY_FILE;

/// Makes a CA and a node certificate signed by it (`IP:127.0.0.1`, `DNS:localhost`) in `dir`
/// ([`fastlane_util::testcert::make`]): [`TLS_CA_FILE`], `node.crt`, `node.key`.
pub fn make_tls_files(dir: &Path) -> Result<(), RedisHarnessError> {
    fastlane_util::testcert::make(dir).map_err(|e| RedisHarnessError(e.to_string()))
}

fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(name)).find(|p| p.is_file())
}

/// Ports the kernel hands out for 127.0.0.1, all distinct (held until all are picked).
fn free_ports(n: usize) -> Result<Vec<u16>, RedisHarnessError> {
    let mut held = Vec::with_capacity(n);
    for _ in 0..n {
        let l = TcpListener::bind("127.0.0.1:0")
            .map_err(|e| RedisHarnessError(format!("binding a free port: {e}")))?;
        held.push(l);
    }
    held.iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| RedisHarnessError(format!("local_addr: {e}")))
}

/// Runs `cmd` to completion, killing it after `limit`. Its output must fit in the pipe
/// buffers (64 KiB each), as every redis-cli answer the harness asks for does.
fn run_bounded(cmd: &mut Command, limit: Duration) -> Result<Output, RedisHarnessError> {
    fastlane_util::testcert::run_bounded(cmd, limit)
        .map_err(|e| RedisHarnessError(format!("running {cmd:?}: {e}")))
}

fn field<'a>(text: &'a str, name: &str) -> Option<&'a str> {
    text.lines().find_map(|l| l.trim_end().strip_prefix(name)?.strip_prefix(':'))
}

/// One line of `CLUSTER NODES`.
#[derive(Debug, Clone)]
struct NodeLine {
    port: u16,
    flags: Vec<String>,
    slots: Vec<(u16, u16)>,
}

fn parse_nodes(text: &str) -> Vec<NodeLine> {
    let mut out = Vec::new();
    for line in text.lines() {
        let parts: Vec<&str> = line.split_whitespace().collect();
        if parts.len() < 8 {
            continue;
        }
        // ip:port@cport[,hostname]
        let Some(port) = parts[1]
            .split('@')
            .next()
            .and_then(|a| a.rsplit(':').next())
            .and_then(|p| p.parse::<u16>().ok())
        else {
            continue;
        };
        let flags = parts[2].split(',').map(str::to_string).collect();
        let mut slots = Vec::new();
        for s in &parts[8..] {
            if s.starts_with('[') {
                continue; // a slot being migrated
            }
            let mut ab = s.splitn(2, '-');
            let a = ab.next().and_then(|x| x.parse::<u16>().ok());
            let b = ab.next().map(|x| x.parse::<u16>().ok());
            match (a, b) {
                (Some(a), None) => slots.push((a, a)),
                (Some(a), Some(Some(b))) => slots.push((a, b)),
                _ => {}
            }
        }
        out.push(NodeLine { port, flags, slots });
    }
    out
}

static NEXT_DIR: AtomicU32 = AtomicU32::new(0);

impl RedisCluster {
    /// Starts six nodes, forms the cluster and waits until it is fully up (about 2-5 s).
    pub fn start() -> Result<RedisCluster, RedisHarnessError> {
        Self::start_with(RedisClusterOptions::default())
    }

    /// [`start`](Self::start) with a password and/or TLS (see the module doc).
    pub fn start_with(opts: RedisClusterOptions) -> Result<RedisCluster, RedisHarnessError> {
        for (bin, pkg) in [("redis-server", "redis-server"), ("redis-cli", "redis-tools")] {
            if find_on_path(bin).is_none() {
                return err(format!(
                    "{bin} not found on PATH: install the Debian package {pkg} \
                     (apt-get install -y redis-server redis-tools; .ci/install-deps.sh does)"
                ));
            }
        }
        let mut last = RedisHarnessError(String::new());
        for _ in 0..START_ATTEMPTS {
            // A port picked here may be taken by someone else before redis binds it: then
            // that node dies at once and the whole start is tried again on new ports.
            match Self::start_once(&opts) {
                Ok(c) => return Ok(c),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    fn start_once(opts: &RedisClusterOptions) -> Result<RedisCluster, RedisHarnessError> {
        let ports = free_ports(2 * NODES)?;
        let dir = std::env::temp_dir().join(format!(
            "kvswap-redis-{}-{}",
            std::process::id(),
            NEXT_DIR.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)
            .map_err(|e| RedisHarnessError(format!("creating {}: {e}", dir.display())))?;
        if opts.tls {
            make_tls_files(&dir)?;
        }
        let mut cluster =
            RedisCluster { dir, nodes: Vec::with_capacity(NODES), opts: opts.clone() };
        for i in 0..NODES {
            let (port, bus_port) = (ports[i], ports[NODES + i]);
            let child = cluster.spawn_node(port, bus_port)?;
            cluster.nodes.push(Node { port, bus_port, child: Some(child) });
        }
        for i in 0..NODES {
            cluster.wait_ping(i, Duration::from_secs(10))?;
        }
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for n in &cluster.nodes {
            create.arg(format!("127.0.0.1:{}", n.port));
        }
        create.args(["--cluster-replicas", "1", "--cluster-yes"]);
        create.args(cluster.cli_access_args());
        let out = run_bounded(&mut create, Duration::from_secs(30))?;
        if !out.status.success() {
            return err(format!(
                "redis-cli --cluster create failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        cluster.wait_ready(Duration::from_secs(30))?;
        Ok(cluster)
    }

    fn spawn_node(&self, port: u16, bus_port: u16) -> Result<Child, RedisHarnessError> {
        let p = port.to_string();
        let file = |suffix: &str| self.dir.join(format!("{port}{suffix}"));
        let mut cmd = Command::new("redis-server");
        if self.opts.tls {
            cmd.args(["--port", "0", "--tls-port", &p])
                .arg("--tls-cert-file")
                .arg(self.dir.join(TLS_CERT_FILE))
                .arg("--tls-key-file")
                .arg(self.dir.join(TLS_KEY_FILE))
                .arg("--tls-ca-cert-file")
                .arg(self.dir.join(TLS_CA_FILE))
                .args(["--tls-auth-clients", "no", "--tls-cluster", "yes"])
                .args(["--tls-replication", "yes"]);
        } else {
            cmd.args(["--port", &p]);
        }
        if let Some(pass) = &self.opts.password {
            cmd.args(["--requirepass", pass, "--masterauth", pass]);
        }
        cmd.args(["--bind", "127.0.0.1", "--daemonize", "no"])
            .args(["--cluster-enabled", "yes", "--cluster-port", &bus_port.to_string()])
            .arg("--cluster-config-file")
            .arg(file("-nodes.conf"))
            .args(["--cluster-node-timeout", &NODE_TIMEOUT_MS.to_string()])
            // A replica fails over however long ago it last heard from its primary.
            .args(["--cluster-replica-validity-factor", "0"])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(file(".log"))
            .args(["--appendonly", "no", "--save", ""])
            .args(["--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0"])
            .args(["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| RedisHarnessError(format!("spawning redis-server on {port}: {e}")))
    }

    fn log_tail(&self, port: u16) -> String {
        let text =
            std::fs::read_to_string(self.dir.join(format!("{port}.log"))).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(8)..].join("\n")
    }

    fn wait_ping(&mut self, i: usize, limit: Duration) -> Result<(), RedisHarnessError> {
        let start = Instant::now();
        loop {
            let port = self.nodes[i].port;
            if let Some(child) = self.nodes[i].child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    return err(format!(
                        "redis-server on {port} exited ({status}): {}",
                        self.log_tail(port)
                    ));
                }
            }
            if self.cli(i, &["PING"]).map(|s| s.trim() == "PONG").unwrap_or(false) {
                return Ok(());
            }
            if start.elapsed() > limit {
                return err(format!("redis-server on {port} not answering after {limit:?}"));
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    fn wait_ready(&self, limit: Duration) -> Result<(), RedisHarnessError> {
        let start = Instant::now();
        let mut why = String::new();
        while start.elapsed() < limit {
            match self.ready() {
                Ok(()) => return Ok(()),
                Err(e) => why = e.0,
            }
            thread::sleep(Duration::from_millis(50));
        }
        err(format!("cluster not ready after {limit:?}: {why}"))
    }

    /// Every running node reports `cluster_state:ok`, and every running replica's link is up.
    fn ready(&self) -> Result<(), RedisHarnessError> {
        for i in self.running() {
            let info = self.cli(i, &["CLUSTER", "INFO"])?;
            if field(&info, "cluster_state") != Some("ok") {
                return err(format!("node {i}: cluster_state not ok"));
            }
            let repl = self.cli(i, &["INFO", "replication"])?;
            if field(&repl, "role") == Some("slave")
                && field(&repl, "master_link_status") != Some("up")
            {
                return err(format!("node {i}: replica link not up"));
            }
        }
        Ok(())
    }

    /// `redis://127.0.0.1:PORT` (`rediss://` for a TLS cluster) of every node, killed ones
    /// included.
    pub fn urls(&self) -> Vec<String> {
        let scheme = if self.opts.tls { "rediss" } else { "redis" };
        self.nodes.iter().map(|n| format!("{scheme}://127.0.0.1:{}", n.port)).collect()
    }

    /// The CA file that signed a TLS cluster's certificates (`None`: plain TCP).
    pub fn ca_file(&self) -> Option<PathBuf> {
        self.opts.tls.then(|| self.dir.join(TLS_CA_FILE))
    }

    /// The options it was started with.
    pub fn options(&self) -> &RedisClusterOptions {
        &self.opts
    }

    /// `redis-cli`'s arguments for the password and TLS.
    fn cli_access_args(&self) -> Vec<String> {
        let mut a = Vec::new();
        if let Some(pass) = &self.opts.password {
            a.extend(["-a".to_string(), pass.clone(), "--no-auth-warning".to_string()]);
        }
        if self.opts.tls {
            a.extend(["--tls".to_string(), "--cacert".to_string()]);
            a.push(self.dir.join(TLS_CA_FILE).display().to_string());
        }
        a
    }

    /// Client port of node `i`.
    pub fn port(&self, i: usize) -> u16 {
        self.nodes[i].port
    }

    /// Cluster bus port of node `i`.
    pub fn bus_port(&self, i: usize) -> u16 {
        self.nodes[i].bus_port
    }

    /// The directory holding the nodes' logs and cluster config files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Indices of the nodes not killed.
    pub fn running(&self) -> Vec<usize> {
        (0..self.nodes.len()).filter(|&i| self.nodes[i].child.is_some()).collect()
    }

    /// Runs `redis-cli -p PORT ARGS…` against node `i` (bounded) and returns its output.
    pub fn cli(&self, i: usize, args: &[&str]) -> Result<String, RedisHarnessError> {
        let port = self.nodes[i].port.to_string();
        let out = run_bounded(
            Command::new("redis-cli")
                .args(["-h", "127.0.0.1", "-p", &port])
                .args(self.cli_access_args())
                .args(args),
            CLI_TIMEOUT,
        )?;
        if !out.status.success() {
            return err(format!(
                "redis-cli -p {port} {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if text.starts_with("Could not connect") || text.starts_with("Error:") {
            return err(format!("redis-cli -p {port} {args:?}: {}", text.trim()));
        }
        Ok(text)
    }

    fn any_running(&self) -> Result<usize, RedisHarnessError> {
        match self.running().first() {
            Some(&i) => Ok(i),
            None => err("no node running"),
        }
    }

    /// The hash slot of `key` (`CLUSTER KEYSLOT`, asked of a running node).
    pub fn key_slot(&self, key: &str) -> Result<u16, RedisHarnessError> {
        let out = self.cli(self.any_running()?, &["CLUSTER", "KEYSLOT", key])?;
        out.trim()
            .parse::<u16>()
            .map_err(|_| RedisHarnessError(format!("CLUSTER KEYSLOT answered {out:?}")))
    }

    fn node_of_port(&self, port: u16) -> Option<usize> {
        self.nodes.iter().position(|n| n.port == port)
    }

    /// The node serving `slot` as primary, as a running node sees the cluster now.
    pub fn primary_for_slot(&self, slot: u16) -> Result<usize, RedisHarnessError> {
        let text = self.cli(self.any_running()?, &["CLUSTER", "NODES"])?;
        for n in parse_nodes(&text) {
            let primary = n.flags.iter().any(|f| f == "master")
                && !n.flags.iter().any(|f| f == "fail" || f == "fail?");
            if primary && n.slots.iter().any(|&(a, b)| a <= slot && slot <= b) {
                if let Some(i) = self.node_of_port(n.port) {
                    return Ok(i);
                }
            }
        }
        err(format!("no live primary serves slot {slot}"))
    }

    /// The nodes that are primaries, as a running node sees the cluster now.
    pub fn primaries(&self) -> Result<Vec<usize>, RedisHarnessError> {
        let text = self.cli(self.any_running()?, &["CLUSTER", "NODES"])?;
        let mut out: Vec<usize> = parse_nodes(&text)
            .iter()
            .filter(|n| n.flags.iter().any(|f| f == "master") && !n.slots.is_empty())
            .filter_map(|n| self.node_of_port(n.port))
            .collect();
        out.sort_unstable();
        Ok(out)
    }

    /// Kills node `i` with SIGKILL and reaps it. A no-op when it is not running.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits until the running nodes have marked the killed node `dead` as failed, a replica
    /// has taken over its slots, and every running node reports `cluster_state:ok`.
    /// Returns how long that took.
    pub fn wait_failover(
        &self,
        dead: usize,
        limit: Duration,
    ) -> Result<Duration, RedisHarnessError> {
        let start = Instant::now();
        let dead_port = self.nodes[dead].port;
        let mut why = String::new();
        while start.elapsed() < limit {
            match self.failed_over(dead_port) {
                Ok(()) => return Ok(start.elapsed()),
                Err(e) => why = e.0,
            }
            thread::sleep(Duration::from_millis(50));
        }
        err(format!("no failover of node {dead} within {limit:?}: {why}"))
    }

    fn failed_over(&self, dead_port: u16) -> Result<(), RedisHarnessError> {
        for i in self.running() {
            let nodes = parse_nodes(&self.cli(i, &["CLUSTER", "NODES"])?);
            let marked =
                nodes.iter().any(|n| n.port == dead_port && n.flags.iter().any(|f| f == "fail"));
            if !marked {
                return err(format!("node {i} has not marked port {dead_port} failed"));
            }
            let covered: u32 = nodes
                .iter()
                .filter(|n| n.port != dead_port && n.flags.iter().any(|f| f == "master"))
                .flat_map(|n| n.slots.iter())
                .map(|&(a, b)| u32::from(b) - u32::from(a) + 1)
                .sum();
            if covered != 16384 {
                return err(format!("node {i} sees {covered} of 16384 slots on live primaries"));
            }
        }
        for i in self.running() {
            if field(&self.cli(i, &["CLUSTER", "INFO"])?, "cluster_state") != Some("ok") {
                return err(format!("node {i}: cluster_state not ok"));
            }
        }
        Ok(())
    }

    /// Freezes node `i` with SIGSTOP: its sockets stay open but nothing answers (a hung
    /// node, unlike a killed one whose port refuses at once). Returns whether it was running.
    pub fn pause(&self, i: usize) -> bool {
        self.signal(i, libc::SIGSTOP)
    }

    /// Lets a [`pause`](Self::pause)d node run again.
    pub fn resume(&self, i: usize) -> bool {
        self.signal(i, libc::SIGCONT)
    }

    fn signal(&self, i: usize, sig: libc::c_int) -> bool {
        let Some(child) = self.nodes[i].child.as_ref() else {
            return false;
        };
        let Ok(pid) = libc::pid_t::try_from(child.id()) else {
            return false;
        };
        // SAFETY: kill(2) touches no memory of ours; `pid` is our child, not yet reaped (we
        // hold its `Child` and reap only in `kill`), so the pid cannot have been reused.
        unsafe { libc::kill(pid, sig) == 0 }
    }

    /// Waits until every running node reports `cluster_state:ok` and every running replica's
    /// link to its primary is up (after a [`resume`](Self::resume), say).
    pub fn wait_healthy(&self, limit: Duration) -> Result<(), RedisHarnessError> {
        self.wait_ready(limit)
    }

    /// Kills every node.
    pub fn stop_all(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        self.stop_all();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cluster_nodes() {
        let text = "\
07c37dfeb235213a872192d90877d0cd55635b91 127.0.0.1:30004@31004,host replica e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 0 1426238317239 4 connected
67ed2db8d677e59ec4a4cefb06858cf2a1a89fa1 127.0.0.1:30002@31002 master - 0 1426238316232 2 connected 5461-10922
e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 127.0.0.1:30001@31001 myself,master - 0 0 1 connected 0-5460 [5461->-67ed2db8d677e59ec4a4cefb06858cf2a1a89fa1]
292f8b365bb7edb5e285caf0b7e6ddc7265d2f4f 127.0.0.1:30003@31003 master,fail - 0 1426238318243 3 connected 10923 10924-16383
";
        let n = parse_nodes(text);
        assert_eq!(n.len(), 4);
        assert_eq!(n[0].port, 30004);
        assert!(n[0].slots.is_empty());
        assert_eq!(n[1].slots, vec![(5461, 10922)]);
        assert_eq!(n[2].flags, vec!["myself".to_string(), "master".to_string()]);
        assert_eq!(n[2].slots, vec![(0, 5460)]);
        assert_eq!(n[3].slots, vec![(10923, 10923), (10924, 16383)]);
        assert!(n[3].flags.iter().any(|f| f == "fail"));
        assert_eq!(field("a:1\r\ncluster_state:ok\r\n", "cluster_state"), Some("ok"));
        assert_eq!(field("cluster_state_x:1\n", "cluster_state"), None);
    }
}
