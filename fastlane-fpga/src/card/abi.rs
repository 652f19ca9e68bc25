//! The host/card ABI: register map, descriptor and completion layouts, op codes.
//!
//! Written down for humans in `docs/fpga-abi.md`; this module is the source of truth and its
//! compile-time asserts pin every size and offset. Modeled on DMA engines in the field (AMD
//! QDMA's H2C/C2H rings and completion ring with a colour bit, Corundum's small descriptors
//! and producer-index doorbells), reduced to one queue pair.
//!
//! Indices are free-running `u32` counters; a ring of `2^n` entries uses `index & (2^n - 1)`.
//! The host owns `DESC_PROD` and `CPL_CONS` (its doorbells), the card owns `DESC_CONS` and
//! `CPL_PROD`. A completion is valid when its phase bit equals the host's expected phase,
//! which starts at 1 and flips every time the host's completion index wraps.

use std::mem::{align_of, offset_of, size_of};

/// `REG_ID` reads this ("FLPQ").
pub const ABI_MAGIC: u32 = 0x464C_5051;
/// Incompatible layout changes bump the major version.
pub const ABI_VERSION_MAJOR: u16 = 1;
/// Compatible additions (new ops, new registers in reserved space) bump the minor version.
pub const ABI_VERSION_MINOR: u16 = 0;
/// `REG_VERSION` reads this.
pub const ABI_VERSION: u32 = (ABI_VERSION_MAJOR as u32) << 16 | ABI_VERSION_MINOR as u32;

/// Size of the register BAR (BAR0) in bytes.
pub const BAR_SIZE: usize = 0x1000;

/// Register offsets in BAR0. All registers are 32 bits wide and 4-byte aligned.
pub mod reg {
    /// RO: [`super::ABI_MAGIC`].
    pub const ID: usize = 0x000;
    /// RO: major << 16 | minor.
    pub const VERSION: usize = 0x004;
    /// RO: bit per supported op (`1 << OP_*`).
    pub const CAPS: usize = 0x008;
    /// RW: [`super::ctrl`] bits.
    pub const CONTROL: usize = 0x00C;
    /// RO: [`super::status`] bits.
    pub const STATUS: usize = 0x010;
    /// RO: the last [`super::CardFault`] code (0: none).
    pub const ERROR: usize = 0x014;
    /// RO: faults since reset.
    pub const ERROR_COUNT: usize = 0x018;
    /// RW1C: bit 0 set when completions were written while `IRQ_ENABLE`.
    pub const IRQ_STATUS: usize = 0x01C;
    /// RW: bit 0 masks the completion interrupt.
    pub const IRQ_MASK: usize = 0x020;
    /// RW: descriptor ring base (IOVA), low and high halves; 4 KiB aligned.
    pub const DESC_BASE_LO: usize = 0x040;
    /// See [`DESC_BASE_LO`].
    pub const DESC_BASE_HI: usize = 0x044;
    /// RW: log2 of the descriptor ring's entries (1..=16).
    pub const DESC_RING_LOG2: usize = 0x048;
    /// WO doorbell: the host's producer index.
    pub const DESC_PROD: usize = 0x04C;
    /// RO: the card's consumer index (descriptors it has read).
    pub const DESC_CONS: usize = 0x050;
    /// RW: completion ring base (IOVA), low and high halves; 4 KiB aligned.
    pub const CPL_BASE_LO: usize = 0x060;
    /// See [`CPL_BASE_LO`].
    pub const CPL_BASE_HI: usize = 0x064;
    /// RW: log2 of the completion ring's entries (1..=16).
    pub const CPL_RING_LOG2: usize = 0x068;
    /// RO: the card's producer index (completions written).
    pub const CPL_PROD: usize = 0x06C;
    /// WO doorbell: the host's consumer index (completions reaped).
    pub const CPL_CONS: usize = 0x070;
    /// RO: the card clock, ns since reset; reading LO latches HI.
    pub const CLOCK_LO: usize = 0x080;
    /// See [`CLOCK_LO`].
    pub const CLOCK_HI: usize = 0x084;
}

/// `CONTROL` bits.
pub mod ctrl {
    /// Process descriptors.
    pub const ENABLE: u32 = 1 << 0;
    /// Write 1: stop, zero the indices and the fault; reads back 0 when done.
    pub const RESET: u32 = 1 << 1;
    /// Raise the completion interrupt.
    pub const IRQ_ENABLE: u32 = 1 << 2;
}

/// `STATUS` bits.
pub mod status {
    /// The engine is running (enabled and not halted).
    pub const RUNNING: u32 = 1 << 0;
    /// The engine stopped on a fault (see `ERROR`); only a reset clears it.
    pub const HALTED: u32 = 1 << 1;
}

/// Why the card halted (`ERROR` register).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum CardFault {
    /// A producer doorbell more than a ring's size ahead of the consumer.
    DoorbellOverrun = 1,
    /// A ring size register outside 1..=16, or a ring base not 4 KiB aligned or null.
    BadRingConfig = 2,
}

/// No operation: completes with status OK.
pub const OP_NOP: u8 = 0;
/// CRC32C of `src`; `dst_len` carries the seed (the CRC so far, 0 to start), `dst_addr` 0.
/// Completion `value`: the CRC.
pub const OP_CRC32C: u8 = 1;
/// Stamp with the card clock; no memory. Completion `value`: the card clock in ns.
pub const OP_TIMESTAMP: u8 = 2;
/// ITCH 5.0: decode the length-prefixed messages in `src`, filter, update the books and write
/// [`fastlane_market::event::Event`]s to `dst` per the `ITCH_*` flags. Completion `value`: bytes
/// consumed, `events`: events written, `errors`: rejected messages plus book anomalies.
pub const OP_ITCH: u8 = 3;

/// `OP_ITCH` flag: write one event per admitted message.
pub const ITCH_EVENTS: u8 = 1 << 0;
/// `OP_ITCH` flag: apply admitted messages to the books and write top-of-book changes.
pub const ITCH_BOOK: u8 = 1 << 1;
/// `OP_ITCH` flag: apply the card's symbol filter (set at card creation).
pub const ITCH_FILTER: u8 = 1 << 2;

/// `CAPS` of this ABI version's software model.
pub const CAPS_ALL: u32 = 1 << OP_NOP | 1 << OP_CRC32C | 1 << OP_TIMESTAMP | 1 << OP_ITCH;

/// Completion status codes.
pub mod cpl_status {
    /// Done.
    pub const OK: u16 = 0;
    /// Op code not supported (see `CAPS`).
    pub const UNSUPPORTED_OP: u16 = 1;
    /// A null or misaligned address, or a length the op cannot take.
    pub const BAD_DESCRIPTOR: u16 = 2;
    /// `dst` filled before the input ended; `value` says how far the input was consumed.
    pub const DST_FULL: u16 = 3;
}

/// Host-to-card descriptor (32 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Descriptor {
    /// `OP_*`.
    pub op: u8,
    /// Op-specific flags.
    pub flags: u8,
    /// Zero.
    pub reserved: u16,
    /// Echoed in the completion.
    pub tag: u32,
    /// IOVA of the input.
    pub src_addr: u64,
    /// Input bytes.
    pub src_len: u32,
    /// Output bytes (or the op's 32-bit argument).
    pub dst_len: u32,
    /// IOVA of the output (8-byte aligned), or 0.
    pub dst_addr: u64,
}

/// Card-to-host completion (32 bytes). The card writes everything else before
/// `phase_flags` (a single 16-bit store, release-ordered in the software model; the last
/// bytes of one posted write on PCIe).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Completion {
    /// The descriptor's tag.
    pub tag: u32,
    /// `cpl_status::*`.
    pub status: u16,
    /// Bit 0: phase.
    pub phase_flags: u16,
    /// Op result (CRC, timestamp, bytes consumed).
    pub value: u64,
    /// Events written to `dst`.
    pub events: u32,
    /// Rejected inputs.
    pub errors: u32,
    /// Card clock when the completion was written, ns.
    pub timestamp_ns: u64,
}

/// `phase_flags` bit 0.
pub const PHASE_BIT: u16 = 1;

const _: () = assert!(size_of::<Descriptor>() == 32);
const _: () = assert!(align_of::<Descriptor>() == 8);
const _: () = assert!(offset_of!(Descriptor, tag) == 4);
const _: () = assert!(offset_of!(Descriptor, src_addr) == 8);
const _: () = assert!(offset_of!(Descriptor, src_len) == 16);
const _: () = assert!(offset_of!(Descriptor, dst_len) == 20);
const _: () = assert!(offset_of!(Descriptor, dst_addr) == 24);
const _: () = assert!(size_of::<Completion>() == 32);
const _: () = assert!(offset_of!(Completion, status) == 4);
const _: () = assert!(offset_of!(Completion, phase_flags) == 6);
const _: () = assert!(offset_of!(Completion, value) == 8);
const _: () = assert!(offset_of!(Completion, events) == 16);
const _: () = assert!(offset_of!(Completion, errors) == 20);
const _: () = assert!(offset_of!(Completion, timestamp_ns) == 24);
const _: () = assert!(reg::CLOCK_HI + 4 <= BAR_SIZE);

/// Largest ring: 2^16 entries.
pub const RING_LOG2_MAX: u32 = 16;
