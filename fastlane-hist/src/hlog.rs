//! HdrHistogram interval logs (`.hlog`): [`HlogWriter`] and [`read_hlog`].
//!
//! The format is the one Java's `HistogramLogWriter` writes and `HistogramLogProcessor` reads
//! (log format version 1.3):
//!
//! ```text
//! #[Histogram log format version 1.3]
//! #[StartTime: 1700000000.000 (seconds since epoch)]
//! #[BaseTime: 1700000000.000 (seconds since epoch)]
//! "StartTimestamp","Interval_Length","Interval_Max","Interval_Compressed_Histogram"
//! Tag=read,0.000,1.000,0.123,HISTFAAAA...
//! ```
//!
//! Each interval line is `[Tag=T,]start,length,max,payload`: `start` is seconds since
//! `BaseTime`, `length` seconds, `max` the interval's largest value divided by
//! [`MAX_VALUE_DIVISOR`], and `payload` the base64 of a V2 deflate-compressed histogram
//! (cookie `0x1c849314`).
//!
//! **Units.** Values are nanoseconds. The max column is in milliseconds (divisor 10⁶), which
//! is what the Java writer's default `maxValueUnitRatio` gives and what
//! `HistogramLogProcessor` assumes by default (`-outputValueUnitRatio 1000000`), so the Java
//! tool prints milliseconds; pass `-outputValueUnitRatio 1000` for microseconds.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use flate2::{Decompress, FlushDecompress, Status};
use hdrhistogram::serialization::{Deserializer, Serializer as _, V2DeflateSerializer};
use hdrhistogram::Histogram;

use crate::recorder::RecordedInterval;
use crate::HistError;

/// What the writer divides a histogram's max (ns) by for the `Interval_Max` column: the column
/// is in milliseconds, as in logs written by Java's `HistogramLogWriter` by default.
pub const MAX_VALUE_DIVISOR: f64 = 1_000_000.0;

/// The legend line that precedes the intervals.
pub const LEGEND: &str =
    "\"StartTimestamp\",\"Interval_Length\",\"Interval_Max\",\"Interval_Compressed_Histogram\"";

/// Cookie of a V2 deflate-compressed histogram (Java's `V2CompressedEncodingCookieBase | 0x10`).
pub const V2_COMPRESSED_COOKIE: u32 = 0x1c84_9314;
/// Cookie of the uncompressed V2 histogram inside the deflate stream.
pub const V2_COOKIE: u32 = 0x1c84_9313;

/// Largest file [`read_hlog`] reads (1 GiB).
pub const MAX_FILE_BYTES: u64 = 1 << 30;
/// Largest inflated histogram accepted (64 MiB; a 5-digit, full-`u64` histogram needs ~57 MiB).
pub const MAX_INFLATED_BYTES: usize = 64 << 20;
/// Most histogram counters (8 bytes each) one [`HlogFile`] may hold across its intervals
/// (1 GiB of counts; a 60 s, 3-digit histogram has ~27 k counters).
pub const MAX_COUNTERS_TOTAL: usize = 1 << 27;

/// V2 header: cookie, payload length, normalizing offset, digits, low, high, int-to-double ratio.
const V2_HEADER_BYTES: usize = 40;

/// Writes an interval log, one histogram per line, in the format Java's tools read.
///
/// Timestamps are seconds since the log's BaseTime (its creation time unless given), written
/// with millisecond resolution like the Java writer. Buffers are reused between lines.
pub struct HlogWriter<W: Write> {
    out: W,
    serializer: V2DeflateSerializer,
    encoded: Vec<u8>,
    line: String,
    base_instant: Instant,
}

impl<W: Write> std::fmt::Debug for HlogWriter<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HlogWriter").field("base_instant", &self.base_instant).finish()
    }
}

impl HlogWriter<BufWriter<File>> {
    /// Create (truncate) `path` and write the header; BaseTime is now.
    pub fn create(path: impl AsRef<Path>) -> Result<Self, HistError> {
        let path = path.as_ref();
        let file = File::create(path)
            .map_err(|source| HistError::Io { path: path.to_path_buf(), source })?;
        Self::new(BufWriter::new(file))
    }
}

impl<W: Write> HlogWriter<W> {
    /// Write the header to `out`; StartTime and BaseTime are now.
    pub fn new(out: W) -> Result<Self, HistError> {
        Self::with_base_time(out, SystemTime::now())
    }

    /// Write the header with StartTime = BaseTime = `base_time`. Interval starts passed to
    /// [`write_histogram`](Self::write_histogram) are offsets from it;
    /// [`write_interval`](Self::write_interval) maps `Instant`s onto it through the monotonic
    /// clock (`base_time` is taken to be "now minus its age").
    pub fn with_base_time(mut out: W, base_time: SystemTime) -> Result<Self, HistError> {
        let base_s = match base_time.duration_since(UNIX_EPOCH) {
            Ok(d) => d.as_secs_f64(),
            Err(e) => -e.duration().as_secs_f64(),
        };
        let header = format!(
            "#[Histogram log format version 1.3]\n\
             #[Logged by fastlane-hist {}: values in nanoseconds, Interval_Max in milliseconds]\n\
             #[StartTime: {base_s:.3} (seconds since epoch)]\n\
             #[BaseTime: {base_s:.3} (seconds since epoch)]\n\
             #[MaxValueDivisor: {MAX_VALUE_DIVISOR:.3}]\n\
             {LEGEND}\n",
            env!("CARGO_PKG_VERSION"),
        );
        out.write_all(header.as_bytes()).map_err(HistError::Write)?;
        let age = SystemTime::now().duration_since(base_time).unwrap_or(Duration::ZERO);
        let now = Instant::now();
        let base_instant = now.checked_sub(age).unwrap_or(now);
        Ok(Self {
            out,
            serializer: V2DeflateSerializer::new(),
            encoded: Vec::new(),
            line: String::new(),
            base_instant,
        })
    }

    /// Write `#text` (one comment line per line of `text`).
    pub fn write_comment(&mut self, text: &str) -> Result<(), HistError> {
        for l in text.split('\n') {
            writeln!(self.out, "#{}", l.trim_end_matches('\r')).map_err(HistError::Write)?;
        }
        Ok(())
    }

    /// Write one interval: `start` is the offset from BaseTime, `length` its duration.
    /// `tag` must be non-empty and free of `,`, spaces, CR and LF.
    pub fn write_histogram(
        &mut self,
        tag: Option<&str>,
        start: Duration,
        length: Duration,
        histogram: &Histogram<u64>,
    ) -> Result<(), HistError> {
        self.line.clear();
        if let Some(tag) = tag {
            check_tag(tag)?;
            self.line.push_str("Tag=");
            self.line.push_str(tag);
            self.line.push(',');
        }
        // The max column is for humans and is skipped by readers; Java writes 0 for an empty
        // histogram, and so do we (hdrhistogram's max() of an empty histogram is 0 as well).
        let max_column = if histogram.is_empty() { 0.0 } else { histogram.max() as f64 };
        let _ = write!(
            self.line,
            "{:.3},{:.3},{:.3},",
            start.as_secs_f64(),
            length.as_secs_f64(),
            max_column / MAX_VALUE_DIVISOR
        );
        self.encoded.clear();
        self.serializer
            .serialize(histogram, &mut self.encoded)
            .map_err(|e| HistError::Encode { reason: e.to_string() })?;
        base64::engine::general_purpose::STANDARD.encode_string(&self.encoded, &mut self.line);
        self.line.push('\n');
        self.out.write_all(self.line.as_bytes()).map_err(HistError::Write)
    }

    /// Write an interval taken from a [`LatencyRecorder`](crate::LatencyRecorder).
    pub fn write_interval(
        &mut self,
        tag: Option<&str>,
        interval: &RecordedInterval<'_>,
    ) -> Result<(), HistError> {
        let start = interval.start.saturating_duration_since(self.base_instant);
        self.write_histogram(tag, start, interval.length(), interval.histogram)
    }

    /// Flush the sink.
    pub fn flush(&mut self) -> Result<(), HistError> {
        self.out.flush().map_err(HistError::Write)
    }

    /// Flush and return the sink.
    pub fn into_inner(mut self) -> Result<W, HistError> {
        self.flush()?;
        Ok(self.out)
    }
}

fn check_tag(tag: &str) -> Result<(), HistError> {
    if tag.is_empty() || tag.contains([',', ' ', '\r', '\n']) {
        return Err(HistError::InvalidTag { tag: tag.to_owned() });
    }
    Ok(())
}

/// One interval read from a log.
#[derive(Debug, Clone)]
pub struct HlogInterval {
    /// `Tag=` value, if any.
    pub tag: Option<String>,
    /// Start, as written: seconds since BaseTime when the log has one, else since the epoch.
    pub start: Duration,
    /// Interval length.
    pub length: Duration,
    /// The `Interval_Max` column as written (informational; Java's reader ignores it too).
    pub max_column: f64,
    /// The interval's histogram (values in the log's unit; nanoseconds for our logs).
    pub histogram: Histogram<u64>,
    /// 1-based line of the log it came from.
    pub line: usize,
}

/// A parsed interval log.
#[derive(Debug, Clone)]
pub struct HlogFile {
    /// `#[StartTime: …]`, seconds since the epoch (the last one, if repeated).
    pub start_time_s: Option<f64>,
    /// `#[BaseTime: …]`, seconds since the epoch (the last one, if repeated).
    pub base_time_s: Option<f64>,
    /// The intervals, in file order.
    pub intervals: Vec<HlogInterval>,
    /// All intervals added together, whatever their tag.
    pub merged: Histogram<u64>,
}

impl HlogFile {
    /// Distinct tags in order of first appearance (`None`: untagged intervals).
    pub fn tags(&self) -> Vec<Option<&str>> {
        let mut tags: Vec<Option<&str>> = Vec::new();
        for iv in &self.intervals {
            let t = iv.tag.as_deref();
            if !tags.contains(&t) {
                tags.push(t);
            }
        }
        tags
    }

    /// The intervals carrying `tag` (`None`: untagged), added together; `None` when there are
    /// no such intervals.
    pub fn merged_for_tag(&self, tag: Option<&str>) -> Option<Histogram<u64>> {
        let mut selected = self.intervals.iter().filter(|iv| iv.tag.as_deref() == tag);
        let first = selected.next()?;
        let mut merged = first.histogram.clone();
        merged.auto(true);
        for iv in selected {
            // Auto-resize is on and every histogram here was validated on read: the only
            // failure left is a usize overflow, which the read-time merge already ruled out.
            merged.add(&iv.histogram).ok()?;
        }
        Some(merged)
    }
}

/// Read and validate an interval log. Any malformed line gives
/// [`HistError::Corrupt`] with its 1-based line number; nothing in the file can panic or
/// make the reader allocate past the `MAX_*` limits of this module.
pub fn read_hlog(path: impl AsRef<Path>) -> Result<HlogFile, HistError> {
    use std::io::Read as _;
    let path = path.as_ref();
    let io_err = |source| HistError::Io { path: path.to_path_buf(), source };
    let file = File::open(path).map_err(io_err)?;
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes).map_err(io_err)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(HistError::TooLarge {
            line: 0,
            reason: format!("file larger than {MAX_FILE_BYTES} bytes"),
        });
    }
    parse_hlog(&bytes)
}

/// [`read_hlog`] on bytes already in memory.
pub fn parse_hlog(bytes: &[u8]) -> Result<HlogFile, HistError> {
    let mut file = HlogFile {
        start_time_s: None,
        base_time_s: None,
        intervals: Vec::new(),
        merged: Histogram::new(3).expect("3 significant digits is a valid configuration"),
    };
    let mut decoder = HistogramDecoder::default();
    let mut counters_total: usize = 0;
    let ends_with_newline = bytes.last() == Some(&b'\n');
    let lines: Vec<&[u8]> = bytes.split(|&b| b == b'\n').collect();
    // split() yields an empty piece after a trailing '\n'; it is not a line.
    let line_count = if ends_with_newline { lines.len() - 1 } else { lines.len() };
    for (index, raw) in lines.iter().take(line_count).enumerate() {
        let line = index + 1;
        let is_cut_short = !ends_with_newline && line == line_count;
        let corrupt = |reason: String| HistError::Corrupt {
            line,
            reason: if is_cut_short { format!("truncated line: {reason}") } else { reason },
        };
        let text = std::str::from_utf8(raw).map_err(|_| corrupt("not UTF-8".into()))?;
        let text = text.strip_suffix('\r').unwrap_or(text);
        if text.trim().is_empty() || text.starts_with("\"StartTimestamp\"") {
            continue;
        }
        if let Some(rest) = text.strip_prefix("#[StartTime:") {
            file.start_time_s = Some(header_seconds(rest).map_err(corrupt)?);
            continue;
        }
        if let Some(rest) = text.strip_prefix("#[BaseTime:") {
            file.base_time_s = Some(header_seconds(rest).map_err(corrupt)?);
            continue;
        }
        if text.starts_with('#') {
            continue;
        }
        let interval = parse_interval_line(text, line, &mut decoder).map_err(corrupt)?;
        counters_total = counters_total.saturating_add(interval.histogram.distinct_values());
        if counters_total > MAX_COUNTERS_TOTAL {
            return Err(HistError::TooLarge {
                line,
                reason: format!("more than {MAX_COUNTERS_TOTAL} histogram counters in total"),
            });
        }
        if file.intervals.is_empty() {
            file.merged = Histogram::new_from(&interval.histogram);
            file.merged.auto(true);
        }
        file.merged
            .add(&interval.histogram)
            .map_err(|e| corrupt(format!("cannot merge histogram: {e:?}")))?;
        file.intervals.push(interval);
    }
    Ok(file)
}

/// `" 1700000000.123 (seconds since epoch)]"` → 1700000000.123
fn header_seconds(rest: &str) -> Result<f64, String> {
    let token = rest.trim_start().split([' ', ']', ',']).next().unwrap_or("");
    match token.parse::<f64>() {
        Ok(v) if v.is_finite() => Ok(v),
        _ => Err(format!("bad time {token:?} in header")),
    }
}

fn parse_interval_line(
    text: &str,
    line: usize,
    decoder: &mut HistogramDecoder,
) -> Result<HlogInterval, String> {
    let (tag, body) = match text.strip_prefix("Tag=") {
        Some(rest) => {
            let (tag, body) = rest.split_once(',').ok_or("tag without fields")?;
            if tag.is_empty() || tag.contains(' ') {
                return Err(format!("bad tag {tag:?}"));
            }
            (Some(tag.to_owned()), body)
        }
        None => (None, text),
    };
    let fields: Vec<&str> = body.split(',').collect();
    if fields.len() != 4 {
        return Err(format!(
            "expected 4 fields (start,length,max,histogram), found {}",
            fields.len()
        ));
    }
    let start = seconds_field("start timestamp", fields[0])?;
    let length = seconds_field("interval length", fields[1])?;
    let max_column = number_field("interval max", fields[2])?;
    let histogram = decoder.decode(fields[3].trim())?;
    Ok(HlogInterval { tag, start, length, max_column, histogram, line })
}

fn number_field(what: &str, field: &str) -> Result<f64, String> {
    match field.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("bad {what} {field:?}")),
    }
}

fn seconds_field(what: &str, field: &str) -> Result<Duration, String> {
    let secs = number_field(what, field)?;
    Duration::try_from_secs_f64(secs).map_err(|_| format!("bad {what} {field:?}"))
}

/// Decodes base64 + V2-deflate payloads, validating every length before allocating.
#[derive(Default)]
struct HistogramDecoder {
    compressed: Vec<u8>,
    inflated: Vec<u8>,
    deserializer: Deserializer,
}

impl HistogramDecoder {
    fn decode(&mut self, payload: &str) -> Result<Histogram<u64>, String> {
        self.compressed.clear();
        base64::engine::general_purpose::STANDARD
            .decode_vec(payload, &mut self.compressed)
            .map_err(|e| format!("bad base64: {e}"))?;
        let bytes = &self.compressed[..];
        if bytes.len() < 8 {
            return Err(format!("histogram of {} bytes, shorter than its header", bytes.len()));
        }
        let cookie = be_u32(&bytes[0..4]);
        if cookie != V2_COMPRESSED_COOKIE {
            return Err(format!(
                "wrong cookie {cookie:#010x}, expected V2 compressed {V2_COMPRESSED_COOKIE:#010x}"
            ));
        }
        let compressed_len = be_u32(&bytes[4..8]) as usize;
        let deflated = &bytes[8..];
        if compressed_len != deflated.len() {
            return Err(format!(
                "compressed length {compressed_len} but {} bytes follow",
                deflated.len()
            ));
        }
        inflate_bounded(deflated, &mut self.inflated, MAX_INFLATED_BYTES)?;
        let v2 = &self.inflated[..];
        if v2.len() < V2_HEADER_BYTES {
            return Err(format!(
                "inflated histogram of {} bytes, shorter than its header",
                v2.len()
            ));
        }
        let inner_cookie = be_u32(&v2[0..4]);
        if inner_cookie != V2_COOKIE {
            return Err(format!(
                "wrong inner cookie {inner_cookie:#010x}, expected {V2_COOKIE:#010x}"
            ));
        }
        let payload_len = be_u32(&v2[4..8]) as usize;
        if payload_len != v2.len() - V2_HEADER_BYTES {
            return Err(format!(
                "counts length {payload_len} but {} bytes follow",
                v2.len() - V2_HEADER_BYTES
            ));
        }
        check_varints(&v2[V2_HEADER_BYTES..])?;
        self.deserializer
            .deserialize::<u64, _>(&mut &v2[..])
            .map_err(|e| format!("bad histogram: {e}"))
    }
}

fn be_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// Inflate a zlib stream into `out`, failing on truncation, trailing bytes or more than
/// `limit` bytes of output.
fn inflate_bounded(input: &[u8], out: &mut Vec<u8>, limit: usize) -> Result<(), String> {
    out.clear();
    let mut inflater = Decompress::new(true);
    loop {
        if out.len() == out.capacity() {
            if out.len() >= limit {
                return Err(format!("histogram inflates past {limit} bytes"));
            }
            let grow = out.len().clamp(4096, limit - out.len());
            out.reserve(grow);
        }
        let in_before = inflater.total_in();
        let out_before = inflater.total_out();
        let consumed = usize::try_from(in_before).map_err(|_| "deflate offset overflow")?;
        let status = inflater
            .decompress_vec(&input[consumed.min(input.len())..], out, FlushDecompress::None)
            .map_err(|e| format!("bad deflate data: {e}"))?;
        match status {
            Status::StreamEnd => break,
            Status::Ok | Status::BufError => {
                let progressed =
                    inflater.total_in() != in_before || inflater.total_out() != out_before;
                // No progress with room to write: the stream needs input that is not there.
                if !progressed && out.len() < out.capacity() {
                    return Err("deflate data truncated".into());
                }
            }
        }
    }
    if inflater.total_in() != input.len() as u64 {
        return Err("bytes after the end of the deflate stream".into());
    }
    Ok(())
}

/// Walk the zig-zag LEB128 counts so the deserializer only ever sees well-formed ones
/// (a value decoding to `i64::MIN` would overflow its negation).
fn check_varints(mut payload: &[u8]) -> Result<(), String> {
    while !payload.is_empty() {
        let mut value: u64 = 0;
        let mut used = 0;
        loop {
            let Some(&b) = payload.get(used) else {
                return Err("counts end inside a varint".into());
            };
            if used == 8 {
                value |= u64::from(b) << 56;
                used += 1;
                break;
            }
            value |= u64::from(b & 0x7f) << (7 * used);
            used += 1;
            if b & 0x80 == 0 {
                break;
            }
        }
        if value == u64::MAX {
            return Err("count out of range".into());
        }
        payload = &payload[used..];
    }
    Ok(())
}

#[cfg(test)]
mod tests;
