//! The book against the naive `BTreeMap` reference model, after every message: on generated
//! (valid) feeds, and on feeds corrupted by a seeded random loop so every anomaly path runs.

use fastlane_market::book::{BookConfig, OrderBooks};
use fastlane_market::gen::{generate_messages, GenConfig, Rng};
use fastlane_market::itch::{Body, Message, Side};
use fastlane_market::reference::ReferenceBooks;

fn compare(book: &mut OrderBooks, model: &mut ReferenceBooks, m: &Message) {
    let a = book.apply(m);
    let b = model.apply(m);
    assert_eq!(a, b, "top-of-book change after {m:?}");
    for side in [Side::Buy, Side::Sell] {
        let ours: Vec<_> = book.levels(m.locate, side).collect();
        assert_eq!(ours, model.levels(m.locate, side), "{side:?} levels after {m:?}");
    }
    assert_eq!(*book.stats(), model.stats, "stats after {m:?}");
    assert_eq!(book.live_orders(), model.live_orders());
}

#[test]
fn generated_feeds_match_the_model_with_no_anomalies() {
    for seed in 0..4 {
        let cfg = GenConfig {
            messages: 40_000,
            symbols: 1 + seed as u16 * 5,
            seed,
            itchy_compatible: false,
        };
        let mut book = OrderBooks::new(BookConfig { orders_max: 1 << 16, levels_reserved: 8 });
        let mut model = ReferenceBooks::new(1 << 16);
        generate_messages(&cfg, |m| compare(&mut book, &mut model, m));
        let s = book.stats();
        assert_eq!(s.anomalies(), 0, "seed {seed}: {s:?}");
        assert!(
            s.adds > 10_000 && s.executions > 0 && s.cancels > 0 && s.deletes > 0 && s.replaces > 0
        );
        assert!(s.top_changes > 1_000);
        for l in book.active_locates() {
            assert_eq!(book.top(l), model.top(l));
        }
    }
}

/// Corrupt a valid feed: wrong references, duplicate adds, overfills, wrong locates, zero
/// shares, and a table small enough to fill up.
#[test]
fn corrupted_feeds_match_the_model_in_every_anomaly() {
    for seed in 0..8u64 {
        let mut rng = Rng::new(seed ^ 0x5eed);
        let orders_max = 50 + rng.below(200) as usize;
        let mut book = OrderBooks::new(BookConfig { orders_max, levels_reserved: 2 });
        let mut model = ReferenceBooks::new(orders_max);
        let cfg = GenConfig { messages: 20_000, symbols: 4, seed, itchy_compatible: false };
        let mut last_ref = 1u64;
        generate_messages(&cfg, |m| {
            let mut m = *m;
            if rng.below(10) == 0 {
                match &mut m.body {
                    Body::AddOrder { order_ref, shares, .. } => match rng.below(3) {
                        0 => *order_ref = last_ref,
                        1 => *shares = 0,
                        _ => m.locate = rng.below(6) as u16,
                    },
                    Body::OrderExecuted { order_ref, shares, .. }
                    | Body::OrderExecutedWithPrice { order_ref, shares, .. }
                    | Body::OrderCancel { order_ref, shares } => match rng.below(3) {
                        0 => *order_ref = rng.below(last_ref + 10),
                        1 => *shares = shares.saturating_mul(3),
                        _ => m.locate ^= 1,
                    },
                    Body::OrderDelete { order_ref } => *order_ref = rng.below(last_ref + 10),
                    Body::OrderReplace { old_ref, new_ref, shares, .. } => match rng.below(3) {
                        0 => *new_ref = last_ref,
                        1 => *old_ref = rng.below(last_ref + 10),
                        _ => *shares = 0,
                    },
                    _ => {}
                }
            }
            if let Body::AddOrder { order_ref, .. } = m.body {
                last_ref = order_ref;
            }
            compare(&mut book, &mut model, &m);
        });
        let s = book.stats();
        assert!(
            s.unknown_ref > 0 && s.duplicate_ref > 0 && s.zero_shares > 0,
            "seed {seed}: {s:?}"
        );
        assert!(s.locate_mismatch > 0 && s.overfill > 0, "seed {seed}: {s:?}");
    }
}

#[test]
fn capacity_exhaustion_matches_the_model() {
    let mut book = OrderBooks::new(BookConfig { orders_max: 10, levels_reserved: 1 });
    let mut model = ReferenceBooks::new(10);
    let cfg = GenConfig { messages: 5_000, symbols: 2, seed: 3, itchy_compatible: false };
    generate_messages(&cfg, |m| compare(&mut book, &mut model, m));
    assert!(book.stats().capacity_exhausted > 0);
}
