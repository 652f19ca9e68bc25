//! Cross-check against an independent decoder: `itchy` must decode every message of the
//! generated feeds to the same fields as ours.

use fastlane_market::gen::{generate, GenConfig};
use fastlane_market::itch::{Body, FeedReader, Message, Side};
use itchy::{
    Body as IB, CrossType, EventCode, FinancialStatus, ImbalanceDirection, InterestFlag,
    IpoReleaseQualifier, IssueClassification, LevelBreached, LuldRefPriceTier, MarketCategory,
    MarketMakerMode, MarketParticipantState, RegShoAction, Side as IS, TradingState,
};

fn s8(b: &[u8; 8]) -> String {
    String::from_utf8(b.to_vec()).unwrap()
}
fn s4(b: &[u8; 4]) -> String {
    String::from_utf8(b.to_vec()).unwrap()
}
fn side(s: IS) -> Side {
    match s {
        IS::Buy => Side::Buy,
        IS::Sell => Side::Sell,
    }
}
fn yn(b: bool) -> u8 {
    if b {
        b'Y'
    } else {
        b'N'
    }
}
fn yn_opt(b: Option<bool>) -> u8 {
    b.map_or(b' ', yn)
}
fn cross(c: CrossType) -> u8 {
    match c {
        CrossType::Opening => b'O',
        CrossType::Closing => b'C',
        CrossType::IpoOrHalted => b'H',
        CrossType::Intraday => b'I',
        CrossType::ExtendedTradingClose => b'A',
    }
}

/// Assert that `ours` and `theirs` carry the same fields.
fn same(ours: &Message, theirs: &itchy::Message) {
    let ctx = format!("{ours:?} vs {theirs:?}");
    assert_eq!(ours.msg_type, theirs.tag, "{ctx}");
    assert_eq!(ours.locate, theirs.stock_locate, "{ctx}");
    assert_eq!(ours.tracking, theirs.tracking_number, "{ctx}");
    assert_eq!(ours.timestamp_ns, theirs.timestamp, "{ctx}");
    match (&ours.body, &theirs.body) {
        (Body::SystemEvent { event_code }, IB::SystemEvent { event }) => {
            let e = match event {
                EventCode::StartOfMessages => b'O',
                EventCode::StartOfSystemHours => b'S',
                EventCode::StartOfMarketHours => b'Q',
                EventCode::EndOfMarketHours => b'M',
                EventCode::EndOfSystemHours => b'E',
                EventCode::EndOfMessages => b'C',
            };
            assert_eq!(*event_code, e, "{ctx}");
        }
        (Body::StockDirectory(d), IB::StockDirectory(t)) => {
            assert_eq!(s8(&d.stock), t.stock.as_str(), "{ctx}");
            let mc = match t.market_category {
                MarketCategory::NasdaqGlobalSelect => b'Q',
                MarketCategory::NasdaqGlobalMarket => b'G',
                MarketCategory::NasdaqCapitalMarket => b'S',
                MarketCategory::Nyse => b'N',
                MarketCategory::NyseMkt => b'A',
                MarketCategory::NyseArca => b'P',
                MarketCategory::BatsZExchange => b'Z',
                MarketCategory::InvestorsExchange => b'V',
                MarketCategory::Unavailable => b' ',
            };
            assert_eq!(d.market_category, mc, "{ctx}");
            let fs = match t.financial_status {
                FinancialStatus::Normal => b'N',
                FinancialStatus::Deficient => b'D',
                FinancialStatus::Delinquent => b'E',
                FinancialStatus::Bankrupt => b'Q',
                FinancialStatus::Suspended => b'S',
                FinancialStatus::DeficientBankrupt => b'G',
                FinancialStatus::DeficientDelinquent => b'H',
                FinancialStatus::DelinquentBankrupt => b'J',
                FinancialStatus::DeficientDelinquentBankrupt => b'K',
                FinancialStatus::EtpSuspended => b'C',
                FinancialStatus::Unavailable => b' ',
            };
            assert_eq!(d.financial_status, fs, "{ctx}");
            assert_eq!(d.round_lot_size, t.round_lot_size, "{ctx}");
            assert_eq!(d.round_lots_only, yn(t.round_lots_only), "{ctx}");
            let ic = match t.issue_classification {
                IssueClassification::AmericanDepositaryShare => b'A',
                IssueClassification::Bond => b'B',
                IssueClassification::CommonStock => b'C',
                IssueClassification::DepositoryReceipt => b'F',
                IssueClassification::A144 => b'I',
                IssueClassification::LimitedPartnership => b'L',
                IssueClassification::Notes => b'N',
                IssueClassification::OrdinaryShare => b'O',
                IssueClassification::PreferredStock => b'P',
                IssueClassification::OtherSecurities => b'Q',
                IssueClassification::Right => b'R',
                IssueClassification::SharesOfBeneficialInterest => b'S',
                IssueClassification::ConvertibleDebenture => b'T',
                IssueClassification::Unit => b'U',
                IssueClassification::UnitsPerBenifInt => b'V',
                IssueClassification::Warrant => b'W',
            };
            assert_eq!(d.issue_classification, ic, "{ctx}");
            let st = match t.issue_subtype {
                itchy::IssueSubType::CommonShares => *b"C ",
                itchy::IssueSubType::NotApplicable => *b"Z ",
                itchy::IssueSubType::ExchangeTradedNotes => *b"EN",
                itchy::IssueSubType::ETFIndexFundShares => *b"I ",
                itchy::IssueSubType::REIT => *b"RT",
                itchy::IssueSubType::Llc => *b"LL",
                other => panic!("subtype {other:?} not produced by the generator"),
            };
            assert_eq!(d.issue_subtype, st, "{ctx}");
            assert_eq!(d.authenticity, if t.authenticity { b'P' } else { b'T' }, "{ctx}");
            assert_eq!(d.short_sale_threshold, yn_opt(t.short_sale_threshold), "{ctx}");
            assert_eq!(d.ipo_flag, yn_opt(t.ipo_flag), "{ctx}");
            let tier = match t.luld_ref_price_tier {
                LuldRefPriceTier::Tier1 => b'1',
                LuldRefPriceTier::Tier2 => b'2',
                LuldRefPriceTier::Na => b' ',
            };
            assert_eq!(d.luld_ref_price_tier, tier, "{ctx}");
            assert_eq!(d.etp_flag, yn_opt(t.etp_flag), "{ctx}");
            assert_eq!(d.etp_leverage_factor, t.etp_leverage_factor, "{ctx}");
            assert_eq!(d.inverse_indicator, yn(t.inverse_indicator), "{ctx}");
        }
        (
            Body::TradingAction { stock, trading_state, reason, .. },
            IB::TradingAction { stock: ts, trading_state: tt, reason: tr },
        ) => {
            assert_eq!(s8(stock), ts.as_str(), "{ctx}");
            let st = match tt {
                TradingState::Halted => b'H',
                TradingState::Paused => b'P',
                TradingState::QuotationOnly => b'Q',
                TradingState::Trading => b'T',
            };
            assert_eq!(*trading_state, st, "{ctx}");
            assert_eq!(s4(reason), tr.as_str(), "{ctx}");
        }
        (Body::RegSho { stock, action }, IB::RegShoRestriction { stock: ts, action: ta }) => {
            assert_eq!(s8(stock), ts.as_str(), "{ctx}");
            let a = match ta {
                RegShoAction::None => b'0',
                RegShoAction::Intraday => b'1',
                RegShoAction::Extant => b'2',
            };
            assert_eq!(*action, a, "{ctx}");
        }
        (
            Body::ParticipantPosition {
                mpid,
                stock,
                primary_market_maker,
                market_maker_mode,
                participant_state,
            },
            IB::ParticipantPosition(t),
        ) => {
            assert_eq!(s4(mpid), t.mpid.as_str(), "{ctx}");
            assert_eq!(s8(stock), t.stock.as_str(), "{ctx}");
            assert_eq!(*primary_market_maker, yn(t.primary_market_maker), "{ctx}");
            let mode = match t.market_maker_mode {
                MarketMakerMode::Normal => b'N',
                MarketMakerMode::Passive => b'P',
                MarketMakerMode::Syndicate => b'S',
                MarketMakerMode::Presyndicate => b'R',
                MarketMakerMode::Penalty => b'L',
            };
            assert_eq!(*market_maker_mode, mode, "{ctx}");
            let state = match t.market_participant_state {
                MarketParticipantState::Active => b'A',
                MarketParticipantState::Excused => b'E',
                MarketParticipantState::Withdrawn => b'W',
                MarketParticipantState::Suspended => b'S',
                MarketParticipantState::Deleted => b'D',
            };
            assert_eq!(*participant_state, state, "{ctx}");
        }
        (
            Body::MwcbDeclineLevel { level1, level2, level3 },
            IB::MwcbDeclineLevel { level1: a, level2: b, level3: c },
        ) => {
            assert_eq!((*level1, *level2, *level3), (a.raw(), b.raw(), c.raw()), "{ctx}");
        }
        (Body::MwcbStatus { breached_level }, IB::Breach(l)) => {
            let b = match l {
                LevelBreached::L1 => b'1',
                LevelBreached::L2 => b'2',
                LevelBreached::L3 => b'3',
            };
            assert_eq!(*breached_level, b, "{ctx}");
        }
        (
            Body::IpoQuotingPeriod { stock, release_time, release_qualifier, price },
            IB::IpoQuotingPeriod(t),
        ) => {
            assert_eq!(s8(stock), t.stock.as_str(), "{ctx}");
            assert_eq!(*release_time, t.release_time, "{ctx}");
            let q = match t.release_qualifier {
                IpoReleaseQualifier::Anticipated => b'A',
                IpoReleaseQualifier::Cancelled => b'C',
            };
            assert_eq!(*release_qualifier, q, "{ctx}");
            assert_eq!(*price, t.price.raw(), "{ctx}");
        }
        (
            Body::LuldAuctionCollar { stock, ref_price, upper_price, lower_price, extension },
            IB::LULDAuctionCollar {
                stock: ts,
                ref_price: r,
                upper_price: u,
                lower_price: l,
                extension: e,
            },
        ) => {
            assert_eq!(s8(stock), ts.as_str(), "{ctx}");
            assert_eq!(
                (*ref_price, *upper_price, *lower_price, *extension),
                (r.raw(), u.raw(), l.raw(), *e),
                "{ctx}"
            );
        }
        (
            Body::AddOrder { order_ref, side: s, shares, stock, price, attribution },
            IB::AddOrder(t),
        ) => {
            assert_eq!(*order_ref, t.reference, "{ctx}");
            assert_eq!(*s, side(t.side), "{ctx}");
            assert_eq!(*shares, t.shares, "{ctx}");
            assert_eq!(s8(stock), t.stock.as_str(), "{ctx}");
            assert_eq!(*price, t.price.raw(), "{ctx}");
            assert_eq!(attribution.map(|a| s4(&a)), t.mpid.map(|m| m.to_string()), "{ctx}");
        }
        (
            Body::OrderExecuted { order_ref, shares, match_number },
            IB::OrderExecuted { reference, executed, match_number: m },
        ) => {
            assert_eq!((*order_ref, *shares, *match_number), (*reference, *executed, *m), "{ctx}");
        }
        (
            Body::OrderExecutedWithPrice { order_ref, shares, match_number, printable, price },
            IB::OrderExecutedWithPrice {
                reference,
                executed,
                match_number: m,
                printable: p,
                price: pr,
            },
        ) => {
            assert_eq!((*order_ref, *shares, *match_number), (*reference, *executed, *m), "{ctx}");
            assert_eq!(*printable, yn(*p), "{ctx}");
            assert_eq!(*price, pr.raw(), "{ctx}");
        }
        (Body::OrderCancel { order_ref, shares }, IB::OrderCancelled { reference, cancelled }) => {
            assert_eq!((*order_ref, *shares), (*reference, *cancelled), "{ctx}");
        }
        (Body::OrderDelete { order_ref }, IB::DeleteOrder { reference }) => {
            assert_eq!(order_ref, reference, "{ctx}");
        }
        (Body::OrderReplace { old_ref, new_ref, shares, price }, IB::ReplaceOrder(t)) => {
            assert_eq!(
                (*old_ref, *new_ref, *shares, *price),
                (t.old_reference, t.new_reference, t.shares, t.price.raw()),
                "{ctx}"
            );
        }
        (
            Body::Trade { order_ref, side: s, shares, stock, price, match_number },
            IB::NonCrossTrade(t),
        ) => {
            assert_eq!(*order_ref, t.reference, "{ctx}");
            assert_eq!(*s, side(t.side), "{ctx}");
            assert_eq!(*shares, t.shares, "{ctx}");
            assert_eq!(s8(stock), t.stock.as_str(), "{ctx}");
            assert_eq!(*price, t.price.raw(), "{ctx}");
            assert_eq!(*match_number, t.match_number, "{ctx}");
        }
        (
            Body::CrossTrade { shares, stock, price, match_number, cross_type },
            IB::CrossTrade(t),
        ) => {
            assert_eq!(*shares, t.shares, "{ctx}");
            assert_eq!(s8(stock), t.stock.as_str(), "{ctx}");
            assert_eq!(*price, t.cross_price.raw(), "{ctx}");
            assert_eq!(*match_number, t.match_number, "{ctx}");
            assert_eq!(*cross_type, cross(t.cross_type), "{ctx}");
        }
        (Body::BrokenTrade { match_number }, IB::BrokenTrade { match_number: m }) => {
            assert_eq!(match_number, m, "{ctx}");
        }
        (Body::Imbalance(i), IB::Imbalance(t)) => {
            assert_eq!(i.paired_shares, t.paired_shares, "{ctx}");
            assert_eq!(i.imbalance_shares, t.imbalance_shares, "{ctx}");
            let dir = match t.imbalance_direction {
                ImbalanceDirection::Buy => b'B',
                ImbalanceDirection::Sell => b'S',
                ImbalanceDirection::NoImbalance => b'N',
                ImbalanceDirection::InsufficientOrders => b'O',
            };
            assert_eq!(i.direction, dir, "{ctx}");
            assert_eq!(s8(&i.stock), t.stock.as_str(), "{ctx}");
            assert_eq!(
                (i.far_price, i.near_price, i.current_ref_price),
                (t.far_price.raw(), t.near_price.raw(), t.current_ref_price.raw()),
                "{ctx}"
            );
            assert_eq!(i.cross_type, cross(t.cross_type), "{ctx}");
            assert_eq!(i.price_variation as char, t.price_variation_indicator, "{ctx}");
        }
        (Body::RetailInterest { stock, interest_flag }, IB::RetailPriceImprovementIndicator(t)) => {
            assert_eq!(s8(stock), t.stock.as_str(), "{ctx}");
            let f = match t.interest_flag {
                InterestFlag::RPIAvailableBuySide => b'B',
                InterestFlag::RPIAvailableSellSide => b'S',
                InterestFlag::RPIAvailableBothSides => b'A',
                InterestFlag::RPINoneAvailable => b'N',
            };
            assert_eq!(*interest_flag, f, "{ctx}");
        }
        _ => panic!("different message kinds: {ctx}"),
    }
}

/// The whole itchy-compatible feed through itchy's stream reader, side by side with ours.
#[test]
fn itchy_decodes_generated_feeds_to_the_same_fields() {
    for seed in [1, 2, 3] {
        let cfg = GenConfig { messages: 60_000, symbols: 12, seed, itchy_compatible: true };
        let feed = generate(&cfg);
        let mut ours = FeedReader::new(&feed);
        let mut theirs = itchy::MessageStream::from_reader(&feed[..]);
        let mut n = 0u64;
        loop {
            match (ours.next(), theirs.next()) {
                (None, None) => break,
                (Some(a), Some(b)) => {
                    same(&a.expect("ours decodes"), &b.expect("itchy decodes"));
                    n += 1;
                }
                (a, b) => panic!("streams end apart after {n}: {a:?} / {b:?}"),
            }
        }
        assert_eq!(n, cfg.messages);
        assert_eq!(ours.stats().errors(), 0);
    }
}

/// A full feed (with the two types itchy 0.3 lacks): every message whose type itchy knows is
/// decoded by itchy on its own and compared; the others are counted.
#[test]
fn itchy_agrees_message_by_message_on_full_feeds() {
    let feed =
        generate(&GenConfig { messages: 40_000, symbols: 30, seed: 99, itchy_compatible: false });
    let mut r = FeedReader::new(&feed);
    let (mut compared, mut skipped) = (0u64, 0u64);
    while let Some(frame) = r.next_frame() {
        let (offset, payload) = frame.expect("well framed");
        let ours = fastlane_market::itch::decode(payload).expect("ours decodes");
        if matches!(payload[0], b'h' | b'O') {
            skipped += 1;
            continue;
        }
        let framed = &feed[offset as usize..offset as usize + 2 + payload.len()];
        let theirs = itchy::MessageStream::from_reader(framed).next().expect("one").expect("ok");
        same(&ours, &theirs);
        compared += 1;
    }
    assert_eq!(compared + skipped, 40_000);
    assert!(skipped > 0, "the full feed has h/O messages");
}
