//! A C program (tests/c/producer.c) attaches to a journal service running in this process and
//! appends through libfastlane_journal, beside a Rust producer; the directory is then read
//! back and verified.
//!
//! How the library is found: this crate has no rlib (see its Cargo.toml), and cargo builds the
//! cdylib and staticlib of a package only when asked to build that package itself, not for
//! its integration tests. So the test runs `$CARGO build -p fastlane-journal-c` once (with
//! the test binary's own target directory and profile, found from its path
//! `<target>/<profile>/deps/c_producer-<hash>`): cargo's fingerprints make it a no-op when the
//! library is current and a rebuild of this crate alone when not, and cargo has released its
//! build lock by the time tests run. The C program is then compiled with the system `cc`
//! against `<target>/<profile>/libfastlane_journal.so` (`-L`, `-rpath`) or, in one test,
//! against `libfastlane_journal.a`.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use journal::service::{Service, ServiceConfig};
use journal::{read_from, verify_dir, Anchor, JournalError, JournalProducer};

const T: Duration = Duration::from_secs(30);

/// The crate's directory.
fn crate_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `<target>/<profile>`, from this test binary's path `<target>/<profile>/deps/<name>`.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let deps = exe.parent().expect("the test binary lives in <target>/<profile>/deps");
    deps.parent().expect("<target>/<profile>").to_path_buf()
}

/// Builds libfastlane_journal.{so,a} for this profile (a no-op when they are current) and
/// returns the directory that holds them.
fn library_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let profile_dir = profile_dir();
        let target_dir = profile_dir.parent().expect("<target>");
        let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") => "dev".to_string(),
            Some(other) => other.to_string(),
            None => panic!("no profile directory in {}", profile_dir.display()),
        };
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let out = Command::new(&cargo)
            .args(["build", "--offline", "-p", "fastlane-journal-c", "--profile", &profile])
            .arg("--target-dir")
            .arg(target_dir)
            .arg("--manifest-path")
            .arg(crate_dir().join("Cargo.toml"))
            .output()
            .unwrap_or_else(|e| panic!("cannot run {cargo:?}: {e}"));
        assert!(
            out.status.success(),
            "building the C library failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        for lib in ["libfastlane_journal.so", "libfastlane_journal.a"] {
            let path = profile_dir.join(lib);
            assert!(path.is_file(), "cargo built no {}", path.display());
        }
        profile_dir
    })
}

/// The C compiler: `$CC`, else `cc`.
fn cc() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".to_string())
}

/// Runs a compiler; fails loudly when it is missing or the compile fails.
fn compile(mut cmd: Command, what: &str) {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let out = cmd.output().unwrap_or_else(|e| {
        panic!(
            "cannot run the C compiler `{program}` ({e}). The C test needs one: \
             .ci/install-deps.sh installs gcc (set CC to use another)"
        )
    });
    assert!(
        out.status.success(),
        "{what} failed ({program}):\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// How the C program links the library.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Link {
    /// `-lfastlane_journal` against the .so, found at run time through `-rpath`.
    Shared,
    /// libfastlane_journal.a and the system libraries Rust's std needs.
    Static,
}

/// Compiles tests/c/producer.c (once per test binary and link kind).
fn c_producer(link: Link) -> PathBuf {
    static SHARED: OnceLock<PathBuf> = OnceLock::new();
    static STATIC: OnceLock<PathBuf> = OnceLock::new();
    let cell = match link {
        Link::Shared => &SHARED,
        Link::Static => &STATIC,
    };
    cell.get_or_init(|| {
        let lib = library_dir();
        // Compiled under a name of this process, then renamed over the fixed name: a test
        // binary running at the same time keeps the program it started.
        let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
        let exe = tmp.join(format!("c_producer-{link:?}").to_lowercase());
        let building = tmp.join(format!("c_producer-{link:?}.{}", std::process::id()));
        let mut cmd = Command::new(cc());
        cmd.args(["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-o"])
            .arg(&building)
            .arg("-I")
            .arg(crate_dir().join("include"))
            .arg(crate_dir().join("tests/c/producer.c"));
        match link {
            Link::Shared => {
                cmd.arg("-L").arg(lib).arg("-lfastlane_journal");
                cmd.arg(format!("-Wl,-rpath,{}", lib.display()));
            }
            Link::Static => {
                // What `rustc --print native-static-libs` lists for std on linux-gnu.
                cmd.arg(lib.join("libfastlane_journal.a"));
                cmd.args(["-lgcc_s", "-lutil", "-lrt", "-lpthread", "-lm", "-ldl", "-lc"]);
            }
        }
        compile(cmd, "compiling tests/c/producer.c");
        std::fs::rename(&building, &exe).unwrap_or_else(|e| panic!("rename to {exe:?}: {e}"));
        exe
    })
    .clone()
}

fn config(dir: &Path) -> ServiceConfig {
    let mut c = ServiceConfig::new(dir);
    c.segment_bytes = 8 << 20;
    c.max_batch_bytes = 256 << 10;
    c.ring_bytes = 1 << 20;
    c
}

/// Waits for a child with a deadline; kills it past the deadline.
fn wait_output(mut child: Child, what: &str) -> (bool, String, String) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if child.try_wait().expect("wait for the C program").is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("reap the killed C program");
            panic!("{what} ran past 120 s; stderr:\n{}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let out = child.wait_with_output().expect("the C program's output");
    let text = |b: Vec<u8>| String::from_utf8_lossy(&b).into_owned();
    (out.status.success(), text(out.stdout), text(out.stderr))
}

/// `key=value` fields of the line of `out` that starts with `prefix`.
fn fields(out: &str, prefix: &str) -> BTreeMap<String, String> {
    let line = out
        .lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line starting {prefix:?} in:\n{out}"));
    line.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Every record of the directory: global seq -> (producer id, payload).
fn records(dir: &Path) -> BTreeMap<u64, (u32, Vec<u8>)> {
    let mut out = BTreeMap::new();
    read_from(dir, 1, &mut |h, p| {
        out.insert(h.seq, (h.flags, p.to_vec()));
        true
    })
    .expect("read the directory back");
    out
}

/// Runs the C producer (`n` records) and checks what the directory holds afterwards.
fn c_beside_rust(link: Link, n: u64) {
    let exe = c_producer(link);
    let d = tempfile::tempdir().unwrap();
    let svc = Service::start(config(d.path())).unwrap();

    // The Rust producer appends from before the C program starts until it has ended (and at
    // least `n` records), so that the two rings are drained side by side.
    let c_done = Arc::new(AtomicBool::new(false));
    let (started_tx, started) = std::sync::mpsc::channel();
    let rust = {
        let (dir, c_done) = (d.path().to_path_buf(), Arc::clone(&c_done));
        std::thread::spawn(move || {
            let mut tx = JournalProducer::connect(&dir, "rust-producer").unwrap();
            let mut last = 0;
            while last < n || (!c_done.load(Ordering::Acquire) && last < 2_000_000) {
                let i = last + 1;
                last = tx.append_blocking(format!("rust {i}").as_bytes(), T).unwrap();
                assert_eq!(last, i);
                if i == 1 {
                    let _ = started_tx.send(());
                }
            }
            tx.wait_durable(last, T).unwrap();
            (tx.producer_id().unwrap(), last)
        })
    };
    started.recv_timeout(T).expect("the Rust producer appended nothing");
    let child = Command::new(&exe)
        .args(["run".as_ref(), d.path().as_os_str(), n.to_string().as_ref()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", exe.display()));
    let c_pid = child.id();
    let (ok, out, err) = wait_output(child, "the C producer");
    c_done.store(true, Ordering::Release);
    let (rust_id, rust_n) = rust.join().unwrap();
    assert!(ok, "the C producer failed:\n{out}\n{err}");
    let f = fields(&out, "ok ");
    let c_id: u32 = f["id"].parse().unwrap();
    assert_eq!(f["last"], n.to_string(), "the C producer's last seq");
    assert_eq!(f["durable"], n.to_string(), "the C producer's durable seq");
    assert_ne!(c_id, rust_id);

    let stats = svc.stop().unwrap();
    let c_info = stats.producers.iter().find(|p| p.id == c_id).expect("the C producer listed");
    assert_eq!((c_info.name.as_str(), c_info.records), ("c-producer", n));
    assert_eq!(c_info.cred.pid as u32, c_pid, "the service saw the C process attach");

    let total = n + rust_n;
    let v = verify_dir(d.path(), Anchor::default()).unwrap();
    assert!(v.problem.is_none(), "{:?}", v.problem);
    assert_eq!((v.records, v.last_seq), (total, total));

    let recs = records(d.path());
    assert_eq!(recs.len() as u64, total);
    let of = |id: u32| -> Vec<Vec<u8>> {
        recs.values().filter(|(p, _)| *p == id).map(|(_, b)| b.clone()).collect()
    };
    let want_c: Vec<Vec<u8>> = (1..=n).map(|i| format!("c {i}").into_bytes()).collect();
    assert!(of(c_id) == want_c, "the C producer's records are missing, changed or out of order");
    let want_rust: Vec<Vec<u8>> = (1..=rust_n).map(|i| format!("rust {i}").into_bytes()).collect();
    assert!(of(rust_id) == want_rust, "the Rust producer's records differ");
    // Both rings were drained in the same stretch: a Rust record lies between the C
    // producer's first and last (the C program waits for durability 20 times on its way, the
    // Rust producer appends throughout).
    let c_seqs: Vec<u64> = recs.iter().filter(|(_, (p, _))| *p == c_id).map(|(s, _)| *s).collect();
    let (first, last) = (c_seqs[0], c_seqs[c_seqs.len() - 1]);
    assert!(
        recs.range(first..=last).any(|(_, (p, _))| *p == rust_id),
        "no Rust record between the C producer's first ({first}) and last ({last})"
    );
}

/// The C producer linked against libfastlane_journal.so appends 20 000 records while a Rust
/// producer appends its own: all of them are in the directory, each under its producer's id,
/// in its order, byte for byte, and the chain verifies.
#[test]
fn c_producer_beside_rust_producer() {
    c_beside_rust(Link::Shared, 20_000);
}

/// The same against the static library (libfastlane_journal.a plus the C library's own
/// system libraries), fewer records.
#[test]
fn c_producer_linked_statically() {
    c_beside_rust(Link::Static, 2_000);
}

/// The error paths seen from C: NULL pointers, no service, a bad name and ring size, a record
/// over the limit, a timeout, then the service stopped under an attached producer.
#[test]
fn c_error_paths() {
    let exe = c_producer(Link::Shared);
    let d = tempfile::tempdir().unwrap();
    let nosvc = tempfile::tempdir().unwrap();
    let svc = Service::start(config(d.path())).unwrap();
    let mut child = Command::new(&exe)
        .args(["errors".as_ref(), nosvc.path().as_os_str(), d.path().as_os_str()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", exe.display()));
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut seen = String::new();
    let mut line = String::new();
    loop {
        line.clear();
        if stdout.read_line(&mut line).unwrap() == 0 {
            let (_, _, err) = wait_output(child, "the C error checks");
            panic!("the C program ended before \"ready\":\n{seen}\n{err}");
        }
        seen.push_str(&line);
        if line.trim() == "ready" {
            break;
        }
    }
    // Stop the service under the attached C producer, then let it go on.
    let stats = svc.stop().unwrap();
    child.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    seen.push_str(&rest);
    let (ok, _, err) = wait_output(child, "the C error checks");
    assert!(ok, "C error checks failed:\n{seen}\n{err}");
    assert!(seen.contains("errors=0"), "{seen}");

    let line_of = |prefix: &str| -> &str {
        seen.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("{seen}"))
    };
    assert!(line_of("null: ").contains("NULL"), "{seen}");
    // No service: the code of FL_JOURNAL_IO (-9) and the OS's words.
    let nosvc_line = line_of("nosvc: ");
    assert!(nosvc_line.starts_with("nosvc: -9 connect to the journal service failed: "));
    assert!(nosvc_line.contains("No such file or directory"), "{nosvc_line}");
    assert!(line_of("refused: ").contains("ring bytes"), "{seen}");
    assert!(line_of("too_large: -2 ").contains("too large (max 4096)"), "{seen}");
    assert!(line_of("timeout: ").contains("not durable in time"), "{seen}");
    assert!(line_of("closed: -3 ").contains("journal closed"), "{seen}");

    // What the C program appended before the stop: the longest record, an empty one and "x".
    assert_eq!(stats.attaches, 1, "only the one good connect attached");
    let recs = records(d.path());
    let payloads: Vec<Vec<u8>> = recs.values().map(|(_, p)| p.clone()).collect();
    assert_eq!(payloads, [vec![b'm'; 4096], vec![], b"x".to_vec()]);
    let v = verify_dir(d.path(), Anchor::default()).unwrap();
    assert!(v.problem.is_none(), "{:?}", v.problem);
}

/// The header is C++ too: it compiles in a C++ translation unit (`extern "C"`).
#[test]
fn header_compiles_as_cxx() {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("use.cc");
    std::fs::write(
        &src,
        "#include \"fastlane_journal.h\"\n\
         int main() { fl_journal_producer *p = nullptr; \
         return fl_journal_append(p, \"x\", 1, nullptr) == FL_JOURNAL_NULL ? 0 : 1; }\n",
    )
    .unwrap();
    let mut cmd = Command::new(cxx);
    cmd.args(["-std=c++17", "-Wall", "-Wextra", "-Werror", "-fsyntax-only", "-I"])
        .arg(crate_dir().join("include"))
        .arg(&src);
    compile(cmd, "compiling the header as C++");
}

/// Append cost from C and from Rust against the same running service, measured the same way
/// (rounds of N appends of 64 bytes timed with a monotonic clock, a wait until durable between
/// rounds). Ignored: a measurement, not a check. Run it optimised:
/// `cargo test --release -p fastlane-journal-c --test c_producer -- --ignored --nocapture`.
#[test]
#[ignore]
fn append_cost_c_and_rust() {
    const ROUNDS: usize = 21;
    const N: u64 = 10_000;
    let exe = c_producer(Link::Shared);
    let d = tempfile::tempdir().unwrap();
    let mut c = config(d.path());
    c.ring_bytes = 4 << 20;
    c.segment_bytes = 64 << 20;
    let svc = Service::start(c).unwrap();
    let load_before = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();

    let child = Command::new(&exe)
        .args(["bench".as_ref(), d.path().as_os_str(), ROUNDS.to_string().as_ref()])
        .arg(N.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (ok, out, err) = wait_output(child, "the C benchmark");
    assert!(ok, "{out}\n{err}");
    let f = fields(&out, "bench ");

    let mut tx = JournalProducer::connect(d.path(), "rust-bench").unwrap();
    let buf = [b'b'; 64];
    let (mut per, mut full) = (Vec::with_capacity(ROUNDS), 0u64);
    let mut seq = 0;
    for _ in 0..ROUNDS {
        let t0 = Instant::now();
        for _ in 0..N {
            loop {
                match tx.append(&buf) {
                    Ok(s) => {
                        seq = s;
                        break;
                    }
                    Err(JournalError::Full) => {
                        full += 1;
                        std::thread::yield_now();
                    }
                    Err(e) => panic!("append: {e}"),
                }
            }
        }
        per.push(t0.elapsed().as_nanos() as f64 / N as f64);
        tx.wait_durable(seq, T).unwrap();
    }
    per.sort_by(f64::total_cmp);
    drop(tx);
    svc.stop().unwrap();
    let load_after = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "append of 64 bytes, {ROUNDS} rounds of {N} ({} build):\n  \
         C    (libfastlane_journal.so): min {} ns, median {} ns, full retries {}\n  \
         Rust (JournalProducer::append): min {:.1} ns, median {:.1} ns, full retries {full}\n  \
         load average before: {}  after: {}",
        if cfg!(debug_assertions) { "debug" } else { "release" },
        f["min_ns"],
        f["median_ns"],
        f["full"],
        per[0],
        per[ROUNDS / 2],
        load_before.trim(),
        load_after.trim(),
    );
}
