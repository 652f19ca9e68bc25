//! Replays every committed fuzz corpus file of the virtio-blk request parser (`fuzz/corpus/
//! request/`) through the same checks the fuzz target runs, so the corpus is a regression
//! suite in every `cargo test`.

use fastlane_vhost_blk::request::fuzzing::parse_one;

#[test]
fn request_parser_corpus() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/request");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).expect("corpus dir") {
        let path = entry.unwrap().path();
        if path.is_file() {
            let data = std::fs::read(&path).unwrap();
            parse_one(&data);
            n += 1;
        }
    }
    assert!(n >= 10, "expected the committed seed corpus in {}, found {n} files", dir.display());
}
