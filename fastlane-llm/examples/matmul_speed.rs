//! Prints GFLOP/s of the batch-invariant matmul for a few shapes (a quick look; the
//! benchmark of record is `fastlane llm bench`).
use std::time::Instant;

use fastlane_llm::kernels::{matmul, PackedMatrix};

fn main() {
    for &(m, n, k) in &[
        (512usize, 1280usize, 768usize),
        (512, 4096, 768),
        (512, 768, 2048),
        (1, 4096, 768),
        (16, 4096, 768),
        (1, 32000, 768),
        (1, 768, 2048),
    ] {
        let w: Vec<f32> = (0..n * k).map(|i| (i % 13) as f32 * 0.01).collect();
        let x: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 * 0.1).collect();
        let p = PackedMatrix::pack(&w, n, k);
        let mut y = vec![0.0; m * n];
        matmul(&x, m, &p, &mut y);
        let reps = (2e9 / (2.0 * (m * n * k) as f64)).clamp(3.0, 2000.0) as usize;
        let t0 = Instant::now();
        for _ in 0..reps {
            matmul(&x, m, &p, &mut y);
        }
        let dt = t0.elapsed().as_secs_f64() / reps as f64;
        println!(
            "m={m:4} n={n:5} k={k:5}: {:8.3} ms  {:6.1} GFLOP/s  {:5.1} GB/s of weights",
            dt * 1e3,
            2.0 * (m * n * k) as f64 / dt / 1e9,
            (n * k * 4) as f64 / dt / 1e9
        );
    }
}
