//! Encoding a [`Message`] back into its wire form, for generators and tests.

use super::*;

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
