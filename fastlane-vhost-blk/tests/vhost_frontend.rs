//! The vhost-user-blk daemon driven by a real vhost-user frontend (the `virtio-driver` crate's
//! userspace virtio-blk driver): data written through the virtqueues reads back, flush,
//! discard and write-zeroes work, GET_ID returns the serial, a read-only export refuses writes,
//! and a second frontend can attach after the first disconnects.

mod common;

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use fastlane_block::ram::RamDisk;
use fastlane_block::BlockDevice;
use fastlane_vhost_blk::{BlkServer, BlkStats, StopHandle, VhostBlkOptions};
use memmap2::MmapRaw;
use virtio_driver::virtqueue::{Virtqueue, VirtqueueLayout};
use virtio_driver::{
    iovec, VhostUser, VirtioBlkConfig, VirtioBlkFeatureFlags, VirtioBlkQueue, VirtioBlkTransport,
    VirtioFeatureFlags, VirtioTransport,
};

const DISK: u64 = 16 << 20;
const BUF: usize = 1 << 20;

fn features() -> u64 {
    VirtioFeatureFlags::VERSION_1.bits()
        | VirtioFeatureFlags::RING_EVENT_IDX.bits()
        | VirtioBlkFeatureFlags::all().bits()
}

struct Server {
    stop: Arc<StopHandle>,
    stats: Arc<BlkStats>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    fn start(socket: &Path, disk: Arc<dyn BlockDevice>, options: VhostBlkOptions) -> Server {
        let mut server = BlkServer::bind(socket, disk, &options).expect("bind");
        let stop = server.stop_handle();
        let stats = server.stats();
        let thread = std::thread::spawn(move || server.run().expect("server run"));
        Server { stop, stats, thread: Some(thread) }
    }

    fn stop(mut self) -> Arc<BlkStats> {
        self.stop.stop();
        self.thread.take().unwrap().join().unwrap();
        self.stats.clone()
    }
}

/// Memory shared with the backend: a memfd mapping.
struct SharedBuf {
    fd: OwnedFd,
    /// MAP_SHARED of the memfd, unmapped on drop.
    map: MmapRaw,
}

impl SharedBuf {
    fn new(len: usize) -> SharedBuf {
        let (fd, map) = common::shared_memfd(len);
        SharedBuf { fd, map }
    }

    fn slice(&mut self, off: usize, len: usize) -> &mut [u8] {
        assert!(off + len <= self.map.len());
        let start = self.map.as_mut_ptr().wrapping_add(off);
        // SAFETY:
        // - `off + len <= self.map.len()`, inside our mapping, which lives as long as `self`;
        // - the backend writes into it only while a request is in flight, and the tests only
        //   look at a buffer after its request completed.
        unsafe { std::slice::from_raw_parts_mut(start, len) }
    }
}

fn wait_readable(fd: i32) {
    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY:
    // - one valid pollfd on our stack, count 1; poll keeps no pointer.
    let rc = unsafe { libc::poll(&mut pfd, 1, 5000) };
    assert!(rc > 0, "no completion within 5 s");
}

/// A virtio-blk frontend connection with `n` queues and a shared data buffer.
struct Client {
    queues: Vec<VirtioBlkQueue<'static, u32>>,
    transport: Box<VirtioBlkTransport>,
    buf: SharedBuf,
}

impl Client {
    fn connect(socket: &Path, n: usize) -> Client {
        let vu = VhostUser::<VirtioBlkConfig, _>::new(socket.to_str().unwrap(), features())
            .expect("vhost-user connect");
        let mut transport: Box<VirtioBlkTransport> = Box::new(vu);
        let buf = SharedBuf::new(BUF);
        transport
            .map_mem_region(buf.map.as_mut_ptr() as usize, buf.map.len(), buf.fd.as_raw_fd(), 0)
            .expect("map data buffer");
        let mut queues =
            VirtioBlkQueue::setup_queues(&mut *transport, n, 64).expect("setup queues");
        // With EVENT_IDX, virtio-driver only asks for used-buffer notifications when told to.
        for q in &mut queues {
            q.set_used_notif_enabled(true);
        }
        Client { queues, transport, buf }
    }

    /// Wait for the completion of the one request in flight on queue `q`; its return value.
    fn complete(&mut self, q: usize) -> i32 {
        self.transport.get_submission_notifier(q).notify().unwrap();
        loop {
            if let Some(c) = self.queues[q].completions().next() {
                return c.ret;
            }
            let fd = self.transport.get_completion_fd(q);
            wait_readable(fd.as_raw_fd());
            let _ = fd.read();
        }
    }

    fn write(&mut self, q: usize, offset: u64, buf_off: usize, len: usize) -> i32 {
        let data = self.buf.slice(buf_off, len) as *const [u8];
        // SAFETY:
        // - `data` points into `self.buf`, which outlives the request (we wait for it below)
        //   and is not written while it is in flight.
        self.queues[q].write(offset, unsafe { &*data }, 0).unwrap();
        self.complete(q)
    }

    fn read(&mut self, q: usize, offset: u64, buf_off: usize, len: usize) -> i32 {
        let data = self.buf.slice(buf_off, len) as *mut [u8];
        // SAFETY:
        // - as in `write`; nothing else touches the slice until the completion.
        self.queues[q].read(offset, unsafe { &mut *data }, 0).unwrap();
        self.complete(q)
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        // Queues point into the transport's ring memory: drop them first.
        self.queues.clear();
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    fastlane_util::pattern::bytes(u64::from(seed), len)
}

/// GET_ID through a raw virtqueue (virtio-driver has no GET_ID call).
#[derive(Clone, Copy)]
#[repr(C)]
struct IdReq {
    header: [u8; 16],
    id: [u8; 20],
    status: u8,
}

fn get_id(socket: &Path) -> [u8; 20] {
    let mut t = VhostUser::<VirtioBlkConfig, IdReq>::new(socket.to_str().unwrap(), features())
        .expect("connect for GET_ID");
    let feats = VirtioFeatureFlags::from_bits_truncate(t.get_features());
    let layout = VirtqueueLayout::new::<IdReq>(1, 16, feats).unwrap();
    let translator = t.iova_translator();
    let mem = t.alloc_queue_mem(&layout).unwrap();
    // SAFETY:
    // - the ring memory is the transport's mapping, which outlives `vq` (dropped at the end of
    //   this function, before `t`); this detaches the borrow the way virtio-driver's own
    //   `setup_queues` does, so the transport can be told about the queue.
    let mem: &mut [u8] = unsafe { std::slice::from_raw_parts_mut(mem.as_mut_ptr(), mem.len()) };
    let mut vq = Virtqueue::<IdReq>::new(translator, mem, 16, feats).unwrap();
    t.setup_queues(std::slice::from_ref(&vq)).unwrap();
    vq.set_used_notif_enabled(true);
    vq.add_request(|req, add| {
        req.header = [0; 16];
        req.header[0] = 8; // VIRTIO_BLK_T_GET_ID
        req.id = [0; 20];
        req.status = 0xff;
        add(iovec { iov_base: req.header.as_mut_ptr().cast(), iov_len: 16 }, false)?;
        add(iovec { iov_base: req.id.as_mut_ptr().cast(), iov_len: 20 }, true)?;
        add(iovec { iov_base: (&mut req.status as *mut u8).cast(), iov_len: 1 }, true)
    })
    .unwrap();
    t.get_submission_notifier(0).notify().unwrap();
    loop {
        if let Some(c) = vq.completions().next() {
            assert_eq!(c.req.status, 0, "GET_ID status");
            return c.req.id;
        }
        let fd = t.get_completion_fd(0);
        wait_readable(fd.as_raw_fd());
        let _ = fd.read();
    }
}

#[test]
fn read_write_flush_discard_get_id_and_reconnect() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("blk.sock");
    let disk = Arc::new(RamDisk::new(DISK, 512).unwrap());
    let options = VhostBlkOptions {
        num_queues: 2,
        serial: "fastlane-it-0001".into(),
        ..VhostBlkOptions::default()
    };
    let server = Server::start(&socket, disk.clone(), options);

    let mut c = Client::connect(&socket, 2);
    let cfg = c.transport.get_config().unwrap();
    assert_eq!(u64::from(cfg.capacity), DISK / 512);
    assert_eq!(u16::from(cfg.num_queues), 2);
    for q in 0..2 {
        let data = pattern(q as u8 + 1, 64 << 10);
        c.buf.slice(0, data.len()).copy_from_slice(&data);
        let off = (q as u64 + 1) << 20;
        assert_eq!(c.write(q, off, 0, data.len()), 0, "write on queue {q}");
        c.buf.slice(0x8_0000, data.len()).fill(0);
        assert_eq!(c.read(q, off, 0x8_0000, data.len()), 0, "read on queue {q}");
        assert_eq!(c.buf.slice(0x8_0000, data.len()), &data[..], "read back on queue {q}");
        let mut on_disk = vec![0u8; data.len()];
        disk.read_at(off, &mut on_disk).unwrap();
        assert_eq!(on_disk, data);
    }
    c.queues[0].flush(0).unwrap();
    assert_eq!(c.complete(0), 0, "flush");
    c.queues[1].discard(1 << 20, 8192, 0).unwrap();
    assert_eq!(c.complete(1), 0, "discard");
    c.queues[0].write_zeroes(2 << 20, 4096, true, 0).unwrap();
    assert_eq!(c.complete(0), 0, "write zeroes");
    let mut check = vec![0xffu8; 8192];
    disk.read_at(1 << 20, &mut check).unwrap();
    assert!(check.iter().all(|&b| b == 0), "discarded range reads zero");
    disk.read_at(2 << 20, &mut check[..4096]).unwrap();
    assert!(check[..4096].iter().all(|&b| b == 0), "zeroed range reads zero");
    // Out of range: an error status, not a dead daemon.
    assert!(c.read(0, DISK, 0, 4096) < 0);
    drop(c);

    // A second frontend on the same socket: the data is still there, GET_ID answers.
    let mut c2 = Client::connect(&socket, 1);
    assert_eq!(c2.read(0, (1 << 20) + 8192, 0, 4096), 0);
    assert_eq!(c2.buf.slice(0, 4096), &pattern(1, 64 << 10)[8192..8192 + 4096]);
    drop(c2);
    let id = get_id(&socket);
    assert_eq!(&id[..16], b"fastlane-it-0001");
    assert_eq!(&id[16..], &[0; 4]);

    let stats = server.stop();
    let q0 = stats.queue(0);
    assert!(q0.completed.load(std::sync::atomic::Ordering::Relaxed) >= 5);
    assert_eq!(q0.rejected_total(), 1, "the out-of-range read");
    assert!(!q0.latency().is_empty());
    assert!(!socket.exists(), "socket removed on shutdown");
}

#[test]
fn read_only_export_refuses_writes() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("ro.sock");
    let disk = Arc::new(RamDisk::new(DISK, 512).unwrap());
    disk.write_at(0, &[0x5a; 4096]).unwrap();
    let options = VhostBlkOptions { read_only: true, poll_us: 0, ..VhostBlkOptions::default() };
    let server = Server::start(&socket, disk.clone(), options);

    let mut c = Client::connect(&socket, 1);
    let feats = VirtioBlkFeatureFlags::from_bits_truncate(c.transport.get_features());
    assert!(feats.contains(VirtioBlkFeatureFlags::RO));
    c.buf.slice(0, 4096).fill(0x11);
    assert_eq!(c.write(0, 0, 0, 4096), -libc::EIO);
    assert_eq!(c.read(0, 0, 0, 4096), 0);
    assert!(c.buf.slice(0, 4096).iter().all(|&b| b == 0x5a));
    drop(c);
    let stats = server.stop();
    assert_eq!(stats.queue(0).rejected(fastlane_vhost_blk::RejectReason::ReadOnly), 1);
}

#[test]
fn stop_without_a_frontend_returns_promptly() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("idle.sock");
    let disk = Arc::new(RamDisk::new(1 << 20, 512).unwrap());
    let server = Server::start(&socket, disk, VhostBlkOptions::default());
    std::thread::sleep(Duration::from_millis(50));
    let t = std::time::Instant::now();
    server.stop();
    assert!(t.elapsed() < Duration::from_secs(2));
}

/// The same path over the io_uring backend: requests complete asynchronously, so the worker
/// sleeps on the block queue's completion eventfd.
#[test]
fn io_uring_backend_round_trip() {
    use fastlane_block::uring::{UringDevice, UringOptions};
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("uring.sock");
    let image = dir.path().join("disk.img");
    std::fs::File::create(&image).unwrap().set_len(DISK).unwrap();
    let device = match UringDevice::open(&image, UringOptions::default()) {
        Ok(d) => Arc::new(d),
        Err(e) => {
            eprintln!("skipping: io_uring unavailable here: {e}");
            return;
        }
    };
    let options = VhostBlkOptions { num_queues: 2, poll_us: 0, ..VhostBlkOptions::default() };
    let server = Server::start(&socket, device, options);
    let mut c = Client::connect(&socket, 2);
    for q in 0..2 {
        let data = pattern(q as u8 + 7, 128 << 10);
        c.buf.slice(0, data.len()).copy_from_slice(&data);
        let off = (q as u64 + 3) << 20;
        assert_eq!(c.write(q, off, 0, data.len()), 0, "write on queue {q}");
        c.queues[q].flush(0).unwrap();
        assert_eq!(c.complete(q), 0, "flush on queue {q}");
        c.buf.slice(0x8_0000, data.len()).fill(0);
        assert_eq!(c.read(q, off, 0x8_0000, data.len()), 0, "read on queue {q}");
        assert_eq!(c.buf.slice(0x8_0000, data.len()), &data[..]);
    }
    drop(c);
    server.stop();
    let mut on_disk = vec![0u8; 128 << 10];
    let f = std::fs::File::open(&image).unwrap();
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut on_disk, 3 << 20).unwrap();
    assert_eq!(on_disk, pattern(7, 128 << 10));
}
