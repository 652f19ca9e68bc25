//! `fastlane-disk`: FastLane's disk daemon on its own, the same as `fastlane serve` without the
//! rest of the `fastlane` tool (and without its LLM crates).
//!
//! `main` only parses, installs the logger, runs, and turns an error into a message on stderr
//! and exit status 1 (clap's usage errors exit 2).

use std::process::ExitCode;

use clap::Parser;
use fastlane_disk::ServeArgs;

/// The disk daemon's command line: `fastlane serve`'s options at the top level.
#[derive(Debug, Parser)]
#[command(
    name = "fastlane-disk",
    version,
    about = "FastLane's vhost-user-blk backend (the same as `fastlane serve`)",
    long_about = "FastLane's disk daemon, a vhost-user-blk backend: it exports a RAM disk \
                  (--backend mem:SIZE) or a file or block device (--blk-file PATH) as a \
                  virtio-blk disk on a Unix socket, to one vhost-user frontend at a time (QEMU, \
                  qemu-storage-daemon's clients, virtio-driver). It is the same daemon, with the \
                  same options, as `fastlane serve`, built without the rest of the `fastlane` \
                  tool. It follows QEMU's vhost-user backend program conventions (--socket-path, \
                  --fd, --print-capabilities) and systemd's socket activation (LISTEN_FDS) and \
                  readiness notification (NOTIFY_SOCKET); SIGINT or SIGTERM flushes the backend \
                  and stops it, SIGUSR1 logs the totals."
)]
struct Cli {
    #[command(flatten)]
    args: ServeArgs,
    #[command(flatten)]
    log: fastlane_daemon::LogArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if !cli.args.print_capabilities {
        fastlane_daemon::logging::init(cli.log.log_format);
    }
    match fastlane_disk::run(&cli.args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
