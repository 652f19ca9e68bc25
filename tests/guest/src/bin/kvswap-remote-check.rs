//! Guest-side driver of kvswap's remote-tier test (fastlane-kvswap/tests/remote_guest.rs): runs inside
//! a soft-RoCE QEMU guest (fastlane-kvswap/tests/vm/guest-kvswap.sh).
//!
//! - `pool-server ADDR BYTES`: a `fastlane_rdma::PoolServer` (prints `READY`).
//! - `client ADDR`: a swap engine whose spill tier is a range of that pool: spills cold
//!   sequences there, swaps them back and checks the bytes; prints `KILL-ME`, waits until the
//!   pool server is gone (the script kills it with -9), then checks that a swap-out to the dead
//!   peer fails with `RemotePeerGone` and leaves the data in device memory.
//!
//! Output: `CHECK name ok|FAIL detail` lines; exit status 1 when any check failed.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fastlane_kvswap::{
    BlockId, DeviceMemory, EngineConfig, HostDeviceMemory, KvSwapError, RemoteTierConfig, SeqId,
    SeqPhase, SpillPolicy, SwapEngine, TierKind,
};

use fastlane_guest_tests::driver::{check, remote_main, R};
use fastlane_util::pattern;

const BB: usize = 64 * 1024;
const T: Duration = Duration::from_secs(30);

/// Block `i` of `blocks` holds bytes `[i × BB, (i + 1) × BB)` of `seed`'s pattern.
fn fill(dev: &HostDeviceMemory, blocks: &[BlockId], seed: u64) {
    for (i, b) in blocks.iter().enumerate() {
        // SAFETY: the driver owns these blocks and no transfer names them now.
        let s = unsafe { std::slice::from_raw_parts_mut(dev.block_ptr(*b).unwrap(), BB) };
        pattern::fill(seed, (i * BB) as u64, s);
    }
}

fn same(dev: &HostDeviceMemory, blocks: &[BlockId], seed: u64) -> bool {
    blocks.iter().enumerate().all(|(i, b)| {
        // SAFETY: as in `fill`.
        let s = unsafe { std::slice::from_raw_parts(dev.block_ptr(*b).unwrap(), BB) };
        pattern::first_mismatch(seed, (i * BB) as u64, s).is_none()
    })
}

fn e(err: KvSwapError) -> String {
    err.to_string()
}

fn park(eng: &mut SwapEngine, dev: &HostDeviceMemory, seq: u64, n: u32) -> R<()> {
    let b = eng.alloc_blocks(SeqId(seq), n).map_err(e)?;
    fill(dev, &b, seq);
    let t = eng.swap_out(SeqId(seq), &b).map_err(e)?;
    eng.wait(t, T).map_err(e)?;
    eng.free_blocks(SeqId(seq), &b).map_err(e)
}

fn unpark(eng: &mut SwapEngine, dev: &HostDeviceMemory, seq: u64, n: u32) -> R<bool> {
    let b = eng.alloc_blocks(SeqId(seq), n).map_err(e)?;
    let t = eng.swap_in(SeqId(seq), &b).map_err(e)?;
    eng.wait(t, T).map_err(e)?;
    let ok = same(dev, &b, seq);
    eng.free_blocks(SeqId(seq), &b).map_err(e)?;
    Ok(ok)
}

fn client(addr: SocketAddr) -> R<()> {
    let dev = Arc::new(HostDeviceMemory::new(BB, 64).map_err(e)?);
    let config = EngineConfig {
        host_bytes: 16 * BB as u64,
        remote: Some(RemoteTierConfig {
            device: std::env::var("RDMA_DEV").unwrap_or_else(|_| "rxe0".into()),
            addr,
            bytes: 48 * BB as u64,
        }),
        spill: SpillPolicy::RemoteOnly,
        ..EngineConfig::default()
    };
    let mut eng = SwapEngine::new(config, dev.clone()).map_err(e)?;
    check(
        "remote-connect",
        eng.stats().tiers[2].capacity_bytes == 48 * BB as u64,
        "48 blocks granted",
    )?;
    park(&mut eng, &dev, 1, 8)?;
    park(&mut eng, &dev, 2, 8)?;
    park(&mut eng, &dev, 3, 8)?;
    let p1 = eng.lookup(SeqId(1)).map(|i| i.phase);
    check("remote-spill", p1 == Some(SeqPhase::Out(TierKind::Remote)), format!("coldest: {p1:?}"))?;
    park(&mut eng, &dev, 4, 20)?;
    let p4 = eng.lookup(SeqId(4)).map(|i| i.phase);
    check("remote-direct", p4 == Some(SeqPhase::Out(TierKind::Remote)), format!("{p4:?}"))?;
    let st = eng.stats();
    check(
        "remote-accounting",
        st.tiers[0].used_bytes == 16 * BB as u64 && st.tiers[2].used_bytes == 28 * BB as u64,
        format!("host {} remote {}", st.tiers[0].used_bytes, st.tiers[2].used_bytes),
    )?;
    let mut all = true;
    for (s, n) in [(1, 8), (2, 8), (3, 8), (4, 20)] {
        all &= unpark(&mut eng, &dev, s, n)?;
    }
    check("remote-round-trip", all, "4 sequences, checksummed, bytes compared")?;
    park(&mut eng, &dev, 5, 20)?; // lives in the pool when the server dies
    println!("KILL-ME");
    let t0 = Instant::now();
    while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
        if t0.elapsed() > Duration::from_secs(30) {
            return check("remote-peer-killed", false, "pool server still up after 30 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let b = eng.alloc_blocks(SeqId(6), 20).map_err(e)?;
    fill(&dev, &b, 6);
    let t0 = Instant::now();
    let r = match eng.swap_out(SeqId(6), &b) {
        Ok(t) => eng.wait(t, Duration::from_secs(60)),
        Err(x) => Err(x),
    };
    check(
        "remote-peer-gone",
        matches!(r, Err(KvSwapError::RemotePeerGone { .. })),
        format!("{r:?} after {:?}", t0.elapsed()),
    )?;
    let phase = eng.lookup(SeqId(6)).map(|i| i.phase);
    check(
        "remote-gone-data-kept",
        phase == Some(SeqPhase::Resident) && same(&dev, &b, 6),
        format!("{phase:?}"),
    )?;
    let c = eng.alloc_blocks(SeqId(5), 20).map_err(e)?;
    let r = eng.swap_in(SeqId(5), &c).and_then(|t| eng.wait(t, Duration::from_secs(60)));
    let phase = eng.lookup(SeqId(5)).map(|i| i.phase);
    check(
        "remote-gone-swap-in",
        r.is_err() && phase == Some(SeqPhase::Out(TierKind::Remote)),
        format!("{r:?}, still {phase:?}"),
    )
}

fn main() -> ExitCode {
    remote_main("kvswap-remote-check", client)
}
