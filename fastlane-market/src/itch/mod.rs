//! NASDAQ TotalView-ITCH 5.0: decoding (and, for generators and tests, encoding).
//!
//! The stream is a sequence of `u16` big-endian lengths, each followed by one message of
//! that many bytes (the framing of NASDAQ's binary files and of MoldUDP64/SoupBinTCP
//! payloads). Every message starts with an 11-byte header: type (1), stock locate (2),
//! tracking number (2), timestamp (6, nanoseconds since midnight). Integers are big-endian,
//! prices are `Price(4)` (4 implied decimals) except the MWCB levels (`Price(8)`), and
//! alphanumeric fields are left-justified, space-padded ASCII, kept here as raw bytes.
//!
//! [`decode`] turns one message into a [`Message`] (a `Copy` value, no allocation);
//! [`FeedReader`] walks a length-prefixed buffer, counting what it saw in [`DecodeStats`].
//! Bad input (truncated stream, unknown type, a length that disagrees with the type, a side
//! that is neither `B` nor `S`) becomes an [`ItchError`] and a counter, never a panic; the
//! reader resynchronises on the length prefix and goes on.

mod decode;
mod encode;
mod feed;

pub use decode::{decode, decode_at};
pub use encode::{encode, encode_to_vec};
pub use feed::{DecodeStats, FeedReader};

/// An 8-byte, space-padded stock symbol as it appears on the wire.
pub type Stock = [u8; 8];

/// Bytes of the common header (type, locate, tracking, timestamp).
pub const HEADER_LEN: usize = 11;

/// Every message type of ITCH 5.0, in the spec's order.
pub const MESSAGE_TYPES: [u8; 23] = *b"SRHYLVWKJhAFECXDUPQBINO";

/// The largest message of the spec (`I`, 50 bytes).
pub const MAX_MESSAGE_LEN: usize = 50;

/// Length in bytes (type byte included, length prefix excluded) of a message type, from the
/// spec's field tables; `None` for a type ITCH 5.0 does not define.
pub const fn message_len(msg_type: u8) -> Option<usize> {
    Some(match msg_type {
        b'S' => 12,
        b'R' => 39,
        b'H' => 25,
        b'Y' => 20,
        b'L' => 26,
        b'V' => 35,
        b'W' => 12,
        b'K' => 28,
        b'J' => 35,
        b'h' => 21,
        b'A' => 36,
        b'F' => 40,
        b'E' => 31,
        b'C' => 36,
        b'X' => 23,
        b'D' => 19,
        b'U' => 35,
        b'P' => 44,
        b'Q' => 40,
        b'B' => 19,
        b'I' => 50,
        b'N' => 20,
        b'O' => 48,
        _ => return None,
    })
}

/// Buy or sell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// `B`
    Buy,
    /// `S`
    Sell,
}

impl Side {
    /// The wire byte.
    pub const fn as_byte(self) -> u8 {
        match self {
            Side::Buy => b'B',
            Side::Sell => b'S',
        }
    }

    /// Parse the wire byte.
    pub const fn from_byte(b: u8) -> Option<Side> {
        match b {
            b'B' => Some(Side::Buy),
            b'S' => Some(Side::Sell),
            _ => None,
        }
    }
}

/// One decoded ITCH 5.0 message: the common header and a typed body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Message {
    /// The type byte (`A`, `F`, ...); tells `A` from `F` and `E` from `C`.
    pub msg_type: u8,
    /// Stock locate: the day's small integer for the instrument (0 for market-wide messages).
    pub locate: u16,
    /// NASDAQ internal tracking number.
    pub tracking: u16,
    /// Nanoseconds since midnight (48 bits on the wire).
    pub timestamp_ns: u64,
    /// The type-specific fields.
    pub body: Body,
}

/// `R`: Stock Directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StockDirectory {
    /// The symbol (offset 11).
    pub stock: Stock,
    /// Listing market: `Q` NASDAQ Global Select, `G` Global Market, `S` Capital Market, `N`
    /// NYSE, `A` NYSE American, `P` NYSE Arca, `Z` BATS, `V` IEX, space: not available.
    pub market_category: u8,
    /// NASDAQ-listed issues: `N` normal, `D` deficient, `E` delinquent, `Q` bankrupt, ...;
    /// space for other listings.
    pub financial_status: u8,
    /// Shares in one round lot.
    pub round_lot_size: u32,
    /// `Y`: only round lots are accepted; `N`: odd and mixed lots too.
    pub round_lots_only: u8,
    /// The security class (`C` common stock, `A` ADR, `U` unit, ...).
    pub issue_classification: u8,
    /// Two-character subtype of the class (`Z` not applicable, ...).
    pub issue_subtype: [u8; 2],
    /// `P` live/production, `T` test.
    pub authenticity: u8,
    /// Reg SHO threshold list: `Y` restricted, `N` not, space: not available.
    pub short_sale_threshold: u8,
    /// `Y` a new IPO, `N` not, space: not available.
    pub ipo_flag: u8,
    /// Limit Up-Limit Down reference price tier: `1`, `2`, or space.
    pub luld_ref_price_tier: u8,
    /// `Y` an exchange-traded product, `N` not, space: not available.
    pub etp_flag: u8,
    /// The ETP's leverage factor (an integer; 0 when not an ETP).
    pub etp_leverage_factor: u32,
    /// `Y` an inverse ETP, `N` not.
    pub inverse_indicator: u8,
}

/// `I`: Net Order Imbalance Indicator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Imbalance {
    /// Shares paired at the current reference price.
    pub paired_shares: u64,
    /// Shares not paired at the current reference price.
    pub imbalance_shares: u64,
    /// `B` buy imbalance, `S` sell, `N` none, `O` insufficient orders, `P` paused.
    pub direction: u8,
    /// The symbol (offset 28).
    pub stock: Stock,
    /// Hypothetical clearing price for cross orders only, `Price(4)`.
    pub far_price: u32,
    /// Hypothetical clearing price for cross and continuous orders, `Price(4)`.
    pub near_price: u32,
    /// The price the paired and imbalance shares are computed at, `Price(4)`.
    pub current_ref_price: u32,
    /// `O` opening cross, `C` closing, `H` IPO or halted security, `A` extended trading close.
    pub cross_type: u8,
    /// How far the near price is from the current reference price (`L` under 1 %, `1`..`9`,
    /// `A`..`C` wider bands, space: not available).
    pub price_variation: u8,
}

/// `O`: Direct Listing with Capital Raise Price Discovery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DlcrPriceDiscovery {
    /// The symbol (offset 11).
    pub stock: Stock,
    /// `Y` eligible to open (the volatility test passed), `N` not.
    pub open_eligibility: u8,
    /// Lowest price the listing may open at, `Price(4)`.
    pub min_allowable_price: u32,
    /// Highest price the listing may open at, `Price(4)`.
    pub max_allowable_price: u32,
    /// The price the security would open at now, `Price(4)`.
    pub near_execution_price: u32,
    /// When the near execution price was set (the 8-byte integer at offset 32, as sent).
    pub near_execution_time: u64,
    /// Lower collar around the near execution price, `Price(4)`.
    pub lower_price_collar: u32,
    /// Upper collar around the near execution price, `Price(4)`.
    pub upper_price_collar: u32,
}

/// The body of a message. Prices are raw `Price(4)` integers unless noted; enumerated
/// single-byte fields are kept as their ASCII code (validated only where the book needs it).
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Body {
    /// `S`
    SystemEvent { event_code: u8 },
    /// `R`
    StockDirectory(StockDirectory),
    /// `H`
    TradingAction { stock: Stock, trading_state: u8, reserved: u8, reason: [u8; 4] },
    /// `Y`
    RegSho { stock: Stock, action: u8 },
    /// `L`
    ParticipantPosition {
        mpid: [u8; 4],
        stock: Stock,
        primary_market_maker: u8,
        market_maker_mode: u8,
        participant_state: u8,
    },
    /// `V`: prices are `Price(8)`.
    MwcbDeclineLevel { level1: u64, level2: u64, level3: u64 },
    /// `W`
    MwcbStatus { breached_level: u8 },
    /// `K`
    IpoQuotingPeriod { stock: Stock, release_time: u32, release_qualifier: u8, price: u32 },
    /// `J`
    LuldAuctionCollar {
        stock: Stock,
        ref_price: u32,
        upper_price: u32,
        lower_price: u32,
        extension: u32,
    },
    /// `h`
    OperationalHalt { stock: Stock, market_code: u8, action: u8 },
    /// `A` (attribution `None`) and `F` (attribution `Some(mpid)`).
    AddOrder {
        order_ref: u64,
        side: Side,
        shares: u32,
        stock: Stock,
        price: u32,
        attribution: Option<[u8; 4]>,
    },
    /// `E`
    OrderExecuted { order_ref: u64, shares: u32, match_number: u64 },
    /// `C`
    OrderExecutedWithPrice {
        order_ref: u64,
        shares: u32,
        match_number: u64,
        printable: u8,
        price: u32,
    },
    /// `X`
    OrderCancel { order_ref: u64, shares: u32 },
    /// `D`
    OrderDelete { order_ref: u64 },
    /// `U`
    OrderReplace { old_ref: u64, new_ref: u64, shares: u32, price: u32 },
    /// `P`: a trade against a non-displayed order.
    Trade { order_ref: u64, side: Side, shares: u32, stock: Stock, price: u32, match_number: u64 },
    /// `Q`
    CrossTrade { shares: u64, stock: Stock, price: u32, match_number: u64, cross_type: u8 },
    /// `B`
    BrokenTrade { match_number: u64 },
    /// `I`
    Imbalance(Imbalance),
    /// `N`
    RetailInterest { stock: Stock, interest_flag: u8 },
    /// `O`
    DlcrPriceDiscovery(DlcrPriceDiscovery),
}

impl Body {
    /// The type byte this body is sent with.
    pub const fn msg_type(&self) -> u8 {
        match self {
            Body::SystemEvent { .. } => b'S',
            Body::StockDirectory(_) => b'R',
            Body::TradingAction { .. } => b'H',
            Body::RegSho { .. } => b'Y',
            Body::ParticipantPosition { .. } => b'L',
            Body::MwcbDeclineLevel { .. } => b'V',
            Body::MwcbStatus { .. } => b'W',
            Body::IpoQuotingPeriod { .. } => b'K',
            Body::LuldAuctionCollar { .. } => b'J',
            Body::OperationalHalt { .. } => b'h',
            Body::AddOrder { attribution: None, .. } => b'A',
            Body::AddOrder { attribution: Some(_), .. } => b'F',
            Body::OrderExecuted { .. } => b'E',
            Body::OrderExecutedWithPrice { .. } => b'C',
            Body::OrderCancel { .. } => b'X',
            Body::OrderDelete { .. } => b'D',
            Body::OrderReplace { .. } => b'U',
            Body::Trade { .. } => b'P',
            Body::CrossTrade { .. } => b'Q',
            Body::BrokenTrade { .. } => b'B',
            Body::Imbalance(_) => b'I',
            Body::RetailInterest { .. } => b'N',
            Body::DlcrPriceDiscovery(_) => b'O',
        }
    }
}

impl Message {
    /// The stock symbol the message names, for the types that carry one.
    pub fn stock(&self) -> Option<&Stock> {
        match &self.body {
            Body::StockDirectory(d) => Some(&d.stock),
            Body::TradingAction { stock, .. }
            | Body::RegSho { stock, .. }
            | Body::ParticipantPosition { stock, .. }
            | Body::IpoQuotingPeriod { stock, .. }
            | Body::LuldAuctionCollar { stock, .. }
            | Body::OperationalHalt { stock, .. }
            | Body::AddOrder { stock, .. }
            | Body::Trade { stock, .. }
            | Body::CrossTrade { stock, .. }
            | Body::RetailInterest { stock, .. } => Some(stock),
            Body::Imbalance(i) => Some(&i.stock),
            Body::DlcrPriceDiscovery(d) => Some(&d.stock),
            _ => None,
        }
    }
}

/// What went wrong with one message, and where (byte offset of its length prefix in the feed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ItchError {
    /// The stream ended inside a length prefix or a message.
    #[error("feed truncated at offset {offset}: need {needed} bytes, {available} left")]
    Truncated {
        /// Byte offset of the message's length prefix in the feed.
        offset: u64,
        /// Bytes the prefix or message needs.
        needed: usize,
        /// Bytes the feed has left.
        available: usize,
    },
    /// A length prefix of 0.
    #[error("empty message at offset {offset}")]
    Empty {
        /// Byte offset of the length prefix in the feed.
        offset: u64,
    },
    /// A type byte ITCH 5.0 does not define.
    #[error("unknown message type {msg_type:#04x} at offset {offset}")]
    UnknownType {
        /// Byte offset of the message's length prefix in the feed.
        offset: u64,
        /// The type byte read.
        msg_type: u8,
    },
    /// The length prefix disagrees with the type's length in the spec.
    #[error("message type {} at offset {offset}: length {declared}, spec says {expected}", *msg_type as char)]
    LengthMismatch {
        /// Byte offset of the message's length prefix in the feed.
        offset: u64,
        /// The type byte.
        msg_type: u8,
        /// The type's length in the spec.
        expected: usize,
        /// The length the prefix declared.
        declared: usize,
    },
    /// A field whose value the spec does not allow and we depend on (an order's side).
    #[error("message type {} at offset {offset}: bad {field} {value:#04x}", *msg_type as char)]
    BadField {
        /// Byte offset of the message's length prefix in the feed.
        offset: u64,
        /// The type byte.
        msg_type: u8,
        /// The field's name in the spec.
        field: &'static str,
        /// The byte found.
        value: u8,
    },
}

/// A symbol as an 8-byte space-padded field (longer input is cut at 8 bytes).
pub fn stock_from_str(s: &str) -> Stock {
    let mut out = [b' '; 8];
    for (o, b) in out.iter_mut().zip(s.bytes()) {
        *o = b;
    }
    out
}

/// A symbol field as text, trailing spaces removed (bytes that are not printable ASCII shown
/// as `?`).
pub fn stock_to_string(s: &Stock) -> String {
    let end = s.iter().rposition(|&b| b != b' ').map_or(0, |i| i + 1);
    s[..end].iter().map(|&b| if b.is_ascii_graphic() { b as char } else { '?' }).collect()
}

/// A `Price(4)` as decimal text (`1234.5600`).
pub fn price4_to_string(p: u32) -> String {
    format!("{}.{:04}", p / 10_000, p % 10_000)
}
