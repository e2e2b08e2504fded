//! `arbor bench algos`: FOCUS, Prefix Sampling, GRPO, PPO and VinePPO on a
//! built-in task from the same warm-started policy, at equal generated
//! tokens per step (`budget = { tokens = N }` for every run), several seeds:
//! held-out greedy pass rate vs generated tokens (training rewards are not
//! comparable: Prefix Sampling steers its re-rollouts toward 50% by
//! design), the final pass rate with a 95% interval, the tokens each needs
//! to reach GRPO's final pass rate, and FOCUS's critic diagnostics. A row
//! is a method with optional settings, `focus+lambda=1+critic_init=own`.
//! Prints tables, writes `algos.json` and `algos.png`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use arbor_model::CriticMode;
use arbor_train::config::FocusConfig;
use arbor_train::{read_metrics, Algo, StepBudget, TrainConfig, Trainer};
use clap::Args;
use serde::Serialize;

#[derive(Debug, Args)]
pub struct AlgosArgs {
    /// Base config (default: the embedded quickstart). `algo`, `seed` and
    /// the critic mode are set per run.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Comma-separated rows: a method (focus, ps, grpo, ppo, vineppo),
    /// optionally with settings joined by `+`: `lambda=X`, `kappa=X`,
    /// `score=spec|bias|propagated`, `evidence=on_policy|subtree`,
    /// `prune_settled=K`, `critic_targets=gbar|monte_carlo`,
    /// `center=B` (centred advantages), `root_samples=K`, `slip_nats=C`
    /// (states below a doubted token go last),
    /// `critic=shared|separate`, `critic_init=policy|own`, `critic_lr=X`,
    /// `critic_epochs=E`, `critic_minibatches=M`, `critic_replay=R`, `heldout_tasks=N`,
    /// `heldout_samples=K`;
    /// Prefix Sampling's `reserve=X`, `band=X`, `eta=X`,
    /// `cut=auto|tokens|lines|boundaries`, `replay=execute|snapshot`,
    /// `rerollouts=M`, `sources=S`, `attempts=K`, `probe=Q`, `anchor=B`, `cut_rule=R`, `keep_skewed=B`,
    /// `match_budget=B`; the context's `compaction=none|free_form|structured|workspace`
    /// and `context_tokens=N`; the step's shape: `prompts=N` (prompts a
    /// step: FOCUS's roots), `samples=N` (a group's size) and
    /// `critic_warmup=N` (critic-only first steps of FOCUS and PPO).
    #[arg(
        long,
        default_value = "focus,ps,grpo,ppo,vineppo",
        value_delimiter = ','
    )]
    pub algos: Vec<String>,
    /// Seeds per row: `first_seed .. first_seed + seeds`.
    #[arg(long, default_value_t = 5)]
    pub seeds: u64,
    /// The first seed (a confirmation run on fresh seeds starts past the
    /// ones a setting was chosen on).
    #[arg(long, default_value_t = 0)]
    pub first_seed: u64,
    /// Generated tokens per step, the same for every run (default: the
    /// config's `budget`, else 1024, about what the quickstart's GRPO
    /// spends per step). 0: each method at its own size.
    #[arg(long)]
    pub budget_tokens: Option<u64>,
    /// RL steps per run (default: the config's).
    #[arg(long)]
    pub steps: Option<u64>,
    #[arg(long, default_value = "runs/bench-algos")]
    pub out: PathBuf,
}

#[derive(Debug, Serialize)]
struct RunResult {
    algo: String,
    seed: u64,
    initial_eval: f64,
    final_eval: f64,
    final_reward: f64,
    generated_tokens: u64,
    replayed_tokens: u64,
    /// (cumulative generated tokens, greedy eval pass rate on held-out
    /// tasks) at every evaluation, starting with the warm-started policy.
    curve: Vec<(u64, f64)>,
    /// (step, held-out critic Spearman vs Monte-Carlo values), where scored.
    critic_curve: Vec<(u64, f64)>,
    /// Mean over the scored steps of the noise ceiling on that Spearman
    /// (what a critic with the true values would show against the same
    /// Monte-Carlo values).
    critic_ceiling: Option<f64>,
    /// Mean over steps of FOCUS's settled-state token share and launch
    /// depth.
    settled_fraction: Option<f64>,
    mean_depth: Option<f64>,
    /// Mean over steps of the groups in the update with mixed rewards.
    effective_groups: f64,
    /// Prefix Sampling's re-rollout statistics (PS rows).
    ps: Option<PsRun>,
    /// Context management (runs with a bounded context).
    context: Option<CtxRun>,
}

/// Context management over one run (a bounded context).
#[derive(Debug, Serialize)]
struct CtxRun {
    /// Share of the greedy held-out episodes' summaries that carry the
    /// task's state, before RL and at the last evaluation.
    kept_first: Option<f64>,
    kept_last: Option<f64>,
    compactions_per_episode: f64,
    summary_tokens_per_episode: f64,
    /// Episodes ended by a malformed summary, a missing key, a full
    /// context, the compaction limit, over the run.
    malformed: u64,
    missing_keys: u64,
    overflows: u64,
    compaction_limit: u64,
    ended_after_compaction: u64,
}

impl CtxRun {
    fn of(ms: &[arbor_train::StepMetrics], s: &arbor_train::Summary) -> Option<CtxRun> {
        let c: Vec<&arbor_train::metrics::ContextMetrics> =
            ms.iter().filter_map(|m| m.context.as_ref()).collect();
        if c.is_empty() {
            return None;
        }
        let last_eval = ms.iter().rev().find_map(|m| m.eval_context.as_ref());
        let n = c.len() as f64;
        Some(CtxRun {
            kept_first: s
                .initial_eval_context
                .as_ref()
                .and_then(|x| x.summaries_kept_state),
            kept_last: last_eval.and_then(|x| x.summaries_kept_state),
            compactions_per_episode: c.iter().map(|x| x.compactions_per_episode).sum::<f64>() / n,
            summary_tokens_per_episode: c.iter().map(|x| x.summary_tokens_per_episode).sum::<f64>()
                / n,
            malformed: c.iter().map(|x| x.malformed_summaries).sum(),
            missing_keys: c.iter().map(|x| x.missing_keys).sum(),
            overflows: c.iter().map(|x| x.overflows).sum(),
            compaction_limit: c.iter().map(|x| x.compaction_limit).sum(),
            ended_after_compaction: c.iter().map(|x| x.ended_after_compaction).sum(),
        })
    }
}

/// Context management of the runs with a bounded context (seed means).
fn print_context(algos: &[String], results: &[RunResult]) {
    if results.iter().all(|r| r.context.is_none()) {
        return;
    }
    println!(
        "\n| algo | held-out summaries carrying the state (greedy), before / after RL | compactions per episode (training) | summary tokens per episode | episodes ended: malformed summary / missing key / full context / compaction limit | ended right after a compaction |"
    );
    println!("|---|---|---|---|---|---|");
    for name in algos {
        let runs: Vec<&CtxRun> = results
            .iter()
            .filter(|r| &r.algo == name)
            .filter_map(|r| r.context.as_ref())
            .collect();
        if runs.is_empty() {
            continue;
        }
        let k = runs.len() as f64;
        let avg = |f: &dyn Fn(&CtxRun) -> Option<f64>| {
            let v: Vec<f64> = runs.iter().filter_map(|r| f(r)).collect();
            if v.is_empty() {
                "-".to_string()
            } else {
                format!("{:.2}", v.iter().sum::<f64>() / v.len() as f64)
            }
        };
        let sum = |f: &dyn Fn(&CtxRun) -> u64| runs.iter().map(|r| f(r)).sum::<u64>();
        println!(
            "| {name} | {} / {} | {:.2} | {:.1} | {} / {} / {} / {} | {} |",
            avg(&|r| r.kept_first),
            avg(&|r| r.kept_last),
            runs.iter().map(|r| r.compactions_per_episode).sum::<f64>() / k,
            runs.iter()
                .map(|r| r.summary_tokens_per_episode)
                .sum::<f64>()
                / k,
            sum(&|r| r.malformed),
            sum(&|r| r.missing_keys),
            sum(&|r| r.overflows),
            sum(&|r| r.compaction_limit),
            sum(&|r| r.ended_after_compaction),
        );
    }
}

/// Prefix Sampling over one run: re-rollout groups and pass rates, and each
/// bucket's EMA after the warm-up (steps past [`PS_WARMUP`]).
#[derive(Debug, Serialize)]
struct PsRun {
    reroll_groups: usize,
    reroll_degenerate: usize,
    probes_agreed: usize,
    reroll_tokens: u64,
    reroll_tokens_wasted: u64,
    rerollout_pass_rate: Option<f64>,
    first_pass_pass_rate: f64,
    /// Bucket -> (mean EMA after the warm-up, share of those steps with the
    /// EMA within 0.5 +- 0.1).
    bucket_ema: std::collections::BTreeMap<String, (f64, f64)>,
}

/// Steps of a PS run before its controller's EMAs are judged.
const PS_WARMUP: u64 = 10;

impl PsRun {
    fn of(ms: &[arbor_train::StepMetrics]) -> Option<PsRun> {
        let ps: Vec<(u64, &arbor_train::rollout::ps::PsReport)> = ms
            .iter()
            .filter_map(|m| m.ps.as_ref().map(|p| (m.step, p)))
            .collect();
        if ps.is_empty() {
            return None;
        }
        let mut emas: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
        for (step, p) in &ps {
            if *step > PS_WARMUP {
                for (b, r) in &p.buckets {
                    if let Some(e) = r.ema {
                        emas.entry(b.clone()).or_default().push(e);
                    }
                }
            }
        }
        let (mut wins, mut trials) = (0.0, 0.0);
        for (_, p) in &ps {
            if let Some(r) = p.reroll_pass_rate {
                // The pass rate of the step's re-rollouts, weighted by them.
                let k = p.rerollouts as f64;
                wins += r * k;
                trials += k;
            }
        }
        Some(PsRun {
            reroll_groups: ps.iter().map(|(_, p)| p.reroll_groups).sum(),
            reroll_degenerate: ps.iter().map(|(_, p)| p.reroll_degenerate).sum(),
            probes_agreed: ps.iter().map(|(_, p)| p.probes_agreed).sum(),
            reroll_tokens: ps.iter().map(|(_, p)| p.reroll_tokens).sum(),
            reroll_tokens_wasted: ps.iter().map(|(_, p)| p.reroll_tokens_wasted).sum(),
            rerollout_pass_rate: (trials > 0.0).then(|| wins / trials),
            first_pass_pass_rate: ps.iter().map(|(_, p)| p.first_pass_pass_rate).sum::<f64>()
                / ps.len() as f64,
            bucket_ema: emas
                .into_iter()
                .map(|(b, v)| {
                    let k = v.len() as f64;
                    let mean = v.iter().sum::<f64>() / k;
                    let near = v.iter().filter(|e| (*e - 0.5).abs() <= 0.1).count() as f64 / k;
                    (b, (mean, near))
                })
                .collect(),
        })
    }
}

#[derive(Debug, Serialize)]
struct AlgoSummary {
    algo: String,
    final_eval_mean: f64,
    /// Half-width of the 95% Student-t interval of the final eval mean.
    final_eval_ci95: f64,
    /// Final eval minus GRPO's on the same seed (same warm-started policy):
    /// mean and 95% interval half-width.
    paired_vs_grpo: Option<(f64, f64)>,
    final_reward_mean: f64,
    generated_tokens_mean: f64,
    /// Generated tokens at which the seed-mean eval pass rate first reaches
    /// GRPO's final one, and that as a fraction of GRPO's total.
    tokens_to_grpo_final: Option<f64>,
    ratio_to_grpo: Option<f64>,
}

/// The config of one run: `base` with the row's method, seed and settings;
/// FOCUS on a separate critic, the others on the shared one; `[focus]`
/// back at its defaults for the other methods (it is FOCUS's own, and PPO
/// and VinePPO refuse a changed one).
pub(crate) fn row_config(
    base: &TrainConfig,
    algo: Algo,
    settings: &[&str],
    seed: u64,
    steps: Option<u64>,
) -> Result<TrainConfig> {
    let mut cfg = base.clone();
    cfg.algo = algo;
    cfg.seed = seed;
    cfg.checkpoint_every = 0;
    cfg.keep_last = 1;
    if let Some(s) = steps {
        cfg.steps = s;
    }
    if algo == Algo::Focus {
        cfg.learner.critic = CriticMode::Separate;
    } else {
        cfg.learner.critic = CriticMode::Shared;
        cfg.focus = FocusConfig::default();
        // The base's surprise features are FOCUS's setting; a PPO row
        // takes them with `+surprise=true`.
        cfg.critic.surprise = false;
    }
    apply_row(&mut cfg, settings)?;
    cfg.validate("bench algos")?;
    Ok(cfg)
}

/// Apply a row's `+key=value` settings to `cfg` (`lambda` is FOCUS's for
/// FOCUS, PPO's GAE lambda otherwise).
fn apply_row(cfg: &mut TrainConfig, settings: &[&str]) -> Result<()> {
    for kv in settings {
        let (k, v) = kv
            .split_once('=')
            .with_context(|| format!("row setting `{kv}`: expected key=value"))?;
        let num = || -> Result<f64> {
            v.parse::<f64>()
                .with_context(|| format!("row setting `{kv}`: not a number"))
        };
        let int = || -> Result<usize> {
            v.parse::<usize>()
                .with_context(|| format!("row setting `{kv}`: not a whole number >= 0"))
        };
        let int32 = || -> Result<u32> {
            u32::try_from(int()?).with_context(|| format!("row setting `{kv}`: too large"))
        };
        match k {
            "lambda" if cfg.algo == Algo::Focus => cfg.focus.lambda = num()?,
            "lambda" => cfg.ppo.lambda = num()?,
            "kappa" => cfg.focus.kappa = num()?,
            "prune_settled" => cfg.focus.prune_settled = int32()?,
            "critic_targets" => cfg.focus.critic_targets = variant(kv, v)?,
            "center" => cfg.focus.center_advantages = flag(kv, v)?,
            "root_samples" => cfg.focus.root_samples = int32()?,
            "slip_nats" => cfg.focus.slip_nats = num()?,
            "prompts" => cfg.prompts_per_step = int()?,
            "samples" => cfg.samples_per_prompt = int()?,
            "critic_warmup" => cfg.critic_warmup_steps = int()? as u64,
            "score" => cfg.focus.score = variant(kv, v)?,
            "evidence" => cfg.focus.evidence = variant(kv, v)?,
            "critic_lr" => cfg.critic.lr = Some(num()?),
            "critic_epochs" => cfg.critic.epochs = int()?,
            "critic_minibatches" => cfg.critic.minibatches = int()?,
            "critic_replay" => cfg.critic.replay_steps = int()?,
            "heldout_tasks" => cfg.critic.heldout_tasks = int()?,
            "heldout_samples" => cfg.critic.heldout_samples = int()?,
            "critic" => cfg.learner.critic = variant(kv, v)?,
            "critic_init" => cfg.critic.init = variant(kv, v)?,
            "surprise" => cfg.critic.surprise = flag(kv, v)?,
            "reserve" => cfg.ps.reserve = num()?,
            "band" => cfg.ps.band = num()?,
            "eta" => cfg.ps.controller.eta = num()?,
            "cut" => cfg.ps.cut = variant(kv, v)?,
            "replay" => cfg.ps.replay = variant(kv, v)?,
            "rerollouts" => cfg.ps.rerollouts = int()?,
            "attempts" => cfg.ps.attempts = int32()?,
            "sources" => cfg.ps.sources = int()?,
            "probe" => cfg.ps.probe = int()?,
            "anchor" => cfg.ps.anchor = flag(kv, v)?,
            "cut_rule" => cfg.ps.cut_rule = variant(kv, v)?,
            "keep_skewed" => cfg.ps.keep_skewed = flag(kv, v)?,
            "match_budget" => cfg.ps.match_budget = flag(kv, v)?,
            "compaction" => cfg.harness.compaction = variant(kv, v)?,
            "context_tokens" => cfg.harness.context_tokens = Some(int()?),
            _ => anyhow::bail!(
                "row setting `{kv}`: unknown key (lambda, kappa, score, evidence, \
                 prune_settled, critic_targets, center, root_samples, slip_nats, critic, critic_init, critic_lr, critic_epochs, \
                 critic_minibatches, critic_replay, heldout_tasks, heldout_samples, surprise; PS: reserve, \
                 band, eta, cut, replay, rerollouts, sources, attempts, probe, anchor, cut_rule, keep_skewed, \
                 match_budget; context: compaction, context_tokens; shape: prompts, samples, critic_warmup)"
            ),
        }
    }
    Ok(())
}

/// A `true` / `false` row setting.
fn flag(kv: &str, v: &str) -> Result<bool> {
    v.parse()
        .map_err(|_| anyhow::anyhow!("row setting `{kv}`: expected true or false"))
}

/// A config enum from its name as the TOML spells it (`monte_carlo`),
/// through its serde form; the error lists the names it accepts.
fn variant<T: serde::de::DeserializeOwned>(kv: &str, v: &str) -> Result<T> {
    use serde::de::IntoDeserializer;
    let de: serde::de::value::StrDeserializer<'_, serde::de::value::Error> = v.into_deserializer();
    T::deserialize(de).map_err(|e| anyhow::anyhow!("row setting `{kv}`: {e}"))
}

/// Two-sided 95% Student-t quantile with `df` degrees of freedom.
fn t95(df: usize) -> f64 {
    const T: [f64; 10] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    ];
    match df {
        0 => f64::NAN,
        d if d <= T.len() => T[d - 1],
        d if d <= 30 => 2.042 + (2.228 - 2.042) * (30 - d) as f64 / 20.0,
        _ => 1.96,
    }
}

/// Mean and 95% interval half-width of `xs`.
fn mean_ci95(xs: &[f64]) -> (f64, f64) {
    let k = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / k.max(1.0);
    if xs.len() < 2 {
        return (mean, f64::NAN);
    }
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (k - 1.0);
    (mean, t95(xs.len() - 1) * (var / k).sqrt())
}

pub(crate) fn parse_algo(s: &str) -> Result<Algo> {
    Ok(match s {
        "focus" => Algo::Focus,
        "ps" => Algo::Ps,
        "grpo" => Algo::Grpo,
        "ppo" => Algo::Ppo,
        "vineppo" => Algo::Vineppo,
        o => anyhow::bail!("unknown algorithm `{o}` (focus, ps, grpo, ppo, vineppo)"),
    })
}

pub fn run(a: AlgosArgs) -> Result<()> {
    let text = match &a.config {
        Some(p) => {
            std::fs::read_to_string(p).with_context(|| format!("{}: cannot read", p.display()))?
        }
        None => crate::train::QUICKSTART.to_string(),
    };
    let mut base = TrainConfig::from_toml(&text, "bench algos config")?;
    base.budget = match a.budget_tokens {
        Some(0) => None,
        Some(n) => Some(StepBudget::Tokens(n)),
        None => base.budget.or(Some(StepBudget::Tokens(1024))),
    };
    let mut results = Vec::new();
    for name in &a.algos {
        let mut parts = name.split('+');
        let algo = parse_algo(parts.next().unwrap_or_default())?;
        let settings: Vec<&str> = parts.collect();
        for seed in a.first_seed..a.first_seed.saturating_add(a.seeds) {
            let cfg = row_config(&base, algo, &settings, seed, a.steps)
                .with_context(|| format!("bench algos row `{name}`"))?;
            let dir = a
                .out
                .join(format!("{}-seed{seed}", name.replace(['+', '='], "_")));
            eprintln!("bench algos: {name} seed {seed} -> {}", dir.display());
            let mut t = Trainer::new(cfg, &dir, false)?;
            t.warmup(|_, _| {})?;
            let s = t.run(|_| {})?;
            let ms = read_metrics(&dir.join("metrics.jsonl"))?;
            let mut cum = 0;
            let mut curve = vec![(0u64, s.initial_eval_pass_rate)];
            for m in &ms {
                cum += m.generated_tokens;
                if let Some(e) = m.eval_pass_rate {
                    curve.push((cum, e));
                }
            }
            let critic_curve = ms
                .iter()
                .filter_map(|m| m.critic_heldout_rank_corr.map(|r| (m.step, r)))
                .collect();
            let mean_of = |f: &dyn Fn(&arbor_train::StepMetrics) -> Option<f64>| {
                let v: Vec<f64> = ms.iter().filter_map(f).collect();
                (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
            };
            let settled_fraction = mean_of(&|m| m.alloc_settled_fraction);
            let mean_depth = mean_of(&|m| m.alloc_mean_depth);
            let critic_ceiling = mean_of(&|m| m.critic_heldout_rank_ceiling);
            let effective_groups =
                ms.iter().map(|m| m.effective_groups as f64).sum::<f64>() / ms.len().max(1) as f64;
            let ps = PsRun::of(&ms);
            let context = CtxRun::of(&ms, &s);
            let n = ms.len().clamp(1, 10);
            let final_reward = ms.iter().rev().take(n).map(|m| m.reward).sum::<f64>() / n as f64;
            results.push(RunResult {
                algo: name.clone(),
                seed,
                initial_eval: s.initial_eval_pass_rate,
                final_eval: s.final_eval_pass_rate,
                final_reward,
                generated_tokens: cum,
                replayed_tokens: ms.iter().map(|m| m.replayed_tokens).sum(),
                curve,
                critic_curve,
                critic_ceiling,
                settled_fraction,
                mean_depth,
                effective_groups,
                ps,
                context,
            });
        }
    }
    // Seed-mean eval curves (same evaluation steps for every run).
    let mean_curve = |algo: &str| -> Vec<(f64, f64)> {
        let runs: Vec<&RunResult> = results.iter().filter(|r| r.algo == algo).collect();
        let n = runs.iter().map(|r| r.curve.len()).min().unwrap_or(0);
        (0..n)
            .map(|i| {
                let k = runs.len() as f64;
                (
                    runs.iter().map(|r| r.curve[i].0 as f64).sum::<f64>() / k,
                    runs.iter().map(|r| r.curve[i].1).sum::<f64>() / k,
                )
            })
            .collect()
    };
    let grpo_final = results
        .iter()
        .any(|r| r.algo == "grpo")
        .then(|| mean_curve("grpo").last().copied())
        .flatten();
    let mut summaries = Vec::new();
    for name in &a.algos {
        let runs: Vec<&RunResult> = results.iter().filter(|r| &r.algo == name).collect();
        let k = runs.len() as f64;
        let curve = mean_curve(name);
        let reach =
            grpo_final.and_then(|(_, target)| curve.iter().find(|c| c.1 >= target).map(|c| c.0));
        let finals: Vec<f64> = runs.iter().map(|r| r.final_eval).collect();
        let (final_eval_mean, final_eval_ci95) = mean_ci95(&finals);
        let diffs: Vec<f64> = runs
            .iter()
            .filter_map(|r| {
                results
                    .iter()
                    .find(|g| g.algo == "grpo" && g.seed == r.seed)
                    .map(|g| r.final_eval - g.final_eval)
            })
            .collect();
        let paired_vs_grpo = (!diffs.is_empty() && name != "grpo").then(|| mean_ci95(&diffs));
        summaries.push(AlgoSummary {
            algo: name.clone(),
            final_eval_mean,
            final_eval_ci95,
            paired_vs_grpo,
            final_reward_mean: runs.iter().map(|r| r.final_reward).sum::<f64>() / k,
            generated_tokens_mean: runs.iter().map(|r| r.generated_tokens as f64).sum::<f64>() / k,
            tokens_to_grpo_final: reach,
            ratio_to_grpo: reach.zip(grpo_final).map(|(t, (g, _))| t / g),
        });
    }
    println!("| algo | seed | eval before | eval after | final training reward (last 10 steps) | generated tokens | replayed tokens |");
    println!("|---|---|---|---|---|---|---|");
    for r in &results {
        println!(
            "| {} | {} | {:.3} | {:.3} | {:.3} | {} | {} |",
            r.algo,
            r.seed,
            r.initial_eval,
            r.final_eval,
            r.final_reward,
            r.generated_tokens,
            r.replayed_tokens
        );
    }
    println!("\n| algo | eval after (mean +- 95% CI) | minus GRPO, same seed (mean +- 95% CI) | mean final training reward | mean generated tokens | tokens to GRPO's final eval | ratio to GRPO |");
    println!("|---|---|---|---|---|---|---|");
    for s in &summaries {
        println!(
            "| {} | {:.3} +- {:.3} | {} | {:.3} | {:.0} | {} | {} |",
            s.algo,
            s.final_eval_mean,
            s.final_eval_ci95,
            s.paired_vs_grpo
                .map(|(m, c)| format!("{m:+.3} +- {c:.3}"))
                .unwrap_or_else(|| "-".into()),
            s.final_reward_mean,
            s.generated_tokens_mean,
            s.tokens_to_grpo_final
                .map(|t| format!("{t:.0}"))
                .unwrap_or_else(|| "not reached".into()),
            s.ratio_to_grpo
                .map(|r| format!("{r:.2}x"))
                .unwrap_or_else(|| "-".into())
        );
    }
    // Critic diagnostics of the critic-based rows: held-out rank
    // correlation at each scored step (seed mean), settled-state token
    // share and launch depth (FOCUS).
    let mut header = false;
    for name in &a.algos {
        let runs: Vec<&RunResult> = results.iter().filter(|r| &r.algo == name).collect();
        let n = runs.iter().map(|r| r.critic_curve.len()).min().unwrap_or(0);
        if n == 0 {
            continue;
        }
        if !header {
            println!("\n| algo | held-out critic rank correlation by step (seed mean) | its noise ceiling (mean) | settled-state token share | mean launch depth |");
            println!("|---|---|---|---|---|");
            header = true;
        }
        let k = runs.len() as f64;
        let curve: Vec<String> = (0..n)
            .map(|i| {
                let m = runs.iter().map(|r| r.critic_curve[i].1).sum::<f64>() / k;
                format!("{}: {m:.2}", runs[0].critic_curve[i].0)
            })
            .collect();
        let avg = |f: &dyn Fn(&RunResult) -> Option<f64>| {
            let v: Vec<f64> = runs.iter().filter_map(|r| f(r)).collect();
            if v.is_empty() {
                "-".to_string()
            } else {
                format!("{:.2}", v.iter().sum::<f64>() / v.len() as f64)
            }
        };
        println!(
            "| {name} | {} | {} | {} | {} |",
            curve.join(", "),
            avg(&|r| r.critic_ceiling),
            avg(&|r| r.settled_fraction),
            avg(&|r| r.mean_depth)
        );
    }
    print_groups(&a.algos, &results);
    print_context(&a.algos, &results);
    std::fs::create_dir_all(&a.out)?;
    std::fs::write(
        a.out.join("algos.json"),
        serde_json::to_vec_pretty(&serde_json::json!({"runs": results, "summary": summaries}))?,
    )?;
    plot(&a.out.join("algos.png"), &a.algos, &mean_curve)?;
    println!(
        "\nwrote {} and {}",
        a.out.join("algos.json").display(),
        a.out.join("algos.png").display()
    );
    Ok(())
}

/// Effective groups per step against GRPO's, and Prefix Sampling's
/// re-rollout statistics (seed means).
fn print_groups(algos: &[String], results: &[RunResult]) {
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let runs_of =
        |name: &str| -> Vec<&RunResult> { results.iter().filter(|r| r.algo == name).collect() };
    let grpo = mean(
        &runs_of("grpo")
            .iter()
            .map(|r| r.effective_groups)
            .collect::<Vec<_>>(),
    );
    println!("\n| algo | effective groups per step (mixed rewards, in the update) | vs GRPO |");
    println!("|---|---|---|");
    for name in algos {
        let e = mean(
            &runs_of(name)
                .iter()
                .map(|r| r.effective_groups)
                .collect::<Vec<_>>(),
        );
        let vs = if grpo > 0.0 {
            format!("{:.2}x", e / grpo)
        } else {
            "-".into()
        };
        println!("| {name} | {e:.2} | {vs} |");
    }
    let mut header = false;
    for name in algos {
        let ps: Vec<&PsRun> = runs_of(name).iter().filter_map(|r| r.ps.as_ref()).collect();
        if ps.is_empty() {
            continue;
        }
        if !header {
            println!("\n| algo | first-pass pass rate | re-rollout pass rate | re-rollout groups per run | degenerate groups (all alike) | agreeing probes per run | re-rollout tokens in no trained group | bucket EMA after step {PS_WARMUP}: mean (share of steps within 0.5 +- 0.1) |");
            println!("|---|---|---|---|---|---|---|---|");
            header = true;
        }
        let groups: usize = ps.iter().map(|p| p.reroll_groups).sum();
        let degenerate: usize = ps.iter().map(|p| p.reroll_degenerate).sum();
        let probes: usize = ps.iter().map(|p| p.probes_agreed).sum();
        let tokens: u64 = ps.iter().map(|p| p.reroll_tokens).sum();
        let wasted: u64 = ps.iter().map(|p| p.reroll_tokens_wasted).sum();
        let rates: Vec<f64> = ps.iter().filter_map(|p| p.rerollout_pass_rate).collect();
        let mut buckets: std::collections::BTreeMap<&str, Vec<(f64, f64)>> = Default::default();
        for p in &ps {
            for (b, v) in &p.bucket_ema {
                buckets.entry(b.as_str()).or_default().push(*v);
            }
        }
        let cells: Vec<String> = buckets
            .iter()
            .map(|(b, v)| {
                let m = mean(&v.iter().map(|x| x.0).collect::<Vec<_>>());
                let near = mean(&v.iter().map(|x| x.1).collect::<Vec<_>>());
                format!("{b}: {m:.2} ({:.0}%)", 100.0 * near)
            })
            .collect();
        println!(
            "| {name} | {:.3} | {:.3} | {:.1} | {:.1}% | {:.1} | {:.1}% | {} |",
            mean(
                &ps.iter()
                    .map(|p| p.first_pass_pass_rate)
                    .collect::<Vec<_>>()
            ),
            mean(&rates),
            groups as f64 / ps.len() as f64,
            100.0 * degenerate as f64 / groups.max(1) as f64,
            probes as f64 / ps.len() as f64,
            100.0 * wasted as f64 / tokens.max(1) as f64,
            cells.join(", ")
        );
    }
}

fn plot(
    path: &std::path::Path,
    algos: &[String],
    curve: &dyn Fn(&str) -> Vec<(f64, f64)>,
) -> Result<()> {
    use plotters::style::{Color, Palette, Palette99};
    let series: Vec<crate::plot::Series> = algos
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let c = Palette99::pick(i).to_rgba();
            crate::plot::Series {
                name: a.clone(),
                color: plotters::style::RGBColor(c.0, c.1, c.2),
                width: 2,
                points: curve(a),
            }
        })
        .collect();
    crate::plot::line_chart(
        path,
        "held-out greedy pass rate vs generated tokens (mean over seeds)",
        "generated tokens",
        "eval pass rate",
        &series,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbor_rl::focus::Score;
    use arbor_train::config::CriticTargets;
    use arbor_train::CriticInit;

    #[test]
    fn interval_matches_hand_computation() {
        // mean 2, sample sd 1, n = 4: half-width t(3) * 1 / 2.
        let (m, c) = mean_ci95(&[1.0, 2.0, 2.0, 3.0]);
        assert!((m - 2.0).abs() < 1e-12);
        let sd = (2.0f64 / 3.0).sqrt();
        assert!((c - 3.182 * sd / 2.0).abs() < 1e-9, "{c}");
        assert!(mean_ci95(&[1.0]).1.is_nan());
        assert_eq!(t95(4), 2.776);
        assert_eq!(t95(1000), 1.96);
    }

    #[test]
    fn row_settings_apply_and_bad_ones_are_named() {
        let mut cfg = TrainConfig::default();
        apply_row(
            &mut cfg,
            &[
                "lambda=1",
                "score=bias",
                "critic_init=own",
                "critic_lr=0.003",
            ],
        )
        .unwrap();
        assert_eq!(cfg.focus.lambda, 1.0);
        assert_eq!(cfg.ppo.lambda, 0.0);
        assert_eq!(cfg.focus.score, Score::Bias);
        assert_eq!(cfg.critic.init, CriticInit::Own);
        assert_eq!(cfg.critic.lr, Some(0.003));
        apply_row(
            &mut cfg,
            &[
                "critic_targets=monte_carlo",
                "prune_settled=2",
                "center=true",
                "slip_nats=1.5",
            ],
        )
        .unwrap();
        assert_eq!(cfg.focus.slip_nats, 1.5);
        assert_eq!(cfg.focus.critic_targets, CriticTargets::MonteCarlo);
        assert!(cfg.focus.center_advantages);
        assert_eq!(cfg.focus.prune_settled, 2);
        let e = apply_row(&mut cfg, &["gamma=1"]).unwrap_err().to_string();
        assert!(e.contains("gamma=1"), "{e}");
        let e = apply_row(&mut cfg, &["lambda"]).unwrap_err().to_string();
        assert!(e.contains("key=value"), "{e}");
        apply_row(
            &mut cfg,
            &["critic_epochs=2", "critic_replay=20", "heldout_tasks=32"],
        )
        .unwrap();
        assert_eq!(
            (
                cfg.critic.epochs,
                cfg.critic.replay_steps,
                cfg.critic.heldout_tasks
            ),
            (2, 20, 32)
        );
        apply_row(&mut cfg, &["prompts=24", "samples=5", "critic_warmup=0"]).unwrap();
        assert_eq!(
            (
                cfg.prompts_per_step,
                cfg.samples_per_prompt,
                cfg.critic_warmup_steps
            ),
            (24, 5, 0)
        );
        // Counts are whole numbers: no silent truncation of 1.5 or -1.
        for bad in [
            "critic_epochs=1.5",
            "critic_replay=-1",
            "prune_settled=x",
            "samples=2.5",
        ] {
            let e = apply_row(&mut cfg, &[bad]).unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains("whole number"), "{e}");
        }
    }

    /// Every method's row is a valid config on the shipped bases, whose
    /// `[focus]` departs from the defaults (`lambda = 1`).
    #[test]
    fn every_method_runs_on_the_shipped_configs() {
        let long = include_str!("../configs/long-horizon.toml");
        for text in [crate::train::QUICKSTART, long] {
            let base = TrainConfig::from_toml(text, "test").unwrap();
            for algo in ["focus", "ps", "grpo", "ppo", "vineppo"] {
                let algo = parse_algo(algo).unwrap();
                let cfg = row_config(&base, algo, &["lambda=0.5"], 3, Some(2)).unwrap();
                assert_eq!(cfg.seed, 3);
                assert_eq!(cfg.steps, 2);
                if algo == Algo::Focus {
                    assert_eq!(cfg.focus.lambda, 0.5);
                    assert_eq!(cfg.learner.critic, CriticMode::Separate);
                } else {
                    assert_eq!(cfg.ppo.lambda, 0.5);
                    assert_eq!(cfg.focus, FocusConfig::default());
                }
            }
        }
    }
}
