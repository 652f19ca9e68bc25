//! Reports over interval logs, the library behind `fastlane hist`: a percentile table per
//! file (or per tag), a comparison of two logs with B/A per metric, as an aligned text table,
//! JSON or CSV (values in nanoseconds), and the series to plot.

use std::io::Write;
use std::path::Path;

use serde::Serialize;

use crate::{format_ns, percentile_plot_svg, read_hlog, HistError, Histogram, PlotSeries, Summary};

/// How a report is printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Aligned columns, values in ns, µs, ms or s.
    Table,
    /// Pretty JSON, values in nanoseconds.
    Json,
    /// CSV with a header row, values in nanoseconds.
    Csv,
}

/// A report: its text, what a reader should know about it, and the series it covers.
#[derive(Debug)]
pub struct Report {
    /// The table, JSON or CSV.
    pub text: Vec<u8>,
    /// Remarks for stderr (a tag found in only one of two compared files).
    pub notes: Vec<String>,
    /// Every histogram reported (for a comparison: A then B of each pair).
    pub series: Vec<Series>,
}

impl Report {
    /// The percentile distribution of every series as SVG ([`percentile_plot_svg`]).
    pub fn plot_svg(&self) -> String {
        let plot: Vec<PlotSeries<'_>> = self
            .series
            .iter()
            .map(|s| PlotSeries { label: &s.label, histogram: &s.histogram })
            .collect();
        percentile_plot_svg("Latency by percentile", &plot)
    }
}

/// One row per file, or per tag of a file with several tags (only the intervals with `tag`
/// when given; a file without them is an error).
pub fn table(
    files: &[impl AsRef<Path>],
    tag: Option<&str>,
    format: Format,
) -> Result<Report, HistError> {
    let mut series = Vec::new();
    for path in files {
        series.extend(load_series(path.as_ref(), tag)?);
    }
    let mut text = Vec::new();
    match format {
        Format::Json => write_json(&mut text, &TableReport { series: &series })?,
        Format::Csv => write_table_csv(&mut text, &series).map_err(HistError::Write)?,
        Format::Table => write_table(&mut text, &series).map_err(HistError::Write)?,
    }
    Ok(Report { text, notes: Vec::new(), series })
}

/// A and B side by side with B/A for the count, the mean, each percentile and the max;
/// files with several tags are compared tag by tag.
pub fn compare(a: &Path, b: &Path, tag: Option<&str>, format: Format) -> Result<Report, HistError> {
    let mut notes = Vec::new();
    let comparisons = compare_series(a, b, tag, &mut notes)?;
    let mut text = Vec::new();
    match format {
        Format::Json => write_json(&mut text, &CompareReport { comparisons: &comparisons })?,
        Format::Csv => write_compare_csv(&mut text, &comparisons).map_err(HistError::Write)?,
        Format::Table => write_compare_table(&mut text, &comparisons).map_err(HistError::Write)?,
    }
    let series = comparisons.into_iter().flat_map(|c| [c.a, c.b]).collect();
    Ok(Report { text, notes, series })
}

fn refused(reason: String) -> HistError {
    HistError::Report { reason }
}

/// One reported histogram: a file, or one tag of it.
#[derive(Debug, Serialize)]
pub struct Series {
    file: String,
    tag: Option<String>,
    intervals: usize,
    summary: Summary,
    #[serde(skip)]
    label: String,
    #[serde(skip)]
    histogram: Histogram<u64>,
}

impl Series {
    /// The file, with the tag in brackets when there is one.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Count, mean, percentiles and max.
    pub fn summary(&self) -> &Summary {
        &self.summary
    }

    fn new(path: &Path, tag: Option<&str>, intervals: usize, histogram: Histogram<u64>) -> Self {
        let file = path.display().to_string();
        let label = match tag {
            Some(t) => format!("{file} [{t}]"),
            None => file.clone(),
        };
        let summary = Summary::from_histogram(&histogram);
        Self { file, tag: tag.map(str::to_owned), intervals, summary, label, histogram }
    }
}

/// The series of one file: the intervals with `tag`, or one per tag, or the whole file.
fn load_series(path: &Path, tag: Option<&str>) -> Result<Vec<Series>, HistError> {
    let file = read_hlog(path).map_err(|e| match e {
        // It names the file already.
        e @ HistError::Io { .. } => e,
        e => HistError::Reading { path: path.to_owned(), source: Box::new(e) },
    })?;
    if file.intervals.is_empty() {
        return Err(refused(format!("{}: no intervals in the log", path.display())));
    }
    let count_tagged =
        |t: Option<&str>| file.intervals.iter().filter(|iv| iv.tag.as_deref() == t).count();
    let tags = file.tags();
    if let Some(wanted) = tag {
        let Some(h) = file.merged_for_tag(Some(wanted)) else {
            return Err(refused(format!(
                "{}: no intervals tagged {wanted:?} (tags: {})",
                path.display(),
                tags.iter().map(|t| t.unwrap_or("(none)")).collect::<Vec<_>>().join(", ")
            )));
        };
        return Ok(vec![Series::new(path, Some(wanted), count_tagged(Some(wanted)), h)]);
    }
    if let [only] = tags[..] {
        return Ok(vec![Series::new(path, only, file.intervals.len(), file.merged.clone())]);
    }
    tags.iter()
        .map(|&t| {
            let h = file
                .merged_for_tag(t)
                .ok_or_else(|| refused(format!("{}: merging intervals", path.display())))?;
            Ok(Series::new(path, t, count_tagged(t), h))
        })
        .collect()
}

/// A and B for one tag (or for the whole files), with B/A per metric.
#[derive(Debug, Serialize)]
struct Comparison {
    tag: Option<String>,
    a: Series,
    b: Series,
    rows: Vec<RatioRow>,
}

#[derive(Debug, Serialize)]
struct RatioRow {
    metric: &'static str,
    a: f64,
    b: f64,
    /// `None` when A is 0.
    b_over_a: Option<f64>,
}

fn compare_series(
    a_path: &Path,
    b_path: &Path,
    tag: Option<&str>,
    notes: &mut Vec<String>,
) -> Result<Vec<Comparison>, HistError> {
    let a_all = load_series(a_path, tag)?;
    let b_all = load_series(b_path, tag)?;
    let pairs: Vec<(Series, Series)> = if a_all.len() == 1 && b_all.len() == 1 {
        // One histogram each (a --tag, or single-tag files): compare them whatever the tags.
        a_all.into_iter().zip(b_all).collect()
    } else {
        let mut b_all: Vec<Option<Series>> = b_all.into_iter().map(Some).collect();
        let mut pairs = Vec::new();
        for a in a_all {
            let found = b_all.iter_mut().find(|b| b.as_ref().is_some_and(|b| b.tag == a.tag));
            match found.and_then(Option::take) {
                Some(b) => pairs.push((a, b)),
                None => notes.push(format!("tag {} only in {}", tag_text(&a.tag), a.file)),
            }
        }
        for b in b_all.into_iter().flatten() {
            notes.push(format!("tag {} only in {}", tag_text(&b.tag), b.file));
        }
        if pairs.is_empty() {
            let (a, b) = (a_path.display(), b_path.display());
            return Err(refused(format!("{a} and {b} have no tag in common")));
        }
        pairs
    };
    Ok(pairs
        .into_iter()
        .map(|(a, b)| {
            let count = |s: &Series| s.summary.count as f64;
            let mut rows = vec![ratio_row("count", count(&a), count(&b))];
            for (ma, mb) in a.summary.metrics().iter().zip(b.summary.metrics()) {
                rows.push(ratio_row(ma.key, ma.value_ns, mb.value_ns));
            }
            let tag = if a.tag == b.tag { a.tag.clone() } else { None };
            Comparison { tag, a, b, rows }
        })
        .collect())
}

fn ratio_row(metric: &'static str, a: f64, b: f64) -> RatioRow {
    RatioRow { metric, a, b, b_over_a: (a > 0.0).then(|| b / a) }
}

fn tag_text(tag: &Option<String>) -> &str {
    tag.as_deref().unwrap_or("-")
}

#[derive(Serialize)]
struct TableReport<'a> {
    series: &'a [Series],
}

#[derive(Serialize)]
struct CompareReport<'a> {
    comparisons: &'a [Comparison],
}

fn write_json(out: &mut Vec<u8>, report: &impl Serialize) -> Result<(), HistError> {
    serde_json::to_writer_pretty(&mut *out, report)
        .map_err(|e| refused(format!("encoding JSON: {e}")))?;
    out.push(b'\n');
    Ok(())
}

/// Human label of a metric key (`p99_9` → `P99.9`).
fn metric_label(key: &str) -> &str {
    match key {
        "p50" => "P50",
        "p90" => "P90",
        "p99" => "P99",
        "p99_9" => "P99.9",
        "p99_99" => "P99.99",
        other => other,
    }
}

fn write_table(out: &mut Vec<u8>, series: &[Series]) -> std::io::Result<()> {
    let mut header = vec!["FILE", "TAG", "INTERVALS", "COUNT"];
    let Some(first) = series.first() else { return Ok(()) };
    let metrics = first.summary.metrics();
    let labels: Vec<String> = metrics.iter().map(|m| m.label.to_uppercase()).collect();
    header.extend(labels.iter().map(String::as_str));
    let rows: Vec<Vec<String>> = series
        .iter()
        .map(|s| {
            let mut row = vec![
                s.file.clone(),
                tag_text(&s.tag).to_owned(),
                s.intervals.to_string(),
                s.summary.count.to_string(),
            ];
            row.extend(s.summary.metrics().iter().map(|m| format_ns(m.value_ns)));
            row
        })
        .collect();
    write_aligned(out, &header, &rows, 2)
}

fn write_compare_table(out: &mut Vec<u8>, comparisons: &[Comparison]) -> std::io::Result<()> {
    for (i, c) in comparisons.iter().enumerate() {
        if i > 0 {
            writeln!(out)?;
        }
        if comparisons.len() > 1 || c.tag.is_some() {
            writeln!(out, "tag {}", tag_text(&c.tag))?;
        }
        let a_head = format!("A: {}", c.a.label);
        let b_head = format!("B: {}", c.b.label);
        let header = ["METRIC", a_head.as_str(), b_head.as_str(), "B/A"];
        let rows: Vec<Vec<String>> = c
            .rows
            .iter()
            .map(|r| {
                let (a, b) = if r.metric == "count" {
                    (format!("{}", r.a), format!("{}", r.b))
                } else {
                    (format_ns(r.a), format_ns(r.b))
                };
                let ratio = r.b_over_a.map_or_else(|| "-".to_owned(), |x| format!("{x:.2}"));
                vec![metric_label(r.metric).to_owned(), a, b, ratio]
            })
            .collect();
        write_aligned(out, &header, &rows, 1)?;
    }
    Ok(())
}

/// Columns before `left_columns` are left-aligned, the rest right-aligned.
fn write_aligned(
    out: &mut Vec<u8>,
    header: &[&str],
    rows: &[Vec<String>],
    left_columns: usize,
) -> std::io::Result<()> {
    let width = |s: &str| s.chars().count();
    let mut widths: Vec<usize> = header.iter().map(|h| width(h)).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(width(cell));
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for (i, (cell, w)) in cells.zip(&widths).enumerate() {
            if i > 0 {
                text.push_str("  ");
            }
            let pad = " ".repeat(w - width(cell));
            if i < left_columns {
                text.push_str(cell);
                text.push_str(&pad);
            } else {
                text.push_str(&pad);
                text.push_str(cell);
            }
        }
        text.truncate(text.trim_end().len());
        text
    };
    writeln!(out, "{}", line(&mut header.iter().copied()))?;
    for row in rows {
        writeln!(out, "{}", line(&mut row.iter().map(String::as_str)))?;
    }
    Ok(())
}

fn csv_field(text: &str) -> String {
    if text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.to_owned()
    }
}

fn write_table_csv(out: &mut Vec<u8>, series: &[Series]) -> std::io::Result<()> {
    writeln!(
        out,
        "file,tag,intervals,count,min_ns,mean_ns,p50_ns,p90_ns,p99_ns,p99_9_ns,p99_99_ns,max_ns"
    )?;
    for s in series {
        let m = &s.summary;
        writeln!(
            out,
            "{},{},{},{},{},{},{},{},{},{},{},{}",
            csv_field(&s.file),
            csv_field(s.tag.as_deref().unwrap_or("")),
            s.intervals,
            m.count,
            m.min_ns,
            m.mean_ns,
            m.p50_ns,
            m.p90_ns,
            m.p99_ns,
            m.p99_9_ns,
            m.p99_99_ns,
            m.max_ns
        )?;
    }
    Ok(())
}

fn write_compare_csv(out: &mut Vec<u8>, comparisons: &[Comparison]) -> std::io::Result<()> {
    writeln!(out, "tag,metric,a_file,b_file,a,b,b_over_a")?;
    for c in comparisons {
        for r in &c.rows {
            let ratio = r.b_over_a.map_or_else(String::new, |x| x.to_string());
            writeln!(
                out,
                "{},{},{},{},{},{},{}",
                csv_field(c.tag.as_deref().unwrap_or("")),
                r.metric,
                csv_field(&c.a.file),
                csv_field(&c.b.file),
                r.a,
                r.b,
                ratio
            )?;
        }
    }
    Ok(())
}
