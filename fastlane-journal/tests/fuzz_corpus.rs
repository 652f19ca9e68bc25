//! Replays the committed fuzz corpus of `fastlane-journal/fuzz` (the attach hello and the
//! journal file image) through the fuzz targets' oracles, then seeded mutations of each seed
//! (bytes overwritten, bits flipped, ranges copied over, the image cut short), so the corpus
//! is a regression suite and a small fuzzing run in every `cargo test`.

use std::path::{Path, PathBuf};

use fastlane_journal::fuzzing::{check_hello, check_image};
use fastlane_util::SplitMix64;

fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus").join(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| {
            let data = std::fs::read(&p).unwrap();
            (p, data)
        })
        .collect();
    files.sort();
    files
}

/// Seeded: the same mutations on every run.
struct Rng(SplitMix64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// One to four mutations of `seed`.
fn mutate(seed: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut d = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        if d.is_empty() {
            break;
        }
        match rng.below(4) {
            0 => {
                let i = rng.below(d.len());
                d[i] = rng.next() as u8;
            }
            1 => {
                let i = rng.below(d.len());
                d[i] ^= 1 << rng.below(8);
            }
            2 => {
                let (from, to) = (rng.below(d.len()), rng.below(d.len()));
                let n = rng.below(64).min(d.len() - from).min(d.len() - to);
                d.copy_within(from..from + n, to);
            }
            _ => d.truncate(rng.below(d.len() + 1)),
        }
    }
    d
}

#[test]
fn attach_hello_corpus_and_mutations() {
    let seeds = corpus("attach_hello");
    assert!(seeds.len() >= 3, "expected the committed seed corpus, found {}", seeds.len());
    let mut rng = Rng(SplitMix64::new(0x5eed_0001));
    for (path, data) in &seeds {
        check_hello(data);
        for _ in 0..2000 {
            let m = mutate(data, &mut rng);
            check_hello(&m);
        }
        eprintln!("{}: 2000 mutations", path.display());
    }
}

#[test]
fn journal_file_corpus_and_mutations() {
    let seeds = corpus("journal_file");
    assert!(seeds.len() >= 2, "expected the committed seed corpus, found {}", seeds.len());
    let mut rng = Rng(SplitMix64::new(0x5eed_0002));
    for (path, data) in &seeds {
        // The seeds are real, intact journals: all their records must scan.
        let records = check_image(data);
        assert!(records >= 3, "{}: {records} intact records", path.display());
        let mut fewer = 0;
        for _ in 0..3000 {
            let m = mutate(data, &mut rng);
            if check_image(&m) < records {
                fewer += 1;
            }
        }
        // Most mutations land in a frame or the superblock: the damage must be seen.
        assert!(fewer > 1000, "{}: only {fewer} of 3000 mutations cut the chain", path.display());
        eprintln!("{}: {records} records, {fewer} of 3000 mutations cut the chain", path.display());
    }
}
