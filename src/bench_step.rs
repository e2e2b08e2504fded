//! `arbor bench step`: one whole RL step of a given shape on one device,
//! timed phase by phase. Each step samples `--prompts` x `--samples`
//! responses of exactly `--response-len` tokens on the engine (no stop
//! token), scores the states with the critic (the value pass a method with
//! a critic makes), builds GRPO-style rows (a random 0/1 reward per
//! response, advantages normalised within each prompt's group, behaviour
//! logprobs from the engine), runs the learner's update and hands the new
//! weights to the engine. Random weights of a preset's shape: the time
//! does not depend on the values.

use std::time::Instant;

use anyhow::{bail, Result};
use arbor_engine::{Engine, EngineConfig, SamplingParams};
use arbor_model::CriticMode;
use arbor_rl::credit::LossRow;
use arbor_train::learner::{Learner, LearnerConfig, Precision};
use arbor_train::optim::AdamWConfig;
use clap::Args;
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde::Serialize;

use crate::bench::{bench_device, preset_config, rss_mib};

#[derive(Debug, Args)]
pub struct StepBenchArgs {
    /// Shape preset with random weights: smollm2-135m, qwen3-0.6b or
    /// qwen3-4b.
    #[arg(long, default_value = "smollm2-135m")]
    pub preset: String,
    /// Prompts per step.
    #[arg(long, default_value_t = 8)]
    pub prompts: usize,
    /// Responses per prompt (a GRPO group).
    #[arg(long, default_value_t = 4)]
    pub samples: usize,
    #[arg(long, default_value_t = 64)]
    pub prompt_len: usize,
    /// Tokens of every response (generation never stops early).
    #[arg(long, default_value_t = 64)]
    pub response_len: usize,
    /// Timed steps, after one untimed warm-up step.
    #[arg(long, default_value_t = 2)]
    pub steps: usize,
    /// The critic: a head on the policy (`shared`) or its own backbone
    /// (`separate`).
    #[arg(long, default_value = "shared", value_parser = ["shared", "separate"])]
    pub critic: String,
    /// Tokens per learner micro-batch (default 8192).
    #[arg(long, default_value_t = 8192)]
    pub micro_batch_tokens: usize,
    /// `cpu`, or `cuda` / `cuda:N` (a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// On a GPU, generate through the dedicated bf16 step from a bf16 copy
    /// of the f32 policy (refreshed at the weight sync).
    #[arg(long)]
    pub bf16_rollouts: bool,
    /// The learner's arithmetic: `f32`, or `bf16` (mixed precision over
    /// f32 master weights; `[learner] precision`).
    #[arg(long, default_value = "f32")]
    pub precision: Precision,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
struct StepBenchResult {
    bench: &'static str,
    model: String,
    weights: &'static str,
    parameters: usize,
    device: String,
    critic: String,
    bf16_rollouts: bool,
    /// The learner's arithmetic (`f32` or mixed `bf16`).
    precision: &'static str,
    fused_decode: bool,
    prompts: usize,
    samples: usize,
    prompt_len: usize,
    response_len: usize,
    steps: usize,
    /// Per step (means over the timed steps).
    step_s: f64,
    generation_s: f64,
    value_pass_s: f64,
    update_s: f64,
    forward_s: f64,
    backward_s: f64,
    optimizer_s: f64,
    weight_sync_s: f64,
    /// Gradient all-reduce per step (one process: none).
    all_reduce_s: f64,
    generated_tokens_per_step: u64,
    trained_tokens_per_step: u64,
    /// Over the whole step.
    generated_tokens_per_s: f64,
    trained_tokens_per_s: f64,
    generation_share: f64,
    peak_rss_mib: f64,
    device_peak_mib: Option<f64>,
}

/// Phase times of one step and its token counts.
#[derive(Default)]
struct Phases {
    generation: f64,
    value_pass: f64,
    update: f64,
    forward: f64,
    backward: f64,
    optimizer: f64,
    sync: f64,
    generated: u64,
    trained: u64,
}

/// Random prompt tokens from ids 10 and up.
fn prompt(rng: &mut StdRng, len: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|_| rng.random_range(10..vocab as u32))
        .collect()
}

fn one_step(
    a: &StepBenchArgs,
    engine: &mut Engine,
    learner: &mut Learner,
    rng: &mut StdRng,
    vocab: usize,
    dev: &candle_core::Device,
) -> Result<Phases> {
    let mut p = Phases::default();
    let t = Instant::now();
    let mut ids = Vec::new();
    for _ in 0..a.prompts {
        let samples = (0..a.samples)
            .map(|_| SamplingParams {
                temperature: 1.0,
                max_tokens: a.response_len,
                seed: rng.random(),
                ..Default::default()
            })
            .collect();
        ids.push(engine.submit(prompt(rng, a.prompt_len, vocab), samples)?);
    }
    let mut done = engine.run(|_| {})?;
    dev.synchronize()?;
    p.generation = t.elapsed().as_secs_f64();
    done.sort_by_key(|c| c.id);
    if let Some(c) = done.iter().find(|c| c.error.is_some()) {
        bail!("sequence {} failed: {:?}", c.id, c.error);
    }
    if done.len() != a.prompts * a.samples || done.iter().any(|c| c.tokens.len() != a.response_len)
    {
        bail!("the engine returned responses of other lengths than --response-len");
    }
    p.generated = done.iter().map(|c| c.tokens.len() as u64).sum();

    // The critic's values at the prompts' ends (a method with a critic
    // scores its states before crediting them).
    let t = Instant::now();
    let seqs: Vec<Vec<u32>> = done
        .iter()
        .map(|c| [c.prompt.as_slice(), c.tokens.as_slice()].concat())
        .collect();
    let pos: Vec<Vec<usize>> = done.iter().map(|c| vec![c.prompt.len() - 1]).collect();
    learner.values_at(&seqs, &[], &pos)?;
    p.value_pass = t.elapsed().as_secs_f64();

    // GRPO rows: a random outcome per response, normalised in its group.
    let rewards: Vec<f32> = done
        .iter()
        .map(|_| f32::from(rng.random::<bool>()))
        .collect();
    let mut rows = Vec::with_capacity(done.len());
    for (g, group) in done.chunks(a.samples).enumerate() {
        let r = &rewards[g * a.samples..(g + 1) * a.samples];
        let mean = r.iter().sum::<f32>() / r.len() as f32;
        let std = (r.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / r.len() as f32).sqrt();
        for (c, &reward) in group.iter().zip(r) {
            let (np, n) = (c.prompt.len(), c.prompt.len() + c.tokens.len());
            let adv = (reward - mean) / (std + 1e-6);
            let mut mask = vec![0.0; n];
            let mut advantages = vec![0.0; n];
            let mut behaviour = vec![0.0; n];
            for i in np..n {
                mask[i] = 1.0;
                advantages[i] = adv;
                behaviour[i] = c.logprobs[i - np];
            }
            rows.push(LossRow {
                episode: rows.len(),
                leaf: arbor_rl::NodeId(0),
                tokens: [c.prompt.as_slice(), c.tokens.as_slice()].concat(),
                mask,
                advantages,
                behaviour_logprobs: behaviour,
                history_logprobs: Vec::new(),
                value_targets: vec![(np - 1, reward)],
            });
        }
    }
    let t = Instant::now();
    let u = learner.update(&rows)?;
    dev.synchronize()?;
    p.update = t.elapsed().as_secs_f64();
    (p.forward, p.backward, p.optimizer) =
        (u.time_forward_s, u.time_backward_s, u.time_optimizer_s);
    p.trained = u.trained_tokens as u64;

    let t = Instant::now();
    engine.invalidate();
    dev.synchronize()?;
    p.sync = t.elapsed().as_secs_f64();
    Ok(p)
}

pub fn run(a: StepBenchArgs) -> Result<()> {
    if a.prompts == 0 || a.samples == 0 || a.prompt_len == 0 || a.response_len == 0 || a.steps == 0
    {
        bail!("--prompts, --samples, --prompt-len, --response-len and --steps must be >= 1");
    }
    let dev = bench_device(&a.device)?;
    let cfg = preset_config(&a.preset)?;
    if a.prompt_len + a.response_len > cfg.max_position_embeddings {
        bail!(
            "--prompt-len {} + --response-len {} exceed the model's context of {} tokens",
            a.prompt_len,
            a.response_len,
            cfg.max_position_embeddings
        );
    }
    let critic = if a.critic == "separate" {
        CriticMode::Separate
    } else {
        CriticMode::Shared
    };
    let lcfg = LearnerConfig {
        critic,
        micro_batch_tokens: a.micro_batch_tokens.max(1),
        precision: a.precision,
        ..Default::default()
    };
    let mut learner = Learner::new(
        &cfg,
        None,
        None,
        a.seed,
        &dev,
        lcfg,
        AdamWConfig::default(),
        None,
    )?;
    let params: usize = learner.opt.vars().iter().map(|(_, v)| v.elem_count()).sum();
    let ecfg = EngineConfig {
        max_seqs: (a.prompts * a.samples).max(1),
        max_batch_tokens: 8192,
        bf16_rollouts: a.bf16_rollouts,
        ..Default::default()
    };
    let mut engine = Engine::new(&learner.model.policy, None, ecfg)?;
    let fused_decode = engine.fast_decode_active();
    let mut rng = StdRng::seed_from_u64(a.seed);
    let mut sum = Phases::default();
    let mut t0 = Instant::now();
    // Step 0 warms up (allocations, AdamW state) and is not counted.
    for k in 0..=a.steps {
        let p = one_step(
            &a,
            &mut engine,
            &mut learner,
            &mut rng,
            cfg.vocab_size,
            &dev,
        )?;
        if k == 0 {
            t0 = Instant::now();
            continue;
        }
        sum.generation += p.generation;
        sum.value_pass += p.value_pass;
        sum.update += p.update;
        sum.forward += p.forward;
        sum.backward += p.backward;
        sum.optimizer += p.optimizer;
        sum.sync += p.sync;
        sum.generated += p.generated;
        sum.trained += p.trained;
    }
    let wall = t0.elapsed().as_secs_f64();
    let n = a.steps as f64;
    let device_peak_mib = crate::bench_train::device_peak_mib(&dev)?;
    let r = StepBenchResult {
        bench: "step",
        model: a.preset.clone(),
        weights: "random",
        parameters: params,
        device: a.device.clone(),
        critic: a.critic.clone(),
        bf16_rollouts: a.bf16_rollouts,
        precision: a.precision.name(),
        fused_decode,
        prompts: a.prompts,
        samples: a.samples,
        prompt_len: a.prompt_len,
        response_len: a.response_len,
        steps: a.steps,
        step_s: wall / n,
        generation_s: sum.generation / n,
        value_pass_s: sum.value_pass / n,
        update_s: sum.update / n,
        forward_s: sum.forward / n,
        backward_s: sum.backward / n,
        optimizer_s: sum.optimizer / n,
        weight_sync_s: sum.sync / n,
        all_reduce_s: 0.0,
        generated_tokens_per_step: sum.generated / a.steps as u64,
        trained_tokens_per_step: sum.trained / a.steps as u64,
        generated_tokens_per_s: sum.generated as f64 / wall,
        trained_tokens_per_s: sum.trained as f64 / wall,
        generation_share: sum.generation / wall,
        peak_rss_mib: rss_mib().1,
        device_peak_mib,
    };
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "{} ({} parameters, random weights) on {}: {} prompts x {} samples, {} + {} tokens, {} critic",
            r.model, r.parameters, r.device, r.prompts, r.samples, r.prompt_len, r.response_len, r.critic
        );
        println!(
            "  {:.3} s per step: generation {:.3} s ({:.0}%), value pass {:.3} s, update {:.3} s \
             (forward {:.3}, backward {:.3}, AdamW {:.3}), weight sync {:.3} s",
            r.step_s,
            r.generation_s,
            100.0 * r.generation_share,
            r.value_pass_s,
            r.update_s,
            r.forward_s,
            r.backward_s,
            r.optimizer_s,
            r.weight_sync_s
        );
        println!(
            "  {:.1} generated and {:.1} trained tokens/s; peak RSS {:.0} MiB{}",
            r.generated_tokens_per_s,
            r.trained_tokens_per_s,
            r.peak_rss_mib,
            r.device_peak_mib
                .map(|d| format!(", device peak {d:.0} MiB"))
                .unwrap_or_default()
        );
    }
    Ok(())
}
