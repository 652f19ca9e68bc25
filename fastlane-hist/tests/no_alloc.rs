//! The hot path allocates nothing: `record*` and `take_interval` after construction.
//! Only the test's own thread is counted ([`CountingAlloc`]).

use std::time::{Duration, Instant};

use fastlane_hist::LatencyRecorder;
use fastlane_util::CountingAlloc;

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

#[test]
fn recording_and_rotating_do_not_allocate() {
    CountingAlloc::count_this_thread();
    let at_start = CountingAlloc::allocations();
    let mut rec = LatencyRecorder::with_max(10_000_000_000).unwrap();
    let t0 = Instant::now();
    let before = CountingAlloc::allocations();
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
    let after = CountingAlloc::allocations();
    assert_eq!(after - before, 0, "allocations on the record path");
    assert_eq!(total, 20 * 10_008);
    assert_eq!(rec.total().len(), total);
    assert_eq!(rec.overflow_count_total(), 20);
}
