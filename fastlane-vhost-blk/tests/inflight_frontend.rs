//! In-flight tracking driven by the `vhost` crate's own frontend: the state a backend leaves
//! behind when it is killed (requests taken from the avail ring, some completed out of order,
//! one completion torn between its used entry and its mark) is written into guest memory and
//! into the region the server handed out; a fresh server is attached to it the way QEMU
//! reattaches (`SET_INFLIGHT_FD` with the old region, the ring base at the used index, a kick).
//! It must resubmit exactly the requests in flight, in the order they were taken, and none that
//! completed (their buffers were changed afterwards, so re-executing one would be seen on the
//! disk); then carry on with new requests. Bad regions are refused with an error answer and the
//! connection goes on.

mod common;

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fastlane_block::ram::RamDisk;
use fastlane_vhost_blk::inflight::queue_region_bytes;
use fastlane_vhost_blk::{BlkServer, BlkStats, StopHandle, VhostBlkOptions};
use memmap2::{MmapOptions, MmapRaw};
use vhost::vhost_user::message::{
    VhostUserHeaderFlag, VhostUserInflight, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vmm_sys_util::eventfd::EventFd;

const MEM: usize = 1 << 20;
const QSIZE: u16 = 16;
const DESC: usize = 0x0000;
const AVAIL: usize = 0x1000;
const USED: usize = 0x2000;
const HDRS: usize = 0x3000;
const DATA: usize = 0x1_0000;
const DISK: u64 = 1 << 20;
const VIRTIO_F_VERSION_1: u64 = 1 << 32;
const NEXT: u16 = 1;
const WRITE: u16 = 2;

/// A memfd shared with the server: guest memory, or the in-flight region.
struct Shared {
    fd: OwnedFd,
    map: MmapRaw,
}

impl Shared {
    fn memfd(len: usize) -> Shared {
        let (fd, map) = common::shared_memfd(len);
        Shared { fd, map }
    }

    fn of(file: std::fs::File, len: usize) -> Shared {
        let map = MmapOptions::new().len(len).map_raw(&file).unwrap();
        Shared { fd: file.into(), map }
    }

    fn addr(&self) -> u64 {
        self.map.as_ptr() as u64
    }

    fn write(&self, off: usize, bytes: &[u8]) {
        assert!(off + bytes.len() <= self.map.len());
        let dst = self.map.as_mut_ptr().wrapping_add(off);
        // SAFETY: `dst..dst + len` is inside the mapping (checked); the server reads this
        // memory only after the kick that follows.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len()) }
    }

    fn read(&self, off: usize, len: usize) -> Vec<u8> {
        assert!(off + len <= self.map.len());
        let base = self.map.as_ptr().wrapping_add(off);
        (0..len)
            .map(|i| {
                // SAFETY: `base + i` is inside the mapping (checked); volatile: the server
                // writes this memory.
                unsafe { std::ptr::read_volatile(base.wrapping_add(i)) }
            })
            .collect()
    }

    fn u16_at(&self, off: usize) -> u16 {
        let b = self.read(off, 2);
        u16::from_le_bytes([b[0], b[1]])
    }
}

struct Server {
    stop: Arc<StopHandle>,
    stats: Arc<BlkStats>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    fn start(socket: &Path, disk: Arc<RamDisk>) -> Server {
        let options = VhostBlkOptions { queue_size_max: 256, ..VhostBlkOptions::default() };
        let mut server = BlkServer::bind(socket, disk, &options).unwrap();
        let (stop, stats) = (server.stop_handle(), server.stats());
        let thread = std::thread::spawn(move || server.run().unwrap());
        Server { stop, stats, thread: Some(thread) }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A frontend that negotiated in-flight tracking and REPLY_ACK (every request asks for an
/// answer, as QEMU does for the ones that can fail).
fn frontend(socket: &Path) -> Frontend {
    let mut f = Frontend::connect(socket, 1).unwrap();
    f.set_owner().unwrap();
    let offered = f.get_features().unwrap();
    let protocol = VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
    assert_ne!(offered & protocol, 0);
    f.set_features(VIRTIO_F_VERSION_1 | protocol).unwrap();
    let p = f.get_protocol_features().unwrap();
    assert!(p.contains(VhostUserProtocolFeatures::INFLIGHT_SHMFD), "{p:?}");
    f.set_protocol_features(
        VhostUserProtocolFeatures::INFLIGHT_SHMFD
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ,
    )
    .unwrap();
    f.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    f
}

/// Write request at `head` (three descriptors from `head`): 512 bytes of `fill` to `sector`.
fn write_request(mem: &Shared, head: u16, sector: u64, fill: u8) {
    let h = usize::from(head);
    let hdr = HDRS + h * 0x100;
    let status = hdr + 0x80;
    let data = DATA + h * 0x1000;
    let mut header = [0u8; 16];
    header[0..4].copy_from_slice(&1u32.to_le_bytes()); // VIRTIO_BLK_T_OUT
    header[8..16].copy_from_slice(&sector.to_le_bytes());
    mem.write(hdr, &header);
    mem.write(data, &[fill; 512]);
    mem.write(status, &[0xff]);
    let descs = [
        (hdr as u64, 16u32, NEXT, head + 1),
        (data as u64, 512, NEXT, head + 2),
        (status as u64, 1, WRITE, 0),
    ];
    for (i, (addr, len, flags, next)) in descs.into_iter().enumerate() {
        let mut d = [0u8; 16];
        d[0..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        d[14..16].copy_from_slice(&next.to_le_bytes());
        mem.write(DESC + (h + i) * 16, &d);
    }
}

fn status_of(mem: &Shared, head: u16) -> u8 {
    mem.read(HDRS + usize::from(head) * 0x100 + 0x80, 1)[0]
}

fn set_avail(mem: &Shared, heads: &[u16]) {
    for (i, h) in heads.iter().enumerate() {
        mem.write(AVAIL + 4 + i * 2, &h.to_le_bytes());
    }
    mem.write(AVAIL + 2, &(heads.len() as u16).to_le_bytes());
}

fn used_entry(mem: &Shared, i: usize) -> (u32, u32) {
    let b = mem.read(USED + 4 + i * 8, 8);
    (
        u32::from_le_bytes(b[0..4].try_into().unwrap()),
        u32::from_le_bytes(b[4..8].try_into().unwrap()),
    )
}

fn wait_used(mem: &Shared, idx: u16) {
    let t0 = Instant::now();
    while mem.u16_at(USED + 2) != idx {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "used idx {} never reached {idx}",
            mem.u16_at(USED + 2)
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn sector(disk: &RamDisk, s: u64) -> Vec<u8> {
    let mut b = vec![0u8; 512];
    disk.read_at(s * 512, &mut b).unwrap();
    b
}

/// The region's fields, as the backend that died left them.
fn put_queue_state(region: &Shared, last_batch_head: u16, used_idx: u16, marks: &[(u16, u64)]) {
    region.write(8, &1u16.to_le_bytes()); // version
    region.write(12, &last_batch_head.to_le_bytes());
    region.write(14, &used_idx.to_le_bytes());
    for &(head, counter) in marks {
        let e = 16 + usize::from(head) * 16;
        region.write(e, &[1]);
        region.write(e + 8, &counter.to_le_bytes());
    }
}

#[test]
fn a_restarted_backend_resubmits_what_was_in_flight_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("blk.sock");
    let disk = Arc::new(RamDisk::new(DISK, 512).unwrap());
    let server = Server::start(&socket, disk.clone());
    let mut f = frontend(&socket);

    // A new region for one queue of 16.
    let ask = VhostUserInflight { mmap_size: 0, mmap_offset: 0, num_queues: 1, queue_size: QSIZE };
    let (info, file) = f.get_inflight_fd(&ask).unwrap();
    assert_eq!(info.mmap_size, queue_region_bytes(QSIZE));
    assert_eq!((info.mmap_offset, info.num_queues, info.queue_size), (0, 1, QSIZE));
    let region = Shared::of(file, info.mmap_size as usize);
    assert_eq!(region.u16_at(10), QSIZE, "desc_num set");
    assert_eq!(region.u16_at(8), 0, "fresh");

    // What the dead backend left: A (head 0, sector 0), B (head 3, sector 8), C (head 6,
    // sector 16) and T (head 9, sector 24) taken in the order B, A, C, T; C and then T
    // completed (used entries 0 and 1, used idx 2); T's completion torn: its mark is still set
    // and the region's used_idx says 1.
    let mem = Shared::memfd(MEM);
    write_request(&mem, 0, 0, 0xa1);
    write_request(&mem, 3, 8, 0xb2);
    write_request(&mem, 6, 16, 0xc3);
    write_request(&mem, 9, 24, 0xd4);
    set_avail(&mem, &[0, 3, 6, 9]);
    mem.write(USED + 4, &[6, 0, 0, 0, 1, 0, 0, 0]);
    mem.write(USED + 12, &[9, 0, 0, 0, 1, 0, 0, 0]);
    mem.write(USED + 2, &2u16.to_le_bytes());
    disk.write_at(16 * 512, &[0xc3; 512]).unwrap();
    disk.write_at(24 * 512, &[0xd4; 512]).unwrap();
    // The guest reused the completed requests' buffers: re-executing one would show.
    mem.write(DATA + 6 * 0x1000, &[0xee; 512]);
    mem.write(DATA + 9 * 0x1000, &[0xee; 512]);
    put_queue_state(&region, 9, 1, &[(3, 0), (0, 1), (9, 3)]);

    // Reattach as QEMU does after a backend crash.
    f.set_inflight_fd(&info, region.fd.as_raw_fd()).unwrap();
    f.set_mem_table(&[VhostUserMemoryRegionInfo {
        guest_phys_addr: 0,
        memory_size: MEM as u64,
        userspace_addr: mem.addr(),
        mmap_offset: 0,
        mmap_handle: mem.fd.as_raw_fd(),
    }])
    .unwrap();
    f.set_vring_num(0, QSIZE).unwrap();
    f.set_vring_addr(
        0,
        &VringConfigData {
            queue_max_size: QSIZE,
            queue_size: QSIZE,
            flags: 0,
            desc_table_addr: mem.addr() + DESC as u64,
            used_ring_addr: mem.addr() + USED as u64,
            avail_ring_addr: mem.addr() + AVAIL as u64,
            log_addr: None,
        },
    )
    .unwrap();
    f.set_vring_base(0, 2).unwrap();
    let (call, kick) = (EventFd::new(0).unwrap(), EventFd::new(0).unwrap());
    f.set_vring_call(0, &call).unwrap();
    f.set_vring_kick(0, &kick).unwrap();
    f.set_vring_enable(0, true).unwrap();
    kick.write(1).unwrap();

    // B then A (the order taken), and nothing else.
    wait_used(&mem, 4);
    assert_eq!(used_entry(&mem, 2), (3, 1));
    assert_eq!(used_entry(&mem, 3), (0, 1));
    assert_eq!((status_of(&mem, 0), status_of(&mem, 3)), (0, 0));
    assert_eq!(sector(&disk, 0), [0xa1; 512]);
    assert_eq!(sector(&disk, 8), [0xb2; 512]);
    assert_eq!(sector(&disk, 16), [0xc3; 512], "C completed before the crash: not re-executed");
    assert_eq!(sector(&disk, 24), [0xd4; 512], "T's torn completion: not re-executed");
    let q = server.stats.queue(0);
    assert_eq!(q.resubmitted.load(std::sync::atomic::Ordering::Relaxed), 2);
    assert_eq!(q.torn_repaired.load(std::sync::atomic::Ordering::Relaxed), 1);
    // The region now says nothing is in flight, and where the used ring is.
    assert_eq!(region.u16_at(14), 4);
    for h in 0..QSIZE {
        assert_eq!(region.read(16 + usize::from(h) * 16, 1)[0], 0, "head {h} still marked");
    }

    // The avail ring resumes after the four taken: a new request is served.
    write_request(&mem, 12, 32, 0xe5);
    set_avail(&mem, &[0, 3, 6, 9, 12]);
    kick.write(1).unwrap();
    wait_used(&mem, 5);
    assert_eq!(used_entry(&mem, 4), (12, 1));
    assert_eq!(sector(&disk, 32), [0xe5; 512]);
    drop(f);
}

#[test]
fn bad_regions_get_an_error_and_the_connection_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("blk.sock");
    let disk = Arc::new(RamDisk::new(DISK, 512).unwrap());
    let _server = Server::start(&socket, disk);
    let mut f = frontend(&socket);

    // More queues than the device has: no region (size 0, no descriptor).
    let four = VhostUserInflight { mmap_size: 0, mmap_offset: 0, num_queues: 4, queue_size: QSIZE };
    assert!(f.get_inflight_fd(&four).is_err());

    let ask = VhostUserInflight { mmap_size: 0, mmap_offset: 0, num_queues: 1, queue_size: QSIZE };
    let (info, file) = f.get_inflight_fd(&ask).unwrap();
    let region = Shared::of(file, info.mmap_size as usize);
    // Too small for what it claims.
    let small = VhostUserInflight { mmap_size: info.mmap_size - 16, ..info };
    assert!(f.set_inflight_fd(&small, region.fd.as_raw_fd()).is_err());
    // Claims queues of 32 over a region laid out for 16.
    let bigger = VhostUserInflight { queue_size: 32, mmap_size: queue_region_bytes(32), ..info };
    assert!(f.set_inflight_fd(&bigger, region.fd.as_raw_fd()).is_err());
    // A version this backend does not know.
    region.write(8, &7u16.to_le_bytes());
    assert!(f.set_inflight_fd(&info, region.fd.as_raw_fd()).is_err());
    // A flag that is neither 0 nor 1.
    region.write(8, &1u16.to_le_bytes());
    region.write(16 + 5 * 16, &[9]);
    assert!(f.set_inflight_fd(&info, region.fd.as_raw_fd()).is_err());
    // Repaired, it is taken, and the connection still answers.
    region.write(16 + 5 * 16, &[0]);
    f.set_inflight_fd(&info, region.fd.as_raw_fd()).unwrap();
    assert_ne!(f.get_features().unwrap(), 0);
}
