//! The one place the ring's synchronisation primitives come from.
//!
//! Production builds use `core`'s atomics. With `RUSTFLAGS="--cfg loom"` the same code is
//! compiled against loom's instrumented atomics so the model checker can explore every
//! interleaving (see `tests/loom.rs`). Nothing else in the crate names `std::sync::atomic`.

// `AtomicU64` is used only by the shared-memory ring, which loom builds leave out.
#[cfg(loom)]
#[allow(unused_imports)]
pub(crate) use loom::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicUsize, Ordering};
#[cfg(loom)]
pub(crate) use loom::{hint::spin_loop, thread::yield_now};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicUsize, Ordering};
#[cfg(not(loom))]
pub(crate) use std::{hint::spin_loop, thread::yield_now};
