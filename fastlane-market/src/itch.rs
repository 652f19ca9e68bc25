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

#[inline(always)]
fn fixed<const N: usize>(payload: &[u8], offset: u64) -> Result<&[u8; N], ItchError> {
    payload.try_into().map_err(|_| ItchError::LengthMismatch {
        offset,
        msg_type: payload[0],
        expected: N,
        declared: payload.len(),
    })
}

#[inline(always)]
fn u16_at<const N: usize>(b: &[u8; N], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

#[inline(always)]
fn u32_at<const N: usize>(b: &[u8; N], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

#[inline(always)]
fn u64_at<const N: usize>(b: &[u8; N], at: usize) -> u64 {
    u64::from_be_bytes([
        b[at],
        b[at + 1],
        b[at + 2],
        b[at + 3],
        b[at + 4],
        b[at + 5],
        b[at + 6],
        b[at + 7],
    ])
}

#[inline(always)]
fn arr_at<const N: usize, const M: usize>(b: &[u8; N], at: usize) -> [u8; M] {
    let mut out = [0u8; M];
    out.copy_from_slice(&b[at..at + M]);
    out
}

#[inline(always)]
fn header<const N: usize>(b: &[u8; N], body: Body) -> Message {
    let ts = u64::from_be_bytes([0, 0, b[5], b[6], b[7], b[8], b[9], b[10]]);
    Message { msg_type: b[0], locate: u16_at(b, 1), tracking: u16_at(b, 3), timestamp_ns: ts, body }
}

#[inline(always)]
fn side_at<const N: usize>(b: &[u8; N], at: usize, offset: u64) -> Result<Side, ItchError> {
    Side::from_byte(b[at]).ok_or(ItchError::BadField {
        offset,
        msg_type: b[0],
        field: "side",
        value: b[at],
    })
}

/// Decode one message (`payload` starts at the type byte; no length prefix).
#[inline]
pub fn decode(payload: &[u8]) -> Result<Message, ItchError> {
    decode_at(payload, 0)
}

/// [`decode`], with `offset` (the message's position in its feed) put into errors.
#[inline(always)]
pub fn decode_at(payload: &[u8], offset: u64) -> Result<Message, ItchError> {
    let Some(&msg_type) = payload.first() else {
        return Err(ItchError::Empty { offset });
    };
    let m = match msg_type {
        b'A' => {
            let b = fixed::<36>(payload, offset)?;
            header(
                b,
                Body::AddOrder {
                    order_ref: u64_at(b, 11),
                    side: side_at(b, 19, offset)?,
                    shares: u32_at(b, 20),
                    stock: arr_at(b, 24),
                    price: u32_at(b, 32),
                    attribution: None,
                },
            )
        }
        b'F' => {
            let b = fixed::<40>(payload, offset)?;
            header(
                b,
                Body::AddOrder {
                    order_ref: u64_at(b, 11),
                    side: side_at(b, 19, offset)?,
                    shares: u32_at(b, 20),
                    stock: arr_at(b, 24),
                    price: u32_at(b, 32),
                    attribution: Some(arr_at(b, 36)),
                },
            )
        }
        b'E' => {
            let b = fixed::<31>(payload, offset)?;
            header(
                b,
                Body::OrderExecuted {
                    order_ref: u64_at(b, 11),
                    shares: u32_at(b, 19),
                    match_number: u64_at(b, 23),
                },
            )
        }
        b'C' => {
            let b = fixed::<36>(payload, offset)?;
            header(
                b,
                Body::OrderExecutedWithPrice {
                    order_ref: u64_at(b, 11),
                    shares: u32_at(b, 19),
                    match_number: u64_at(b, 23),
                    printable: b[31],
                    price: u32_at(b, 32),
                },
            )
        }
        b'X' => {
            let b = fixed::<23>(payload, offset)?;
            header(b, Body::OrderCancel { order_ref: u64_at(b, 11), shares: u32_at(b, 19) })
        }
        b'D' => {
            let b = fixed::<19>(payload, offset)?;
            header(b, Body::OrderDelete { order_ref: u64_at(b, 11) })
        }
        b'U' => {
            let b = fixed::<35>(payload, offset)?;
            header(
                b,
                Body::OrderReplace {
                    old_ref: u64_at(b, 11),
                    new_ref: u64_at(b, 19),
                    shares: u32_at(b, 27),
                    price: u32_at(b, 31),
                },
            )
        }
        b'P' => {
            let b = fixed::<44>(payload, offset)?;
            header(
                b,
                Body::Trade {
                    order_ref: u64_at(b, 11),
                    side: side_at(b, 19, offset)?,
                    shares: u32_at(b, 20),
                    stock: arr_at(b, 24),
                    price: u32_at(b, 32),
                    match_number: u64_at(b, 36),
                },
            )
        }
        b'Q' => {
            let b = fixed::<40>(payload, offset)?;
            header(
                b,
                Body::CrossTrade {
                    shares: u64_at(b, 11),
                    stock: arr_at(b, 19),
                    price: u32_at(b, 27),
                    match_number: u64_at(b, 31),
                    cross_type: b[39],
                },
            )
        }
        b'B' => {
            let b = fixed::<19>(payload, offset)?;
            header(b, Body::BrokenTrade { match_number: u64_at(b, 11) })
        }
        b'S' => {
            let b = fixed::<12>(payload, offset)?;
            header(b, Body::SystemEvent { event_code: b[11] })
        }
        b'R' => {
            let b = fixed::<39>(payload, offset)?;
            header(
                b,
                Body::StockDirectory(StockDirectory {
                    stock: arr_at(b, 11),
                    market_category: b[19],
                    financial_status: b[20],
                    round_lot_size: u32_at(b, 21),
                    round_lots_only: b[25],
                    issue_classification: b[26],
                    issue_subtype: arr_at(b, 27),
                    authenticity: b[29],
                    short_sale_threshold: b[30],
                    ipo_flag: b[31],
                    luld_ref_price_tier: b[32],
                    etp_flag: b[33],
                    etp_leverage_factor: u32_at(b, 34),
                    inverse_indicator: b[38],
                }),
            )
        }
        b'H' => {
            let b = fixed::<25>(payload, offset)?;
            header(
                b,
                Body::TradingAction {
                    stock: arr_at(b, 11),
                    trading_state: b[19],
                    reserved: b[20],
                    reason: arr_at(b, 21),
                },
            )
        }
        b'Y' => {
            let b = fixed::<20>(payload, offset)?;
            header(b, Body::RegSho { stock: arr_at(b, 11), action: b[19] })
        }
        b'L' => {
            let b = fixed::<26>(payload, offset)?;
            header(
                b,
                Body::ParticipantPosition {
                    mpid: arr_at(b, 11),
                    stock: arr_at(b, 15),
                    primary_market_maker: b[23],
                    market_maker_mode: b[24],
                    participant_state: b[25],
                },
            )
        }
        b'V' => {
            let b = fixed::<35>(payload, offset)?;
            header(
                b,
                Body::MwcbDeclineLevel {
                    level1: u64_at(b, 11),
                    level2: u64_at(b, 19),
                    level3: u64_at(b, 27),
                },
            )
        }
        b'W' => {
            let b = fixed::<12>(payload, offset)?;
            header(b, Body::MwcbStatus { breached_level: b[11] })
        }
        b'K' => {
            let b = fixed::<28>(payload, offset)?;
            header(
                b,
                Body::IpoQuotingPeriod {
                    stock: arr_at(b, 11),
                    release_time: u32_at(b, 19),
                    release_qualifier: b[23],
                    price: u32_at(b, 24),
                },
            )
        }
        b'J' => {
            let b = fixed::<35>(payload, offset)?;
            header(
                b,
                Body::LuldAuctionCollar {
                    stock: arr_at(b, 11),
                    ref_price: u32_at(b, 19),
                    upper_price: u32_at(b, 23),
                    lower_price: u32_at(b, 27),
                    extension: u32_at(b, 31),
                },
            )
        }
        b'h' => {
            let b = fixed::<21>(payload, offset)?;
            header(
                b,
                Body::OperationalHalt { stock: arr_at(b, 11), market_code: b[19], action: b[20] },
            )
        }
        b'I' => {
            let b = fixed::<50>(payload, offset)?;
            header(
                b,
                Body::Imbalance(Imbalance {
                    paired_shares: u64_at(b, 11),
                    imbalance_shares: u64_at(b, 19),
                    direction: b[27],
                    stock: arr_at(b, 28),
                    far_price: u32_at(b, 36),
                    near_price: u32_at(b, 40),
                    current_ref_price: u32_at(b, 44),
                    cross_type: b[48],
                    price_variation: b[49],
                }),
            )
        }
        b'N' => {
            let b = fixed::<20>(payload, offset)?;
            header(b, Body::RetailInterest { stock: arr_at(b, 11), interest_flag: b[19] })
        }
        b'O' => {
            let b = fixed::<48>(payload, offset)?;
            header(
                b,
                Body::DlcrPriceDiscovery(DlcrPriceDiscovery {
                    stock: arr_at(b, 11),
                    open_eligibility: b[19],
                    min_allowable_price: u32_at(b, 20),
                    max_allowable_price: u32_at(b, 24),
                    near_execution_price: u32_at(b, 28),
                    near_execution_time: u64_at(b, 32),
                    lower_price_collar: u32_at(b, 40),
                    upper_price_collar: u32_at(b, 44),
                }),
            )
        }
        other => return Err(ItchError::UnknownType { offset, msg_type: other }),
    };
    Ok(m)
}

/// Counts of what a [`FeedReader`] decoded and rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeStats {
    /// Messages decoded, by type byte.
    pub by_type: [u64; 256],
    /// Messages decoded, all types.
    pub messages: u64,
    /// Bytes consumed (prefixes included).
    pub bytes: u64,
    /// Feeds that ended inside a prefix or a message.
    pub truncated: u64,
    /// Zero-length messages.
    pub empty: u64,
    /// Messages of a type ITCH 5.0 does not define.
    pub unknown_type: u64,
    /// Messages whose length prefix disagrees with their type.
    pub length_mismatch: u64,
    /// Messages with a field value we cannot use.
    pub bad_field: u64,
}

impl Default for DecodeStats {
    fn default() -> Self {
        Self {
            by_type: [0; 256],
            messages: 0,
            bytes: 0,
            truncated: 0,
            empty: 0,
            unknown_type: 0,
            length_mismatch: 0,
            bad_field: 0,
        }
    }
}

impl DecodeStats {
    /// All rejected messages.
    pub fn errors(&self) -> u64 {
        self.truncated + self.empty + self.unknown_type + self.length_mismatch + self.bad_field
    }

    /// Count one error.
    pub fn count_error(&mut self, e: &ItchError) {
        match e {
            ItchError::Truncated { .. } => self.truncated += 1,
            ItchError::Empty { .. } => self.empty += 1,
            ItchError::UnknownType { .. } => self.unknown_type += 1,
            ItchError::LengthMismatch { .. } => self.length_mismatch += 1,
            ItchError::BadField { .. } => self.bad_field += 1,
        }
    }
}

/// Walks a length-prefixed ITCH feed held in memory, yielding messages and errors.
///
/// After an error inside a well-framed message it skips that message (the length prefix says
/// where the next one starts); after a truncation it stops.
#[derive(Debug, Clone)]
pub struct FeedReader<'a> {
    buf: &'a [u8],
    pos: usize,
    stats: DecodeStats,
}

impl<'a> FeedReader<'a> {
    /// A reader at the start of `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0, stats: DecodeStats::default() }
    }

    /// Byte offset of the next length prefix.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// What has been decoded and rejected so far.
    pub fn stats(&self) -> &DecodeStats {
        &self.stats
    }

    /// The next framed message as raw bytes (type byte first), without decoding it:
    /// `(offset of its prefix, payload)`. Errors only for truncation (then the reader stops).
    #[inline(always)]
    pub fn next_frame(&mut self) -> Option<Result<(u64, &'a [u8]), ItchError>> {
        let rest = &self.buf[self.pos..];
        if rest.is_empty() {
            return None;
        }
        let offset = self.pos as u64;
        if rest.len() < 2 {
            self.pos = self.buf.len();
            return Some(Err(ItchError::Truncated { offset, needed: 2, available: rest.len() }));
        }
        let len = usize::from(u16::from_be_bytes([rest[0], rest[1]]));
        let Some(payload) = rest.get(2..2 + len) else {
            self.pos = self.buf.len();
            return Some(Err(ItchError::Truncated {
                offset,
                needed: 2 + len,
                available: rest.len(),
            }));
        };
        self.pos += 2 + len;
        self.stats.bytes += 2 + len as u64;
        Some(Ok((offset, payload)))
    }
}

impl FeedReader<'_> {
    /// The next message that decodes; rejected ones are counted in [`stats`](Self::stats)
    /// and skipped. `None` at the end of the feed (or at a truncation, also counted).
    #[inline(always)]
    pub fn next_message(&mut self) -> Option<Message> {
        loop {
            match self.next()? {
                Ok(m) => return Some(m),
                Err(_) => continue,
            }
        }
    }
}

impl Iterator for FeedReader<'_> {
    type Item = Result<Message, ItchError>;

    #[inline(always)]
    fn next(&mut self) -> Option<Self::Item> {
        let r = match self.next_frame()? {
            Ok((offset, payload)) => decode_at(payload, offset),
            Err(e) => Err(e),
        };
        match &r {
            Ok(m) => {
                self.stats.messages += 1;
                self.stats.by_type[usize::from(m.msg_type)] += 1;
            }
            Err(e) => self.stats.count_error(e),
        }
        Some(r)
    }
}

/// Encode `m` with its length prefix into `out`; returns the bytes written (2 + the type's
/// length). The inverse of [`decode`] for every message it can produce.
pub fn encode(m: &Message, out: &mut [u8; 2 + MAX_MESSAGE_LEN]) -> usize {
    let msg_type = m.body.msg_type();
    // Every body's type is one of the spec's, so the length is always known.
    let len = message_len(msg_type).unwrap_or(HEADER_LEN);
    out[..2 + len].fill(0);
    out[0..2].copy_from_slice(&(len as u16).to_be_bytes());
    let p = &mut out[2..2 + len];
    p[0] = msg_type;
    p[1..3].copy_from_slice(&m.locate.to_be_bytes());
    p[3..5].copy_from_slice(&m.tracking.to_be_bytes());
    p[5..11].copy_from_slice(&m.timestamp_ns.to_be_bytes()[2..]);
    fn put(p: &mut [u8], at: usize, v: &[u8]) {
        p[at..at + v.len()].copy_from_slice(v);
    }
    match m.body {
        Body::SystemEvent { event_code } => p[11] = event_code,
        Body::StockDirectory(d) => {
            put(p, 11, &d.stock);
            p[19] = d.market_category;
            p[20] = d.financial_status;
            put(p, 21, &d.round_lot_size.to_be_bytes());
            p[25] = d.round_lots_only;
            p[26] = d.issue_classification;
            put(p, 27, &d.issue_subtype);
            p[29] = d.authenticity;
            p[30] = d.short_sale_threshold;
            p[31] = d.ipo_flag;
            p[32] = d.luld_ref_price_tier;
            p[33] = d.etp_flag;
            put(p, 34, &d.etp_leverage_factor.to_be_bytes());
            p[38] = d.inverse_indicator;
        }
        Body::TradingAction { stock, trading_state, reserved, reason } => {
            put(p, 11, &stock);
            p[19] = trading_state;
            p[20] = reserved;
            put(p, 21, &reason);
        }
        Body::RegSho { stock, action } => {
            put(p, 11, &stock);
            p[19] = action;
        }
        Body::ParticipantPosition {
            mpid,
            stock,
            primary_market_maker,
            market_maker_mode,
            participant_state,
        } => {
            put(p, 11, &mpid);
            put(p, 15, &stock);
            p[23] = primary_market_maker;
            p[24] = market_maker_mode;
            p[25] = participant_state;
        }
        Body::MwcbDeclineLevel { level1, level2, level3 } => {
            put(p, 11, &level1.to_be_bytes());
            put(p, 19, &level2.to_be_bytes());
            put(p, 27, &level3.to_be_bytes());
        }
        Body::MwcbStatus { breached_level } => p[11] = breached_level,
        Body::IpoQuotingPeriod { stock, release_time, release_qualifier, price } => {
            put(p, 11, &stock);
            put(p, 19, &release_time.to_be_bytes());
            p[23] = release_qualifier;
            put(p, 24, &price.to_be_bytes());
        }
        Body::LuldAuctionCollar { stock, ref_price, upper_price, lower_price, extension } => {
            put(p, 11, &stock);
            put(p, 19, &ref_price.to_be_bytes());
            put(p, 23, &upper_price.to_be_bytes());
            put(p, 27, &lower_price.to_be_bytes());
            put(p, 31, &extension.to_be_bytes());
        }
        Body::OperationalHalt { stock, market_code, action } => {
            put(p, 11, &stock);
            p[19] = market_code;
            p[20] = action;
        }
        Body::AddOrder { order_ref, side, shares, stock, price, attribution } => {
            put(p, 11, &order_ref.to_be_bytes());
            p[19] = side.as_byte();
            put(p, 20, &shares.to_be_bytes());
            put(p, 24, &stock);
            put(p, 32, &price.to_be_bytes());
            if let Some(mpid) = attribution {
                put(p, 36, &mpid);
            }
        }
        Body::OrderExecuted { order_ref, shares, match_number } => {
            put(p, 11, &order_ref.to_be_bytes());
            put(p, 19, &shares.to_be_bytes());
            put(p, 23, &match_number.to_be_bytes());
        }
        Body::OrderExecutedWithPrice { order_ref, shares, match_number, printable, price } => {
            put(p, 11, &order_ref.to_be_bytes());
            put(p, 19, &shares.to_be_bytes());
            put(p, 23, &match_number.to_be_bytes());
            p[31] = printable;
            put(p, 32, &price.to_be_bytes());
        }
        Body::OrderCancel { order_ref, shares } => {
            put(p, 11, &order_ref.to_be_bytes());
            put(p, 19, &shares.to_be_bytes());
        }
        Body::OrderDelete { order_ref } => put(p, 11, &order_ref.to_be_bytes()),
        Body::OrderReplace { old_ref, new_ref, shares, price } => {
            put(p, 11, &old_ref.to_be_bytes());
            put(p, 19, &new_ref.to_be_bytes());
            put(p, 27, &shares.to_be_bytes());
            put(p, 31, &price.to_be_bytes());
        }
        Body::Trade { order_ref, side, shares, stock, price, match_number } => {
            put(p, 11, &order_ref.to_be_bytes());
            p[19] = side.as_byte();
            put(p, 20, &shares.to_be_bytes());
            put(p, 24, &stock);
            put(p, 32, &price.to_be_bytes());
            put(p, 36, &match_number.to_be_bytes());
        }
        Body::CrossTrade { shares, stock, price, match_number, cross_type } => {
            put(p, 11, &shares.to_be_bytes());
            put(p, 19, &stock);
            put(p, 27, &price.to_be_bytes());
            put(p, 31, &match_number.to_be_bytes());
            p[39] = cross_type;
        }
        Body::BrokenTrade { match_number } => put(p, 11, &match_number.to_be_bytes()),
        Body::Imbalance(i) => {
            put(p, 11, &i.paired_shares.to_be_bytes());
            put(p, 19, &i.imbalance_shares.to_be_bytes());
            p[27] = i.direction;
            put(p, 28, &i.stock);
            put(p, 36, &i.far_price.to_be_bytes());
            put(p, 40, &i.near_price.to_be_bytes());
            put(p, 44, &i.current_ref_price.to_be_bytes());
            p[48] = i.cross_type;
            p[49] = i.price_variation;
        }
        Body::RetailInterest { stock, interest_flag } => {
            put(p, 11, &stock);
            p[19] = interest_flag;
        }
        Body::DlcrPriceDiscovery(d) => {
            put(p, 11, &d.stock);
            p[19] = d.open_eligibility;
            put(p, 20, &d.min_allowable_price.to_be_bytes());
            put(p, 24, &d.max_allowable_price.to_be_bytes());
            put(p, 28, &d.near_execution_price.to_be_bytes());
            put(p, 32, &d.near_execution_time.to_be_bytes());
            put(p, 40, &d.lower_price_collar.to_be_bytes());
            put(p, 44, &d.upper_price_collar.to_be_bytes());
        }
    }
    2 + len
}

/// Append `m`, length-prefixed, to `out`.
pub fn encode_to_vec(m: &Message, out: &mut Vec<u8>) {
    let mut buf = [0u8; 2 + MAX_MESSAGE_LEN];
    let n = encode(m, &mut buf);
    out.extend_from_slice(&buf[..n]);
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
