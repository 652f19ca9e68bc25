use std::time::{Duration, UNIX_EPOCH};

use base64::Engine as _;
use hdrhistogram::serialization::interval_log::{IntervalLogIterator, LogEntry};
use hdrhistogram::serialization::Deserializer;

use super::*;
use crate::synth::{Distribution, SyntheticStream};
use crate::RecorderConfig;

fn hist(values: impl IntoIterator<Item = u64>) -> Histogram<u64> {
    let mut h = RecorderConfig::default().new_histogram().unwrap();
    for v in values {
        h.record(v).unwrap();
    }
    h
}

/// Three intervals, two tags, one untagged, one empty.
type Written = Vec<(Option<&'static str>, Histogram<u64>)>;

fn sample_log() -> (Vec<u8>, Written) {
    let intervals = vec![
        (None, hist((1..=1000).map(|v| v * 1000))),
        (Some("read"), hist([5, 5, 5, 60_000_000_000])),
        (Some("write"), hist([])),
        (Some("read"), hist((0..10_000).map(|v| 100 + v % 7))),
    ];
    let base = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let mut w = HlogWriter::with_base_time(Vec::new(), base).unwrap();
    for (i, (tag, h)) in intervals.iter().enumerate() {
        let start = Duration::from_millis(1000 * i as u64 + 5);
        w.write_histogram(*tag, start, Duration::from_millis(1000), h).unwrap();
    }
    (w.into_inner().unwrap(), intervals)
}

#[test]
fn header_matches_java_layout() {
    let (bytes, _) = sample_log();
    let text = String::from_utf8(bytes).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "#[Histogram log format version 1.3]");
    assert!(lines.contains(&"#[StartTime: 1700000000.000 (seconds since epoch)]"));
    assert!(lines.contains(&"#[BaseTime: 1700000000.000 (seconds since epoch)]"));
    let legend_at = lines.iter().position(|l| *l == LEGEND).unwrap();
    assert!(lines[..legend_at].iter().all(|l| l.starts_with('#')));
    let first = lines[legend_at + 1];
    // start,length,max(ms),payload; 1000 µs max = 1.000 ms (within histogram precision).
    assert!(first.starts_with("0.005,1.000,1.000,HISTF"), "{first}");
    assert!(lines[legend_at + 2].starts_with("Tag=read,1.005,1.000,600"), "max in ms");
    assert!(lines[legend_at + 3].starts_with("Tag=write,2.005,1.000,0.000,HISTF"));
}

#[test]
fn crate_reader_reads_what_we_write() {
    let (bytes, written) = sample_log();
    let mut deserializer = Deserializer::new();
    let mut seen = Vec::new();
    let mut start_times = 0;
    let mut base_times = 0;
    for entry in IntervalLogIterator::new(&bytes) {
        match entry.expect("hdrhistogram's iterator parses our log") {
            LogEntry::StartTime(t) => {
                start_times += 1;
                assert_eq!(t, Duration::from_secs(1_700_000_000));
            }
            LogEntry::BaseTime(_) => base_times += 1,
            LogEntry::Interval(ilh) => {
                let raw = base64::engine::general_purpose::STANDARD
                    .decode(ilh.encoded_histogram())
                    .unwrap();
                let h: Histogram<u64> = deserializer.deserialize(&mut &raw[..]).unwrap();
                seen.push((ilh.tag().map(|t| t.as_str().to_owned()), ilh.start_timestamp(), h));
            }
        }
    }
    assert_eq!((start_times, base_times), (1, 1));
    assert_eq!(seen.len(), written.len());
    let mut total_written = 0;
    let mut total_read = 0;
    for (i, ((tag, start, h), (wtag, wh))) in seen.iter().zip(&written).enumerate() {
        assert_eq!(tag.as_deref(), *wtag);
        assert_eq!(*start, Duration::from_millis(1000 * i as u64 + 5));
        assert_eq!(h.len(), wh.len(), "interval {i} count");
        assert_eq!(h, wh, "interval {i} contents");
        total_written += wh.len();
        total_read += h.len();
    }
    assert_eq!(total_read, total_written);
    assert_eq!(total_read, 1000 + 4 + 10_000);
}

#[test]
fn our_reader_round_trips() {
    let (bytes, written) = sample_log();
    let file = parse_hlog(&bytes).unwrap();
    assert_eq!(file.start_time_s, Some(1_700_000_000.0));
    assert_eq!(file.base_time_s, Some(1_700_000_000.0));
    assert_eq!(file.intervals.len(), 4);
    for (iv, (tag, h)) in file.intervals.iter().zip(&written) {
        assert_eq!(iv.tag.as_deref(), *tag);
        assert_eq!(&iv.histogram, h);
        assert_eq!(iv.length, Duration::from_secs(1));
    }
    assert_eq!(file.merged.len(), 11_004);
    assert_eq!(file.tags(), vec![None, Some("read"), Some("write")]);
    assert_eq!(file.merged_for_tag(Some("read")).unwrap().len(), 10_004);
    assert_eq!(file.merged_for_tag(Some("write")).unwrap().len(), 0);
    assert!(file.merged_for_tag(Some("nope")).is_none());
}

#[test]
fn recorder_intervals_through_the_writer() {
    let mut rec = crate::LatencyRecorder::with_max(1_000_000).unwrap();
    let mut w = HlogWriter::new(Vec::new()).unwrap();
    for round in 0..3u64 {
        for v in 0..100 {
            rec.record(v + round * 1000);
        }
        let iv = rec.take_interval();
        w.write_interval(Some("op"), &iv).unwrap();
    }
    let file = parse_hlog(&w.into_inner().unwrap()).unwrap();
    assert_eq!(file.intervals.len(), 3);
    assert_eq!(file.merged.len(), 300);
    assert!(file.intervals.windows(2).all(|p| p[0].start <= p[1].start));
}

/// Lines written by Java's HistogramLogWriter (jHiccup 2.0.7, as shipped in the hdrhistogram
/// crate's test data): we read them, and their max column is the histogram max in ms.
#[test]
fn reads_java_written_lines() {
    let log = "\
#[Logged with jHiccup version 2.0.7-SNAPSHOT]
#[Histogram log format version 1.2]
#[StartTime: 1441812279.474 (seconds since epoch), Wed Sep 09 08:24:39 PDT 2015]
\"StartTimestamp\",\"Interval_Length\",\"Interval_Max\",\"Interval_Compressed_Histogram\"
0.127,1.007,2.769,HISTFAAAAEV42pNpmSzMwMCgyAABTBDKT4GBgdnNYMcCBvsPEBEJISEuATEZMQ4uASkhIR4nrxg9v2lMaxhvMekILGZkKmcCAEf2CsI=
Tag=A,1.134,0.999,0.442,HISTFAAAAEJ42pNpmSzMwMAgxwABTBDKT4GBgdnNYMcCBvsPEBEWLj45FTExAT4pBSEBKa6UkAgBi1uM7xjfMMlwMDABAC0CCjM=
";
    let file = parse_hlog(log.as_bytes()).unwrap();
    assert_eq!(file.start_time_s, Some(1441812279.474));
    assert_eq!(file.intervals.len(), 2);
    assert_eq!(file.intervals[1].tag.as_deref(), Some("A"));
    for iv in &file.intervals {
        let max_ms = iv.histogram.max() as f64 / MAX_VALUE_DIVISOR;
        assert!(
            (max_ms - iv.max_column).abs() / iv.max_column < 0.01,
            "{max_ms} vs {}",
            iv.max_column
        );
    }
}

fn corrupt_line(bytes: &[u8]) -> (usize, String) {
    match parse_hlog(bytes) {
        Err(HistError::Corrupt { line, reason }) => (line, reason),
        other => panic!("expected Corrupt, got {other:?}"),
    }
}

/// Replace line `line` (1-based) of `text`.
fn with_line(text: &str, line: usize, replacement: &str) -> Vec<u8> {
    let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
    lines[line - 1] = replacement.to_owned();
    (lines.join("\n") + "\n").into_bytes()
}

fn first_interval_line(text: &str) -> usize {
    text.lines().position(|l| l == LEGEND).unwrap() + 2
}

#[test]
fn truncated_log_names_last_line() {
    let (bytes, _) = sample_log();
    let text = String::from_utf8(bytes.clone()).unwrap();
    let last_line = text.lines().count();
    // Cut in the middle of the last line's payload, at every offset from its start.
    let last_start = text.trim_end_matches('\n').rfind('\n').unwrap() + 1;
    for cut in last_start + 1..bytes.len() - 1 {
        let (line, reason) = corrupt_line(&bytes[..cut]);
        assert_eq!(line, last_line, "cut at {cut}: {reason}");
        assert!(reason.starts_with("truncated line"), "{reason}");
    }
    // Cut right before the final newline: a complete line, still a valid log.
    assert_eq!(parse_hlog(&bytes[..bytes.len() - 1]).unwrap().intervals.len(), 4);
}

#[test]
fn bad_base64_names_line() {
    let (bytes, _) = sample_log();
    let text = String::from_utf8(bytes).unwrap();
    let at = first_interval_line(&text) + 1;
    let bad = with_line(&text, at, "Tag=read,1.005,1.000,0.000,HISTF!!!notbase64");
    let (line, reason) = corrupt_line(&bad);
    assert_eq!(line, at);
    assert!(reason.contains("base64"), "{reason}");
}

#[test]
fn bad_number_names_line() {
    let (bytes, _) = sample_log();
    let text = String::from_utf8(bytes).unwrap();
    let at = first_interval_line(&text) + 2;
    let original = text.lines().nth(at - 1).unwrap();
    for broken in [
        original.replacen("2.005", "2.0x5", 1),
        original.replacen("2.005", "-1.0", 1),
        original.replacen(",1.000,", ",NaN,", 1),
        original.replacen(",0.000,", ",1e999,", 1),
    ] {
        let (line, reason) = corrupt_line(&with_line(&text, at, &broken));
        assert_eq!(line, at, "{broken}");
        assert!(reason.starts_with("bad "), "{reason}");
    }
    let (line, reason) =
        corrupt_line(&with_line(&text, 3, "#[StartTime: soon (seconds since epoch)]"));
    assert_eq!(line, 3);
    assert!(reason.contains("time"), "{reason}");
}

#[test]
fn wrong_cookie_names_line() {
    let (bytes, _) = sample_log();
    let text = String::from_utf8(bytes).unwrap();
    let at = first_interval_line(&text);
    let original = text.lines().nth(at - 1).unwrap();
    let (prefix, payload) = original.rsplit_once(',').unwrap();
    let engine = base64::engine::general_purpose::STANDARD;
    let mut raw = engine.decode(payload).unwrap();
    raw[3] = 0x15;
    let (line, reason) =
        corrupt_line(&with_line(&text, at, &format!("{prefix},{}", engine.encode(&raw))));
    assert_eq!(line, at);
    assert!(reason.contains("cookie"), "{reason}");

    // A valid compressed wrapper around a V1-style inner cookie.
    let mut inner = Vec::new();
    inner.extend_from_slice(&0x1c84_9301u32.to_be_bytes());
    inner.extend_from_slice(&[0; 36]);
    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    std::io::Write::write_all(&mut z, &inner).unwrap();
    let deflated = z.finish().unwrap();
    let mut outer = V2_COMPRESSED_COOKIE.to_be_bytes().to_vec();
    outer.extend_from_slice(&(deflated.len() as u32).to_be_bytes());
    outer.extend_from_slice(&deflated);
    let (line, reason) =
        corrupt_line(&with_line(&text, at, &format!("{prefix},{}", engine.encode(&outer))));
    assert_eq!(line, at);
    assert!(reason.contains("inner cookie"), "{reason}");
}

#[test]
fn hostile_headers_are_refused_before_allocating() {
    let engine = base64::engine::general_purpose::STANDARD;
    let wrap = |inner: &[u8]| {
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        std::io::Write::write_all(&mut z, inner).unwrap();
        let deflated = z.finish().unwrap();
        let mut outer = V2_COMPRESSED_COOKIE.to_be_bytes().to_vec();
        outer.extend_from_slice(&(deflated.len() as u32).to_be_bytes());
        outer.extend_from_slice(&deflated);
        format!("0.000,1.000,0.000,{}\n", engine.encode(&outer))
    };
    let header = |payload_len: u32, digits: u32, low: u64, high: u64| {
        let mut v = V2_COOKIE.to_be_bytes().to_vec();
        v.extend_from_slice(&payload_len.to_be_bytes());
        v.extend_from_slice(&0u32.to_be_bytes());
        v.extend_from_slice(&digits.to_be_bytes());
        v.extend_from_slice(&low.to_be_bytes());
        v.extend_from_slice(&high.to_be_bytes());
        v.extend_from_slice(&1.0f64.to_be_bytes());
        v
    };
    // Claims 4 GiB of counts.
    let (line, reason) = corrupt_line(wrap(&header(u32::MAX, 3, 1, 1000)).as_bytes());
    assert_eq!(line, 1);
    assert!(reason.contains("counts length"), "{reason}");
    // Impossible precision.
    let (_, reason) = corrupt_line(wrap(&header(0, 9, 1, 1000)).as_bytes());
    assert!(reason.contains("bad histogram"), "{reason}");
    // A count whose zig-zag decoding is i64::MIN.
    let mut v = header(9, 3, 1, 1000);
    v.extend_from_slice(&[0xff; 9]);
    let (_, reason) = corrupt_line(wrap(&v).as_bytes());
    assert!(reason.contains("out of range"), "{reason}");
    // Counts past the end of the array.
    let mut v = header(4, 3, 1, 1000);
    v.extend_from_slice(&[0xbf, 0x9a, 0x0c, 0x02]); // skip 100000 zeros, then a count of 1
    let (_, reason) = corrupt_line(wrap(&v).as_bytes());
    assert!(reason.contains("longer"), "{reason}");
}

#[test]
fn inflation_is_bounded() {
    let zeros = vec![0u8; 3 << 20];
    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut z, &zeros).unwrap();
    let deflated = z.finish().unwrap();
    let mut out = Vec::new();
    let reason = inflate_bounded(&deflated, &mut out, 1 << 20).unwrap_err();
    assert!(reason.contains("inflates past"), "{reason}");
    assert!(out.len() <= 1 << 20);
    inflate_bounded(&deflated, &mut out, 4 << 20).unwrap();
    assert_eq!(out, zeros);
    let reason = inflate_bounded(&deflated[..deflated.len() - 3], &mut out, 4 << 20).unwrap_err();
    assert!(reason.contains("truncated"), "{reason}");
    let mut trailing = deflated.clone();
    trailing.push(0);
    let reason = inflate_bounded(&trailing, &mut out, 4 << 20).unwrap_err();
    assert!(reason.contains("after the end"), "{reason}");
}

/// Every truncation and many single-byte corruptions of a small log either parse or give
/// `Corrupt` with a line inside the file: never a panic.
#[test]
fn damage_never_panics() {
    let stream = SyntheticStream::new(Distribution::Exponential { mean_ns: 50_000.0 }, 2000, 2);
    let hists = stream.histograms().unwrap();
    let mut w = HlogWriter::new(Vec::new()).unwrap();
    for (i, h) in hists.iter().enumerate() {
        w.write_histogram(Some("x"), Duration::from_secs(i as u64), Duration::from_secs(1), h)
            .unwrap();
    }
    let bytes = w.into_inner().unwrap();
    let line_count = bytes.iter().filter(|&&b| b == b'\n').count();
    let check = |damaged: &[u8]| match parse_hlog(damaged) {
        Ok(_) => {}
        Err(HistError::Corrupt { line, .. }) => assert!((1..=line_count).contains(&line)),
        Err(e) => panic!("unexpected {e:?}"),
    };
    for cut in 0..bytes.len() {
        check(&bytes[..cut]);
    }
    let mut state = 0x1234_5678_9abc_def0u64;
    for _ in 0..3000 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let mut damaged = bytes.clone();
        let at = (state % damaged.len() as u64) as usize;
        damaged[at] = (state >> 32) as u8;
        check(&damaged);
    }
}

#[test]
fn tags_are_validated() {
    let mut w = HlogWriter::new(Vec::new()).unwrap();
    let h = hist([1]);
    for bad in ["", "a,b", "a b", "a\nb"] {
        assert!(matches!(
            w.write_histogram(Some(bad), Duration::ZERO, Duration::ZERO, &h),
            Err(HistError::InvalidTag { .. })
        ));
    }
}
