//! Percentile-distribution plots as standalone SVG, drawn the way HdrHistogram's plotter does.
//!
//! The x axis is the percentile on a "nines" scale: x = log10(1 / (1 − p)), so 0 %, 90 %, 99 %,
//! 99.9 %, … are equally spaced. The y axis is latency, linear from 0. One polyline per series,
//! through the points of hdrhistogram's quantile iteration (5 ticks per half distance, as
//! Java's `outputPercentileDistribution`).

use std::fmt::Write as _;

use hdrhistogram::Histogram;

use crate::summary::format_ns;

/// One line on the plot.
#[derive(Debug, Clone, Copy)]
pub struct PlotSeries<'a> {
    /// Legend text.
    pub label: &'a str,
    /// Latencies in nanoseconds.
    pub histogram: &'a Histogram<u64>,
}

const WIDTH: f64 = 900.0;
const HEIGHT: f64 = 560.0;
const LEFT: f64 = 90.0;
const RIGHT: f64 = 30.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 70.0;
const COLORS: [&str; 8] =
    ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
/// Most nines on the x axis (99.99999999 %).
const NINES_MAX: u32 = 10;
/// Quantile iteration resolution, as Java's default percentile output.
const TICKS_PER_HALF_DISTANCE: u32 = 5;

/// Render `series` as an SVG document (UTF-8 text starting with `<svg`).
pub fn percentile_plot_svg(title: &str, series: &[PlotSeries<'_>]) -> String {
    let count_max = series.iter().map(|s| s.histogram.len()).max().unwrap_or(0);
    // Enough decades to reach the last sample's percentile (1 - 1/count), at least 99 %.
    let nines = ((count_max.max(1) as f64).log10().ceil() as u32).clamp(2, NINES_MAX);
    let value_max = series
        .iter()
        .filter(|s| !s.histogram.is_empty())
        .map(|s| s.histogram.max())
        .max()
        .unwrap_or(0);
    let (y_step, y_top) = nice_axis(value_max as f64);

    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let px = |nines_x: f64| LEFT + plot_w * (nines_x / f64::from(nines));
    let py = |value: f64| TOP + plot_h * (1.0 - value / y_top);

    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="28" text-anchor="middle" font-size="16">{}</text>"#,
        WIDTH / 2.0,
        xml_escape(title)
    );

    // Grid and tick labels.
    for decade in 0..=nines {
        let x = px(f64::from(decade));
        let _ = writeln!(
            svg,
            r##"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}" stroke="#dddddd"/>"##,
            TOP + plot_h
        );
        let _ = writeln!(
            svg,
            r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            TOP + plot_h + 18.0,
            nines_label(decade)
        );
    }
    let mut tick = 0.0;
    while tick <= y_top * (1.0 + 1e-9) {
        let y = py(tick);
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#dddddd"/>"##,
            LEFT + plot_w
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            LEFT - 8.0,
            y + 4.0,
            xml_escape(&format_ns(tick))
        );
        tick += y_step;
    }
    // Axes and their labels.
    let _ = writeln!(
        svg,
        r#"<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{:.1}" stroke="black"/>"#,
        TOP + plot_h
    );
    let _ = writeln!(
        svg,
        r#"<line x1="{LEFT}" y1="{0:.1}" x2="{1:.1}" y2="{0:.1}" stroke="black"/>"#,
        TOP + plot_h,
        LEFT + plot_w
    );
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="14">percentile</text>"#,
        LEFT + plot_w / 2.0,
        HEIGHT - 20.0
    );
    let _ = writeln!(
        svg,
        r#"<text x="20" y="{0:.1}" text-anchor="middle" font-size="14" transform="rotate(-90 20 {0:.1})">latency</text>"#,
        TOP + plot_h / 2.0
    );

    // One polyline per series.
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let mut points = String::new();
        if !s.histogram.is_empty() {
            for v in s.histogram.iter_quantiles(TICKS_PER_HALF_DISTANCE) {
                let q = v.quantile_iterated_to();
                let x = if q >= 1.0 { f64::from(nines) } else { -(1.0 - q).log10() };
                let x = x.clamp(0.0, f64::from(nines));
                let _ = write!(points, "{:.1},{:.1} ", px(x), py(v.value_iterated_to() as f64));
            }
        }
        let _ = writeln!(
            svg,
            r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{}"/>"#,
            points.trim_end()
        );
    }

    // Legend, top left inside the plot.
    let legend_h = 8.0 + 18.0 * series.len() as f64;
    let legend_w =
        40.0 + 7.0 * series.iter().map(|s| s.label.chars().count()).max().unwrap_or(0) as f64;
    let _ = writeln!(
        svg,
        r##"<rect x="{:.1}" y="{:.1}" width="{legend_w:.1}" height="{legend_h:.1}" fill="white" stroke="#999999"/>"##,
        LEFT + 10.0,
        TOP + 10.0
    );
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let y = TOP + 10.0 + 16.0 + 18.0 * i as f64;
        let _ = writeln!(
            svg,
            r#"<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{color}" stroke-width="3"/>"#,
            LEFT + 18.0,
            y - 4.0,
            LEFT + 38.0,
            y - 4.0
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{y:.1}">{}</text>"#,
            LEFT + 44.0,
            xml_escape(s.label)
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// `0%`, `90%`, `99%`, `99.9%`, …
fn nines_label(decade: u32) -> String {
    match decade {
        0 => "0%".to_owned(),
        1 => "90%".to_owned(),
        2 => "99%".to_owned(),
        n => format!("99.{}%", "9".repeat(n as usize - 2)),
    }
}

/// A 1/2/5 × 10ᵏ step giving at most 8 ticks, and the axis top (a multiple of the step).
fn nice_axis(value_max: f64) -> (f64, f64) {
    let value_max = if value_max > 0.0 { value_max } else { 1.0 };
    let raw_step = value_max / 6.0;
    let magnitude = 10f64.powf(raw_step.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|s| value_max / s <= 8.0)
        .unwrap_or(10.0 * magnitude)
        .max(1.0);
    (step, (value_max / step).ceil().max(1.0) * step)
}

fn xml_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if c.is_control() => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_polyline_per_series_and_escaped_labels() {
        let mut a = Histogram::<u64>::new_with_bounds(1, 1_000_000, 3).unwrap();
        for v in 1..=10_000 {
            a.record(v).unwrap();
        }
        let b = Histogram::<u64>::new_with_bounds(1, 1_000_000, 3).unwrap();
        let svg = percentile_plot_svg(
            "t<&>",
            &[
                PlotSeries { label: "a&b", histogram: &a },
                PlotSeries { label: "empty", histogram: &b },
            ],
        );
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("a&amp;b") && svg.contains("t&lt;&amp;&gt;"));
        assert!(svg.contains(">99.99%<"), "10k samples reach four nines");
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
    }

    #[test]
    fn axis_is_nice() {
        assert_eq!(nice_axis(0.0), (1.0, 1.0));
        let (step, top) = nice_axis(2_000_895.0);
        assert_eq!(step, 500_000.0);
        assert_eq!(top, 2_500_000.0);
        let labels: Vec<String> = (0..5).map(nines_label).collect();
        assert_eq!(labels, ["0%", "90%", "99%", "99.9%", "99.99%"]);
    }
}
