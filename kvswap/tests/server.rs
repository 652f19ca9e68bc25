//! The Unix-socket server with the Rust client: a full preemption round trip over the
//! protocol, and hostile frames that must close only their own connection.

use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvswap::client::{KvClient, KvClientError};
use kvswap::proto::{ErrorCode, Request};
use kvswap::server::Server;
use kvswap::{EngineConfig, HostDeviceMemory, SwapEngine};

const BB: usize = 64 * 1024;

fn start(
    dir: &std::path::Path,
) -> (std::path::PathBuf, Arc<AtomicBool>, std::thread::JoinHandle<Server>) {
    let dev = Arc::new(HostDeviceMemory::new(BB, 32).unwrap());
    let (fd, len) = (dev.fd(), dev.len_bytes() as u64);
    let engine = SwapEngine::new(
        EngineConfig { host_bytes: 16 * BB as u64, ..Default::default() },
        dev.clone(),
    )
    .unwrap();
    let path = dir.join("kv.sock");
    let server = Server::bind(&path, engine, fd, len).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    let h = std::thread::spawn(move || {
        server.serve(&s2).unwrap();
        drop(dev);
        server
    });
    (path, stop, h)
}

#[test]
fn preempt_and_resume_over_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let (path, stop, h) = start(dir.path());
    let mut c = KvClient::connect(&path).unwrap();
    assert_eq!((c.block_bytes(), c.blocks()), (BB, 32));
    let blocks = c.alloc(7, 4).unwrap();
    for (i, b) in blocks.iter().enumerate() {
        c.write_block(*b, &vec![i as u8 + 1; BB]);
    }
    let t = c.prepare_store(7, &blocks).unwrap();
    // Pinned until the store completes: freeing now is refused.
    match c.free(7, &blocks) {
        Err(KvClientError::Server { code: ErrorCode::BlockPinned, .. }) | Ok(()) => {}
        other => panic!("unexpected {other:?}"),
    }
    c.complete(t, Duration::from_secs(10)).unwrap();
    let _ = c.free(7, &blocks);
    let l = c.lookup(7).unwrap();
    assert_eq!((l.phase, l.tier, l.blocks_out), (2, 0, 4));
    c.touch(7).unwrap();
    let (tiers, _, _) = c.stats().unwrap();
    assert_eq!(tiers[0], (16 * BB as u64, 4 * BB as u64));
    // Scribble over the pool, then load back into fresh blocks.
    let other = c.alloc(8, 8).unwrap();
    for b in &other {
        c.write_block(*b, &vec![0xee; BB]);
    }
    c.free(8, &other).unwrap();
    let back = c.alloc(7, 4).unwrap();
    let t = c.prepare_load(7, &back).unwrap();
    c.complete(t, Duration::from_secs(10)).unwrap();
    let mut buf = vec![0u8; BB];
    for (i, b) in back.iter().enumerate() {
        c.read_block(*b, &mut buf);
        assert!(buf.iter().all(|x| *x == i as u8 + 1), "block {i} came back different");
    }
    // Typed errors travel as status codes.
    assert!(matches!(
        c.prepare_load(7, &back),
        Err(KvClientError::Server { code: ErrorCode::NotSwappedOut, .. })
    ));
    assert!(matches!(
        c.lookup(99),
        Err(KvClientError::Server { code: ErrorCode::UnknownSequence, .. })
    ));
    assert!(matches!(
        c.complete(12345, Duration::ZERO),
        Err(KvClientError::Server { code: ErrorCode::UnknownTicket, .. })
    ));
    c.drop_seq(7).unwrap();
    stop.store(true, Ordering::Relaxed);
    drop(c);
    h.join().unwrap();
}

#[test]
fn hostile_frames_close_only_their_connection() {
    let dir = tempfile::tempdir().unwrap();
    let (path, stop, h) = start(dir.path());
    let mut good = KvClient::connect(&path).unwrap();
    let blocks = good.alloc(1, 2).unwrap();
    let hostile: Vec<Vec<u8>> = vec![
        b"GET / HTTP/1.1\r\n\r\n".to_vec(),
        {
            let mut f = Request::PrepareStore { seq: 1, blocks: vec![1] }.encode(1);
            f[20] = 0xff; // block count far past the payload
            f
        },
        {
            let mut f = Request::Stats.encode(1);
            f[12..16].copy_from_slice(&u32::MAX.to_le_bytes()); // 4 GiB payload
            f
        },
        {
            let mut f = Request::Hello.encode(1);
            f[6] = 200; // unknown op
            f
        },
    ];
    for bytes in hostile {
        let mut bad = KvClient::connect(&path).unwrap();
        bad.send_raw(&bytes).unwrap();
        // The server closes it: reads see EOF (bounded by the client's read timeout).
        let mut s = std::os::unix::net::UnixStream::connect(&path).unwrap();
        drop(s.set_read_timeout(Some(Duration::from_millis(1))));
        let _ = s.read(&mut [0u8; 1]);
        assert!(bad.lookup(1).is_err(), "hostile connection still served");
        // The well-behaved connection is unaffected.
        assert_eq!(good.lookup(1).unwrap().device_blocks, 2);
    }
    // Another connection cannot touch this one's sequences or tickets.
    let mut other = KvClient::connect(&path).unwrap();
    assert!(matches!(
        other.free(1, &blocks),
        Err(KvClientError::Server { code: ErrorCode::BlockNotOwned, .. })
    ));
    let t = good.prepare_store(1, &blocks).unwrap();
    assert!(matches!(
        other.complete(t, Duration::ZERO),
        Err(KvClientError::Server { code: ErrorCode::UnknownTicket, .. })
    ));
    good.complete(t, Duration::from_secs(10)).unwrap();
    stop.store(true, Ordering::Relaxed);
    drop((good, other));
    let server = h.join().unwrap();
    assert_eq!(server.counters().protocol_errors.load(Ordering::Relaxed), 4);
}

/// Replays the fuzz target's seed corpus (kvswap/fuzz/corpus/proto) through the same oracle.
#[test]
fn fuzz_seed_corpus_replays() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/proto");
    let mut files = 0;
    let mut frames = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let data = std::fs::read(e.unwrap().path()).unwrap();
        frames += kvswap::proto::check_frame_model(&data);
        files += 1;
    }
    assert!(files >= 10, "seed corpus missing ({files} files)");
    assert!(frames >= 10, "seeds decode to too few frames ({frames})");
    // Random mutations of the seeds, as a bounded stand-in for the fuzzer in cargo test.
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for e in std::fs::read_dir(&dir).unwrap() {
        let seed = std::fs::read(e.unwrap().path()).unwrap();
        for _ in 0..2000 {
            let mut d = seed.clone();
            for _ in 0..3 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                if d.is_empty() {
                    break;
                }
                let i = (x as usize) % d.len();
                d[i] ^= (x >> 32) as u8;
            }
            kvswap::proto::check_frame_model(&d);
        }
    }
}
