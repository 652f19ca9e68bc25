//! `fastlane itch`: generate deterministic ITCH 5.0 feeds and replay feeds into order books,
//! in software or through the preprocessing card's rings (`fastlane_bench::itch`).

use std::fs;
use std::io::{self, Write};
use std::path::PathBuf;

use anyhow::{Context, Result};
use fastlane_bench::itch::ReplayConfig;
use fastlane_market::gen::{generate, GenConfig};

/// Arguments of `fastlane itch`.
#[derive(Debug, clap::Args)]
pub struct ItchArgs {
    #[command(subcommand)]
    command: ItchCommand,
}

#[derive(Debug, clap::Subcommand)]
enum ItchCommand {
    /// Write a deterministic, realistic ITCH 5.0 feed (length-prefixed messages).
    Gen(GenArgs),
    /// Decode a feed, rebuild the order books, print message stats and the final top of book.
    Replay(ReplayArgs),
}

#[derive(Debug, clap::Args)]
#[command(after_help = "\
The same --messages/--symbols/--seed always give the same bytes.

Example:
  fastlane itch gen --messages 1000000 --symbols 16 --seed 1 --out feed.itch")]
struct GenArgs {
    /// Messages in the feed, all types together.
    #[arg(long, default_value_t = 1_000_000)]
    messages: u64,
    /// Instruments (stock locates 1..=K).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..))]
    symbols: u16,
    /// PRNG seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Output file.
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
    /// Leave out the `h` and `O` message types (for decoders that predate them).
    #[arg(long)]
    itchy_compatible: bool,
}

#[derive(Debug, clap::Args)]
#[command(after_help = "\
Prices are shown with the spec's 4 implied decimals. With --through-card every message goes \
through the SoftCard's descriptor and completion rings (one descriptor each, up to --depth in \
flight) and its post-to-completion latency is recorded.

Examples:
  fastlane itch replay feed.itch
  fastlane itch replay feed.itch --symbol AAPL --symbol MSFT
  fastlane itch replay feed.itch --through-card --hlog card.hlog && fastlane hist card.hlog")]
struct ReplayArgs {
    /// The feed.
    #[arg(value_name = "FILE")]
    file: PathBuf,
    /// Keep only this symbol's messages (repeatable); market-wide messages always pass.
    #[arg(long = "symbol", value_name = "S")]
    symbols: Vec<String>,
    /// Route every message through the software card's rings and record latencies.
    #[arg(long)]
    through_card: bool,
    /// Write the per-message latency histogram (.hlog) here (needs --through-card).
    #[arg(long, value_name = "FILE", requires = "through_card")]
    hlog: Option<PathBuf>,
    /// Descriptors in flight at most with --through-card.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=256))]
    depth: u32,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// Run `fastlane itch`.
pub fn run(args: &ItchArgs) -> Result<()> {
    match &args.command {
        ItchCommand::Gen(a) => gen(a),
        ItchCommand::Replay(a) => replay(a),
    }
}

/// The flags → one `fastlane_bench::itch::replay` → stdout.
fn replay(a: &ReplayArgs) -> Result<()> {
    let cfg = ReplayConfig {
        file: a.file.clone(),
        symbols: a.symbols.clone(),
        through_card: a.through_card,
        hlog: a.hlog.clone(),
        depth: a.depth,
    };
    let report = fastlane_bench::itch::replay(&cfg)?;
    let mut out = io::stdout().lock();
    if a.json {
        serde_json::to_writer_pretty(&mut out, &report)?;
        writeln!(out)?;
    } else {
        report.write_text(&mut out)?;
    }
    Ok(())
}

fn gen(a: &GenArgs) -> Result<()> {
    let cfg = GenConfig {
        messages: a.messages,
        symbols: a.symbols,
        seed: a.seed,
        itchy_compatible: a.itchy_compatible,
    };
    let feed = generate(&cfg);
    fs::write(&a.out, &feed).with_context(|| format!("writing {}", a.out.display()))?;
    eprintln!("wrote {} messages, {} bytes to {}", a.messages, feed.len(), a.out.display());
    Ok(())
}
