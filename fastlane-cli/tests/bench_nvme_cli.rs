//! End-to-end test of `fastlane bench nvme` on a RAM disk (`--backend mem:SIZE`, which needs
//! neither VFIO nor a disk): the JSON of `--json` and the table without it.

use serde_json::Value;

mod common;

use common::cli::fastlane;

fn u(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("{key} missing or not an integer in {v}"))
}

const ARGS: [&str; 13] = [
    "bench",
    "nvme",
    "--backend",
    "mem:16M",
    "--label",
    "ram",
    "--seconds",
    "0.05",
    "--qd",
    "1,4",
    "--span",
    "4M",
    "--size=8K",
];

#[test]
fn json_has_every_case_of_the_table() {
    let out = fastlane(&[&ARGS[..], &["--json"]].concat());
    let (stdout, stderr) =
        (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let v: Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}):\n{stdout}"));
    assert_eq!(v["label"], "ram");
    assert_eq!(v["backend"], "mem:16M");
    assert_eq!(u(&v, "device_bytes"), 16 << 20);
    assert_eq!(u(&v, "request_bytes"), 8192);
    assert_eq!(u(&v, "span_bytes"), 4 << 20);
    assert_eq!(v["seconds_per_case"].as_f64(), Some(0.05));
    let cases = v["cases"].as_array().expect("cases");
    let names: Vec<&str> = cases.iter().map(|c| c["case"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["ram_qd1_randread", "ram_qd4_randread", "ram_qd1_randwrite", "ram_qd4_randwrite"]
    );
    for (c, (pattern, qd)) in
        cases.iter().zip([("randread", 1), ("randread", 4), ("randwrite", 1), ("randwrite", 4)])
    {
        assert_eq!((c["pattern"].as_str(), u(c, "qd")), (Some(pattern), qd), "{c}");
        let ops = u(c, "ops");
        assert!(ops > 0, "{c}");
        let elapsed_ns = u(c, "elapsed_ns");
        assert!(elapsed_ns >= 50_000_000, "{c}");
        let iops = c["iops"].as_f64().unwrap();
        assert!((iops / (ops as f64 * 1e9 / elapsed_ns as f64) - 1.0).abs() < 1e-3, "{c}");
        let l = &c["latency"];
        assert_eq!(u(l, "count"), ops, "{c}");
        let (p50, p90, p99, max) = (u(l, "p50_ns"), u(l, "p90_ns"), u(l, "p99_ns"), u(l, "max_ns"));
        assert!(0 < p50 && p50 <= p90 && p90 <= p99 && p99 <= max, "{c}");
    }
    // The BENCH lines stay visible, on stderr.
    assert_eq!(stderr.lines().filter(|l| l.starts_with("BENCH ram_qd")).count(), 4, "{stderr}");
}

#[test]
fn table_without_json() {
    let out = fastlane(&ARGS);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(lines[0].starts_with("# ram: mem:16M (16777216 bytes"), "{stdout}");
    assert_eq!(lines.iter().filter(|l| l.starts_with("BENCH ram_qd")).count(), 4, "{stdout}");
    let header = lines.iter().position(|l| l.starts_with("case ")).expect("table header");
    assert_eq!(
        lines[header].split_whitespace().collect::<Vec<_>>(),
        ["case", "IOPS", "P50", "P90", "P99", "max"]
    );
    assert_eq!(lines.len(), header + 5, "{stdout}");
    assert!(lines[header + 1].starts_with("ram_qd1_randread "), "{stdout}");
}
