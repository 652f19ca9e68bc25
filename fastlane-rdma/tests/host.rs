//! Host-side tests: what can be checked without an RDMA device, and a device smoke test that
//! runs only where one exists (skips with a message on the build host, which has none).

use fastlane_rdma::{device_names, Device, RdmaError};

#[test]
fn unknown_device_is_a_typed_error() {
    match Device::open("no-such-rdma-device") {
        Err(RdmaError::NoSuchDevice { name, available }) => {
            assert_eq!(name, "no-such-rdma-device");
            assert!(!available.contains(&name));
        }
        other => panic!("expected NoSuchDevice, got {other:?}"),
    }
}

#[test]
fn device_smoke_where_one_exists() {
    let names = device_names();
    let Some(name) = names.first() else {
        eprintln!(
            "SKIPPED: no RDMA device on this host (the real tests run in a guest: tests/guest/tests/rdma.rs)"
        );
        return;
    };
    let dev = Device::open(name).expect("open the first device");
    assert!(dev.active_mtu_bytes() >= 256);
    let pd = dev.alloc_pd().expect("PD");
    let buf = fastlane_rdma::RegisteredBuffer::new(&pd, 1 << 16, fastlane_rdma::Access::REMOTE_RW)
        .expect("register 64 KiB");
    buf.write_at(100, b"hello").unwrap();
    let mut b = [0u8; 5];
    buf.read_at(100, &mut b).unwrap();
    assert_eq!(&b, b"hello");
    assert!(buf.write_at(buf.len() - 2, b"abc").is_err());
}
