//! Replays the committed seed corpora of the fuzz targets (`fuzz/corpus/{decode,book}/`)
//! through the same checks the targets run, so the corpus is a regression suite in a plain
//! `cargo test`. `FASTLANE_FPGA_WRITE_CORPUS=1` (re)writes the generated seeds.

use std::path::{Path, PathBuf};

use fastlane_market::fuzzing::{check_book, check_decoder};
use fastlane_market::gen::{generate, GenConfig};

fn dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus").join(target)
}

fn seeds() -> Vec<(String, Vec<u8>)> {
    let mut v = Vec::new();
    for (seed, messages, symbols) in [(1u64, 40u64, 1u16), (2, 200, 3), (3, 1000, 8)] {
        let feed = generate(&GenConfig { messages, symbols, seed, itchy_compatible: false });
        v.push((format!("gen-{seed}-{messages}"), feed.clone()));
        // Truncated, a flipped byte, a bogus length.
        v.push((format!("gen-{seed}-truncated"), feed[..feed.len() * 2 / 3].to_vec()));
        let mut flipped = feed.clone();
        let i = flipped.len() / 2;
        flipped[i] ^= 0x5a;
        v.push((format!("gen-{seed}-flipped"), flipped));
        let mut bogus = feed;
        bogus[0] = 0xff;
        v.push((format!("gen-{seed}-bogus-length"), bogus));
    }
    v.push(("empty".into(), Vec::new()));
    v.push(("one-byte".into(), vec![0]));
    v.push(("unknown-type".into(), vec![0, 3, b'Z', 0, 0]));
    v
}

fn replay(target: &str, check: fn(&[u8])) {
    let d = dir(target);
    if std::env::var_os("FASTLANE_FPGA_WRITE_CORPUS").is_some() {
        std::fs::create_dir_all(&d).unwrap();
        for (name, bytes) in seeds() {
            std::fs::write(d.join(name), bytes).unwrap();
        }
    }
    let mut n = 0;
    for entry in std::fs::read_dir(&d).expect("corpus dir") {
        let path = entry.unwrap().path();
        let bytes = std::fs::read(&path).unwrap();
        check(&bytes);
        n += 1;
    }
    assert!(n >= 10, "expected the committed seed corpus in {}, found {n} files", d.display());
}

#[test]
fn decoder_corpus() {
    replay("decode", check_decoder);
}

#[test]
fn book_corpus() {
    replay("book", check_book);
}

/// A poor man's fuzzer that runs in every `cargo test`: seeded random mutations (byte flips,
/// insertions, deletions, cuts) of small generated feeds through both checks.
#[test]
fn random_mutations_of_generated_feeds() {
    let mut rng = fastlane_market::gen::Rng::new(0xf022);
    for round in 0..600u64 {
        let cfg = GenConfig { messages: 60, symbols: 3, seed: round % 50, itchy_compatible: false };
        let mut feed = generate(&cfg);
        for _ in 0..1 + rng.below(6) {
            let len = feed.len() as u64;
            let at = rng.below(len.max(1)) as usize;
            match rng.below(4) {
                0 => feed[at] ^= 1 << rng.below(8),
                1 => feed.insert(at, rng.below(256) as u8),
                2 => {
                    feed.remove(at);
                }
                _ => feed.truncate(at),
            }
            if feed.is_empty() {
                break;
            }
        }
        check_decoder(&feed);
        check_book(&feed);
    }
}
