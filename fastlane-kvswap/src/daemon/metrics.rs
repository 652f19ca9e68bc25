//! The Prometheus families of `fastlane kv serve --metrics` (docs/kvswap.md lists them):
//! connections, requests, device and tier blocks, bytes swapped, transfers in flight, and the
//! content-addressed store's hits, misses and evictions, read from the server's counters at
//! each scrape.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use fastlane_daemon::metrics::{
    counter, gauge, set_gauge, set_total, Families, Field, FieldSet, IntCounterVec, IntGaugeVec,
};

use crate::server::ServerCounters;
use crate::{PrefixStats, PrefixStore, SwapEngine};

/// The server's counters (`ServerCounters`) as metrics: one line per field.
static SERVER_FIELDS: &[Field<ServerCounters>] = &[
    counter("fastlane_kv_requests_total", "Requests served (all ops)", |c| {
        c.requests.load(Ordering::Relaxed)
    }),
    counter(
        "fastlane_kv_cas_requests_total",
        "Content-addressed requests (PUT, GET, EXISTS, PIN, UNPIN, EVICT) served",
        |c| c.cas_requests.load(Ordering::Relaxed),
    ),
    counter("fastlane_kv_protocol_errors_total", "Connections closed for a malformed frame", |c| {
        c.protocol_errors.load(Ordering::Relaxed)
    }),
    counter(
        "fastlane_kv_cas_pins_released_on_close_total",
        "Pins released because their connection closed without UNPIN",
        |c| c.pins_released_on_close.load(Ordering::Relaxed),
    ),
    gauge("fastlane_kv_connections_open", "Connections open now (served or being refused)", |c| {
        c.open.load(Ordering::Relaxed)
    }),
];

/// The content-addressed store's counters (`PrefixStats`) as metrics: one line per field.
static CAS_FIELDS: &[Field<PrefixStats>] = &[
    counter("fastlane_kv_cas_get_keys_total", "Keys asked for by GET", |s| s.gets),
    counter("fastlane_kv_cas_get_hits_total", "Keys GET served (any tier)", |s| s.get_hits),
    counter("fastlane_kv_cas_lookups_total", "Leading-run lookups", |s| s.lookups),
    counter("fastlane_kv_cas_lookup_keys_total", "Keys asked for by lookups", |s| {
        s.blocks_looked_up
    }),
    counter("fastlane_kv_cas_host_hits_total", "Lookup keys served from host memory", |s| {
        s.host_hits
    }),
    counter("fastlane_kv_cas_cluster_hits_total", "Keys served from the cluster", |s| {
        s.cluster_hits
    }),
    counter("fastlane_kv_cas_misses_total", "Lookup keys not served", |s| s.misses),
    counter(
        "fastlane_kv_cas_integrity_misses_total",
        "Cluster values that failed verification (key, length, CRC32C), served as misses",
        |s| s.integrity_misses,
    ),
    counter("fastlane_kv_cas_inserts_total", "Blocks inserted into host memory", |s| {
        s.host_inserts
    }),
    counter(
        "fastlane_kv_cas_inserts_refused_total",
        "Blocks host memory could not take (larger than it, or the rest pinned)",
        |s| s.host_refused,
    ),
    counter(
        "fastlane_kv_cas_evictions_total",
        "Blocks evicted from host memory for room (least recently used first)",
        |s| s.evictions,
    ),
    counter("fastlane_kv_cas_evicted_by_request_total", "Blocks removed by EVICT", |s| {
        s.evicted_by_request
    }),
    counter("fastlane_kv_cas_cluster_puts_total", "Blocks the cluster acknowledged", |s| {
        s.cluster_puts
    }),
    counter(
        "fastlane_kv_cas_cluster_puts_dropped_total",
        "Puts dropped because the queue to the cluster was full",
        |s| s.puts_dropped,
    ),
    counter("fastlane_kv_cas_cluster_put_errors_total", "Puts the cluster failed", |s| {
        s.put_errors
    }),
    counter(
        "fastlane_kv_cas_cluster_errors_total",
        "Cluster calls that failed (timeout, connection); their keys were misses",
        |s| s.cluster_errors,
    ),
    counter("fastlane_kv_cas_cluster_read_bytes_total", "Bytes of cluster hits", |s| s.bytes_in),
    counter("fastlane_kv_cas_cluster_written_bytes_total", "Bytes the cluster stored", |s| {
        s.bytes_out
    }),
    gauge("fastlane_kv_cas_blocks", "Blocks in host memory now", |s| s.host_blocks),
    gauge("fastlane_kv_cas_bytes", "Bytes in host memory now", |s| s.host_bytes),
    gauge("fastlane_kv_cas_pins", "Pins held now (a key pinned twice counts twice)", |s| s.pins),
    gauge("fastlane_kv_cas_pinned_blocks", "Blocks pinned in host memory now", |s| s.pinned_blocks),
    counter("fastlane_kv_cas_nvme_hits_total", "Keys served from the NVMe tier", |s| s.nvme_hits),
    gauge("fastlane_kv_cas_nvme_blocks", "Blocks on the NVMe tier now", |s| s.nvme_blocks),
    gauge("fastlane_kv_cas_nvme_bytes", "Bytes on the NVMe tier now", |s| s.nvme_bytes),
    gauge("fastlane_kv_cas_nvme_capacity_blocks", "Slots of the NVMe tier", |s| {
        s.nvme_capacity_blocks
    }),
    counter("fastlane_kv_cas_nvme_spills_total", "Blocks written to the NVMe tier", |s| {
        s.nvme_spills
    }),
    counter(
        "fastlane_kv_cas_nvme_spills_dropped_total",
        "Spills dropped because the queue to the NVMe tier was full",
        |s| s.nvme_spills_dropped,
    ),
    counter(
        "fastlane_kv_cas_nvme_evictions_total",
        "Blocks dropped from the NVMe tier for room (least recently used first)",
        |s| s.nvme_evictions,
    ),
    counter(
        "fastlane_kv_cas_nvme_errors_total",
        "NVMe tier reads or writes that failed; their keys were misses",
        |s| s.nvme_errors,
    ),
];

/// Tier names by `TierKind::index`.
const TIERS: [&str; 3] = ["host", "nvme", "remote"];

/// The Prometheus families of `fastlane kv serve --metrics`.
pub(super) struct KvMetrics {
    server: FieldSet<ServerCounters>,
    connections: IntCounterVec,
    device_blocks: IntGaugeVec,
    device_pinned: IntGaugeVec,
    tier_blocks: IntGaugeVec,
    swap_bytes: IntCounterVec,
    checksum_failures: IntCounterVec,
    spills: IntCounterVec,
    tickets: IntGaugeVec,
    /// The store's families, with its capacity; `None` without a store (`--cas-bytes 0`).
    cas: Option<(FieldSet<PrefixStats>, IntGaugeVec, u64)>,
}

impl KvMetrics {
    /// `cas_bytes`: the store's capacity, `None` without one.
    pub(super) fn new(f: &Families, cas_bytes: Option<u64>) -> KvMetrics {
        KvMetrics {
            server: f.fields(SERVER_FIELDS),
            connections: f.counter(
                "fastlane_kv_connections_total",
                "Connections by result: accepted, refused_peer (credentials not allowed), \
                 refused_full (the connection limit was reached)",
                &["result"],
            ),
            device_blocks: f.gauge(
                "fastlane_kv_device_blocks",
                "Device pool blocks, by state (used, free)",
                &["state"],
            ),
            device_pinned: f.gauge(
                "fastlane_kv_device_pinned_blocks",
                "Device pool blocks pinned by transfers in flight (part of used)",
                &[],
            ),
            tier_blocks: f.gauge(
                "fastlane_kv_tier_blocks",
                "Swap tier slots (one block each), by configured tier (host, nvme, remote) and \
                 state (used, free)",
                &["tier", "state"],
            ),
            swap_bytes: f.counter(
                "fastlane_kv_swap_bytes_total",
                "Bytes moved by finished transfers, by direction (out: device to tier, in: tier \
                 to device, spill: host tier to a lower one)",
                &["direction"],
            ),
            checksum_failures: f.counter(
                "fastlane_kv_checksum_failures_total",
                "Block checksum mismatches seen",
                &[],
            ),
            spills: f.counter("fastlane_kv_spills_total", "Spills started", &[]),
            tickets: f.gauge(
                "fastlane_kv_tickets_in_flight",
                "Transfers (tickets) started and not yet finished",
                &[],
            ),
            cas: cas_bytes.map(|bytes| {
                let capacity = f.gauge(
                    "fastlane_kv_cas_capacity_bytes",
                    "Host memory of the content-addressed store (--cas-bytes)",
                    &[],
                );
                (f.fields(CAS_FIELDS), capacity, bytes)
            }),
        }
    }

    pub(super) fn update(
        &self,
        c: &ServerCounters,
        engine: &Mutex<SwapEngine>,
        store: Option<&PrefixStore>,
    ) {
        self.server.update(c);
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        set_total(&self.connections, &["accepted"], l(&c.accepted));
        set_total(&self.connections, &["refused_peer"], l(&c.refused));
        set_total(&self.connections, &["refused_full"], l(&c.refused_full));
        // One engine call under the lock every request takes for one call at a time.
        let (st, in_flight, bb) = {
            let e = engine.lock().unwrap_or_else(PoisonError::into_inner);
            (e.stats(), e.in_flight(), e.block_bytes() as u64)
        };
        set_gauge(
            &self.device_blocks,
            &["used"],
            u64::from(st.device_blocks.saturating_sub(st.device_free)),
        );
        set_gauge(&self.device_blocks, &["free"], u64::from(st.device_free));
        set_gauge(&self.device_pinned, &[], u64::from(st.device_pinned));
        for (t, name) in st.tiers.iter().zip(TIERS) {
            if t.present {
                let used = t.used_bytes / bb.max(1);
                set_gauge(&self.tier_blocks, &[name, "used"], used);
                set_gauge(
                    &self.tier_blocks,
                    &[name, "free"],
                    (t.capacity_bytes / bb.max(1)).saturating_sub(used),
                );
            }
        }
        set_total(&self.swap_bytes, &["out"], st.bytes_out);
        set_total(&self.swap_bytes, &["in"], st.bytes_in);
        set_total(&self.swap_bytes, &["spill"], st.bytes_spilled);
        set_total(&self.checksum_failures, &[], st.checksum_failures);
        set_total(&self.spills, &[], st.spills);
        set_gauge(&self.tickets, &[], in_flight as u64);
        if let (Some((fields, capacity, bytes)), Some(store)) = (&self.cas, store) {
            fields.update(&store.stats());
            set_gauge(capacity, &[], *bytes);
        }
    }
}
