//! The card: everything a host and an FPGA (or the software model) agree on, and the host's
//! side of it. Nothing here knows what ITCH is except the engine's `OP_ITCH`, which calls into
//! [`fastlane_market`].
//!
//! - [`abi`]: the register map, descriptor and completion layouts, op codes (the contract
//!   with hardware; `docs/fpga-abi.md` is its prose form).
//! - [`dma`]: [`DmaBuffer`], page-aligned memory the card reads and writes by DMA.
//! - [`soft`]: the [`Card`] trait, [`HostQueue`] (the driver side of the rings over any
//!   [`Bar`]: [`SoftBar`] or a mapped [`MmioBar`]) and [`SoftCard`], the software model (an
//!   engine thread that honours doorbells, reads descriptors, runs the op and writes
//!   completions).
//! - [`clock`]: the card clock ([`CardClock::now_ns`]), callable directly by the journal
//!   without a ring round trip.
//! - [`error`]: [`CardError`], used by `dma` and `soft` alike.
//!
//! Inside the module dependencies point one way: `abi`, `clock` ← `error` ← `dma` ← `soft`.

pub mod abi;
pub mod clock;
pub mod dma;
pub mod error;
pub mod soft;

pub use clock::CardClock;
pub use dma::DmaBuffer;
pub use error::CardError;
pub use soft::{
    Bar, Card, EngineReport, HostQueue, MmioBar, SoftBar, SoftCard, SoftCardConfig,
    ITCH_EVENTS_PER_SLOT, ITCH_STAGING_BYTES,
};
