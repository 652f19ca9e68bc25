//! The normalized event: the fixed-size record the card writes for each decoded message and
//! each top-of-book change (64 bytes, one cache line, `#[repr(C)]`, part of the ABI).
//!
//! Field use by kind (see `docs/fpga-abi.md` for the full table): `order_ref` is the order
//! reference (`U`: the old one), `aux_ref` the new reference (`U`) or match number
//! (`E`/`C`/`P`/`Q`/`B`), `shares`/`price` the message's quantity and `Price(4)`, `code` the
//! type's main one-byte field (event code, trading state, cross type, ...). For
//! [`KIND_TOP_OF_BOOK`]: `price`/`shares` are the best bid, `price2`/`shares2` the best ask.

use crate::book::TopOfBook;
use crate::itch::{Body, Message, Stock};

/// `kind` of a top-of-book change (not an ITCH type byte).
pub const KIND_TOP_OF_BOOK: u8 = 0x01;

/// One normalized event.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Event {
    /// The ITCH type byte, or [`KIND_TOP_OF_BOOK`].
    pub kind: u8,
    /// `B`, `S` or 0.
    pub side: u8,
    /// The type's main one-byte field, or 0.
    pub code: u8,
    /// Bit 0: `F` (attributed add), bit 1: `C` printable.
    pub flags: u8,
    /// The message's stock locate (0 for market-wide messages).
    pub locate: u16,
    /// The message's tracking number.
    pub tracking: u16,
    /// Nanoseconds since midnight (the message's timestamp).
    pub timestamp_ns: u64,
    /// The stock symbol, space-padded; all spaces for types without one and for
    /// [`KIND_TOP_OF_BOOK`].
    pub stock: Stock,
    /// The order reference (`U`: the old one; `V`: MWCB level 1, `Price(8)`), or 0.
    pub order_ref: u64,
    /// The new reference (`U`), the match number (`E`/`C`/`P`/`Q`/`B`), the release time
    /// (`K`, seconds since midnight), the near execution time (`O`), MWCB level 2 (`V`), or 0.
    pub aux_ref: u64,
    /// The message's quantity in shares (`I`: paired shares; `R`: round lot size); the best
    /// bid's shares for [`KIND_TOP_OF_BOOK`].
    pub shares: u64,
    /// `I`: imbalance shares; [`KIND_TOP_OF_BOOK`]: the best ask's shares; else 0.
    pub shares2: u64,
    /// The message's `Price(4)` (`I`: current reference price); the best bid for
    /// [`KIND_TOP_OF_BOOK`].
    pub price: u32,
    /// `J`: upper collar; `I`: near price; [`KIND_TOP_OF_BOOK`]: the best ask; else 0.
    pub price2: u32,
}

const _: () = assert!(std::mem::size_of::<Event>() == 64);
const _: () = assert!(std::mem::align_of::<Event>() == 8);

/// `flags` bit: an `F` add (with attribution).
pub const FLAG_ATTRIBUTED: u8 = 1;
/// `flags` bit: a `C` execution marked printable.
pub const FLAG_PRINTABLE: u8 = 2;

impl Event {
    /// The normalized form of `m`.
    #[inline]
    pub fn from_message(m: &Message) -> Event {
        let mut e = Event {
            kind: m.msg_type,
            locate: m.locate,
            tracking: m.tracking,
            timestamp_ns: m.timestamp_ns,
            stock: m.stock().copied().unwrap_or([b' '; 8]),
            ..Event::default()
        };
        match m.body {
            Body::SystemEvent { event_code } => e.code = event_code,
            Body::StockDirectory(d) => {
                e.code = d.market_category;
                e.shares = u64::from(d.round_lot_size);
            }
            Body::TradingAction { trading_state, .. } => e.code = trading_state,
            Body::RegSho { action, .. } => e.code = action,
            Body::ParticipantPosition { participant_state, .. } => e.code = participant_state,
            Body::MwcbDeclineLevel { level1, level2, level3 } => {
                e.order_ref = level1;
                e.aux_ref = level2;
                e.shares = level3;
            }
            Body::MwcbStatus { breached_level } => e.code = breached_level,
            Body::IpoQuotingPeriod { release_qualifier, price, release_time, .. } => {
                e.code = release_qualifier;
                e.price = price;
                e.aux_ref = u64::from(release_time);
            }
            Body::LuldAuctionCollar { ref_price, upper_price, lower_price, .. } => {
                e.price = ref_price;
                e.price2 = upper_price;
                e.shares = u64::from(lower_price);
            }
            Body::OperationalHalt { action, .. } => e.code = action,
            Body::AddOrder { order_ref, side, shares, price, attribution, .. } => {
                e.order_ref = order_ref;
                e.side = side.as_byte();
                e.shares = u64::from(shares);
                e.price = price;
                if attribution.is_some() {
                    e.flags |= FLAG_ATTRIBUTED;
                }
            }
            Body::OrderExecuted { order_ref, shares, match_number } => {
                e.order_ref = order_ref;
                e.shares = u64::from(shares);
                e.aux_ref = match_number;
            }
            Body::OrderExecutedWithPrice { order_ref, shares, match_number, printable, price } => {
                e.order_ref = order_ref;
                e.shares = u64::from(shares);
                e.aux_ref = match_number;
                e.price = price;
                if printable == b'Y' {
                    e.flags |= FLAG_PRINTABLE;
                }
            }
            Body::OrderCancel { order_ref, shares } => {
                e.order_ref = order_ref;
                e.shares = u64::from(shares);
            }
            Body::OrderDelete { order_ref } => e.order_ref = order_ref,
            Body::OrderReplace { old_ref, new_ref, shares, price } => {
                e.order_ref = old_ref;
                e.aux_ref = new_ref;
                e.shares = u64::from(shares);
                e.price = price;
            }
            Body::Trade { order_ref, side, shares, price, match_number, .. } => {
                e.order_ref = order_ref;
                e.side = side.as_byte();
                e.shares = u64::from(shares);
                e.price = price;
                e.aux_ref = match_number;
            }
            Body::CrossTrade { shares, price, match_number, cross_type, .. } => {
                e.shares = shares;
                e.price = price;
                e.aux_ref = match_number;
                e.code = cross_type;
            }
            Body::BrokenTrade { match_number } => e.aux_ref = match_number,
            Body::Imbalance(i) => {
                e.shares = i.paired_shares;
                e.shares2 = i.imbalance_shares;
                e.side = i.direction;
                e.price = i.current_ref_price;
                e.price2 = i.near_price;
                e.code = i.cross_type;
            }
            Body::RetailInterest { interest_flag, .. } => e.code = interest_flag,
            Body::DlcrPriceDiscovery(d) => {
                e.code = d.open_eligibility;
                e.price = d.near_execution_price;
                e.aux_ref = d.near_execution_time;
            }
        }
        e
    }

    /// A top-of-book change, stamped with the message that caused it.
    #[inline]
    pub fn top_of_book(t: &TopOfBook, cause: &Message) -> Event {
        Event {
            kind: KIND_TOP_OF_BOOK,
            locate: t.locate,
            tracking: cause.tracking,
            timestamp_ns: cause.timestamp_ns,
            stock: [b' '; 8],
            price: t.bid_price,
            shares: t.bid_shares,
            price2: t.ask_price,
            shares2: t.ask_shares,
            ..Event::default()
        }
    }

    /// The top of book a [`KIND_TOP_OF_BOOK`] event carries.
    pub fn as_top_of_book(&self) -> Option<TopOfBook> {
        (self.kind == KIND_TOP_OF_BOOK).then_some(TopOfBook {
            locate: self.locate,
            bid_price: self.price,
            bid_shares: self.shares,
            ask_price: self.price2,
            ask_shares: self.shares2,
        })
    }
}
