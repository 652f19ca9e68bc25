//! [`CountingAlloc`]: a global allocator for the "the hot path allocates nothing" tests. It
//! forwards every call to the system allocator and counts the allocations (and reallocations)
//! of one thread, the one that called [`CountingAlloc::count_this_thread`]: the test harness's
//! own threads may allocate while a test runs, and in a loaded suite they do.
//!
//! ```ignore
//! #[global_allocator]
//! static GLOBAL: fastlane_util::CountingAlloc = fastlane_util::CountingAlloc;
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Allocations and reallocations by the counted thread.
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

/// The counted thread's `pthread_self` (0: none).
static COUNTED: AtomicUsize = AtomicUsize::new(0);

fn this_thread() -> usize {
    // SAFETY: pthread_self has no preconditions, cannot fail and does not allocate.
    unsafe { libc::pthread_self() as usize }
}

/// The counting allocator (see the module docs).
#[derive(Debug, Clone, Copy, Default)]
pub struct CountingAlloc;

impl CountingAlloc {
    /// From now on, the calling thread's allocations are the ones counted.
    pub fn count_this_thread() {
        COUNTED.store(this_thread(), Ordering::Relaxed);
    }

    /// Allocations and reallocations the counted thread made so far.
    pub fn allocations() -> u64 {
        ALLOCATIONS.load(Ordering::Relaxed)
    }

    fn count() {
        if COUNTED.load(Ordering::Relaxed) == this_thread() {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
    }
}

// SAFETY: every call is forwarded to the system allocator unchanged; only counts are kept.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        CountingAlloc::count();
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, which we pass on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` through this allocator with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        CountingAlloc::count();
        // SAFETY: as for `alloc` and `dealloc`; the contract is passed on unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}
