//! Decode speed, fastlane-fpga against itchy on the feed of `benches/itch.rs`, as the best of
//! 40 alternating runs: a cross-check of the criterion ratio that holds up on a busy machine.
//!
//! `cargo run --release -p fastlane-fpga --example decode_speed`
use fastlane_fpga::gen::{generate, GenConfig};
use fastlane_fpga::itch::{Body, FeedReader};
use std::time::Instant;

fn main() {
    let feed =
        generate(&GenConfig { messages: 200_000, symbols: 16, seed: 1, itchy_compatible: true });
    let mut best = [f64::MAX; 2];
    for _ in 0..40 {
        let t = Instant::now();
        let mut acc = 0u64;
        for m in FeedReader::new(std::hint::black_box(&feed)).flatten() {
            acc = acc.wrapping_add(m.timestamp_ns ^ u64::from(m.locate));
            if let Body::AddOrder { price, .. } = m.body {
                acc = acc.wrapping_add(u64::from(price));
            }
        }
        std::hint::black_box(acc);
        best[0] = best[0].min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let mut acc = 0u64;
        for m in itchy::MessageStream::from_reader(std::hint::black_box(&feed[..])).flatten() {
            acc = acc.wrapping_add(m.timestamp ^ u64::from(m.stock_locate));
            if let itchy::Body::AddOrder(a) = &m.body {
                acc = acc.wrapping_add(u64::from(a.price.raw()));
            }
        }
        std::hint::black_box(acc);
        best[1] = best[1].min(t.elapsed().as_secs_f64());
    }
    println!(
        "fastlane {:.1} ns/msg, itchy {:.1} ns/msg, ratio {:.2}",
        best[0] / 2e5 * 1e9,
        best[1] / 2e5 * 1e9,
        best[1] / best[0]
    );
}
