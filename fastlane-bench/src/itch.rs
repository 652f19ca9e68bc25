//! `fastlane itch replay`: a feed decoded and its order books rebuilt in software or through
//! the preprocessing card's rings (`fastlane-fpga`), with message rates, rejections, the
//! books' counts, the final top of book and the card's post-to-completion latency.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use fastlane_fpga::abi;
use fastlane_fpga::card::{CardError, SoftCard, SoftCardConfig};
use fastlane_hist::{format_ns, HlogWriter, LatencyRecorder, Summary};
use fastlane_market::book::{BookConfig, BookStats, OrderBooks, TopOfBook};
use fastlane_market::event::Event;
use fastlane_market::filter::SymbolFilter;
use fastlane_market::itch::{
    price4_to_string, stock_from_str, stock_to_string, DecodeStats, FeedReader, Stock,
    MESSAGE_TYPES,
};
use serde::Serialize;

#[derive(Debug, Serialize)]
struct Errors {
    truncated: u64,
    empty: u64,
    unknown_type: u64,
    length_mismatch: u64,
    bad_field: u64,
}

#[derive(Debug, Serialize)]
struct BookReport {
    adds: u64,
    executions: u64,
    cancels: u64,
    deletes: u64,
    replaces: u64,
    updates: u64,
    top_changes: u64,
    unknown_ref: u64,
    duplicate_ref: u64,
    zero_shares: u64,
    locate_mismatch: u64,
    overfill: u64,
    capacity_exhausted: u64,
}

#[derive(Debug, Serialize)]
struct TopRow {
    locate: u16,
    symbol: String,
    bid_price: String,
    bid_shares: u64,
    ask_price: String,
    ask_shares: u64,
}

/// What a replay found (`--json` prints it as is).
#[derive(Debug, Serialize)]
pub struct ReplayReport {
    file: String,
    through_card: bool,
    messages: u64,
    bytes: u64,
    by_type: BTreeMap<String, u64>,
    errors: Errors,
    filtered_out: u64,
    book: BookReport,
    elapsed_s: f64,
    messages_per_s: f64,
    top_of_book: Vec<TopRow>,
    latency: Option<Summary>,
}

fn book_report(s: &BookStats) -> BookReport {
    BookReport {
        adds: s.adds,
        executions: s.executions,
        cancels: s.cancels,
        deletes: s.deletes,
        replaces: s.replaces,
        updates: s.updates,
        top_changes: s.top_changes,
        unknown_ref: s.unknown_ref,
        duplicate_ref: s.duplicate_ref,
        zero_shares: s.zero_shares,
        locate_mismatch: s.locate_mismatch,
        overfill: s.overfill,
        capacity_exhausted: s.capacity_exhausted,
    }
}

fn top_rows(tops: impl Iterator<Item = TopOfBook>, names: &BTreeMap<u16, Stock>) -> Vec<TopRow> {
    tops.filter(|t| t.bid_shares != 0 || t.ask_shares != 0)
        .map(|t| TopRow {
            locate: t.locate,
            symbol: names.get(&t.locate).map_or_else(|| "?".into(), stock_to_string),
            bid_price: price4_to_string(t.bid_price),
            bid_shares: t.bid_shares,
            ask_price: price4_to_string(t.ask_price),
            ask_shares: t.ask_shares,
        })
        .collect()
}

struct Outcome {
    decode: DecodeStats,
    book: BookStats,
    filtered_out: u64,
    tops: Vec<TopOfBook>,
    names: BTreeMap<u16, Stock>,
    latency: Option<Summary>,
}

/// What `fastlane itch replay` replays, and how.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    /// The feed (length-prefixed ITCH 5.0 messages).
    pub file: PathBuf,
    /// Keep only these symbols' messages (empty: all); market-wide messages always pass.
    pub symbols: Vec<String>,
    /// Route every message through the software card's rings and record latencies.
    pub through_card: bool,
    /// Write the card's per-message latency histogram (.hlog) here.
    pub hlog: Option<PathBuf>,
    /// Descriptors in flight at most through the card (1..=256).
    pub depth: u32,
}

/// Decodes the feed, rebuilds the order books in software or through the card, and reports
/// message counts by type, what was rejected, the books' counts, the final top of book and,
/// through the card, the post-to-completion latency.
pub fn replay(a: &ReplayConfig) -> Result<ReplayReport> {
    if a.hlog.is_some() && !a.through_card {
        bail!("an .hlog of card latencies needs the replay through the card");
    }
    if !(1..=256).contains(&a.depth) {
        bail!("depth {}: 1 to 256 descriptors in flight", a.depth);
    }
    let feed = fs::read(&a.file).with_context(|| format!("reading {}", a.file.display()))?;
    let symbols: Vec<Stock> = a.symbols.iter().map(|s| stock_from_str(s)).collect();
    let start = Instant::now();
    let o = if a.through_card {
        replay_card(a, &feed, &symbols)?
    } else {
        replay_soft(&feed, &symbols)
    };
    let elapsed = start.elapsed();
    let d = &o.decode;
    let report = ReplayReport {
        file: a.file.display().to_string(),
        through_card: a.through_card,
        messages: d.messages,
        bytes: d.bytes,
        by_type: MESSAGE_TYPES
            .iter()
            .filter(|&&t| d.by_type[usize::from(t)] != 0)
            .map(|&t| ((t as char).to_string(), d.by_type[usize::from(t)]))
            .collect(),
        errors: Errors {
            truncated: d.truncated,
            empty: d.empty,
            unknown_type: d.unknown_type,
            length_mismatch: d.length_mismatch,
            bad_field: d.bad_field,
        },
        filtered_out: o.filtered_out,
        book: book_report(&o.book),
        elapsed_s: elapsed.as_secs_f64(),
        messages_per_s: d.messages as f64 / elapsed.as_secs_f64().max(1e-9),
        top_of_book: top_rows(o.tops.into_iter(), &o.names),
        latency: o.latency,
    };
    Ok(report)
}

fn replay_soft(feed: &[u8], symbols: &[Stock]) -> Outcome {
    let mut books = OrderBooks::new(BookConfig::default());
    let mut filter = (!symbols.is_empty()).then(|| SymbolFilter::new(symbols));
    let mut names = BTreeMap::new();
    let mut reader = FeedReader::new(feed);
    while let Some(m) = reader.next_message() {
        if let Some(f) = filter.as_mut() {
            if !f.admit(&m) {
                continue;
            }
        }
        if let (b'R', Some(s)) = (m.msg_type, m.stock()) {
            names.insert(m.locate, *s);
        }
        books.apply(&m);
    }
    Outcome {
        decode: reader.stats().clone(),
        book: *books.stats(),
        filtered_out: filter.map_or(0, |f| f.dropped()),
        tops: books.active_locates().map(|l| books.top(l)).collect(),
        names,
        latency: None,
    }
}

fn replay_card(a: &ReplayConfig, feed: &[u8], symbols: &[Stock]) -> Result<Outcome> {
    let mut card =
        SoftCard::new(SoftCardConfig { symbols: symbols.to_vec(), ..SoftCardConfig::default() })
            .context("starting the software card")?;
    let mut flags = abi::ITCH_EVENTS | abi::ITCH_BOOK;
    if !symbols.is_empty() {
        flags |= abi::ITCH_FILTER;
    }
    let mut rec = LatencyRecorder::with_max(1_000_000_000)?;
    let mut log = match &a.hlog {
        Some(p) => {
            Some(HlogWriter::create(p).with_context(|| format!("creating {}", p.display()))?)
        }
        None => None,
    };
    if let Some(l) = log.as_mut() {
        l.write_comment(&format!("fastlane itch replay --through-card {}", a.file.display()))?;
    }
    // Post times by tag slot; tags are consecutive and complete in order.
    let mut posted_at = vec![Instant::now(); 256];
    let mut names = BTreeMap::new();
    let mut on_done = |c: &fastlane_fpga::abi::Completion,
                       events: &[Event],
                       rec: &mut LatencyRecorder,
                       posted_at: &[Instant]| {
        rec.record_since(posted_at[(c.tag & 255) as usize]);
        for e in events.iter().filter(|e| e.kind == b'R') {
            names.insert(e.locate, e.stock);
        }
    };
    let mut reader = FeedReader::new(feed);
    let (mut posted, mut reaped) = (0u64, 0u64);
    let mut last_interval = Instant::now();
    let mut truncated = 0u64;
    while let Some(frame) = reader.next_frame() {
        let Ok((offset, payload)) = frame else {
            truncated += 1;
            break;
        };
        let bytes = &feed[offset as usize..offset as usize + 2 + payload.len()];
        let mut spins = 0u64;
        loop {
            if posted - reaped < u64::from(a.depth) {
                match card.submit_itch(bytes, flags) {
                    Ok(tag) => {
                        posted_at[(tag & 255) as usize] = Instant::now();
                        posted += 1;
                        break;
                    }
                    Err(CardError::Full(_)) => {}
                    Err(e) => return Err(e).context("posting to the card"),
                }
            }
            reaped += card.reap_itch(|c, ev| on_done(c, ev, &mut rec, &posted_at))? as u64;
            spins += 1;
            if spins > 100_000_000 {
                bail!("the card stopped answering after {reaped} of {posted} descriptors");
            }
        }
        if let Some(l) = log.as_mut() {
            if last_interval.elapsed() >= Duration::from_secs(1) {
                l.write_interval(None, &rec.take_interval())?;
                last_interval = Instant::now();
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while reaped < posted {
        reaped += card.reap_itch(|c, ev| on_done(c, ev, &mut rec, &posted_at))? as u64;
        if Instant::now() > deadline {
            bail!("the card stopped answering after {reaped} of {posted} descriptors");
        }
    }
    {
        let interval = rec.take_interval();
        if let Some(l) = log.as_mut() {
            l.write_interval(None, &interval)?;
            l.flush()?;
        }
    }
    let latency = Some(Summary::from_histogram(rec.total()));
    let report = card.shutdown().context("the card's engine panicked")?;
    let mut decode = report.decode;
    decode.truncated += truncated;
    let books = report.books;
    Ok(Outcome {
        decode,
        book: report.book_stats,
        filtered_out: report.filtered_out,
        tops: books.active_locates().map(|l| books.top(l)).collect(),
        names,
        latency,
    })
}

impl ReplayReport {
    /// The report as text: counts, then the top of book per symbol.
    pub fn write_text(&self, out: &mut impl Write) -> Result<()> {
        write_text(out, self)
    }
}

fn write_text(out: &mut impl Write, r: &ReplayReport) -> Result<()> {
    writeln!(
        out,
        "file        {}{}",
        r.file,
        if r.through_card { " (through the card)" } else { "" }
    )?;
    writeln!(
        out,
        "messages    {} ({} bytes) in {:.3} s, {:.0} msg/s",
        r.messages, r.bytes, r.elapsed_s, r.messages_per_s
    )?;
    let types: Vec<String> = r.by_type.iter().map(|(t, n)| format!("{t}:{n}")).collect();
    writeln!(out, "by type     {}", types.join(" "))?;
    let e = &r.errors;
    writeln!(
        out,
        "rejected    truncated {} empty {} unknown-type {} length-mismatch {} bad-field {}",
        e.truncated, e.empty, e.unknown_type, e.length_mismatch, e.bad_field
    )?;
    if r.filtered_out > 0 {
        writeln!(out, "filtered    {} messages of other symbols", r.filtered_out)?;
    }
    let b = &r.book;
    writeln!(
        out,
        "book        adds {} executions {} cancels {} deletes {} replaces {} top-changes {}",
        b.adds, b.executions, b.cancels, b.deletes, b.replaces, b.top_changes
    )?;
    writeln!(
        out,
        "anomalies   unknown-ref {} duplicate-ref {} zero-shares {} locate-mismatch {} overfill {} capacity {}",
        b.unknown_ref, b.duplicate_ref, b.zero_shares, b.locate_mismatch, b.overfill, b.capacity_exhausted
    )?;
    if let Some(l) = &r.latency {
        writeln!(
            out,
            "card latency p50 {} p99 {} p99.9 {} max {} ({} messages, post to completion)",
            format_ns(l.p50_ns as f64),
            format_ns(l.p99_ns as f64),
            format_ns(l.p99_9_ns as f64),
            format_ns(l.max_ns as f64),
            l.count
        )?;
    }
    writeln!(out)?;
    writeln!(
        out,
        "{:>6}  {:<8} {:>12} {:>10}  {:>12} {:>10}",
        "LOCATE", "SYMBOL", "BID", "BID_SHR", "ASK", "ASK_SHR"
    )?;
    for t in &r.top_of_book {
        writeln!(
            out,
            "{:>6}  {:<8} {:>12} {:>10}  {:>12} {:>10}",
            t.locate, t.symbol, t.bid_price, t.bid_shares, t.ask_price, t.ask_shares
        )?;
    }
    Ok(())
}
