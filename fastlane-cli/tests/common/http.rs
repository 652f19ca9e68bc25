//! Helpers of the HTTP tests: start `fastlane llm serve` / `fastlane router` on a free port
//! and stop them, talk to them with curl (a real client), read a metric.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Any child process, killed (and reaped) on drop.
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A loopback port free at the time of the call.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A server process, killed on drop.
pub struct Server {
    pub child: Child,
    pub url: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Runs `fastlane ARGS` (which must listen on `127.0.0.1:0` and print its address) and
    /// waits for the address.
    pub fn start(args: &[&str]) -> Server {
        Server::start_logging(args, None, None)
    }

    /// As [`Server::start`], with `RUST_LOG` set to `rust_log` and stderr (the log) written
    /// to `log` when given.
    pub fn start_logging(args: &[&str], rust_log: Option<&str>, log: Option<&Path>) -> Server {
        let mut cmd = super::cli::command();
        cmd.args(args).stdout(Stdio::piped());
        match log {
            Some(p) => cmd.stderr(std::fs::File::create(p).expect("create the log file")),
            None => cmd.stderr(Stdio::null()),
        };
        if let Some(v) = rust_log {
            cmd.env("RUST_LOG", v);
        }
        let mut child = cmd.spawn().expect("start fastlane");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let url = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("the server prints its address, got {line:?}"))
            .to_string();
        Server { child, url }
    }

    /// `fastlane llm serve` on random:tiny with these tenants and extra flags.
    pub fn llm(tenants: &Path, extra: &[&str]) -> Server {
        let t = tenants.to_str().unwrap();
        let mut args = vec!["llm", "serve", "--listen", "127.0.0.1:0", "--tenants", t];
        args.extend_from_slice(extra);
        Server::start(&args)
    }

    /// host:port.
    pub fn addr(&self) -> &str {
        self.url.strip_prefix("http://").unwrap()
    }

    /// POST `body` to `path` with `key`: (status, headers + body).
    pub fn post(&self, path: &str, key: &str, body: &str) -> (u16, String) {
        let auth = format!("Authorization: Bearer {key}");
        curl(&[
            "-H",
            &auth,
            "-H",
            "Content-Type: application/json",
            "-d",
            body,
            &format!("{}{path}", self.url),
        ])
    }

    /// The value of the first metric line that starts with `name_and_labels`; panics, with the
    /// scrape, when there is none: a metric that is missing is a failure, never a 0.
    pub fn metric(&self, name_and_labels: &str) -> f64 {
        let (_, text) = curl(&[&format!("{}/metrics", self.url)]);
        metric_in(&text, name_and_labels)
            .unwrap_or_else(|| panic!("no {name_and_labels} in the scrape:\n{text}"))
    }

    /// Waits (at most `secs`) until the metric is there and satisfies `ok`; panics with `what`
    /// otherwise (saying whether it was absent or what it read).
    pub fn wait_metric(&self, name: &str, secs: u64, what: &str, ok: impl Fn(f64) -> bool) {
        let t0 = Instant::now();
        loop {
            let (_, text) = curl(&[&format!("{}/metrics", self.url)]);
            let v = metric_in(&text, name);
            if v.is_some_and(&ok) {
                return;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(secs),
                "{what}: {name} = {} after {secs} s",
                v.map_or("absent".to_string(), |v| v.to_string())
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Sends SIGTERM (kill(1): no unsafe code in the tests).
    pub fn sigterm(&self) {
        let st = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        assert!(st.unwrap().success());
    }

    /// Waits (at most `secs`) for the process to exit; its status.
    pub fn wait_exit(&mut self, secs: u64) -> std::process::ExitStatus {
        let t0 = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(t0.elapsed() < Duration::from_secs(secs), "no exit within {secs} s");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A raw streamed completion request of `max_tokens` tokens (`ignore_eos`), sent; the socket,
/// for reading the response (or for walking away from it).
pub fn open_stream(addr: &str, key: &str, max_tokens: u32) -> std::net::TcpStream {
    use std::io::Write;
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    let body = format!(
        r#"{{"prompt": "x", "max_tokens": {max_tokens}, "stream": true, "ignore_eos": true}}"#
    );
    write!(
        c,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    c
}

/// curl -s -i: (status, headers + body).
pub fn curl(args: &[&str]) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-s", "-i", "--max-time", "60"])
        .args(args)
        .output()
        .expect("curl runs (CI installs it)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let status = text.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, text)
}

/// The JSON body of a curl -i response.
pub fn json_body(text: &str) -> serde_json::Value {
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// Token ids of a response: the `token_ids` of a whole one, or of every SSE chunk.
pub fn token_ids(text: &str) -> Vec<u64> {
    let ids = |v: &serde_json::Value| -> Vec<u64> {
        v["choices"][0]["token_ids"]
            .as_array()
            .map(|a| a.iter().filter_map(|x| x.as_u64()).collect())
            .unwrap_or_default()
    };
    if text.contains("text/event-stream") {
        text.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
            .flat_map(|v| ids(&v))
            .collect()
    } else {
        ids(&json_body(text))
    }
}

/// Reads a raw HTTP/1.1 response to its end (at most 60 s): the head, then the body with
/// any chunked transfer encoding removed.
pub fn read_response(mut c: std::net::TcpStream) -> String {
    use std::io::Read;
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut v = Vec::new();
    let _ = c.read_to_end(&mut v);
    decode_response(&v)
}

/// A response's bytes as [`read_response`] returns them (a chunked body unchunked).
pub fn decode_response(v: &[u8]) -> String {
    let text = String::from_utf8_lossy(v).into_owned();
    let Some((head, mut body)) = text.split_once("\r\n\r\n") else { return text };
    if !head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        return text;
    }
    let mut out = format!("{head}\r\n\r\n");
    // Bounded by the body's length: each turn consumes one chunk.
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else { break };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].strip_prefix("\r\n").unwrap_or(&rest[n..]);
    }
    out
}

/// The value of the first sample line of `text` that starts with `name_and_labels`.
pub fn metric_in(text: &str, name_and_labels: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.starts_with(name_and_labels))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}
