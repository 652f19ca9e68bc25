//! `fastlane hist`: percentile tables, comparisons and plots from `.hlog` files.

use std::fs;
use std::io::{self, Write};
use std::path::PathBuf;

use anyhow::{Context, Result};
use fastlane_hist::report::{self, Format};

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

/// Run `fastlane hist`: the flags → one report of `fastlane_hist::report` → stdout.
pub fn run(args: &HistArgs) -> Result<()> {
    let format = match (args.json, args.csv) {
        (true, _) => Format::Json,
        (_, true) => Format::Csv,
        _ => Format::Table,
    };
    let tag = args.tag.as_deref();
    let report = match &args.compare {
        Some(pair) => report::compare(&pair[0], &pair[1], tag, format)?,
        None => report::table(&args.files, tag, format)?,
    };
    for note in &report.notes {
        eprintln!("note: {note}");
    }
    if let Some(svg_path) = &args.plot {
        let svg = report.plot_svg();
        fs::write(svg_path, svg)
            .with_context(|| format!("--plot: writing {}", svg_path.display()))?;
    }
    let mut stdout = io::stdout().lock();
    match stdout.write_all(&report.text).and_then(|()| stdout.flush()) {
        // A reader that stops early (`| head`) is not an error.
        Err(e) if e.kind() != io::ErrorKind::BrokenPipe => Err(e).context("writing to stdout"),
        _ => Ok(()),
    }
}
