//! A daemon of this build under test: `fastlane … --metrics 127.0.0.1:0` with its log
//! collected, scraped with curl, stopped with SIGTERM, killed on drop.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A daemon started with `--metrics 127.0.0.1:0`: its stderr is collected, the metrics
/// address read from its log line. SIGKILLed on drop if still running.
pub struct Daemon {
    pub child: Child,
    /// `http://HOST:PORT/metrics`.
    pub url: String,
    /// `HOST:PORT` of the metrics listener.
    pub addr: String,
    stderr: Arc<Mutex<String>>,
}

impl Daemon {
    /// Runs `fastlane ARGS --metrics 127.0.0.1:0` and waits (30 s at most) for its `metrics on`
    /// log line.
    pub fn start(args: &[&str]) -> Daemon {
        let mut child = super::cli::command()
            .args(args)
            .args(["--metrics", "127.0.0.1:0"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start fastlane");
        let stderr = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel();
        let (pipe, log) = (child.stderr.take().unwrap(), stderr.clone());
        // Drains stderr to its end (the daemon never blocks on a full pipe).
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                if let Some((_, url)) = line.split_once("metrics on ") {
                    let _ = tx.send(url.trim().to_string());
                }
                log.lock().unwrap().push_str(&line);
                log.lock().unwrap().push('\n');
            }
        });
        let url = rx.recv_timeout(Duration::from_secs(30)).unwrap_or_else(|_| {
            panic!("no `metrics on` line within 30 s:\n{}", stderr.lock().unwrap())
        });
        let addr = url.strip_prefix("http://").unwrap().strip_suffix("/metrics").unwrap().into();
        Daemon { child, url, addr, stderr }
    }

    /// One scrape: every sample line, `name{labels}` → value.
    pub fn scrape(&self) -> Scrape {
        let (status, text) = super::http::curl(&[&self.url]);
        assert_eq!(status, 200, "{text}");
        assert!(text.to_ascii_lowercase().contains("content-type: text/plain; version=0.0.4"));
        Scrape(text)
    }

    /// SIGTERM, then the exit (30 s at most), which must be a success; the whole log.
    pub fn sigterm_and_wait(mut self) -> String {
        let st = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        assert!(st.unwrap().success());
        let t0 = Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "no exit within 30 s");
            std::thread::sleep(Duration::from_millis(50));
        };
        // The reader thread has the rest once the pipe closes.
        std::thread::sleep(Duration::from_millis(100));
        let log = self.stderr.lock().unwrap().clone();
        assert!(status.success(), "{status:?}\n{log}");
        log
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One scrape's text.
pub struct Scrape(pub String);

impl Scrape {
    /// The value of the sample named exactly `name_and_labels`; panics if absent.
    pub fn get(&self, name_and_labels: &str) -> u64 {
        let v = self
            .0
            .lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| l.strip_prefix(name_and_labels)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {name_and_labels} in the scrape:\n{}", self.0));
        v.parse().unwrap_or_else(|e| panic!("{name_and_labels} {v:?}: {e}"))
    }
}

/// A `NOTIFY_SOCKET` of the test's own: the datagrams a daemon sends systemd.
pub struct Notify {
    sock: UnixDatagram,
}

impl Notify {
    /// Binds the socket at `path` (give the daemon `NOTIFY_SOCKET=path`); reads wait 60 s at most.
    pub fn bind(path: &Path) -> Notify {
        let sock = UnixDatagram::bind(path).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        Notify { sock }
    }

    /// The next datagram, as text; fails after 60 s without one.
    pub fn next(&self) -> String {
        self.recv().expect("a notification within 60 s")
    }

    /// The next datagram, as text, or the error (a timeout after 60 s) for a caller that
    /// reports it instead of failing at once.
    pub fn recv(&self) -> std::io::Result<String> {
        let mut buf = [0u8; 4096];
        let n = self.sock.recv(&mut buf)?;
        Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
    }

    /// The next datagram that contains `want` (others, e.g. a STATUS= alone, are skipped);
    /// fails, naming `what`, after 60 s without one.
    pub fn expect(&self, want: &str, what: &str) -> String {
        let t0 = Instant::now();
        loop {
            let mut buf = [0u8; 4096];
            let n = self
                .sock
                .recv(&mut buf)
                .unwrap_or_else(|e| panic!("{what}: no {want} on NOTIFY_SOCKET: {e}"));
            let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
            if msg.contains(want) {
                return msg;
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "{what}: no {want}, last {msg:?}");
        }
    }
}
