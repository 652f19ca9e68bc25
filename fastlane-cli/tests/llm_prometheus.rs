//! The dashboard is code: a real Prometheus (Debian's `prometheus`, on loopback, started and
//! stopped here) scrapes a running `fastlane llm serve`, and every PromQL expression of
//! `deploy/grafana/fastlane-llm.json` must return data. Skips, with a message, only when the
//! `prometheus` binary is missing (`.ci/install-deps.sh` installs it).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn curl(args: &[&str]) -> String {
    let out = Command::new("curl")
        .args(["-s", "--max-time", "30"])
        .args(args)
        .output()
        .expect("curl runs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn exprs(dashboard: &serde_json::Value) -> Vec<String> {
    let mut out = Vec::new();
    for p in dashboard["panels"].as_array().expect("panels") {
        for t in p["targets"].as_array().expect("targets") {
            out.push(t["expr"].as_str().expect("expr").to_string());
        }
    }
    out
}

#[test]
fn every_dashboard_query_returns_data_from_a_real_scrape() {
    if Command::new("prometheus").arg("--version").output().is_err() {
        eprintln!("SKIPPED: prometheus is not installed (run .ci/install-deps.sh)");
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("deploy/grafana/fastlane-llm.json")).unwrap(),
    )
    .unwrap();
    let queries = exprs(&dashboard);
    assert!(queries.len() >= 8, "the dashboard has its panels: {queries:?}");

    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let tenants = dir.path().join("tenants.toml");
    std::fs::write(
        &tenants,
        "[[tenant]]\nname = \"quiet\"\nkeys = [\"kq\"]\nrpm = 6000\nburst = 100\nmax_concurrent = 4\ntier = \"interactive\"\n\n\
         [[tenant]]\nname = \"flood\"\nkeys = [\"kf\"]\nrpm = 1\nburst = 1\nmax_concurrent = 1\ntier = \"batch\"\nqueue = 0\n",
    )
    .unwrap();
    let mut server = Command::new(env!("CARGO_BIN_EXE_fastlane"))
        .args(["llm", "serve", "--listen", "127.0.0.1:0", "--device-blocks", "64", "--tenants"])
        .arg(&tenants)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(server.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let _server = Kill(server);
    let url = line.trim().strip_prefix("listening on ").unwrap().to_string();
    let target = url.strip_prefix("http://").unwrap().to_string();

    let prom_port = free_port();
    let config = dir.path().join("prometheus.yml");
    // The repository's scrape config with the test's target and a 1 s interval.
    let shipped = std::fs::read_to_string(root.join("deploy/prometheus.yml")).unwrap();
    assert!(shipped.contains("127.0.0.1:8000"));
    let cfg = shipped
        .replace("127.0.0.1:8000", &target)
        .replace("scrape_interval: 5s", "scrape_interval: 1s");
    std::fs::write(&config, cfg).unwrap();
    let prom = Command::new("prometheus")
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", dir.path().join("tsdb").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start prometheus");
    let _prom = Kill(prom);
    let api = format!("http://127.0.0.1:{prom_port}/api/v1/query");

    // Traffic while Prometheus scrapes: both tenants, a 429, streams.
    let t0 = Instant::now();
    let mut sent = 0;
    while t0.elapsed() < Duration::from_secs(6) {
        for (key, stream) in [("kq", true), ("kq", false), ("kf", false)] {
            let body =
                format!(r#"{{"prompt": "hello {sent}", "max_tokens": 8, "stream": {stream}}}"#);
            curl(&[
                "-H",
                &format!("Authorization: Bearer {key}"),
                "-d",
                &body,
                &format!("{url}/v1/completions"),
            ]);
            sent += 1;
        }
    }
    // Every query must return at least one series (bounded wait for scrapes to land).
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut missing: Vec<String> = queries.clone();
    while !missing.is_empty() && Instant::now() < deadline {
        missing.retain(|q| {
            let out = curl(&["--data-urlencode", &format!("query={q}"), &api]);
            let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
            !(v["status"] == "success"
                && v["data"]["result"].as_array().is_some_and(|r| !r.is_empty()))
        });
        if !missing.is_empty() {
            std::thread::sleep(Duration::from_millis(500));
        }
    }
    assert!(missing.is_empty(), "dashboard queries without data after a real scrape: {missing:#?}");
    // And the scrape saw the rejected requests by outcome.
    let out = curl(&[
        "--data-urlencode",
        "query=fastlane_llm_requests_total{outcome=\"rejected_rate\"}",
        &api,
    ]);
    assert!(out.contains("flood"), "{out}");
}
