//! Who the Redis tier says it is to the cluster, and whom it trusts: the `AUTH` user and
//! password, and the CA that signed the nodes' TLS certificates (`rediss://`).
//!
//! # Where credentials come from, and why
//!
//! Never from the command line: a flag's value, or a password in a `redis://user:pass@host`
//! URL, shows in `ps` and `/proc/PID/cmdline` to every user of the machine. So
//! [`parse_cluster_urls`](crate::daemon::parse_cluster_urls) refuses a URL with a user or
//! password, and [`ClusterAccess::load`] reads them from
//!
//! - the environment: [`USERNAME_ENV`] (optional; Redis 6 ACL user, default `default`) and
//!   [`PASSWORD_ENV`];
//! - or a file (`--kv-cluster-password-file PATH`): the password on one line (one trailing
//!   newline is dropped), which must not be readable by its group or others (mode `0600` or
//!   `0400`; [`fastlane_util::secret`] says why).
//!
//! Both a file and [`PASSWORD_ENV`] is refused (which one was meant?). A user without a
//! password is refused too. The password goes to every node connection (`AUTH`, also to the
//! nodes found through the slot map); [`ClusterAccess`]'s `Debug` does not print it.
//!
//! # TLS
//!
//! `rediss://` URLs connect over TLS (rustls). The nodes' certificates are checked against
//! the CA file of `--kv-cluster-ca PATH` (PEM) when one is given — then against it alone —
//! and against the system's roots (`/etc/ssl/certs`, through rustls-native-certs) otherwise.
//! The host name or IP address of each node's URL, and of each node the slot map names, must
//! be in its certificate's subject alternative names.

use std::ffi::OsString;
use std::path::Path;

use anyhow::{bail, Result};

/// Environment variable holding the Redis ACL user (optional).
pub const USERNAME_ENV: &str = "FASTLANE_REDIS_USERNAME";
/// Environment variable holding the Redis password.
pub const PASSWORD_ENV: &str = "FASTLANE_REDIS_PASSWORD";
/// Largest password file read.
pub const PASSWORD_FILE_BYTES_MAX: u64 = fastlane_util::secret::SECRET_FILE_BYTES_MAX;
/// Largest CA file read.
pub const CA_FILE_BYTES_MAX: u64 = fastlane_util::secret::PEM_FILE_BYTES_MAX;

/// Credentials and trust of the cluster connections (see the module doc). The default is no
/// `AUTH` and, for `rediss://`, the system's roots.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ClusterAccess {
    /// ACL user of `AUTH user password`; `None`: `AUTH password` (the `default` user).
    pub username: Option<String>,
    /// Password sent with `AUTH` on every node connection; `None`: no `AUTH`.
    pub password: Option<String>,
    /// PEM certificates of the CA(s) trusted for `rediss://` instead of the system roots.
    pub ca_pem: Option<Vec<u8>>,
}

impl std::fmt::Debug for ClusterAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterAccess")
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("ca_pem", &self.ca_pem.as_ref().map(|p| format!("{} bytes", p.len())))
            .finish()
    }
}

impl ClusterAccess {
    /// Credentials from the process environment ([`USERNAME_ENV`], [`PASSWORD_ENV`]) or
    /// `password_file`, and the CA of `ca_file`. Errors name the flag or variable at fault.
    pub fn load(password_file: Option<&Path>, ca_file: Option<&Path>) -> Result<ClusterAccess> {
        Self::load_with(|name| std::env::var_os(name), password_file, ca_file)
    }

    /// [`load`](Self::load) with `env` in place of the process environment.
    pub fn load_with(
        env: impl Fn(&str) -> Option<OsString>,
        password_file: Option<&Path>,
        ca_file: Option<&Path>,
    ) -> Result<ClusterAccess> {
        use fastlane_util::secret::{env_value, file_or_env};
        let username = env_value(USERNAME_ENV, env(USERNAME_ENV)).map_err(anyhow::Error::msg)?;
        let password = file_or_env(
            "--kv-cluster-password-file",
            password_file,
            PASSWORD_ENV,
            env(PASSWORD_ENV),
        )
        .map_err(anyhow::Error::msg)?;
        if username.is_some() && password.is_none() {
            bail!(
                "{USERNAME_ENV} is set but no password: set {PASSWORD_ENV} or give \
                 --kv-cluster-password-file"
            );
        }
        let ca_pem = ca_file.map(read_ca_file).transpose()?;
        Ok(ClusterAccess { username, password, ca_pem })
    }
}

/// The PEM certificates of `--kv-cluster-ca`.
fn read_ca_file(path: &Path) -> Result<Vec<u8>> {
    fastlane_util::secret::read_pem_file(path, "CERTIFICATE")
        .map_err(|e| anyhow::anyhow!("--kv-cluster-ca {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use fastlane_util::testcert::file_with_mode as file;

    use fastlane_util::testcert::env_of as env;

    #[test]
    fn credentials_from_the_environment() {
        let a = ClusterAccess::load_with(env(&[]), None, None).unwrap();
        assert_eq!(a, ClusterAccess::default());
        let a = ClusterAccess::load_with(env(&[(PASSWORD_ENV, "s3cret")]), None, None).unwrap();
        assert_eq!((a.username, a.password.as_deref()), (None, Some("s3cret")));
        let a = ClusterAccess::load_with(
            env(&[(USERNAME_ENV, "kv"), (PASSWORD_ENV, "s3cret")]),
            None,
            None,
        )
        .unwrap();
        assert_eq!((a.username.as_deref(), a.password.as_deref()), (Some("kv"), Some("s3cret")));
        let e = ClusterAccess::load_with(env(&[(USERNAME_ENV, "kv")]), None, None).unwrap_err();
        assert!(e.to_string().contains("no password"), "{e}");
        let e = ClusterAccess::load_with(env(&[(PASSWORD_ENV, "")]), None, None).unwrap_err();
        assert!(e.to_string().contains("empty"), "{e}");
    }

    #[test]
    fn the_password_file_is_one_private_line() {
        let dir = tempfile::tempdir().unwrap();
        let ok = file(dir.path(), "ok", "s3cret\n", 0o600);
        let a = ClusterAccess::load_with(env(&[]), Some(&ok), None).unwrap();
        assert_eq!(a.password.as_deref(), Some("s3cret"));
        // The file's rules are fastlane_util::secret's (tested there); here, that they apply
        // and that the error names the flag without the password.
        let open = file(dir.path(), "world", "s3cret\n", 0o604);
        let e = ClusterAccess::load_with(env(&[]), Some(&open), None).unwrap_err().to_string();
        assert!(e.contains("readable by its group or others"), "{e}");
        assert!(e.contains("--kv-cluster-password-file"), "{e}");
        assert!(!e.contains("s3cret"), "the error shows the password: {e}");
        let e =
            ClusterAccess::load_with(env(&[(PASSWORD_ENV, "other")]), Some(&ok), None).unwrap_err();
        assert!(e.to_string().contains("both given"), "{e}");
        let e =
            ClusterAccess::load_with(env(&[]), Some(&dir.path().join("none")), None).unwrap_err();
        assert!(format!("{e:#}").contains("No such file"), "{e:#}");
        // The password file alone is enough; the user may come from the environment.
        let a = ClusterAccess::load_with(env(&[(USERNAME_ENV, "kv")]), Some(&ok), None).unwrap();
        assert_eq!((a.username.as_deref(), a.password.as_deref()), (Some("kv"), Some("s3cret")));
    }

    #[test]
    fn ca_file_and_debug_hides_the_password() {
        let dir = tempfile::tempdir().unwrap();
        let pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
        let ca = file(dir.path(), "ca.pem", pem, 0o644);
        let a =
            ClusterAccess::load_with(env(&[(PASSWORD_ENV, "s3cret")]), None, Some(&ca)).unwrap();
        assert_eq!(a.ca_pem.as_deref(), Some(pem.as_bytes()));
        let shown = format!("{a:?}");
        assert!(!shown.contains("s3cret") && shown.contains("<redacted>"), "{shown}");
        let junk = file(dir.path(), "junk.pem", "not a certificate", 0o644);
        let e = ClusterAccess::load_with(env(&[]), None, Some(&junk)).unwrap_err();
        assert!(e.to_string().contains("no PEM CERTIFICATE"), "{e}");
    }
}
