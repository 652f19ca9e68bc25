//! Hand-built messages from the ITCH 5.0 spec's field tables (each field written out with its
//! offset and length, independently of our encoder), and bad input.

use fastlane_market::itch::{
    decode, message_len, Body, DlcrPriceDiscovery, FeedReader, Imbalance, ItchError, Side,
    StockDirectory, MESSAGE_TYPES,
};

/// 09:30:00.000000123 as the spec's 6-byte timestamp.
const TS: [u8; 6] = [0x1f, 0x1a, 0xce, 0xd9, 0xf0, 0x7b];
const TS_NS: u64 = 34_200_000_000_123;

/// Type, locate 0x0102, tracking 0x0304, timestamp, then the body fields in table order.
fn msg(t: u8, fields: &[&[u8]]) -> Vec<u8> {
    let mut m = vec![t, 0x01, 0x02, 0x03, 0x04];
    m.extend_from_slice(&TS);
    for f in fields {
        m.extend_from_slice(f);
    }
    m
}

fn framed(m: &[u8]) -> Vec<u8> {
    let mut v = (m.len() as u16).to_be_bytes().to_vec();
    v.extend_from_slice(m);
    v
}

#[test]
fn every_type_from_the_field_tables() {
    let fixtures: Vec<(Vec<u8>, Body)> = vec![
        (msg(b'S', &[b"O"]), Body::SystemEvent { event_code: b'O' }),
        (
            msg(
                b'R',
                &[
                    b"AAPL    ",
                    b"Q",
                    b"N",
                    &100u32.to_be_bytes(),
                    b"N",
                    b"C",
                    b"Z ",
                    b"P",
                    b"N",
                    b" ",
                    b"1",
                    b"N",
                    &0u32.to_be_bytes(),
                    b"N",
                ],
            ),
            Body::StockDirectory(StockDirectory {
                stock: *b"AAPL    ",
                market_category: b'Q',
                financial_status: b'N',
                round_lot_size: 100,
                round_lots_only: b'N',
                issue_classification: b'C',
                issue_subtype: *b"Z ",
                authenticity: b'P',
                short_sale_threshold: b'N',
                ipo_flag: b' ',
                luld_ref_price_tier: b'1',
                etp_flag: b'N',
                etp_leverage_factor: 0,
                inverse_indicator: b'N',
            }),
        ),
        (
            msg(b'H', &[b"MSFT    ", b"H", b" ", b"LUDP"]),
            Body::TradingAction {
                stock: *b"MSFT    ",
                trading_state: b'H',
                reserved: b' ',
                reason: *b"LUDP",
            },
        ),
        (msg(b'Y', &[b"TSLA    ", b"1"]), Body::RegSho { stock: *b"TSLA    ", action: b'1' }),
        (
            msg(b'L', &[b"GSCO", b"AMD     ", b"Y", b"N", b"A"]),
            Body::ParticipantPosition {
                mpid: *b"GSCO",
                stock: *b"AMD     ",
                primary_market_maker: b'Y',
                market_maker_mode: b'N',
                participant_state: b'A',
            },
        ),
        (
            msg(
                b'V',
                &[
                    &1u64.to_be_bytes(),
                    &2u64.to_be_bytes(),
                    &0x0102_0304_0506_0708u64.to_be_bytes(),
                ],
            ),
            Body::MwcbDeclineLevel { level1: 1, level2: 2, level3: 0x0102_0304_0506_0708 },
        ),
        (msg(b'W', &[b"2"]), Body::MwcbStatus { breached_level: b'2' }),
        (
            msg(b'K', &[b"NEWCO   ", &34_200u32.to_be_bytes(), b"A", &250_000u32.to_be_bytes()]),
            Body::IpoQuotingPeriod {
                stock: *b"NEWCO   ",
                release_time: 34_200,
                release_qualifier: b'A',
                price: 250_000,
            },
        ),
        (
            msg(
                b'J',
                &[
                    b"NVDA    ",
                    &1u32.to_be_bytes(),
                    &2u32.to_be_bytes(),
                    &3u32.to_be_bytes(),
                    &4u32.to_be_bytes(),
                ],
            ),
            Body::LuldAuctionCollar {
                stock: *b"NVDA    ",
                ref_price: 1,
                upper_price: 2,
                lower_price: 3,
                extension: 4,
            },
        ),
        (
            msg(b'h', &[b"QQQ     ", b"Q", b"H"]),
            Body::OperationalHalt { stock: *b"QQQ     ", market_code: b'Q', action: b'H' },
        ),
        (
            msg(
                b'A',
                &[
                    &0xdead_beef_u64.to_be_bytes(),
                    b"B",
                    &300u32.to_be_bytes(),
                    b"AAPL    ",
                    &1_925_100u32.to_be_bytes(),
                ],
            ),
            Body::AddOrder {
                order_ref: 0xdead_beef,
                side: Side::Buy,
                shares: 300,
                stock: *b"AAPL    ",
                price: 1_925_100,
                attribution: None,
            },
        ),
        (
            msg(
                b'F',
                &[
                    &7u64.to_be_bytes(),
                    b"S",
                    &1u32.to_be_bytes(),
                    b"AAPL    ",
                    &1_925_200u32.to_be_bytes(),
                    b"VIRT",
                ],
            ),
            Body::AddOrder {
                order_ref: 7,
                side: Side::Sell,
                shares: 1,
                stock: *b"AAPL    ",
                price: 1_925_200,
                attribution: Some(*b"VIRT"),
            },
        ),
        (
            msg(b'E', &[&7u64.to_be_bytes(), &1u32.to_be_bytes(), &u64::MAX.to_be_bytes()]),
            Body::OrderExecuted { order_ref: 7, shares: 1, match_number: u64::MAX },
        ),
        (
            msg(
                b'C',
                &[
                    &7u64.to_be_bytes(),
                    &5u32.to_be_bytes(),
                    &9u64.to_be_bytes(),
                    b"Y",
                    &1_925_300u32.to_be_bytes(),
                ],
            ),
            Body::OrderExecutedWithPrice {
                order_ref: 7,
                shares: 5,
                match_number: 9,
                printable: b'Y',
                price: 1_925_300,
            },
        ),
        (
            msg(b'X', &[&7u64.to_be_bytes(), &50u32.to_be_bytes()]),
            Body::OrderCancel { order_ref: 7, shares: 50 },
        ),
        (msg(b'D', &[&7u64.to_be_bytes()]), Body::OrderDelete { order_ref: 7 }),
        (
            msg(
                b'U',
                &[
                    &7u64.to_be_bytes(),
                    &8u64.to_be_bytes(),
                    &200u32.to_be_bytes(),
                    &u32::MAX.to_be_bytes(),
                ],
            ),
            Body::OrderReplace { old_ref: 7, new_ref: 8, shares: 200, price: u32::MAX },
        ),
        (
            msg(
                b'P',
                &[
                    &0u64.to_be_bytes(),
                    b"B",
                    &100u32.to_be_bytes(),
                    b"SPY     ",
                    &4_500_000u32.to_be_bytes(),
                    &11u64.to_be_bytes(),
                ],
            ),
            Body::Trade {
                order_ref: 0,
                side: Side::Buy,
                shares: 100,
                stock: *b"SPY     ",
                price: 4_500_000,
                match_number: 11,
            },
        ),
        (
            msg(
                b'Q',
                &[
                    &(1u64 << 40).to_be_bytes(),
                    b"SPY     ",
                    &4_500_100u32.to_be_bytes(),
                    &12u64.to_be_bytes(),
                    b"O",
                ],
            ),
            Body::CrossTrade {
                shares: 1 << 40,
                stock: *b"SPY     ",
                price: 4_500_100,
                match_number: 12,
                cross_type: b'O',
            },
        ),
        (msg(b'B', &[&12u64.to_be_bytes()]), Body::BrokenTrade { match_number: 12 }),
        (
            msg(
                b'I',
                &[
                    &1000u64.to_be_bytes(),
                    &200u64.to_be_bytes(),
                    b"B",
                    b"INTC    ",
                    &1u32.to_be_bytes(),
                    &2u32.to_be_bytes(),
                    &3u32.to_be_bytes(),
                    b"C",
                    b"L",
                ],
            ),
            Body::Imbalance(Imbalance {
                paired_shares: 1000,
                imbalance_shares: 200,
                direction: b'B',
                stock: *b"INTC    ",
                far_price: 1,
                near_price: 2,
                current_ref_price: 3,
                cross_type: b'C',
                price_variation: b'L',
            }),
        ),
        (
            msg(b'N', &[b"META    ", b"A"]),
            Body::RetailInterest { stock: *b"META    ", interest_flag: b'A' },
        ),
        (
            msg(
                b'O',
                &[
                    b"DLCR    ",
                    b"Y",
                    &10u32.to_be_bytes(),
                    &20u32.to_be_bytes(),
                    &15u32.to_be_bytes(),
                    &(TS_NS + 5).to_be_bytes(),
                    &11u32.to_be_bytes(),
                    &19u32.to_be_bytes(),
                ],
            ),
            Body::DlcrPriceDiscovery(DlcrPriceDiscovery {
                stock: *b"DLCR    ",
                open_eligibility: b'Y',
                min_allowable_price: 10,
                max_allowable_price: 20,
                near_execution_price: 15,
                near_execution_time: TS_NS + 5,
                lower_price_collar: 11,
                upper_price_collar: 19,
            }),
        ),
    ];
    assert_eq!(fixtures.len(), MESSAGE_TYPES.len());
    let mut feed = Vec::new();
    for (bytes, body) in &fixtures {
        assert_eq!(Some(bytes.len()), message_len(bytes[0]), "spec length of {}", bytes[0] as char);
        let m = decode(bytes).unwrap_or_else(|e| panic!("{}: {e}", bytes[0] as char));
        assert_eq!(
            (m.msg_type, m.locate, m.tracking, m.timestamp_ns),
            (bytes[0], 0x0102, 0x0304, TS_NS)
        );
        assert_eq!(&m.body, body, "type {}", bytes[0] as char);
        feed.extend_from_slice(&framed(bytes));
    }
    let mut r = FeedReader::new(&feed);
    assert_eq!(r.by_ref().filter(Result::is_ok).count(), MESSAGE_TYPES.len());
    assert_eq!(r.stats().errors(), 0);
    for t in MESSAGE_TYPES {
        assert_eq!(r.stats().by_type[usize::from(t)], 1);
    }
}

#[test]
fn bad_input_is_counted_and_the_reader_resynchronises() {
    let good = framed(&msg(b'D', &[&7u64.to_be_bytes()]));
    let mut feed = Vec::new();
    feed.extend_from_slice(&good);
    feed.extend_from_slice(&framed(&msg(b'Z', &[b"junk"]))); // unknown type
    feed.extend_from_slice(&good);
    let mut short_add = msg(
        b'A',
        &[&7u64.to_be_bytes(), b"B", &1u32.to_be_bytes(), b"AAPL    ", &1u32.to_be_bytes()],
    );
    short_add.pop(); // 35 bytes: disagrees with the type
    feed.extend_from_slice(&framed(&short_add));
    feed.extend_from_slice(&[0, 0]); // empty
    feed.extend_from_slice(&framed(&msg(
        b'A',
        &[&7u64.to_be_bytes(), b"Q", &1u32.to_be_bytes(), b"AAPL    ", &1u32.to_be_bytes()],
    )));
    feed.extend_from_slice(&good);
    feed.extend_from_slice(&good[..10]); // truncated inside the message
    let mut r = FeedReader::new(&feed);
    let results: Vec<_> = r.by_ref().collect();
    assert_eq!(results.len(), 8);
    assert!(matches!(results[1], Err(ItchError::UnknownType { msg_type: b'Z', offset: 21 })));
    assert!(matches!(
        results[3],
        Err(ItchError::LengthMismatch { msg_type: b'A', expected: 36, declared: 35, .. })
    ));
    assert!(matches!(results[4], Err(ItchError::Empty { .. })));
    assert!(matches!(results[5], Err(ItchError::BadField { field: "side", value: b'Q', .. })));
    assert!(matches!(results[7], Err(ItchError::Truncated { needed: 21, available: 10, .. })));
    let s = r.stats();
    assert_eq!(
        (s.messages, s.unknown_type, s.length_mismatch, s.empty, s.bad_field, s.truncated),
        (3, 1, 1, 1, 1, 1)
    );
    assert_eq!(s.by_type[usize::from(b'D')], 3);
    // The same feed through `next_message`: the good messages, the rest counted.
    let mut r = FeedReader::new(&feed);
    let mut n = 0;
    while let Some(m) = r.next_message() {
        assert_eq!(m.body, Body::OrderDelete { order_ref: 7 });
        n += 1;
    }
    assert_eq!((n, r.stats().errors()), (3, 5));
    // A lone byte: a truncated length prefix.
    let mut r = FeedReader::new(&[0x00]);
    assert!(matches!(r.next(), Some(Err(ItchError::Truncated { needed: 2, available: 1, .. }))));
    assert!(r.next().is_none());
}
