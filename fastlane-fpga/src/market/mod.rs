//! Market data: NASDAQ TotalView-ITCH 5.0 and what is built from it. Plain functions over
//! bytes and values; nothing here knows about rings, registers or DMA ([`crate::card`] calls
//! into it for `OP_ITCH`).
//!
//! - [`itch`]: decoding of every ITCH 5.0 message type, and encoding.
//! - [`book`]: order-book reconstruction per stock locate with top-of-book changes.
//! - [`event`]: the 64-byte normalized event the card writes for each message.
//! - [`filter`]: filtering by symbol set.
//! - [`gen`]: a deterministic, realistic ITCH feed generator for tests and benchmarks.
//! - [`mod@reference`]: a naive `BTreeMap` order book, the oracle for tests and fuzzing.
//!
//! Dependencies point one way: `itch` ← `book` ← `event`, `reference`, `gen`; `itch` ←
//! `filter`.

pub mod book;
pub mod event;
pub mod filter;
pub mod gen;
pub mod itch;
pub mod reference;
