//! FastLane's preprocessing card: the interface an FPGA will implement, a software model
//! behind it, and the operations it runs. Two halves, each its own folder:
//!
//! - [`mod@card`] (`src/card/`), the card itself: the ABI ([`card::abi`]: register map,
//!   descriptor and completion layouts, op codes; `docs/fpga-abi.md` is its prose form), DMA
//!   memory ([`card::dma`]), the [`card::Card`] trait with [`card::HostQueue`] (the driver side
//!   of the rings over any [`card::Bar`]) and [`card::SoftCard`], the software model
//!   ([`card::soft`]), the card clock ([`card::clock`]: [`card::CardClock::now_ns`], callable
//!   directly by the journal without a ring round trip) and [`card::CardError`]. The card's
//!   `OP_CRC32C` runs the `crc32c` crate, the same function the journal and kvswap call
//!   directly.
//! - [`market`] (`src/market/`), the market data the card processes: NASDAQ TotalView-ITCH 5.0
//!   decoding and encoding ([`market::itch`]), order books per stock locate
//!   ([`market::book`]), the 64-byte normalized event ([`market::event`]), filtering by symbol
//!   set ([`market::filter`]), a deterministic feed generator ([`market::gen`]) and a naive
//!   `BTreeMap` order book, the oracle for tests and fuzzing ([`market::reference`]).
//!
//! `market` does not depend on `card`; `card`'s engine calls `market` for `OP_ITCH`. The
//! modules are also re-exported at the crate root under their earlier paths
//! (`fastlane_fpga::itch`, `fastlane_fpga::abi`, ...), which callers use.
//!
//! It does not talk to real hardware yet: the VFIO-mapped BAR backend is a documented seam
//! ([`card::MmioBar`] + [`card::HostQueue`]), not a driver.

#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

pub mod card;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod market;

pub use card::{abi, clock, dma};
pub use market::{book, event, filter, gen, itch, reference};

pub use book::{BookConfig, OrderBooks, TopOfBook};
pub use card::{Card, CardClock, CardError, SoftCard, SoftCardConfig};
pub use itch::{decode, FeedReader, ItchError, Message};
