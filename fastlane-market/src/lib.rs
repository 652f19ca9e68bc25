//! Market data: NASDAQ TotalView-ITCH 5.0 and what is built from it. Plain functions over
//! bytes and values; nothing here knows about rings, registers or DMA (the preprocessing card,
//! crate `fastlane-fpga`, calls into it for `OP_ITCH`; the journal's preprocessing stage and
//! `fastlane itch` call it directly).
//!
//! - [`itch`]: decoding of every ITCH 5.0 message type, and encoding.
//! - [`book`]: order-book reconstruction per stock locate with top-of-book changes.
//! - [`event`]: the 64-byte normalized event the card writes for each message.
//! - [`filter`]: filtering by symbol set.
//! - [`gen`]: a deterministic, realistic ITCH feed generator for tests and benchmarks.
//! - [`mod@reference`]: a naive `BTreeMap` order book, the oracle for tests and fuzzing.
//! - `fuzzing` (feature `fuzzing`): the fuzz targets' entry points, for `fuzz/` and the
//!   corpus test.
//!
//! Dependencies point one way: `itch` ← `book` ← `event`, `reference`, `gen`; `itch` ←
//! `filter`.

#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

pub mod book;
pub mod event;
pub mod filter;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod gen;
pub mod itch;
pub mod reference;

pub use book::{BookConfig, OrderBooks, TopOfBook};
pub use itch::{decode, FeedReader, ItchError, Message};
