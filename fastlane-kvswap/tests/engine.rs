//! End-to-end tests of the swap engine on the host-memory device pool.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use fastlane_kvswap::testing::MemTier;
use fastlane_kvswap::{
    BlockId, ChecksumMode, CustomTiers, DeviceMemory, EngineConfig, HostDeviceMemory, KvSwapError,
    NvmeTierConfig, SeqId, SeqPhase, SpillPolicy, SwapEngine, TenantId, TierIo, TierKind,
};
use fastlane_util::pattern;

const BB: usize = 64 * 1024;
const T: Duration = Duration::from_secs(10);

fn device(blocks: u32) -> Arc<HostDeviceMemory> {
    Arc::new(HostDeviceMemory::new(BB, blocks).unwrap())
}

/// Block `i` of `blocks` holds bytes `[i × BB, (i + 1) × BB)` of `seed`'s pattern.
fn fill(dev: &HostDeviceMemory, blocks: &[BlockId], seed: u64) {
    for (i, b) in blocks.iter().enumerate() {
        // SAFETY: the test owns these blocks; no transfer names them now.
        let s = unsafe { std::slice::from_raw_parts_mut(dev.block_ptr(*b).unwrap(), BB) };
        pattern::fill(seed, (i * BB) as u64, s);
    }
}

fn check(dev: &HostDeviceMemory, blocks: &[BlockId], seed: u64) -> bool {
    blocks.iter().enumerate().all(|(i, b)| {
        // SAFETY: as in `fill`.
        let s = unsafe { std::slice::from_raw_parts(dev.block_ptr(*b).unwrap(), BB) };
        pattern::first_mismatch(seed, (i * BB) as u64, s).is_none()
    })
}

fn cfg(host_blocks: u64) -> EngineConfig {
    EngineConfig { host_bytes: host_blocks * BB as u64, ..EngineConfig::default() }
}

/// Swap out `n` fresh blocks of `seq` filled with `seq` as seed, wait, free the device blocks.
fn park(e: &mut SwapEngine, dev: &HostDeviceMemory, seq: u64, n: u32) -> Result<(), KvSwapError> {
    let b = e.alloc_blocks(SeqId(seq), n)?;
    fill(dev, &b, seq);
    let t = e.swap_out(SeqId(seq), &b).inspect_err(|_| {
        e.free_blocks(SeqId(seq), &b).unwrap();
    })?;
    let r = e.wait(t, T);
    if r.is_ok() {
        e.free_blocks(SeqId(seq), &b).unwrap();
    }
    r
}

fn unpark(
    e: &mut SwapEngine,
    dev: &HostDeviceMemory,
    seq: u64,
    n: u32,
) -> Result<Vec<BlockId>, KvSwapError> {
    let b = e.alloc_blocks(SeqId(seq), n)?;
    let t = e.swap_in(SeqId(seq), &b)?;
    e.wait(t, T)?;
    assert!(check(dev, &b, seq), "seq {seq} came back different");
    Ok(b)
}

#[test]
fn host_round_trip_and_exact_accounting() {
    let dev = device(64);
    let mut e = SwapEngine::new(cfg(32), dev.clone()).unwrap();
    park(&mut e, &dev, 1, 10).unwrap();
    park(&mut e, &dev, 2, 7).unwrap();
    let st = e.stats();
    assert_eq!(st.tiers[0].capacity_bytes, 32 * BB as u64);
    assert_eq!(st.tiers[0].used_bytes, 17 * BB as u64);
    assert_eq!(st.device_free, 64);
    assert_eq!(st.tenant_bytes, vec![(TenantId(0), 17 * BB as u64)]);
    assert_eq!(e.lookup(SeqId(1)).unwrap().phase, SeqPhase::Out(TierKind::Host));
    let b = unpark(&mut e, &dev, 1, 10).unwrap();
    let st = e.stats();
    assert_eq!(st.tiers[0].used_bytes, 7 * BB as u64);
    assert_eq!(st.device_free, 54);
    assert_eq!(st.bytes_out, 17 * BB as u64);
    assert_eq!(st.bytes_in, 10 * BB as u64);
    e.free_blocks(SeqId(1), &b).unwrap();
    e.drop_seq(SeqId(2)).unwrap();
    let st = e.stats();
    assert_eq!(st.tiers[0].used_bytes, 0);
    assert!(st.tenant_bytes.is_empty());
    assert_eq!(st.device_free, 64);
}

#[test]
fn blocks_in_flight_cannot_be_reused() {
    let dev = device(8);
    let mut e = SwapEngine::new(cfg(8), dev.clone()).unwrap();
    let b = e.alloc_blocks(SeqId(1), 4).unwrap();
    fill(&dev, &b, 1);
    let t = e.swap_out(SeqId(1), &b).unwrap();
    // The copy may already be done in the worker, but the engine has not seen it: the blocks
    // stay pinned until poll/wait processes the completion.
    assert!(matches!(e.free_blocks(SeqId(1), &b), Err(KvSwapError::BlockPinned { .. })));
    let other = e.alloc_blocks(SeqId(2), 4).unwrap();
    assert!(other.iter().all(|x| !b.contains(x)), "pinned block handed to another sequence");
    assert!(matches!(e.alloc_blocks(SeqId(3), 1), Err(KvSwapError::DeviceFull { .. })));
    assert!(matches!(e.free_blocks(SeqId(2), &b), Err(KvSwapError::BlockNotOwned { .. })));
    assert_eq!(e.stats().device_pinned, 4);
    e.wait(t, T).unwrap();
    e.free_blocks(SeqId(1), &b).unwrap();
    assert_eq!(e.stats().device_pinned, 0);
    let b3 = e.alloc_blocks(SeqId(3), 4).unwrap();
    fill(&dev, &b3, 99);
    unpark(&mut e, &dev, 1, 0).expect_err("count mismatch");
    e.free_blocks(SeqId(3), &b3).unwrap();
    unpark(&mut e, &dev, 1, 4).unwrap();
}

#[test]
fn typed_errors() {
    let dev = device(8);
    let mut e = SwapEngine::new(cfg(4), dev.clone()).unwrap();
    assert_eq!(e.swap_out(SeqId(9), &[]), Err(KvSwapError::UnknownSequence { seq: SeqId(9) }));
    let b = e.alloc_blocks(SeqId(1), 2).unwrap();
    assert!(matches!(e.swap_in(SeqId(1), &b), Err(KvSwapError::NotSwappedOut { .. })));
    assert!(matches!(e.swap_out(SeqId(1), &[b[0], b[0]]), Err(KvSwapError::DuplicateBlock { .. })));
    let t = e.swap_out(SeqId(1), &b).unwrap();
    assert_eq!(e.swap_out(SeqId(1), &b), Err(KvSwapError::DoubleSwapOut { seq: SeqId(1) }));
    e.wait(t, T).unwrap();
    assert_eq!(e.swap_out(SeqId(1), &b), Err(KvSwapError::DoubleSwapOut { seq: SeqId(1) }));
    assert!(matches!(e.wait(t, T), Err(KvSwapError::UnknownTicket { .. })));
    assert!(matches!(e.swap_in(SeqId(1), &b[..1]), Err(KvSwapError::BlockCountMismatch { .. })));
    // Host full, spilling never allowed.
    let c = e.alloc_blocks(SeqId(2), 3).unwrap();
    let mut e2 = e;
    let r = e2.swap_out(SeqId(2), &c);
    assert!(matches!(r, Err(KvSwapError::TierFull { .. })), "{r:?}");
    assert_eq!(e2.lookup(SeqId(2)).unwrap().phase, SeqPhase::Resident);
    e2.drop_seq(SeqId(1)).unwrap();
    assert_eq!(e2.drop_seq(SeqId(1)), Err(KvSwapError::UnknownSequence { seq: SeqId(1) }));
}

#[test]
fn quotas_per_tenant() {
    let dev = device(16);
    let mut e = SwapEngine::new(cfg(16), dev.clone()).unwrap();
    e.register_seq(SeqId(1), TenantId(7)).unwrap();
    e.register_seq(SeqId(2), TenantId(7)).unwrap();
    e.set_quota(TenantId(7), Some(5 * BB as u64));
    park(&mut e, &dev, 1, 4).unwrap();
    let r = park(&mut e, &dev, 2, 2);
    assert!(matches!(r, Err(KvSwapError::QuotaExceeded { tenant: TenantId(7), .. })), "{r:?}");
    park(&mut e, &dev, 3, 2).unwrap(); // tenant 0 has no quota
    assert_eq!(
        e.stats().tenant_bytes,
        vec![(TenantId(0), 2 * BB as u64), (TenantId(7), 4 * BB as u64)]
    );
}

fn spill_engine(
    host_blocks: u64,
    spill_blocks: usize,
    kind: TierKind,
    policy: SpillPolicy,
    mode: ChecksumMode,
) -> (Arc<HostDeviceMemory>, SwapEngine, Arc<fastlane_kvswap::testing::MemTierFaults>) {
    let dev = device(64);
    let (tier, faults) = MemTier::new(kind, spill_blocks * BB);
    let tier: Box<dyn TierIo> = Box::new(tier);
    let tiers = if kind == TierKind::Nvme {
        CustomTiers { nvme: Some(tier), remote: None }
    } else {
        CustomTiers { nvme: None, remote: Some(tier) }
    };
    let config =
        EngineConfig { spill: policy, checksum: mode, chunk_bytes: 512 * 1024, ..cfg(host_blocks) };
    let e = SwapEngine::with_tiers(config, dev.clone(), tiers).unwrap();
    (dev, e, faults)
}

#[test]
fn coldest_sequences_spill_and_come_back() {
    let (dev, mut e, faults) =
        spill_engine(16, 64, TierKind::Nvme, SpillPolicy::NvmeFirst, ChecksumMode::Fast);
    park(&mut e, &dev, 1, 8).unwrap();
    park(&mut e, &dev, 2, 8).unwrap();
    e.touch(SeqId(1)).unwrap(); // 2 is now the coldest
    park(&mut e, &dev, 3, 8).unwrap();
    assert_eq!(e.lookup(SeqId(2)).unwrap().phase, SeqPhase::Out(TierKind::Nvme));
    assert_eq!(e.lookup(SeqId(1)).unwrap().phase, SeqPhase::Out(TierKind::Host));
    assert_eq!(e.lookup(SeqId(3)).unwrap().phase, SeqPhase::Out(TierKind::Host));
    let st = e.stats();
    assert_eq!(st.tiers[0].used_bytes, 16 * BB as u64);
    assert_eq!(st.tiers[1].used_bytes, 8 * BB as u64);
    assert_eq!(st.spills, 1);
    // 8 blocks of 64 KiB, 512 KiB chunks: one store for the spill.
    assert_eq!(faults.stores.load(Ordering::Relaxed), 1);
    // Bigger than the host tier: straight to nvme.
    park(&mut e, &dev, 4, 20).unwrap();
    assert_eq!(e.lookup(SeqId(4)).unwrap().phase, SeqPhase::Out(TierKind::Nvme));
    for (s, n) in [(1, 8), (2, 8), (3, 8), (4, 20)] {
        let b = unpark(&mut e, &dev, s, n).unwrap();
        e.free_blocks(SeqId(s), &b).unwrap();
    }
    let st = e.stats();
    assert_eq!((st.tiers[0].used_bytes, st.tiers[1].used_bytes, st.device_free), (0, 0, 64));
}

#[test]
fn failed_spill_loses_nothing() {
    let (dev, mut e, faults) =
        spill_engine(16, 64, TierKind::Nvme, SpillPolicy::NvmeFirst, ChecksumMode::Fast);
    park(&mut e, &dev, 1, 8).unwrap();
    park(&mut e, &dev, 2, 8).unwrap();
    faults.fail_stores.store(true, Ordering::Relaxed);
    let b = e.alloc_blocks(SeqId(3), 8).unwrap();
    fill(&dev, &b, 3);
    let t = e.swap_out(SeqId(3), &b).unwrap();
    let r = e.wait(t, T);
    assert!(matches!(r, Err(KvSwapError::TierIo { tier: TierKind::Nvme, .. })), "{r:?}");
    assert_eq!(e.lookup(SeqId(3)).unwrap().phase, SeqPhase::Resident);
    assert!(check(&dev, &b, 3), "device copy of the failed swap-out changed");
    assert_eq!(e.lookup(SeqId(1)).unwrap().phase, SeqPhase::Out(TierKind::Host));
    let st = e.stats();
    assert_eq!((st.tiers[0].used_bytes, st.tiers[1].used_bytes), (16 * BB as u64, 0));
    faults.fail_stores.store(false, Ordering::Relaxed);
    e.free_blocks(SeqId(3), &b).unwrap();
    unpark(&mut e, &dev, 1, 8).unwrap();
    unpark(&mut e, &dev, 2, 8).unwrap();
}

#[test]
fn remote_peer_gone_is_typed_and_keeps_data() {
    let (dev, mut e, faults) =
        spill_engine(0, 64, TierKind::Remote, SpillPolicy::RemoteOnly, ChecksumMode::Fast);
    park(&mut e, &dev, 1, 4).unwrap();
    assert_eq!(e.lookup(SeqId(1)).unwrap().phase, SeqPhase::Out(TierKind::Remote));
    faults.fail_stores.store(true, Ordering::Relaxed);
    let b = e.alloc_blocks(SeqId(2), 4).unwrap();
    fill(&dev, &b, 2);
    let t = e.swap_out(SeqId(2), &b).unwrap();
    assert!(matches!(e.wait(t, T), Err(KvSwapError::RemotePeerGone { .. })));
    assert!(check(&dev, &b, 2));
    faults.fail_loads.store(true, Ordering::Relaxed);
    let c = e.alloc_blocks(SeqId(1), 4).unwrap();
    let t = e.swap_in(SeqId(1), &c).unwrap();
    assert!(matches!(e.wait(t, T), Err(KvSwapError::RemotePeerGone { .. })));
    assert_eq!(e.lookup(SeqId(1)).unwrap().phase, SeqPhase::Out(TierKind::Remote));
    faults.fail_loads.store(false, Ordering::Relaxed);
    let t = e.swap_in(SeqId(1), &c).unwrap();
    e.wait(t, T).unwrap();
    assert!(check(&dev, &c, 1));
}

#[test]
fn checksum_catches_corruption_and_can_be_off() {
    for mode in [ChecksumMode::Fast, ChecksumMode::Crc32c, ChecksumMode::Off] {
        let (dev, mut e, faults) = spill_engine(0, 64, TierKind::Nvme, SpillPolicy::NvmeOnly, mode);
        park(&mut e, &dev, 1, 4).unwrap();
        faults.corrupt_offset.store(2 * BB as u64 + 100, Ordering::Relaxed);
        faults.corrupt_xor.store(0x10, Ordering::Relaxed);
        let c = e.alloc_blocks(SeqId(1), 4).unwrap();
        let t = e.swap_in(SeqId(1), &c).unwrap();
        let r = e.wait(t, T);
        if mode == ChecksumMode::Off {
            assert_eq!(r, Ok(()));
            assert!(!check(&dev, &c, 1));
        } else {
            assert_eq!(
                r,
                Err(KvSwapError::ChecksumMismatch {
                    seq: SeqId(1),
                    index: 2,
                    tier: TierKind::Nvme
                }),
                "{mode:?}"
            );
            assert_eq!(e.stats().checksum_failures, 1);
        }
    }
}

#[test]
fn cancel_and_drop_leave_consistent_state() {
    let (dev, mut e, _faults) =
        spill_engine(8, 64, TierKind::Nvme, SpillPolicy::NvmeFirst, ChecksumMode::Fast);
    let b = e.alloc_blocks(SeqId(1), 8).unwrap();
    fill(&dev, &b, 1);
    let t = e.swap_out(SeqId(1), &b).unwrap();
    e.cancel(t).unwrap();
    let r = e.wait(t, T);
    assert_eq!(r, Err(KvSwapError::Cancelled));
    assert_eq!(e.lookup(SeqId(1)).unwrap().phase, SeqPhase::Resident);
    assert!(check(&dev, &b, 1));
    assert_eq!(e.stats().tiers[0].used_bytes, 0);
    let t = e.swap_out(SeqId(1), &b).unwrap();
    e.drop_seq(SeqId(1)).unwrap();
    let mut done = Vec::new();
    for _ in 0..1000 {
        e.poll(&mut done);
        if e.in_flight() == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].ticket, t);
    let st = e.stats();
    assert_eq!((st.tiers[0].used_bytes, st.device_free, st.device_pinned), (0, 64, 0));
    assert!(e.lookup(SeqId(1)).is_none());
}

#[test]
fn nvme_tier_o_direct_round_trip() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let dev = device(64);
    let config = EngineConfig {
        host_bytes: 0,
        nvme: Some(NvmeTierConfig {
            path: dir.path().join("tier"),
            bytes: 64 * BB as u64,
            depth: 8,
        }),
        spill: SpillPolicy::NvmeOnly,
        ..EngineConfig::default()
    };
    let mut e = SwapEngine::new(config, dev.clone()).unwrap();
    park(&mut e, &dev, 1, 20).unwrap();
    park(&mut e, &dev, 2, 30).unwrap();
    assert_eq!(e.stats().tiers[1].used_bytes, 50 * BB as u64);
    let r = park(&mut e, &dev, 3, 20);
    assert!(matches!(r, Err(KvSwapError::TierFull { tier: TierKind::Nvme, .. })), "{r:?}");
    unpark(&mut e, &dev, 2, 30).unwrap();
    unpark(&mut e, &dev, 1, 20).unwrap();
    assert_eq!(e.stats().tiers[1].used_bytes, 0);
}
