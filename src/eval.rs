//! `arbor eval`: accuracy, pass@k and tokens per problem on math datasets.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use arbor_engine::{Engine, EngineConfig, SamplingParams};
use arbor_env::math::{grade, load_problems};
use arbor_model::{parse_dtype, ChatOptions, LoadOptions, LoadedModel};
use candle_core::Device;
use clap::Args;
use serde::Serialize;

/// The instruction appended to every problem (Qwen's math prompt).
pub const MATH_INSTRUCTION: &str =
    "Please reason step by step, and put your final answer within \\boxed{}.";

#[derive(Debug, Args)]
pub struct EvalArgs {
    /// Model directory or HF model id (needs tokenizer.json and a chat template).
    #[arg(long, value_name = "PATH_OR_ID")]
    pub model: String,
    /// gsm8k, math500, aime (from the shared data folder: `$ARBOR_SHARED_DATA`
    /// or `../shared/data`), math (Hendrycks MATH test), or a JSONL file.
    #[arg(long, value_name = "NAME|FILE", required_unless_present = "swe")]
    pub dataset: Option<String>,
    /// SWE tasks instead of math: SWE-bench-style instances (JSONL, e.g.
    /// the `instances.jsonl` of `arbor swe build`; `specs.json` beside it
    /// applies). Every instance is an episode through the tool harness in
    /// the sandbox; reports pass rate, turns and tokens per task.
    #[arg(long, value_name = "FILE", conflicts_with = "dataset")]
    pub swe: Option<PathBuf>,
    /// SWE: repositories (default: `repos/` beside the instances).
    #[arg(long, value_name = "DIR", requires = "swe")]
    pub repos: Option<PathBuf>,
    /// SWE: policy turns per episode (then it is cut off and scored).
    #[arg(long, default_value_t = 20)]
    pub max_turns: usize,
    /// SWE: environment steps on this many threads while the engine decodes.
    #[arg(long, default_value_t = 4)]
    pub env_workers: usize,
    /// SWE: run commands without bubblewrap (trusted models and tasks only).
    #[arg(long)]
    pub unsandboxed: bool,
    /// Samples per problem (pass@k is reported for k = 1, 2, 4, ... <= n).
    #[arg(long, default_value_t = 1)]
    pub n: usize,
    /// Evaluate only the first N problems.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Sampling temperature (0: greedy; only with --n 1).
    #[arg(long, default_value_t = 0.6)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Longest response (math) or policy turn (SWE), tokens.
    #[arg(long, default_value_t = 2048)]
    pub max_tokens: usize,
    /// Qwen3: answer without a thinking block.
    #[arg(long)]
    pub no_thinking: bool,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// f32, bf16, f16 or f64 (bf16 on a CPU: bf16 weight matrices and KV
    /// cache, f32 activations; on a GPU bf16 throughout).
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Write every sample (problem id, text, extracted answer, correct) as JSONL.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
    #[arg(long, default_value_t = 2048)]
    pub kv_memory_mib: usize,
}

/// Mean unbiased pass@k over problems (`correct[i]` of `n` samples right)
/// for k = 1, 2, 4, ... <= n.
fn pass_at_ks(n: usize, correct: &[usize]) -> Vec<(usize, f64)> {
    std::iter::successors(Some(1usize), |k| Some(k * 2))
        .take_while(|&k| k <= n)
        .map(|k| {
            let v = correct.iter().map(|&c| pass_at_k(n, c, k)).sum::<f64>();
            (k, v / correct.len().max(1) as f64)
        })
        .collect()
}

/// Unbiased pass@k from `n` samples with `c` correct: `1 - C(n-c, k) / C(n, k)`.
pub fn pass_at_k(n: usize, c: usize, k: usize) -> f64 {
    if k > n {
        return f64::NAN;
    }
    if n - c < k {
        return 1.0;
    }
    // C(n-c, k) / C(n, k) = prod_{i=0}^{k-1} (n-c-i) / (n-i)
    1.0 - (0..k)
        .map(|i| (n - c - i) as f64 / (n - i) as f64)
        .product::<f64>()
}

#[derive(Debug, Serialize)]
struct Sample<'a> {
    id: &'a str,
    sample: usize,
    text: String,
    extracted: Option<String>,
    reference: &'a str,
    correct: bool,
    tokens: usize,
    finish_reason: arbor_engine::FinishReason,
}

#[derive(Debug, Serialize)]
struct Summary {
    model: String,
    dataset: String,
    problems: usize,
    samples_per_problem: usize,
    accuracy: f64,
    pass_at_k: Vec<(usize, f64)>,
    tokens_per_problem: f64,
    truncated_fraction: f64,
    seconds: f64,
}

pub fn run(a: EvalArgs) -> Result<()> {
    if a.n == 0 {
        bail!("--n must be at least 1");
    }
    if a.temperature == 0.0 && a.n > 1 {
        bail!("--temperature 0 (greedy) gives n identical samples; use --n 1 or a positive temperature");
    }
    if a.swe.is_some() {
        return run_swe(&a);
    }
    let dataset = a
        .dataset
        .as_deref()
        .context("--dataset or --swe is required")?;
    let (path, fmt) = arbor_train::tasks::dataset_file(dataset, "test")?;
    let mut problems = load_problems(&path, fmt.as_ref())?;
    if let Some(l) = a.limit {
        problems.truncate(l);
    }
    if problems.is_empty() {
        bail!("{}: no problems", path.display());
    }
    let m = load_model(&a)?;
    let tok = m
        .tokenizer
        .as_ref()
        .with_context(|| format!("`{}` has no tokenizer.json", a.model))?;
    let tmpl = m.chat_template()?;
    let opts = ChatOptions {
        add_generation_prompt: true,
        enable_thinking: a.no_thinking.then_some(false),
    };
    let stops = m.files.eos_token_ids(&m.config.eos_token_ids)?;
    let mut engine = Engine::new(
        &m.model,
        Some(tok.clone()),
        EngineConfig {
            kv_memory_mib: a.kv_memory_mib,
            ..Default::default()
        },
    )?;
    let mut ids = Vec::with_capacity(problems.len());
    for (i, p) in problems.iter().enumerate() {
        let msgs = serde_json::json!([{"role": "user", "content": format!("{}\n{}", p.problem, MATH_INSTRUCTION)}]);
        let prompt = tok.encode(&tmpl.render(&msgs, None, &opts)?, false)?;
        let samples = (0..a.n)
            .map(|j| SamplingParams {
                temperature: a.temperature,
                top_p: a.top_p,
                max_tokens: a.max_tokens,
                stop_tokens: stops.clone(),
                seed: a.seed.wrapping_add((i * a.n + j) as u64),
                ..Default::default()
            })
            .collect();
        ids.push(
            engine
                .submit(prompt, samples)
                .with_context(|| format!("problem {}", p.id))?,
        );
    }
    let bar = indicatif::ProgressBar::new((problems.len() * a.n) as u64);
    let start = std::time::Instant::now();
    let done = engine.run(|k| bar.set_position(k as u64))?;
    bar.finish_and_clear();
    let seconds = start.elapsed().as_secs_f64();
    let by_id: std::collections::HashMap<u64, &arbor_engine::Completion> =
        done.iter().map(|c| (c.id, c)).collect();
    let mut out = match &a.out {
        Some(p) => Some(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("{}: cannot create", p.display()))?,
        )),
        None => None,
    };
    let (mut correct_total, mut tokens_total, mut truncated) = (0usize, 0usize, 0usize);
    let mut per_problem_correct = Vec::with_capacity(problems.len());
    for (p, group) in problems.iter().zip(&ids) {
        let mut c = 0;
        for (j, id) in group.iter().enumerate() {
            let comp = by_id[id];
            let text = tok.decode(&comp.tokens, true)?;
            let g = grade(&text, &p.answer);
            c += usize::from(g.correct);
            tokens_total += comp.tokens.len();
            truncated += usize::from(comp.finish_reason == arbor_engine::FinishReason::Length);
            if let Some(w) = out.as_mut() {
                use std::io::Write;
                let s = Sample {
                    id: &p.id,
                    sample: j,
                    text,
                    extracted: g.extracted,
                    reference: &p.answer,
                    correct: g.correct,
                    tokens: comp.tokens.len(),
                    finish_reason: comp.finish_reason,
                };
                writeln!(w, "{}", serde_json::to_string(&s)?)?;
            }
        }
        correct_total += c;
        per_problem_correct.push(c);
    }
    let total = problems.len() * a.n;
    let pass = pass_at_ks(a.n, &per_problem_correct);
    let s = Summary {
        model: a.model.clone(),
        dataset: path.display().to_string(),
        problems: problems.len(),
        samples_per_problem: a.n,
        accuracy: correct_total as f64 / total as f64,
        pass_at_k: pass,
        tokens_per_problem: tokens_total as f64 / problems.len() as f64,
        truncated_fraction: truncated as f64 / total as f64,
        seconds,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        println!(
            "dataset            {} ({} problems x {} samples)",
            s.dataset, s.problems, s.samples_per_problem
        );
        println!("accuracy           {:.4}", s.accuracy);
        for (k, v) in &s.pass_at_k {
            println!("pass@{k:<14} {v:.4}");
        }
        println!(
            "tokens per problem {:.1} (all samples)",
            s.tokens_per_problem
        );
        println!(
            "truncated          {:.1}% of samples hit --max-tokens",
            100.0 * s.truncated_fraction
        );
        println!("time               {:.1} s", s.seconds);
    }
    Ok(())
}

/// One SWE task's results over its samples.
#[derive(Debug, Serialize)]
struct SweTaskResult {
    id: String,
    samples: usize,
    passed: usize,
    turns: f64,
    generated_tokens: f64,
    context_tokens: f64,
}

#[derive(Debug, Serialize)]
struct SweSummary {
    model: String,
    instances: String,
    tasks: usize,
    samples_per_task: usize,
    pass_rate: f64,
    pass_at_k: Vec<(usize, f64)>,
    turns_per_episode: f64,
    generated_tokens_per_episode: f64,
    seconds: f64,
    env_seconds: f64,
    per_task: Vec<SweTaskResult>,
}

/// The model of `--model`, on the CPU in `--dtype`.
fn load_model(a: &EvalArgs) -> Result<LoadedModel> {
    LoadedModel::load(
        &a.model,
        &LoadOptions {
            dtype: parse_dtype(&a.dtype)?,
            device: Device::Cpu,
        },
    )
    .with_context(|| format!("loading model `{}`", a.model))
}

fn run_swe(a: &EvalArgs) -> Result<()> {
    use arbor_train::rollout::EpisodeResult;
    use arbor_train::tasks::{TaskConfig, TaskSampler};
    let file = a.swe.as_ref().context("--swe")?;
    let m = load_model(a)?;
    let tok = m
        .tokenizer
        .clone()
        .with_context(|| format!("`{}` has no tokenizer.json", a.model))?;
    let eos = m.files.eos_token_ids(&m.config.eos_token_ids)?;
    let cfg = TaskConfig::Swe {
        instances: file.display().to_string(),
        repos: a.repos.as_ref().map(|r| r.display().to_string()),
        holdout_every: 1,
        max_tokens: a.max_tokens,
        max_turns: a.max_turns,
        allow_unsandboxed: a.unsandboxed,
    };
    let sampler = TaskSampler::new(cfg, a.seed, Some(tok), eos)?;
    let n_tasks = sampler
        .eval_len()
        .unwrap_or(0)
        .min(a.limit.unwrap_or(usize::MAX));
    if n_tasks == 0 {
        bail!("{}: no instances", file.display());
    }
    let mut tasks = Vec::with_capacity(n_tasks * a.n);
    for i in 0..n_tasks {
        for _ in 0..a.n {
            tasks.push(sampler.eval_task(i as u64)?);
        }
    }
    let ids: Vec<String> = tasks.iter().step_by(a.n).map(|t| t.id.clone()).collect();
    let mut engine = Engine::new(
        &m.model,
        None,
        EngineConfig {
            kv_memory_mib: a.kv_memory_mib,
            ..Default::default()
        },
    )?;
    let start = std::time::Instant::now();
    let (eps, stats) = arbor_train::rollout::run_episodes_detailed(
        &mut engine,
        tasks,
        &sampler.rollout_config(a.temperature),
        a.seed,
        a.env_workers,
    )?;
    let seconds = start.elapsed().as_secs_f64();
    fn mean<'a>(eps: &'a [EpisodeResult], f: impl Fn(&'a EpisodeResult) -> usize) -> f64 {
        eps.iter().map(|e| f(e) as f64).sum::<f64>() / eps.len().max(1) as f64
    }
    let per_task: Vec<SweTaskResult> = eps
        .chunks(a.n)
        .zip(&ids)
        .map(|(g, id)| SweTaskResult {
            id: id.clone(),
            samples: g.len(),
            passed: g.iter().filter(|e| e.reward >= 1.0).count(),
            turns: mean(g, |e| e.turns),
            generated_tokens: mean(g, |e| e.generated_tokens),
            context_tokens: mean(g, |e| e.context_tokens),
        })
        .collect();
    let passed: Vec<usize> = per_task.iter().map(|t| t.passed).collect();
    let s = SweSummary {
        model: a.model.clone(),
        instances: file.display().to_string(),
        tasks: n_tasks,
        samples_per_task: a.n,
        pass_rate: passed.iter().sum::<usize>() as f64 / eps.len() as f64,
        pass_at_k: pass_at_ks(a.n, &passed),
        turns_per_episode: mean(&eps, |e| e.turns),
        generated_tokens_per_episode: mean(&eps, |e| e.generated_tokens),
        seconds,
        env_seconds: stats.env_s,
        per_task,
    };
    if let Some(p) = &a.out {
        let mut w = std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("{}: cannot create", p.display()))?,
        );
        use std::io::Write;
        for t in &s.per_task {
            writeln!(w, "{}", serde_json::to_string(t)?)?;
        }
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&s)?);
        return Ok(());
    }
    println!(
        "{:<40} {:>7} {:>7} {:>9}",
        "task", "passed", "turns", "tokens"
    );
    for t in &s.per_task {
        println!(
            "{:<40} {:>3}/{:<3} {:>7.1} {:>9.0}",
            t.id, t.passed, t.samples, t.turns, t.generated_tokens
        );
    }
    println!(
        "instances          {} ({} tasks x {} samples)",
        s.instances, s.tasks, s.samples_per_task
    );
    println!("pass rate          {:.4}", s.pass_rate);
    for (k, v) in &s.pass_at_k {
        println!("pass@{k:<14} {v:.4}");
    }
    println!("turns per episode  {:.2}", s.turns_per_episode);
    println!(
        "tokens per episode {:.1} generated",
        s.generated_tokens_per_episode
    );
    println!(
        "time               {:.1} s ({:.1} s in environments, summed over workers)",
        s.seconds, s.env_seconds
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::pass_at_k;

    /// pass@k against a brute-force count over all k-subsets.
    #[test]
    fn pass_at_k_matches_brute_force() {
        fn subsets(n: usize, k: usize) -> Vec<Vec<usize>> {
            if k == 0 {
                return vec![vec![]];
            }
            if n < k {
                return vec![];
            }
            let mut with: Vec<Vec<usize>> = subsets(n - 1, k - 1);
            for s in &mut with {
                s.push(n - 1);
            }
            with.extend(subsets(n - 1, k));
            with
        }
        for n in 1..=8 {
            for c in 0..=n {
                for k in 1..=n {
                    let all = subsets(n, k);
                    // Samples 0..c are the correct ones.
                    let hit = all.iter().filter(|s| s.iter().any(|&i| i < c)).count();
                    let want = hit as f64 / all.len() as f64;
                    assert!(
                        (pass_at_k(n, c, k) - want).abs() < 1e-12,
                        "n={n} c={c} k={k}"
                    );
                }
            }
        }
    }
}
