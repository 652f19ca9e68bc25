//! A segment directory built by hand with the format's helpers (superblocks installed by
//! `SegmentDir`, frames written with `encode_frame` continuing the chain): it verifies and
//! reads back, and every edit across segments is named.

use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use fastlane_journal::format::{
    encode_frame, frame_len, Chain, Superblock, DATA_OFFSET, FRAME_HEADER_LEN, SUPER_LEN_V2,
};
use fastlane_journal::segments::{read_segment_superblock, segment_name};
use fastlane_journal::{
    read_from, scan, verify_dir, Anchor, DirProblem, Durability, Problem, ReadEnd, Retention,
    SegmentDir,
};

const SEG_BYTES: u64 = 64 << 10;
const DAY_NS: u64 = 86_400 * 1_000_000_000;

/// The producer id record `seq` carries.
fn producer(seq: u64) -> u32 {
    (seq % 5) as u32 * 1000
}

fn payload(seq: u64) -> Vec<u8> {
    format!("record {seq} {}", "x".repeat((seq % 40) as usize)).into_bytes()
}

/// What was built.
struct Built {
    /// Per segment: (path, first seq, last seq, final chain value).
    segs: Vec<(PathBuf, u64, u64, Chain)>,
}

/// Writes frames `seqs` into the segment at `path` from its first frame on; returns the
/// last one's chain value.
fn write_frames(
    path: &Path,
    sb: &Superblock,
    mut head: Chain,
    seqs: std::ops::Range<u64>,
) -> Chain {
    let f = OpenOptions::new().write(true).open(path).unwrap();
    let key = sb.chain_key();
    let mut off = DATA_OFFSET;
    for seq in seqs {
        let p = payload(seq);
        let mut buf = vec![0u8; frame_len(p.len())];
        buf[FRAME_HEADER_LEN..FRAME_HEADER_LEN + p.len()].copy_from_slice(&p);
        let ts = 1_700_000_000_000_000_000 + seq;
        head = encode_frame(
            &mut buf,
            &key,
            &head,
            seq,
            ts,
            producer(seq),
            p.len(),
            &mut crc32c::crc32c_append,
        );
        f.write_all_at(&buf, off).unwrap();
        off += buf.len() as u64;
    }
    head
}

/// Segments of `counts[i]` records each, rolled on days 1, 2, 3, … (segment i created on
/// day i + 1).
fn build(dir: &Path, counts: &[u64]) -> Built {
    let mut d = SegmentDir::open(dir, true).unwrap();
    let mut sb = Superblock::new([0x42; 16], DAY_NS, 1, 64 << 10, 1024, Durability::Local);
    let mut head = [0u8; 16];
    let mut seq = 1;
    let mut segs = Vec::new();
    for (i, &n) in counts.iter().enumerate() {
        if i > 0 {
            sb = sb.next_segment((i as u64 + 1) * DAY_NS, seq, head);
        }
        let path = d.install(&sb, SEG_BYTES).unwrap();
        head = write_frames(&path, &sb, sb.genesis(), seq..seq + n);
        segs.push((path, seq, seq + n - 1, head));
        seq += n;
    }
    Built { segs }
}

#[test]
fn three_segments_verify_and_read_back() {
    let tmp = tempfile::tempdir().unwrap();
    let b = build(tmp.path(), &[30, 25, 20]);
    let r = verify_dir(tmp.path(), Anchor::default()).unwrap();
    assert_eq!(r.problem, None, "{r:?}");
    assert_eq!((r.segments, r.first_segment, r.last_segment, r.first_seq), (3, 0, 2, 1));
    assert_eq!((r.records, r.last_seq, r.head), (75, 75, b.segs[2].3));
    // The anchor: right passes, wrong is named.
    let right = Anchor { last_seq: Some(75), head: Some(b.segs[2].3) };
    assert_eq!(verify_dir(tmp.path(), right).unwrap().problem, None);
    let wrong = Anchor { last_seq: Some(76), head: None };
    let p = verify_dir(tmp.path(), wrong).unwrap().problem.unwrap();
    assert!(matches!(p, DirProblem::Anchor(Problem::AnchorMismatch { last_seq: 75, .. })), "{p}");

    // Every record, in order, with its producer id.
    let mut seen = Vec::new();
    let stop = read_from(tmp.path(), 0, &mut |h, p| {
        assert_eq!(p, payload(h.seq));
        assert_eq!(h.flags, producer(h.seq));
        seen.push(h.seq);
        true
    })
    .unwrap();
    assert_eq!(seen, (1..=75).collect::<Vec<_>>());
    assert_eq!(
        (stop.visited, stop.last_seq, stop.head, stop.end),
        (75, 75, b.segs[2].3, ReadEnd::End)
    );

    // The single-file scan reads the producer id of a segment too.
    let mut flags = Vec::new();
    scan(&mut fs::File::open(&b.segs[1].0).unwrap(), &mut |v| {
        flags.push((v.header.seq, v.header.flags));
        true
    })
    .unwrap();
    assert_eq!(flags.len(), 25);
    assert!(flags.iter().all(|&(s, f)| f == producer(s)));
}

#[test]
fn read_from_the_middle_of_segment_two_and_stop() {
    let tmp = tempfile::tempdir().unwrap();
    let b = build(tmp.path(), &[30, 25, 20]);
    let mut seen = Vec::new();
    let stop = read_from(tmp.path(), 40, &mut |h, _| {
        seen.push(h.seq);
        true
    })
    .unwrap();
    assert_eq!(seen, (40..=75).collect::<Vec<_>>());
    assert_eq!((stop.visited, stop.first_seq, stop.end), (36, 31, ReadEnd::End));
    // The visitor stops at 60: the walk says so, and where.
    let mut n = 0;
    let stop = read_from(tmp.path(), 50, &mut |h, _| {
        n += 1;
        h.seq < 60
    })
    .unwrap();
    assert_eq!((n, stop.visited, stop.last_seq, stop.end), (11, 11, 60, ReadEnd::Visitor));
    // Resuming after it continues the chain.
    let mut next = Vec::new();
    read_from(tmp.path(), stop.last_seq + 1, &mut |h, _| {
        next.push(h.seq);
        true
    })
    .unwrap();
    assert_eq!(next.first(), Some(&61));
    // From before what retention left: starts at the first present record, says so.
    let mut d = SegmentDir::open(tmp.path(), false).unwrap();
    let gone = d.retain(&Retention { max_segments: Some(2), ..Default::default() }).unwrap();
    assert_eq!(gone.len(), 1);
    drop(d);
    let mut first = None;
    let stop = read_from(tmp.path(), 5, &mut |h, _| {
        first.get_or_insert(h.seq);
        true
    })
    .unwrap();
    assert_eq!((first, stop.first_seq, stop.last_seq), (Some(31), 31, 75));
    let r = verify_dir(tmp.path(), Anchor::default()).unwrap();
    assert_eq!(r.problem, None);
    assert_eq!(
        (r.segments, r.first_segment, r.first_seq, r.records, r.head),
        (2, 1, 31, 45, b.segs[2].3)
    );
}

/// A writer in the middle of a frame of the active segment: the reader stops there, cleanly.
#[test]
fn an_incomplete_frame_in_the_active_segment_is_the_end() {
    let tmp = tempfile::tempdir().unwrap();
    let b = build(tmp.path(), &[10, 10]);
    let (path, _, last, _) = &b.segs[1];
    // The next frame's header, without its payload (what a reader racing a write sees).
    let sb = read_segment_superblock(path).unwrap();
    let mut off = DATA_OFFSET;
    for seq in sb.first_seq..=*last {
        off += frame_len(payload(seq).len()) as u64;
    }
    let p = payload(last + 1);
    let mut buf = vec![0u8; frame_len(p.len())];
    buf[FRAME_HEADER_LEN..FRAME_HEADER_LEN + p.len()].copy_from_slice(&p);
    encode_frame(
        &mut buf,
        &sb.chain_key(),
        &b.segs[1].3,
        last + 1,
        1,
        0,
        p.len(),
        &mut crc32c::crc32c_append,
    );
    let f = OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(&buf[..FRAME_HEADER_LEN], off).unwrap();
    let mut n = 0;
    let stop = read_from(tmp.path(), 1, &mut |_, _| {
        n += 1;
        true
    })
    .unwrap();
    assert_eq!((n, stop.last_seq, stop.end), (20, 20, ReadEnd::End));
    // The same bytes in a closed segment are damage.
    let b2 = tempfile::tempdir().unwrap();
    let built = build(b2.path(), &[10, 10]);
    let first = &built.segs[0].0;
    let mut end = DATA_OFFSET;
    for seq in 1..=10 {
        end += frame_len(payload(seq).len()) as u64;
    }
    OpenOptions::new()
        .write(true)
        .open(first)
        .unwrap()
        .write_all_at(&buf[..FRAME_HEADER_LEN], end)
        .unwrap();
    let stop = read_from(b2.path(), 1, &mut |_, _| true).unwrap();
    assert!(
        matches!(stop.end, ReadEnd::Problem(DirProblem::InSegment { index: 0, .. })),
        "{stop:?}"
    );
}

fn first_problem(dir: &Path) -> DirProblem {
    let r = verify_dir(dir, Anchor::default()).unwrap();
    let found = r.problem.clone();
    found.unwrap_or_else(|| panic!("not found: {r:?}"))
}

#[test]
fn a_changed_payload_in_segment_two_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let b = build(tmp.path(), &[30, 25, 20]);
    let path = &b.segs[1].0;
    let mut img = fs::read(path).unwrap();
    let at = img.windows(10).position(|w| w == b"record 40 ").unwrap();
    img[at + 7] ^= 0x01;
    fs::write(path, &img).unwrap();
    let r = verify_dir(tmp.path(), Anchor::default()).unwrap();
    assert_eq!((r.records, r.last_seq), (39, 39), "intact up to the changed record");
    match r.problem.unwrap() {
        DirProblem::InSegment {
            path: p,
            index: 1,
            problem: Problem::Changed { after_seq: 39, .. },
        } => {
            assert_eq!(&p, path)
        }
        p => panic!("{p}"),
    }
    // read_from stops there too.
    let stop = read_from(tmp.path(), 1, &mut |_, _| true).unwrap();
    assert_eq!(stop.last_seq, 39);
    assert!(matches!(stop.end, ReadEnd::Problem(DirProblem::InSegment { index: 1, .. })));
}

#[test]
fn a_removed_middle_segment_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let b = build(tmp.path(), &[30, 25, 20]);
    fs::remove_file(&b.segs[1].0).unwrap();
    match first_problem(tmp.path()) {
        DirProblem::Missing { first: 1, last: 1, after_seq: 30, path } => {
            assert_eq!(path, b.segs[2].0)
        }
        p => panic!("{p}"),
    }
    let text = first_problem(tmp.path()).to_string();
    assert!(text.contains("segments 1..=1 missing") && text.contains("after seq 30"), "{text}");
}

#[test]
fn a_wrong_prev_head_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let b = build(tmp.path(), &[30, 25, 20]);
    // Segment 2's superblock rewritten with a valid CRC but another previous head.
    let path = &b.segs[2].0;
    let sb = read_segment_superblock(path).unwrap();
    let mut forged = [0u8; SUPER_LEN_V2];
    Superblock { prev_head: [0xEE; 16], ..sb }.encode(&mut forged);
    OpenOptions::new().write(true).open(path).unwrap().write_all_at(&forged, 0).unwrap();
    match first_problem(tmp.path()) {
        DirProblem::PrevHead { index: 2, after_seq: 55, expected, found, .. } => {
            assert_eq!((expected, found), (b.segs[1].3, [0xEE; 16]));
        }
        p => panic!("{p}"),
    }
    // Records cut from the end of segment 1 (its last frame zeroed): segment 2 no longer
    // continues its chain.
    let tmp2 = tempfile::tempdir().unwrap();
    let b2 = build(tmp2.path(), &[30, 25, 20]);
    let mut img = fs::read(&b2.segs[1].0).unwrap();
    let at = img.windows(10).position(|w| w == b"record 55 ").unwrap() - FRAME_HEADER_LEN;
    img[at..].fill(0);
    fs::write(&b2.segs[1].0, &img).unwrap();
    let p = first_problem(tmp2.path());
    assert!(matches!(p, DirProblem::FirstSeq { index: 2, found: 56, expected: 55, .. }), "{p}");
    assert!(p.to_string().contains(&b2.segs[2].0.display().to_string()), "{p}");
}

#[test]
fn swapped_segments_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let b = build(tmp.path(), &[30, 25, 20]);
    let (one, two) = (&b.segs[1].0, &b.segs[2].0);
    let tmp_name = tmp.path().join("swap");
    fs::rename(one, &tmp_name).unwrap();
    fs::rename(two, one).unwrap();
    fs::rename(&tmp_name, two).unwrap();
    match first_problem(tmp.path()) {
        DirProblem::Misnamed { named: 1, found: 2, path } => assert_eq!(&path, one),
        p => panic!("{p}"),
    }
}

#[test]
fn another_journals_segment_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let other = tempfile::tempdir().unwrap();
    let b = build(tmp.path(), &[5, 5]);
    let o = build(other.path(), &[5, 5]);
    // Same journal id in `build`: give the intruder another one by rebuilding its
    // superblock and frames.
    let sb = read_segment_superblock(&o.segs[1].0).unwrap();
    let sb = Superblock { journal_id: [0x43; 16], ..sb };
    let mut block = vec![0u8; DATA_OFFSET as usize];
    sb.encode(&mut block);
    OpenOptions::new().write(true).open(&o.segs[1].0).unwrap().write_all_at(&block, 0).unwrap();
    write_frames(&o.segs[1].0, &sb, sb.genesis(), 6..11);
    fs::copy(&o.segs[1].0, &b.segs[1].0).unwrap();
    let p = first_problem(tmp.path());
    assert!(matches!(p, DirProblem::JournalId { index: 1, .. }), "{p}");
    assert_eq!(segment_name(1), b.segs[1].0.file_name().unwrap().to_str().unwrap());
}
