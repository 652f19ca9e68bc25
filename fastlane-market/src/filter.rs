//! Filtering by symbol set.
//!
//! Most ITCH messages name their instrument only by stock locate; the symbol appears in the
//! Stock Directory (`R`) and on adds and a few other types. The filter learns the locates of
//! the wanted symbols from the messages that carry a symbol and then admits every message of
//! those locates, plus market-wide messages (locate 0). Its state is a fixed bitmap: no
//! allocation per message.

use crate::itch::{Message, Stock};

/// Admits the messages of a set of symbols.
#[derive(Debug, Clone)]
pub struct SymbolFilter {
    wanted: Vec<Stock>,
    locates: Box<[u64; 1024]>,
    admitted: u64,
    dropped: u64,
}

impl SymbolFilter {
    /// A filter for `symbols` (8-byte space-padded fields, see [`crate::itch::stock_from_str`]).
    pub fn new(symbols: &[Stock]) -> Self {
        Self { wanted: symbols.to_vec(), locates: Box::new([0; 1024]), admitted: 0, dropped: 0 }
    }

    /// The wanted symbols.
    pub fn symbols(&self) -> &[Stock] {
        &self.wanted
    }

    /// Whether `locate` has been learnt as one of the wanted symbols.
    #[inline]
    pub fn has_locate(&self, locate: u16) -> bool {
        self.locates[usize::from(locate >> 6)] & (1 << (locate & 63)) != 0
    }

    /// Learn from `m` and say whether it passes.
    #[inline]
    pub fn admit(&mut self, m: &Message) -> bool {
        if let Some(stock) = m.stock() {
            if !self.has_locate(m.locate) && self.wanted.contains(stock) {
                self.locates[usize::from(m.locate >> 6)] |= 1 << (m.locate & 63);
            }
        }
        let pass = m.locate == 0 || self.has_locate(m.locate);
        if pass {
            self.admitted += 1;
        } else {
            self.dropped += 1;
        }
        pass
    }

    /// Messages admitted so far.
    pub fn admitted(&self) -> u64 {
        self.admitted
    }

    /// Messages dropped so far.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::itch::{stock_from_str, Body, Side};

    #[test]
    fn learns_locates_from_adds_and_passes_market_wide() {
        let mut f = SymbolFilter::new(&[stock_from_str("MSFT")]);
        let m = |locate, body| Message { msg_type: 0, locate, tracking: 0, timestamp_ns: 0, body };
        assert!(f.admit(&m(0, Body::SystemEvent { event_code: b'O' })));
        assert!(!f.admit(&m(3, Body::OrderDelete { order_ref: 1 })));
        let add = |s| Body::AddOrder {
            order_ref: 1,
            side: Side::Buy,
            shares: 1,
            stock: stock_from_str(s),
            price: 1,
            attribution: None,
        };
        assert!(!f.admit(&m(4, add("AAPL"))));
        assert!(f.admit(&m(3, add("MSFT"))));
        assert!(f.admit(&m(3, Body::OrderDelete { order_ref: 1 })));
        assert!(!f.admit(&m(4, Body::OrderDelete { order_ref: 1 })));
        assert_eq!((f.admitted(), f.dropped()), (3, 3));
    }
}
