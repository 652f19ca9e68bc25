//! ITCH 5.0 decode and order-book reconstruction: `fastlane-fpga` against the `itchy` crate,
//! on the same generated feed, in one run.
//!
//! ```text
//! cargo bench --bench itch                            # criterion, about a minute
//! ITCH_BENCH_INTERLEAVED=40 cargo bench --bench itch  # 40 alternating rounds, best and median
//! ```
//!
//! On a shared machine the load changes between criterion's back-to-back measurements of two
//! peers, which moves their ratio; the interleaved mode runs the four cases in turn, round after
//! round, and reports the best and the median of each with their ratios, which hold up better.
//!
//! The feed: `fastlane itch gen --messages 200000 --symbols 16 --seed 1 --itchy-compatible`
//! (the same bytes, built in memory; `itchy` 0.3 does not know the `h`/`O` types, so the
//! feed leaves them out). Groups (criterion ids `group/peer`):
//! - `itch_decode`: every message decoded into a typed value and folded into a checksum so
//!   nothing is optimised away. `fastlane`: `FeedReader::next_message` over the bytes (skips
//!   and counts bad messages); `itchy`:
//!   `MessageStream::from_reader` over the same bytes (its intended use), errors skipped by
//!   `flatten`. Throughput in
//!   messages per second.
//! - `itch_book`: decode and rebuild every book, detecting top-of-book changes after each
//!   order message. `fastlane`: `FeedReader` + `OrderBooks`; `itchy+btree`: itchy's decoder
//!   feeding the textbook book (hash map of orders, `BTreeMap` of levels per side). Throughput
//!   in book updates (order messages) per second. Books are built fresh for every iteration,
//!   outside the timed part.

use std::collections::{BTreeMap, HashMap};
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, BatchSize, Criterion, Throughput};
use fastlane::market::book::{BookConfig, OrderBooks};
use fastlane::market::gen::{generate, GenConfig};
use fastlane::market::itch::{Body, FeedReader};

const MESSAGES: u64 = 200_000;

fn feed() -> Vec<u8> {
    generate(&GenConfig { messages: MESSAGES, symbols: 16, seed: 1, itchy_compatible: true })
}

fn is_order_message(t: u8) -> bool {
    matches!(t, b'A' | b'F' | b'E' | b'C' | b'X' | b'D' | b'U')
}

fn fastlane_decode(feed: &[u8]) -> u64 {
    let mut acc = 0u64;
    let mut r = FeedReader::new(feed);
    while let Some(m) = r.next_message() {
        acc = acc.wrapping_add(m.timestamp_ns ^ u64::from(m.locate));
        if let Body::AddOrder { price, .. } = m.body {
            acc = acc.wrapping_add(u64::from(price));
        }
    }
    acc
}

fn itchy_decode(feed: &[u8]) -> u64 {
    let mut acc = 0u64;
    for m in itchy::MessageStream::from_reader(feed).flatten() {
        acc = acc.wrapping_add(m.timestamp ^ u64::from(m.stock_locate));
        if let itchy::Body::AddOrder(a) = &m.body {
            acc = acc.wrapping_add(u64::from(a.price.raw()));
        }
    }
    acc
}

/// (price, shares) of a best level.
type Level = (u32, u64);

/// The textbook book over itchy's messages: same semantics as `fastlane_market::reference`.
#[derive(Default)]
struct BTreeBook {
    orders: HashMap<u64, (u16, bool, u32, u32)>,
    levels: HashMap<(u16, bool), BTreeMap<u32, u64>>,
    top_changes: u64,
}

impl BTreeBook {
    fn top(&self, locate: u16) -> (Option<Level>, Option<Level>) {
        let bid = self.levels.get(&(locate, true)).and_then(|m| m.last_key_value());
        let ask = self.levels.get(&(locate, false)).and_then(|m| m.first_key_value());
        (bid.map(|(p, s)| (*p, *s)), ask.map(|(p, s)| (*p, *s)))
    }

    fn add(&mut self, r: u64, locate: u16, buy: bool, price: u32, shares: u32) {
        self.orders.insert(r, (locate, buy, price, shares));
        *self.levels.entry((locate, buy)).or_default().entry(price).or_insert(0) +=
            u64::from(shares);
    }

    fn take(&mut self, r: u64, shares: Option<u32>) -> Option<(u16, bool)> {
        let o = self.orders.get_mut(&r)?;
        let (locate, buy, price, left) = *o;
        let n = shares.unwrap_or(left).min(left);
        o.3 -= n;
        if o.3 == 0 {
            self.orders.remove(&r);
        }
        let side = self.levels.get_mut(&(locate, buy))?;
        let lvl = side.get_mut(&price)?;
        *lvl -= u64::from(n);
        if *lvl == 0 {
            side.remove(&price);
        }
        Some((locate, buy))
    }

    fn apply(&mut self, m: &itchy::Message) {
        let locate = m.stock_locate;
        let before = self.top(locate);
        match &m.body {
            itchy::Body::AddOrder(a) => {
                self.add(a.reference, locate, a.side == itchy::Side::Buy, a.price.raw(), a.shares)
            }
            itchy::Body::OrderExecuted { reference, executed, .. }
            | itchy::Body::OrderExecutedWithPrice { reference, executed, .. }
            | itchy::Body::OrderCancelled { reference, cancelled: executed } => {
                self.take(*reference, Some(*executed));
            }
            itchy::Body::DeleteOrder { reference } => {
                self.take(*reference, None);
            }
            itchy::Body::ReplaceOrder(u) => {
                if let Some((l, buy)) = self.take(u.old_reference, None) {
                    self.add(u.new_reference, l, buy, u.price.raw(), u.shares);
                }
            }
            _ => return,
        }
        if self.top(locate) != before {
            self.top_changes += 1;
        }
    }
}

fn benches(c: &mut Criterion) {
    let feed = feed();
    assert_eq!(fastlane_decode(&feed), itchy_decode(&feed), "both decoders see the same feed");
    let updates = FeedReader::new(&feed).flatten().filter(|m| is_order_message(m.msg_type)).count();

    let mut g = c.benchmark_group("itch_decode");
    g.sample_size(20).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(5));
    g.throughput(Throughput::Elements(MESSAGES));
    g.bench_function("fastlane", |b| b.iter(|| fastlane_decode(black_box(&feed))));
    g.bench_function("itchy", |b| b.iter(|| itchy_decode(black_box(&feed))));
    g.finish();

    let mut g = c.benchmark_group("itch_book");
    g.sample_size(20).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(5));
    g.throughput(Throughput::Elements(updates as u64));
    g.bench_function("fastlane", |b| {
        b.iter_batched(fresh_books, |books| fastlane_book(&feed, books), BatchSize::PerIteration)
    });
    g.bench_function("itchy+btree", |b| {
        b.iter_batched(fresh_btree, |book| itchy_book(&feed, book), BatchSize::PerIteration)
    });
    g.finish();
}

fn fastlane_book(feed: &[u8], mut books: OrderBooks) -> u64 {
    let mut r = FeedReader::new(black_box(feed));
    while let Some(m) = r.next_message() {
        books.apply(&m);
    }
    assert_eq!(books.stats().anomalies(), 0);
    books.stats().top_changes
}

fn itchy_book(feed: &[u8], mut book: BTreeBook) -> u64 {
    for m in itchy::MessageStream::from_reader(black_box(feed)).flatten() {
        book.apply(&m);
    }
    book.top_changes
}

fn fresh_books() -> OrderBooks {
    OrderBooks::new(BookConfig { orders_max: 1 << 18, levels_reserved: 256 })
}

fn fresh_btree() -> BTreeBook {
    BTreeBook { orders: HashMap::with_capacity(1 << 18), ..BTreeBook::default() }
}

/// `rounds` rounds of the four cases in turn; prints best and median with ratios.
fn interleaved(rounds: usize) {
    let feed = feed();
    let updates = FeedReader::new(&feed).flatten().filter(|m| is_order_message(m.msg_type)).count();
    let mut t: [Vec<f64>; 4] = Default::default();
    for _ in 0..rounds {
        let s = Instant::now();
        black_box(fastlane_decode(black_box(&feed)));
        t[0].push(s.elapsed().as_secs_f64());
        let s = Instant::now();
        black_box(itchy_decode(black_box(&feed)));
        t[1].push(s.elapsed().as_secs_f64());
        let books = fresh_books();
        let s = Instant::now();
        black_box(fastlane_book(&feed, books));
        t[2].push(s.elapsed().as_secs_f64());
        let book = fresh_btree();
        let s = Instant::now();
        black_box(itchy_book(&feed, book));
        t[3].push(s.elapsed().as_secs_f64());
    }
    for v in &mut t {
        v.sort_by(f64::total_cmp);
    }
    let best = |i: usize| t[i][0];
    let median = |i: usize| fastlane::bench::stats::median(t[i].clone());
    println!("{rounds} interleaved rounds, {MESSAGES} messages, {updates} book updates per round");
    println!("| group | peer | best | median | best rate | ratio (best) | ratio (median) |");
    println!("|---|---|---|---|---|---|---|");
    for (group, units, n, a, b, peer) in [
        ("decode", "msgs/s", MESSAGES as f64, 0, 1, "itchy"),
        ("book", "updates/s", updates as f64, 2, 3, "itchy+btree"),
    ] {
        for (i, name) in [(a, "fastlane"), (b, peer)] {
            let r = if i == a { String::new() } else { format!("{:.2}x", best(b) / best(a)) };
            let rm = if i == a { String::new() } else { format!("{:.2}x", median(b) / median(a)) };
            println!(
                "| {group} | {name} | {:.2} ms | {:.2} ms | {:.1} M{units} | {r} | {rm} |",
                best(i) * 1e3,
                median(i) * 1e3,
                n / best(i) / 1e6
            );
        }
    }
}

criterion_group!(itch, benches);

fn main() {
    if let Some(rounds) = std::env::var("ITCH_BENCH_INTERLEAVED").ok().and_then(|v| v.parse().ok())
    {
        // Only under `cargo bench` (`--bench`); `cargo test` runs criterion's quick test mode.
        if std::env::args().any(|a| a == "--bench") {
            interleaved(rounds);
            return;
        }
    }
    itch();
    Criterion::default().configure_from_args().final_summary();
}
