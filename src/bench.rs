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

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Training forward and forward+backward of the policy (+ shared value
    /// head) through the chunked logprob path: tokens/s and peak memory.
    Model(ModelBenchArgs),
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
    }
}

/// Resident-set figures from /proc/self/status (MiB): (current, peak).
fn rss_mib() -> (f64, f64) {
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
            let cfg = match a.preset.as_str() {
                "smollm2-135m" => ModelConfig::smollm2_135m(),
                "qwen3-0.6b" => ModelConfig::qwen3_0_6b(),
                other => bail!("unknown --preset `{other}` (smollm2-135m, qwen3-0.6b)"),
            };
            (cfg, format!("{} (random weights)", a.preset), None)
        }
    };
    let source = || match &ckpt {
        Some(c) => ParamSource::Checkpoint(c),
        None => ParamSource::Random,
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
        threads: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
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
