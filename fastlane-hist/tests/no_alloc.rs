//! The hot path allocates nothing: `record*` and `take_interval` after construction.
//! (One test in this binary, so no other thread allocates while it counts.)

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use fastlane_hist::LatencyRecorder;

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, which we pass on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` through `alloc` above with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as for `alloc` and `dealloc`; the contract is passed on unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn recording_and_rotating_do_not_allocate() {
    let at_start = ALLOCATIONS.load(Ordering::Relaxed);
    let mut rec = LatencyRecorder::with_max(10_000_000_000).unwrap();
    let t0 = Instant::now();
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    assert!(before - at_start >= 3, "the counter sees the three histograms allocated");
    let mut total = 0;
    for round in 0..20u64 {
        for v in 0..10_000u64 {
            rec.record(v * 997 + round);
        }
        rec.record(u64::MAX); // overflow path
        rec.record_n(123, 5);
        rec.record_duration(Duration::from_micros(round));
        rec.record_since(t0);
        let interval = rec.take_interval();
        total += interval.histogram.len();
    }
    let after = ALLOCATIONS.load(Ordering::Relaxed);
    assert_eq!(after - before, 0, "allocations on the record path");
    assert_eq!(total, 20 * 10_008);
    assert_eq!(rec.total().len(), total);
    assert_eq!(rec.overflow_count_total(), 20);
}
