//! The dashboard is code: a real Prometheus (Debian's `prometheus`, on loopback, started and
//! stopped here) scrapes a running `fastlane llm serve`, and every PromQL expression of
//! `deploy/grafana/fastlane-llm.json` must return data. A missing `prometheus` binary fails the
//! test (`.ci/install-deps.sh` installs it).

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::http::{curl, free_port, json_body, KillOnDrop, Server};

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
    assert!(
        Command::new("prometheus").arg("--version").output().is_ok(),
        "prometheus is not installed (run .ci/install-deps.sh)"
    );
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
    let server = Server::llm(&tenants, &["--device-blocks", "64"]);
    let url = server.url.clone();
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
    let _prom = KillOnDrop(prom);
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
            let (status, out) = curl(&["--data-urlencode", &format!("query={q}"), &api]);
            let v = if status == 200 { json_body(&out) } else { serde_json::Value::Null };
            !(v["status"] == "success"
                && v["data"]["result"].as_array().is_some_and(|r| !r.is_empty()))
        });
        if !missing.is_empty() {
            std::thread::sleep(Duration::from_millis(500));
        }
    }
    assert!(missing.is_empty(), "dashboard queries without data after a real scrape: {missing:#?}");
    // And the scrape saw the rejected requests by outcome.
    let (_, out) = curl(&[
        "--data-urlencode",
        "query=fastlane_llm_requests_total{outcome=\"rejected_rate\"}",
        &api,
    ]);
    assert!(out.contains("flood"), "{out}");
}
