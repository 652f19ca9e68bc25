//! Write a synthetic interval log to try `fastlane hist` on:
//! `cargo run -p fastlane-hist --example synth_hlog -- OUT.hlog [MEAN_NS]`
//! (two tags: `read`, exponential with the given mean, default 20 µs; `write`, 98 % at
//! 50 µs and 2 % at 2 ms).

use fastlane_hist::synth::{write_synthetic_hlog, Distribution, SyntheticStream};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let out = args.next().ok_or("usage: synth_hlog OUT.hlog [MEAN_NS]")?;
    let mean_ns: f64 = args.next().map(|a| a.parse()).transpose()?.unwrap_or(20_000.0);
    let read =
        SyntheticStream::new(Distribution::Exponential { mean_ns }, 1_000_000, 10).tagged("read");
    let write = SyntheticStream::new(
        Distribution::TwoPoint { low_ns: 50_000, high_ns: 2_000_000, high_every: 50 },
        200_000,
        10,
    )
    .tagged("write");
    write_synthetic_hlog(&out, &[read, write])?;
    Ok(())
}
