//! A deterministic ITCH 5.0 feed generator: realistic sequences for tests and benchmarks.
//!
//! The same `(messages, symbols, seed)` always gives the same bytes. A feed starts like a
//! trading day (start of messages, a Stock Directory per symbol, start of system hours, MWCB
//! levels, trading actions, Reg SHO, market-participant positions, an IPO quoting update and
//! an LULD collar, start of market hours), then mixes order flow around a drifting mid price
//! per symbol (adds with and without attribution, partial and full executions with and without
//! price, partial cancels, deletes, replaces, non-displayed trades, crosses, broken trades,
//! imbalance and retail-interest messages, occasional halts and MWCB status), and ends with end
//! of market hours, end of system hours and end of messages. Every order message names a live
//! order and never takes more shares than it has, so a correct book reports no anomaly.

use fastlane_util::SplitMix64;

use crate::book::{BookConfig, OrderBooks};
use crate::itch::{
    encode_to_vec, stock_from_str, Body, DlcrPriceDiscovery, Imbalance, Message, Side, Stock,
    StockDirectory,
};

/// SplitMix64 ([`fastlane_util::SplitMix64`]): small, fast, and good enough for test data.
#[derive(Debug, Clone)]
pub struct Rng(SplitMix64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Self(SplitMix64::new(seed))
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }
    /// Uniform in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
    /// One of `choices`.
    pub fn pick<T: Copy>(&mut self, choices: &[T]) -> T {
        choices[self.below(choices.len() as u64) as usize]
    }
}

/// What to generate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GenConfig {
    /// Messages in the feed (all types together).
    pub messages: u64,
    /// Instruments (stock locates 1..=symbols).
    pub symbols: u16,
    /// PRNG seed.
    pub seed: u64,
    /// Leave out the two types the `itchy` 0.3 decoder does not know (`h` operational halt,
    /// `O` DLCR price discovery), so it can read the whole feed.
    pub itchy_compatible: bool,
}

impl Default for GenConfig {
    fn default() -> Self {
        Self { messages: 100_000, symbols: 16, seed: 1, itchy_compatible: false }
    }
}

const TICKERS: [&str; 24] = [
    "AAPL", "MSFT", "AMZN", "NVDA", "GOOGL", "META", "TSLA", "AMD", "INTC", "QQQ", "SPY", "NFLX",
    "ADBE", "CSCO", "PEP", "COST", "AVGO", "TXN", "QCOM", "SBUX", "INTU", "AMAT", "MU", "PYPL",
];

/// The symbol of locate `locate` (1-based) in generated feeds.
pub fn symbol_name(locate: u16) -> String {
    match TICKERS.get(usize::from(locate).wrapping_sub(1)) {
        Some(t) => (*t).to_owned(),
        None => format!("SYM{locate:05}"),
    }
}

#[derive(Debug, Clone, Copy)]
struct Live {
    order_ref: u64,
    locate: u16,
    side: Side,
    shares: u32,
    price: u32,
}

struct State {
    rng: Rng,
    cfg: GenConfig,
    stocks: Vec<Stock>,
    mids: Vec<u32>,
    live: Vec<Live>,
    /// The book the feed builds, to keep new prices from crossing it.
    books: OrderBooks,
    next_ref: u64,
    next_match: u64,
    ts: u64,
    emitted: u64,
}

const LIVE_MAX: usize = 200_000;
const MPIDS: [&str; 4] = ["GSCO", "MSCO", "NITE", "VIRT"];

impl State {
    fn emit(&mut self, locate: u16, body: Body, f: &mut impl FnMut(&Message)) {
        if self.emitted >= self.cfg.messages {
            return;
        }
        self.ts += self.rng.range(1, 40_000);
        let m = Message {
            msg_type: body.msg_type(),
            locate,
            tracking: self.rng.below(8) as u16,
            timestamp_ns: self.ts,
            body,
        };
        self.books.apply(&m);
        f(&m);
        self.emitted += 1;
    }

    fn locate(&mut self) -> u16 {
        // Skewed: low locates (the big names) trade more.
        let n = u64::from(self.cfg.symbols);
        let a = self.rng.below(n);
        let b = self.rng.below(n);
        a.min(b) as u16 + 1
    }

    fn stock(&self, locate: u16) -> Stock {
        self.stocks[usize::from(locate) - 1]
    }

    /// A passive price: around the mid, and never through the other side's best (a real
    /// matching engine would have executed a crossing order, so feeds never show a crossed
    /// book).
    fn price_near(&mut self, locate: u16, side: Side) -> u32 {
        let mid = self.mids[usize::from(locate) - 1];
        let ticks = 1 + self.rng.below(4) * self.rng.below(6);
        let off = (ticks * 100) as u32;
        let top = self.books.top(locate);
        match side {
            Side::Buy => {
                let p = mid.saturating_sub(off).max(100);
                if top.ask_shares > 0 && p >= top.ask_price {
                    top.ask_price.saturating_sub(100 * (1 + self.rng.below(3) as u32)).max(100)
                } else {
                    p
                }
            }
            Side::Sell => {
                let p = mid + off;
                if top.bid_shares > 0 && p <= top.bid_price {
                    top.bid_price + 100 * (1 + self.rng.below(3) as u32)
                } else {
                    p
                }
            }
        }
    }

    fn shares(&mut self) -> u32 {
        if self.rng.below(10) == 0 {
            self.rng.range(1, 99) as u32
        } else {
            100 * self.rng.range(1, 10) as u32
        }
    }

    fn take_live(&mut self) -> Option<(usize, Live)> {
        if self.live.is_empty() {
            return None;
        }
        // Mostly recent orders (they are near the top of the book).
        let n = self.live.len() as u64;
        let i = if self.rng.below(4) == 0 {
            self.rng.below(n)
        } else {
            n - 1 - self.rng.below(n.min(64))
        };
        Some((i as usize, self.live[i as usize]))
    }

    fn directory(&mut self, i: usize) -> Body {
        let r = &mut self.rng;
        Body::StockDirectory(StockDirectory {
            stock: self.stocks[i],
            market_category: r.pick(b"QGSNAPZV "),
            financial_status: r.pick(b"NNNNDEQSGHJKC "),
            round_lot_size: 100,
            round_lots_only: r.pick(b"NY"),
            issue_classification: r.pick(b"ABCFILNOPQRSTUVW"),
            issue_subtype: r.pick(&[*b"C ", *b"Z ", *b"EN", *b"I ", *b"RT", *b"LL"]),
            authenticity: r.pick(b"PT"),
            short_sale_threshold: r.pick(b"YN "),
            ipo_flag: r.pick(b"YN "),
            luld_ref_price_tier: r.pick(b"12 "),
            etp_flag: r.pick(b"YN "),
            etp_leverage_factor: r.below(4) as u32,
            inverse_indicator: r.pick(b"YN"),
        })
    }

    fn order_flow(&mut self, f: &mut impl FnMut(&Message)) {
        let roll = self.rng.below(1000);
        let want_add = self.live.is_empty() || (self.live.len() < 20 && roll < 900);
        let roll = if want_add { 0 } else { roll };
        let roll = if self.live.len() >= LIVE_MAX && roll < 370 { 400 } else { roll };
        match roll {
            0..=369 => {
                let locate = self.locate();
                let side = if self.rng.below(2) == 0 { Side::Buy } else { Side::Sell };
                if self.rng.below(50) == 0 {
                    // The mid drifts one tick.
                    let m = &mut self.mids[usize::from(locate) - 1];
                    *m = if self.rng.below(2) == 0 {
                        m.saturating_sub(100).max(10_000)
                    } else {
                        *m + 100
                    };
                }
                let price = self.price_near(locate, side);
                let shares = self.shares();
                let order_ref = self.next_ref;
                self.next_ref += 1 + self.rng.below(3);
                let attribution = (roll >= 330).then(|| stock_mpid(self.rng.pick(&MPIDS)));
                self.live.push(Live { order_ref, locate, side, shares, price });
                let stock = self.stock(locate);
                self.emit(
                    locate,
                    Body::AddOrder { order_ref, side, shares, stock, price, attribution },
                    f,
                );
            }
            370..=449 => {
                let Some((i, o)) = self.take_live() else { return };
                let full = self.rng.below(2) == 0 || o.shares == 1;
                let shares =
                    if full { o.shares } else { self.rng.range(1, u64::from(o.shares) - 1) as u32 };
                let match_number = self.next_match;
                self.next_match += 1;
                let body = if roll < 435 {
                    Body::OrderExecuted { order_ref: o.order_ref, shares, match_number }
                } else {
                    let printable = self.rng.pick(b"YN");
                    Body::OrderExecutedWithPrice {
                        order_ref: o.order_ref,
                        shares,
                        match_number,
                        printable,
                        price: o.price + 100,
                    }
                };
                self.reduce(i, shares);
                self.emit(o.locate, body, f);
            }
            450..=509 => {
                let Some((i, o)) = self.take_live() else { return };
                if o.shares < 2 {
                    return;
                }
                let shares = self.rng.range(1, u64::from(o.shares) - 1) as u32;
                self.reduce(i, shares);
                self.emit(o.locate, Body::OrderCancel { order_ref: o.order_ref, shares }, f);
            }
            510..=769 => {
                let Some((i, o)) = self.take_live() else { return };
                self.live.swap_remove(i);
                self.emit(o.locate, Body::OrderDelete { order_ref: o.order_ref }, f);
            }
            770..=889 => {
                let Some((i, o)) = self.take_live() else { return };
                let new_ref = self.next_ref;
                self.next_ref += 1;
                let price = self.price_near(o.locate, o.side);
                let shares = self.shares();
                self.live[i] =
                    Live { order_ref: new_ref, locate: o.locate, side: o.side, shares, price };
                self.emit(
                    o.locate,
                    Body::OrderReplace { old_ref: o.order_ref, new_ref, shares, price },
                    f,
                );
            }
            _ => self.other(roll, f),
        }
    }

    fn reduce(&mut self, i: usize, shares: u32) {
        if self.live[i].shares == shares {
            self.live.swap_remove(i);
        } else {
            self.live[i].shares -= shares;
        }
    }

    fn other(&mut self, roll: u64, f: &mut impl FnMut(&Message)) {
        let locate = self.locate();
        let stock = self.stock(locate);
        let mid = self.mids[usize::from(locate) - 1];
        let match_number = self.next_match;
        let body = match roll {
            890..=929 => {
                self.next_match += 1;
                let shares = self.shares();
                Body::Trade {
                    order_ref: 0,
                    side: Side::Buy,
                    shares,
                    stock,
                    price: mid,
                    match_number,
                }
            }
            930..=934 => {
                self.next_match += 1;
                let cross_type = self.rng.pick(b"OCHI");
                Body::CrossTrade {
                    shares: self.rng.range(0, 1_000_000),
                    stock,
                    price: mid,
                    match_number,
                    cross_type,
                }
            }
            935..=936 => Body::BrokenTrade { match_number: self.rng.range(1, match_number.max(1)) },
            937..=969 => {
                let r = &mut self.rng;
                Body::Imbalance(Imbalance {
                    paired_shares: r.range(0, 500_000),
                    imbalance_shares: r.range(0, 100_000),
                    direction: r.pick(b"BSNO"),
                    stock,
                    far_price: mid + 200,
                    near_price: mid + 100,
                    current_ref_price: mid,
                    cross_type: r.pick(b"OCHA"),
                    price_variation: r.pick(b"L123456789ABC "),
                })
            }
            970..=981 => Body::RetailInterest { stock, interest_flag: self.rng.pick(b"BSAN") },
            982..=984 => Body::TradingAction {
                stock,
                trading_state: self.rng.pick(b"HPQT"),
                reserved: b' ',
                reason: self.rng.pick(&[*b"T1  ", *b"LUDP", *b"    ", *b"MWC1"]),
            },
            985..=986 => Body::RegSho { stock, action: self.rng.pick(b"012") },
            987..=989 => Body::ParticipantPosition {
                mpid: stock_mpid(self.rng.pick(&MPIDS)),
                stock,
                primary_market_maker: self.rng.pick(b"YN"),
                market_maker_mode: self.rng.pick(b"NPSRL"),
                participant_state: self.rng.pick(b"AEWSD"),
            },
            990 => Body::IpoQuotingPeriod {
                stock,
                release_time: 34_200 + self.rng.below(3600) as u32,
                release_qualifier: self.rng.pick(b"AC"),
                price: mid,
            },
            991..=993 => Body::LuldAuctionCollar {
                stock,
                ref_price: mid,
                upper_price: mid + mid / 10,
                lower_price: mid - mid / 10,
                extension: self.rng.below(3) as u32,
            },
            994 => Body::MwcbStatus { breached_level: self.rng.pick(b"123") },
            995..=996 if !self.cfg.itchy_compatible => Body::OperationalHalt {
                stock,
                market_code: self.rng.pick(b"QBX"),
                action: self.rng.pick(b"HT"),
            },
            997 if !self.cfg.itchy_compatible => Body::DlcrPriceDiscovery(DlcrPriceDiscovery {
                stock,
                open_eligibility: self.rng.pick(b"NY"),
                min_allowable_price: mid - mid / 5,
                max_allowable_price: mid + mid / 5,
                near_execution_price: mid,
                near_execution_time: self.ts,
                lower_price_collar: mid - mid / 10,
                upper_price_collar: mid + mid / 10,
            }),
            _ => {
                let shares = self.shares();
                self.next_match += 1;
                Body::Trade {
                    order_ref: 0,
                    side: Side::Buy,
                    shares,
                    stock,
                    price: mid,
                    match_number,
                }
            }
        };
        let locate = match body {
            Body::MwcbStatus { .. } => 0,
            _ => locate,
        };
        self.emit(locate, body, f);
    }
}

fn stock_mpid(s: &str) -> [u8; 4] {
    let mut out = [b' '; 4];
    out.copy_from_slice(&s.as_bytes()[..4]);
    out
}

/// Call `f` for each message of the feed described by `cfg`, in order.
pub fn generate_messages(cfg: &GenConfig, mut f: impl FnMut(&Message)) {
    let symbols = cfg.symbols.max(1);
    let cfg = GenConfig { symbols, ..*cfg };
    let mut rng = Rng::new(cfg.seed);
    let stocks: Vec<Stock> = (1..=symbols).map(|l| stock_from_str(&symbol_name(l))).collect();
    let mids = (0..symbols).map(|_| 100 * rng.range(500, 50_000) as u32).collect();
    let mut s = State {
        rng,
        cfg,
        stocks,
        mids,
        live: Vec::new(),
        books: OrderBooks::new(BookConfig { orders_max: LIVE_MAX + 1, levels_reserved: 64 }),
        next_ref: 1,
        next_match: 1,
        ts: 4 * 3600 * 1_000_000_000,
        emitted: 0,
    };
    let f = &mut f;
    let epilogue = 3u64;
    s.emit(0, Body::SystemEvent { event_code: b'O' }, f);
    for i in 0..usize::from(symbols) {
        let d = s.directory(i);
        s.emit(i as u16 + 1, d, f);
    }
    s.emit(0, Body::SystemEvent { event_code: b'S' }, f);
    s.emit(
        0,
        Body::MwcbDeclineLevel {
            level1: 5_000_000_000_000,
            level2: 4_700_000_000_000,
            level3: 4_300_000_000_000,
        },
        f,
    );
    for l in 1..=symbols {
        let stock = s.stock(l);
        s.emit(
            l,
            Body::TradingAction { stock, trading_state: b'T', reserved: b' ', reason: *b"    " },
            f,
        );
        s.emit(l, Body::RegSho { stock, action: b'0' }, f);
    }
    s.emit(0, Body::SystemEvent { event_code: b'Q' }, f);
    while s.emitted + epilogue < cfg.messages {
        s.order_flow(f);
    }
    for code in [b'M', b'E', b'C'] {
        s.emit(0, Body::SystemEvent { event_code: code }, f);
    }
}

/// The feed described by `cfg`, length-prefixed, in memory.
pub fn generate(cfg: &GenConfig) -> Vec<u8> {
    let mut out = Vec::with_capacity(cfg.messages as usize * 30);
    generate_messages(cfg, |m| encode_to_vec(m, &mut out));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_exact_count_and_every_type() {
        let cfg = GenConfig { messages: 50_000, symbols: 8, seed: 7, itchy_compatible: false };
        let a = generate(&cfg);
        assert_eq!(a, generate(&cfg));
        assert_ne!(a, generate(&GenConfig { seed: 8, ..cfg }));
        let mut r = crate::itch::FeedReader::new(&a);
        for m in &mut r {
            m.unwrap();
        }
        assert_eq!(r.stats().messages, 50_000);
        for t in crate::itch::MESSAGE_TYPES {
            assert!(r.stats().by_type[usize::from(t)] > 0, "type {} missing", t as char);
        }
        let mut books = crate::book::OrderBooks::new(crate::book::BookConfig::default());
        for m in crate::itch::FeedReader::new(&a) {
            if let Some(t) = books.apply(&m.unwrap()) {
                let crossed = t.bid_shares > 0 && t.ask_shares > 0 && t.bid_price >= t.ask_price;
                assert!(!crossed, "crossed book {t:?}");
            }
        }
        assert_eq!(books.stats().anomalies(), 0);
        let c = generate(&GenConfig { itchy_compatible: true, ..cfg });
        let mut r = crate::itch::FeedReader::new(&c);
        r.by_ref().for_each(|m| assert!(m.is_ok()));
        assert_eq!(r.stats().by_type[usize::from(b'h')] + r.stats().by_type[usize::from(b'O')], 0);
    }
}
