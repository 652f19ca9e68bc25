//! The limits, defaults and format constants that `docs/*.md` quote, checked against the code.
//!
//! Each [`Check`] is a piece of text a doc must contain, written as a template whose `{}` is
//! filled from the code: a constant, a `Default` impl, a constructor's default or a clap flag's
//! default. The template also holds the constant's name as the doc gives it, in backticks. When
//! the code changes a value, the doc that quotes it fails here instead of going stale. Runs of
//! whitespace, line breaks included, count as one space, so re-wrapping a paragraph keeps its
//! checks passing.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use fastlane::{bench, disk, fpga, journal, kvswap, llm, market, nvme, openai, rdma, ring, sched};
use fastlane::{daemon, vhost_blk};

/// One value a doc quotes: the doc must contain `before + value + after`.
#[derive(Debug)]
struct Check {
    /// File name under `docs/`.
    doc: &'static str,
    /// The constant, default or flag the value comes from, for the failure message.
    constant: &'static str,
    /// Text right before the value in the doc.
    before: String,
    /// The value, rendered from the code.
    value: String,
    /// Text right after the value (usually the constant's name in backticks).
    after: String,
}

/// A check that `docs/{doc}` contains `template` with its `{}` replaced by `value`.
fn check(doc: &'static str, constant: &'static str, template: &str, value: impl ToString) -> Check {
    let (before, after) = template.split_once("{}").expect("a template holds one {}");
    Check {
        doc,
        constant,
        before: before.to_string(),
        value: value.to_string(),
        after: after.to_string(),
    }
}

/// `n` with `sep` between groups of three digits: `16,384`, `65 536`.
fn grouped(n: u64, sep: &str) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push_str(sep);
        }
        out.push(c);
    }
    out
}

/// Bytes in the largest binary unit that divides them: `4 KiB`, `1 MiB`, `2 GiB`, `100 bytes`.
fn size(bytes: u64) -> String {
    for (shift, unit) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{} {unit}", bytes >> shift);
        }
    }
    format!("{bytes} bytes")
}

/// A duration as the docs write it: `30 s`, `250 ms`, `50 µs`.
fn dur(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{} s", d.as_secs())
    } else if d.as_nanos().is_multiple_of(1_000_000) {
        format!("{} ms", d.as_millis())
    } else {
        format!("{} µs", d.as_micros())
    }
}

/// The default clap gives the flag `--long` of `A`, as clap displays it.
fn flag_default<A: Args>(long: &str) -> String {
    let cmd = A::augment_args(clap::Command::new("docs-constants"));
    let arg = cmd
        .get_arguments()
        .find(|a| a.get_long() == Some(long))
        .unwrap_or_else(|| panic!("no flag --{long}"));
    let values: Vec<String> =
        arg.get_default_values().iter().map(|v| v.to_string_lossy().into_owned()).collect();
    assert!(!values.is_empty(), "--{long} has no default");
    values.join(",")
}

fn docs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("docs")
}

/// Whitespace runs (line breaks included) as one space.
fn normalise(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn serving() -> Vec<Check> {
    let http = daemon::http::HttpOptions::default();
    let tenants = openai::Tenants::parse(
        r#"
[[tenant]]
name = "t"
keys = ["k"]
rpm = 60
burst = 5
max_concurrent = 1
tier = "interactive"
"#,
    )
    .expect("a minimal tenants file parses");
    let sched::TierSteps::Separate { hold_ns_max } = sched::TierSteps::SEPARATE else {
        panic!("TierSteps::SEPARATE is not Separate");
    };
    let d = "serving.md";
    vec![
        check(
            d,
            "HttpOptions::default().header_timeout",
            "`--header-timeout-seconds` ({}; `HttpOptions::header_timeout`)",
            http.header_timeout.as_secs(),
        ),
        check(
            d,
            "HttpOptions::default().max_connections",
            "`--max-connections` ({}; `HttpOptions::max_connections`)",
            grouped(http.max_connections as u64, ","),
        ),
        check(
            d,
            "HttpOptions::default().drain",
            "`--drain-seconds` ({}; `HttpOptions::drain`)",
            http.drain.as_secs(),
        ),
        check(
            d,
            "openai::api::DEFAULT_MAX_TOKENS",
            "`max_tokens` ({}, `DEFAULT_MAX_TOKENS`)",
            openai::api::DEFAULT_MAX_TOKENS,
        ),
        check(
            d,
            "openai::api::BODY_TIMEOUT_SECONDS",
            "`--body-timeout-seconds` ({}; `BODY_TIMEOUT_SECONDS`)",
            openai::api::BODY_TIMEOUT_SECONDS,
        ),
        check(
            d,
            "HttpOptions::default().write_timeout",
            "`--client-write-timeout-seconds` ({}; `HttpOptions::write_timeout`)",
            http.write_timeout.as_secs(),
        ),
        check(
            d,
            "llm serve --send-buffer-bytes default",
            "`--send-buffer-bytes` ({}; `HttpOptions::send_buffer`",
            flag_default::<llm::args::HttpArgs>("send-buffer-bytes"),
        ),
        check(
            d,
            "daemon::http::LISTEN_BACKLOG",
            "The backlog is {} (`LISTEN_BACKLOG`",
            grouped(daemon::http::LISTEN_BACKLOG as u64, ","),
        ),
        check(
            d,
            "daemon::http::CONNECTION_BUFFER_BYTES",
            "hyper's connection buffer of {} (`CONNECTION_BUFFER_BYTES`",
            size(daemon::http::CONNECTION_BUFFER_BYTES as u64),
        ),
        check(
            d,
            "llm::server::admit::TOKENIZER_THREADS",
            "| {} (`TOKENIZER_THREADS`)",
            llm::server::admit::TOKENIZER_THREADS,
        ),
        check(
            d,
            "openai::api::STOP_STRINGS_MAX",
            "{} strings (`STOP_STRINGS_MAX`)",
            openai::api::STOP_STRINGS_MAX,
        ),
        check(
            d,
            "openai::api::STOP_STRING_BYTES_MAX",
            "of 1–{} bytes (`STOP_STRING_BYTES_MAX`)",
            openai::api::STOP_STRING_BYTES_MAX,
        ),
        check(
            d,
            "openai::api::STOP_TOKEN_IDS_MAX",
            "{} `stop_token_ids` (`STOP_TOKEN_IDS_MAX`)",
            openai::api::STOP_TOKEN_IDS_MAX,
        ),
        check(
            d,
            "llm::STALL_AFTER",
            "no engine step has begun for {} (`STALL_AFTER`)",
            dur(llm::STALL_AFTER),
        ),
        check(
            d,
            "llm::server::LIVENESS_STALL",
            "stalled for {} (`LIVENESS_STALL`)",
            dur(llm::server::LIVENESS_STALL),
        ),
        check(
            d,
            "openai::api::BODY_BYTES_MAX",
            "a body over {} (`BODY_BYTES_MAX`)",
            size(openai::api::BODY_BYTES_MAX as u64),
        ),
        check(
            d,
            "tenants file: the default of `queue`",
            "wait for a slot at the router (default {})",
            tenants.entries()[0].queue,
        ),
        check(
            d,
            "sched::TierSteps::SEPARATE (hold_ns_max)",
            "kept out for {} (`TierSteps::SEPARATE`) without a break",
            dur(Duration::from_nanos(hold_ns_max)),
        ),
        check(
            d,
            "llm::args::SERVE_MIXED_BATCH_TOKENS",
            "(`--mixed-batch-tokens`, {} for `llm serve`)",
            llm::args::SERVE_MIXED_BATCH_TOKENS,
        ),
        check(
            d,
            "random:tiny's LlamaConfig::attention_context",
            "too short to measure, {} for `random:tiny`)",
            grouped(u64::from(llm::RandomPreset::Tiny.config().attention_context()), ","),
        ),
        check(
            d,
            "openai::gate::BATCH_HOLD_MAX",
            "(at most {} in a row, `BATCH_HOLD_MAX`,",
            dur(openai::gate::BATCH_HOLD_MAX),
        ),
    ]
}

fn fpga_abi() -> Vec<Check> {
    use fpga::abi::{self, reg};
    let d = "fpga-abi.md";
    let mut checks = vec![
        check(
            d,
            "fpga::abi::ABI_MAGIC",
            "| RO | `{}` (\"FLPQ\", `ABI_MAGIC`) |",
            format!("0x{:08X}", abi::ABI_MAGIC),
        ),
        check(
            d,
            "fpga::abi::ABI_VERSION_MAJOR.ABI_VERSION_MINOR",
            "this document is {} (`ABI_VERSION_MAJOR`.`ABI_VERSION_MINOR`) |",
            format!("{}.{}", abi::ABI_VERSION_MAJOR, abi::ABI_VERSION_MINOR),
        ),
        check(
            d,
            "fpga::abi::ABI_VERSION_MAJOR.ABI_VERSION_MINOR",
            "# FastLane preprocessing card ABI (version {})",
            format!("{}.{}", abi::ABI_VERSION_MAJOR, abi::ABI_VERSION_MINOR),
        ),
        check(
            d,
            "fpga::abi::BAR_SIZE",
            "Everything else up to {} (`BAR_SIZE`) is reserved",
            format!("{:#x}", abi::BAR_SIZE),
        ),
        check(d, "fpga::abi::BAR_SIZE", "(BAR0, {}, 32-bit registers)", size(abi::BAR_SIZE as u64)),
        check(
            d,
            "fpga::abi::RING_LOG2_MAX",
            "| `DESC_RING_LOG2` | RW | entries = 2^n, n in 1..={} (`RING_LOG2_MAX`) |",
            abi::RING_LOG2_MAX,
        ),
        check(
            d,
            "fpga::abi::RING_LOG2_MAX",
            "| `CPL_RING_LOG2` | RW | entries = 2^n, n in 1..={} (`RING_LOG2_MAX`) |",
            abi::RING_LOG2_MAX,
        ),
        check(
            d,
            "size_of::<fpga::abi::Descriptor>()",
            "## Descriptor (host to card, {} bytes, `abi::Descriptor`)",
            std::mem::size_of::<abi::Descriptor>(),
        ),
        check(
            d,
            "size_of::<fpga::abi::Completion>()",
            "## Completion (card to host, {} bytes, `abi::Completion`)",
            std::mem::size_of::<abi::Completion>(),
        ),
        check(
            d,
            "size_of::<market::event::Event>()",
            "## Event ({} bytes, `fastlane_market::event::Event`)",
            std::mem::size_of::<market::event::Event>(),
        ),
    ];
    // The register map: each row's offset is the `abi::reg` constant of the row's name.
    let regs: [(&'static str, usize, Option<usize>); 18] = [
        ("ID", reg::ID, None),
        ("VERSION", reg::VERSION, None),
        ("CAPS", reg::CAPS, None),
        ("CONTROL", reg::CONTROL, None),
        ("STATUS", reg::STATUS, None),
        ("ERROR", reg::ERROR, None),
        ("ERROR_COUNT", reg::ERROR_COUNT, None),
        ("IRQ_STATUS", reg::IRQ_STATUS, None),
        ("IRQ_MASK", reg::IRQ_MASK, None),
        ("DESC_BASE_LO/HI", reg::DESC_BASE_LO, Some(reg::DESC_BASE_HI)),
        ("DESC_RING_LOG2", reg::DESC_RING_LOG2, None),
        ("DESC_PROD", reg::DESC_PROD, None),
        ("DESC_CONS", reg::DESC_CONS, None),
        ("CPL_BASE_LO/HI", reg::CPL_BASE_LO, Some(reg::CPL_BASE_HI)),
        ("CPL_RING_LOG2", reg::CPL_RING_LOG2, None),
        ("CPL_PROD", reg::CPL_PROD, None),
        ("CPL_CONS", reg::CPL_CONS, None),
        ("CLOCK_LO/HI", reg::CLOCK_LO, Some(reg::CLOCK_HI)),
    ];
    for (name, offset, hi) in regs {
        let row = format!("| {{}} | `{name}` |");
        let value = match hi {
            None => format!("0x{offset:03X}"),
            Some(hi) => format!("0x{offset:03X} / 0x{hi:03X}"),
        };
        checks.push(check(d, "fpga::abi::reg (the row's register)", &row, value));
    }
    checks
}

fn journal() -> Vec<Check> {
    use journal::format as f;
    let device = Arc::new(fastlane::block::ram::RamDisk::new(64 << 10, 512).expect("a RAM disk"));
    let config = journal::JournalConfig::new(device, journal::Durability::Local);
    let d = "journal.md";
    vec![
        check(
            d,
            "JournalConfig::new(..).max_record_bytes",
            "`max_record_bytes` (default {},",
            config.max_record_bytes,
        ),
        check(
            d,
            "journal::format::MAX_RECORD_BYTES_LIMIT",
            "at most {}: `MAX_RECORD_BYTES_LIMIT`)",
            size(f::MAX_RECORD_BYTES_LIMIT.into()),
        ),
        check(
            d,
            "JournalConfig::new(..).max_batch_bytes",
            "`max_batch_bytes` (default {}, at most a quarter",
            size(config.max_batch_bytes.into()),
        ),
        check(
            d,
            "journal::format::MAX_BATCH_BYTES_LIMIT",
            "of the device and {}: `MAX_BATCH_BYTES_LIMIT`)",
            size(f::MAX_BATCH_BYTES_LIMIT.into()),
        ),
        check(
            d,
            "journal::format::SUPER_MAGIC",
            "| 0 | 8 | magic `{}` (`SUPER_MAGIC`) |",
            String::from_utf8_lossy(&f::SUPER_MAGIC),
        ),
        check(
            d,
            "journal::format::FORMAT_VERSION",
            "| 8 | 4 | version ({}, `FORMAT_VERSION`) |",
            f::FORMAT_VERSION,
        ),
        check(
            d,
            "journal::format::DATA_OFFSET",
            "| 56 | 8 | data offset ({}, `DATA_OFFSET`) |",
            f::DATA_OFFSET,
        ),
        check(
            d,
            "journal::format::SUPER_LEN",
            "zero (the fields above are `SUPER_LEN` = {} bytes) |",
            f::SUPER_LEN,
        ),
        check(
            d,
            "journal::format::SUPER_LEN and DATA_OFFSET - SUPER_LEN",
            "| {} | zero (the fields above",
            format!("{} | {}", f::SUPER_LEN, f::DATA_OFFSET - f::SUPER_LEN as u64),
        ),
        check(
            d,
            "journal::format::DATA_OFFSET",
            "### Frames (from offset {}, back to back,",
            f::DATA_OFFSET,
        ),
        check(
            d,
            "journal::format::FRAME_ALIGN",
            "back to back, {}-byte aligned: `FRAME_ALIGN`)",
            f::FRAME_ALIGN,
        ),
        check(
            d,
            "journal::format::FRAME_MAGIC",
            "| 0 | 4 | magic `{}` (`FRAME_MAGIC`) |",
            String::from_utf8_lossy(&f::FRAME_MAGIC.to_le_bytes()),
        ),
        check(
            d,
            "journal::format::CHAIN_LEN",
            "| 24 | {} | chain value (`CHAIN_LEN`) |",
            f::CHAIN_LEN,
        ),
        check(
            d,
            "journal::format::FRAME_HEADER_LEN",
            "keep the frame header at {} bytes (`FRAME_HEADER_LEN`)",
            f::FRAME_HEADER_LEN,
        ),
        check(
            d,
            "journal::preprocess::CARD_TIMEOUT",
            "`with_timeout` (default {}, `CARD_TIMEOUT`)",
            dur(journal::preprocess::CARD_TIMEOUT),
        ),
    ]
}

fn ring() -> Vec<Check> {
    use ring::shm::layout as l;
    use ring::spsc;
    let d = "ring.md";
    vec![
        check(d, "ring::spsc::SETTLE_BUDGET_NANOS", "by default `spsc::default_settle_limit()`, {} worth of pauses on the CPU at hand (`SETTLE_BUDGET_NANOS`)", dur(Duration::from_nanos(spsc::SETTLE_BUDGET_NANOS))),
        check(d, "ring::spsc::SETTLE_MAX_PAUSES", "(`SETTLE_BUDGET_NANOS`), at most {} (`SETTLE_MAX_PAUSES`); `set_settle_limit(0)`", spsc::SETTLE_MAX_PAUSES),
        check(d, "ring::shm::layout::HEADER_LEN", "a versioned header of {} bytes (`layout::HEADER_LEN`", l::HEADER_LEN),
        check(d, "ring::shm::layout::MAGIC", "(`layout::HEADER_LEN`: magic `{}`,", String::from_utf8_lossy(&l::MAGIC.to_le_bytes())),
        check(d, "ring::shm::layout::ABI_VERSION", "ABI version {} (`layout::ABI_VERSION`)", l::ABI_VERSION),
        check(d, "ring::shm::layout::RECORD_HEADER_LEN", "records behind an {}-byte header (`layout::RECORD_HEADER_LEN`)", l::RECORD_HEADER_LEN),
        check(d, "ring::shm::layout::RECORD_ALIGN", "each {}-byte-aligned (`layout::RECORD_ALIGN`)", l::RECORD_ALIGN),
        check(d, "ring::shm::layout::MIN_CAPACITY", "a power of two from {} bytes (`layout::MIN_CAPACITY`)", l::MIN_CAPACITY),
        check(d, "ring::shm::layout::MAX_CAPACITY", "(`layout::MIN_CAPACITY`) to {} (`layout::MAX_CAPACITY`)", size(l::MAX_CAPACITY as u64)),
    ]
}

fn kvswap() -> Vec<Check> {
    use kvswap::{cluster, prefix, proto, server};
    let cluster_cfg = cluster::ClusterTierConfig::default();
    let engine = kvswap::EngineConfig::default();
    let d = "kvswap.md";
    vec![
        check(
            d,
            "kvswap::EngineConfig::default().chunk_bytes",
            "jobs of `chunk_bytes` (default {}, never below",
            size(engine.chunk_bytes as u64),
        ),
        check(
            d,
            "kvswap::CHUNK_BYTES_MIN",
            "never below {} (`CHUNK_BYTES_MIN`)",
            size(kvswap::CHUNK_BYTES_MIN as u64),
        ),
        check(
            d,
            "kvswap::prefix::SPILL_QUEUE_MAX",
            "bounded by `spill_queue_max` (default {}, `SPILL_QUEUE_MAX`,",
            prefix::SPILL_QUEUE_MAX,
        ),
        check(
            d,
            "kvswap::cluster::VALUE_HEADER_BYTES",
            "Values are a {}-byte header (`cluster::VALUE_HEADER_BYTES`)",
            cluster::VALUE_HEADER_BYTES,
        ),
        check(
            d,
            "kvswap::cluster::VALUE_MAGIC",
            "| `magic u32` | `{}` (the bytes `KVCB`, `cluster::VALUE_MAGIC`) |",
            format!("0x{:08X}", cluster::VALUE_MAGIC),
        ),
        check(
            d,
            "kvswap::cluster::VALUE_VERSION",
            "| 4 | `version u16` | {} (`cluster::VALUE_VERSION`) |",
            cluster::VALUE_VERSION,
        ),
        check(
            d,
            "ClusterTierConfig::default().timeout",
            "timeout (whole call, default {})",
            dur(cluster_cfg.timeout),
        ),
        check(
            d,
            "ClusterTierConfig::default().connect_timeout",
            "connect_timeout (one node connection, {})",
            dur(cluster_cfg.connect_timeout),
        ),
        check(
            d,
            "ClusterTierConfig::default().response_timeout",
            "response_timeout (one node reply, {})",
            dur(cluster_cfg.response_timeout),
        ),
        check(
            d,
            "kvswap::proto::HEADER_LEN",
            "is a {}-byte header (`proto::HEADER_LEN`)",
            proto::HEADER_LEN,
        ),
        check(
            d,
            "kvswap::proto::MAGIC",
            "| `magic u32` | `{}` (the bytes `KVSW`, `proto::MAGIC`) |",
            format!("0x{:08X}", proto::MAGIC),
        ),
        check(
            d,
            "kvswap::proto::VERSION",
            "| 4 | `version u16` | {} (`proto::VERSION`) |",
            proto::VERSION,
        ),
        check(
            d,
            "kvswap::proto::REPLY",
            "replies `op \\| {}` (`proto::REPLY`)",
            format!("{:#06x}", proto::REPLY),
        ),
        check(
            d,
            "kvswap::proto::PAYLOAD_MAX",
            "payload bytes, at most {} (`proto::PAYLOAD_MAX`)",
            grouped(proto::PAYLOAD_MAX as u64, " "),
        ),
        check(
            d,
            "kvswap::proto::NAMESPACE_MAX",
            "(at most {} of `[A-Za-z0-9._:-]`, `proto::NAMESPACE_MAX`;",
            proto::NAMESPACE_MAX,
        ),
        check(
            d,
            "kvswap::server::COMPLETE_WAIT_MAX",
            "(server caps at {}, `server::COMPLETE_WAIT_MAX`)",
            dur(server::COMPLETE_WAIT_MAX),
        ),
        check(
            d,
            "kvswap::proto::BLOCKS_MAX",
            "`count` is at most {} for the block lists of ops 3, 5 and 7 (`proto::BLOCKS_MAX`)",
            grouped(proto::BLOCKS_MAX as u64, " "),
        ),
        check(
            d,
            "kvswap::proto::KEY_BLOCKS_MAX",
            "(`proto::BLOCKS_MAX`), {} for `PUT`/`GET` (`proto::KEY_BLOCKS_MAX`)",
            grouped(proto::KEY_BLOCKS_MAX as u64, " "),
        ),
        check(
            d,
            "kvswap::proto::KEYS_MAX",
            "(`proto::KEY_BLOCKS_MAX`) and {} for ops 14–17 (`proto::KEYS_MAX`)",
            grouped(proto::KEYS_MAX as u64, " "),
        ),
        check(
            d,
            "kvswap::server::CONNECTIONS_MAX",
            "At most {} connections (`server::CONNECTIONS_MAX`).",
            server::CONNECTIONS_MAX,
        ),
        check(
            d,
            "kvswap::server::PINS_PER_KEY_MAX",
            "(at most {} pins per key and connection, `server::PINS_PER_KEY_MAX`)",
            grouped(server::PINS_PER_KEY_MAX.into(), " "),
        ),
    ]
}

fn llm() -> Vec<Check> {
    let prefix = llm::engine::PrefixConfig::default();
    let d = "llm.md";
    vec![
        check(
            d,
            "llm::kernels::PANEL",
            "in panels of {} output columns (`kernels::PANEL`;",
            llm::kernels::PANEL,
        ),
        check(
            d,
            "llm::TOKENS_PER_BLOCK",
            "in blocks of {} tokens (`TOKENS_PER_BLOCK`;",
            llm::TOKENS_PER_BLOCK,
        ),
        check(
            d,
            "PrefixConfig::default().host_bytes",
            "`--prefix-cache-bytes` (default {}, `PrefixConfig::host_bytes`)",
            format!("{}M", prefix.host_bytes >> 20),
        ),
        check(
            d,
            "PrefixConfig::default().cluster_namespace",
            "(namespace `{}`, every call bounded by",
            &prefix.cluster_namespace,
        ),
        check(
            d,
            "PrefixConfig::default().cluster_timeout",
            "every call bounded by {}: `PrefixConfig::cluster_timeout`)",
            dur(prefix.cluster_timeout),
        ),
        check(
            d,
            "kvswap::prefix::PUT_BATCH_MAX",
            "puts queued blocks in batches of up to {} (`prefix::PUT_BATCH_MAX`)",
            kvswap::prefix::PUT_BATCH_MAX,
        ),
        check(
            d,
            "kvswap::prefix::PUT_QUEUE_MAX",
            "a full queue ({}, `prefix::PUT_QUEUE_MAX`)",
            kvswap::prefix::PUT_QUEUE_MAX,
        ),
    ]
}

fn vhost_blk() -> Vec<Check> {
    use vhost_blk::{chain, inflight, interpose};
    // `mem:256M` as the usage comment writes it, `256 MiB`; any other default as it is.
    let backend = flag_default::<disk::ServeArgs>("backend");
    let ram_disk = match backend.strip_prefix("mem:").and_then(|s| s.strip_suffix('M')) {
        Some(mib) => format!("{mib} MiB"),
        None => backend.clone(),
    };
    let d = "vhost-blk.md";
    vec![
        check(
            d,
            "clap default of `fastlane serve --backend` (disk::ServeArgs)",
            "fastlane serve --socket-path /run/fastlane.sock # {} RAM disk",
            ram_disk,
        ),
        check(
            d,
            "clap default of `fastlane serve --poll-us` (disk::ServeArgs)",
            "adaptive polling (`--poll-us`, default {})",
            flag_default::<disk::ServeArgs>("poll-us"),
        ),
        check(
            d,
            "vhost_blk::inflight::QUEUE_HEADER_BYTES",
            "one region per queue of {} (`inflight::QUEUE_HEADER_BYTES`)",
            inflight::QUEUE_HEADER_BYTES,
        ),
        check(
            d,
            "vhost_blk::inflight::DESC_STATE_BYTES",
            "(`inflight::QUEUE_HEADER_BYTES`) + {} (`inflight::DESC_STATE_BYTES`) × queue size",
            inflight::DESC_STATE_BYTES,
        ),
        check(
            d,
            "vhost_blk::inflight::QUEUE_ALIGN",
            "bytes rounded up to {} (`inflight::QUEUE_ALIGN`)",
            inflight::QUEUE_ALIGN,
        ),
        check(
            d,
            "vhost_blk::chain::INDIRECT_MAX",
            "indirect tables of at most {} entries (`chain::INDIRECT_MAX`)",
            chain::INDIRECT_MAX,
        ),
        check(
            d,
            "vhost_blk::interpose::PAYLOAD_MAX",
            "a message carries at most {} payload bytes, `interpose::PAYLOAD_MAX`,",
            interpose::PAYLOAD_MAX,
        ),
        check(
            d,
            "vhost_blk::interpose::FDS_MAX",
            "`interpose::PAYLOAD_MAX`, and {} descriptors, `interpose::FDS_MAX`",
            interpose::FDS_MAX,
        ),
        check(
            d,
            "vhost_blk::MERGE_INTERVAL",
            "shared one every {} (`MERGE_INTERVAL`) while busy",
            dur(vhost_blk::MERGE_INTERVAL),
        ),
    ]
}

fn vfio_nvme() -> Vec<Check> {
    let o = nvme::NvmeOptions::default();
    let d = "vfio-nvme.md";
    vec![
        check(d, "NvmeOptions::default().nsid", "namespace id (`nsid`, {})", o.nsid),
        check(d, "NvmeOptions::default().io_queues_max", "(`io_queues_max`, {})", o.io_queues_max),
        check(
            d,
            "NvmeOptions::default().command_timeout",
            "(`command_timeout`, {})",
            dur(o.command_timeout),
        ),
        check(
            d,
            "NvmeOptions::default().bounce_bytes",
            "(`bounce_bytes`, {})",
            size(o.bounce_bytes as u64),
        ),
        check(d, "NvmeOptions::default().max_segments", "(`max_segments`, {})", o.max_segments),
        check(
            d,
            "NvmeOptions::default().max_transfer_bytes",
            "(`max_transfer_bytes`, {}, also capped by MDTS)",
            size(o.max_transfer_bytes.into()),
        ),
        check(
            d,
            "nvme::regs::REG_DOORBELL_BASE",
            "doorbells at `{} + (2*qid + cq) * (4 << CAP.DSTRD)` (`REG_DOORBELL_BASE`)",
            format!("{:#x}", nvme::regs::REG_DOORBELL_BASE),
        ),
        check(
            d,
            "nvme::dma::IOVA_BASE",
            "IOVA bump allocator from {} (`dma::IOVA_BASE`)",
            size(nvme::dma::IOVA_BASE),
        ),
        check(
            d,
            "nvme::dma::IOVA_END",
            "(IOVAs are not reused): 2^{} bytes (`dma::IOVA_END`)",
            nvme::dma::IOVA_END.trailing_zeros(),
        ),
        check(
            d,
            "nvme::cmd::DSM_RANGES_MAX",
            "(up to {} ranges per command, `cmd::DSM_RANGES_MAX`)",
            nvme::cmd::DSM_RANGES_MAX,
        ),
    ]
}

fn rdma() -> Vec<Check> {
    let qp = rdma::QpConfig::default();
    let conn = rdma::ConnectOptions::default();
    let d = "rdma.md";
    vec![
        check(
            d,
            "rdma::QpConfig::default() (ack_timeout_exp, retry_cnt)",
            "the default `QpConfig`: {}, `ack_timeout_exp` and `retry_cnt`",
            format!("2^{} × 4.096 µs × {} tries", qp.ack_timeout_exp, qp.retry_cnt),
        ),
        check(
            d,
            "rdma::ConnectOptions::default().op_timeout",
            "`ConnectOptions::op_timeout`, {} by default",
            dur(conn.op_timeout),
        ),
        check(
            d,
            "rdma::GRANT_ALIGN",
            "Lengths are rounded up to {} bytes (`GRANT_ALIGN`)",
            rdma::GRANT_ALIGN,
        ),
        check(
            d,
            "rdma::GRANTS_PER_CLIENT_MAX",
            "a client holds at most {} grants at once (`GRANTS_PER_CLIENT_MAX`)",
            rdma::GRANTS_PER_CLIENT_MAX,
        ),
    ]
}

fn fpga_md() -> Vec<Check> {
    let d = "fpga.md";
    vec![
        check(
            d,
            "market::itch::MESSAGE_TYPES.len()",
            "every message type of the spec ({}, `itch::MESSAGE_TYPES`,",
            market::itch::MESSAGE_TYPES.len(),
        ),
        check(
            d,
            "size_of::<market::event::Event>()",
            "normalized into {}-byte events (`event::Event`)",
            std::mem::size_of::<market::event::Event>(),
        ),
    ]
}

fn scheduler() -> Vec<Check> {
    use sched::sim;
    let sim_cfg = sim::SimConfig::new(sim::ScenarioId::A, sched::Policy::Drr);
    let sched::TierSteps::Separate { hold_ns_max } = sched::TierSteps::SEPARATE else {
        panic!("TierSteps::SEPARATE is not Separate");
    };
    let hold_ms: f64 = flag_default::<bench::kv_sim::SimArgs>("protect-hold-ms")
        .parse()
        .expect("--protect-hold-ms default is a number");
    let d = "scheduler.md";
    vec![
        check(
            d,
            "sched::BLOCK_TOKENS",
            "(`BlockManager`): {}-token blocks (`BLOCK_TOKENS`)",
            sched::BLOCK_TOKENS,
        ),
        check(
            d,
            "sim::SimConfig::new(..).chunk_tokens",
            "`sim::SimConfig::new`: chunk {},",
            sim_cfg.chunk_tokens.map_or("none".to_string(), |c| c.to_string()),
        ),
        check(
            d,
            "sim::SimConfig::new(..).batch_tokens_max",
            "budget {} tokens).",
            grouped(sim_cfg.batch_tokens_max.into(), ","),
        ),
        check(
            d,
            "sched::TierSteps::SEPARATE (hold_ns_max)",
            "for at most {} in a row (`TierSteps::SEPARATE`;",
            dur(Duration::from_nanos(hold_ns_max)),
        ),
        check(
            d,
            "clap default of `fastlane kv sim --protect-bucket` (bench::kv_sim::SimArgs)",
            "(`--protect-bucket`, default {})",
            flag_default::<bench::kv_sim::SimArgs>("protect-bucket"),
        ),
        check(
            d,
            "clap default of `fastlane kv sim --protect-cap` (bench::kv_sim::SimArgs)",
            "prefill tokens to that step (default {})",
            flag_default::<bench::kv_sim::SimArgs>("protect-cap"),
        ),
        check(
            d,
            "clap default of `fastlane kv sim --protect-hold-ms` (bench::kv_sim::SimArgs)",
            "for `--protect-hold-ms` (default {} ms)",
            if hold_ms.fract() == 0.0 { grouped(hold_ms as u64, ",") } else { hold_ms.to_string() },
        ),
        check(
            d,
            "sim::SimConfig::new(..).drain_s_max",
            "(at most {} more, `SimConfig::drain_s_max`;",
            format!("{} s", sim_cfg.drain_s_max),
        ),
        check(
            d,
            "sim::SWAP_FIXED_NS",
            "is `{} + bytes × ns_per_byte` (`SWAP_FIXED_NS`)",
            dur(Duration::from_nanos(sim::SWAP_FIXED_NS)),
        ),
        check(
            d,
            "sim::PCIE_FACTOR_DEFAULT",
            "factor (default {}, `PCIE_FACTOR_DEFAULT`, `--pcie-factor`)",
            sim::PCIE_FACTOR_DEFAULT,
        ),
    ]
}

fn checks() -> Vec<Check> {
    [
        serving(),
        fpga_abi(),
        journal(),
        ring(),
        kvswap(),
        llm(),
        vhost_blk(),
        vfio_nvme(),
        rdma(),
        fpga_md(),
        scheduler(),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// What the doc has where the check expects its value: the text between `before` and `after`,
/// found from the longer of the two (40 characters of context when the other is not near).
fn doc_value(text: &str, c: &Check) -> String {
    let after_before = || {
        let at = text.find(c.before.as_str()).filter(|_| !c.before.is_empty())?;
        let head: String = text[at + c.before.len()..].chars().take(60).collect();
        Some(match head.find(c.after.as_str()).filter(|_| !c.after.is_empty()) {
            Some(end) => head[..end].to_string(),
            None => head.chars().take(40).collect(),
        })
    };
    let before_after = || {
        let at = text.find(c.after.as_str()).filter(|_| !c.after.is_empty())?;
        let start = text[..at].char_indices().rev().nth(59).map_or(0, |(i, _)| i);
        let tail = &text[start..at];
        Some(match tail.rfind(c.before.as_str()).filter(|_| !c.before.is_empty()) {
            Some(i) => tail[i + c.before.len()..].to_string(),
            None => {
                let from = tail.char_indices().rev().nth(39).map_or(0, |(i, _)| i);
                tail[from..].to_string()
            }
        })
    };
    let found = if c.after.len() > c.before.len() {
        before_after().or_else(after_before)
    } else {
        after_before().or_else(before_after)
    };
    found.unwrap_or_else(|| "(neither the text before nor after the value is there)".to_string())
}

#[test]
fn every_quoted_constant_matches_the_code() {
    let checks = checks();
    let mut failures = Vec::new();
    for c in &checks {
        let path = docs_dir().join(c.doc);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => normalise(&t),
            Err(e) => {
                failures.push(format!("docs/{}: cannot read it ({e}); {}", c.doc, c.constant));
                continue;
            }
        };
        let expected = normalise(&format!("{}{}{}", c.before, c.value, c.after));
        if !text.contains(&expected) {
            failures.push(format!(
                "docs/{}: {} is {:?} in the code, the doc has {:?}\n    expected text: {:?}",
                c.doc,
                c.constant,
                c.value,
                doc_value(&text, c),
                expected
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} doc constants disagree with the code:\n  {}",
        failures.len(),
        checks.len(),
        failures.join("\n  ")
    );
}

#[test]
fn every_checked_doc_exists() {
    let checks = checks();
    assert!(!checks.is_empty());
    let missing: Vec<String> = checks
        .iter()
        .map(|c| docs_dir().join(c.doc))
        .filter(|p| !p.is_file())
        .map(|p| p.display().to_string())
        .collect();
    assert!(missing.is_empty(), "docs the checks name that do not exist: {missing:?}");
}

#[test]
fn the_renderers_write_what_the_docs_write() {
    assert_eq!(grouped(16_384, ","), "16,384");
    assert_eq!(grouped(65_536, " "), "65 536");
    assert_eq!(grouped(999, ","), "999");
    assert_eq!(size(1 << 20), "1 MiB");
    assert_eq!(size(512 << 10), "512 KiB");
    assert_eq!(size(1 << 31), "2 GiB");
    assert_eq!(size(100), "100 bytes");
    assert_eq!(dur(Duration::from_secs(30)), "30 s");
    assert_eq!(dur(Duration::from_millis(250)), "250 ms");
    assert_eq!(dur(Duration::from_micros(50)), "50 µs");
    assert_eq!(normalise("a\n  b\tc"), "a b c");
}
