//! Secrets and certificates read from files, the one way every FastLane client of another
//! service (the Redis tier, the NATS export) takes them.
//!
//! A password or token never comes from the command line: a flag's value shows in `ps` and
//! `/proc/PID/cmdline` to every user of the machine. The callers take it from the environment
//! or from a file read by [`read_secret_file`], which refuses a file its group or others may
//! read (mode `0600` or `0400`), as ssh refuses a private key: a secret everyone can read
//! protects nothing. A Kubernetes secret volume needs `defaultMode: 0400`.
//!
//! Errors say what is wrong with the file and never contain its contents; the caller puts the
//! flag and the path in front.

use std::ffi::OsString;
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// Largest secret file read.
pub const SECRET_FILE_BYTES_MAX: u64 = 4096;
/// Largest PEM file read.
pub const PEM_FILE_BYTES_MAX: u64 = 1 << 20;

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// The secret in `path`: one line of UTF-8, not empty (one trailing `\n` or `\r\n` is
/// dropped), in a regular file of at most [`SECRET_FILE_BYTES_MAX`] bytes that neither its
/// group nor others may read.
pub fn read_secret_file(path: &Path) -> io::Result<String> {
    let file = File::open(path)?;
    // The checks look at the file opened, not at a path that may have changed since.
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(invalid("not a regular file".into()));
    }
    let mode = meta.permissions().mode();
    if mode & 0o044 != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "readable by its group or others (mode {:04o}); a secret file must be readable \
                 by its owner only: chmod 600 it",
                mode & 0o7777
            ),
        ));
    }
    if meta.len() > SECRET_FILE_BYTES_MAX {
        return Err(invalid(format!("over {SECRET_FILE_BYTES_MAX} bytes: not a secret file")));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(SECRET_FILE_BYTES_MAX + 1).read_to_end(&mut bytes)?;
    let text = String::from_utf8(bytes).map_err(|_| invalid("not UTF-8".into()))?;
    let line = text.strip_suffix('\n').map(|t| t.strip_suffix('\r').unwrap_or(t)).unwrap_or(&text);
    if line.is_empty() {
        return Err(invalid("empty".into()));
    }
    if line.contains(['\n', '\r']) {
        return Err(invalid("more than one line; the file holds the secret alone".into()));
    }
    Ok(line.to_string())
}

/// The value of environment variable `name` (`value`, as `std::env::var_os` gives it):
/// `None` when unset; an error naming the variable when it is set but empty or not UTF-8.
pub fn env_value(name: &str, value: Option<OsString>) -> Result<Option<String>, String> {
    match value {
        None => Ok(None),
        Some(v) if v.is_empty() => Err(format!("{name} is set but empty")),
        Some(v) => v.into_string().map(Some).map_err(|_| format!("{name} is not UTF-8")),
    }
}

/// A secret given by a file (`flag`'s, read with [`read_secret_file`]) or by environment
/// variable `name` (its value `value`), one of the two at most; `None` when neither. Errors
/// name the flag, the file or the variable, never the secret.
pub fn file_or_env(
    flag: &str,
    file: Option<&Path>,
    name: &str,
    value: Option<OsString>,
) -> Result<Option<String>, String> {
    match (file, env_value(name, value)?) {
        (Some(p), Some(_)) => {
            Err(format!("{flag} {} and {name} are both given: use one", p.display()))
        }
        (Some(p), None) => {
            read_secret_file(p).map(Some).map_err(|e| format!("{flag} {}: {e}", p.display()))
        }
        (None, v) => Ok(v),
    }
}

/// The bytes of the PEM file `path` (at most [`PEM_FILE_BYTES_MAX`]), which must hold at
/// least one `-----BEGIN {label}-----` block: `CERTIFICATE` for a CA or a certificate chain,
/// `PRIVATE KEY` (also matching `EC PRIVATE KEY` and `RSA PRIVATE KEY`) for a key.
pub fn read_pem_file(path: &Path, label: &str) -> io::Result<Vec<u8>> {
    let file = File::open(path)?;
    let mut pem = Vec::new();
    file.take(PEM_FILE_BYTES_MAX + 1).read_to_end(&mut pem)?;
    if pem.len() as u64 > PEM_FILE_BYTES_MAX {
        return Err(invalid(format!("over {PEM_FILE_BYTES_MAX} bytes")));
    }
    let tail = format!("{label}-----");
    let found = pem.split(|&b| b == b'\n').any(|line| {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        line.starts_with(b"-----BEGIN ") && line.ends_with(tail.as_bytes())
    });
    if !found {
        return Err(invalid(format!("no PEM {label} (-----BEGIN …{label}-----) in it")));
    }
    Ok(pem)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testcert::file_with_mode as file;

    #[test]
    fn a_secret_file_is_one_private_line() {
        let dir = tempfile::tempdir().unwrap();
        let ok = file(dir.path(), "ok", "s3cret\n", 0o600);
        assert_eq!(read_secret_file(&ok).unwrap(), "s3cret");
        let crlf = file(dir.path(), "crlf", "s3cret\r\n", 0o400);
        assert_eq!(read_secret_file(&crlf).unwrap(), "s3cret");
        let bare = file(dir.path(), "bare", "s3cret", 0o600);
        assert_eq!(read_secret_file(&bare).unwrap(), "s3cret");
        let refused = |name: &str, text: &str, mode: u32, why: &str| {
            let p = file(dir.path(), name, text, mode);
            let e = read_secret_file(&p).unwrap_err().to_string();
            assert!(e.contains(why), "{name}: {e}");
            assert!(!e.contains("s3cret"), "{name}: the error shows the secret: {e}");
        };
        refused("world", "s3cret\n", 0o604, "readable by its group or others");
        refused("group", "s3cret\n", 0o640, "readable by its group or others");
        refused("empty", "\n", 0o600, "empty");
        refused("lines", "user\ns3cret\n", 0o600, "more than one line");
        refused("big", &"x".repeat(SECRET_FILE_BYTES_MAX as usize + 1), 0o600, "over");
        let e = read_secret_file(&dir.path().join("none")).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        let e = read_secret_file(dir.path()).unwrap_err().to_string();
        assert!(e.contains("not a regular file") || e.contains("readable"), "{e}");
    }

    #[test]
    fn a_secret_comes_from_a_file_or_a_variable_not_both() {
        let dir = tempfile::tempdir().unwrap();
        let f = file(dir.path(), "pw", "s3cret\n", 0o600);
        let v = |x: &str| Some(OsString::from(x));
        assert_eq!(env_value("V", None), Ok(None));
        assert_eq!(env_value("V", v("x")), Ok(Some("x".into())));
        assert_eq!(env_value("V", v("")), Err("V is set but empty".into()));
        assert_eq!(file_or_env("--f", None, "V", None), Ok(None));
        assert_eq!(file_or_env("--f", None, "V", v("env")), Ok(Some("env".into())));
        assert_eq!(file_or_env("--f", Some(&f), "V", None), Ok(Some("s3cret".into())));
        let e = file_or_env("--f", Some(&f), "V", v("env")).unwrap_err();
        assert!(e.contains("--f") && e.contains("both given") && !e.contains("s3cret"), "{e}");
        let e = file_or_env("--f", Some(&dir.path().join("no")), "V", None).unwrap_err();
        assert!(e.starts_with("--f "), "{e}");
    }

    #[test]
    fn a_pem_file_holds_a_block_of_its_label() {
        let dir = tempfile::tempdir().unwrap();
        let cert = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
        let p = file(dir.path(), "ca.pem", cert, 0o644);
        assert_eq!(read_pem_file(&p, "CERTIFICATE").unwrap(), cert.as_bytes());
        let e = read_pem_file(&p, "PRIVATE KEY").unwrap_err().to_string();
        assert!(e.contains("no PEM PRIVATE KEY"), "{e}");
        let key = "-----BEGIN EC PRIVATE KEY-----\r\nMHc\r\n-----END EC PRIVATE KEY-----\r\n";
        let k = file(dir.path(), "k.pem", key, 0o600);
        assert!(read_pem_file(&k, "PRIVATE KEY").is_ok());
        let junk = file(dir.path(), "junk.pem", "not a certificate", 0o644);
        let e = read_pem_file(&junk, "CERTIFICATE").unwrap_err().to_string();
        assert!(e.contains("no PEM CERTIFICATE"), "{e}");
    }
}
