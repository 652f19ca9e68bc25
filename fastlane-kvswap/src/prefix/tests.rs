//! Unit tests of the prefix store.

use super::*;
use crate::cas::{prefix_keys, ModelDigest};
use crate::KvGeometry;

fn keys(n: usize, seed: u32) -> Vec<BlockKey> {
    let d = ModelDigest::new("test", &KvGeometry::LLAMA31_8B);
    let t: Vec<u32> = (0..n as u32 * 16).map(|i| i ^ seed).collect();
    prefix_keys(&d, &t, 16)
}

fn block(i: u8) -> Arc<[u8]> {
    vec![i; 64].into()
}

fn store(blocks: usize) -> PrefixStore {
    PrefixStore::new(PrefixStoreConfig {
        host_bytes: blocks * 64,
        block_bytes: 64,
        put_queue_max: 4,
        nvme: None,
    })
}

#[test]
fn longest_leading_run_and_exact_counts() {
    let s = store(16);
    let k = keys(5, 1);
    for (i, key) in k.iter().enumerate().take(3) {
        assert!(s.insert(*key, block(i as u8)));
    }
    // Block 4 cached but block 3 not: the run stops at 3.
    assert!(s.insert(k[4], block(4)));
    let hits = s.lookup(&k);
    assert_eq!(hits.len(), 3);
    for (i, h) in hits.iter().enumerate() {
        assert_eq!(&h[..], &[i as u8; 64][..]);
    }
    assert!(s.lookup(&keys(2, 99)).is_empty());
    let st = s.stats();
    assert_eq!(st.lookups, 2);
    assert_eq!(st.blocks_looked_up, 7);
    assert_eq!(st.host_hits, 3);
    assert_eq!(st.misses, 4);
    assert_eq!(st.cluster_hits, 0);
    assert_eq!(st.host_inserts, 4);
    assert_eq!(st.host_blocks, 4);
    assert_eq!(st.host_bytes, 256);
    assert_eq!(st.evictions, 0);
    assert!(!s.insert(k[0], vec![0u8; 63].into()), "wrong size refused");
    assert!(s.flush(Duration::from_millis(10)), "nothing queued without a cluster");
}

#[test]
fn evicts_least_recently_used_within_the_byte_bound() {
    let s = store(3);
    let k = keys(5, 2);
    for (i, key) in k.iter().enumerate().take(3) {
        s.insert(*key, block(i as u8));
    }
    // Touch block 0: block 1 is now the oldest.
    assert_eq!(s.lookup(&k[..1]).len(), 1);
    s.insert(k[3], block(3));
    assert!(s.contains(&k[0]));
    assert!(!s.contains(&k[1]), "oldest evicted");
    assert!(s.contains(&k[2]));
    assert!(s.contains(&k[3]));
    // Inserting an existing key refreshes it and evicts nothing.
    s.insert(k[2], block(2));
    s.insert(k[4], block(4));
    assert!(!s.contains(&k[0]), "k0 was the oldest after k2's refresh");
    let st = s.stats();
    assert_eq!(st.evictions, 2);
    assert_eq!(st.host_blocks, 3);
    assert_eq!(st.host_bytes, 3 * 64);
    // A zero-byte cache holds nothing.
    let z = store(0);
    z.insert(k[0], block(0));
    assert!(z.lookup(&k[..1]).is_empty());
    assert_eq!(z.stats().host_blocks, 0);
}

#[test]
fn handed_out_blocks_outlive_eviction() {
    let s = store(1);
    let k = keys(2, 3);
    s.insert(k[0], block(7));
    let held = s.lookup(&k[..1]);
    s.insert(k[1], block(8));
    assert!(!s.contains(&k[0]));
    assert_eq!(&held[0][..], &[7u8; 64][..]);
}

#[test]
fn get_exists_pin_unpin_evict() {
    let s = store(3);
    let k = keys(5, 4);
    for (i, key) in k.iter().enumerate().take(3) {
        assert!(s.insert(*key, block(i as u8)));
    }
    // Per-key get: holes do not end the answer.
    let g = s.get(&[k[0], k[3], k[2]]);
    assert_eq!(g.iter().map(Option::is_some).collect::<Vec<_>>(), [true, false, true]);
    assert_eq!(&g[2].as_ref().unwrap()[..], &[2u8; 64][..]);
    assert_eq!(s.exists(&[k[1], k[4]]), vec![Some(Located::Host), None], "exists names the tier");
    // Pin k1 (now the oldest): inserting two more evicts k0 and k2, never k1.
    assert_eq!(s.pin(&[k[1], k[4]]), vec![true, false], "an absent key cannot be pinned");
    assert_eq!(s.pin(&[k[1]]), vec![true], "pins nest");
    s.insert(k[3], block(3));
    s.insert(k[4], block(4));
    assert!(s.contains(&k[1]), "pinned block survives eviction");
    assert!(!s.contains(&k[0]) && !s.contains(&k[2]));
    assert!(!s.evict(&[k[1]])[0], "a pinned block is not evicted on request");
    let st = s.stats();
    assert_eq!((st.pins, st.pinned_blocks, st.host_blocks), (2, 1, 3));
    assert_eq!(s.unpin(&[k[1], k[0]]), vec![true, false]);
    assert_eq!(s.unpin(&[k[1]]), vec![true]);
    assert_eq!(s.unpin(&[k[1]]), vec![false], "no pin left");
    assert_eq!(s.evict(&[k[1], k[0]]), vec![true, false]);
    assert!(!s.contains(&k[1]));
    let st = s.stats();
    assert_eq!((st.pins, st.pinned_blocks, st.evicted_by_request), (0, 0, 1));
    // The failed pin of k4 looked it up too.
    assert_eq!((st.gets, st.get_hits), (4, 2));
    // With every byte pinned, an insert is refused (and counted), not forced in.
    let full = store(2);
    let k = keys(3, 5);
    full.insert(k[0], block(0));
    full.insert(k[1], block(1));
    assert_eq!(full.pin(&k[..2]), vec![true, true]);
    full.insert(k[2], block(2));
    assert!(!full.contains(&k[2]));
    assert!(full.contains(&k[0]) && full.contains(&k[1]));
    assert_eq!(full.stats().host_refused, 1);
}

// ---- The NVMe tier ----

/// A block whose bytes differ along it (a flipped byte anywhere changes the CRC).
fn nblock(i: u8) -> Arc<[u8]> {
    (0..64u8).map(|j| j.wrapping_mul(31) ^ i).collect::<Vec<u8>>().into()
}

fn nvme_store(
    dir: &tempfile::TempDir,
    host_blocks: usize,
    slots: u64,
    queue: usize,
) -> PrefixStore {
    PrefixStore::open(PrefixStoreConfig {
        host_bytes: host_blocks * 64,
        block_bytes: 64,
        put_queue_max: 4,
        nvme: Some(PrefixNvmeConfig {
            path: dir.path().join("prefix.nvme"),
            bytes: slots * NVME_ALIGN as u64,
            spill_queue_max: queue,
        }),
    })
    .expect("NVMe tier opens")
}

fn flush(s: &PrefixStore) {
    assert!(s.flush(Duration::from_secs(10)), "spills finish");
}

/// The slot `key` is written in.
fn slot_of(s: &PrefixStore, key: &BlockKey) -> u32 {
    s.nvme.as_ref().unwrap().state().map[key].slot
}

/// The payload bytes of `slot` in the file, read past the store.
fn file_bytes(dir: &tempfile::TempDir, slot: u32) -> Vec<u8> {
    let f = File::open(dir.path().join("prefix.nvme")).unwrap();
    let mut b = vec![0u8; 64];
    f.read_exact_at(&mut b, u64::from(slot) * NVME_ALIGN as u64).unwrap();
    b
}

#[test]
fn host_eviction_spills_to_nvme_and_a_hit_comes_back_identical() {
    let dir = tempfile::tempdir().unwrap();
    let s = nvme_store(&dir, 2, 8, 8);
    assert!(s.has_nvme());
    let len = std::fs::metadata(dir.path().join("prefix.nvme")).unwrap().len();
    assert_eq!(len, 8 * NVME_ALIGN as u64, "preallocated to its slots");
    let k = keys(5, 10);
    for (i, key) in k.iter().enumerate().take(3) {
        assert!(s.insert(*key, nblock(i as u8)));
    }
    flush(&s);
    let st = s.stats();
    assert_eq!((st.host_blocks, st.evictions), (2, 1));
    assert_eq!((st.nvme_spills, st.nvme_blocks, st.nvme_bytes), (1, 1, 64));
    assert_eq!(st.nvme_capacity_blocks, 8);
    assert!(!s.contains(&k[0]));
    // On the device, not only in memory: the file holds k0's bytes.
    assert_eq!(file_bytes(&dir, slot_of(&s, &k[0])), &nblock(0)[..]);
    assert_eq!(s.exists(&k[..1]), vec![Some(Located::Nvme)]);
    // A hit from NVMe: identical bytes, promoted into the host cache (evicting k1, which
    // is spilled in turn), still on NVMe.
    let g = s.get(&k[..1]);
    assert_eq!(g[0].as_deref(), Some(&nblock(0)[..]));
    assert!(s.contains(&k[0]), "promoted");
    flush(&s);
    let st = s.stats();
    assert_eq!((st.nvme_hits, st.get_hits, st.host_inserts), (1, 1, 4));
    assert_eq!((st.nvme_spills, st.nvme_blocks), (2, 2), "k1 spilled, k0 stays on NVMe");
    // k3 evicts k2 (written), k4 evicts k0 (already on NVMe: no second write).
    s.insert(k[3], nblock(3));
    s.insert(k[4], nblock(4));
    flush(&s);
    let st = s.stats();
    assert_eq!((st.nvme_spills, st.nvme_blocks, st.evictions), (3, 3, 4));
    assert_eq!(
        s.exists(&k),
        vec![
            Some(Located::Nvme),
            Some(Located::Nvme),
            Some(Located::Nvme),
            Some(Located::Host),
            Some(Located::Host)
        ]
    );
    for (i, key) in k.iter().enumerate().take(3) {
        assert_eq!(s.get(&[*key])[0].as_deref(), Some(&nblock(i as u8)[..]), "block {i}");
    }
    assert_eq!((s.stats().integrity_misses, s.stats().nvme_errors), (0, 0));
}

#[test]
fn a_full_nvme_tier_reuses_its_least_recently_used_slot() {
    let dir = tempfile::tempdir().unwrap();
    let s = nvme_store(&dir, 1, 3, 8);
    let k = keys(5, 11);
    // k0..k3 are evicted in order; the 4th spill takes k0's slot.
    for (i, key) in k.iter().enumerate() {
        s.insert(*key, nblock(i as u8));
    }
    flush(&s);
    let st = s.stats();
    assert_eq!((st.nvme_spills, st.nvme_evictions, st.nvme_blocks), (4, 1, 3));
    assert_eq!(st.nvme_bytes, 3 * 64);
    assert_eq!(
        s.exists(&k),
        vec![
            None,
            Some(Located::Nvme),
            Some(Located::Nvme),
            Some(Located::Nvme),
            Some(Located::Host)
        ]
    );
    // Reading k1 makes it the newest on NVMe; promoting it evicts k4 from the host,
    // whose spill reuses the oldest slot now: k2's.
    assert_eq!(s.get(&k[1..2])[0].as_deref(), Some(&nblock(1)[..]));
    flush(&s);
    let st = s.stats();
    assert_eq!((st.nvme_spills, st.nvme_evictions, st.nvme_blocks), (5, 2, 3));
    assert_eq!(
        s.exists(&k),
        vec![None, Some(Located::Host), None, Some(Located::Nvme), Some(Located::Nvme)]
    );
    assert_eq!(s.get(&k[4..])[0].as_deref(), Some(&nblock(4)[..]));
    assert_eq!(s.get(&k[..1]), vec![None]);
}

#[test]
fn a_corrupted_or_unreadable_slot_is_a_counted_miss_and_leaves_the_tier() {
    let dir = tempfile::tempdir().unwrap();
    let s = nvme_store(&dir, 1, 4, 8);
    let k = keys(3, 12);
    s.insert(k[0], nblock(0));
    s.insert(k[1], nblock(1));
    flush(&s);
    // One byte of k0's payload flipped behind the store's back.
    let slot = slot_of(&s, &k[0]);
    let f = std::fs::OpenOptions::new().write(true).open(dir.path().join("prefix.nvme")).unwrap();
    let off = u64::from(slot) * NVME_ALIGN as u64 + 17;
    f.write_all_at(&[nblock(0)[17] ^ 0x40], off).unwrap();
    f.sync_all().unwrap();
    assert!(s.lookup(&k[..1]).is_empty(), "never handed out");
    let st = s.stats();
    assert_eq!((st.integrity_misses, st.nvme_hits, st.misses), (1, 0, 1));
    assert_eq!(st.nvme_blocks, 0, "dropped from the index");
    assert_eq!(s.exists(&k[..1]), vec![None]);
    assert_eq!(s.get(&k[..1]), vec![None], "not read again");
    assert_eq!(s.stats().integrity_misses, 1);
    // An I/O error (the file cut short under the tier) is a miss too, counted apart.
    s.insert(k[2], nblock(2));
    flush(&s);
    assert_eq!(s.exists(&k[1..2]), vec![Some(Located::Nvme)]);
    f.set_len(0).unwrap();
    assert_eq!(s.get(&k[1..2]), vec![None]);
    let st = s.stats();
    assert_eq!((st.nvme_errors, st.integrity_misses, st.nvme_hits), (1, 1, 0));
    assert_eq!((st.nvme_blocks, st.get_hits), (0, 0));
    // The tier goes on working (writes extend the file again).
    s.insert(k[0], nblock(0));
    flush(&s);
    assert_eq!(s.get(&k[2..])[0].as_deref(), Some(&nblock(2)[..]));
}

#[test]
fn exists_names_nvme_and_evict_removes_from_both_tiers() {
    let dir = tempfile::tempdir().unwrap();
    let s = nvme_store(&dir, 2, 4, 8);
    let k = keys(4, 13);
    for (i, key) in k.iter().enumerate().take(3) {
        s.insert(*key, nblock(i as u8));
    }
    // k0 back from NVMe into the host (it stays on NVMe); k1 spilled.
    assert!(s.get(&k[..1])[0].is_some());
    flush(&s);
    assert_eq!(
        s.exists(&k),
        vec![Some(Located::Host), Some(Located::Nvme), Some(Located::Host), None]
    );
    assert_eq!(s.stats().nvme_blocks, 2);
    // A pinned block stays on both tiers.
    assert_eq!(s.pin(&k[..1]), vec![true]);
    assert_eq!(s.evict(&k[..1]), vec![false]);
    assert_eq!(s.stats().nvme_blocks, 2);
    assert_eq!(s.unpin(&k[..1]), vec![true]);
    assert_eq!(s.evict(&[k[0], k[1], k[3]]), vec![true, true, false]);
    assert_eq!(s.exists(&k), vec![None, None, Some(Located::Host), None]);
    let st = s.stats();
    assert_eq!((st.nvme_blocks, st.nvme_bytes, st.evicted_by_request), (0, 0, 2));
    assert_eq!(s.get(&k[..2]), vec![None, None]);
    // A spill still queued is cancelled by evict (and the freed slots are reused).
    s.nvme.as_ref().unwrap().set_paused(true);
    s.insert(k[0], nblock(0));
    s.insert(k[1], nblock(1));
    assert_eq!(s.exists(&k[2..3]), vec![Some(Located::Nvme)], "queued counts as NVMe");
    assert_eq!(s.evict(&k[2..3]), vec![true]);
    s.nvme.as_ref().unwrap().set_paused(false);
    flush(&s);
    assert_eq!(s.exists(&k[2..3]), vec![None]);
    let st = s.stats();
    assert_eq!((st.nvme_blocks, st.nvme_spills, st.evicted_by_request), (0, 2, 3));
}

#[test]
fn lookup_runs_across_host_and_nvme() {
    let dir = tempfile::tempdir().unwrap();
    let s = nvme_store(&dir, 4, 8, 8);
    let k = keys(6, 14);
    let filler = keys(4, 15);
    // k1, k3 spilled by four fillers, which are then evicted from the host: the host
    // holds k0 and k2 with room for two more, NVMe holds k1 and k3.
    s.insert(k[1], nblock(1));
    s.insert(k[3], nblock(3));
    for (i, f) in filler.iter().enumerate() {
        s.insert(*f, nblock(100 + i as u8));
    }
    flush(&s);
    assert_eq!(s.evict(&filler), vec![true; 4]);
    s.insert(k[0], nblock(0));
    s.insert(k[2], nblock(2));
    flush(&s);
    let before = s.stats();
    assert_eq!(
        s.exists(&k[..5]),
        vec![
            Some(Located::Host),
            Some(Located::Nvme),
            Some(Located::Host),
            Some(Located::Nvme),
            None
        ]
    );
    let hits = s.lookup(&k[..5]);
    assert_eq!(hits.len(), 4, "host, NVMe, host, NVMe, then the first miss");
    for (i, h) in hits.iter().enumerate() {
        assert_eq!(&h[..], &nblock(i as u8)[..], "block {i}");
    }
    let st = s.stats();
    assert_eq!(st.host_hits - before.host_hits, 2);
    assert_eq!(st.nvme_hits - before.nvme_hits, 2);
    assert_eq!(st.misses - before.misses, 1);
    assert_eq!(st.host_blocks, 4, "both NVMe hits promoted");
    // A leading miss ends the run, whatever follows; an NVMe miss ends it too.
    assert!(s.lookup(&[k[5], k[0]]).is_empty());
    assert_eq!(s.evict(&k[1..2]), vec![true]);
    assert_eq!(s.lookup(&k[..4]).len(), 1);
    let st2 = s.stats();
    assert_eq!(st2.misses - st.misses, 2 + 3);
    assert_eq!(st2.nvme_hits, st.nvme_hits);
}

#[test]
fn pin_reads_an_nvme_block_in_and_a_block_the_host_refuses_goes_to_nvme() {
    let dir = tempfile::tempdir().unwrap();
    let s = nvme_store(&dir, 1, 4, 8);
    let k = keys(3, 19);
    s.insert(k[0], nblock(0));
    s.insert(k[1], nblock(1));
    flush(&s);
    assert_eq!(s.exists(&k[..2]), vec![Some(Located::Nvme), Some(Located::Host)]);
    assert_eq!(s.pin(&k[..1]), vec![true], "read in from NVMe, then pinned");
    flush(&s);
    assert_eq!(s.exists(&k[..2]), vec![Some(Located::Host), Some(Located::Nvme)]);
    let st = s.stats();
    assert_eq!((st.nvme_hits, st.pinned_blocks, st.nvme_spills), (1, 1, 2));
    // The host cache is all pinned: k2 is refused there and written to NVMe instead.
    assert!(s.insert(k[2], nblock(2)));
    flush(&s);
    let st = s.stats();
    assert_eq!((st.host_refused, st.nvme_spills, st.nvme_blocks), (1, 3, 3));
    assert_eq!(s.exists(&k[2..]), vec![Some(Located::Nvme)]);
    assert_eq!(s.get(&k[2..])[0].as_deref(), Some(&nblock(2)[..]));
    assert_eq!(s.unpin(&k[..1]), vec![true]);
}

#[test]
fn a_full_spill_queue_drops_and_counts() {
    let dir = tempfile::tempdir().unwrap();
    let s = nvme_store(&dir, 1, 8, 2);
    let k = keys(5, 16);
    // A device that takes nothing: two spills wait, the next two are dropped.
    s.nvme.as_ref().unwrap().set_paused(true);
    for (i, key) in k.iter().enumerate() {
        s.insert(*key, nblock(i as u8));
    }
    let st = s.stats();
    assert_eq!((st.evictions, st.nvme_spills_dropped, st.nvme_spills), (4, 2, 0));
    assert!(!s.flush(Duration::from_millis(20)), "spills are still pending");
    // Waiting spills are found (served from the queue).
    assert_eq!(s.exists(&k[..4]), vec![Some(Located::Nvme), Some(Located::Nvme), None, None]);
    s.nvme.as_ref().unwrap().set_paused(false);
    flush(&s);
    let st = s.stats();
    assert_eq!((st.nvme_spills, st.nvme_blocks, st.nvme_spills_dropped), (2, 2, 2));
    assert_eq!(s.get(&k[..1])[0].as_deref(), Some(&nblock(0)[..]));
    // Dropping a store with spills queued and its writer stalled does not hang.
    s.nvme.as_ref().unwrap().set_paused(true);
    s.insert(k[2], nblock(2));
    s.insert(k[3], nblock(3));
    drop(s);
}

#[test]
fn nvme_setup_errors_name_the_file_and_new_runs_without_the_tier() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = |path: PathBuf, bytes: u64| PrefixStoreConfig {
        host_bytes: 64,
        block_bytes: 64,
        put_queue_max: 4,
        nvme: Some(PrefixNvmeConfig::new(path, bytes)),
    };
    let missing = dir.path().join("no-such-dir").join("f");
    let e = PrefixStore::open(cfg(missing.clone(), 1 << 20)).unwrap_err();
    assert!(e.to_string().contains("no-such-dir"), "{e}");
    let e = PrefixStore::open(cfg(dir.path().join("small"), 4095)).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    assert!(e.to_string().contains("no slot of 4096 bytes"), "{e}");
    let s = PrefixStore::new(cfg(missing, 1 << 20));
    assert!(!s.has_nvme());
    assert_eq!(s.nvme_direct_io(), None);
    assert!(s.insert(keys(1, 17)[0], nblock(1)));
    assert_eq!(s.stats().nvme_capacity_blocks, 0);
}

#[test]
fn nvme_tier_on_tmpfs_round_trips() {
    // tmpfs may refuse O_DIRECT (then buffered I/O); either way blocks round-trip.
    let shm = std::path::Path::new("/dev/shm");
    if !shm.is_dir() {
        return;
    }
    let dir = tempfile::tempdir_in(shm).unwrap();
    let s = nvme_store(&dir, 1, 2, 4);
    assert!(s.nvme_direct_io().is_some());
    let k = keys(2, 18);
    s.insert(k[0], nblock(0));
    s.insert(k[1], nblock(1));
    flush(&s);
    assert_eq!(s.get(&k[..1])[0].as_deref(), Some(&nblock(0)[..]));
    assert_eq!(s.stats().nvme_hits, 1);
}
