//! Arrival processes and the simulator's random numbers (seeded, platform-independent).

use fastlane_util::SplitMix64;

/// SplitMix64 ([`fastlane_util::SplitMix64`]): small, fast, and the same stream on every
/// platform for a given seed.
#[derive(Debug, Clone)]
pub struct SimRng(SplitMix64);

impl SimRng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(SplitMix64::new(seed))
    }

    /// An independent stream for `stream` (a tenant index) under `seed`.
    pub fn stream(seed: u64, stream: u64) -> Self {
        let mut r = Self::new(seed ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03));
        r.next_u64();
        r
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in (0, 1].
    pub fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// Exponential with the given rate (per unit).
    pub fn exp(&mut self, rate: f64) -> f64 {
        -self.unit().ln() / rate
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let (u1, u2) = (self.unit(), self.unit());
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// How requests of one tenant arrive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ArrivalProcess {
    /// Poisson at a constant rate.
    Poisson {
        /// Mean requests per second.
        rate_per_s: f64,
    },
    /// Poisson whose log-rate follows an AR(1) process, times a diurnal sine:
    /// `rate(t) = mean × (1 + A sin(2πt/P)) × exp(x_k − σ²/2)`, `x_k = φ x_{k−1} + ε_k`,
    /// `ε ~ N(0, σ_e²)` with `σ² = σ_e² / (1 − φ²)` the stationary variance (so the mean rate
    /// is `mean`); the rate is constant within each `interval_s`.
    Bursty {
        /// Mean requests per second.
        rate_per_s: f64,
        /// AR(1) coefficient (≈ 0.92: bursts last ~12 intervals).
        phi: f64,
        /// Stationary standard deviation σ of the log-rate.
        sigma: f64,
        /// Diurnal amplitude A in [0, 1).
        diurnal_amplitude: f64,
        /// Diurnal period P in seconds (a "day", compressed to fit the run).
        diurnal_period_s: f64,
        /// AR(1) step in seconds.
        interval_s: f64,
    },
}

impl ArrivalProcess {
    /// The bursty process with the defaults used by the scenarios (φ = 0.92, σ = 0.8,
    /// A = 0.5, 1 s steps, one "day" per `period_s`).
    pub fn bursty(rate_per_s: f64, period_s: f64) -> Self {
        ArrivalProcess::Bursty {
            rate_per_s,
            phi: 0.92,
            sigma: 0.8,
            diurnal_amplitude: 0.5,
            diurnal_period_s: period_s,
            interval_s: 1.0,
        }
    }

    /// Arrival times in `[start_s, end_s)`, in ns, ascending. Bounded by `count_max`.
    pub fn times_ns(
        &self,
        rng: &mut SimRng,
        start_s: f64,
        end_s: f64,
        count_max: usize,
    ) -> Vec<u64> {
        let mut out = Vec::new();
        match *self {
            ArrivalProcess::Poisson { rate_per_s } => {
                if rate_per_s <= 0.0 {
                    return out;
                }
                let mut t = start_s + rng.exp(rate_per_s);
                while t < end_s && out.len() < count_max {
                    out.push((t * 1e9) as u64);
                    t += rng.exp(rate_per_s);
                }
            }
            ArrivalProcess::Bursty {
                rate_per_s,
                phi,
                sigma,
                diurnal_amplitude,
                diurnal_period_s,
                interval_s,
            } => {
                let sigma_e = sigma * (1.0 - phi * phi).max(0.0).sqrt();
                let mut x = sigma * rng.normal();
                let mut k0 = start_s;
                while k0 < end_s && out.len() < count_max {
                    let k1 = (k0 + interval_s).min(end_s);
                    let day = 1.0
                        + diurnal_amplitude
                            * (std::f64::consts::TAU * k0 / diurnal_period_s.max(1e-9)).sin();
                    let rate = rate_per_s * day.max(0.0) * (x - sigma * sigma / 2.0).exp();
                    if rate > 0.0 {
                        // Memoryless: restarting the exponential at the interval edge is exact.
                        let mut t = k0 + rng.exp(rate);
                        while t < k1 && out.len() < count_max {
                            out.push((t * 1e9) as u64);
                            t += rng.exp(rate);
                        }
                    }
                    x = phi * x + sigma_e * rng.normal();
                    k0 = k1;
                }
            }
        }
        out
    }
}

/// A distribution of token counts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LenDist {
    /// Always this many.
    Fixed(u32),
    /// Log-normal with this median and log-σ, clamped to `[min, max]`.
    LogNormal {
        /// Median.
        median: f64,
        /// σ of ln.
        sigma: f64,
        /// Floor.
        min: u32,
        /// Ceiling.
        max: u32,
    },
}

impl LenDist {
    /// One draw.
    pub fn sample(&self, rng: &mut SimRng) -> u32 {
        match *self {
            LenDist::Fixed(n) => n,
            LenDist::LogNormal { median, sigma, min, max } => {
                let v = median * (sigma * rng.normal()).exp();
                (v.round() as u32).clamp(min, max)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_rate_and_exponential_gaps() {
        let mut r = SimRng::new(7);
        let t = ArrivalProcess::Poisson { rate_per_s: 20.0 }.times_ns(&mut r, 0.0, 1000.0, 1 << 20);
        let n = t.len() as f64;
        assert!((n - 20_000.0).abs() < 4.0 * 20_000f64.sqrt(), "{n}");
        assert!(t.windows(2).all(|w| w[0] <= w[1]));
        // Coefficient of variation of the gaps ≈ 1.
        let gaps: Vec<f64> = t.windows(2).map(|w| (w[1] - w[0]) as f64).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
        let cv = var.sqrt() / mean;
        assert!((0.95..1.05).contains(&cv), "{cv}");
    }

    #[test]
    fn bursty_keeps_its_mean_and_is_burstier_than_poisson() {
        let mut r = SimRng::new(11);
        let p = ArrivalProcess::Bursty {
            rate_per_s: 10.0,
            phi: 0.92,
            sigma: 0.8,
            diurnal_amplitude: 0.0,
            diurnal_period_s: 1.0,
            interval_s: 1.0,
        };
        let t = p.times_ns(&mut r, 0.0, 20_000.0, 1 << 22);
        let n = t.len() as f64 / 20_000.0;
        assert!((8.5..11.5).contains(&n), "mean rate {n}");
        // Counts per second: variance far above the Poisson variance (= mean).
        let mut counts = vec![0f64; 20_000];
        for &x in &t {
            counts[(x / 1_000_000_000) as usize] += 1.0;
        }
        let m = counts.iter().sum::<f64>() / counts.len() as f64;
        let var = counts.iter().map(|c| (c - m).powi(2)).sum::<f64>() / counts.len() as f64;
        assert!(var > 5.0 * m, "index of dispersion {}", var / m);
        // Lag-1 autocorrelation of the counts is high (phi ≈ 0.92 in the log-rate).
        let cov = counts.windows(2).map(|w| (w[0] - m) * (w[1] - m)).sum::<f64>()
            / (counts.len() - 1) as f64;
        assert!(cov / var > 0.6, "lag-1 autocorrelation {}", cov / var);
    }

    #[test]
    fn same_seed_same_stream() {
        let a = SimRng::stream(3, 5).next_u64();
        let b = SimRng::stream(3, 5).next_u64();
        let c = SimRng::stream(3, 6).next_u64();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }
}
