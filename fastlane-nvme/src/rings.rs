//! An SQ/CQ ring pair in DMA memory and its doorbells: what the admin queue
//! ([`super::controller`]) and every I/O queue ([`super::queue`]) push commands into and reap
//! completions from. Depends only on the command layouts.

use std::sync::atomic::{fence, Ordering};

use super::cmd::{Cqe, Sqe};

/// An SQ/CQ pair in DMA memory and its doorbells.
pub(crate) struct Rings {
    sq: *mut Sqe,
    cq: *mut Cqe,
    pub(crate) entries: u32,
    sq_tail: u32,
    sq_tail_rung: u32,
    cq_head: u32,
    cq_head_rung: u32,
    phase: bool,
    sq_db: *mut u32,
    cq_db: *mut u32,
}

// SAFETY: the pointers name DMA memory and doorbells whose owners (the queue's region, the
// controller's BAR) travel with the `Rings`' owner; only raw volatile accesses are made.
unsafe impl Send for Rings {}

impl Rings {
    /// # Safety
    ///
    /// `sq` and `cq` point to `entries` zeroed entries each in DMA memory, and `sq_db`,
    /// `cq_db` to the queue's doorbells in BAR0; all stay valid as long as the `Rings`.
    pub(crate) unsafe fn new(
        sq: *mut Sqe,
        cq: *mut Cqe,
        entries: u32,
        sq_db: *mut u32,
        cq_db: *mut u32,
    ) -> Rings {
        Rings {
            sq,
            cq,
            entries,
            sq_tail: 0,
            sq_tail_rung: 0,
            cq_head: 0,
            cq_head_rung: 0,
            phase: true,
            sq_db,
            cq_db,
        }
    }

    /// Write `sqe` at the tail (the doorbell is rung by `ring_sq`). The caller keeps at most
    /// `entries - 1` commands outstanding, so the slot is free.
    pub(crate) fn push(&mut self, sqe: &Sqe) {
        // SAFETY: `sq_tail < entries`, inside the SQ (`new`'s contract); the controller does
        // not read this slot until the doorbell moves past it; a volatile store, no reference.
        unsafe { self.sq.wrapping_add(self.sq_tail as usize).write_volatile(*sqe) };
        self.sq_tail = (self.sq_tail + 1) % self.entries;
    }

    /// Tell the controller about new SQ entries (one doorbell store), if any.
    pub(crate) fn ring_sq(&mut self) {
        if self.sq_tail == self.sq_tail_rung {
            return;
        }
        // Orders the SQ entry stores above before the doorbell store below; the controller
        // fetches the entries after it sees the doorbell (x86: stores stay in order).
        fence(Ordering::SeqCst);
        // SAFETY: the SQ tail doorbell in BAR0 (`new`'s contract); a volatile MMIO store.
        unsafe { self.sq_db.write_volatile(self.sq_tail) };
        self.sq_tail_rung = self.sq_tail;
    }

    /// Whether a new completion entry is waiting (one volatile load).
    pub(crate) fn ready(&self) -> bool {
        let status_ptr = self
            .cq
            .wrapping_add(self.cq_head as usize)
            .cast::<u8>()
            .wrapping_add(std::mem::offset_of!(Cqe, status))
            .cast::<u16>();
        // SAFETY: `cq_head < entries`, inside the CQ; a volatile load of the status word,
        // which the controller writes last (it pairs with the Acquire fence in `pop`).
        let status = unsafe { status_ptr.read_volatile() };
        (status & 1 != 0) == self.phase
    }

    /// Take the next completion entry, if its phase tag says it is new.
    pub(crate) fn pop(&mut self) -> Option<Cqe> {
        if !self.ready() {
            return None;
        }
        // Acquire: the rest of the entry is read after its phase tag was seen flipped.
        fence(Ordering::Acquire);
        // SAFETY: as in `ready`; the controller does not rewrite this entry until we move
        // the head doorbell past it.
        let cqe = unsafe { self.cq.wrapping_add(self.cq_head as usize).read_volatile() };
        self.cq_head += 1;
        if self.cq_head == self.entries {
            self.cq_head = 0;
            self.phase = !self.phase;
        }
        Some(cqe)
    }

    /// Give consumed CQ entries back to the controller (one doorbell store), if any.
    pub(crate) fn ring_cq(&mut self) {
        if self.cq_head == self.cq_head_rung {
            return;
        }
        // SAFETY: the CQ head doorbell in BAR0; a volatile MMIO store.
        unsafe { self.cq_db.write_volatile(self.cq_head) };
        self.cq_head_rung = self.cq_head;
    }
}
