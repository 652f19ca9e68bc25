//! `fastlane hist`: percentile tables, comparisons and plots from `.hlog` files.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use fastlane_hist::{format_ns, percentile_plot_svg, read_hlog, Histogram, PlotSeries, Summary};
use serde::Serialize;

/// Arguments of `fastlane hist`.
#[derive(Debug, clap::Args)]
#[command(after_help = "\
Values in the logs are nanoseconds; tables print each value in ns, µs, ms or s, while \
--json and --csv give plain nanoseconds. Percentiles are HdrHistogram's: the highest value \
equivalent, within the histogram's precision, to the sample at that rank.

Examples:
  fastlane hist run.hlog
  fastlane hist --tag read a.hlog b.hlog --plot read.svg
  fastlane hist --compare before.hlog after.hlog
  fastlane hist --json run.hlog | jq .series[0].summary.p99_ns")]
pub struct HistArgs {
    /// Interval logs (.hlog) to report: one table row per file, or per tag when a file holds
    /// several tags.
    #[arg(value_name = "FILE", required_unless_present = "compare", conflicts_with = "compare")]
    files: Vec<PathBuf>,

    /// Use only the intervals carrying this tag (`Tag=TAG,` in the log); it is an error if a
    /// file has none.
    #[arg(long, value_name = "TAG")]
    tag: Option<String>,

    /// Compare two logs: A and B side by side, with the ratio B/A for the count, the mean,
    /// each percentile and the max (above 1: B is slower). Files with several tags are
    /// compared tag by tag.
    #[arg(long, num_args = 2, value_names = ["A", "B"])]
    compare: Option<Vec<PathBuf>>,

    /// Also draw the percentile distribution of every reported series into this SVG file,
    /// the way HdrHistogram's plotter does (x: percentile on a 90%/99%/99.9% "nines" scale,
    /// y: latency).
    #[arg(long, value_name = "OUT.svg")]
    plot: Option<PathBuf>,

    /// Print JSON instead of a table (values in nanoseconds).
    #[arg(long, conflicts_with = "csv")]
    json: bool,

    /// Print CSV with a header row instead of a table (values in nanoseconds).
    #[arg(long)]
    csv: bool,
}

/// Run `fastlane hist`.
pub fn run(args: &HistArgs) -> Result<()> {
    let mut out = Vec::new();
    let series_for_plot = match &args.compare {
        Some(pair) => {
            let comparisons = compare(&pair[0], &pair[1], args.tag.as_deref())?;
            if args.json {
                write_json(&mut out, &CompareReport { comparisons: &comparisons })?;
            } else if args.csv {
                write_compare_csv(&mut out, &comparisons)?;
            } else {
                write_compare_table(&mut out, &comparisons)?;
            }
            comparisons.into_iter().flat_map(|c| [c.a, c.b]).collect()
        }
        None => {
            let mut series = Vec::new();
            for path in &args.files {
                series.extend(load_series(path, args.tag.as_deref())?);
            }
            if args.json {
                write_json(&mut out, &TableReport { series: &series })?;
            } else if args.csv {
                write_table_csv(&mut out, &series)?;
            } else {
                write_table(&mut out, &series)?;
            }
            series
        }
    };
    if let Some(svg_path) = &args.plot {
        let plot_series: Vec<PlotSeries<'_>> = series_for_plot
            .iter()
            .map(|s| PlotSeries { label: &s.label, histogram: &s.histogram })
            .collect();
        let svg = percentile_plot_svg("Latency by percentile", &plot_series);
        fs::write(svg_path, svg).with_context(|| format!("writing {}", svg_path.display()))?;
    }
    let mut stdout = io::stdout().lock();
    match stdout.write_all(&out).and_then(|()| stdout.flush()) {
        // A reader that stops early (`| head`) is not an error.
        Err(e) if e.kind() != io::ErrorKind::BrokenPipe => Err(e).context("writing to stdout"),
        _ => Ok(()),
    }
}

/// One reported histogram: a file, or one tag of it.
#[derive(Debug, Serialize)]
struct Series {
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
fn load_series(path: &Path, tag: Option<&str>) -> Result<Vec<Series>> {
    let file = read_hlog(path).with_context(|| format!("reading {}", path.display()))?;
    if file.intervals.is_empty() {
        bail!("{}: no intervals in the log", path.display());
    }
    let count_tagged =
        |t: Option<&str>| file.intervals.iter().filter(|iv| iv.tag.as_deref() == t).count();
    let tags = file.tags();
    if let Some(wanted) = tag {
        let Some(h) = file.merged_for_tag(Some(wanted)) else {
            bail!(
                "{}: no intervals tagged {wanted:?} (tags: {})",
                path.display(),
                tags.iter().map(|t| t.unwrap_or("(none)")).collect::<Vec<_>>().join(", ")
            );
        };
        return Ok(vec![Series::new(path, Some(wanted), count_tagged(Some(wanted)), h)]);
    }
    if let [only] = tags[..] {
        return Ok(vec![Series::new(path, only, file.intervals.len(), file.merged.clone())]);
    }
    tags.iter()
        .map(|&t| {
            let h = file.merged_for_tag(t).context("merging intervals")?;
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

fn compare(a_path: &Path, b_path: &Path, tag: Option<&str>) -> Result<Vec<Comparison>> {
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
                None => eprintln!("note: tag {} only in {}", tag_text(&a.tag), a.file),
            }
        }
        for b in b_all.into_iter().flatten() {
            eprintln!("note: tag {} only in {}", tag_text(&b.tag), b.file);
        }
        if pairs.is_empty() {
            bail!("{} and {} have no tag in common", a_path.display(), b_path.display());
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

fn write_json(out: &mut Vec<u8>, report: &impl Serialize) -> Result<()> {
    serde_json::to_writer_pretty(&mut *out, report).context("encoding JSON")?;
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

fn write_table(out: &mut Vec<u8>, series: &[Series]) -> Result<()> {
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

fn write_compare_table(out: &mut Vec<u8>, comparisons: &[Comparison]) -> Result<()> {
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
) -> Result<()> {
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

fn write_table_csv(out: &mut Vec<u8>, series: &[Series]) -> Result<()> {
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

fn write_compare_csv(out: &mut Vec<u8>, comparisons: &[Comparison]) -> Result<()> {
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
