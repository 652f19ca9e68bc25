//! Order-book reconstruction from ITCH 5.0, per stock locate.
//!
//! Orders live in one fixed-capacity open-addressing table keyed by order reference
//! (allocated at construction; a full table is counted, not grown). Each locate's book keeps
//! its price levels per side in a vector sorted so that the best price is at the end: adds,
//! executions and cancels near the top of the book touch the end of the vector. A locate's
//! book and level vectors are allocated the first time the locate is seen; after that the
//! per-message path allocates only if a side outgrows its reserved levels.
//!
//! Semantics (the reference model in [`crate::reference`] implements the same ones, naively):
//! - `A`/`F` add an order; a reference already live is a [`BookAnomaly::DuplicateRef`], zero
//!   shares a [`BookAnomaly::ZeroShares`]; both are ignored.
//! - `E`/`C`/`X` take shares off an order (the order's resting price, not the `C` price); at
//!   zero shares the order goes. Taking more than is left is [`BookAnomaly::Overfill`] and
//!   removes the order.
//! - `D` removes an order. `U` removes the old order and adds the new reference with the old
//!   side, new price and shares (a live new reference: `DuplicateRef`, nothing changes).
//! - An order reference never added is [`BookAnomaly::UnknownRef`]; a message whose locate
//!   is not the order's is [`BookAnomaly::LocateMismatch`]; both are ignored.

use crate::itch::{Body, Message, Side};

/// Sizing of the order table and books.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BookConfig {
    /// Live orders the table holds; more are counted as [`BookAnomaly::CapacityExhausted`].
    pub orders_max: usize,
    /// Price levels reserved per side when a locate's book is created.
    pub levels_reserved: usize,
}

impl Default for BookConfig {
    fn default() -> Self {
        Self { orders_max: 1 << 20, levels_reserved: 256 }
    }
}

/// One price level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Level {
    /// `Price(4)`.
    pub price: u32,
    /// Shares resting at this price.
    pub shares: u64,
    /// Orders resting at this price.
    pub orders: u32,
}

/// Best bid and ask of one locate; a price of 0 with 0 shares means the side is empty.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TopOfBook {
    /// The stock locate.
    pub locate: u16,
    /// Best bid, `Price(4)`.
    pub bid_price: u32,
    /// Shares at the best bid.
    pub bid_shares: u64,
    /// Best ask, `Price(4)`.
    pub ask_price: u32,
    /// Shares at the best ask.
    pub ask_shares: u64,
}

/// Something in the feed that the book could not apply (counted, then ignored).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BookAnomaly {
    /// An execute/cancel/delete/replace named an order that is not live.
    #[error("order {order_ref} is not live")]
    UnknownRef {
        /// The order reference the message named.
        order_ref: u64,
    },
    /// An add (or a replace's new reference) named an order that is already live.
    #[error("order {order_ref} is already live")]
    DuplicateRef {
        /// The order reference the message named.
        order_ref: u64,
    },
    /// An add or replace with zero shares.
    #[error("order {order_ref} has zero shares")]
    ZeroShares {
        /// The order reference the message named.
        order_ref: u64,
    },
    /// The message's locate is not the order's.
    #[error("order {order_ref} belongs to locate {order_locate}, message says {locate}")]
    LocateMismatch {
        /// The order reference the message named.
        order_ref: u64,
        /// The stock locate the order was added under.
        order_locate: u16,
        /// The stock locate of the message.
        locate: u16,
    },
    /// More shares executed or cancelled than the order had (the order is removed).
    #[error("order {order_ref}: {shares} shares taken, {left} left")]
    Overfill {
        /// The order reference the message named.
        order_ref: u64,
        /// Shares the message executed or cancelled.
        shares: u32,
        /// Shares the order had left.
        left: u32,
    },
    /// The order table is full; the add was dropped.
    #[error("order table full ({orders_max} orders); order {order_ref} dropped")]
    CapacityExhausted {
        /// The order reference of the dropped add.
        order_ref: u64,
        /// The table's capacity ([`BookConfig`]'s).
        orders_max: usize,
    },
}

/// Counters of what the books did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BookStats {
    /// Orders added (`A`, `F`).
    pub adds: u64,
    /// Executions applied (`E`, `C`).
    pub executions: u64,
    /// Partial cancels applied (`X`).
    pub cancels: u64,
    /// Deletes applied (`D`).
    pub deletes: u64,
    /// Replaces applied (`U`).
    pub replaces: u64,
    /// Messages that changed a book (the "book updates" of the benchmark).
    pub updates: u64,
    /// Top-of-book changes emitted.
    pub top_changes: u64,
    /// [`BookAnomaly::UnknownRef`] seen.
    pub unknown_ref: u64,
    /// [`BookAnomaly::DuplicateRef`] seen.
    pub duplicate_ref: u64,
    /// [`BookAnomaly::ZeroShares`] seen.
    pub zero_shares: u64,
    /// [`BookAnomaly::LocateMismatch`] seen.
    pub locate_mismatch: u64,
    /// [`BookAnomaly::Overfill`] seen.
    pub overfill: u64,
    /// [`BookAnomaly::CapacityExhausted`] seen.
    pub capacity_exhausted: u64,
}

impl BookStats {
    /// All anomalies.
    pub fn anomalies(&self) -> u64 {
        self.unknown_ref
            + self.duplicate_ref
            + self.zero_shares
            + self.locate_mismatch
            + self.overfill
            + self.capacity_exhausted
    }

    fn count(&mut self, a: &BookAnomaly) {
        match a {
            BookAnomaly::UnknownRef { .. } => self.unknown_ref += 1,
            BookAnomaly::DuplicateRef { .. } => self.duplicate_ref += 1,
            BookAnomaly::ZeroShares { .. } => self.zero_shares += 1,
            BookAnomaly::LocateMismatch { .. } => self.locate_mismatch += 1,
            BookAnomaly::Overfill { .. } => self.overfill += 1,
            BookAnomaly::CapacityExhausted { .. } => self.capacity_exhausted += 1,
        }
    }
}

/// A live order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Order {
    /// The order reference number (ITCH's unique id of the order for the day).
    pub order_ref: u64,
    /// Limit price, `Price(4)`.
    pub price: u32,
    /// Shares still open.
    pub shares: u32,
    /// The stock locate it was added under.
    pub locate: u16,
    /// Buy or sell.
    pub side: Side,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    order: Order,
    used: bool,
}

const EMPTY_SLOT: Slot = Slot {
    order: Order { order_ref: 0, price: 0, shares: 0, locate: 0, side: Side::Buy },
    used: false,
};

/// Open addressing, linear probing, backward-shift deletion (no tombstones).
#[derive(Debug)]
struct OrderTable {
    slots: Box<[Slot]>,
    mask: usize,
    len: usize,
    len_max: usize,
}

impl OrderTable {
    fn new(orders_max: usize) -> Self {
        let orders_max = orders_max.max(1);
        // Load factor at most 1/2.
        let cap = (orders_max * 2).next_power_of_two();
        Self {
            slots: vec![EMPTY_SLOT; cap].into_boxed_slice(),
            mask: cap - 1,
            len: 0,
            len_max: orders_max,
        }
    }

    #[inline]
    fn home(&self, order_ref: u64) -> usize {
        // NASDAQ assigns references in increasing order, so the low bits (folded with the high
        // ones) keep the live orders, mostly recent, in a compact window of the table: a
        // scattering hash made every lookup a cache miss and the book 5x slower. A feed crafted
        // to collide only lengthens probes (bounded by the table size): slower, never unsafe.
        (order_ref ^ (order_ref >> 32)) as usize & self.mask
    }

    #[inline]
    fn find(&self, order_ref: u64) -> Option<usize> {
        let mut i = self.home(order_ref);
        // Bounded: the table is never full (load <= 1/2), so an empty slot ends the probe.
        for _ in 0..=self.mask {
            let s = &self.slots[i];
            if !s.used {
                return None;
            }
            if s.order.order_ref == order_ref {
                return Some(i);
            }
            i = (i + 1) & self.mask;
        }
        None
    }

    /// Caller checked `find` is `None` and `len < len_max`.
    #[inline]
    fn insert(&mut self, order: Order) {
        let mut i = self.home(order.order_ref);
        for _ in 0..=self.mask {
            if !self.slots[i].used {
                self.slots[i] = Slot { order, used: true };
                self.len += 1;
                return;
            }
            i = (i + 1) & self.mask;
        }
        debug_assert!(false, "order table has no empty slot at load {}", self.len);
    }

    #[inline]
    fn remove_at(&mut self, mut hole: usize) {
        self.slots[hole].used = false;
        self.len -= 1;
        let mut i = (hole + 1) & self.mask;
        for _ in 0..self.mask {
            let s = self.slots[i];
            if !s.used {
                break;
            }
            let home = self.home(s.order.order_ref);
            // Move `s` into the hole if its home is not cyclically within (hole, i].
            let dist_home = i.wrapping_sub(home) & self.mask;
            let dist_hole = i.wrapping_sub(hole) & self.mask;
            if dist_home >= dist_hole {
                self.slots[hole] = s;
                self.slots[i].used = false;
                hole = i;
            }
            i = (i + 1) & self.mask;
        }
    }
}

/// One locate's price levels.
#[derive(Debug)]
struct Book {
    /// Ascending by price: best bid last.
    bids: Vec<Level>,
    /// Descending by price: best ask last.
    asks: Vec<Level>,
}

impl Book {
    fn new(levels_reserved: usize) -> Self {
        Self {
            bids: Vec::with_capacity(levels_reserved),
            asks: Vec::with_capacity(levels_reserved),
        }
    }

    #[inline]
    fn side_mut(&mut self, side: Side) -> &mut Vec<Level> {
        match side {
            Side::Buy => &mut self.bids,
            Side::Sell => &mut self.asks,
        }
    }

    /// Index of `price` in a side, or where it would go. The side is sorted by `key`.
    #[inline]
    fn search(levels: &[Level], side: Side, price: u32) -> Result<usize, usize> {
        // Scan from the top (the end): most activity is near the best price.
        let key = |p: u32| match side {
            Side::Buy => p,
            Side::Sell => u32::MAX - p,
        };
        let k = key(price);
        let n = levels.len();
        for back in 0..n.min(8) {
            let i = n - 1 - back;
            let ki = key(levels[i].price);
            if ki == k {
                return Ok(i);
            }
            if ki < k {
                return Err(i + 1);
            }
        }
        levels.binary_search_by(|l| key(l.price).cmp(&k))
    }

    #[inline]
    fn add(&mut self, side: Side, price: u32, shares: u32) {
        let levels = self.side_mut(side);
        match Self::search(levels, side, price) {
            Ok(i) => {
                levels[i].shares += u64::from(shares);
                levels[i].orders += 1;
            }
            Err(i) => levels.insert(i, Level { price, shares: u64::from(shares), orders: 1 }),
        }
    }

    /// Take `shares` off the level at `price`; `order_gone` when the order left the level.
    #[inline]
    fn reduce(&mut self, side: Side, price: u32, shares: u32, order_gone: bool) {
        let levels = self.side_mut(side);
        if let Ok(i) = Self::search(levels, side, price) {
            let l = &mut levels[i];
            l.shares -= u64::from(shares);
            if order_gone {
                l.orders -= 1;
            }
            if l.orders == 0 {
                debug_assert_eq!(l.shares, 0, "level at {price} empty of orders but not shares");
                levels.remove(i);
            }
        } else {
            debug_assert!(false, "live order at {price} has no level");
        }
    }

    fn top(&self, locate: u16) -> TopOfBook {
        let (bid_price, bid_shares) = self.bids.last().map_or((0, 0), |l| (l.price, l.shares));
        let (ask_price, ask_shares) = self.asks.last().map_or((0, 0), |l| (l.price, l.shares));
        TopOfBook { locate, bid_price, bid_shares, ask_price, ask_shares }
    }
}

/// Books for every locate, and the orders resting in them.
#[derive(Debug)]
pub struct OrderBooks {
    config: BookConfig,
    orders: OrderTable,
    books: Vec<Option<Box<Book>>>,
    stats: BookStats,
    last_anomaly: Option<BookAnomaly>,
}

impl OrderBooks {
    /// Empty books; the order table is allocated now.
    pub fn new(config: BookConfig) -> Self {
        let mut books = Vec::with_capacity(usize::from(u16::MAX) + 1);
        books.resize_with(usize::from(u16::MAX) + 1, || None);
        Self {
            config,
            orders: OrderTable::new(config.orders_max),
            books,
            stats: BookStats::default(),
            last_anomaly: None,
        }
    }

    /// Counters so far.
    pub fn stats(&self) -> &BookStats {
        &self.stats
    }

    /// The most recent anomaly, for reports.
    pub fn last_anomaly(&self) -> Option<BookAnomaly> {
        self.last_anomaly
    }

    /// Live orders.
    pub fn live_orders(&self) -> usize {
        self.orders.len
    }

    /// A live order.
    pub fn order(&self, order_ref: u64) -> Option<Order> {
        self.orders.find(order_ref).map(|i| self.orders.slots[i].order)
    }

    /// Best bid and ask of `locate` (empty if the locate has no book).
    pub fn top(&self, locate: u16) -> TopOfBook {
        match &self.books[usize::from(locate)] {
            Some(b) => b.top(locate),
            None => TopOfBook { locate, ..TopOfBook::default() },
        }
    }

    /// Levels of one side, best first.
    pub fn levels(&self, locate: u16, side: Side) -> impl Iterator<Item = Level> + '_ {
        let levels: &[Level] = match &self.books[usize::from(locate)] {
            Some(b) => match side {
                Side::Buy => &b.bids,
                Side::Sell => &b.asks,
            },
            None => &[],
        };
        levels.iter().rev().copied()
    }

    /// Locates that have a book with at least one level, ascending.
    pub fn active_locates(&self) -> impl Iterator<Item = u16> + '_ {
        self.books.iter().enumerate().filter_map(|(i, b)| {
            b.as_ref().filter(|b| !b.bids.is_empty() || !b.asks.is_empty()).map(|_| i as u16)
        })
    }

    fn anomaly(&mut self, a: BookAnomaly) {
        self.stats.count(&a);
        self.last_anomaly = Some(a);
    }

    #[inline]
    fn book(&mut self, locate: u16) -> &mut Book {
        let levels = self.config.levels_reserved;
        self.books[usize::from(locate)].get_or_insert_with(|| Box::new(Book::new(levels)))
    }

    /// Look up a live order named by a message of `locate`.
    #[inline]
    fn live(&mut self, order_ref: u64, locate: u16) -> Option<usize> {
        let Some(i) = self.orders.find(order_ref) else {
            self.anomaly(BookAnomaly::UnknownRef { order_ref });
            return None;
        };
        let order_locate = self.orders.slots[i].order.locate;
        if order_locate != locate {
            self.anomaly(BookAnomaly::LocateMismatch { order_ref, order_locate, locate });
            return None;
        }
        Some(i)
    }

    #[inline]
    fn add(&mut self, order: Order) -> bool {
        if order.shares == 0 {
            self.anomaly(BookAnomaly::ZeroShares { order_ref: order.order_ref });
            return false;
        }
        if self.orders.find(order.order_ref).is_some() {
            self.anomaly(BookAnomaly::DuplicateRef { order_ref: order.order_ref });
            return false;
        }
        if self.orders.len >= self.orders.len_max {
            let orders_max = self.orders.len_max;
            self.anomaly(BookAnomaly::CapacityExhausted { order_ref: order.order_ref, orders_max });
            return false;
        }
        self.orders.insert(order);
        self.book(order.locate).add(order.side, order.price, order.shares);
        true
    }

    #[inline]
    fn take(&mut self, slot: usize, shares: u32) {
        let o = self.orders.slots[slot].order;
        let taken = shares.min(o.shares);
        if shares > o.shares {
            self.anomaly(BookAnomaly::Overfill { order_ref: o.order_ref, shares, left: o.shares });
        }
        let gone = taken == o.shares;
        self.book(o.locate).reduce(o.side, o.price, taken, gone);
        if gone {
            self.orders.remove_at(slot);
        } else {
            self.orders.slots[slot].order.shares -= taken;
        }
    }

    /// Apply one message. Returns the locate's new top of book when the message changed it.
    #[inline]
    pub fn apply(&mut self, m: &Message) -> Option<TopOfBook> {
        let locate = match m.body {
            Body::AddOrder { .. }
            | Body::OrderExecuted { .. }
            | Body::OrderExecutedWithPrice { .. }
            | Body::OrderCancel { .. }
            | Body::OrderDelete { .. }
            | Body::OrderReplace { .. } => m.locate,
            _ => return None,
        };
        let before = self.top(locate);
        let changed = match m.body {
            Body::AddOrder { order_ref, side, shares, price, .. } => {
                self.stats.adds += 1;
                self.add(Order { order_ref, price, shares, locate, side })
            }
            Body::OrderExecuted { order_ref, shares, .. }
            | Body::OrderExecutedWithPrice { order_ref, shares, .. } => {
                self.stats.executions += 1;
                self.live(order_ref, locate).map(|i| self.take(i, shares)).is_some()
            }
            Body::OrderCancel { order_ref, shares } => {
                self.stats.cancels += 1;
                self.live(order_ref, locate).map(|i| self.take(i, shares)).is_some()
            }
            Body::OrderDelete { order_ref } => {
                self.stats.deletes += 1;
                match self.live(order_ref, locate) {
                    Some(i) => {
                        let left = self.orders.slots[i].order.shares;
                        self.take(i, left);
                        true
                    }
                    None => false,
                }
            }
            Body::OrderReplace { old_ref, new_ref, shares, price } => {
                self.stats.replaces += 1;
                match self.live(old_ref, locate) {
                    None => false,
                    Some(_) if new_ref != old_ref && self.orders.find(new_ref).is_some() => {
                        self.anomaly(BookAnomaly::DuplicateRef { order_ref: new_ref });
                        false
                    }
                    Some(i) => {
                        let old = self.orders.slots[i].order;
                        self.take(i, old.shares);
                        self.add(Order {
                            order_ref: new_ref,
                            price,
                            shares,
                            locate,
                            side: old.side,
                        });
                        true
                    }
                }
            }
            _ => false,
        };
        if changed {
            self.stats.updates += 1;
        }
        let after = self.top(locate);
        if after != before {
            self.stats.top_changes += 1;
            Some(after)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::itch::stock_from_str;

    fn msg(locate: u16, body: Body) -> Message {
        Message { msg_type: body.msg_type(), locate, tracking: 0, timestamp_ns: 0, body }
    }

    fn add(r: u64, side: Side, shares: u32, price: u32) -> Body {
        Body::AddOrder {
            order_ref: r,
            side,
            shares,
            stock: stock_from_str("AAPL"),
            price,
            attribution: None,
        }
    }

    #[test]
    fn add_execute_cancel_delete_replace() {
        let mut b = OrderBooks::new(BookConfig { orders_max: 16, levels_reserved: 4 });
        let t = b.apply(&msg(7, add(1, Side::Buy, 100, 1_000_000))).unwrap();
        assert_eq!((t.bid_price, t.bid_shares, t.ask_price), (1_000_000, 100, 0));
        assert!(b.apply(&msg(7, add(2, Side::Buy, 50, 990_000))).is_none());
        let t = b.apply(&msg(7, add(3, Side::Sell, 10, 1_010_000))).unwrap();
        assert_eq!((t.ask_price, t.ask_shares), (1_010_000, 10));
        let t = b
            .apply(&msg(7, Body::OrderExecuted { order_ref: 1, shares: 40, match_number: 1 }))
            .unwrap();
        assert_eq!(t.bid_shares, 60);
        let t = b.apply(&msg(7, Body::OrderCancel { order_ref: 1, shares: 60 })).unwrap();
        assert_eq!((t.bid_price, t.bid_shares), (990_000, 50));
        assert!(b.order(1).is_none());
        let t = b
            .apply(&msg(
                7,
                Body::OrderReplace { old_ref: 2, new_ref: 9, shares: 5, price: 995_000 },
            ))
            .unwrap();
        assert_eq!((t.bid_price, t.bid_shares), (995_000, 5));
        assert_eq!(b.order(9).unwrap().side, Side::Buy);
        let t = b.apply(&msg(7, Body::OrderDelete { order_ref: 3 })).unwrap();
        assert_eq!((t.ask_price, t.ask_shares), (0, 0));
        assert_eq!(b.live_orders(), 1);
        assert_eq!(b.stats().anomalies(), 0);
    }

    #[test]
    fn anomalies_are_counted_not_applied() {
        let mut b = OrderBooks::new(BookConfig { orders_max: 2, levels_reserved: 1 });
        assert!(b.apply(&msg(1, Body::OrderDelete { order_ref: 5 })).is_none());
        assert_eq!(b.stats().unknown_ref, 1);
        b.apply(&msg(1, add(1, Side::Sell, 10, 100)));
        b.apply(&msg(1, add(1, Side::Sell, 10, 100)));
        assert_eq!(b.stats().duplicate_ref, 1);
        b.apply(&msg(2, Body::OrderDelete { order_ref: 1 }));
        assert_eq!(b.stats().locate_mismatch, 1);
        b.apply(&msg(1, add(2, Side::Sell, 0, 100)));
        assert_eq!(b.stats().zero_shares, 1);
        b.apply(&msg(1, add(3, Side::Sell, 1, 100)));
        b.apply(&msg(1, add(4, Side::Sell, 1, 100)));
        assert_eq!(b.stats().capacity_exhausted, 1);
        b.apply(&msg(1, Body::OrderCancel { order_ref: 1, shares: 11 }));
        assert_eq!(b.stats().overfill, 1);
        assert!(b.order(1).is_none());
        assert_eq!(b.top(1).ask_shares, 1);
    }

    #[test]
    fn table_survives_churn() {
        // Stride 1: spread keys; stride 256: every key has the same home slot (worst case).
        for (stride, steps) in [(1u64, 20_000), (256, 3_000)] {
            table_churn(stride, steps);
        }
    }

    fn table_churn(stride: u64, steps: u64) {
        let mut t = OrderTable::new(64);
        let mut live = std::collections::HashSet::new();
        let mut x = 1u64;
        for step in 0..steps {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let r = (x % 200) * stride;
            if live.contains(&r) {
                let i = t.find(r).unwrap();
                t.remove_at(i);
                live.remove(&r);
            } else if t.len < t.len_max {
                t.insert(Order {
                    order_ref: r,
                    price: step as u32,
                    shares: 1,
                    locate: 0,
                    side: Side::Buy,
                });
                live.insert(r);
            }
            for k in (0..200).map(|k| k * stride) {
                assert_eq!(t.find(k).is_some(), live.contains(&k), "step {step} ref {k}");
            }
        }
    }
}
