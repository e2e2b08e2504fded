//! `arbor bench ...`: throughput and memory measurements.

use std::time::Instant;

use anyhow::{bail, Result};
use arbor_model::logprobs::token_logprobs;
use arbor_model::{
    parse_dtype, ActorCritic, Checkpoint, CriticMode, ModelConfig, ModelFiles, ParamLoader,
    ParamSource,
};
use candle_core::{Device, Tensor};
use candle_nn::VarMap;
use clap::{Args, Subcommand};
use serde::Serialize;

use crate::generate::MAX_SAMPLES;

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Training forward and forward+backward of the policy (+ shared value
    /// head) through the chunked logprob path: tokens/s and peak memory.
    Model(ModelBenchArgs),
    /// One learner update (forward, backward, AdamW) on a batch of rollouts
    /// of a given shape: tokens/s, peak memory, time per phase.
    Train(crate::bench_train::TrainBenchArgs),
    /// Generation throughput of the paged engine: a batch of prompts, greedy,
    /// a fixed number of new tokens each.
    Generate(GenBenchArgs),
    /// Fork throughput: one long prompt, N sampled continuations sharing its
    /// KV (prefill computed once).
    Fork(ForkBenchArgs),
    /// FOCUS audit-tree diagnostic: MSE of value estimates vs rollout budget
    /// (FOCUS, random, uniform, raw residual; constant and random critic).
    /// Table, PNG, JSON.
    Audit(crate::bench_audit::AuditArgs),
    /// FOCUS, Prefix Sampling, GRPO, PPO and VinePPO on a built-in task
    /// from the same warm-started policy at equal generated tokens per step,
    /// several seeds: held-out pass rate vs tokens, intervals, critic
    /// diagnostics.
    Algos(crate::bench_algos::AlgosArgs),
    /// Can the critic rank states at all? Fits it by regression on states
    /// with Monte-Carlo values from a frozen policy and scores it on
    /// held-out states against the noise ceiling and a depth baseline.
    Critic(crate::bench_critic::CriticBenchArgs),
    /// One whole RL step of a given shape (generation, value pass, update,
    /// weight sync), timed phase by phase: generated and trained tokens/s.
    Step(crate::bench_step::StepBenchArgs),
    /// The rollout scheduler with slow environments: wall, engine,
    /// environment and engine-idle time with environment steps inline and
    /// on worker threads.
    Rollout(crate::bench_rollout::RolloutBenchArgs),
    /// Peak memory of token logprobs: the fused chunked op (forward +
    /// backward) vs the naive full-logits log_softmax path, by allocation
    /// accounting.
    LogprobMemory(LogprobMemArgs),
}

/// The model a generation benchmark runs.
#[derive(Debug, Args)]
pub struct BenchModel {
    /// Shape preset with random weights: smollm2-135m, qwen3-0.6b or
    /// qwen3-4b (speed does not depend on the values).
    #[arg(long, default_value = "smollm2-135m", conflicts_with = "model")]
    pub preset: String,
    /// A real checkpoint instead (directory or HF id).
    #[arg(long, value_name = "PATH_OR_ID")]
    pub model: Option<String>,
    /// f32, bf16, f16 or f64 (bf16 on a CPU: bf16 weight matrices and KV
    /// cache, f32 activations; on a GPU bf16 throughout).
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// `cpu`, or `cuda` / `cuda:N` (a build with `--features cuda`): the
    /// model and the engine's KV cache on that GPU.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Print the result as JSON (one line per batch size when
    /// `--batch` lists several).
    #[arg(long)]
    pub json: bool,
    /// Peak memory bandwidth in GB/s for the roofline (default: from the
    /// GPU's attributes; none on the CPU unless given).
    #[arg(long, value_name = "GB_PER_S")]
    pub peak_gbs: Option<f64>,
    /// On a GPU, an f32 model generates through the dedicated bf16 step
    /// from a bf16 copy of its weights (`EngineConfig::bf16_rollouts`).
    #[arg(long)]
    pub bf16_rollouts: bool,
}

/// The device a benchmark's `--device` names.
pub(crate) fn bench_device(name: &str) -> Result<Device> {
    match name {
        "cpu" => Ok(Device::Cpu),
        d if d.starts_with("cuda") => {
            if !cfg!(feature = "cuda") {
                bail!("this arbor was built without CUDA; rebuild with `--features cuda` (see scripts/gpu-check.sh)");
            }
            let d = if d == "cuda" { "cuda:0" } else { d };
            arbor_train::parse_device(d)
                .map_err(|e| anyhow::anyhow!("no usable CUDA device `{d}`: {e}"))
        }
        other => bail!("--device must be cpu, cuda or cuda:N, not `{other}`"),
    }
}

#[derive(Debug, Args)]
pub struct GenBenchArgs {
    #[command(flatten)]
    pub m: BenchModel,
    /// Prompts in the batch; a comma-separated list (`1,64,256`) runs each
    /// size in turn on the same loaded model (the first run is the fresh
    /// process's).
    #[arg(long, default_value = "32", value_delimiter = ',')]
    pub batch: Vec<usize>,
    /// Tokens per prompt.
    #[arg(long, default_value_t = 64)]
    pub prompt_len: usize,
    /// New tokens per sequence (EOS ignored).
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Leading tokens every prompt shares (a system prompt; all of
    /// --prompt-len for a GRPO group sent as separate requests): computed
    /// once, then served from the prefix cache.
    #[arg(long, default_value_t = 0)]
    pub shared_prefix: usize,
}

#[derive(Debug, Args)]
pub struct ForkBenchArgs {
    #[command(flatten)]
    pub m: BenchModel,
    /// Samples forked from the one prompt.
    #[arg(long, default_value_t = 8)]
    pub n: usize,
    #[arg(long, default_value_t = 512)]
    pub prompt_len: usize,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
}

#[derive(Debug, Serialize)]
struct GenBenchResult {
    bench: &'static str,
    /// The preset (random weights of its shape), or the checkpoint.
    model: String,
    /// `random` for a preset, `checkpoint` for `--model`.
    weights: &'static str,
    dtype: String,
    /// `cpu`, or `cuda:N`: where the model and the KV cache were.
    device: String,
    sequences: usize,
    prompt_len: usize,
    /// `bench generate`: leading prompt tokens all prompts share.
    #[serde(skip_serializing_if = "Option::is_none")]
    shared_prefix: Option<usize>,
    new_tokens: usize,
    threads: usize,
    /// The CPU matmul kernels (`avx512`, `avx512-bf16`, `avx2`, `portable`).
    cpu_kernels: &'static str,
    seconds: f64,
    generated_tokens: u64,
    generated_tokens_per_s: f64,
    prefill_computed: u64,
    prefill_cached: u64,
    prefill_forked: u64,
    preemptions: u64,
    kv_pool_mib: f64,
    peak_rss_mib: f64,
    /// On a GPU: the CUDA memory pool's high-water mark during the run
    /// (KV pool, activations, logits; the weights were loaded before).
    peak_device_mib: Option<f64>,
    /// Steps that only decoded (no prompt token computed), their mean
    /// wall time, and their generated tokens per second.
    decode_steps: u64,
    ms_per_step: f64,
    decode_tokens_per_s: f64,
    /// The run's first step (a prefill: module loads, first launches) and
    /// its first decode-only step, in ms.
    first_step_ms: f64,
    first_decode_step_ms: f64,
    /// Whether this was the process's first run (its first steps then
    /// include the kernels' first loads).
    fresh_process: bool,
    /// Bytes of parameters (each read once per step) and of KV one token
    /// slot holds.
    weight_bytes: u64,
    kv_bytes_per_token: u64,
    /// Bytes a decode step reads at the least, averaged over the decode
    /// steps: the weights plus each sequence's KV rows.
    bytes_per_decode_step: f64,
    /// Peak memory bandwidth the roofline uses (GB/s), and where it came
    /// from (`device attributes`, `--peak-gbs`); none on the CPU unless given.
    bandwidth_gb_s: Option<f64>,
    bandwidth_source: Option<&'static str>,
    /// (bytes of every decode step / bandwidth) / their measured time.
    roofline_fraction: Option<f64>,
    /// `ARBOR_GPU_OFF`: the GPU overhead cuts turned off for this run.
    gpu_cuts_off: Vec<&'static str>,
    /// Whether decode-only steps ran on the engine's dedicated decode step.
    fused_decode: bool,
    /// `--bf16-rollouts`: an f32 model run from a bf16 weight copy.
    bf16_rollouts: bool,
    /// `Engine::invalidate` after the run, as after a learner's update: the
    /// time until new weights are what the engine reads.
    weight_refresh_ms: f64,
}

fn load_for_bench(m: &BenchModel) -> Result<(arbor_model::Transformer, String)> {
    let (preset, model, dtype) = (&m.preset, &m.model, &m.dtype);
    let dtype = parse_dtype(dtype)?;
    let dev = bench_device(&m.device)?;
    match model {
        Some(m) => {
            let lm = arbor_model::LoadedModel::load(
                m,
                &arbor_model::LoadOptions { dtype, device: dev },
            )?;
            Ok((lm.model, m.clone()))
        }
        None => {
            let cfg = preset_config(preset)?;
            let p = ParamLoader::frozen(ParamSource::Random { seed: 0 }, dtype, &dev);
            Ok((arbor_model::Transformer::load(&cfg, &p)?, preset.clone()))
        }
    }
}

pub(crate) fn preset_config(preset: &str) -> Result<ModelConfig> {
    Ok(match preset {
        "smollm2-135m" => ModelConfig::smollm2_135m(),
        "qwen3-0.6b" => ModelConfig::qwen3_0_6b(),
        "qwen3-4b" => ModelConfig::qwen3_4b(),
        other => bail!("unknown --preset `{other}` (smollm2-135m, qwen3-0.6b, qwen3-4b)"),
    })
}

/// The bench's model, once `--prompt-len` plus `--max-tokens` is known to
/// fit its context (a longer run would stop early and report fewer tokens
/// than asked); for a preset, checked before building it.
fn load_fitting(
    m: &BenchModel,
    prompt_len: usize,
    max_tokens: usize,
) -> Result<(arbor_model::Transformer, String)> {
    let fits = |context: usize| -> Result<()> {
        match prompt_len.checked_add(max_tokens) {
            Some(n) if n <= context => Ok(()),
            _ => bail!(
                "--prompt-len {prompt_len} + --max-tokens {max_tokens} exceed the model's \
                 context of {context} tokens"
            ),
        }
    };
    if m.model.is_none() {
        fits(preset_config(&m.preset)?.max_position_embeddings)?;
    }
    let (model, name) = load_for_bench(m)?;
    fits(model.cfg.max_position_embeddings)?;
    if model.cfg.vocab_size <= 10 {
        // `bench_prompt` keeps clear of the first 10 ids (often special).
        bail!(
            "{name}: the benches draw prompt tokens from ids 10 and up, and this model's \
             vocabulary has {} ids",
            model.cfg.vocab_size
        );
    }
    Ok((model, name))
}

/// Deterministic pseudo-random prompt tokens.
fn bench_prompt(len: usize, salt: u64, vocab: usize) -> Vec<u32> {
    (0..len as u64)
        .map(|i| {
            ((i.wrapping_add(salt * 7919)).wrapping_mul(2654435761) % (vocab as u64 - 10) + 10)
                as u32
        })
        .collect()
}

/// One bench run: the model flags it was given, and which run of the
/// process it is.
struct RunOpts<'a> {
    m: &'a BenchModel,
    /// One compact JSON line (several runs in one process).
    json_line: bool,
    fresh_process: bool,
}

/// The roofline's bandwidth: `--peak-gbs`, else the GPU's attributes.
fn roofline_bandwidth(dev: &Device, peak_gbs: Option<f64>) -> (Option<f64>, Option<&'static str>) {
    if let Some(g) = peak_gbs {
        return (Some(g * 1e9), Some("--peak-gbs"));
    }
    match dev {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => match arbor_ops::cuda::peak_bandwidth(d) {
            Some(b) => (Some(b), Some("device attributes")),
            None => (None, None),
        },
        _ => (None, None),
    }
}

fn run_engine_bench(
    bench: &'static str,
    model: &arbor_model::Transformer,
    name: String,
    shared_prefix: Option<usize>,
    jobs: Vec<(Vec<u32>, Vec<arbor_engine::SamplingParams>)>,
    opts: &RunOpts<'_>,
) -> Result<()> {
    let cfg = arbor_engine::EngineConfig {
        max_seqs: 512,
        max_batch_tokens: 4096,
        bf16_rollouts: opts.m.bf16_rollouts,
        ..Default::default()
    };
    let dev = model.device().clone();
    let meter = Meter::for_device(&dev)?;
    let device_base = meter.device_reset(&dev)?;
    let mut engine = arbor_engine::Engine::new(model, None, cfg)?;
    let sequences: usize = jobs.iter().map(|j| j.1.len()).sum();
    let prompt_len = jobs[0].0.len();
    let new_tokens = jobs[0].1[0].max_tokens;
    // Every weight a decode step reads once, at the width the step reads
    // it (the bf16 copy under --bf16-rollouts); an untied embedding table
    // is only gathered from.
    let fused_decode = engine.fast_decode_active();
    let width = |t: &Tensor| {
        if fused_decode {
            2
        } else {
            t.dtype().size_in_bytes()
        }
    };
    let tied = model.cfg.tie_word_embeddings;
    let weight_bytes: u64 = model
        .named_tensors()?
        .iter()
        .filter(|(name, _)| tied || name != "model.embed_tokens.weight")
        .map(|(_, t)| (t.elem_count() * width(t)) as u64)
        .sum();
    let kv_bytes_per_token = engine.kv_bytes_per_token() as u64;
    let start = Instant::now();
    for (p, s) in jobs {
        engine.submit(p, s)?;
    }
    // Step by hand to time the decode-only steps (each step ends with the
    // sampled tokens on the host, so wall time is device time).
    let (mut decode_s, mut decode_steps, mut decode_tokens, mut decode_bytes) =
        (0.0, 0u64, 0u64, 0.0);
    let (mut first_step_ms, mut first_decode_step_ms) = (None, None);
    let mut done = Vec::new();
    while engine.has_pending() {
        let before = engine.stats().clone();
        let t = Instant::now();
        engine.step()?;
        let dt = t.elapsed().as_secs_f64();
        let after = engine.stats();
        first_step_ms.get_or_insert(dt * 1e3);
        let prefill = after.prefill_computed > before.prefill_computed
            || after.prefill_cached > before.prefill_cached
            || after.prefill_forked > before.prefill_forked;
        if !prefill && after.generated > before.generated {
            first_decode_step_ms.get_or_insert(dt * 1e3);
            decode_s += dt;
            decode_steps += 1;
            decode_tokens += after.generated - before.generated;
            decode_bytes += weight_bytes as f64
                + ((after.kv_rows_read - before.kv_rows_read) * kv_bytes_per_token) as f64;
        }
        done.extend(engine.take_finished());
    }
    dev.synchronize()?;
    let seconds = start.elapsed().as_secs_f64();
    // What a learner's update costs the engine afterwards (the bf16 weight
    // copy's refresh, the CPU's repack; the KV policy version).
    let t = Instant::now();
    engine.invalidate();
    dev.synchronize()?;
    let weight_refresh_ms = t.elapsed().as_secs_f64() * 1e3;
    let peak_device_mib = meter
        .device_peak(device_base)?
        .map(|b| b as f64 / (1 << 20) as f64);
    if let Some(c) = done.iter().find(|c| c.error.is_some()) {
        bail!("sequence {} failed: {:?}", c.id, c.error);
    }
    let (bandwidth, bandwidth_source) = roofline_bandwidth(&dev, opts.m.peak_gbs);
    let st = engine.stats().clone();
    let r = GenBenchResult {
        bench,
        model: name,
        weights: if opts.m.model.is_none() {
            "random"
        } else {
            "checkpoint"
        },
        dtype: opts.m.dtype.clone(),
        device: match dev.location() {
            candle_core::DeviceLocation::Cpu => "cpu".into(),
            candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
            other => format!("{other:?}"),
        },
        sequences,
        prompt_len,
        shared_prefix,
        new_tokens,
        // The pool the kernels run on (RAYON_NUM_THREADS, else the CPUs
        // this process may use).
        threads: rayon::current_num_threads(),
        cpu_kernels: arbor_ops::MatmulIsa::detect().name(),
        seconds,
        generated_tokens: st.generated,
        generated_tokens_per_s: st.generated as f64 / seconds,
        prefill_computed: st.prefill_computed,
        prefill_cached: st.prefill_cached,
        prefill_forked: st.prefill_forked,
        preemptions: st.preemptions,
        kv_pool_mib: engine.kv_bytes() as f64 / (1 << 20) as f64,
        peak_rss_mib: rss_mib().1,
        peak_device_mib,
        decode_steps,
        ms_per_step: if decode_steps > 0 {
            decode_s * 1e3 / decode_steps as f64
        } else {
            0.0
        },
        decode_tokens_per_s: if decode_s > 0.0 {
            decode_tokens as f64 / decode_s
        } else {
            0.0
        },
        first_step_ms: first_step_ms.unwrap_or(0.0),
        first_decode_step_ms: first_decode_step_ms.unwrap_or(0.0),
        fresh_process: opts.fresh_process,
        weight_bytes,
        kv_bytes_per_token,
        bytes_per_decode_step: if decode_steps > 0 {
            decode_bytes / decode_steps as f64
        } else {
            0.0
        },
        bandwidth_gb_s: bandwidth.map(|b| b / 1e9),
        bandwidth_source,
        roofline_fraction: bandwidth
            .filter(|_| decode_s > 0.0)
            .map(|b| decode_bytes / b / decode_s),
        gpu_cuts_off: arbor_ops::tuning::cuts_off_from_env()
            .unwrap_or_default()
            .into_iter()
            .map(arbor_ops::GpuCut::name)
            .collect(),
        fused_decode,
        bf16_rollouts: opts.m.bf16_rollouts,
        weight_refresh_ms,
    };
    if opts.json_line {
        println!("{}", serde_json::to_string(&r)?);
    } else if opts.m.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!("bench                  {}", r.bench);
        println!("model                  {} ({} weights)", r.model, r.weights);
        println!(
            "sequences x tokens     {} x ({} prompt + {} new)",
            r.sequences, r.prompt_len, r.new_tokens
        );
        if let Some(n) = r.shared_prefix.filter(|&n| n > 0) {
            println!("shared prompt prefix   {n} tokens");
        }
        println!("threads                {}", r.threads);
        println!("wall time              {:.2} s", r.seconds);
        println!(
            "generated              {} tokens, {:.1} tokens/s",
            r.generated_tokens, r.generated_tokens_per_s
        );
        println!(
            "decode steps           {} of {:.2} ms, {:.1} tokens/s",
            r.decode_steps, r.ms_per_step, r.decode_tokens_per_s
        );
        println!(
            "first step             {:.1} ms (first decode step {:.2} ms{})",
            r.first_step_ms,
            r.first_decode_step_ms,
            if r.fresh_process {
                ", fresh process"
            } else {
                ""
            }
        );
        match (r.roofline_fraction, r.bandwidth_gb_s) {
            (Some(f), Some(b)) => println!(
                "roofline               {:.1}% of {:.0} GB/s ({}; {:.0} MB a decode step)",
                100.0 * f,
                b,
                r.bandwidth_source.unwrap_or_default(),
                r.bytes_per_decode_step / 1e6
            ),
            _ => println!(
                "roofline               no bandwidth (give --peak-gbs); {:.0} MB a decode step",
                r.bytes_per_decode_step / 1e6
            ),
        }
        println!("prefill computed       {} tokens", r.prefill_computed);
        println!("prefill from cache     {} tokens", r.prefill_cached);
        println!("prefill shared by fork {} tokens", r.prefill_forked);
        println!("preemptions            {}", r.preemptions);
        println!("KV pool                {:.0} MiB", r.kv_pool_mib);
        println!("peak RSS               {:.0} MiB", r.peak_rss_mib);
        if let Some(m) = r.peak_device_mib {
            println!("peak device memory     {m:.0} MiB (CUDA pool, KV pool included)");
        }
        if r.fused_decode {
            println!(
                "decode path            dedicated fused step{}",
                if r.bf16_rollouts {
                    " (bf16 weight copy)"
                } else {
                    ""
                }
            );
        }
        println!("weight refresh         {:.2} ms", r.weight_refresh_ms);
        if !r.gpu_cuts_off.is_empty() {
            println!("GPU cuts off           {}", r.gpu_cuts_off.join(", "));
        }
    }
    Ok(())
}

/// `--peak-gbs` must be a bandwidth.
fn check_peak(m: &BenchModel) -> Result<()> {
    match m.peak_gbs {
        Some(g) if !(g > 0.0 && g.is_finite()) => bail!("--peak-gbs {g} must be > 0"),
        _ => Ok(()),
    }
}

fn generate_bench(a: GenBenchArgs) -> Result<()> {
    check_peak(&a.m)?;
    if a.batch.is_empty() || a.batch.contains(&0) || a.prompt_len == 0 || a.max_tokens == 0 {
        bail!("--batch, --prompt-len and --max-tokens must be >= 1");
    }
    if let Some(b) = a.batch.iter().find(|&&b| b > MAX_SAMPLES) {
        bail!("--batch {b} is more than {MAX_SAMPLES} sequences");
    }
    if a.shared_prefix > a.prompt_len {
        bail!(
            "--shared-prefix {} is longer than --prompt-len {}",
            a.shared_prefix,
            a.prompt_len
        );
    }
    let (model, name) = load_fitting(&a.m, a.prompt_len, a.max_tokens)?;
    let vocab = model.cfg.vocab_size;
    let shared = bench_prompt(a.shared_prefix, u32::MAX as u64, vocab);
    for (k, &batch) in a.batch.iter().enumerate() {
        let jobs = (0..batch)
            .map(|i| {
                let p = arbor_engine::SamplingParams::greedy(a.max_tokens);
                let mut prompt = shared.clone();
                prompt.extend(bench_prompt(
                    a.prompt_len - a.shared_prefix,
                    i as u64,
                    vocab,
                ));
                (prompt, vec![p])
            })
            .collect();
        run_engine_bench(
            "generate",
            &model,
            name.clone(),
            Some(a.shared_prefix),
            jobs,
            &RunOpts {
                m: &a.m,
                json_line: a.m.json && a.batch.len() > 1,
                fresh_process: k == 0,
            },
        )?;
    }
    Ok(())
}

fn fork_bench(a: ForkBenchArgs) -> Result<()> {
    check_peak(&a.m)?;
    if a.n == 0 || a.prompt_len == 0 || a.max_tokens == 0 {
        bail!("--n, --prompt-len and --max-tokens must be >= 1");
    }
    if a.n > MAX_SAMPLES {
        bail!("--n {} is more than {MAX_SAMPLES} samples", a.n);
    }
    let (model, name) = load_fitting(&a.m, a.prompt_len, a.max_tokens)?;
    let vocab = model.cfg.vocab_size;
    let samples = (0..a.n)
        .map(|j| arbor_engine::SamplingParams {
            temperature: 1.0,
            max_tokens: a.max_tokens,
            seed: j as u64,
            ..Default::default()
        })
        .collect();
    run_engine_bench(
        "fork",
        &model,
        name,
        None,
        vec![(bench_prompt(a.prompt_len, 1, vocab), samples)],
        &RunOpts {
            m: &a.m,
            json_line: false,
            fresh_process: true,
        },
    )
}

#[derive(Debug, Args)]
pub struct ModelBenchArgs {
    /// Shape preset with random weights: smollm2-135m or qwen3-0.6b.
    #[arg(long, default_value = "smollm2-135m", conflicts_with = "model")]
    pub preset: String,
    /// Benchmark a real checkpoint instead (directory or HF id).
    #[arg(long, value_name = "PATH_OR_ID")]
    pub model: Option<String>,
    /// Sequences per batch.
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 256)]
    pub seq: usize,
    /// Timed repetitions (after one warm-up).
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    /// Compute dtype.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
struct ModelBenchResult {
    model: String,
    parameters: usize,
    dtype: String,
    batch: usize,
    seq: usize,
    steps: usize,
    threads: usize,
    /// The CPU matmul kernels (`avx512`, `avx512-bf16`, `avx2`, `portable`).
    cpu_kernels: &'static str,
    forward_tokens_per_s: f64,
    forward_backward_tokens_per_s: f64,
    forward_backward_s_per_step: f64,
    rss_after_load_mib: f64,
    peak_rss_forward_mib: f64,
    peak_rss_forward_backward_mib: f64,
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Model(a) => model_bench(a),
        BenchCommand::Train(a) => crate::bench_train::run(a),
        BenchCommand::Generate(a) => generate_bench(a),
        BenchCommand::Fork(a) => fork_bench(a),
        BenchCommand::Audit(a) => crate::bench_audit::run(a),
        BenchCommand::Algos(a) => crate::bench_algos::run(a),
        BenchCommand::Critic(a) => crate::bench_critic::run(a),
        BenchCommand::Step(a) => crate::bench_step::run(a),
        BenchCommand::Rollout(a) => crate::bench_rollout::run(a),
        BenchCommand::LogprobMemory(a) => logprob_memory(a),
    }
}

/// Resident-set figures from /proc/self/status (MiB): (current, peak).
pub(crate) fn rss_mib() -> (f64, f64) {
    let Ok(s) = std::fs::read_to_string("/proc/self/status") else {
        return (f64::NAN, f64::NAN);
    };
    let field = |name: &str| {
        s.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .map(|kb| kb / 1024.0)
            .unwrap_or(f64::NAN)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn model_bench(a: ModelBenchArgs) -> Result<()> {
    let dtype = parse_dtype(&a.dtype)?;
    let dev = Device::Cpu;
    if a.batch == 0 || a.seq < 2 || a.steps == 0 {
        bail!("--batch and --steps must be >= 1 and --seq >= 2");
    }
    let (cfg, name, ckpt) = match &a.model {
        Some(m) => {
            let files = ModelFiles::resolve(m)?;
            let cfg = ModelConfig::from_file(&files.config)?;
            (cfg, m.clone(), Some(Checkpoint::open(&files.weights)?))
        }
        None => {
            let cfg = preset_config(&a.preset)?;
            (cfg, format!("{} (random weights)", a.preset), None)
        }
    };
    let source = || match &ckpt {
        Some(c) => ParamSource::Checkpoint(c),
        None => ParamSource::Random { seed: 0 },
    };
    let (pv, cv) = (VarMap::new(), VarMap::new());
    let pl = ParamLoader::trainable(source(), dtype, &dev, pv.clone());
    let cl = ParamLoader::trainable(source(), dtype, &dev, cv.clone());
    let model = ActorCritic::load(&cfg, CriticMode::Shared, &pl, &cl)?;
    let (rss_load, _) = rss_mib();

    let (b, t) = (a.batch, a.seq);
    let vocab = cfg.vocab_size as u32;
    let toks: Vec<u32> = (0..b * t)
        .map(|i| (i as u32).wrapping_mul(2654435761) % vocab)
        .collect();
    let ids = Tensor::from_vec(toks, (b, t), &dev)?;
    let targets = ids.narrow(1, 1, t - 1)?.flatten_all()?;
    let loss_of = |ids: &Tensor| -> Result<Tensor> {
        let (h, v) = model.forward(ids)?;
        let h = h
            .narrow(1, 0, t - 1)?
            .reshape((b * (t - 1), cfg.hidden_size))?;
        let lp = token_logprobs(&h, &model.policy.lm_head, &targets, 256)?;
        Ok((lp.mean_all()?.neg()? + v.sqr()?.mean_all()?)?)
    };

    let time = |f: &dyn Fn() -> Result<()>| -> Result<f64> {
        f()?; // warm-up
        let start = Instant::now();
        for _ in 0..a.steps {
            f()?;
        }
        Ok(start.elapsed().as_secs_f64() / a.steps as f64)
    };
    let fwd = time(&|| {
        let l = loss_of(&ids)?;
        let _ = l.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()?;
        Ok(())
    })?;
    let (_, peak_fwd) = rss_mib();
    let fwd_bwd = time(&|| {
        let l = loss_of(&ids)?;
        let g = l.backward()?;
        drop(g);
        Ok(())
    })?;
    let (_, peak_all) = rss_mib();
    let tokens = (b * t) as f64;
    let r = ModelBenchResult {
        model: name,
        parameters: cfg.num_parameters() + cfg.hidden_size + 1,
        dtype: a.dtype.clone(),
        batch: b,
        seq: t,
        steps: a.steps,
        // The pool the kernels run on (RAYON_NUM_THREADS, else the CPUs
        // this process may use).
        threads: rayon::current_num_threads(),
        cpu_kernels: arbor_ops::MatmulIsa::detect().name(),
        forward_tokens_per_s: tokens / fwd,
        forward_backward_tokens_per_s: tokens / fwd_bwd,
        forward_backward_s_per_step: fwd_bwd,
        rss_after_load_mib: rss_load,
        peak_rss_forward_mib: peak_fwd,
        peak_rss_forward_backward_mib: peak_all,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!("model                  {}", r.model);
        println!("parameters             {:.1}M", r.parameters as f64 / 1e6);
        println!(
            "dtype / batch x seq    {} / {} x {}",
            r.dtype, r.batch, r.seq
        );
        println!("threads                {}", r.threads);
        println!(
            "forward                {:.1} tokens/s",
            r.forward_tokens_per_s
        );
        println!(
            "forward+backward       {:.1} tokens/s ({:.2} s/step)",
            r.forward_backward_tokens_per_s, r.forward_backward_s_per_step
        );
        println!("RSS after load         {:.0} MiB", r.rss_after_load_mib);
        println!("peak RSS forward       {:.0} MiB", r.peak_rss_forward_mib);
        println!(
            "peak RSS fwd+bwd       {:.0} MiB",
            r.peak_rss_forward_backward_mib
        );
    }
    Ok(())
}

#[derive(Debug, Args)]
pub struct LogprobMemArgs {
    /// Tokens (rows).
    #[arg(long, default_value_t = 8192)]
    pub tokens: usize,
    /// Vocabulary size (Qwen3's by default).
    #[arg(long, default_value_t = 151_936)]
    pub vocab: usize,
    /// Hidden size. Memory of both paths is dominated by N x V; a small
    /// hidden size keeps the matmuls quick on a laptop.
    #[arg(long, default_value_t = 64)]
    pub hidden: usize,
    /// Also run the naive path's backward (needs roughly 5 N*V floats).
    #[arg(long)]
    pub naive_backward: bool,
    /// `cpu` (heap allocation accounting) or `cuda` (the CUDA memory pool's
    /// high-water mark; needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Peak memory meter: heap allocation accounting on the CPU, the default
/// CUDA memory pool's high-water mark on a GPU.
enum Meter {
    Heap,
    #[cfg(feature = "cuda")]
    Pool(candle_core::CudaDevice),
}

impl Meter {
    fn for_device(dev: &Device) -> Result<Meter> {
        match dev {
            Device::Cpu => Ok(Meter::Heap),
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => Ok(Meter::Pool(d.clone())),
            #[allow(unreachable_patterns)]
            other => anyhow::bail!("no memory meter for {other:?}"),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Meter::Heap => "peak heap above inputs (allocation accounting)",
            #[cfg(feature = "cuda")]
            Meter::Pool(_) => "peak device memory above inputs (CUDA pool high-water mark)",
        }
    }

    /// Synchronises; on a GPU also resets the pool's high-water mark and
    /// returns the bytes in use now (the base for
    /// [`device_peak`](Self::device_peak)); 0 on the CPU.
    fn device_reset(&self, dev: &Device) -> Result<usize> {
        dev.synchronize()?;
        match self {
            Meter::Heap => Ok(0),
            #[cfg(feature = "cuda")]
            Meter::Pool(d) => {
                arbor_ops::cuda::reset_pool_peak(d)?;
                Ok(arbor_ops::cuda::pool_used_bytes(d)?.0 as usize)
            }
        }
    }

    /// On a GPU: the pool's high-water mark above `base`; `None` on the CPU.
    fn device_peak(&self, base: usize) -> Result<Option<usize>> {
        match self {
            Meter::Heap => {
                let _ = base;
                Ok(None)
            }
            #[cfg(feature = "cuda")]
            Meter::Pool(d) => Ok(Some(
                (arbor_ops::cuda::pool_used_bytes(d)?.1 as usize).saturating_sub(base),
            )),
        }
    }

    /// Peak bytes above what was live before `f`, and `f`'s seconds.
    fn measure(&self, dev: &Device, f: &dyn Fn() -> Result<()>) -> Result<(usize, f64)> {
        use crate::alloc_count;
        let timed = || -> Result<f64> {
            let t0 = std::time::Instant::now();
            f()?;
            dev.synchronize()?;
            Ok(t0.elapsed().as_secs_f64())
        };
        match self {
            Meter::Heap => {
                dev.synchronize()?;
                alloc_count::enable();
                let base = alloc_count::live();
                alloc_count::reset_peak();
                let secs = timed()?;
                Ok(((alloc_count::peak() - base).max(0) as usize, secs))
            }
            #[cfg(feature = "cuda")]
            Meter::Pool(_) => {
                let base = self.device_reset(dev)?;
                let secs = timed()?;
                let above = self.device_peak(base)?.unwrap_or(0);
                Ok((above, secs))
            }
        }
    }
}

/// Peak bytes above the inputs for token logprobs by the fused op (forward,
/// then forward and backward) and by the naive path (full logits,
/// log_softmax, gather), in f32: by allocation accounting on the CPU, by the
/// CUDA memory pool's high-water mark on a GPU.
pub fn logprob_memory(a: LogprobMemArgs) -> Result<()> {
    let (n, v, h) = (a.tokens, a.vocab, a.hidden);
    let dev = bench_device(&a.device)?;
    let meter = Meter::for_device(&dev)?;
    let hid = candle_core::Var::from_tensor(&Tensor::randn(0f32, 1.0, (n, h), &dev)?)?;
    let w = candle_core::Var::from_tensor(&(Tensor::randn(0f32, 1.0, (v, h), &dev)? * 0.05)?)?;
    let y: Vec<u32> = (0..n as u64)
        .map(|i| (i.wrapping_mul(2654435761) % v as u64) as u32)
        .collect();
    let y = Tensor::from_vec(y, n, &dev)?;
    let measure = |f: &dyn Fn() -> Result<()>| meter.measure(&dev, f);
    let (fused_fwd, t_ff) = measure(&|| {
        let _o = arbor_ops::fused_logprobs(
            &hid.as_tensor().detach(),
            &w.as_tensor().detach(),
            &y,
            arbor_ops::DEFAULT_CHUNK_ELEMS,
        )?;
        Ok(())
    })?;
    let (fused_all, t_fa) = measure(&|| {
        let o = arbor_ops::fused_logprobs(
            hid.as_tensor(),
            w.as_tensor(),
            &y,
            arbor_ops::DEFAULT_CHUNK_ELEMS,
        )?;
        let _g = o.narrow(1, 0, 1)?.sum_all()?.backward()?;
        Ok(())
    })?;
    let naive = |backward: bool| -> Result<()> {
        let logits = hid.as_tensor().matmul(&w.as_tensor().t()?)?;
        let lp = candle_nn::ops::log_softmax(&logits, candle_core::D::Minus1)?;
        let picked = lp.gather(&y.unsqueeze(1)?, 1)?;
        if backward {
            let _g = picked.sum_all()?.backward()?;
        }
        Ok(())
    };
    let (naive_fwd, t_nf) = measure(&|| naive(false))?;
    let naive_all = if a.naive_backward {
        Some(measure(&|| naive(true))?)
    } else {
        None
    };
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    let ratio = naive_fwd as f64 / fused_all as f64;
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "tokens": n, "vocab": v, "hidden": h,
                "device": a.device, "meter": meter.name(),
                "fused_forward_bytes": fused_fwd, "fused_forward_backward_bytes": fused_all,
                "naive_forward_bytes": naive_fwd,
                "naive_forward_backward_bytes": naive_all.map(|x| x.0),
                "naive_forward_over_fused_forward_backward": ratio,
            })
        );
    } else {
        println!(
            "token logprobs, N={n} V={v} H={h}, f32, {}, {}:",
            a.device,
            meter.name()
        );
        println!("| path | peak GiB | time s |");
        println!("|---|---|---|");
        println!("| fused forward | {:.3} | {t_ff:.1} |", gib(fused_fwd));
        println!(
            "| fused forward + backward | {:.3} | {t_fa:.1} |",
            gib(fused_all)
        );
        println!(
            "| naive forward (logits, log_softmax, gather) | {:.3} | {t_nf:.1} |",
            gib(naive_fwd)
        );
        if let Some((b, t)) = naive_all {
            println!("| naive forward + backward | {:.3} | {t:.1} |", gib(b));
        }
        println!("naive forward alone / fused forward+backward = {ratio:.1}x");
    }
    Ok(())
}
