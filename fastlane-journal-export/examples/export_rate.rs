//! Sustained export to a local three-node JetStream cluster: RATE records/s of 64 bytes for
//! SECONDS, sampling the exporter's lag every millisecond. Not part of CI.
//!
//! ```text
//! cargo run --release -p fastlane-journal-export --example export_rate [RATE] [SECONDS]
//! ```

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use fastlane_journal_export::{Exporter, MemorySource};

fn main() {
    let mut args = std::env::args().skip(1);
    let rate: u64 = args.next().map_or(20_000, |a| a.parse().expect("RATE records/s"));
    let seconds: u64 = args.next().map_or(30, |a| a.parse().expect("SECONDS"));
    let cluster = common::NatsCluster::start(3);
    let src = MemorySource::new();
    let exporter = Exporter::start(common::config(&cluster), Box::new(src.clone()))
        .expect("start the exporter");
    // Warm up: the stream exists and a session is up before the clock starts.
    src.append(0, 0, vec![0; 64]);
    common::wait_exported(&exporter, 1, Duration::from_secs(30));

    let start = Instant::now();
    let end = start + Duration::from_secs(seconds);
    let mut appended = 1u64;
    let mut lag_samples: Vec<u64> = Vec::with_capacity(seconds as usize * 1000);
    let mut tick = start;
    while Instant::now() < end {
        tick += Duration::from_millis(1);
        let due = 1 + rate * start.elapsed().as_micros() as u64 / 1_000_000;
        while appended < due {
            src.append(1, appended, vec![(appended % 251) as u8; 64]);
            appended += 1;
        }
        let s = exporter.stats();
        lag_samples.push(appended.saturating_sub(s.exported_seq));
        if appended.is_multiple_of(10_000) {
            src.trim_below(s.exported_seq);
        }
        if let Some(wait) = tick.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
    }
    let elapsed = start.elapsed();
    let at_end = exporter.stats();
    let drained_in = Instant::now();
    common::wait_exported(&exporter, appended, Duration::from_secs(60));
    let drain = drained_in.elapsed();
    let last = exporter.stop();

    lag_samples.sort_unstable();
    let pct = |p: f64| lag_samples[((lag_samples.len() - 1) as f64 * p) as usize];
    let ms = |records: u64| records as f64 * 1000.0 / rate as f64;
    let exported = at_end.exported_seq - 1;
    println!(
        "offered: {} records of 64 B in {:.1} s ({rate}/s)",
        appended - 1,
        elapsed.as_secs_f64()
    );
    println!(
        "exported during the run: {exported} ({:.0} records/s)",
        exported as f64 / elapsed.as_secs_f64()
    );
    println!(
        "lag (records; ms at the offered rate): p50 {} ({:.2} ms), p99 {} ({:.2} ms), max {} ({:.2} ms)",
        pct(0.5),
        ms(pct(0.5)),
        pct(0.99),
        ms(pct(0.99)),
        pct(1.0),
        ms(pct(1.0))
    );
    println!("drained the rest in {drain:?}; final stats: {last:?}");
}
