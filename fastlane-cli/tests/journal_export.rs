//! `fastlane journal serve --export`: producer processes append, the service ships every
//! durable record to a three-node NATS JetStream cluster on loopback (Debian's nats-server);
//! the service is SIGKILLed during the export and restarted, then stopped with SIGTERM; the
//! stream holds every journal seq exactly once, in order, with the journal's bytes.

mod common;
#[path = "../../fastlane-journal-export/tests/common/mod.rs"]
mod nats;

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::http::KillOnDrop;

fn serve(dir: &Path, urls: &str, log: &Path) -> KillOnDrop {
    serve_with(dir, urls, log, &[], &[])
}

/// [`serve`] with more flags and environment variables.
fn serve_with(
    dir: &Path,
    urls: &str,
    log: &Path,
    more: &[std::ffi::OsString],
    env: &[(&str, &str)],
) -> KillOnDrop {
    let child = common::cli::command()
        .args(["journal", "serve", "--dir"])
        .arg(dir)
        .args(["--segment-bytes", "4M", "--status-every", "1", "--export", urls])
        .args(more)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .expect("start fastlane journal serve");
    let t0 = Instant::now();
    while !std::fs::read_to_string(log).unwrap_or_default().contains("producers attach at") {
        assert!(t0.elapsed() < Duration::from_secs(20), "not ready: {}", read(log));
        std::thread::sleep(Duration::from_millis(10));
    }
    KillOnDrop(child)
}

/// Waits until the last status line of `log` says the export has everything durable.
fn wait_caught_up(log: &Path, within: Duration) {
    let t0 = Instant::now();
    loop {
        let text = read(log);
        let caught_up = text.lines().rev().find(|l| l.contains("exported")).is_some_and(|l| {
            let num = |key: &str| -> Option<u64> {
                l.split(key).nth(1)?.split_whitespace().next()?.parse().ok()
            };
            num("durable seq ").is_some() && num("durable seq ") == num("exported ")
        });
        if caught_up {
            return;
        }
        assert!(t0.elapsed() < within, "export did not catch up: {text}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// SIGTERMs the service and waits (bounded) for its successful exit.
fn stop(svc: &mut KillOnDrop, log: &Path) {
    let st = Command::new("kill").args(["-TERM", &svc.0.id().to_string()]).status();
    assert!(st.unwrap().success());
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = svc.0.try_wait().unwrap() {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "no exit: {}", read(log));
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{}", read(log));
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

fn producer(dir: &Path, n: u64) -> Child {
    common::cli::command()
        .args(["journal", "append", "--service"])
        .arg(dir)
        .args(["--generate", &n.to_string(), "--record-bytes", "80", "--ack-every", "500"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Waits until the producer printed `acks` ACK lines (or exited).
fn wait_acks(p: &mut Child, acks: usize) {
    let out = p.stdout.take().unwrap();
    let mut seen = 0;
    for line in BufReader::new(out).lines().map_while(Result::ok) {
        if line.starts_with("ACK ") {
            seen += 1;
            if seen >= acks {
                return;
            }
        }
    }
}

/// The exported seq in a status line ("… exported N (lag L)").
fn exported(line: &str) -> Option<u64> {
    line.split("exported ").nth(1)?.split_whitespace().next()?.parse().ok()
}

/// The journal's records (`dump --raw`): seq → payload.
fn journal(dir: &Path) -> BTreeMap<u64, Vec<u8>> {
    let out = common::cli::command().args(["journal", "dump", "--raw"]).arg(dir).output().unwrap();
    assert!(out.status.success(), "dump: {}", String::from_utf8_lossy(&out.stderr));
    let b = out.stdout;
    let (mut at, mut recs) = (0, BTreeMap::new());
    while at < b.len() {
        let seq = u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
        let len = u32::from_le_bytes(b[at + 12..at + 16].try_into().unwrap()) as usize;
        recs.insert(seq, b[at + 16..at + 16 + len].to_vec());
        at += 16 + len;
    }
    recs
}

#[test]
fn every_durable_record_reaches_the_stream_exactly_once_across_a_sigkill() {
    let _one = nats::one_at_a_time();
    let cluster = nats::NatsCluster::start(3);
    let urls = cluster.url_list();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("j");
    let log1 = tmp.path().join("serve1.log");
    let mut svc = serve(&dir, &urls, &log1);
    let mut a = producer(&dir, 60_000);
    let b = producer(&dir, 60_000);
    wait_acks(&mut a, 6);
    // Killed while records arrive and the export runs (once it has shipped some).
    let t0 = Instant::now();
    while !read(&log1).lines().any(|l| exported(l).is_some_and(|e| e > 0)) {
        assert!(t0.elapsed() < Duration::from_secs(60), "export never started: {}", read(&log1));
        std::thread::sleep(Duration::from_millis(50));
    }
    svc.0.kill().unwrap();
    svc.0.wait().unwrap();
    let _ = a.wait();
    let mut b = b;
    let _ = b.wait();
    drop(svc);

    let log2 = tmp.path().join("serve2.log");
    let mut svc = serve(&dir, &urls, &log2);
    let mut c = producer(&dir, 3000);
    assert!(c.wait().unwrap().success(), "producer after restart: {}", read(&log2));
    // The export catches up (the status line every second says how far it is).
    wait_caught_up(&log2, Duration::from_secs(60));
    // SIGTERM: the service drains, the export ships what is durable, then it exits.
    stop(&mut svc, &log2);
    let log = read(&log2);
    assert!(log.contains("export stopped"), "{log}");

    let v = common::cli::command().args(["journal", "verify"]).arg(&dir).output().unwrap();
    let v = String::from_utf8_lossy(&v.stdout).into_owned();
    assert!(v.contains("OK"), "verify: {v}");
    let recs = journal(&dir);
    let last = *recs.keys().last().unwrap();
    assert_eq!(recs.len() as u64, last, "the journal has a gap");
    assert!(v.contains(&format!("records {last} ")), "dump and verify disagree: {v}");
    let stored = nats::read_stream(&cluster, "FASTLANE_JOURNAL", Duration::from_secs(60));
    assert_eq!(stored.len() as u64, last, "stream holds {} of {last} records", stored.len());
    for (i, m) in stored.iter().enumerate() {
        let seq = i as u64 + 1;
        assert_eq!(m.journal_seq, seq, "stream message {i} holds journal seq {}", m.journal_seq);
        assert_eq!(m.payload, recs[&seq], "payload of seq {seq}");
    }
}

#[test]
fn the_export_speaks_tls_with_a_password_and_a_refused_login_stops_only_the_export() {
    use std::os::unix::fs::PermissionsExt;
    let _one = nats::one_at_a_time();
    let cluster = nats::NatsCluster::start_secured(3);
    let urls = cluster.url_list();
    assert!(urls.starts_with("tls://"), "{urls}");
    let tls = cluster.tls_dir();
    let tmp = tempfile::tempdir().unwrap();
    let secret = |name: &str, text: &str| {
        let p = tmp.path().join(name);
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        p
    };
    let good = secret("good", &format!("{}\n", nats::SECURED_PASSWORD));
    let secured = |pw: &Path| -> Vec<std::ffi::OsString> {
        let mut v = Vec::new();
        for (flag, file) in [
            ("--export-ca", tls.join("ca.crt")),
            ("--export-cert", tls.join("node.crt")),
            ("--export-key", tls.join("node.key")),
            ("--export-password-file", pw.to_path_buf()),
        ] {
            v.extend([flag.into(), file.into_os_string()]);
        }
        v
    };
    let user = [("FASTLANE_NATS_USER", nats::SECURED_USER)];

    // With the CA, the client certificate and the password: every record, once, in order.
    let dir = tmp.path().join("j");
    let log = tmp.path().join("serve.log");
    let mut svc = serve_with(&dir, &urls, &log, &secured(&good), &user);
    assert!(read(&log).contains("TLS required, user fastlane"), "{}", read(&log));
    assert!(!read(&log).contains(nats::SECURED_PASSWORD), "the log shows the password");
    let mut p = producer(&dir, 3000);
    assert!(p.wait().unwrap().success(), "producer: {}", read(&log));
    wait_caught_up(&log, Duration::from_secs(60));
    stop(&mut svc, &log);
    let recs = journal(&dir);
    assert_eq!(recs.len(), 3000);
    let stored = nats::read_stream(&cluster, "FASTLANE_JOURNAL", Duration::from_secs(60));
    assert_eq!(stored.len(), 3000, "stream holds {} of 3000 records", stored.len());
    for (i, m) in stored.iter().enumerate() {
        let seq = i as u64 + 1;
        assert_eq!(m.journal_seq, seq, "stream message {i} holds journal seq {}", m.journal_seq);
        assert_eq!(m.payload, recs[&seq], "payload of seq {seq}");
    }

    // A wrong password: the cluster refuses the export, the journal goes on taking records,
    // and the status line shows the lag.
    let bad = secret("bad", "not-the-password\n");
    let dir2 = tmp.path().join("j2");
    let log2 = tmp.path().join("serve2.log");
    let mut svc = serve_with(&dir2, &urls, &log2, &secured(&bad), &user);
    let mut p = producer(&dir2, 500);
    assert!(p.wait().unwrap().success(), "producer beside a refused export: {}", read(&log2));
    let t0 = Instant::now();
    loop {
        let text = read(&log2);
        let refused = text.to_lowercase().contains("authorization");
        let lagging = text.lines().any(|l| l.contains("exported 0 (lag 500, disconnected)"));
        if refused && lagging {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "no refusal and lag in the log: {text}");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(!read(&log2).contains("not-the-password"), "the log shows the password");
    drop(svc.0.kill());
    let _ = svc.0.wait();

    // Without the CA the nodes' certificates are not trusted (the system's roots do not
    // know the test CA): refused as well, before any credential is sent.
    let dir3 = tmp.path().join("j3");
    let log3 = tmp.path().join("serve3.log");
    let pw = ["--export-password-file".into(), good.clone().into_os_string()];
    let _svc = serve_with(&dir3, &urls, &log3, &pw, &user);
    let t0 = Instant::now();
    while !read(&log3).to_lowercase().contains("certificate") {
        assert!(t0.elapsed() < Duration::from_secs(30), "no TLS refusal: {}", read(&log3));
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn export_credentials_and_tls_files_are_checked_before_the_service_opens() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let dir = tmp.path().join("never");
        let mut c = common::cli::command();
        c.args(["journal", "serve", "--dir"]).arg(&dir).args(args);
        c.env_remove("FASTLANE_NATS_USER").env_remove("FASTLANE_NATS_PASSWORD");
        let out = c.envs(env.iter().copied()).output().unwrap();
        assert!(!out.status.success(), "{args:?} started");
        assert!(!dir.exists(), "{args:?}: the journal was created before the check");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let open = tmp.path().join("open");
    std::fs::write(&open, "s3cret\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o644)).unwrap();
    let url = "tls://127.0.0.1:9";
    let e = run(
        &["--export", url, "--export-password-file", open.to_str().unwrap()],
        &[("FASTLANE_NATS_USER", "u")],
    );
    assert!(e.contains("--export-password-file") && e.contains("readable by its group"), "{e}");
    assert!(!e.contains("s3cret"), "{e}");
    let e = run(&["--export", url], &[("FASTLANE_NATS_USER", "u")]);
    assert!(e.contains("no password"), "{e}");
    let e = run(&["--export", url, "--export-ca", open.to_str().unwrap()], &[]);
    assert!(e.contains("--export-ca") && e.contains("no PEM CERTIFICATE"), "{e}");
    let e = run(&["--export", url, "--export-cert", open.to_str().unwrap()], &[]);
    assert!(e.contains("--export-key"), "{e}");
    let e = run(&["--export", "nats://u:p@127.0.0.1:9"], &[]);
    assert!(e.contains("credentials"), "{e}");
}
