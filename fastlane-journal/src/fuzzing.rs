//! The oracles of the fuzz targets in `fastlane-journal/fuzz`, here so that
//! `tests/fuzz_corpus.rs` replays the committed corpus (and seeded mutations of it) through
//! the same checks in every `cargo test`, without cargo-fuzz.

use crate::{scan, verify, Anchor, Stop};

/// The fuzz target `attach_hello`: see [`crate::service::wire::check_hello_model`].
pub fn check_hello(data: &[u8]) {
    crate::service::wire::check_hello_model(data);
}

/// The fuzz target `journal_file`: `data` as a journal file image, corrupt or hostile, is
/// scanned (recovery) and verified (`fastlane journal verify`) without a panic, and what they
/// report stays inside the image and agrees: every frame visited lies inside it, the scan's
/// end (or the data offset, for an image cut inside its header) and any defect's offset too, and verify names the same intact prefix as the scan.
/// Returns the intact records (0 when the superblock is refused).
pub fn check_image(data: &[u8]) -> u64 {
    let len = data.len() as u64;
    let mut visited = 0u64;
    let mut image = data;
    let s = match scan(&mut image, &mut |v| {
        assert!(v.offset + v.payload.len() as u64 <= len, "frame past the image");
        visited += 1;
        true
    }) {
        Ok(s) => s,
        Err(_) => return 0,
    };
    assert_eq!(s.records, visited);
    // An image cut inside the 4096-byte header (a service segment before its first batch)
    // ends where its first frame would go.
    let end_max = len.max(crate::format::DATA_OFFSET);
    assert!(s.end <= end_max, "scan ended past the image: {} > {len}", s.end);
    assert!(s.last_seq + 1 >= s.superblock.first_seq, "{s:?}");
    if let Stop::Defect { offset, .. } | Stop::Seq { offset, .. } | Stop::Chain { offset, .. } =
        s.stop
    {
        assert!(offset < len, "defect past the image: {s:?}");
    }
    let mut image = data;
    match verify(&mut image, Anchor::default()) {
        Ok(r) => assert_eq!((r.records, r.last_seq, r.end), (s.records, s.last_seq, s.end)),
        Err(e) => panic!("verify failed to read an image the scan read: {e}"),
    }
    s.records
}
