//! FastLane's preprocessing card: the interface an FPGA will implement, a software model
//! behind it, and the operations it runs.
//!
//! - [`abi`]: the register map, descriptor and completion layouts, op codes (the contract
//!   with hardware; `docs/fpga-abi.md` is its prose form).
//! - [`mod@card`]: the [`card::Card`] trait, [`card::HostQueue`] (the driver side of the rings
//!   over any [`card::Bar`]), and [`card::SoftCard`], the software model (an engine thread that
//!   honours doorbells, reads descriptors, runs the op and writes completions).
//! - [`itch`]: NASDAQ TotalView-ITCH 5.0 decoding of every message type, and encoding.
//! - [`book`]: order-book reconstruction per stock locate with top-of-book changes.
//! - [`event`]: the 64-byte normalized event the card writes.
//! - [`filter`]: filtering by symbol set.
//! - [`clock`]: the card clock, callable directly by the journal without a ring round trip
//!   ([`clock::CardClock::now_ns`]). The card's `OP_CRC32C` runs the `crc32c` crate, the same
//!   function the journal and kvswap call directly.
//! - [`gen`]: a deterministic, realistic ITCH feed generator for tests and benchmarks.
//! - [`mod@reference`]: a naive `BTreeMap` order book, the oracle for tests and fuzzing.
//!
//! It does not talk to real hardware yet: the VFIO-mapped BAR backend is a documented seam
//! ([`card::MmioBar`] + [`card::HostQueue`]), not a driver.

pub mod abi;
pub mod book;
pub mod card;
pub mod clock;
pub mod dma;
pub mod event;
pub mod filter;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod gen;
pub mod itch;
pub mod reference;

pub use book::{BookConfig, OrderBooks, TopOfBook};
pub use card::{Card, CardError, SoftCard, SoftCardConfig};
pub use clock::CardClock;
pub use itch::{decode, FeedReader, ItchError, Message};
