//! The workspace's dependency rules, read from `cargo tree` (normal dependencies, each crate
//! resolved on its own, as a user of that crate alone would build it): a crate that gains a
//! dependency across a boundary fails here.

use std::collections::BTreeSet;
use std::process::Command;

/// The FastLane crates `package` links (itself excluded).
fn links(package: &str) -> BTreeSet<String> {
    let out = Command::new(env!("CARGO"))
        .args(["tree", "--offline", "-e", "normal", "--prefix", "none", "-f", "{p}", "-p", package])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree -p {package}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let found: BTreeSet<String> = text
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with("fastlane"))
        .map(str::to_string)
        .collect();
    assert!(found.contains(package), "cargo tree -p {package} lists the package itself: {text}");
    found.into_iter().filter(|n| n != package).collect()
}

fn assert_links_none(package: &str, forbidden: &[&str]) {
    let l = links(package);
    for f in forbidden {
        assert!(!l.contains(*f), "{package} must not link {f}; it links {l:?}");
    }
}

#[test]
fn the_router_links_neither_the_engine_nor_the_swap_tier() {
    assert_links_none("fastlane-openai", &["fastlane-llm", "fastlane-kvswap", "fastlane-rdma"]);
    let l = links("fastlane-openai");
    assert!(l.contains("fastlane-sched") && l.contains("fastlane-daemon"), "{l:?}");
}

#[test]
fn the_scheduler_links_the_swap_tier_only_for_its_simulator() {
    assert_links_none("fastlane-sched", &["fastlane-kvswap", "fastlane-llm", "fastlane-openai"]);
    assert_links_none("fastlane-kvswap", &["fastlane-sched", "fastlane-llm", "fastlane-openai"]);
}

#[test]
fn the_disk_and_the_daemon_toolkit_link_no_llm_crate() {
    let llm = ["fastlane-llm", "fastlane-openai", "fastlane-sched", "fastlane-kvswap"];
    assert_links_none("fastlane-vhost-blk", &llm);
    // The disk daemon builds and runs without the LLM crates and the benchmarks.
    assert_links_none("fastlane-disk", &[&llm[..], &["fastlane-bench"]].concat());
    assert!(links("fastlane-daemon").is_empty(), "the toolkit links no FastLane crate");
}

#[test]
fn market_data_knows_nothing_of_the_card_and_the_util_crate_nothing_at_all() {
    assert_links_none("fastlane-market", &["fastlane-fpga"]);
    assert!(links("fastlane-util").is_empty());
}

#[test]
fn the_facade_re_exports_every_library_crate() {
    let manifest = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"))
        .expect("workspace manifest");
    let lib = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lib.rs"))
        .expect("facade");
    let members = manifest.lines().find(|l| l.starts_with("members = [")).expect("members line");
    let crates: Vec<&str> = members
        .split('"')
        .skip(1)
        .step_by(2)
        // The CLI is a binary; fastlane-journal-c is a C library (cdylib + staticlib, no rlib).
        .filter(|m| !m.starts_with("tests/") && !["fastlane-cli", "fastlane-journal-c"].contains(m))
        .collect();
    assert!(crates.len() >= 15, "{crates:?}");
    for c in crates {
        let ident = c.replace('-', "_");
        assert!(lib.contains(&format!("pub use {ident}")), "src/lib.rs re-exports {c}");
    }
}
