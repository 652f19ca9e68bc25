//! The card interface's error type, shared by the rings and DMA memory ([`super::dma`]) and
//! the queues ([`super::soft`]); its own module so that neither of those has to import the
//! other for it.

use std::time::Duration;

use super::abi::{self, Descriptor};

/// Errors of the card interface.
#[derive(Debug, thiserror::Error)]
pub enum CardError {
    /// The descriptor ring (or the in-flight window) is full; the descriptor is handed back.
    #[error("descriptor ring full")]
    Full(Descriptor),
    /// `REG_ID` did not read the magic.
    #[error("not a FastLane card: ID register reads {id:#010x}")]
    BadMagic {
        /// What `REG_ID` read.
        id: u32,
    },
    /// The card's major ABI version is not ours.
    #[error("card ABI version {major}.{minor}, driver speaks {}.x", abi::ABI_VERSION_MAJOR)]
    Version {
        /// The card's major ABI version.
        major: u16,
        /// The card's minor ABI version.
        minor: u16,
    },
    /// A ring size outside 1..=16 (log2).
    #[error("ring log2 size {log2} outside 1..={}", abi::RING_LOG2_MAX)]
    RingSize {
        /// The log2 of the ring's entries that was asked for.
        log2: u32,
    },
    /// A DMA buffer could not be allocated.
    #[error("cannot allocate {bytes} bytes of DMA memory")]
    Alloc {
        /// Bytes asked for.
        bytes: usize,
    },
    /// The card halted on a fault.
    #[error("card halted: fault {fault}")]
    Halted {
        /// The `ERROR` register: a [`CardFault`](super::abi::CardFault) code.
        fault: u32,
    },
    /// The card did not answer in time (it has been stopped).
    #[error("card did not complete tag {tag} within {waited:?}")]
    Timeout {
        /// The descriptor's tag.
        tag: u32,
        /// How long the host waited.
        waited: Duration,
    },
    /// The operation needs an idle queue.
    #[error("{in_flight} descriptors in flight")]
    Busy {
        /// Descriptors posted and not yet completed.
        in_flight: u32,
    },
    /// The input does not fit the card's staging slot.
    #[error("input of {bytes} bytes exceeds the {max} byte staging slot")]
    TooLarge {
        /// Bytes of the input.
        bytes: usize,
        /// Bytes of a staging slot.
        max: usize,
    },
    /// The card answered something that cannot be right.
    #[error("card completion out of protocol: {reason}")]
    Protocol {
        /// What was wrong with the completion.
        reason: &'static str,
    },
}
