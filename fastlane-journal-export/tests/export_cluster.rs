//! The exporter against a real three-node JetStream cluster on loopback (nats-server from
//! .ci/install-deps.sh): every record arrives exactly once and in order, through a crash of
//! the exporter, the loss of one node and the loss of all of them.

mod common;

use std::time::{Duration, Instant};

use common::*;
use fastlane_journal_export::{Exporter, MemorySource, RecordSource};

const STREAM: &str = fastlane_journal_export::DEFAULT_STREAM;

#[test]
fn fifty_thousand_records_arrive_once_in_order() {
    let _one = one_at_a_time();
    let cluster = NatsCluster::start(3);
    let n = 50_000;
    let src = MemorySource::new();
    fill(&src, n / 2);
    let exporter = Exporter::start(config(&cluster), Box::new(src.clone())).unwrap();
    // The second half becomes durable while the first is being exported.
    fill(&src, n);
    wait_exported(&exporter, n, Duration::from_secs(120));
    let stats = exporter.stop();
    assert_eq!(stats.lag_records, 0, "{stats:?}");
    assert_eq!(stats.published_total, n, "{stats:?}");
    assert_exactly_once(&read_stream(&cluster, STREAM, Duration::from_secs(60)), n);
}

#[test]
fn a_new_exporter_resumes_after_an_abort_without_duplicates() {
    let _one = one_at_a_time();
    let cluster = NatsCluster::start(3);
    let n = 30_000;
    let src = MemorySource::new();
    fill(&src, n);
    let first = Exporter::start(config(&cluster), Box::new(src.clone())).unwrap();
    wait_exported(&first, 5_000, Duration::from_secs(60));
    // Publishes in flight are abandoned, as in a crash.
    let at_abort = first.abort();
    assert!(at_abort.exported_seq < n, "the abort came too late to test anything: {at_abort:?}");
    let second = Exporter::start(config(&cluster), Box::new(src.clone())).unwrap();
    wait_exported(&second, n, Duration::from_secs(120));
    let stats = second.stop();
    assert!(stats.published_total <= n - at_abort.exported_seq, "{stats:?}");
    assert_exactly_once(&read_stream(&cluster, STREAM, Duration::from_secs(60)), n);
}

/// Environment of the child process of `sigkilled_exporter_process_is_resumed`.
const CHILD_URLS: &str = "FASTLANE_EXPORT_TEST_CHILD_URLS";
const CHILD_RECORDS: &str = "FASTLANE_EXPORT_TEST_CHILD_RECORDS";
/// Bound on the child's life should its parent never kill it.
const CHILD_LIFE_MAX: Duration = Duration::from_secs(120);

/// The exporter process that `sigkilled_exporter_process_is_resumed` kills: runs only when
/// started by that test (with its environment).
#[test]
#[ignore = "the child process of sigkilled_exporter_process_is_resumed"]
fn child_exporter_process() {
    let (Ok(urls), Ok(n)) = (std::env::var(CHILD_URLS), std::env::var(CHILD_RECORDS)) else {
        return;
    };
    let n: u64 = n.parse().unwrap();
    let src = MemorySource::new();
    let mut cfg = fastlane_journal_export::ExportConfig::from_urls(&urls).unwrap();
    cfg.ack_timeout = Duration::from_secs(2);
    let exporter = Exporter::start(cfg, Box::new(src.clone())).unwrap();
    // About 10,000 records/s, so that the parent's kill lands mid-export.
    let end = Instant::now() + CHILD_LIFE_MAX;
    let mut last = 0;
    while Instant::now() < end {
        last = (last + 1_000).min(n);
        fill(&src, last);
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(exporter);
}

#[test]
fn sigkilled_exporter_process_is_resumed() {
    let _one = one_at_a_time();
    let cluster = NatsCluster::start(3);
    let n = 40_000;
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_exporter_process", "--ignored", "--nocapture"])
        .env(CHILD_URLS, cluster.url_list())
        .env(CHILD_RECORDS, n.to_string())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Kill it once part of the records are in the stream.
    let rt = runtime();
    let end = Instant::now() + Duration::from_secs(60);
    let urls = cluster.urls();
    let in_stream_at_kill = rt.block_on(async {
        let js = async_nats::jetstream::new(async_nats::connect(urls.as_slice()).await.unwrap());
        loop {
            assert!(Instant::now() < end, "the child exported nothing in 60 s");
            // Short waits: before the cluster has a meta leader, requests go unanswered.
            let short = Duration::from_millis(500);
            if let Ok(Ok(mut s)) = tokio::time::timeout(short, js.get_stream(STREAM)).await {
                if let Ok(Ok(info)) = tokio::time::timeout(short, s.info()).await {
                    if info.state.messages >= 5_000 {
                        return info.state.messages;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    // SAFETY: kill(2) on our own child's pid, which is not reaped yet (wait() below).
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGKILL) };
    assert_eq!(rc, 0);
    child.wait().unwrap();
    assert!(in_stream_at_kill < n, "the kill came too late to test anything: {in_stream_at_kill}");

    let src = MemorySource::new();
    fill(&src, n);
    let exporter = Exporter::start(config(&cluster), Box::new(src)).unwrap();
    wait_exported(&exporter, n, Duration::from_secs(120));
    exporter.stop();
    assert_exactly_once(&read_stream(&cluster, STREAM, Duration::from_secs(60)), n);
}

#[test]
fn export_goes_on_with_one_node_killed() {
    let _one = one_at_a_time();
    let mut cluster = NatsCluster::start(3);
    let n = 30_000;
    let src = MemorySource::new();
    fill(&src, n / 3);
    let exporter = Exporter::start(config(&cluster), Box::new(src.clone())).unwrap();
    wait_exported(&exporter, 2_000, Duration::from_secs(60));
    // The stream's leader: the hardest node to lose (an election, publishes lost in flight).
    let leader = stream_leader(&cluster, STREAM, Duration::from_secs(10));
    cluster.kill(leader);
    let at_kill = exporter.stats();
    fill(&src, n);
    let stats = wait_exported(&exporter, n, Duration::from_secs(120));
    assert!(stats.connected, "{stats:?}");
    eprintln!("killed node {leader} at {at_kill:?}; done at {stats:?}");
    exporter.stop();
    // The node comes back; the reader's consumer may be placed on it.
    cluster.restart(leader);
    cluster.wait_ready(leader);
    assert_exactly_once(&read_stream(&cluster, STREAM, Duration::from_secs(60)), n);
}

#[test]
fn all_nodes_down_then_back_catches_up() {
    let _one = one_at_a_time();
    let mut cluster = NatsCluster::start(3);
    let src = MemorySource::new();
    fill(&src, 5_000);
    let exporter = Exporter::start(config(&cluster), Box::new(src.clone())).unwrap();
    wait_exported(&exporter, 5_000, Duration::from_secs(60));
    for i in 0..cluster.len() {
        cluster.kill(i);
    }
    // The journal goes on: records become durable while the cluster is gone.
    let down_from = Instant::now();
    let mut last = 5_000;
    while down_from.elapsed() < Duration::from_secs(3) {
        last += 500;
        fill(&src, last);
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(200));
    let down = exporter.stats();
    assert!(!down.connected, "{down:?}");
    assert_eq!(down.durable_seq, src.durable_seq(), "durable_seq keeps being read: {down:?}");
    assert!(down.lag_records >= last - 5_000 - 500, "lag grows: {down:?}");
    assert!(down.exported_seq <= 5_000 + 1_000, "{down:?}");

    for i in 0..cluster.len() {
        cluster.restart(i);
    }
    for i in 0..cluster.len() {
        cluster.wait_ready(i);
    }
    let up = wait_exported(&exporter, last, Duration::from_secs(120));
    assert!(up.reconnects_total >= 1, "{up:?}");
    let stats = exporter.stop();
    assert_eq!(stats.lag_records, 0, "{stats:?}");
    assert_exactly_once(&read_stream(&cluster, STREAM, Duration::from_secs(60)), last);
}
