//! `fastlane_hist::report`, the library behind `fastlane hist` (whose output the CLI tests
//! check): a comparison pairs the tags two logs share and notes the others, refuses logs with
//! no tag in common naming both files, and an unreadable log is named in the error.

use fastlane_hist::report::{compare, table, Format};
use fastlane_hist::synth::{write_synthetic_hlog, Distribution, SyntheticStream};
use fastlane_hist::HistError;

fn stream(tag: &str, low_ns: u64) -> SyntheticStream {
    let d = Distribution::Sequence { low_ns, high_ns: low_ns + 999 };
    SyntheticStream::new(d, 1000, 2).tagged(tag)
}

#[test]
fn comparison_pairs_shared_tags_and_notes_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, c) =
        (dir.path().join("a.hlog"), dir.path().join("b.hlog"), dir.path().join("c.hlog"));
    write_synthetic_hlog(&a, &[stream("read", 1000), stream("write", 5000)]).unwrap();
    write_synthetic_hlog(&b, &[stream("read", 2000), stream("sync", 9000)]).unwrap();
    write_synthetic_hlog(&c, &[stream("open", 100), stream("close", 200)]).unwrap();

    let r = compare(&a, &b, None, Format::Json).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&r.text).unwrap();
    let comparisons = v["comparisons"].as_array().unwrap();
    assert_eq!(comparisons.len(), 1, "only `read` is in both: {v}");
    assert_eq!(comparisons[0]["tag"], "read");
    assert_eq!(r.series.len(), 2, "A and B of the one pair");
    assert!(r.series[1].summary().p50_ns > r.series[0].summary().p50_ns);
    assert_eq!(r.notes.len(), 2, "{:?}", r.notes);
    assert!(r.notes.iter().any(|n| n.contains("write") && n.contains("a.hlog")), "{:?}", r.notes);
    assert!(r.notes.iter().any(|n| n.contains("sync") && n.contains("b.hlog")), "{:?}", r.notes);
    assert!(r.plot_svg().contains("a.hlog [read]"));

    let e = compare(&a, &c, None, Format::Table).unwrap_err();
    assert!(matches!(e, HistError::Report { .. }), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains("a.hlog") && text.contains("c.hlog") && text.contains("no tag"),
        "{text}"
    );

    let rows = table(&[&a, &c], None, Format::Csv).unwrap();
    let csv = String::from_utf8(rows.text).unwrap();
    assert_eq!(csv.lines().count(), 1 + 4, "a header and one row per tag: {csv}");
    assert_eq!(rows.series.len(), 4);
}

#[test]
fn an_unreadable_log_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.hlog");
    std::fs::write(&bad, "#[StartTime: 1 (seconds since epoch)]\nnot,a,histogram\n").unwrap();
    for path in [bad, dir.path().join("missing.hlog")] {
        let e = table(&[&path], None, Format::Table).unwrap_err();
        assert!(matches!(e, HistError::Reading { .. } | HistError::Io { .. }), "{e:?}");
        assert!(e.to_string().contains(path.file_name().unwrap().to_str().unwrap()), "{e}");
    }
}
