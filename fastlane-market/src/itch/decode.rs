//! Decoding one message: the field readers and [`decode_at`], one arm per message type.

use super::*;

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
