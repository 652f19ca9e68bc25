//! End-to-end tests of `fastlane itch`: the built binary against the library's own answers on
//! the same generated feeds.

use std::path::Path;

use fastlane_market::book::{BookConfig, OrderBooks};
use fastlane_market::filter::SymbolFilter;
use fastlane_market::gen::{generate, GenConfig};
use fastlane_market::itch::{price4_to_string, stock_from_str, FeedReader};
use serde_json::Value;

mod common;

use common::cli::fastlane;

fn json_of(args: &[&str]) -> Value {
    let out = fastlane(args);
    assert!(out.status.success(), "fastlane {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("json")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The library's final top of book as (locate, bid, bid shares, ask, ask shares).
fn expected_tops(feed: &[u8], symbols: &[&str]) -> Vec<(u64, String, u64, String, u64)> {
    let mut books = OrderBooks::new(BookConfig::default());
    let wanted: Vec<_> = symbols.iter().map(|s| stock_from_str(s)).collect();
    let mut filter = SymbolFilter::new(&wanted);
    for m in FeedReader::new(feed).flatten() {
        if symbols.is_empty() || filter.admit(&m) {
            books.apply(&m);
        }
    }
    books
        .active_locates()
        .map(|l| {
            let t = books.top(l);
            (
                u64::from(l),
                price4_to_string(t.bid_price),
                t.bid_shares,
                price4_to_string(t.ask_price),
                t.ask_shares,
            )
        })
        .collect()
}

fn tops_of(report: &Value) -> Vec<(u64, String, u64, String, u64)> {
    report["top_of_book"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["locate"].as_u64().unwrap(),
                t["bid_price"].as_str().unwrap().to_owned(),
                t["bid_shares"].as_u64().unwrap(),
                t["ask_price"].as_str().unwrap().to_owned(),
                t["ask_shares"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn gen_is_deterministic_and_matches_the_library() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.itch");
    let b = dir.path().join("b.itch");
    for p in [&a, &b] {
        let out = fastlane(&[
            "itch",
            "gen",
            "--messages",
            "5000",
            "--symbols",
            "4",
            "--seed",
            "9",
            "--out",
            s(p),
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let bytes = std::fs::read(&a).unwrap();
    assert_eq!(bytes, std::fs::read(&b).unwrap());
    let cfg = GenConfig { messages: 5000, symbols: 4, seed: 9, itchy_compatible: false };
    assert_eq!(bytes, generate(&cfg));
}

#[test]
fn replay_reports_stats_and_the_final_top_of_book() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("feed.itch");
    let feed =
        generate(&GenConfig { messages: 30_000, symbols: 5, seed: 4, itchy_compatible: false });
    std::fs::write(&path, &feed).unwrap();
    let r = json_of(&["itch", "replay", s(&path), "--json"]);
    assert_eq!(r["messages"], 30_000);
    assert_eq!(r["bytes"].as_u64().unwrap(), feed.len() as u64);
    assert_eq!(r["errors"]["unknown_type"], 0);
    assert_eq!(r["book"]["unknown_ref"], 0);
    let by_type: u64 =
        r["by_type"].as_object().unwrap().values().map(|v| v.as_u64().unwrap()).sum();
    assert_eq!(by_type, 30_000);
    let tops = tops_of(&r);
    assert_eq!(tops.len(), 5);
    assert_eq!(tops, expected_tops(&feed, &[]));
    assert_eq!(r["top_of_book"][0]["symbol"], "AAPL");
    // The text form prints the same table.
    let out = fastlane(&["itch", "replay", s(&path)]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("LOCATE") && text.contains(&tops[0].1), "{text}");
}

#[test]
fn replay_through_the_card_with_a_symbol_filter_and_hlog() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("feed.itch");
    let hlog = dir.path().join("card.hlog");
    let feed =
        generate(&GenConfig { messages: 8_000, symbols: 6, seed: 2, itchy_compatible: false });
    std::fs::write(&path, &feed).unwrap();
    let args =
        ["itch", "replay", s(&path), "--through-card", "--symbol", "MSFT", "--symbol", "NVDA"];
    let r = json_of(&[&args[..], &["--hlog", s(&hlog), "--depth", "8", "--json"]].concat());
    assert_eq!(r["through_card"], true);
    assert_eq!(r["messages"], 8_000);
    assert!(r["filtered_out"].as_u64().unwrap() > 1000);
    let tops = tops_of(&r);
    assert_eq!(tops, expected_tops(&feed, &["MSFT", "NVDA"]));
    let symbols: Vec<_> =
        r["top_of_book"].as_array().unwrap().iter().map(|t| t["symbol"].clone()).collect();
    assert_eq!(symbols, ["MSFT", "NVDA"]);
    assert_eq!(r["latency"]["count"], 8_000);
    let log = fastlane_hist::read_hlog(&hlog).unwrap();
    assert_eq!(log.merged.len(), 8_000, "one latency per message in the .hlog");
}

#[test]
fn replay_of_a_damaged_feed_counts_instead_of_crashing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.itch");
    let mut feed =
        generate(&GenConfig { messages: 2_000, symbols: 3, seed: 8, itchy_compatible: false });
    feed.extend_from_slice(&[0, 3, b'Z', 1, 2]); // unknown type
    feed.extend_from_slice(&[0, 40, b'A', 0]); // truncated
    std::fs::write(&path, &feed).unwrap();
    for extra in [&[][..], &["--through-card"][..]] {
        let r = json_of(&[&["itch", "replay", s(&path), "--json"][..], extra].concat());
        assert_eq!(r["messages"], 2_000, "{extra:?}");
        assert_eq!(r["errors"]["unknown_type"], 1, "{extra:?}");
        assert_eq!(r["errors"]["truncated"], 1, "{extra:?}");
    }
    let missing = fastlane(&["itch", "replay", s(&dir.path().join("nope.itch"))]);
    assert!(!missing.status.success());
}
