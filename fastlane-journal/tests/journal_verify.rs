//! Tamper evidence: flipping any byte of a closed journal is found by `verify`, and removed,
//! reordered and re-checksummed records are named as such.

use std::sync::Arc;
use std::time::Duration;

use fastlane_block::ram::RamDisk;
use fastlane_block::BlockDevice;
use fastlane_journal::format::{decode_header, frame_len, DATA_OFFSET};
use fastlane_journal::{verify, Anchor, Durability, Journal, JournalConfig, Problem};

const RECORDS: u64 = 40;

/// A closed journal of `RECORDS` records on a 24 KiB device, as bytes.
fn closed_journal() -> Vec<u8> {
    let dev = Arc::new(RamDisk::new(24 << 10, 512).unwrap());
    let mut c = JournalConfig::new(Arc::clone(&dev) as Arc<dyn BlockDevice>, Durability::Local);
    c.ring_bytes = 16 << 10;
    c.max_record_bytes = 256;
    c.max_batch_bytes = 8 << 10;
    let j = Journal::create(c).unwrap();
    let mut tx = j.producer().unwrap();
    for i in 0..RECORDS {
        let body = format!("order {i} qty {} px {}", i * 100, 1000 + i);
        tx.append_blocking(body.as_bytes(), Duration::from_secs(5)).unwrap();
    }
    tx.wait_durable(RECORDS, Duration::from_secs(5)).unwrap();
    drop(tx);
    j.close().unwrap();
    let mut img = vec![0u8; 24 << 10];
    dev.read_at(0, &mut img).unwrap();
    img
}

/// `(offset, length)` of every frame.
fn frames(img: &[u8]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut off = DATA_OFFSET as usize;
    while let Ok(h) = decode_header(&img[off..off + 48], 256) {
        let n = frame_len(h.len as usize);
        out.push((off, n));
        off += n;
    }
    out
}

#[test]
fn every_byte_flip_is_found() {
    let img = closed_journal();
    let clean = verify(&mut &img[..], Anchor::default()).unwrap();
    assert_eq!(clean.problem, None);
    assert_eq!((clean.records, clean.last_seq), (RECORDS, RECORDS));
    let end = clean.end as usize;
    // Every byte of the superblock and the frames; every 13th byte of the (zero) rest.
    let mut offsets: Vec<usize> = (0..end).collect();
    offsets.extend((end..img.len()).step_by(13));
    let mut mask = 0x5Au8;
    for &i in &offsets {
        let mut bad = img.clone();
        mask = mask.rotate_left(3) | 1;
        bad[i] ^= mask;
        let report = verify(&mut &bad[..], Anchor::default()).unwrap();
        let problem = report.problem.unwrap_or_else(|| panic!("flip at offset {i} not found"));
        if i >= DATA_OFFSET as usize && i < end {
            // Inside a frame: named as the record it belongs to.
            let (idx, _) = frames(&img)
                .iter()
                .enumerate()
                .find(|(_, (o, n))| i >= *o && i < o + n)
                .map(|(k, f)| (k as u64 + 1, *f))
                .unwrap();
            match problem {
                Problem::Changed { after_seq, .. } => assert_eq!(after_seq + 1, idx, "flip at {i}"),
                p => panic!("flip at {i} in record {idx}: {p}"),
            }
        }
    }
}

#[test]
fn removed_reordered_and_rechecksummed_records_are_named() {
    let img = closed_journal();
    let f = frames(&img);
    assert_eq!(f.len() as u64, RECORDS);

    // Remove record 10 (index 9): splice it out.
    let (o, n) = f[9];
    let mut removed = img[..o].to_vec();
    removed.extend_from_slice(&img[o + n..]);
    removed.resize(img.len(), 0);
    let p = verify(&mut &removed[..], Anchor::default()).unwrap().problem;
    assert_eq!(p, Some(Problem::Removed { offset: o as u64, first: 10, last: 10 }), "{p:?}");

    // Swap records 20 and 21.
    let (a, an) = f[19];
    let (b, bn) = f[20];
    let mut swapped = img[..a].to_vec();
    swapped.extend_from_slice(&img[b..b + bn]);
    swapped.extend_from_slice(&img[a..a + an]);
    swapped.extend_from_slice(&img[b + bn..]);
    let p = verify(&mut &swapped[..], Anchor::default()).unwrap().problem;
    assert!(matches!(p, Some(Problem::Reordered { seq: 21, after_seq: 19, .. })), "{p:?}");

    // Change a payload byte of record 30 and fix up its CRC32C: the chain still catches it.
    let (o, n) = f[29];
    let mut forged = img.clone();
    forged[o + 48] ^= 0x01;
    let crc = crc32c::crc32c_append(crc32c::crc32c(&forged[o..o + 44]), &forged[o + 48..o + n]);
    forged[o + 44..o + 48].copy_from_slice(&crc.to_le_bytes());
    let p = verify(&mut &forged[..], Anchor::default()).unwrap().problem;
    assert!(
        matches!(p, Some(Problem::Changed { after_seq: 29, seq: Some(30), what, .. }) if what.contains("chain")),
        "{p:?}"
    );

    // Truncate the last record cleanly: only an anchor kept elsewhere can tell.
    let (o, _) = f[39];
    let mut cut = img.clone();
    cut[o..].fill(0);
    assert_eq!(verify(&mut &cut[..], Anchor::default()).unwrap().problem, None);
    let anchor = Anchor { last_seq: Some(RECORDS), head: None };
    assert!(matches!(
        verify(&mut &cut[..], anchor).unwrap().problem,
        Some(Problem::AnchorMismatch { last_seq: 39, .. })
    ));
}
