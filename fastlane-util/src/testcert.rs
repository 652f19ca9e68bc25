//! A throwaway certificate authority and one server certificate for the TLS tests (the Redis
//! tier's `rediss://`, the journal export's `tls://`), made with the `openssl` command
//! (Debian package `openssl`); [`run_bounded`], which runs a command with a time limit; and
//! the two helpers of the credential tests: [`file_with_mode`] and [`env_of`].

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{self, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// File name of the CA certificate [`make`] writes.
pub const CA_FILE: &str = "ca.crt";
/// File name of the node certificate (signed by the CA).
pub const CERT_FILE: &str = "node.crt";
/// File name of the node certificate's private key.
pub const KEY_FILE: &str = "node.key";

/// How long one `openssl` step may take.
const STEP_LIMIT: Duration = Duration::from_secs(30);

/// Writes `text` to `dir/name` with permission bits `mode`; its path. Panics on failure (for
/// tests).
pub fn file_with_mode(dir: &Path, name: &str, text: &str, mode: u32) -> PathBuf {
    let p = dir.join(name);
    let written = std::fs::File::create(&p)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .and_then(|()| std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)));
    if let Err(e) = written {
        panic!("writing {}: {e}", p.display());
    }
    p
}

/// An environment of `vars` alone, as the loaders' `env` argument takes it (for tests).
pub fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
    let m: HashMap<String, OsString> =
        vars.iter().map(|(k, v)| (k.to_string(), OsString::from(v))).collect();
    move |name| m.get(name).cloned()
}

/// Runs `cmd` (stdin from `/dev/null`, stdout and stderr captured) and returns its output, or
/// `TimedOut` after killing it when it has not finished within `limit`.
pub fn run_bounded(cmd: &mut Command, limit: Duration) -> io::Result<Output> {
    let mut child =
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
    // The output is read while the command runs (a full pipe would stall it otherwise); the
    // child stays ours to wait for, so a kill never reaches a pid reused after a reap.
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut buf);
            }
            buf
        })
    };
    let out = drain(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let err = drain(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let start = Instant::now();
    // Bounded by `limit`.
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{cmd:?} did not finish within {limit:?}"),
            ));
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let join = |t: std::thread::JoinHandle<Vec<u8>>| t.join().unwrap_or_default();
    Ok(Output { status, stdout: join(out), stderr: join(err) })
}

/// Makes in `dir` a CA ([`CA_FILE`]) and a node certificate signed by it ([`CERT_FILE`],
/// [`KEY_FILE`]; EC P-256, two days, subject alternative names `IP:127.0.0.1` and
/// `DNS:localhost`, usable by servers and clients alike).
pub fn make(dir: &Path) -> io::Result<()> {
    let on_path = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d: PathBuf| d.join("openssl").is_file()));
    if !on_path {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            "openssl not found on PATH: install the Debian package openssl (.ci/install-deps.sh does)",
        ));
    }
    std::fs::write(
        dir.join("node.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=critical,CA:FALSE\n\
         keyUsage=critical,digitalSignature,keyEncipherment\n\
         extendedKeyUsage=serverAuth,clientAuth\n",
    )?;
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    let ca: Vec<&str> = [&["req", "-x509"][..], &ec, &["-keyout", "ca.key", "-out", CA_FILE]]
        .concat()
        .into_iter()
        .chain(["-days", "2", "-subj", "/CN=fastlane test CA"])
        .chain(["-addext", "basicConstraints=critical,CA:TRUE"])
        .chain(["-addext", "keyUsage=critical,keyCertSign,cRLSign"])
        .collect();
    let csr =
        [&["req"][..], &ec, &["-keyout", KEY_FILE, "-out", "node.csr", "-subj", "/CN=127.0.0.1"]]
            .concat();
    let sign = vec![
        "x509",
        "-req",
        "-in",
        "node.csr",
        "-CA",
        CA_FILE,
        "-CAkey",
        "ca.key",
        "-set_serial",
        "2",
        "-days",
        "2",
        "-extfile",
        "node.ext",
        "-out",
        CERT_FILE,
    ];
    for args in [ca, csr, sign] {
        let out = run_bounded(Command::new("openssl").args(&args).current_dir(dir), STEP_LIMIT)?;
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "openssl {args:?} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_past_its_limit_is_killed_and_one_within_it_gives_its_output() {
        let out = run_bounded(Command::new("sh").args(["-c", "echo hi; echo err >&2"]), STEP_LIMIT)
            .unwrap();
        assert!(out.status.success());
        assert_eq!((&out.stdout[..], &out.stderr[..]), (&b"hi\n"[..], &b"err\n"[..]));
        let t0 = std::time::Instant::now();
        let e =
            run_bounded(Command::new("sleep").arg("20"), Duration::from_millis(200)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    }

    #[test]
    fn makes_a_ca_and_a_node_certificate_it_signed() {
        let dir = tempfile::tempdir().unwrap();
        make(dir.path()).unwrap();
        for f in [CA_FILE, CERT_FILE, KEY_FILE] {
            assert!(dir.path().join(f).is_file(), "{f}");
        }
        let out = run_bounded(
            Command::new("openssl")
                .args(["verify", "-CAfile", CA_FILE, CERT_FILE])
                .current_dir(dir.path()),
            STEP_LIMIT,
        )
        .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    }
}
