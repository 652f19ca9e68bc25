//! The exporter's settings, the `--export` URL list parser and their validation.

use std::time::Duration;

use crate::ExportAccess;

/// Default stream name.
pub const DEFAULT_STREAM: &str = "FASTLANE_JOURNAL";
/// Default subject the records are published on.
pub const DEFAULT_SUBJECT: &str = "fastlane.journal";
/// Default replica count of the stream (a JetStream cluster of three keeps working with one
/// node down).
pub const DEFAULT_REPLICAS: usize = 3;
/// Default number of publishes whose ack may be outstanding.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 1024;
/// Default number of records read from the source at a time.
pub const DEFAULT_BATCH_MAX: usize = 256;
/// Default wait before looking at the source again when nothing new was durable.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(2);
/// Default bound on one connection attempt to the cluster.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Default bound on a publish ack and on a JetStream API request.
pub const DEFAULT_ACK_TIMEOUT: Duration = Duration::from_secs(5);
/// Default JetStream duplicate window of a stream the exporter creates.
pub const DEFAULT_DUPLICATE_WINDOW: Duration = Duration::from_secs(120);
/// Default longest wait between two reconnection attempts.
pub const DEFAULT_BACKOFF_MAX: Duration = Duration::from_secs(2);
/// Default bound on [`crate::Exporter::stop`]'s drain.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// JetStream's largest replica count.
pub const REPLICAS_MAX: usize = 5;
/// Largest `max_in_flight` accepted.
pub const MAX_IN_FLIGHT_MAX: usize = 65_536;
/// Largest `batch_max` accepted.
pub const BATCH_MAX_MAX: usize = 65_536;
/// Longest stream name accepted (JetStream stores a stream under a directory of its name).
pub const STREAM_NAME_LEN_MAX: usize = 255;

/// Where and how the exporter ships records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportConfig {
    /// Cluster seed URLs, each `nats://HOST:PORT` or `tls://HOST:PORT` (TLS required); the
    /// client learns the other nodes from them.
    pub urls: Vec<String>,
    /// Credentials and TLS material ([`crate::access`]).
    pub access: ExportAccess,
    /// JetStream stream name.
    pub stream: String,
    /// Subject the records are published on; the stream the exporter creates holds only it.
    pub subject: String,
    /// Replicas of a stream the exporter creates; an existing stream must have as many.
    pub replicas: usize,
    /// Publishes whose ack may be outstanding at once (the pipelining depth).
    pub max_in_flight: usize,
    /// Records read from the source per call.
    pub batch_max: usize,
    /// Wait before asking the source again when nothing new was durable.
    pub poll_interval: Duration,
    /// Bound on one connection attempt.
    pub connect_timeout: Duration,
    /// Bound on one publish ack or one JetStream API request; past it the exporter
    /// reconnects and resumes from what the stream holds.
    pub ack_timeout: Duration,
    /// JetStream duplicate window of a stream the exporter creates. A publish repeated within
    /// it under the same `Nats-Msg-Id` is acknowledged as a duplicate and not stored again: a
    /// publish whose ack was lost in a reconnect may be resent without a second copy. It must
    /// be longer than the longest time a lost publish can still be in flight somewhere in the
    /// cluster (an ack timeout plus a leader election, seconds); the exporter does not rely on
    /// it alone (see the crate documentation).
    pub duplicate_window: Duration,
    /// Longest wait between two reconnection attempts (the backoff doubles up to it).
    pub backoff_max: Duration,
    /// Bound on [`crate::Exporter::stop`]'s drain of the records durable when it was called.
    pub drain_timeout: Duration,
}

/// A rejected export setting; each names the setting and the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExportConfigError {
    /// No URL given.
    #[error("export: no NATS URL given (expected nats://HOST:PORT[,nats://HOST:PORT...])")]
    NoUrl,
    /// A URL that is not `nats://HOST:PORT`.
    #[error(
        "export: bad NATS URL {url:?}: {reason} (expected nats://HOST:PORT or tls://HOST:PORT)"
    )]
    Url {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The same URL twice.
    #[error("export: NATS URL {url:?} given twice")]
    DuplicateUrl {
        /// The URL as given.
        url: String,
    },
    /// A stream name JetStream refuses.
    #[error("export: bad stream name {name:?}: {reason}")]
    Stream {
        /// The name as given.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A subject that is not one literal subject.
    #[error("export: bad subject {subject:?}: {reason}")]
    Subject {
        /// The subject as given.
        subject: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A number out of its range.
    #[error("export: {field} = {value} is out of range {min}..={max}")]
    Range {
        /// The setting.
        field: &'static str,
        /// The value given.
        value: usize,
        /// Smallest accepted.
        min: usize,
        /// Largest accepted.
        max: usize,
    },
    /// Credentials or TLS files that cannot be used.
    #[error("export: {reason}")]
    Access {
        /// What is wrong, naming the variable or flag.
        reason: String,
    },
    /// A zero duration where a wait is needed.
    #[error("export: {field} must be longer than zero")]
    ZeroDuration {
        /// The setting.
        field: &'static str,
    },
}

impl ExportConfig {
    /// The defaults with the URLs of an `--export` value (`nats://HOST:PORT[,...]`).
    pub fn from_urls(list: &str) -> Result<Self, ExportConfigError> {
        let cfg = Self { urls: parse_urls(list)?, ..Self::with_urls(Vec::new()) };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The defaults with these URLs (not yet validated).
    pub fn with_urls(urls: Vec<String>) -> Self {
        Self {
            urls,
            access: ExportAccess::default(),
            stream: DEFAULT_STREAM.to_string(),
            subject: DEFAULT_SUBJECT.to_string(),
            replicas: DEFAULT_REPLICAS,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            batch_max: DEFAULT_BATCH_MAX,
            poll_interval: DEFAULT_POLL_INTERVAL,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            ack_timeout: DEFAULT_ACK_TIMEOUT,
            duplicate_window: DEFAULT_DUPLICATE_WINDOW,
            backoff_max: DEFAULT_BACKOFF_MAX,
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
        }
    }

    /// Checks every setting; [`crate::Exporter::start`] calls it.
    pub fn validate(&self) -> Result<(), ExportConfigError> {
        if self.urls.is_empty() {
            return Err(ExportConfigError::NoUrl);
        }
        for (i, url) in self.urls.iter().enumerate() {
            check_url(url)?;
            if self.urls[..i].contains(url) {
                return Err(ExportConfigError::DuplicateUrl { url: url.clone() });
            }
        }
        check_stream_name(&self.stream)?;
        check_subject(&self.subject)?;
        range("replicas", self.replicas, 1, REPLICAS_MAX)?;
        range("max_in_flight", self.max_in_flight, 1, MAX_IN_FLIGHT_MAX)?;
        range("batch_max", self.batch_max, 1, BATCH_MAX_MAX)?;
        for (field, d) in [
            ("poll_interval", self.poll_interval),
            ("connect_timeout", self.connect_timeout),
            ("ack_timeout", self.ack_timeout),
            ("duplicate_window", self.duplicate_window),
            ("backoff_max", self.backoff_max),
            ("drain_timeout", self.drain_timeout),
        ] {
            if d.is_zero() {
                return Err(ExportConfigError::ZeroDuration { field });
            }
        }
        Ok(())
    }

    /// Whether the exporter refuses servers that do not speak TLS: a `tls://` URL, a CA or a
    /// client certificate.
    pub fn tls_required(&self) -> bool {
        self.access.wants_tls() || self.urls.iter().any(|u| u.starts_with("tls://"))
    }
}

/// Splits and checks an `--export` value: comma-separated `nats://HOST:PORT` (or `tls://`) URLs, blanks
/// around each ignored.
pub fn parse_urls(list: &str) -> Result<Vec<String>, ExportConfigError> {
    let mut urls: Vec<String> = Vec::new();
    for part in list.split(',') {
        let url = part.trim();
        if url.is_empty() {
            if list.trim().is_empty() {
                return Err(ExportConfigError::NoUrl);
            }
            return Err(ExportConfigError::Url { url: list.to_string(), reason: "empty entry" });
        }
        check_url(url)?;
        if urls.iter().any(|u| u == url) {
            return Err(ExportConfigError::DuplicateUrl { url: url.to_string() });
        }
        urls.push(url.to_string());
    }
    Ok(urls)
}

fn check_url(url: &str) -> Result<(), ExportConfigError> {
    let bad = |reason| Err(ExportConfigError::Url { url: url.to_string(), reason });
    let Some(rest) = url.strip_prefix("nats://").or_else(|| url.strip_prefix("tls://")) else {
        return bad("the scheme must be nats:// or tls://");
    };
    if rest.contains(['/', '?', '#', '@']) {
        return bad("only HOST:PORT may follow the scheme (no path, query or credentials)");
    }
    let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
        let Some((host, after)) = v6.split_once(']') else {
            return bad("an IPv6 host needs its closing ]");
        };
        let Some(port) = after.strip_prefix(':') else {
            return bad("missing :PORT");
        };
        if host.parse::<std::net::Ipv6Addr>().is_err() {
            return bad("not an IPv6 address inside [ ]");
        }
        (host, port)
    } else {
        let Some((host, port)) = rest.rsplit_once(':') else {
            return bad("missing :PORT");
        };
        if host.contains(':') {
            return bad("an IPv6 host goes inside [ ]");
        }
        let ok = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '.';
        if host.is_empty() || !host.chars().all(ok) {
            return bad("the host must be a name or an address");
        }
        (host, port)
    };
    if host.is_empty() {
        return bad("empty host");
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(()),
        _ => bad("the port must be a number in 1..=65535"),
    }
}

fn check_stream_name(name: &str) -> Result<(), ExportConfigError> {
    let bad = |reason| Err(ExportConfigError::Stream { name: name.to_string(), reason });
    if name.is_empty() {
        return bad("empty");
    }
    if name.len() > STREAM_NAME_LEN_MAX {
        return bad("longer than 255 bytes");
    }
    if name.chars().any(|c| c.is_whitespace() || c.is_control() || ".*>/\\".contains(c)) {
        return bad("JetStream refuses blanks, control characters and . * > / \\ in a name");
    }
    Ok(())
}

fn check_subject(subject: &str) -> Result<(), ExportConfigError> {
    let bad = |reason| Err(ExportConfigError::Subject { subject: subject.to_string(), reason });
    if subject.is_empty() {
        return bad("empty");
    }
    for token in subject.split('.') {
        if token.is_empty() {
            return bad("empty token (leading, trailing or doubled .)");
        }
        if token == "*" || token == ">" || token.contains(['*', '>']) {
            return bad("wildcards are not a subject one can publish on");
        }
        if token.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return bad("blanks and control characters are not allowed");
        }
    }
    Ok(())
}

fn range(
    field: &'static str,
    value: usize,
    min: usize,
    max: usize,
) -> Result<(), ExportConfigError> {
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err(ExportConfigError::Range { field, value, min, max })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_one_or_many_urls() {
        let cfg = ExportConfig::from_urls("nats://127.0.0.1:4222").unwrap();
        assert_eq!(cfg.urls, ["nats://127.0.0.1:4222"]);
        assert_eq!(cfg.stream, DEFAULT_STREAM);
        assert_eq!(cfg.subject, DEFAULT_SUBJECT);
        assert_eq!(cfg.replicas, 3);
        assert!(!cfg.tls_required());
        let urls = parse_urls("nats://a.example:1, nats://b-2:65535 ,nats://[::1]:4222").unwrap();
        assert_eq!(urls, ["nats://a.example:1", "nats://b-2:65535", "nats://[::1]:4222"]);
        let cfg = ExportConfig::from_urls("nats://a:1,tls://b:2").unwrap();
        assert_eq!(cfg.urls, ["nats://a:1", "tls://b:2"]);
        assert!(cfg.tls_required(), "a tls:// URL requires TLS of every server");
    }

    #[test]
    fn refuses_bad_urls_with_a_reason() {
        for (input, want) in [
            ("", "no NATS URL"),
            ("  ", "no NATS URL"),
            ("nats://h:1,", "empty entry"),
            ("ws://h:1", "scheme"),
            ("tls://u:p@h:1", "credentials"),
            ("h:4222", "scheme"),
            ("nats://h", "missing :PORT"),
            ("nats://h:0", "port"),
            ("nats://h:70000", "port"),
            ("nats://h:x", "port"),
            ("nats://:4222", "host"),
            ("nats://u:p@h:1", "credentials"),
            ("nats://h:1/x", "path"),
            ("nats://::1:4222", "IPv6"),
            ("nats://[::1:4222", "closing ]"),
            ("nats://[zz]:4222", "IPv6"),
            ("nats://h_1:4222", "host"),
            ("nats://h:1,nats://h:1", "twice"),
        ] {
            let err = parse_urls(input).unwrap_err().to_string();
            assert!(err.contains(want), "{input:?}: {err:?} lacks {want:?}");
        }
    }

    #[test]
    fn validation_names_the_setting() {
        let ok = ExportConfig::with_urls(vec!["nats://h:1".into()]);
        ok.validate().unwrap();
        let cases: Vec<(ExportConfig, &str)> = vec![
            (ExportConfig { replicas: 0, ..ok.clone() }, "replicas"),
            (ExportConfig { replicas: 6, ..ok.clone() }, "replicas"),
            (ExportConfig { max_in_flight: 0, ..ok.clone() }, "max_in_flight"),
            (ExportConfig { batch_max: 0, ..ok.clone() }, "batch_max"),
            (ExportConfig { ack_timeout: Duration::ZERO, ..ok.clone() }, "ack_timeout"),
            (ExportConfig { stream: "A.B".into(), ..ok.clone() }, "stream name"),
            (ExportConfig { stream: String::new(), ..ok.clone() }, "stream name"),
            (ExportConfig { subject: "a.*".into(), ..ok.clone() }, "wildcards"),
            (ExportConfig { subject: "a..b".into(), ..ok.clone() }, "empty token"),
            (ExportConfig { subject: "a b".into(), ..ok.clone() }, "blanks"),
            (ExportConfig { urls: vec![], ..ok.clone() }, "no NATS URL"),
        ];
        for (cfg, want) in cases {
            let err = cfg.validate().unwrap_err().to_string();
            assert!(err.contains(want), "{err:?} lacks {want:?}");
        }
    }
}
