//! The CI check of the C header: `include/fastlane_journal.h` must be what cbindgen writes from
//! this source today, so that a changed signature or doc comment cannot ship with a stale
//! header.

#[path = "../gen/header.rs"]
mod header;

#[test]
fn checked_in_header_is_current() {
    let want = header::generate().expect("cbindgen could not read the crate");
    let path = header::header_path();
    let have = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    if have != want {
        let line = have
            .lines()
            .zip(want.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| have.lines().count().min(want.lines().count()));
        panic!(
            "{} is stale (first difference at line {}: checked in {:?}, generated {:?}).\n\
             Run `cargo run -p fastlane-journal-c --example gen-header` and commit the header.",
            path.display(),
            line + 1,
            have.lines().nth(line).unwrap_or("<end of file>"),
            want.lines().nth(line).unwrap_or("<end of file>"),
        );
    }
}

/// The header has only ASCII and C comments a C89-era tool chain can read, and every
/// exported function of the library is declared in it.
#[test]
fn header_declares_every_function() {
    let text = std::fs::read_to_string(header::header_path()).unwrap();
    assert!(text.is_ascii(), "the header should be plain ASCII");
    for f in [
        "int fl_journal_connect(",
        "int fl_journal_connect_with(",
        "int fl_journal_append(",
        "int fl_journal_append_blocking(",
        "uint64_t fl_journal_durable_seq(",
        "int fl_journal_wait_durable(",
        "uint32_t fl_journal_producer_id(",
        "size_t fl_journal_max_record_bytes(",
        "void fl_journal_close(",
        "const char *fl_journal_strerror(",
        "const char *fl_journal_last_error(",
        "FL_JOURNAL_OK = 0,",
        "typedef struct fl_journal_producer fl_journal_producer;",
    ] {
        assert!(text.contains(f), "the header lacks {f:?}");
    }
}

/// docs/journal-c.md lists every result code with the value the header gives it (a row
/// "| `FL_JOURNAL_X` | -n |"), so that a renumbered or added code cannot leave the table stale.
#[test]
fn docs_list_every_code_with_its_value() {
    let header = std::fs::read_to_string(header::header_path()).unwrap();
    let docs_path = header::crate_dir().join("../docs/journal-c.md");
    let docs = std::fs::read_to_string(&docs_path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", docs_path.display()));
    let codes: Vec<(&str, &str)> = header
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("FL_JOURNAL_"))
        .filter_map(|l| l.trim_end_matches(',').split_once(" = "))
        .collect();
    assert_eq!(codes.len(), 13, "the header's codes: {codes:?}");
    for (name, value) in codes {
        let row = format!("| `{name}` | {value} |");
        assert!(docs.contains(&row), "docs/journal-c.md has no row {row:?}");
    }
}
