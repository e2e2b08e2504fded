//! `arbor bench train`: one learner update (forward, backward, AdamW) on a
//! batch of rollouts of a given shape: tokens/s, peak memory and the time of
//! each phase. `scripts/bench_hf_train.py` runs the same shape in PyTorch
//! (HF model + torch AdamW) as the peer.

use std::time::Instant;

use anyhow::{bail, Result};
use arbor_model::{CriticMode, ModelConfig};
use arbor_rl::credit::LossRow;
use arbor_train::learner::{Learner, LearnerConfig, Precision, Recompute, UpdateStats};
use arbor_train::optim::AdamWConfig;
use clap::Args;
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde::Serialize;

use crate::bench::{bench_device, preset_config, rss_mib};

#[derive(Debug, Args)]
pub struct TrainBenchArgs {
    /// Shape preset with random weights: smollm2-135m or qwen3-0.6b.
    #[arg(long, default_value = "smollm2-135m")]
    pub preset: String,
    /// Sequences per update.
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 256)]
    pub seq: usize,
    /// Timed updates (after one warm-up update).
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    /// Tokens per micro-batch (sequences packed back to back; gradients
    /// accumulate over micro-batches). Default: the whole batch at once.
    #[arg(long)]
    pub micro_batch_tokens: Option<usize>,
    /// Activation recomputation: `off` or `layers` (keep each layer's
    /// input only; recompute the layer in the backward).
    #[arg(long, default_value = "off")]
    pub recompute: String,
    /// `cpu`, or `cuda` / `cuda:N` (a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// The training forward's arithmetic: `f32`, or `bf16` (mixed
    /// precision: bf16 activations over f32 master weights, f32 AdamW
    /// state, logprobs and losses summed in f32; `[learner] precision`).
    #[arg(long, default_value = "f32")]
    pub precision: Precision,
    /// The device's peak dense TFLOP/s in the compute dtype, to print model
    /// FLOPs utilisation (H100 / H200 SXM bf16: 989).
    #[arg(long)]
    pub peak_tflops: Option<f64>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
struct TrainBenchResult {
    engine: &'static str,
    model: String,
    parameters: usize,
    dtype: &'static str,
    device: String,
    batch: usize,
    seq: usize,
    micro_batch_tokens: usize,
    recompute: String,
    steps: usize,
    threads: usize,
    tokens_per_s: f64,
    step_s: f64,
    forward_s: f64,
    backward_s: f64,
    optimizer_s: f64,
    /// Model FLOPs per step: `6 P N + 6 L h d sum(T^2)` (fwd + bwd).
    model_flops_per_step: f64,
    achieved_tflops: f64,
    mfu: Option<f64>,
    /// Whole-process peak resident set (CPU) in MiB.
    peak_rss_mib: f64,
    /// Device memory high-water mark (CUDA pool) in MiB.
    device_peak_mib: Option<f64>,
}

/// `batch` rows of `seq` random tokens, every token after the first
/// trained, behaviour logprobs at the uniform policy's, random advantages,
/// a value target every 16 tokens.
fn rows(cfg: &ModelConfig, batch: usize, seq: usize) -> Vec<LossRow> {
    let mut rng = StdRng::seed_from_u64(0);
    let uniform = -(cfg.vocab_size as f32).ln();
    (0..batch)
        .map(|e| {
            let mut mask = vec![1.0f32; seq];
            mask[0] = 0.0;
            LossRow {
                episode: e,
                leaf: arbor_rl::NodeId(0),
                tokens: (0..seq)
                    .map(|_| rng.random_range(0..cfg.vocab_size as u32))
                    .collect(),
                mask,
                advantages: (0..seq).map(|_| rng.random_range(-1.0f32..1.0)).collect(),
                behaviour_logprobs: vec![uniform; seq],
                history_logprobs: Vec::new(),
                value_targets: (0..seq)
                    .step_by(16)
                    .map(|p| (p, rng.random_range(0.0f32..1.0)))
                    .collect(),
            }
        })
        .collect()
}

pub fn run(a: TrainBenchArgs) -> Result<()> {
    if a.batch == 0 || a.seq < 2 || a.steps == 0 {
        bail!("--batch and --steps must be >= 1 and --seq >= 2");
    }
    let dev = bench_device(&a.device)?;
    let cfg = preset_config(&a.preset)?;
    let mbt = a.micro_batch_tokens.unwrap_or(a.batch * a.seq);
    if mbt == 0 {
        bail!("--micro-batch-tokens must be >= 1");
    }
    let recompute = match a.recompute.as_str() {
        "off" => Recompute::Off,
        "layers" => Recompute::Layers,
        other => bail!("--recompute must be off or layers, not `{other}`"),
    };
    let lcfg = LearnerConfig {
        critic: CriticMode::Shared,
        micro_batch_tokens: mbt,
        recompute,
        precision: a.precision,
        ..Default::default()
    };
    let mut learner = Learner::new(
        &cfg,
        None,
        None,
        0,
        &dev,
        lcfg,
        AdamWConfig::default(),
        None,
    )?;
    let params: usize = learner.opt.vars().iter().map(|(_, v)| v.elem_count()).sum();
    let rows = rows(&cfg, a.batch, a.seq);
    learner.update(&rows)?; // warm-up: allocations, AdamW state
    let mut sum = UpdateStats::default();
    let t0 = Instant::now();
    for _ in 0..a.steps {
        let s = learner.update(&rows)?;
        sum.time_forward_s += s.time_forward_s;
        sum.time_backward_s += s.time_backward_s;
        sum.time_optimizer_s += s.time_optimizer_s;
    }
    let step_s = t0.elapsed().as_secs_f64() / a.steps as f64;
    let tokens = (a.batch * a.seq) as f64;
    let attn = 6.0
        * (cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim) as f64
        * (a.batch * a.seq * a.seq) as f64;
    let flops = 6.0 * params as f64 * tokens + attn;
    let achieved = flops / step_s / 1e12;
    let device_peak_mib = device_peak_mib(&dev)?;
    let r = TrainBenchResult {
        engine: "arbor",
        model: format!("{} (random weights)", a.preset),
        parameters: params,
        dtype: a.precision.name(),
        device: a.device.clone(),
        batch: a.batch,
        seq: a.seq,
        micro_batch_tokens: mbt,
        recompute: a.recompute.clone(),
        steps: a.steps,
        threads: rayon::current_num_threads(),
        tokens_per_s: tokens / step_s,
        step_s,
        forward_s: sum.time_forward_s / a.steps as f64,
        backward_s: sum.time_backward_s / a.steps as f64,
        optimizer_s: sum.time_optimizer_s / a.steps as f64,
        model_flops_per_step: flops,
        achieved_tflops: achieved,
        mfu: a.peak_tflops.map(|p| achieved / p),
        peak_rss_mib: rss_mib().1,
        device_peak_mib,
    };
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "{} {} x {} tokens on {} ({} parameters, {}, micro-batches of {} tokens, recompute {})",
            r.model,
            r.batch,
            r.seq,
            r.device,
            r.parameters,
            r.dtype,
            r.micro_batch_tokens,
            r.recompute
        );
        println!(
            "  {:.1} tokens/s, {:.3} s per update: forward {:.3} s, backward {:.3} s, AdamW {:.3} s",
            r.tokens_per_s, r.step_s, r.forward_s, r.backward_s, r.optimizer_s
        );
        let mfu = r
            .mfu
            .map(|m| format!(", MFU {:.1}%", 100.0 * m))
            .unwrap_or_default();
        println!("  {:.3} model TFLOP/s{mfu}", r.achieved_tflops);
        match r.device_peak_mib {
            Some(d) => println!(
                "  device peak {d:.0} MiB, process peak RSS {:.0} MiB",
                r.peak_rss_mib
            ),
            None => println!("  peak RSS {:.0} MiB", r.peak_rss_mib),
        }
    }
    Ok(())
}

/// The CUDA pool's high-water mark in MiB; `None` on the CPU.
pub(crate) fn device_peak_mib(dev: &candle_core::Device) -> Result<Option<f64>> {
    match dev {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(d) => Ok(Some(
            arbor_ops::cuda::pool_used_bytes(d)?.1 as f64 / (1024.0 * 1024.0),
        )),
        _ => Ok(None),
    }
}
