//! The VFIO NVMe driver, for real: a QEMU TCG guest with intel-iommu and an emulated NVMe
//! controller on a backing file this test creates; the guest binds the controller to vfio-pci
//! and runs `vfio_guest check` (identify, 4 KiB..1 MiB writes and reads with PRP lists,
//! zero copy and bounced, flush, deallocate, write-zeroes, two queue pairs at once, typed
//! errors). In the same boot, the vhost-user zero-copy path: `fastlane serve --backend
//! nvme:BDF` with `fastlane bench blk --verify` as its frontend (a pattern written through the
//! frontend's guest memory, read back and compared in the guest, then reads at QD 1 and 8); the
//! driver's totals must show every read and write went zero copy (none bounced). Then the host
//! checks that the backing file holds exactly the bytes the guest reported writing (both
//! phases), and zeroes everywhere else.
//!
//! The `fastlane` binary is taken from next to `vfio_guest` (the same target directory and
//! profile; `cargo test --workspace` builds it) or from `$FASTLANE_BIN`.
//!
//! QEMU missing fails the test (`.ci/install-deps.sh` installs it).

use std::path::{Path, PathBuf};
use std::time::Instant;

use fastlane_guest_tests::Guest;

use fastlane_util::pattern;

const DISK_BYTES: u64 = 128 << 20;
const VFIO_MODULES: &str = "vfio vfio_iommu_type1 vfio_virqfd irqbypass vfio-pci-core vfio-pci";

#[test]
fn vfio_driver_in_guest() {
    let guest = Guest::new(env!("CARGO_MANIFEST_DIR"), "tests/vm/guest-vfio.sh");
    let fastlane = std::env::var_os("FASTLANE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_BIN_EXE_vfio_guest")).with_file_name("fastlane"));
    assert!(
        fastlane.is_file(),
        "{} is missing: build it first (cargo build -p fastlane-cli, same profile) or set \
         FASTLANE_BIN",
        fastlane.display()
    );
    let disk = tempfile::NamedTempFile::new().unwrap();
    disk.as_file().set_len(DISK_BYTES).unwrap();
    let drive = format!(
        "file={},if=none,id=nv0,format=raw,discard=unmap,cache=writeback",
        disk.path().display()
    );
    let start = Instant::now();
    let out = guest
        .bin(env!("CARGO_BIN_EXE_vfio_guest"))
        .bin(&fastlane)
        .modules(VFIO_MODULES)
        .append("intel_iommu=on fl_vfio_mode=check")
        .smp(2)
        .timeout_s(150)
        .qemu(["-machine", "q35,kernel-irqchip=split"])
        .qemu(["-device", "intel-iommu,intremap=on,caching-mode=on"])
        .qemu(["-drive", &drive, "-device", "nvme,serial=fl0vfio,drive=nv0"])
        .output();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let results: Vec<&str> =
        stdout.lines().filter(|l| l.starts_with("VFIO-") && !l.starts_with("VFIO-SERVE")).collect();
    eprintln!("guest run took {:.1} s:\n{}", start.elapsed().as_secs_f64(), results.join("\n"));
    assert!(
        out.status.success() && stdout.lines().any(|l| l.trim() == "VFIO-OK"),
        "guest check failed (status {:?})\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}",
        out.status.code()
    );

    // Zero copy through vhost-user: the driver in `fastlane serve` counted its reads and writes;
    // the frontend's buffers are page-aligned 4 KiB slots in registered guest memory, so none
    // may have been bounced, and the verify pass alone made 2 * 4 MiB / 4 KiB of them.
    let zc = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("VFIO-ZEROCOPY "))
        .unwrap_or_else(|| panic!("no VFIO-ZEROCOPY line\n--- stdout ---\n{stdout}"));
    let count = |key: &str| -> u64 {
        zc.split_whitespace()
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
            .unwrap_or_else(|| panic!("VFIO-ZEROCOPY {zc}: no {key}=N\n{stdout}"))
    };
    let (direct, bounced) = (count("direct"), count("bounced"));
    assert_eq!(bounced, 0, "requests from registered guest memory were bounced: {zc}\n{stdout}");
    assert!(direct >= 2 * (4 << 20) / 4096, "too few zero-copy requests: {zc}\n{stdout}");

    // Replay what the guest says it wrote onto a zero image; the backing file must match.
    let mut want = vec![0u8; DISK_BYTES as usize];
    let mut expects = 0;
    for line in stdout.lines().filter_map(|l| l.trim().strip_prefix("VFIO-EXPECT ")) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let off: usize = f[1].parse().unwrap();
        let len: usize = f[2].parse().unwrap();
        match f[0] {
            "pattern" => {
                pattern::fill(f[3].parse().unwrap(), off as u64, &mut want[off..off + len])
            }
            "zero" => want[off..off + len].fill(0),
            other => panic!("unknown VFIO-EXPECT kind {other}"),
        }
        expects += 1;
    }
    assert!(expects >= 15, "too few VFIO-EXPECT lines ({expects})");
    let got = std::fs::read(disk.path()).unwrap();
    assert_eq!(got.len(), want.len());
    if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
        panic!(
            "backing file differs from what the guest wrote at byte {i} (MiB {}): got {:#04x}, \
             want {:#04x}",
            i >> 20,
            got[i],
            want[i]
        );
    }
}
