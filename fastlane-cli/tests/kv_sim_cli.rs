//! End-to-end test of `fastlane kv sim`: a short scenario with `--json`, the per-tenant
//! fields, the `.hlog` (read back by `fastlane hist`) and the SVG.

use std::path::Path;

mod common;

use common::cli::{fastlane, ok};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn sim_json_hlog_and_svg() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let out = dir.path().join("out");
    let text = ok(&[
        "kv",
        "sim",
        "--scenario",
        "a",
        "--policy",
        "drr",
        "--seconds",
        "10",
        "--seed",
        "3",
        "--swap-ns-per-byte",
        "0.04",
        "--json",
        "--out",
        s(&out),
    ]);
    let v: serde_json::Value = serde_json::from_str(&text).expect("--json prints JSON");
    assert_eq!(v["simulation"], true);
    assert_eq!(v["scenario"], "a");
    assert_eq!(v["policy"], "drr");
    assert_eq!(v["seed"], 3);
    assert_eq!(v["chunk_tokens"], 512);
    let tenants = v["tenants"].as_array().unwrap();
    let names: Vec<&str> = tenants.iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["quiet", "flooder"]);
    for t in tenants {
        for key in [
            "tier",
            "submitted",
            "admitted",
            "rejected",
            "queued",
            "completed",
            "unserved",
            "tokens_per_s",
            "preempted_swap",
            "preempted_recompute",
            "swap_out_bytes",
            "swap_in_bytes",
        ] {
            assert!(!t[key].is_null(), "{key} missing in {t}");
        }
        assert_eq!(t["tier"], "interactive");
        let ttft = &t["ttft_ns"];
        let p: Vec<u64> =
            ["p50", "p95", "p99", "p99_9"].iter().map(|k| ttft[*k].as_u64().unwrap()).collect();
        assert!(p[0] > 0 && p.windows(2).all(|w| w[0] <= w[1]), "{ttft}");
        assert!(ttft["count"].as_u64().unwrap() > 0);
        let submitted = t["submitted"].as_u64().unwrap();
        let admitted = t["admitted"].as_u64().unwrap();
        let rejected = t["rejected"].as_u64().unwrap();
        assert_eq!(admitted + rejected, submitted, "{t}");
    }
    // The flooder is held to its bucket (B = 10, 60 rpm): 429s.
    let flood = &tenants[1];
    assert!(flood["rejected"].as_u64().unwrap() > flood["admitted"].as_u64().unwrap());
    assert!(flood["admitted"].as_u64().unwrap() <= 10 + 10 + 1);

    // The .hlog: every tenant's TTFT and token-gap tags, readable by `fastlane hist`.
    let stem = "sim-a-drr-chunk512-seed3";
    let hlog = out.join(format!("{stem}.hlog"));
    assert!(hlog.is_file(), "{} missing", hlog.display());
    let hist = ok(&["hist", "--json", s(&hlog)]);
    let h: serde_json::Value = serde_json::from_str(&hist).unwrap();
    let text = h.to_string();
    for tag in ["quiet.ttft", "quiet.token", "flooder.ttft", "flooder.token"] {
        assert!(text.contains(tag), "tag {tag} missing in {hist}");
    }
    let quiet = ok(&["hist", "--tag", "quiet.ttft", s(&hlog)]);
    assert!(quiet.lines().count() >= 2, "{quiet}");

    // The SVG: one well-formed document with a series per tenant.
    let svg = std::fs::read_to_string(out.join(format!("{stem}-ttft.svg"))).unwrap();
    let svg = svg.trim();
    assert!(svg.starts_with("<svg") || svg.starts_with("<?xml"), "{}", &svg[..60.min(svg.len())]);
    assert!(svg.ends_with("</svg>"));
    assert_eq!(svg.matches("<svg").count(), 1);
    assert!(svg.contains("quiet") && svg.contains("flooder"));
    assert!(svg.contains("simulation"));
    assert_well_formed(svg);
}

/// `--protect` and its knobs parse, reach the scheduler and show in the JSON, the table,
/// the file names and `--help`; misuse is refused.
#[test]
fn sim_protect_option_parses_and_is_reported() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let out = dir.path().join("out");
    let common = ["kv", "sim", "--scenario", "a", "--seconds", "10", "--swap-ns-per-byte", "0.04"];
    let with = |extra: &[&str]| -> Vec<String> {
        common.iter().chain(extra).map(|s| s.to_string()).collect()
    };
    let args = with(&[
        "--policy",
        "drr",
        "--protect",
        "--protect-cap",
        "128",
        "--protect-bucket",
        "0.25",
        "--protect-hold-ms",
        "500",
        "--json",
        "--out",
        s(&out),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let v: serde_json::Value = serde_json::from_str(&ok(&args)).expect("--json prints JSON");
    assert_eq!(v["policy"], "drr");
    let p = &v["protect"];
    assert_eq!(p["others_prefill_tokens_max"], 128, "{v}");
    assert_eq!(p["bucket_frac_min"], 0.25);
    assert_eq!(p["hold_ns_max"], 500_000_000u64);
    assert!(p["capped_steps"].as_u64().is_some() && p["released_steps"].as_u64().is_some());
    assert!(out.join("sim-a-drr-protect128-chunk512-seed1.hlog").is_file());

    // Without --protect the field is null; the table names the option when it is on.
    let args = with(&["--policy", "drr", "--json", "--out", s(&out)]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let v: serde_json::Value = serde_json::from_str(&ok(&args)).unwrap();
    assert!(v["protect"].is_null(), "{}", v["protect"]);
    let args = with(&["--policy", "drr+preempt", "--protect", "--out", s(&out)]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let table = ok(&args);
    assert!(table.contains("policy drr+preempt +protect(cap 0)"), "{table}");
    assert!(table.lines().any(|l| l.starts_with("protect: ") && l.contains("capped steps")));

    // Misuse: a knob without --protect, protection under fifo, a bad fraction.
    for extra in [
        &["--policy", "drr", "--protect-cap", "10"][..],
        &["--policy", "fifo", "--protect"][..],
        &["--policy", "drr", "--protect", "--protect-bucket", "2"][..],
        &["--policy", "drr", "--protect", "--protect-hold-ms", "0"][..],
    ] {
        let mut args = with(extra);
        args.extend(["--out".to_string(), s(&out).to_string()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        assert!(!fastlane(&args).status.success(), "{extra:?} was accepted");
    }

    let help = ok(&["kv", "sim", "--help"]);
    for word in ["--protect", "--protect-cap", "--protect-bucket", "--protect-hold-ms"] {
        assert!(help.contains(word), "{word} missing in --help");
    }
    assert!(help.contains("Not work-conserving"), "{help}");
}

/// Every element opened is closed in order (a small check, not a full XML parser).
fn assert_well_formed(doc: &str) {
    let mut stack: Vec<String> = Vec::new();
    let mut rest = doc;
    while let Some(i) = rest.find('<') {
        rest = &rest[i + 1..];
        let end = rest.find('>').expect("unterminated tag");
        let tag = &rest[..end];
        rest = &rest[end + 1..];
        if tag.starts_with('?') || tag.starts_with('!') {
            continue;
        }
        if let Some(name) = tag.strip_prefix('/') {
            let open = stack.pop().unwrap_or_else(|| panic!("</{name}> closes nothing"));
            assert_eq!(open, name.trim(), "mismatched </{name}>");
        } else if !tag.ends_with('/') {
            let name = tag.split_whitespace().next().unwrap_or_default();
            stack.push(name.to_string());
        }
    }
    assert!(stack.is_empty(), "unclosed: {stack:?}");
}
