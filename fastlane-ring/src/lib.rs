//! Lock-free single-producer/single-consumer rings.
//!
//! - [`spsc`]: a typed ring between two threads of one process, `channel::<T>(capacity)`.
//! - [`shm`]: a byte ring of variable-length records in a shared mapping, between two
//!   processes (or threads) that may not trust each other.
//! - [`WaitStrategy`]: how the blocking variants wait (spin, yield, then a futex).
//!
//! What this crate does not do: more than one producer or consumer per ring, allocation after
//! construction, or any syscall in a `try_*` operation.
// The shared-memory ring reads a peer's memory: a panic here is a peer taking us down.
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

#[cfg(not(loom))]
pub mod shm;
pub mod spsc;
pub(crate) mod sync;
mod wait;

pub use wait::WaitStrategy;
