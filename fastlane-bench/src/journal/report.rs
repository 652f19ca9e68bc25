//! `fastlane journal bench --json`: the report's structures.

use fastlane_hist::LatencyRecorder;
use serde::Serialize;

#[derive(Serialize)]
pub(super) struct Pcts {
    #[serde(rename = "p50_ns")]
    pub(super) p50: u64,
    #[serde(rename = "p99_ns")]
    pub(super) p99: u64,
    #[serde(rename = "p999_ns")]
    pub(super) p999: u64,
    #[serde(rename = "max_ns")]
    pub(super) max: u64,
    #[serde(rename = "count")]
    pub(super) n: u64,
}

/// `fastlane journal bench --json`: what the table prints.
#[derive(Serialize)]
pub(super) struct BenchReport<'a> {
    pub(super) record_bytes: usize,
    pub(super) durability: String,
    pub(super) io: String,
    pub(super) writer_io: &'static str,
    pub(super) prefill: bool,
    pub(super) ack_wait: &'static str,
    pub(super) preprocess: &'static str,
    pub(super) rate_per_s: u64,
    pub(super) seconds: f64,
    pub(super) append: &'a Pcts,
    pub(super) ack: &'a Pcts,
    pub(super) pwrite_fdatasync: &'a Pcts,
    pub(super) same_load_no_journal: &'a Pcts,
    pub(super) ack_over_floor_p50: f64,
    pub(super) ack_over_floor_p99: f64,
    pub(super) ack_over_no_journal_p50: f64,
    pub(super) ack_over_no_journal_p99: f64,
    pub(super) ack_run_batches: u64,
    pub(super) ack_run_flushes: u64,
    pub(super) no_journal_drain_s: f64,
    pub(super) throughput_records_per_s: f64,
    pub(super) throughput_records: u64,
    pub(super) throughput_s: f64,
    pub(super) throughput_batches: u64,
    pub(super) throughput_full_retries: u64,
    pub(super) framing_ns_per_record: f64,
    pub(super) framing_chain_ns: f64,
    pub(super) framing_crc32c_ns: f64,
    pub(super) framing_timestamp_ns: f64,
    pub(super) framing_batch_hash_ns: f64,
    pub(super) framing_direct_ns_per_record: f64,
    pub(super) framing_card_ns_per_record: f64,
    pub(super) hlog: String,
}

pub(super) fn pcts(r: &LatencyRecorder) -> Pcts {
    let h = r.current();
    Pcts {
        p50: h.value_at_quantile(0.5),
        p99: h.value_at_quantile(0.99),
        p999: h.value_at_quantile(0.999),
        max: h.max(),
        n: h.len(),
    }
}
