//! `arbor`: the command-line front end of the Arbor RL trainer.

use anyhow::Result;
use clap::{Parser, Subcommand};

mod alloc_count;
mod bench;
mod bench_algos;
mod bench_audit;
mod bench_critic;
mod bench_rollout;
mod bench_step;
mod bench_train;
mod check_device;
mod eval;
mod generate;
mod grade;
mod plot;
mod replay;
mod score;
mod swe;
mod train;

/// Arbor: reinforcement learning from verifiable rewards for Qwen-family
/// models, candle-native.
///
/// Start with `arbor score` to check that a checkpoint loads and predicts
/// what transformers predicts.
#[derive(Debug, Parser)]
#[command(name = "arbor", version, about, long_about = None, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Train with RL (FOCUS, Prefix Sampling, GRPO, PPO or VinePPO) on a
    /// synthetic, math or SWE task. Without a config, runs the embedded
    /// quickstart (tiny Qwen3-architecture model, CPU, under a minute).
    Train(train::TrainArgs),
    /// Render a run directory's metrics as PNG curves and a markdown table.
    Report(train::ReportArgs),
    /// Score a token sequence: next-token log-probabilities and greedy argmax
    /// at every position.
    Score(score::ScoreArgs),
    /// Generate completions with the paged engine (continuous batching,
    /// shared prompt KV for --n samples).
    Generate(generate::GenerateArgs),
    /// Evaluate a model on a math dataset: accuracy, pass@k, tokens per
    /// problem.
    Eval(eval::EvalArgs),
    /// Grade a JSONL of model responses against reference answers.
    Grade(grade::GradeArgs),
    /// Replay a recorded action list through a task; print the final state
    /// and reward.
    Replay(replay::ReplayArgs),
    /// SWE tasks: build them from real Python packages, oracle-check
    /// instance files.
    #[command(subcommand)]
    Swe(swe::SweCommand),
    /// Print a model's resolved files, validated config and parameter count.
    Info(score::InfoArgs),
    /// Benchmarks (results are printed; record the ones you cite in
    /// docs/benchmarks.md).
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Check the CUDA path on this machine: every kernel against its CPU
    /// reference, model logits and a training step on the GPU vs the CPU,
    /// then GPU benchmarks. Prints a table, writes JSON.
    CheckDevice(check_device::CheckDeviceArgs),
}

#[global_allocator]
static ALLOC: alloc_count::Counting = alloc_count::Counting;

fn main() {
    tune_malloc();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    // Engine steps and learner updates run on rayon workers
    // (`arbor_ops::in_pool`), and candle's backward walks the graph
    // recursively: give workers the main thread's headroom and more.
    if let Err(e) = rayon::ThreadPoolBuilder::new()
        .stack_size(16 << 20)
        .build_global()
    {
        tracing::warn!("rayon pool already built: {e}");
    }
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// glibc malloc settings for a process whose steps allocate and free the
/// same large buffers over and over (a prefill's activations are up to
/// 2048 x 1536 floats, 12.6 MB, a dozen per layer). By default glibc maps
/// such buffers fresh from the OS and unmaps them on free, or serves them
/// from per-thread arenas that it shrinks and grows again, so every use
/// pays a page fault per 4 KB and the kernel's zeroing: 160 thousand
/// faults in the 2048-token prefill of `arbor bench generate` (about a
/// fifth of its time). Here buffers up to 32 MB come from one arena that
/// keeps its freed memory for reuse and never trims it: 48 thousand faults
/// in that prefill (mostly the KV cache's first touch), peak RSS
/// unchanged. A learner update frees several GB of activations at the end
/// of its backward; an arena trimmed at 1 GB gave most of them back and
/// faulted them in again in the next update (SmolLM2-135M shape, 4 x 256,
/// mixed precision: 4.1 million faults over four updates against 1.7
/// million untrimmed, about 10% of the update's time). Buffers over 32 MB
/// (the KV cache's per-layer storage) are still mapped lazily. Skipped
/// when the user sets glibc's own malloc variables.
fn tune_malloc() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let user_set = std::env::vars_os().any(|(k, _)| {
            let k = k.to_string_lossy();
            k.starts_with("MALLOC_") || k == "GLIBC_TUNABLES"
        });
        if !user_set {
            // SAFETY: plain setters, called before any other thread exists.
            #[allow(unsafe_code)]
            unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
                // -1: never trim (mallopt(3)).
                libc::mallopt(libc::M_TRIM_THRESHOLD, -1);
                libc::mallopt(libc::M_ARENA_MAX, 1);
            }
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    // A bad switch list fails here, by name, before any work.
    arbor_ops::tuning::cuts_off_from_env().map_err(anyhow::Error::msg)?;
    match cli.command {
        Command::Train(a) => train::run(a),
        Command::Report(a) => train::report(a),
        Command::Score(a) => score::run(a),
        Command::Info(a) => score::info(a),
        Command::Generate(a) => generate::run(a),
        Command::Eval(a) => eval::run(a),
        Command::Grade(a) => grade::run(a),
        Command::Replay(a) => replay::run(a),
        Command::Swe(c) => swe::run(c),
        Command::Bench(b) => bench::run(b),
        Command::CheckDevice(a) => check_device::run(a),
    }
}
