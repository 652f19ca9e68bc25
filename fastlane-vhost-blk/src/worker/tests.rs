//! Unit tests of the worker on a mock split queue over guest memory and a RAM disk.

use super::*;
use fastlane_block::ram::RamDisk;
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
};
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::MockSplitQueue;

const QSIZE: u16 = 32;
const DISK: u64 = 1 << 20;
const R: u16 = 0;
const W: u16 = VRING_DESC_F_WRITE as u16;
const HDR: u64 = 0x10_000;
const STATUS: u64 = 0x11_000;
const DATA: u64 = 0x20_000;
const IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;
const UNSUPP: u8 = VIRTIO_BLK_S_UNSUPP as u8;
const OK: u8 = VIRTIO_BLK_S_OK as u8;

/// A worker on a mock split queue over two guest memory regions and a 1 MiB RAM disk.
struct Rig {
    mem: &'static GuestMem,
    mock: MockSplitQueue<'static, GuestMem>,
    disk: Arc<RamDisk>,
    stats: Arc<BlkStats>,
    worker: Worker,
    next_desc: u16,
    chains: u16,
}

impl Rig {
    fn new(read_only: bool) -> Rig {
        // Leaked so the mock queue can borrow it for the whole test.
        let mem: &'static GuestMem = Box::leak(Box::new(
            GuestMem::from_ranges(&[
                (GuestAddress(0), 0x10_0000),
                (GuestAddress(0x10_0000), 0x10_0000),
            ])
            .unwrap(),
        ));
        let atomic = GuestMemoryAtomic::new(mem.clone());
        let mock = MockSplitQueue::new(mem, QSIZE);
        let vring = BlkVring::new(atomic.clone(), QSIZE).unwrap();
        vring.set_queue_size(QSIZE);
        vring
            .set_queue_info(mock.desc_table_addr().0, mock.avail_addr().0, mock.used_addr().0)
            .unwrap();
        vring.set_queue_ready(true);
        vring.set_enabled(true);
        let disk = Arc::new(RamDisk::new(DISK, 512).unwrap());
        let stats = Arc::new(BlkStats::new(1));
        let config = WorkerConfig {
            queue_index: 0,
            queue_size_max: QSIZE,
            poll: Duration::ZERO,
            serial: *b"fastlane-test-serial",
            limits: ParseLimits {
                capacity_bytes: DISK,
                segments_max: 4,
                read_only,
                discard: true,
                write_zeroes: true,
            },
            clock: Clock::instant(),
        };
        let worker = Worker::new(config, disk.clone(), atomic, vring, stats.clone());
        Rig { mem, mock, disk, stats, worker, next_desc: 0, chains: 0 }
    }

    fn header(&self, t: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&t.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.mem.write_slice(&h, GuestAddress(HDR)).unwrap();
    }

    /// Publish a chain of (addr, len, flags), let the worker run, and return (status byte,
    /// used length) after checking there is exactly one new used entry for it.
    fn run(&mut self, descs: &[(u64, u32, u16)]) -> (u8, u32) {
        self.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
        let base = self.next_desc;
        let raw: Vec<RawDescriptor> = descs
            .iter()
            .enumerate()
            .map(|(i, &(addr, len, flags))| {
                let last = i + 1 == descs.len();
                let flags = if last { flags } else { flags | VRING_DESC_F_NEXT as u16 };
                let next = if last { 0 } else { base + i as u16 + 1 };
                RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next))
            })
            .collect();
        self.mock.add_desc_chains(&raw, base).unwrap();
        self.next_desc = (base + descs.len() as u16) % (QSIZE - 8);
        self.worker.run();
        let used = self.mock.used().ring().ref_at(self.chains as usize).unwrap().load();
        self.chains += 1;
        assert_eq!(self.mock.used().idx().load(), self.chains, "one used entry per chain");
        assert_eq!(used.id(), u32::from(base));
        let status = self.mem.read_obj::<u8>(GuestAddress(STATUS)).unwrap();
        (status, used.len())
    }

    fn rejected(&self, r: RejectReason) -> u64 {
        self.stats.queue(0).rejected(r)
    }
}

#[test]
fn write_then_read_back_through_guest_memory() {
    let mut rig = Rig::new(false);
    let pattern: Vec<u8> = (0..1024u32).map(|i| (i * 7 + 3) as u8).collect();
    rig.mem.write_slice(&pattern[..512], GuestAddress(DATA)).unwrap();
    // The second data descriptor is in the other memory region.
    rig.mem.write_slice(&pattern[512..], GuestAddress(0x10_0000 + DATA)).unwrap();
    rig.header(VIRTIO_BLK_T_OUT, 8);
    let chain = [(HDR, 16, R), (DATA, 512, R), (0x10_0000 + DATA, 512, R), (STATUS, 1, W)];
    assert_eq!(rig.run(&chain), (OK, 1));
    let mut back = vec![0u8; 1024];
    rig.disk.read_at(8 * 512, &mut back).unwrap();
    assert_eq!(back, pattern);

    rig.header(VIRTIO_BLK_T_IN, 8);
    let (st, len) = rig.run(&[(HDR, 16, R), (DATA + 0x1000, 1024, W), (STATUS, 1, W)]);
    assert_eq!((st, len), (OK, 1025));
    let mut got = vec![0u8; 1024];
    rig.mem.read_slice(&mut got, GuestAddress(DATA + 0x1000)).unwrap();
    assert_eq!(got, pattern);
    let q = rig.stats.queue(0);
    assert_eq!(q.completed.load(Ordering::Relaxed), 2);
    assert_eq!(q.bytes_written.load(Ordering::Relaxed), 1024);
    assert_eq!(q.bytes_read.load(Ordering::Relaxed), 1024);
    assert_eq!(q.rejected_total(), 0);
}

#[test]
fn flush_discard_write_zeroes_get_id() {
    let mut rig = Rig::new(false);
    rig.disk.write_at(0, &[0xaa; 4096]).unwrap();
    rig.header(VIRTIO_BLK_T_FLUSH, 0);
    assert_eq!(rig.run(&[(HDR, 16, R), (STATUS, 1, W)]), (OK, 1));

    let range = |sector: u64, n: u32, flags: u32| {
        let mut r = [0u8; 16];
        r[0..8].copy_from_slice(&sector.to_le_bytes());
        r[8..12].copy_from_slice(&n.to_le_bytes());
        r[12..16].copy_from_slice(&flags.to_le_bytes());
        r
    };
    rig.mem.write_slice(&range(0, 2, 0), GuestAddress(DATA)).unwrap();
    rig.header(VIRTIO_BLK_T_DISCARD, 0);
    assert_eq!(rig.run(&[(HDR, 16, R), (DATA, 16, R), (STATUS, 1, W)]), (OK, 1));
    rig.mem.write_slice(&range(2, 2, 1), GuestAddress(DATA)).unwrap();
    rig.header(VIRTIO_BLK_T_WRITE_ZEROES, 0);
    assert_eq!(rig.run(&[(HDR, 16, R), (DATA, 16, R), (STATUS, 1, W)]), (OK, 1));
    let mut back = [0u8; 4096];
    rig.disk.read_at(0, &mut back).unwrap();
    assert!(back[..2048].iter().all(|&b| b == 0));
    assert!(back[2048..].iter().all(|&b| b == 0xaa));
    let q = rig.stats.queue(0);
    assert_eq!(q.flushes.load(Ordering::Relaxed), 1);
    assert_eq!(q.discards.load(Ordering::Relaxed), 2, "discard and write-zeroes");

    rig.header(VIRTIO_BLK_T_GET_ID, 0);
    assert_eq!(rig.run(&[(HDR, 16, R), (DATA, 20, W), (STATUS, 1, W)]), (OK, 21));
    let mut id = [0u8; 20];
    rig.mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
    assert_eq!(&id, b"fastlane-test-serial");
}

#[test]
fn missing_status_descriptor_returns_len_0() {
    let mut rig = Rig::new(false);
    rig.header(VIRTIO_BLK_T_IN, 0);
    let (st, len) = rig.run(&[(HDR, 16, R), (DATA, 512, W), (STATUS, 1, R)]);
    assert_eq!((st, len), (0xff, 0), "status untouched, chain returned empty");
    assert_eq!(rig.rejected(RejectReason::StatusUnusable), 1);
}

#[test]
fn status_descriptor_too_small_returns_len_0() {
    let mut rig = Rig::new(false);
    rig.header(VIRTIO_BLK_T_FLUSH, 0);
    assert_eq!(rig.run(&[(HDR, 16, R), (STATUS, 0, W)]), (0xff, 0));
    assert_eq!(rig.rejected(RejectReason::StatusUnusable), 1);
}

#[test]
fn status_outside_guest_memory_returns_len_0() {
    let mut rig = Rig::new(false);
    rig.header(VIRTIO_BLK_T_FLUSH, 0);
    assert_eq!(rig.run(&[(HDR, 16, R), (0x4000_0000, 1, W)]), (0xff, 0));
    assert_eq!(rig.rejected(RejectReason::StatusUnusable), 1);
}

#[test]
fn missing_header_is_ioerr() {
    let mut rig = Rig::new(false);
    assert_eq!(rig.run(&[(HDR, 8, R), (STATUS, 1, W)]), (IOERR, 1));
    assert_eq!(rig.rejected(RejectReason::HeaderMissing), 1);
}

#[test]
fn header_in_write_only_descriptor_is_ioerr() {
    let mut rig = Rig::new(false);
    rig.header(VIRTIO_BLK_T_IN, 0);
    assert_eq!(rig.run(&[(HDR, 16, W), (DATA, 512, W), (STATUS, 1, W)]), (IOERR, 1));
    assert_eq!(rig.rejected(RejectReason::HeaderWriteOnly), 1);
}

#[test]
fn data_of_wrong_direction_is_ioerr() {
    let mut rig = Rig::new(false);
    rig.header(VIRTIO_BLK_T_IN, 0);
    assert_eq!(rig.run(&[(HDR, 16, R), (DATA, 512, R), (STATUS, 1, W)]), (IOERR, 1));
    rig.header(VIRTIO_BLK_T_OUT, 0);
    assert_eq!(rig.run(&[(HDR, 16, R), (DATA, 512, W), (STATUS, 1, W)]), (IOERR, 1));
    assert_eq!(rig.rejected(RejectReason::WrongDirection), 2);
}

#[test]
fn length_not_multiple_of_512_is_ioerr() {
    let mut rig = Rig::new(false);
    rig.header(VIRTIO_BLK_T_IN, 0);
    assert_eq!(rig.run(&[(HDR, 16, R), (DATA, 100, W), (STATUS, 1, W)]), (IOERR, 1));
    assert_eq!(rig.rejected(RejectReason::LengthNotSectorMultiple), 1);
}

#[test]
fn sector_range_past_capacity_or_overflowing_is_ioerr() {
    let mut rig = Rig::new(false);
    rig.header(VIRTIO_BLK_T_IN, DISK / 512);
    assert_eq!(rig.run(&[(HDR, 16, R), (DATA, 512, W), (STATUS, 1, W)]), (IOERR, 1));
    rig.header(VIRTIO_BLK_T_IN, DISK / 512 - 1);
    assert_eq!(rig.run(&[(HDR, 16, R), (DATA, 1024, W), (STATUS, 1, W)]), (IOERR, 1));
    rig.header(VIRTIO_BLK_T_IN, u64::MAX);
    assert_eq!(rig.run(&[(HDR, 16, R), (DATA, 512, W), (STATUS, 1, W)]), (IOERR, 1));
    assert_eq!(rig.rejected(RejectReason::OutOfRange), 3);
}

#[test]
fn too_many_segments_is_ioerr() {
    let mut rig = Rig::new(false);
    rig.header(VIRTIO_BLK_T_IN, 0);
    let mut chain = vec![(HDR, 16, R)];
    for i in 0..5 {
        chain.push((DATA + i * 0x1000, 512, W));
    }
    chain.push((STATUS, 1, W));
    assert_eq!(rig.run(&chain), (IOERR, 1));
    assert_eq!(rig.rejected(RejectReason::TooManySegments), 1);
}

#[test]
fn data_outside_guest_memory_is_ioerr() {
    let mut rig = Rig::new(false);
    rig.header(VIRTIO_BLK_T_IN, 0);
    assert_eq!(rig.run(&[(HDR, 16, R), (0x4000_0000, 512, W), (STATUS, 1, W)]), (IOERR, 1));
    // Straddling the two regions.
    let straddle = [(HDR, 16, R), (0x10_0000 - 256, 512, W), (STATUS, 1, W)];
    assert_eq!(rig.run(&straddle), (IOERR, 1));
    assert_eq!(rig.rejected(RejectReason::BadAddress), 2);
}

#[test]
fn unknown_type_is_unsupp() {
    let mut rig = Rig::new(false);
    rig.header(99, 0);
    assert_eq!(rig.run(&[(HDR, 16, R), (STATUS, 1, W)]), (UNSUPP, 1));
    assert_eq!(rig.rejected(RejectReason::Unsupported), 1);
}

#[test]
fn read_only_export_refuses_writes() {
    let mut rig = Rig::new(true);
    rig.header(VIRTIO_BLK_T_OUT, 0);
    rig.mem.write_slice(&[0x55; 512], GuestAddress(DATA)).unwrap();
    assert_eq!(rig.run(&[(HDR, 16, R), (DATA, 512, R), (STATUS, 1, W)]), (IOERR, 1));
    assert_eq!(rig.rejected(RejectReason::ReadOnly), 1);
    let mut back = [0u8; 512];
    rig.disk.read_at(0, &mut back).unwrap();
    assert_eq!(back, [0u8; 512]);
    rig.header(VIRTIO_BLK_T_IN, 0);
    assert_eq!(rig.run(&[(HDR, 16, R), (DATA, 512, W), (STATUS, 1, W)]), (OK, 513));
}

#[test]
fn bad_write_zeroes_flags_are_unsupp() {
    let mut rig = Rig::new(false);
    let mut r = [0u8; 16];
    r[8..12].copy_from_slice(&1u32.to_le_bytes());
    r[12..16].copy_from_slice(&2u32.to_le_bytes());
    rig.mem.write_slice(&r, GuestAddress(DATA)).unwrap();
    rig.header(VIRTIO_BLK_T_WRITE_ZEROES, 0);
    assert_eq!(rig.run(&[(HDR, 16, R), (DATA, 16, R), (STATUS, 1, W)]), (UNSUPP, 1));
    assert_eq!(rig.rejected(RejectReason::BadDiscardFlags), 1);
}

#[test]
fn an_avail_index_more_than_a_queue_ahead_does_not_spin() {
    let mut rig = Rig::new(false);
    rig.header(VIRTIO_BLK_T_IN, 0);
    assert_eq!(rig.run(&[(HDR, 16, R), (DATA, 512, W), (STATUS, 1, W)]), (OK, 513));
    // The guest claims 100 new entries on a queue of 32: no pop can succeed. `run` must
    // return (a spin would hang this test) and count it.
    rig.mock.avail().idx().store(u16::to_le(100));
    rig.worker.run();
    rig.worker.run();
    assert_eq!(rig.stats.queue(0).broken_avail.load(Ordering::Relaxed), 2);
    assert_eq!(rig.mock.used().idx().load(), 1, "nothing was used");
}

#[test]
fn latency_is_recorded_and_merged() {
    let mut rig = Rig::new(false);
    rig.header(VIRTIO_BLK_T_IN, 0);
    rig.run(&[(HDR, 16, R), (DATA, 512, W), (STATUS, 1, W)]);
    rig.worker.flush_latency();
    assert_eq!(rig.stats.queue(0).latency().len(), 1);
}
