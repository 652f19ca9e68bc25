//! `fastlane`: the FastLane command-line tool.
//!
//! One subcommand per module; `main` only parses, dispatches, and turns an error into a
//! message on stderr and exit status 1.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod hist;
mod itch;
mod journal;
mod kv;
mod llm;
mod logging;
mod rdma;
mod router;

#[derive(Debug, Parser)]
#[command(name = "fastlane", version, about = "FastLane: a low-latency userspace data path")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    log: fastlane_daemon::LogArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Measure FastLane's paths against their floor or peer, in one run.
    Bench(fastlane_bench::suite::BenchArgs),
    /// Latency percentiles, comparisons and plots from HdrHistogram interval logs (.hlog).
    Hist(hist::HistArgs),
    /// ITCH 5.0 feeds: generate a deterministic one, or replay one into order books.
    Itch(itch::ItchArgs),
    /// The record journal: append, verify, dump, bench.
    Journal(journal::JournalArgs),
    /// The KV-cache swap tier: serve it on a Unix socket, benchmark its tiers.
    Kv(kv::KvArgs),
    /// The inference engine: generate with preemption through the swap tiers, write random
    /// models, benchmark against floors measured in the same run.
    Llm(llm::LlmArgs),
    /// RDMA: serve a remote memory pool; WRITE latency/bandwidth benchmark.
    Rdma(rdma::RdmaArgs),
    /// The multi-tenant front end (tenants, rate limits, DRR, fence, TTFT metrics) as a
    /// proxy before an OpenAI-compatible server.
    Router(router::RouterArgs),
    /// Export a block backend as a vhost-user-blk device on a Unix socket.
    Serve(fastlane_disk::ServeArgs),
}

/// `fastlane serve` under the name QEMU's and libvirt's vhost-user JSON descriptors point at
/// (`deploy/vhost-user/50-fastlane-vhost-blk.json`): a link named `fastlane-vhost-user-blk`
/// to this binary takes the options of `fastlane serve` directly, as a vhost-user backend
/// program must (QEMU `docs/interop/vhost-user.rst`, "Backend program conventions").
#[derive(Debug, Parser)]
#[command(
    name = fastlane_disk::BACKEND_PROGRAM,
    version,
    about = "FastLane's vhost-user-blk backend (the same as `fastlane serve`)"
)]
struct BackendProgram {
    #[command(flatten)]
    args: fastlane_disk::ServeArgs,
    #[command(flatten)]
    log: fastlane_daemon::LogArgs,
}

fn main() -> ExitCode {
    let argv0 = std::env::args_os().next().unwrap_or_default();
    let invoked_as = std::path::Path::new(&argv0).file_name().unwrap_or_default().to_owned();
    let result = if invoked_as == fastlane_disk::BACKEND_PROGRAM {
        let program = BackendProgram::parse();
        logging::set_format(program.log.log_format);
        serve(&program.args)
    } else {
        let cli = Cli::parse();
        logging::set_format(cli.log.log_format);
        dispatch(cli)
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn dispatch(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Bench(args) => fastlane_bench::suite::run(&args),
        Command::Hist(args) => hist::run(&args),
        Command::Itch(args) => itch::run(&args),
        Command::Journal(args) => journal::run(&args),
        Command::Kv(args) => kv::run(&args),
        Command::Llm(args) => llm::run(&args),
        Command::Rdma(args) => rdma::run(&args),
        Command::Router(args) => router::run(&args),
        Command::Serve(args) => serve(&args),
    }
}

/// `fastlane serve`: the disk daemon of `fastlane-disk` (the `fastlane-disk` binary runs the
/// same), logging in the `--log-format` chosen here.
fn serve(args: &fastlane_disk::ServeArgs) -> anyhow::Result<()> {
    if !args.print_capabilities {
        logging::init();
    }
    fastlane_disk::run(args)
}
