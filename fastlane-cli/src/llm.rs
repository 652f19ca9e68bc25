//! `fastlane llm`: the inference engine from the command line.
//!
//! - `serve`, `generate`, `make-random`: flags and run functions in
//!   `fastlane_llm::commands` (the shared model, engine and listener flags in
//!   `fastlane_llm::args`).
//! - `bench`: decode, prefill, batching and swap overlap against floors measured in the same
//!   run, in the `fastlane-bench` crate (`llm_bench`).

use anyhow::Result;
use clap::{Args, Subcommand};
use fastlane_llm::commands::{self, GenerateArgs, MakeRandomArgs, ServeArgs};

/// Arguments of `fastlane llm`.
#[derive(Debug, Args)]
pub struct LlmArgs {
    #[command(subcommand)]
    cmd: LlmCmd,
}

#[derive(Debug, Subcommand)]
enum LlmCmd {
    /// Generate text: one prompt streamed to stdout, or --prompts FILE all at once.
    Generate(Box<GenerateArgs>),
    /// Write a seeded random model as a Hugging Face directory (config.json + safetensors).
    MakeRandom(MakeRandomArgs),
    /// Measure decode, prefill, batching and swap overlap against floors of the same run.
    Bench(Box<fastlane_bench::llm_bench::BenchArgs>),
    /// Serve the engine over HTTP: the OpenAI API (/v1/completions, /v1/chat/completions,
    /// /v1/models), /health, /livez, /readyz and /metrics, tenants from --tenants.
    Serve(Box<ServeArgs>),
}

/// Runs `fastlane llm`.
pub fn run(args: &LlmArgs) -> Result<()> {
    crate::logging::init();
    match &args.cmd {
        LlmCmd::Generate(a) => commands::generate(a),
        LlmCmd::MakeRandom(a) => commands::make_random(a),
        LlmCmd::Bench(a) => fastlane_bench::llm_bench::run(a),
        LlmCmd::Serve(a) => commands::serve(a),
    }
}
