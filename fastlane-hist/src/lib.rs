//! Latency histograms for FastLane (placeholder, being written).
