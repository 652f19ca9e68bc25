//! The VFIO NVMe driver's check, run inside a QEMU guest against the emulated controller (see
//! `tests/vm/guest-vfio.sh` and `tests/vfio_guest.rs`). Not a tool for real disks: it
//! overwrites the first 64 MiB.
//!
//! `vfio_guest check BDF`: identify; write and read back patterns of 4 KiB to 1 MiB (zero copy
//! from DMA buffers, scattered pages, and bounced heap buffers at odd addresses); flush;
//! deallocate and write-zeroes that read back as zeroes; two queue pairs on two threads at
//! once; typed errors for bad requests. Prints
//!
//! - `VFIO-INFO key=value ...`
//! - `VFIO-EXPECT pattern OFFSET LEN SEED` / `VFIO-EXPECT zero OFFSET LEN`: what the disk must
//!   hold afterwards (applied in order), for the host to compare with the backing file;
//! - `VFIO-STEP name ms`, and `VFIO-OK` at the end. Exits non-zero on the first failure.

use std::process::ExitCode;
use std::time::Instant;

use fastlane_block::{
    BlockDevice, BlockError, BlockOp, BlockQueue, BlockRequest, Completion, Segment,
};
use fastlane_nvme::{DmaBuffer, NvmeDevice, NvmeOptions};
use memmap2::{MmapOptions, MmapRaw};

use fastlane_util::pattern;

type Res<T> = Result<T, String>;

/// Submit one request and wait for it (bounded by the driver's command timeout).
fn run1(q: &mut dyn BlockQueue, op: BlockOp, offset: u64, len: u64, segs: &[Segment]) -> Res<u32> {
    let req = BlockRequest { op, offset, len, segments: segs, tag: 0xf1 };
    // SAFETY: the callers' segments point into buffers they own and do not touch until this
    // function returns, which is after the completion was drained.
    unsafe { q.submit(req) }.map_err(|_| "queue full with nothing in flight".to_string())?;
    q.kick().map_err(|e| e.to_string())?;
    let mut out = [Completion::EMPTY; 1];
    loop {
        if q.complete(&mut out) == 1 {
            assert_eq!(out[0].tag, 0xf1);
            return out[0].result.map_err(|e| format!("{op:?} at {offset} len {len}: {e}"));
        }
        q.wait(None).map_err(|e| e.to_string())?;
    }
}

fn seg(ptr: *mut u8, len: usize) -> Segment {
    Segment { addr: ptr, len: len as u32 }
}

fn expect_pattern(offset: u64, len: usize, seed: u64) {
    println!("VFIO-EXPECT pattern {offset} {len} {seed}");
}

fn check_equal(what: &str, got: &[u8], want: &[u8]) -> Res<()> {
    if got == want {
        return Ok(());
    }
    let first = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
    Err(format!("{what}: mismatch at byte {first} of {}", want.len()))
}

fn dma_read(buf: &DmaBuffer, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    buf.read_at(0, &mut v);
    v
}

fn step<T>(name: &str, f: impl FnOnce() -> Res<T>) -> Res<T> {
    let t = Instant::now();
    let r = f();
    match &r {
        Ok(_) => println!("VFIO-STEP {name} {}", t.elapsed().as_millis()),
        Err(e) => println!("VFIO-FAIL {name}: {e}"),
    }
    r
}

const MIB: u64 = 1 << 20;

fn check(bdf: &str) -> Res<()> {
    let dev = step("open", || {
        NvmeDevice::open(bdf.parse().map_err(|e| format!("{e}"))?, NvmeOptions::default())
            .map_err(|e| format!("{e} ({e:?})"))
    })?;
    let id = dev.controller();
    let ns = dev.namespace();
    let info = dev.info();
    println!(
        "VFIO-INFO model={:?} serial={:?} fw={:?} mdts={} oncs={:#x} vwc={} nsze={} block={} \
         max_transfer={} dstrd_bytes={} discard={} write_zeroes={}",
        id.model,
        id.serial,
        id.firmware,
        id.mdts,
        id.oncs,
        id.vwc,
        ns.nsze,
        ns.block_size,
        dev.max_transfer_bytes(),
        dev.doorbell_stride_bytes(),
        info.discard,
        info.write_zeroes
    );
    if info.size_bytes < 64 * MIB {
        return Err(format!("disk too small: {}", info.size_bytes));
    }
    let mut q = dev.open_queue(32).map_err(|e| e.to_string())?;
    let q = q.as_mut();
    let wbuf = dev.alloc_dma(2 << 20).map_err(|e| e.to_string())?;
    let rbuf = dev.alloc_dma(2 << 20).map_err(|e| e.to_string())?;

    // 1. Zero copy from DMA buffers, one segment: sizes 4 KiB .. 1 MiB (PRP1 only, PRP2, PRP
    //    lists, split commands when MDTS is smaller).
    step("zero_copy_sizes", || {
        let mut off = 0u64;
        for (i, kib) in [4usize, 8, 12, 16, 64, 128, 256, 512, 1024].into_iter().enumerate() {
            let len = kib << 10;
            let seed = 100 + i as u64;
            let mut data = vec![0u8; len];
            pattern::fill(seed, off, &mut data);
            wbuf.write_at(0, &data);
            run1(q, BlockOp::Write, off, 0, &[seg(wbuf.as_ptr(), len)])?;
            expect_pattern(off, len, seed);
            rbuf.write_at(0, &vec![0xee; len]);
            run1(q, BlockOp::Read, off, 0, &[seg(rbuf.as_ptr(), len)])?;
            check_equal(&format!("read back {kib} KiB"), &dma_read(&rbuf, len), &data)?;
            off += len as u64;
        }
        Ok(())
    })?;

    // 2. 1 MiB as 256 scattered pages (reverse order in the DMA buffer): a PRP list of
    //    non-contiguous pages; plus a 512-byte-offset start (PRP1 with an offset).
    step("scattered_pages", || {
        let off = 8 * MIB;
        let len = 1 << 20;
        let seed = 200;
        let mut data = vec![0u8; len];
        pattern::fill(seed, off, &mut data);
        let pages = len / 4096;
        let wsegs: Vec<Segment> = (0..pages)
            .map(|k| seg(wbuf.as_ptr().wrapping_add((pages - 1 - k) * 4096), 4096))
            .collect();
        for k in 0..pages {
            wbuf.write_at((pages - 1 - k) * 4096, &data[k * 4096..(k + 1) * 4096]);
        }
        run1(q, BlockOp::Write, off, 0, &wsegs)?;
        expect_pattern(off, len, seed);
        let rsegs: Vec<Segment> = (0..pages)
            .map(|k| seg(rbuf.as_ptr().wrapping_add((k * 7 % pages) * 4096), 4096))
            .collect();
        run1(q, BlockOp::Read, off, 0, &rsegs)?;
        let mut got = vec![0u8; len];
        for k in 0..pages {
            rbuf.read_at((k * 7 % pages) * 4096, &mut got[k * 4096..(k + 1) * 4096]);
        }
        check_equal("scattered read back", &got, &data)?;
        // Unaligned start inside the buffer (PRP1 offset 512), 64 KiB + 512.
        let len2 = (64 << 10) + 512;
        let off2 = 10 * MIB;
        let mut d2 = vec![0u8; len2];
        pattern::fill(201, off2, &mut d2);
        wbuf.write_at(512, &d2);
        run1(q, BlockOp::Write, off2, 0, &[seg(wbuf.as_ptr().wrapping_add(512), len2)])?;
        expect_pattern(off2, len2, 201);
        run1(q, BlockOp::Read, off2, 0, &[seg(rbuf.as_ptr().wrapping_add(1024), len2)])?;
        let mut got2 = vec![0u8; len2];
        rbuf.read_at(1024, &mut got2);
        check_equal("PRP1-offset read back", &got2, &d2)
    })?;

    // 3. Bounced: heap memory the device cannot reach, at an odd address, in three uneven
    //    segments (not PRP-compatible either way).
    step("bounce", || {
        for (i, len) in [4096usize, 12288, 1 << 20].into_iter().enumerate() {
            let off = 12 * MIB + (i as u64) * 2 * MIB;
            let seed = 300 + i as u64;
            let mut storage = vec![0u8; len + 1];
            let data = &mut storage[1..]; // odd address: the allocator aligns to 8 or more
            pattern::fill(seed, off, data);
            let a = 1000.min(len / 2);
            let p = data.as_mut_ptr();
            let segs =
                [seg(p, a), seg(p.wrapping_add(a), 24), seg(p.wrapping_add(a + 24), len - a - 24)];
            run1(q, BlockOp::Write, off, 0, &segs)?;
            expect_pattern(off, len, seed);
            let mut back = vec![0u8; len + 3];
            let bp = back.as_mut_ptr().wrapping_add(3);
            let rsegs = [seg(bp, len - 512), seg(bp.wrapping_add(len - 512), 512)];
            run1(q, BlockOp::Read, off, 0, &rsegs)?;
            check_equal(&format!("bounced {len}"), &back[3..], &data[..len])?;
        }
        Ok(())
    })?;

    // 3b. External memory (what the vhost-user memory-table hook maps): an anonymous mapping
    //     registered with sync_external, used zero copy, re-keyed (remapped), then removed.
    step("external", || {
        let len = 1usize << 20;
        // A private anonymous mapping, unmapped (dropped) below after the device mapping is gone.
        let map = MmapRaw::from(MmapOptions::new().len(len).map_anon().map_err(|e| e.to_string())?);
        let p = map.as_mut_ptr();
        let off = 26 * MIB;
        let mut data = vec![0u8; len];
        pattern::fill(600, off, &mut data);
        for key in [1u64, 2] {
            // SAFETY: `p..p+len` stays mapped and is only touched through raw copies until
            // `sync_external(&[])` below removes it.
            unsafe { dev.sync_external(&[(p, len, key)]) }.map_err(|e| e.to_string())?;
            let maps = dev.mappings();
            if !maps.iter().any(|m| m.host == p as usize && m.len == len) {
                return Err(format!("external region not in the mappings: {maps:?}"));
            }
            // SAFETY: in bounds of our mapping; no request in flight.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, len) };
            run1(q, BlockOp::Write, off, 0, &[seg(p, len)])?;
            // SAFETY: as above.
            unsafe { std::ptr::write_bytes(p, 0xee, len) };
            run1(q, BlockOp::Read, off, 0, &[seg(p, len)])?;
            let mut got = vec![0u8; len];
            // SAFETY: as above; the read has completed.
            unsafe { std::ptr::copy_nonoverlapping(p, got.as_mut_ptr(), len) };
            check_equal(&format!("external key {key}"), &got, &data)?;
        }
        expect_pattern(off, len, 600);
        // SAFETY: an empty list.
        unsafe { dev.sync_external(&[]) }.map_err(|e| e.to_string())?;
        if dev.mappings().iter().any(|m| m.host == p as usize) {
            return Err("external region still mapped".into());
        }
        // The same memory now goes through the bounce pages.
        run1(q, BlockOp::Read, off, 0, &[seg(p, len)])?;
        // The device mapping is gone: nothing uses our mapping any more.
        drop(map);
        Ok(())
    })?;

    step("flush", || run1(q, BlockOp::Flush, 0, 0, &[]).map(|_| ()))?;

    // 4. Deallocate and Write Zeroes: written first, then must read back as zeroes.
    let zero_checks =
        |q: &mut dyn BlockQueue, op: BlockOp, off: u64, len: usize, seed: u64| -> Res<()> {
            let mut data = vec![0u8; len];
            pattern::fill(seed, off, &mut data);
            wbuf.write_at(0, &data);
            run1(q, BlockOp::Write, off, 0, &[seg(wbuf.as_ptr(), len)])?;
            run1(q, op, off, len as u64, &[])?;
            println!("VFIO-EXPECT zero {off} {len}");
            rbuf.write_at(0, &vec![0xee; len]);
            run1(q, BlockOp::Read, off, 0, &[seg(rbuf.as_ptr(), len)])?;
            check_equal(&format!("{op:?} reads back zeroes"), &dma_read(&rbuf, len), &vec![0; len])
        };
    if info.discard {
        step("deallocate", || zero_checks(q, BlockOp::Discard, 20 * MIB, 1 << 20, 400))?;
    } else {
        println!("VFIO-INFO deallocate=unsupported");
    }
    if info.write_zeroes {
        step("write_zeroes", || {
            zero_checks(q, BlockOp::WriteZeroes { unmap: false }, 22 * MIB, 256 << 10, 401)?;
            zero_checks(q, BlockOp::WriteZeroes { unmap: true }, 23 * MIB, 64 << 10, 402)
        })?;
    } else {
        println!("VFIO-INFO write_zeroes=unsupported");
    }

    // 5. Typed errors for bad requests; the queue keeps working after them.
    step("errors", || {
        let r = run1(q, BlockOp::Read, info.size_bytes, 0, &[seg(rbuf.as_ptr(), 4096)]);
        if !r.as_ref().is_err_and(|e| e.contains("out of bounds")) {
            return Err(format!("read past the end: {r:?}"));
        }
        let r = run1(q, BlockOp::Write, 100, 0, &[seg(rbuf.as_ptr(), 512)]);
        if !r.as_ref().is_err_and(|e| e.contains("misaligned")) {
            return Err(format!("misaligned write: {r:?}"));
        }
        let req = BlockRequest {
            op: BlockOp::Read,
            offset: info.size_bytes - 4096,
            len: 0,
            segments: &[seg(rbuf.as_ptr(), 8192)],
            tag: 9,
        };
        // SAFETY: rejected before reaching the device (out of range); rbuf outlives it.
        unsafe { q.submit(req) }.map_err(|_| "full")?;
        let mut out = [Completion::EMPTY; 1];
        while q.complete(&mut out) == 0 {
            q.wait(None).map_err(|e| e.to_string())?;
        }
        if !matches!(out[0].result, Err(BlockError::OutOfRange { .. })) {
            return Err(format!("straddling the end: {:?}", out[0]));
        }
        run1(q, BlockOp::Read, 0, 0, &[seg(rbuf.as_ptr(), 4096)]).map(|_| ())
    })?;

    // 6. Two queue pairs on two threads at once, queue depth 8 each, 64 KiB writes over 4 MiB
    //    each, then read back.
    step("two_queues", || {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..2u64)
                .map(|t| {
                    let dev = &dev;
                    s.spawn(move || worker(dev, t))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().map_err(|_| "worker panicked".to_string())?)
                .collect::<Res<Vec<()>>>()
        })?;
        Ok(())
    })?;

    step("flush", || run1(q, BlockOp::Flush, 0, 0, &[]).map(|_| ()))?;
    Ok(())
}

/// One thread: its own queue pair, 64 writes of 64 KiB with up to 8 in flight, then reads.
fn worker(dev: &NvmeDevice, t: u64) -> Res<()> {
    const CHUNK: usize = 64 << 10;
    const COUNT: usize = 64;
    const QD: usize = 8;
    let base = 32 * MIB + t * 8 * MIB;
    let seed = 500 + t;
    let mut q = dev.open_nvme_queue(16).map_err(|e| e.to_string())?;
    let buf = dev.alloc_dma(CHUNK * QD).map_err(|e| e.to_string())?;
    let mut data = vec![0u8; CHUNK * COUNT];
    pattern::fill(seed, base, &mut data);
    for write in [true, false] {
        let mut next = 0usize;
        let mut done = 0usize;
        let mut slot_of = [usize::MAX; QD];
        let mut out = [Completion::EMPTY; QD];
        while done < COUNT {
            while next < COUNT && q.in_flight() < QD as u32 {
                let slot = slot_of.iter().position(|&s| s == usize::MAX).expect("free slot");
                slot_of[slot] = next;
                let ptr = buf.as_ptr().wrapping_add(slot * CHUNK);
                if write {
                    buf.write_at(slot * CHUNK, &data[next * CHUNK..(next + 1) * CHUNK]);
                }
                let op = if write { BlockOp::Write } else { BlockOp::Read };
                let segs = [seg(ptr, CHUNK)];
                let req = BlockRequest {
                    op,
                    offset: base + (next * CHUNK) as u64,
                    len: 0,
                    segments: &segs,
                    tag: slot as u64,
                };
                // SAFETY: slot `slot` of `buf` belongs to this request until its completion
                // (slot_of marks it busy); `buf` outlives the queue's use of it.
                unsafe { q.submit(req) }.map_err(|_| "queue full below depth")?;
                next += 1;
            }
            q.kick().map_err(|e| e.to_string())?;
            let n = q.complete(&mut out);
            if n == 0 {
                q.wait(None).map_err(|e| e.to_string())?;
            }
            for c in &out[..n] {
                c.result.map_err(|e| format!("thread {t}: {e}"))?;
                let slot = c.tag as usize;
                let i = slot_of[slot];
                if !write {
                    let mut got = vec![0u8; CHUNK];
                    buf.read_at(slot * CHUNK, &mut got);
                    check_equal(
                        &format!("thread {t} chunk {i}"),
                        &got,
                        &data[i * CHUNK..(i + 1) * CHUNK],
                    )?;
                }
                slot_of[slot] = usize::MAX;
                done += 1;
            }
        }
        if write {
            expect_pattern(base, CHUNK * COUNT, seed);
        }
    }
    println!("VFIO-INFO thread={t} qid={} spurious={}", q.qid(), q.spurious_completions());
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1..).unwrap_or_default() {
        [cmd, bdf] if cmd == "check" => match check(bdf) {
            Ok(()) => {
                println!("VFIO-OK");
                ExitCode::SUCCESS
            }
            Err(e) => {
                println!("VFIO-FAILED {e}");
                ExitCode::FAILURE
            }
        },
        _ => {
            eprintln!(
                "usage: vfio_guest check BDF   (overwrites the first 64 MiB of the namespace)"
            );
            ExitCode::from(2)
        }
    }
}
