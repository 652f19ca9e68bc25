//! The virtio-blk request parser: one descriptor chain in, one validated request out, with data
//! segments that point straight into guest memory (zero copy).
//!
//! Everything here treats the guest as hostile (VIRTIO 1.2 §5.2.6 and §2.7.4: the device must
//! not assume any particular framing). A chain is read as two byte streams, the device-readable
//! part (header, then data or a discard range) followed by the device-writable part (data, then
//! the status byte, the last byte of the last descriptor), as QEMU's `virtio-blk-handler.c`
//! does. Every check that fails yields a [`Rejected`] carrying the reason (counted per queue)
//! and, when the chain has a usable status byte, where to write the error status.
//!
//! The walk over the chain itself (loops, indirect tables, ttl) is virtio-queue's; this module
//! only sees the descriptors it yields, and stops recording after a bounded count.

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_DISCARD,
    VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
    VIRTIO_BLK_T_WRITE_ZEROES, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{
    Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress,
};

use super::config::{DISCARD_SECTORS_MAX, SECTOR_SHIFT, SECTOR_SIZE, WRITE_ZEROES_SECTORS_MAX};
use fastlane_block::Segment;

/// Size of `struct virtio_blk_outhdr` (type, ioprio, sector).
pub const HEADER_LEN: u64 = 16;
/// Size of `struct virtio_blk_discard_write_zeroes` (sector, num_sectors, flags).
pub const DISCARD_RANGE_LEN: u64 = 16;
/// Bytes of a GET_ID answer.
pub const ID_LEN: usize = VIRTIO_BLK_ID_BYTES as usize;

/// What a valid request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestKind {
    /// `VIRTIO_BLK_T_IN`: read into the segments.
    Read,
    /// `VIRTIO_BLK_T_OUT`: write the segments.
    Write,
    /// `VIRTIO_BLK_T_FLUSH`.
    Flush,
    /// `VIRTIO_BLK_T_GET_ID`: the serial, written by [`Parser::write_id`].
    GetId,
    /// `VIRTIO_BLK_T_DISCARD`.
    Discard,
    /// `VIRTIO_BLK_T_WRITE_ZEROES`.
    WriteZeroes {
        /// `VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP` was set.
        unmap: bool,
    },
}

/// A validated request. Its data segments are in [`Parser::segments`] until the next parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParsedRequest {
    /// The operation.
    pub kind: RequestKind,
    /// Byte offset on the device (0 for flush and GET_ID).
    pub offset: u64,
    /// Bytes of data (read/write: the segments' total; GET_ID: what the answer fills) or of
    /// range (discard, write-zeroes).
    pub len: u64,
    /// Guest address of the status byte.
    pub status: GuestAddress,
}

/// Why a chain was refused. One counter per reason, per queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum RejectReason {
    /// No usable status byte: the last descriptor is not device-writable, is empty, or lies
    /// outside guest memory. The chain is returned with length 0.
    StatusUnusable,
    /// Fewer than 16 device-readable bytes for the header.
    HeaderMissing,
    /// The first descriptor is device-writable, so there is no header to read.
    HeaderWriteOnly,
    /// A data descriptor has the wrong direction for the request type (or a readable
    /// descriptor follows a writable one).
    WrongDirection,
    /// Read/write data is not a multiple of 512 bytes.
    LengthNotSectorMultiple,
    /// The sector range is past the capacity, overflows, or is longer than the limit.
    OutOfRange,
    /// More descriptors than `seg_max` allows.
    TooManySegments,
    /// A buffer lies (partly) outside guest memory or straddles two memory regions.
    BadAddress,
    /// Unknown request type, or an operation this export does not offer.
    Unsupported,
    /// A write, discard or write-zeroes on a read-only export.
    ReadOnly,
    /// A discard / write-zeroes range list that is empty, truncated or has more than one range.
    BadDiscardRange,
    /// Unknown flags in a discard / write-zeroes range (UNMAP on discard included).
    BadDiscardFlags,
    /// The guest published a head index that is still in flight.
    HeadInFlight,
}

impl RejectReason {
    /// Every reason, in counter order.
    pub const ALL: [RejectReason; 13] = [
        RejectReason::StatusUnusable,
        RejectReason::HeaderMissing,
        RejectReason::HeaderWriteOnly,
        RejectReason::WrongDirection,
        RejectReason::LengthNotSectorMultiple,
        RejectReason::OutOfRange,
        RejectReason::TooManySegments,
        RejectReason::BadAddress,
        RejectReason::Unsupported,
        RejectReason::ReadOnly,
        RejectReason::BadDiscardRange,
        RejectReason::BadDiscardFlags,
        RejectReason::HeadInFlight,
    ];
    /// Number of reasons.
    pub const COUNT: usize = Self::ALL.len();

    /// Counter index.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The virtio-blk status the request completes with.
    pub fn status(self) -> u8 {
        match self {
            RejectReason::Unsupported | RejectReason::BadDiscardFlags => VIRTIO_BLK_S_UNSUPP as u8,
            _ => VIRTIO_BLK_S_IOERR as u8,
        }
    }

    /// Short name for logs and stats.
    pub fn name(self) -> &'static str {
        match self {
            RejectReason::StatusUnusable => "status_unusable",
            RejectReason::HeaderMissing => "header_missing",
            RejectReason::HeaderWriteOnly => "header_write_only",
            RejectReason::WrongDirection => "wrong_direction",
            RejectReason::LengthNotSectorMultiple => "length_not_sector_multiple",
            RejectReason::OutOfRange => "out_of_range",
            RejectReason::TooManySegments => "too_many_segments",
            RejectReason::BadAddress => "bad_address",
            RejectReason::Unsupported => "unsupported",
            RejectReason::ReadOnly => "read_only",
            RejectReason::BadDiscardRange => "bad_discard_range",
            RejectReason::BadDiscardFlags => "bad_discard_flags",
            RejectReason::HeadInFlight => "head_in_flight",
        }
    }

    /// How a log line describes it: "guest gave us a descriptor chain that …".
    pub fn describe(self) -> &'static str {
        match self {
            RejectReason::StatusUnusable => "has no usable status byte",
            RejectReason::HeaderMissing => "is too short for a request header",
            RejectReason::HeaderWriteOnly => "starts with a device-writable header",
            RejectReason::WrongDirection => "has a data buffer of the wrong direction",
            RejectReason::LengthNotSectorMultiple => "has data that is not a multiple of 512 bytes",
            RejectReason::OutOfRange => "addresses sectors past the end of the disk",
            RejectReason::TooManySegments => "has more segments than seg_max",
            RejectReason::BadAddress => "points outside guest memory",
            RejectReason::Unsupported => "asks for an unsupported request type",
            RejectReason::ReadOnly => "writes to a read-only disk",
            RejectReason::BadDiscardRange => "has a malformed discard/write-zeroes range",
            RejectReason::BadDiscardFlags => "has unknown discard/write-zeroes flags",
            RejectReason::HeadInFlight => "reuses a head index that is still in flight",
        }
    }
}

/// A refused chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rejected {
    /// Why.
    pub reason: RejectReason,
    /// Where to write the error status, when the chain has a usable status byte.
    pub status: Option<GuestAddress>,
}

/// What the parser checks requests against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParseLimits {
    /// Device size in bytes.
    pub capacity_bytes: u64,
    /// Most data segments per request (`seg_max`).
    pub segments_max: u32,
    /// Refuse writes, discards and write-zeroes.
    pub read_only: bool,
    /// Discard is offered.
    pub discard: bool,
    /// Write-zeroes is offered.
    pub write_zeroes: bool,
}

/// One descriptor as recorded during the walk.
#[derive(Debug, Clone, Copy)]
struct Piece {
    addr: GuestAddress,
    len: u32,
    write: bool,
}

/// The parser with its pre-allocated scratch space: one per queue worker, reused for every
/// request (no allocation per request).
#[derive(Debug)]
pub struct Parser {
    limits: ParseLimits,
    pieces: Vec<Piece>,
    pieces_max: usize,
    segments: Vec<Segment>,
}

impl Parser {
    /// A parser for requests against `limits`.
    pub fn new(limits: ParseLimits) -> Self {
        let segments_max = limits.segments_max.max(1) as usize;
        // header + data + status, plus one for a data descriptor that also holds the header
        // or the status (any layout).
        let pieces_max = segments_max + 3;
        Parser {
            limits,
            pieces: Vec::with_capacity(pieces_max),
            pieces_max,
            segments: Vec::with_capacity(segments_max),
        }
    }

    /// The limits.
    pub fn limits(&self) -> &ParseLimits {
        &self.limits
    }

    /// The data segments of the last request parsed successfully (read/write only).
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Parse one chain. `descs` yields the chain's descriptors in order (a virtio-queue
    /// `DescriptorChain`); `mem` is the guest memory the addresses refer to.
    pub fn parse<M, I>(&mut self, mem: &M, descs: I) -> Result<ParsedRequest, Rejected>
    where
        M: GuestMemoryBackend + ?Sized,
        I: IntoIterator<Item = Descriptor>,
    {
        self.pieces.clear();
        self.segments.clear();

        let mut count = 0usize;
        let mut first: Option<Descriptor> = None;
        let mut last: Option<Descriptor> = None;
        let mut seen_writable = false;
        let mut order_bad = false;
        for d in descs {
            count += 1;
            if first.is_none() {
                first = Some(d);
            }
            last = Some(d);
            if d.is_write_only() {
                seen_writable = true;
            } else if seen_writable {
                order_bad = true;
            }
            if self.pieces.len() < self.pieces_max {
                self.pieces.push(Piece { addr: d.addr(), len: d.len(), write: d.is_write_only() });
            }
        }

        // The status byte: the last byte of the last descriptor, which must be writable.
        let status = last.and_then(|d| {
            if !d.is_write_only() || d.len() == 0 {
                return None;
            }
            let addr = d.addr().checked_add(u64::from(d.len()) - 1)?;
            mem.find_region(addr).map(|_| addr)
        });
        let Some(status) = status else {
            return Err(reject(RejectReason::StatusUnusable, None));
        };
        let fail = |reason| Err(reject(reason, Some(status)));

        if count > self.pieces_max {
            return fail(RejectReason::TooManySegments);
        }
        if first.is_some_and(|d| d.is_write_only()) {
            return fail(RejectReason::HeaderWriteOnly);
        }
        if order_bad {
            return fail(RejectReason::WrongDirection);
        }

        let readable: u64 = self.stream_len(false);
        // The writable stream without the status byte (the last piece is writable and non-empty).
        let writable: u64 = self.stream_len(true) - 1;
        if readable < HEADER_LEN {
            return fail(RejectReason::HeaderMissing);
        }
        let mut hdr = [0u8; HEADER_LEN as usize];
        if !self.read_stream(mem, 0, &mut hdr) {
            return fail(RejectReason::BadAddress);
        }
        let req_type = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
        let sector = u64::from_le_bytes([
            hdr[8], hdr[9], hdr[10], hdr[11], hdr[12], hdr[13], hdr[14], hdr[15],
        ]);
        let extra_readable = readable - HEADER_LEN;

        match req_type {
            VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT => {
                let (kind, len) = if req_type == VIRTIO_BLK_T_IN {
                    if extra_readable != 0 {
                        return fail(RejectReason::WrongDirection);
                    }
                    (RequestKind::Read, writable)
                } else {
                    if self.limits.read_only {
                        return fail(RejectReason::ReadOnly);
                    }
                    if writable != 0 {
                        return fail(RejectReason::WrongDirection);
                    }
                    (RequestKind::Write, extra_readable)
                };
                if len % SECTOR_SIZE != 0 {
                    return fail(RejectReason::LengthNotSectorMultiple);
                }
                let Some(offset) = self.sector_range(sector, len) else {
                    return fail(RejectReason::OutOfRange);
                };
                let (write, skip) = match kind {
                    RequestKind::Read => (true, 0),
                    _ => (false, HEADER_LEN),
                };
                self.build_segments(mem, write, skip, len)
                    .map_err(|reason| reject(reason, Some(status)))?;
                Ok(ParsedRequest { kind, offset, len, status })
            }
            VIRTIO_BLK_T_FLUSH => {
                if extra_readable != 0 || writable != 0 {
                    return fail(RejectReason::WrongDirection);
                }
                Ok(ParsedRequest { kind: RequestKind::Flush, offset: 0, len: 0, status })
            }
            VIRTIO_BLK_T_GET_ID => {
                if extra_readable != 0 {
                    return fail(RejectReason::WrongDirection);
                }
                Ok(ParsedRequest {
                    kind: RequestKind::GetId,
                    offset: 0,
                    len: writable.min(ID_LEN as u64),
                    status,
                })
            }
            VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
                let is_discard = req_type == VIRTIO_BLK_T_DISCARD;
                let offered =
                    if is_discard { self.limits.discard } else { self.limits.write_zeroes };
                if self.limits.read_only {
                    return fail(RejectReason::ReadOnly);
                }
                if !offered {
                    return fail(RejectReason::Unsupported);
                }
                if writable != 0 {
                    return fail(RejectReason::WrongDirection);
                }
                // One range only (max_discard_seg = 1); more is UNSUPP as in QEMU.
                if extra_readable > DISCARD_RANGE_LEN {
                    return fail(RejectReason::BadDiscardFlags);
                }
                if extra_readable < DISCARD_RANGE_LEN {
                    return fail(RejectReason::BadDiscardRange);
                }
                let mut range = [0u8; DISCARD_RANGE_LEN as usize];
                if !self.read_stream(mem, HEADER_LEN, &mut range) {
                    return fail(RejectReason::BadAddress);
                }
                let r_sector = u64::from_le_bytes([
                    range[0], range[1], range[2], range[3], range[4], range[5], range[6], range[7],
                ]);
                let num_sectors = u32::from_le_bytes([range[8], range[9], range[10], range[11]]);
                let flags = u32::from_le_bytes([range[12], range[13], range[14], range[15]]);
                let sectors_max =
                    if is_discard { DISCARD_SECTORS_MAX } else { WRITE_ZEROES_SECTORS_MAX };
                if num_sectors > sectors_max {
                    return fail(RejectReason::OutOfRange);
                }
                let len = u64::from(num_sectors) << SECTOR_SHIFT;
                let Some(offset) = self.sector_range(r_sector, len) else {
                    return fail(RejectReason::OutOfRange);
                };
                if flags & !VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0 {
                    return fail(RejectReason::BadDiscardFlags);
                }
                let unmap = flags & VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0;
                let kind = if is_discard {
                    // The device MUST answer UNSUPP to a discard with UNMAP set (§5.2.6.2).
                    if unmap {
                        return fail(RejectReason::BadDiscardFlags);
                    }
                    RequestKind::Discard
                } else {
                    RequestKind::WriteZeroes { unmap }
                };
                Ok(ParsedRequest { kind, offset, len, status })
            }
            _ => fail(RejectReason::Unsupported),
        }
    }

    /// Answer a GET_ID parsed by the last [`Parser::parse`]: write `serial` (zero-padded to 20
    /// bytes, cut to `req.len`) into the chain's writable stream. Returns the bytes written.
    pub fn write_id<M>(&self, mem: &M, req: &ParsedRequest, serial: &[u8; ID_LEN]) -> Option<u32>
    where
        M: GuestMemoryBackend + ?Sized,
    {
        let mut left = &serial[..req.len.min(ID_LEN as u64) as usize];
        for p in self.pieces.iter().filter(|p| p.write) {
            if left.is_empty() {
                break;
            }
            let n = left.len().min(p.len as usize);
            mem.write_slice(&left[..n], p.addr).ok()?;
            left = &left[n..];
        }
        Some((req.len.min(ID_LEN as u64) - left.len() as u64) as u32)
    }

    fn stream_len(&self, write: bool) -> u64 {
        self.pieces.iter().filter(|p| p.write == write).map(|p| u64::from(p.len)).sum()
    }

    /// `[sector * 512, + len)` inside the device; returns the byte offset.
    fn sector_range(&self, sector: u64, len: u64) -> Option<u64> {
        let offset = sector.checked_mul(SECTOR_SIZE)?;
        let end = offset.checked_add(len)?;
        (end <= self.limits.capacity_bytes).then_some(offset)
    }

    /// Copy bytes `[skip, skip + out.len())` of the readable stream into `out`.
    fn read_stream<M>(&self, mem: &M, mut skip: u64, out: &mut [u8]) -> bool
    where
        M: GuestMemoryBackend + ?Sized,
    {
        let mut done = 0usize;
        for p in self.pieces.iter().filter(|p| !p.write) {
            if done == out.len() {
                break;
            }
            let plen = u64::from(p.len);
            if skip >= plen {
                skip -= plen;
                continue;
            }
            let n = ((plen - skip) as usize).min(out.len() - done);
            let Some(addr) = p.addr.checked_add(skip) else {
                return false;
            };
            if mem.read_slice(&mut out[done..done + n], addr).is_err() {
                return false;
            }
            done += n;
            skip = 0;
        }
        done == out.len()
    }

    /// Turn bytes `[skip, skip + len)` of one stream into host segments.
    fn build_segments<M>(
        &mut self,
        mem: &M,
        write: bool,
        mut skip: u64,
        len: u64,
    ) -> Result<(), RejectReason>
    where
        M: GuestMemoryBackend + ?Sized,
    {
        let mut left = len;
        for p in self.pieces.iter().filter(|p| p.write == write) {
            if left == 0 {
                break;
            }
            let plen = u64::from(p.len);
            if skip >= plen {
                skip -= plen;
                continue;
            }
            let n = (plen - skip).min(left);
            let addr = p.addr.checked_add(skip).ok_or(RejectReason::BadAddress)?;
            skip = 0;
            if n == 0 {
                continue;
            }
            if self.segments.len() >= self.limits.segments_max as usize {
                return Err(RejectReason::TooManySegments);
            }
            // n <= p.len, a u32.
            let host = host_range(mem, addr, n).ok_or(RejectReason::BadAddress)?;
            self.segments.push(Segment { addr: host, len: n as u32 });
            left -= n;
        }
        debug_assert_eq!(left, 0, "segments must cover the stream");
        Ok(())
    }
}

fn reject(reason: RejectReason, status: Option<GuestAddress>) -> Rejected {
    Rejected { reason, status }
}

/// The host address of `[addr, addr + len)`, which must lie inside one guest memory region.
pub fn host_range<M>(mem: &M, addr: GuestAddress, len: u64) -> Option<*mut u8>
where
    M: GuestMemoryBackend + ?Sized,
{
    let region = mem.find_region(addr)?;
    let offset = addr.checked_offset_from(region.start_addr())?;
    let end = offset.checked_add(len)?;
    if end > region.len() {
        return None;
    }
    region.get_host_address(MemoryRegionAddress(offset)).ok()
}

/// Fuzzing and corpus replay: decode bytes into guest memory and a descriptor chain, parse it
/// and check what the parser promises. Used by `fuzz/` and by the corpus test.
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
// A test harness (built only for tests and `fuzz/`): its panics are the findings.
#[allow(clippy::unwrap_used, clippy::expect_used)]
pub mod fuzzing {
    use super::*;
    use virtio_bindings::virtio_ring::VRING_DESC_F_WRITE;
    use vm_memory::GuestMemoryMmap;

    /// Guest memory for fuzzing: two adjacent regions (a buffer may not straddle them) and one
    /// after a hole.
    pub const REGIONS: [(u64, usize); 3] =
        [(0, 0x1_0000), (0x1_0000, 0x1_0000), (0x3_0000, 0x1_0000)];

    thread_local! {
        static MEM: GuestMemoryMmap<()> = GuestMemoryMmap::from_ranges(
            &REGIONS.map(|(a, l)| (GuestAddress(a), l)),
        ).expect("fuzz guest memory");
    }

    /// One fuzz input. Layout: byte 0 = limits flags (bit 0 read-only, bit 1 discard, bit 2
    /// write-zeroes), byte 1 = descriptor count (mod 24), then 13 bytes per descriptor
    /// (address u64 LE, length u32 LE, flags u8: bit 0 device-writable, bit 6 keep the full
    /// length, bit 7 keep the full address; otherwise both are folded into guest memory), and
    /// the rest is copied to guest address 0.
    pub fn parse_one(data: &[u8]) {
        let (Some(&lflags), Some(&n)) = (data.first(), data.get(1)) else {
            return;
        };
        let n = (n % 24) as usize;
        let mut descs = Vec::with_capacity(n);
        let mut rest = &data[2..];
        for _ in 0..n {
            if rest.len() < 13 {
                break;
            }
            let raw_addr = u64::from_le_bytes(rest[0..8].try_into().unwrap());
            let raw_len = u32::from_le_bytes(rest[8..12].try_into().unwrap());
            let f = rest[12];
            rest = &rest[13..];
            let addr = if f & 0x80 != 0 { raw_addr } else { raw_addr % 0x4_2000 };
            let len = if f & 0x40 != 0 { raw_len } else { raw_len % 0x4000 };
            let flags = if f & 1 != 0 { VRING_DESC_F_WRITE as u16 } else { 0 };
            descs.push(Descriptor::new(addr, len, flags, 0));
        }
        let limits = ParseLimits {
            capacity_bytes: 1 << 20,
            segments_max: 8,
            read_only: lflags & 1 != 0,
            discard: lflags & 2 != 0,
            write_zeroes: lflags & 4 != 0,
        };
        MEM.with(|mem| {
            let fill = rest.len().min(REGIONS[0].1);
            mem.write_slice(&rest[..fill], GuestAddress(0)).unwrap();
            let mut parser = Parser::new(limits);
            check(mem, &mut parser, &descs);
        });
    }

    fn check(mem: &GuestMemoryMmap<()>, parser: &mut Parser, descs: &[Descriptor]) {
        let region_ok = |ptr: *mut u8, len: u64| {
            mem.iter().any(|r| {
                let base = r.as_ptr() as usize;
                let p = ptr as usize;
                p >= base && (p as u64 + len) <= base as u64 + r.len()
            })
        };
        match parser.parse(mem, descs.iter().copied()) {
            Ok(req) => {
                assert!(mem.find_region(req.status).is_some());
                let limits = *parser.limits();
                match req.kind {
                    RequestKind::Read | RequestKind::Write => {
                        let total: u64 = parser.segments().iter().map(|s| u64::from(s.len)).sum();
                        assert_eq!(total, req.len);
                        assert!(req.offset + req.len <= limits.capacity_bytes);
                        assert_eq!(req.len % SECTOR_SIZE, 0);
                        assert!(parser.segments().len() <= limits.segments_max as usize);
                        for s in parser.segments() {
                            assert!(s.len > 0);
                            assert!(region_ok(s.addr, u64::from(s.len)), "segment outside memory");
                        }
                        if req.kind == RequestKind::Write {
                            assert!(!limits.read_only);
                        }
                    }
                    RequestKind::Discard | RequestKind::WriteZeroes { .. } => {
                        assert!(!limits.read_only);
                        assert!(req.offset + req.len <= limits.capacity_bytes);
                    }
                    RequestKind::GetId => {
                        let serial = *b"fuzz-serial-0123456\0";
                        let n = parser.write_id(mem, &req, &serial).unwrap_or(0);
                        assert!(u64::from(n) <= req.len);
                    }
                    RequestKind::Flush => {}
                }
            }
            Err(rej) => {
                if let Some(st) = rej.status {
                    assert!(mem.find_region(st).is_some());
                    assert_ne!(rej.reason, RejectReason::StatusUnusable);
                } else {
                    assert_eq!(rej.reason, RejectReason::StatusUnusable);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::virtio_ring::VRING_DESC_F_WRITE;
    use vm_memory::GuestMemoryMmap;

    const W: u16 = VRING_DESC_F_WRITE as u16;

    fn mem() -> GuestMemoryMmap<()> {
        GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0), 0x1_0000),
            (GuestAddress(0x1_0000), 0x1_0000),
        ])
        .unwrap()
    }

    fn limits() -> ParseLimits {
        ParseLimits {
            capacity_bytes: 1 << 20,
            segments_max: 4,
            read_only: false,
            discard: true,
            write_zeroes: true,
        }
    }

    fn hdr(m: &GuestMemoryMmap<()>, at: u64, t: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&t.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        m.write_slice(&h, GuestAddress(at)).unwrap();
    }

    fn d(addr: u64, len: u32, flags: u16) -> Descriptor {
        Descriptor::new(addr, len, flags, 0)
    }

    #[test]
    fn read_with_header_and_status_in_data_descriptors() {
        // Any layout: the header shares a descriptor with nothing, the status shares one with
        // the tail of the data.
        let m = mem();
        hdr(&m, 0x100, VIRTIO_BLK_T_IN, 2);
        let mut p = Parser::new(limits());
        let r = p.parse(&m, [d(0x100, 16, 0), d(0x1000, 512, W), d(0x2000, 513, W)]).unwrap();
        assert_eq!(r.kind, RequestKind::Read);
        assert_eq!((r.offset, r.len), (1024, 1024));
        assert_eq!(r.status, GuestAddress(0x2000 + 512));
        assert_eq!(p.segments().len(), 2);
    }

    #[test]
    fn write_with_data_in_header_descriptor() {
        let m = mem();
        hdr(&m, 0x100, VIRTIO_BLK_T_OUT, 0);
        let mut p = Parser::new(limits());
        let r = p.parse(&m, [d(0x100, 16 + 512, 0), d(0x3000, 1, W)]).unwrap();
        assert_eq!((r.kind, r.len), (RequestKind::Write, 512));
        let host = host_range(&m, GuestAddress(0x110), 512).unwrap();
        assert_eq!(p.segments()[0].addr, host);
    }

    #[test]
    fn straddling_regions_is_bad_address() {
        let m = mem();
        hdr(&m, 0x100, VIRTIO_BLK_T_IN, 0);
        let mut p = Parser::new(limits());
        let e = p.parse(&m, [d(0x100, 16, 0), d(0xff00, 512, W), d(0x3000, 1, W)]).unwrap_err();
        assert_eq!(e.reason, RejectReason::BadAddress);
        assert_eq!(e.status, Some(GuestAddress(0x3000)));
    }

    #[test]
    fn discard_limits_and_flags() {
        let m = mem();
        hdr(&m, 0x100, VIRTIO_BLK_T_DISCARD, 0);
        let mut range = [0u8; 16];
        range[0..8].copy_from_slice(&8u64.to_le_bytes());
        range[8..12].copy_from_slice(&16u32.to_le_bytes());
        m.write_slice(&range, GuestAddress(0x200)).unwrap();
        let mut p = Parser::new(limits());
        let r = p.parse(&m, [d(0x100, 16, 0), d(0x200, 16, 0), d(0x3000, 1, W)]).unwrap();
        assert_eq!(r.kind, RequestKind::Discard);
        assert_eq!((r.offset, r.len), (4096, 8192));
        // UNMAP on a discard: UNSUPP.
        range[12] = 1;
        m.write_slice(&range, GuestAddress(0x200)).unwrap();
        let e = p.parse(&m, [d(0x100, 16, 0), d(0x200, 16, 0), d(0x3000, 1, W)]).unwrap_err();
        assert_eq!(e.reason, RejectReason::BadDiscardFlags);
        assert_eq!(e.reason.status(), VIRTIO_BLK_S_UNSUPP as u8);
        // Two ranges: UNSUPP; half a range: IOERR.
        let e = p.parse(&m, [d(0x100, 16, 0), d(0x200, 32, 0), d(0x3000, 1, W)]).unwrap_err();
        assert_eq!(e.reason, RejectReason::BadDiscardFlags);
        let e = p.parse(&m, [d(0x100, 16, 0), d(0x200, 8, 0), d(0x3000, 1, W)]).unwrap_err();
        assert_eq!(e.reason, RejectReason::BadDiscardRange);
    }

    #[test]
    fn sector_overflow_is_out_of_range() {
        let m = mem();
        hdr(&m, 0x100, VIRTIO_BLK_T_IN, u64::MAX / 256);
        let mut p = Parser::new(limits());
        let e = p.parse(&m, [d(0x100, 16, 0), d(0x1000, 512, W), d(0x3000, 1, W)]).unwrap_err();
        assert_eq!(e.reason, RejectReason::OutOfRange);
    }

    #[test]
    fn get_id_is_cut_to_the_buffer() {
        let m = mem();
        hdr(&m, 0x100, VIRTIO_BLK_T_GET_ID, 0);
        let mut p = Parser::new(limits());
        let r = p.parse(&m, [d(0x100, 16, 0), d(0x1000, 8, W), d(0x3000, 1, W)]).unwrap();
        assert_eq!(r.len, 8);
        let serial = *b"0123456789abcdefghij";
        assert_eq!(p.write_id(&m, &r, &serial), Some(8));
        let mut got = [0u8; 9];
        m.read_slice(&mut got, GuestAddress(0x1000)).unwrap();
        assert_eq!(&got, b"01234567\0");
    }

    #[test]
    fn empty_chain_and_readable_last_have_no_status() {
        let m = mem();
        let mut p = Parser::new(limits());
        let e = p.parse(&m, std::iter::empty()).unwrap_err();
        assert_eq!(e, reject(RejectReason::StatusUnusable, None));
        let e = p.parse(&m, [d(0x100, 16, 0)]).unwrap_err();
        assert_eq!(e.status, None);
        let e = p.parse(&m, [d(0x100, 16, 0), d(0x3000, 0, W)]).unwrap_err();
        assert_eq!(e.status, None);
        let e = p.parse(&m, [d(0x100, 16, 0), d(0x9_0000, 1, W)]).unwrap_err();
        assert_eq!(e.status, None);
        let e = p.parse(&m, [d(0x100, 16, 0), d(u64::MAX, 2, W)]).unwrap_err();
        assert_eq!(e.status, None);
    }

    #[test]
    fn fuzz_helper_survives_noise() {
        let mut x = 0x1234_5678_9abc_def0u64;
        for _ in 0..2000 {
            let mut buf = vec![0u8; 80];
            for b in buf.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *b = x as u8;
            }
            fuzzing::parse_one(&buf);
        }
    }
}
