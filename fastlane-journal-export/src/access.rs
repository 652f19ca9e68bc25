//! Who the exporter says it is to the NATS cluster, and whom it trusts.
//!
//! # Credentials
//!
//! NATS servers take a user and password or a token (`authorization` in the server's
//! configuration). Neither ever comes from the command line or the URL (`ps` shows both to
//! every user of the machine; [`crate::parse_urls`] refuses `user:pass@`). They come from
//!
//! - the environment: [`USER_ENV`] with [`PASSWORD_ENV`], or [`TOKEN_ENV`];
//! - or files (`--export-password-file`, `--export-token-file`), one line each, readable by
//!   their owner only ([`fastlane_util::secret::read_secret_file`]); the user still comes from
//!   [`USER_ENV`].
//!
//! A secret given both ways, a user without a password (or the reverse), and a token beside a
//! user are refused at start, with the variable or flag named. JWT/NKey `.creds` files are not
//! supported (they need the `nkeys` crate, not in this build).
//!
//! # TLS
//!
//! A `tls://HOST:PORT` URL, a CA file (`--export-ca`) or a client certificate
//! (`--export-cert` with `--export-key`, for servers that verify clients) makes the exporter
//! refuse any server that does not speak TLS. Servers' certificates are checked against the
//! CA file when one is given, else against the system's roots; the URL's host must be in the
//! certificate's subject alternative names. With plain `nats://` URLs and none of these, a
//! server that requires TLS is still met with TLS (it says so when the client connects), and
//! one that does not is spoken to in clear.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::ExportConfigError;

/// Environment variable holding the NATS user (with [`PASSWORD_ENV`] or a password file).
pub const USER_ENV: &str = "FASTLANE_NATS_USER";
/// Environment variable holding the NATS password.
pub const PASSWORD_ENV: &str = "FASTLANE_NATS_PASSWORD";
/// Environment variable holding the NATS token.
pub const TOKEN_ENV: &str = "FASTLANE_NATS_TOKEN";

/// Credentials and TLS material of the exporter's connections (see the module doc). The
/// default is no credentials and no TLS of its own asking.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ExportAccess {
    /// User of user-and-password authentication.
    pub user: Option<String>,
    /// Password of `user`.
    pub password: Option<String>,
    /// Token authentication (instead of a user).
    pub token: Option<String>,
    /// PEM file of the CA(s) trusted instead of the system's roots.
    pub ca_file: Option<PathBuf>,
    /// PEM files of the client certificate (chain) and its private key, for mutual TLS.
    pub client_cert: Option<(PathBuf, PathBuf)>,
}

impl std::fmt::Debug for ExportAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hidden = |s: &Option<String>| s.as_ref().map(|_| "<redacted>");
        f.debug_struct("ExportAccess")
            .field("user", &self.user)
            .field("password", &hidden(&self.password))
            .field("token", &hidden(&self.token))
            .field("ca_file", &self.ca_file)
            .field("client_cert", &self.client_cert)
            .finish()
    }
}

/// Where the secrets and TLS files of [`ExportAccess::load`] are, as the command line names
/// them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AccessFiles {
    /// `--export-password-file`.
    pub password_file: Option<PathBuf>,
    /// `--export-token-file`.
    pub token_file: Option<PathBuf>,
    /// `--export-ca`.
    pub ca_file: Option<PathBuf>,
    /// `--export-cert`.
    pub cert_file: Option<PathBuf>,
    /// `--export-key`.
    pub key_file: Option<PathBuf>,
}

fn refuse(reason: String) -> ExportConfigError {
    ExportConfigError::Access { reason }
}

impl ExportAccess {
    /// Credentials from the process environment or the files, and the TLS files (each read
    /// and checked now, so that a mistake is an error at start, not a retried connection).
    pub fn load(files: &AccessFiles) -> Result<ExportAccess, ExportConfigError> {
        Self::load_with(|name| std::env::var_os(name), files)
    }

    /// [`load`](Self::load) with `env` in place of the process environment.
    pub fn load_with(
        env: impl Fn(&str) -> Option<OsString>,
        files: &AccessFiles,
    ) -> Result<ExportAccess, ExportConfigError> {
        use fastlane_util::secret::{env_value, file_or_env};
        let user = env_value(USER_ENV, env(USER_ENV)).map_err(refuse)?;
        let secret = |flag: &str, file: &Option<PathBuf>, name: &str| {
            file_or_env(flag, file.as_deref(), name, env(name)).map_err(refuse)
        };
        let password = secret("--export-password-file", &files.password_file, PASSWORD_ENV)?;
        let token = secret("--export-token-file", &files.token_file, TOKEN_ENV)?;
        match (&user, &password, &token) {
            (Some(_), None, _) => {
                return Err(refuse(format!(
                    "{USER_ENV} is set but no password: set {PASSWORD_ENV} or give \
                     --export-password-file"
                )))
            }
            (None, Some(_), _) => {
                return Err(refuse(format!("a NATS password without a user: set {USER_ENV} too")))
            }
            (Some(_), Some(_), Some(_)) => {
                return Err(refuse(format!(
                    "both a user ({USER_ENV}) and a token: a NATS server takes one way"
                )))
            }
            _ => {}
        }
        let pem = |flag: &str, p: &Path, label: &str| {
            fastlane_util::secret::read_pem_file(p, label)
                .map(|_| p.to_path_buf())
                .map_err(|e| refuse(format!("{flag} {}: {e}", p.display())))
        };
        let ca_file =
            files.ca_file.as_deref().map(|p| pem("--export-ca", p, "CERTIFICATE")).transpose()?;
        let client_cert = match (&files.cert_file, &files.key_file) {
            (Some(c), Some(k)) => Some((
                pem("--export-cert", c, "CERTIFICATE")?,
                pem("--export-key", k, "PRIVATE KEY")?,
            )),
            (None, None) => None,
            _ => return Err(refuse("--export-cert and --export-key go together".into())),
        };
        Ok(ExportAccess { user, password, token, ca_file, client_cert })
    }

    /// Whether the exporter asks for TLS itself (a CA or a client certificate given).
    pub fn wants_tls(&self) -> bool {
        self.ca_file.is_some() || self.client_cert.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fastlane_util::testcert::file_with_mode as file;

    use fastlane_util::testcert::env_of as env;

    fn err(e: impl Fn(&str) -> Option<OsString>, files: &AccessFiles) -> String {
        ExportAccess::load_with(e, files).unwrap_err().to_string()
    }

    #[test]
    fn credentials_come_from_the_environment_or_a_private_file() {
        let none = AccessFiles::default();
        assert_eq!(ExportAccess::load_with(env(&[]), &none).unwrap(), ExportAccess::default());
        let a = ExportAccess::load_with(env(&[(USER_ENV, "fl"), (PASSWORD_ENV, "s3cret")]), &none)
            .unwrap();
        assert_eq!((a.user.as_deref(), a.password.as_deref()), (Some("fl"), Some("s3cret")));
        let a = ExportAccess::load_with(env(&[(TOKEN_ENV, "t0ken")]), &none).unwrap();
        assert_eq!(a.token.as_deref(), Some("t0ken"));
        let shown = format!("{a:?}");
        assert!(!shown.contains("t0ken") && shown.contains("<redacted>"), "{shown}");

        let dir = tempfile::tempdir().unwrap();
        let pw = file(dir.path(), "pw", "s3cret\n", 0o600);
        let files = AccessFiles { password_file: Some(pw.clone()), ..AccessFiles::default() };
        let a = ExportAccess::load_with(env(&[(USER_ENV, "fl")]), &files).unwrap();
        assert_eq!(a.password.as_deref(), Some("s3cret"));

        for (vars, files, want) in [
            (vec![(USER_ENV, "fl")], none.clone(), "no password"),
            (vec![(PASSWORD_ENV, "s3cret")], none.clone(), "without a user"),
            (vec![(TOKEN_ENV, "")], none.clone(), "empty"),
            (
                vec![(USER_ENV, "fl"), (PASSWORD_ENV, "s3cret"), (TOKEN_ENV, "t")],
                none.clone(),
                "both a user",
            ),
            (vec![(USER_ENV, "fl"), (PASSWORD_ENV, "other")], files.clone(), "both given"),
        ] {
            let e = err(env(&vars), &files);
            assert!(e.contains(want), "{vars:?}: {e}");
            assert!(!e.contains("s3cret"), "the error shows the password: {e}");
        }
        let open = file(dir.path(), "open", "s3cret\n", 0o644);
        let files = AccessFiles { token_file: Some(open), ..AccessFiles::default() };
        let e = err(env(&[]), &files);
        assert!(e.contains("--export-token-file") && e.contains("readable by its group"), "{e}");
    }

    #[test]
    fn tls_files_are_checked_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let cert = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
        let key = "-----BEGIN PRIVATE KEY-----\nMIIB\n-----END PRIVATE KEY-----\n";
        let ca = file(dir.path(), "ca.pem", cert, 0o644);
        let crt = file(dir.path(), "c.pem", cert, 0o644);
        let k = file(dir.path(), "k.pem", key, 0o600);
        let files = AccessFiles {
            ca_file: Some(ca.clone()),
            cert_file: Some(crt.clone()),
            key_file: Some(k.clone()),
            ..AccessFiles::default()
        };
        let a = ExportAccess::load_with(env(&[]), &files).unwrap();
        assert_eq!(a.ca_file.as_deref(), Some(ca.as_path()));
        assert_eq!(a.client_cert, Some((crt.clone(), k.clone())));
        assert!(a.wants_tls());
        assert!(!ExportAccess::default().wants_tls());
        let half = AccessFiles { cert_file: Some(crt), ..AccessFiles::default() };
        assert!(err(env(&[]), &half).contains("go together"));
        let swapped = AccessFiles { ca_file: Some(k), ..AccessFiles::default() };
        let e = err(env(&[]), &swapped);
        assert!(e.contains("--export-ca") && e.contains("no PEM CERTIFICATE"), "{e}");
        let missing =
            AccessFiles { ca_file: Some(dir.path().join("no")), ..AccessFiles::default() };
        assert!(err(env(&[]), &missing).contains("--export-ca"));
    }
}
