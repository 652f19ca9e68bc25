//! Walking a split virtqueue's descriptor chain from a head index, for the requests an
//! in-flight region says must be resubmitted: virtio-queue builds chains only from the avail
//! ring (`DescriptorChain::new` is not public), and these heads were taken from it by a backend
//! that died.
//!
//! The walk follows VIRTIO 1.2 §2.7.5 (descriptor table, `NEXT`) and §2.7.5.3 (indirect
//! tables) and treats the table as hostile, as virtio-queue does: every index is checked
//! against the table's size, the walk ends after as many descriptors as the table holds (so a
//! loop cannot run forever), an indirect table must be a whole number of descriptors, inside
//! guest memory, and may not itself point to an indirect table. A chain that breaks a rule
//! simply ends there: the request parser then sees a short chain and refuses it with a status
//! (or length 0 without one), as it would a bad chain from the avail ring.

use virtio_bindings::virtio_ring::{VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend};

/// Bytes of one split-ring descriptor.
const DESC_BYTES: u64 = 16;
/// Largest indirect table walked (entries); the ring's own limit is 32768.
pub const INDIRECT_MAX: u32 = 32768;

/// The descriptors of the chain at `head` of the table at `table` (`queue_size` entries).
#[derive(Debug)]
pub struct ChainWalk<'m, M: ?Sized> {
    mem: &'m M,
    /// The table being walked (the ring's, or an indirect one) and its entries.
    table: GuestAddress,
    table_len: u32,
    /// In the indirect table: no further indirection.
    indirect: bool,
    next: Option<u16>,
    /// Descriptors still allowed.
    ttl: u32,
}

impl<'m, M: GuestMemoryBackend + ?Sized> ChainWalk<'m, M> {
    /// A walk of the chain whose head is `head` in the descriptor table at `table` of a ring
    /// with `queue_size` entries.
    pub fn new(mem: &'m M, table: GuestAddress, queue_size: u16, head: u16) -> Self {
        ChainWalk {
            mem,
            table,
            table_len: u32::from(queue_size),
            indirect: false,
            next: (head < queue_size).then_some(head),
            ttl: u32::from(queue_size),
        }
    }

    fn read(&self, index: u16) -> Option<Descriptor> {
        if u32::from(index) >= self.table_len {
            return None;
        }
        let addr = self.table.checked_add(u64::from(index) * DESC_BYTES)?;
        let mut raw = [0u8; DESC_BYTES as usize];
        self.mem.read_slice(&mut raw, addr).ok()?;
        let le64 = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or_default());
        let le32 = |b: &[u8]| u32::from_le_bytes(b.try_into().unwrap_or_default());
        let le16 = |b: &[u8]| u16::from_le_bytes(b.try_into().unwrap_or_default());
        Some(Descriptor::new(
            le64(&raw[0..8]),
            le32(&raw[8..12]),
            le16(&raw[12..14]),
            le16(&raw[14..16]),
        ))
    }
}

impl<M: GuestMemoryBackend + ?Sized> Iterator for ChainWalk<'_, M> {
    type Item = Descriptor;

    fn next(&mut self) -> Option<Descriptor> {
        loop {
            let index = self.next.take()?;
            if self.ttl == 0 {
                return None;
            }
            self.ttl -= 1;
            let d = self.read(index)?;
            if d.flags() & VRING_DESC_F_INDIRECT as u16 != 0 {
                // Only from the ring's table, only as the head, never with NEXT (§2.7.5.3.1).
                let len = d.len();
                if self.indirect
                    || d.flags() & VRING_DESC_F_NEXT as u16 != 0
                    || len == 0
                    || u64::from(len) % DESC_BYTES != 0
                    || u64::from(len) / DESC_BYTES > u64::from(INDIRECT_MAX)
                {
                    return None;
                }
                let entries = u32::try_from(u64::from(len) / DESC_BYTES).ok()?;
                let table = GuestAddress(d.addr().0);
                // The whole table must be guest memory.
                let last = table.checked_add(u64::from(len) - 1)?;
                if !self.mem.address_in_range(table) || !self.mem.address_in_range(last) {
                    return None;
                }
                self.table = table;
                self.table_len = entries;
                self.indirect = true;
                self.ttl = entries;
                self.next = Some(0);
                continue;
            }
            if d.flags() & VRING_DESC_F_NEXT as u16 != 0 {
                self.next = Some(d.next());
            }
            return Some(d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::virtio_ring::VRING_DESC_F_WRITE;
    use vm_memory::GuestMemoryMmap;

    const TABLE: u64 = 0x1000;
    const N: u16 = 8;

    fn mem() -> GuestMemoryMmap<()> {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_000)]).unwrap()
    }

    fn put(
        mem: &GuestMemoryMmap<()>,
        table: u64,
        i: u16,
        addr: u64,
        len: u32,
        flags: u16,
        next: u16,
    ) {
        let mut raw = [0u8; 16];
        raw[0..8].copy_from_slice(&addr.to_le_bytes());
        raw[8..12].copy_from_slice(&len.to_le_bytes());
        raw[12..14].copy_from_slice(&flags.to_le_bytes());
        raw[14..16].copy_from_slice(&next.to_le_bytes());
        mem.write_slice(&raw, GuestAddress(table + u64::from(i) * 16)).unwrap();
    }

    fn walk(mem: &GuestMemoryMmap<()>, head: u16) -> Vec<(u64, u32)> {
        ChainWalk::new(mem, GuestAddress(TABLE), N, head).map(|d| (d.addr().0, d.len())).collect()
    }

    const NEXT: u16 = VRING_DESC_F_NEXT as u16;
    const WRITE: u16 = VRING_DESC_F_WRITE as u16;
    const INDIRECT: u16 = VRING_DESC_F_INDIRECT as u16;

    #[test]
    fn direct_chains_are_followed_in_order() {
        let m = mem();
        put(&m, TABLE, 5, 0x100, 16, NEXT, 2);
        put(&m, TABLE, 2, 0x200, 512, NEXT | WRITE, 7);
        put(&m, TABLE, 7, 0x300, 1, WRITE, 0);
        assert_eq!(walk(&m, 5), [(0x100, 16), (0x200, 512), (0x300, 1)]);
        assert_eq!(walk(&m, 7), [(0x300, 1)]);
        assert!(walk(&m, N).is_empty(), "a head past the table");
    }

    #[test]
    fn loops_and_bad_indices_end_the_walk() {
        let m = mem();
        put(&m, TABLE, 0, 0x100, 16, NEXT, 1);
        put(&m, TABLE, 1, 0x200, 16, NEXT, 0);
        assert_eq!(walk(&m, 0).len(), usize::from(N), "a loop ends after the table's size");
        put(&m, TABLE, 3, 0x100, 16, NEXT, 200);
        assert_eq!(walk(&m, 3), [(0x100, 16)], "next past the table ends the chain");
    }

    #[test]
    fn indirect_tables() {
        let m = mem();
        let ind = 0x4000;
        put(&m, ind, 0, 0x100, 16, NEXT, 1);
        put(&m, ind, 1, 0x200, 4096, NEXT | WRITE, 2);
        put(&m, ind, 2, 0x300, 1, WRITE, 0);
        put(&m, TABLE, 4, ind, 48, INDIRECT, 0);
        assert_eq!(walk(&m, 4), [(0x100, 16), (0x200, 4096), (0x300, 1)]);
        // Not a whole number of descriptors; empty; with NEXT; nested; outside memory.
        put(&m, TABLE, 4, ind, 40, INDIRECT, 0);
        assert!(walk(&m, 4).is_empty());
        put(&m, TABLE, 4, ind, 0, INDIRECT, 0);
        assert!(walk(&m, 4).is_empty());
        put(&m, TABLE, 4, ind, 48, INDIRECT | NEXT, 1);
        assert!(walk(&m, 4).is_empty());
        put(&m, ind, 1, ind, 48, INDIRECT, 0);
        put(&m, TABLE, 4, ind, 48, INDIRECT, 0);
        assert_eq!(walk(&m, 4), [(0x100, 16)], "an indirect inside an indirect ends it");
        put(&m, TABLE, 4, 0xff00, 0x1000, INDIRECT, 0);
        assert!(walk(&m, 4).is_empty(), "a table past the end of guest memory");
        // A loop inside an indirect table ends after its entries.
        put(&m, ind, 0, 0x100, 16, NEXT, 1);
        put(&m, ind, 1, 0x100, 16, NEXT, 0);
        put(&m, TABLE, 4, ind, 32, INDIRECT, 0);
        assert_eq!(walk(&m, 4).len(), 2);
    }
}
