//! A naive order-book model (hash map of orders, `BTreeMap` of levels per side) with the same
//! semantics as [`crate::book::OrderBooks`]: the oracle that property tests and the book fuzz
//! target compare the real book against after every message. Not for production use.

use std::collections::{BTreeMap, HashMap};

use crate::book::{BookStats, Level, Order, TopOfBook};
use crate::itch::{Body, Message, Side};

/// The reference books.
#[derive(Debug, Default)]
pub struct ReferenceBooks {
    orders_max: usize,
    orders: HashMap<u64, Order>,
    /// (locate, side) -> price -> (shares, orders)
    levels: HashMap<(u16, Side), BTreeMap<u32, (u64, u32)>>,
    /// Same counters as the real book.
    pub stats: BookStats,
}

impl ReferenceBooks {
    /// Empty books holding at most `orders_max` live orders.
    pub fn new(orders_max: usize) -> Self {
        Self { orders_max: orders_max.max(1), ..Self::default() }
    }

    /// Levels of one side, best first.
    pub fn levels(&self, locate: u16, side: Side) -> Vec<Level> {
        let Some(m) = self.levels.get(&(locate, side)) else { return Vec::new() };
        let it = m.iter().map(|(&price, &(shares, orders))| Level { price, shares, orders });
        match side {
            Side::Buy => it.rev().collect(),
            Side::Sell => it.collect(),
        }
    }

    /// Best bid and ask.
    pub fn top(&self, locate: u16) -> TopOfBook {
        let b = self.levels(locate, Side::Buy).first().copied();
        let a = self.levels(locate, Side::Sell).first().copied();
        TopOfBook {
            locate,
            bid_price: b.map_or(0, |l| l.price),
            bid_shares: b.map_or(0, |l| l.shares),
            ask_price: a.map_or(0, |l| l.price),
            ask_shares: a.map_or(0, |l| l.shares),
        }
    }

    /// Live orders.
    pub fn live_orders(&self) -> usize {
        self.orders.len()
    }

    fn level_add(&mut self, o: &Order) {
        let e = self.levels.entry((o.locate, o.side)).or_default().entry(o.price).or_insert((0, 0));
        e.0 += u64::from(o.shares);
        e.1 += 1;
    }

    // Callers pass a live order (they checked `orders`); a live order always has its side and
    // price level (`level_add` made them, and they go only when the level's last order goes),
    // so the `expect`s cannot fail. A failure would be a bug in this oracle, not bad input.
    #[allow(clippy::expect_used)]
    fn take(&mut self, order_ref: u64, shares: u32) {
        let o = self.orders[&order_ref];
        if shares > o.shares {
            self.stats.overfill += 1;
        }
        let taken = shares.min(o.shares);
        let side = self.levels.get_mut(&(o.locate, o.side)).expect("side of a live order");
        let lvl = side.get_mut(&o.price).expect("level of a live order");
        lvl.0 -= u64::from(taken);
        if taken == o.shares {
            lvl.1 -= 1;
            self.orders.remove(&order_ref);
        } else {
            self.orders.get_mut(&order_ref).expect("live").shares -= taken;
        }
        if lvl.1 == 0 {
            side.remove(&o.price);
        }
    }

    fn live(&mut self, order_ref: u64, locate: u16) -> bool {
        match self.orders.get(&order_ref) {
            None => {
                self.stats.unknown_ref += 1;
                false
            }
            Some(o) if o.locate != locate => {
                self.stats.locate_mismatch += 1;
                false
            }
            Some(_) => true,
        }
    }

    fn add(&mut self, o: Order) -> bool {
        if o.shares == 0 {
            self.stats.zero_shares += 1;
            false
        } else if self.orders.contains_key(&o.order_ref) {
            self.stats.duplicate_ref += 1;
            false
        } else if self.orders.len() >= self.orders_max {
            self.stats.capacity_exhausted += 1;
            false
        } else {
            self.orders.insert(o.order_ref, o);
            self.level_add(&o);
            true
        }
    }

    /// Apply one message; returns the new top of book when it changed.
    pub fn apply(&mut self, m: &Message) -> Option<TopOfBook> {
        let locate = m.locate;
        let before = self.top(locate);
        let changed = match m.body {
            Body::AddOrder { order_ref, side, shares, price, .. } => {
                self.stats.adds += 1;
                self.add(Order { order_ref, price, shares, locate, side })
            }
            Body::OrderExecuted { order_ref, shares, .. }
            | Body::OrderExecutedWithPrice { order_ref, shares, .. } => {
                self.stats.executions += 1;
                self.live(order_ref, locate) && {
                    self.take(order_ref, shares);
                    true
                }
            }
            Body::OrderCancel { order_ref, shares } => {
                self.stats.cancels += 1;
                self.live(order_ref, locate) && {
                    self.take(order_ref, shares);
                    true
                }
            }
            Body::OrderDelete { order_ref } => {
                self.stats.deletes += 1;
                self.live(order_ref, locate) && {
                    let left = self.orders[&order_ref].shares;
                    self.take(order_ref, left);
                    true
                }
            }
            Body::OrderReplace { old_ref, new_ref, shares, price } => {
                self.stats.replaces += 1;
                if !self.live(old_ref, locate) {
                    false
                } else if new_ref != old_ref && self.orders.contains_key(&new_ref) {
                    self.stats.duplicate_ref += 1;
                    false
                } else {
                    let old = self.orders[&old_ref];
                    self.take(old_ref, old.shares);
                    self.add(Order { order_ref: new_ref, price, shares, locate, side: old.side });
                    true
                }
            }
            _ => return None,
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
