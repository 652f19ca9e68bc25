//! FastLane's preprocessing card: the interface an FPGA will implement, a software model
//! behind it, and the operations it runs ([`mod@card`], `src/card/`): the ABI ([`card::abi`]:
//! register map, descriptor and completion layouts, op codes; `docs/fpga-abi.md` is its prose
//! form), DMA memory ([`card::dma`]), the [`card::Card`] trait with [`card::HostQueue`] (the
//! driver side of the rings over any [`card::Bar`]) and [`card::SoftCard`], the software model
//! ([`card::soft`]), the card clock ([`card::clock`]: [`card::CardClock::now_ns`], callable
//! directly by the journal without a ring round trip) and [`card::CardError`]. The card's
//! `OP_CRC32C` runs the `crc32c` crate, the same function the journal and kvswap call
//! directly.
//!
//! The market data the card processes (ITCH 5.0, order books, the normalized event, the symbol
//! filter, the feed generator) is the crate `fastlane-market`, which knows nothing of the
//! card; the card's engine calls it for `OP_ITCH`. The card's modules are also re-exported at
//! the crate root (`fastlane_fpga::abi`, `fastlane_fpga::clock`, `fastlane_fpga::dma`).
//!
//! It does not talk to real hardware yet: the VFIO-mapped BAR backend is a documented seam
//! ([`card::MmioBar`] + [`card::HostQueue`]), not a driver.

#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

pub mod card;

pub use card::{abi, clock, dma};

pub use card::{Card, CardClock, CardError, SoftCard, SoftCardConfig};
