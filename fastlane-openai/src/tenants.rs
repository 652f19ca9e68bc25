//! Tenants from TOML: who a bearer key belongs to, and that tenant's admission settings.
//!
//! ```toml
//! [[tenant]]
//! name = "quiet"
//! keys = ["key-quiet"]
//! rpm = 60                 # token bucket refill, requests per minute
//! burst = 5                # bucket capacity
//! weight = 1               # DRR weight: backlogged tenants share prefill in proportion
//! max_concurrent = 4       # admission slots (streams in flight)
//! tier = "interactive"     # or "batch"
//! max_stream_seconds = 60  # the fence
//! queue = 64               # requests waiting for a slot at the router (beyond: 503)
//! prefix_group = "acme"    # optional: prefix-cache namespace (default: the tenant's name)
//! ```
//!
//! Each tenant's prompt blocks in the prefix cache are keyed in a namespace of its own, its
//! name unless `prefix_group` says otherwise (same characters as a name), so no tenant can
//! tell from its time to first token whether another sent a prompt. Tenants that name the same
//! `prefix_group` share their cached blocks (and can time each other's prompts). Without a
//! tenants file everything is tenant `default`: one namespace.
//!
//! A request whose tenant's bucket is empty gets 429 with `Retry-After` at once; one that has
//! a bucket token but finds every slot of its tenant busy waits in the router queue without
//! spending the token (spent when it is admitted); a full queue gives 503.

use std::collections::HashMap;
use std::path::Path;

use fastlane_sched::{Overflow, TenantConfig, Tier};

use crate::api::SECONDS_MAX;
use serde::Deserialize;
use thiserror::Error;

/// A tenants file that cannot be used.
#[derive(Debug, Error)]
pub enum TenantsError {
    /// The file cannot be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file's text is wrong.
    #[error("{path}: {reason}")]
    Config {
        /// The file.
        path: String,
        /// What is wrong (names the tenant and field).
        reason: String,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    tenant: Vec<Entry>,
}

/// One `[[tenant]]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    /// Name (metrics label; letters, digits, `-`, `_`).
    pub name: String,
    /// Bearer keys that identify it.
    pub keys: Vec<String>,
    /// Requests per minute refilled into its token bucket.
    pub rpm: f64,
    /// Bucket capacity.
    pub burst: f64,
    /// DRR weight.
    #[serde(default = "one")]
    pub weight: u32,
    /// Streams in flight at most.
    pub max_concurrent: u32,
    /// `interactive` or `batch`.
    pub tier: String,
    /// Longest stream, seconds (the fence).
    #[serde(default)]
    pub max_stream_seconds: Option<f64>,
    /// Requests that may wait at the router for a slot; beyond, 503.
    #[serde(default = "queue_default")]
    pub queue: usize,
    /// The prefix-cache namespace it shares with the tenants that name the same group
    /// (`None`: its own, named after it).
    #[serde(default)]
    pub prefix_group: Option<String>,
}

impl Entry {
    /// Whether the tenant is in the batch tier (else interactive).
    pub fn is_batch(&self) -> bool {
        self.tier == "batch"
    }

    /// The namespace its prefix-cache blocks are keyed in: `prefix_group`, else its name.
    pub fn prefix_namespace(&self) -> &str {
        self.prefix_group.as_deref().unwrap_or(&self.name)
    }
}

/// A tenant name or prefix group: letters, digits, `-` and `_`, not empty.
fn is_name(s: &str) -> bool {
    !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

fn one() -> u32 {
    1
}
fn queue_default() -> usize {
    64
}

/// The tenant table.
#[derive(Debug, Clone)]
pub struct Tenants {
    entries: Vec<Entry>,
    by_key: HashMap<String, usize>,
    /// No tenants file: every request is tenant 0, `default`, with no key needed.
    open: bool,
}

impl Tenants {
    /// No authentication: one interactive tenant `default` with no limits.
    pub fn open() -> Tenants {
        Tenants {
            entries: vec![Entry {
                name: "default".into(),
                keys: Vec::new(),
                rpm: 1e12,
                burst: 1e12,
                weight: 1,
                max_concurrent: u32::MAX,
                tier: "interactive".into(),
                max_stream_seconds: None,
                queue: 1 << 20,
                prefix_group: None,
            }],
            by_key: HashMap::new(),
            open: true,
        }
    }

    /// Reads a tenants file; the error names the file, and the tenant and field when the
    /// text is wrong.
    pub fn load(path: &Path) -> Result<Tenants, TenantsError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| TenantsError::Io { path: path.display().to_string(), source: e })?;
        Tenants::parse(&text)
            .map_err(|reason| TenantsError::Config { path: path.display().to_string(), reason })
    }

    /// Parses and checks a tenants file's text; the error names the tenant and field.
    pub fn parse(text: &str) -> Result<Tenants, String> {
        let f: File = toml::from_str(text).map_err(|e| e.to_string())?;
        if f.tenant.is_empty() {
            return Err("no [[tenant]]".into());
        }
        let mut by_key = HashMap::new();
        for (i, t) in f.tenant.iter().enumerate() {
            let bad = |field: &str, why: &str| Err(format!("tenant {:?}: {field}: {why}", t.name));
            if !is_name(&t.name) {
                return bad("name", "letters, digits, '-' and '_' only");
            }
            if t.prefix_group.as_deref().is_some_and(|g| !is_name(g)) {
                return bad("prefix_group", "letters, digits, '-' and '_' only");
            }
            if f.tenant[..i].iter().any(|o| o.name == t.name) {
                return bad("name", "used twice");
            }
            if !(t.rpm.is_finite() && t.rpm > 0.0) {
                return bad("rpm", "must be positive");
            }
            if !(t.burst.is_finite() && t.burst >= 1.0) {
                return bad("burst", "must be at least 1");
            }
            if !(1..=1000).contains(&t.weight) {
                return bad("weight", "1 to 1000");
            }
            if t.max_concurrent == 0 {
                return bad("max_concurrent", "must be at least 1");
            }
            if t.tier != "interactive" && t.tier != "batch" {
                return bad("tier", "interactive or batch");
            }
            if t.max_stream_seconds.is_some_and(|s| !(s.is_finite() && s > 0.0 && s <= SECONDS_MAX))
            {
                return bad("max_stream_seconds", "more than 0 and at most 604800 (a week)");
            }
            if t.keys.is_empty() {
                return bad("keys", "at least one key");
            }
            for k in &t.keys {
                if k.is_empty() {
                    return bad("keys", "empty key");
                }
                if by_key.insert(k.clone(), i).is_some() {
                    return bad("keys", "a key belongs to two tenants");
                }
            }
        }
        Ok(Tenants { entries: f.tenant, by_key, open: false })
    }

    /// The tenant of a bearer key (`None`: 401). Without a tenants file, everyone is tenant 0.
    pub fn tenant_of(&self, key: Option<&str>) -> Option<usize> {
        if self.open {
            return Some(0);
        }
        key.and_then(|k| self.by_key.get(k).copied())
    }

    /// Whether requests need a key.
    pub fn needs_key(&self) -> bool {
        !self.open
    }

    /// Tenant `i`.
    pub fn get(&self, i: usize) -> &Entry {
        &self.entries[i]
    }

    /// Tenants in order.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// Each tenant's prefix-cache namespace, in tenant order ([`Entry::prefix_namespace`]).
    pub fn prefix_namespaces(&self) -> Vec<String> {
        self.entries.iter().map(|t| t.prefix_namespace().to_string()).collect()
    }

    /// The scheduler's view.
    pub fn sched_configs(&self) -> Vec<TenantConfig> {
        self.entries
            .iter()
            .map(|t| TenantConfig {
                name: t.name.clone(),
                tier: if t.is_batch() { Tier::Batch } else { Tier::Interactive },
                bucket_capacity: t.burst,
                rpm: t.rpm,
                concurrency_max: t.max_concurrent,
                weight: t.weight,
                overflow: Overflow::Gate { depth_max: t.queue },
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[[tenant]]
name = "quiet"
keys = ["key-quiet"]
rpm = 60
burst = 5
weight = 1
max_concurrent = 4
tier = "interactive"
max_stream_seconds = 60

[[tenant]]
name = "flood"
keys = ["key-flood", "key-flood-2"]
rpm = 1800
burst = 30
max_concurrent = 8
tier = "batch"
"#;

    #[test]
    fn the_issue_form_parses_and_keys_map_to_tenants() {
        let t = Tenants::parse(GOOD).unwrap();
        assert_eq!(t.tenant_of(Some("key-quiet")), Some(0));
        assert_eq!(t.tenant_of(Some("key-flood-2")), Some(1));
        assert_eq!(t.tenant_of(Some("nope")), None);
        assert_eq!(t.tenant_of(None), None);
        let c = t.sched_configs();
        assert_eq!((c[1].tier, c[1].concurrency_max), (Tier::Batch, 8));
        assert_eq!(t.get(0).max_stream_seconds, Some(60.0));
    }

    #[test]
    fn mistakes_name_the_field() {
        let typo = GOOD.replace("max_concurrent = 4", "max_concurent = 4");
        assert!(Tenants::parse(&typo).unwrap_err().contains("max_concurent"));
        let tier = GOOD.replace("\"interactive\"", "\"gold\"");
        assert!(Tenants::parse(&tier).unwrap_err().contains("tier"));
        let dup = GOOD.replace("key-flood-2", "key-quiet");
        assert!(Tenants::parse(&dup).unwrap_err().contains("two tenants"));
        let rpm = GOOD.replace("rpm = 60", "rpm = 0");
        assert!(Tenants::parse(&rpm).unwrap_err().contains("rpm"));
        assert!(Tenants::parse("").is_err());
        for group in ["\"\"", "\"a b\"", "\"acme/x\"", "\"acme:x\""] {
            let bad = GOOD.replace(
                "max_stream_seconds = 60",
                &format!("max_stream_seconds = 60\nprefix_group = {group}"),
            );
            let e = Tenants::parse(&bad).unwrap_err();
            assert!(e.contains("\"quiet\"") && e.contains("prefix_group"), "{group}: {e}");
        }
    }

    #[test]
    fn prefix_namespace_is_the_group_else_the_name() {
        let t = Tenants::parse(&GOOD.replace(
            "max_stream_seconds = 60",
            "max_stream_seconds = 60\nprefix_group = \"shared-1\"",
        ))
        .unwrap();
        assert_eq!(t.get(0).prefix_group.as_deref(), Some("shared-1"));
        assert_eq!(t.prefix_namespaces(), ["shared-1", "flood"]);
        assert_eq!(Tenants::parse(GOOD).unwrap().prefix_namespaces(), ["quiet", "flood"]);
        assert_eq!(Tenants::open().prefix_namespaces(), ["default"], "open mode: one namespace");
    }

    #[test]
    fn durations_past_a_week_are_refused_not_panicked_on() {
        for bad in ["1e30", "604801", "0", "-5", "nan", "inf"] {
            let t = GOOD.replace("max_stream_seconds = 60", &format!("max_stream_seconds = {bad}"));
            let e = Tenants::parse(&t).unwrap_err();
            assert!(e.contains("max_stream_seconds") && e.contains("604800"), "{bad}: {e}");
        }
        let week = GOOD.replace("max_stream_seconds = 60", "max_stream_seconds = 604800");
        let t = Tenants::parse(&week).unwrap();
        // What the server computes from it cannot overflow.
        let fence = std::time::Duration::from_secs_f64(t.get(0).max_stream_seconds.unwrap());
        assert!(std::time::Instant::now().checked_add(fence).is_some());
    }
}
