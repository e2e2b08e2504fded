//! Data-parallel training on CPU threads: two ranks, each with its own
//! engine and learner and half of every step's tasks, end a GRPO run with
//! the weights, losses and rewards of one rank doing all the work (up to
//! f32 round-off: gradients are summed in a different order), and a rank
//! that fails stops the others with an error instead of a hang.

use std::time::Duration;

use arbor_train::dist::{Collective, Single, ThreadGroup};
use arbor_train::{StepMetrics, TrainConfig, Trainer};

const CONFIG: &str = r#"
seed = 3
steps = 3
algo = "grpo"
prompts_per_step = 6
samples_per_prompt = 4
eval_every = 3
eval_tasks = 8
checkpoint_every = 0

[task]
kind = "running_sum"
difficulty = 3

[warmup]
steps = 300
batch = 16
stop_at_eval = 0.4
check_every = 20

[learner]
critic = "shared"
"#;

/// One rank's run: its metrics and its final policy weights (name, values).
type RankRun = (Vec<StepMetrics>, Vec<(String, Vec<f32>)>);

fn run_rank(cfg: &str, group: Box<dyn Collective>) -> Result<RankRun, String> {
    let dir = tempfile::tempdir().unwrap();
    let cfg = TrainConfig::from_toml(cfg, "test").unwrap();
    let mut t = Trainer::open(cfg, dir.path(), false, group).map_err(|e| e.to_string())?;
    t.warmup(|_, _| {}).map_err(|e| e.to_string())?;
    let mut ms = Vec::new();
    t.run(|m| ms.push(m.clone())).map_err(|e| e.to_string())?;
    Ok((ms, weights(&t)))
}

/// The trainer's trainable weights (name, values).
fn weights(t: &Trainer) -> Vec<(String, Vec<f32>)> {
    t.learner
        .opt
        .vars()
        .iter()
        .map(|(n, v)| {
            let x = v.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
            (n.clone(), x)
        })
        .collect()
}

fn run_world(cfg: &str, world: usize) -> Vec<Result<RankRun, String>> {
    let ranks = ThreadGroup::new(world, Duration::from_secs(120));
    std::thread::scope(|s| {
        let hs: Vec<_> = ranks
            .into_iter()
            .map(|g| s.spawn(move || run_rank(cfg, Box::new(g))))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Two ranks against one, under each loss aggregation (the per-token
/// weights of a rank's share are rescaled to the whole step's).
#[test]
fn two_ranks_train_like_one() {
    for agg in [
        "token_mean",
        "sequence_mean",
        "{ token_sum = { normalizer = 64.0 } }",
    ] {
        let value = if agg.starts_with('{') {
            agg.to_string()
        } else {
            format!("\"{agg}\"")
        };
        let cfg = format!(
            "{CONFIG}\n[learner.policy]\neps_low = 0.2\neps_high = 0.28\naggregation = {value}\n"
        );
        two_ranks_match_one(&cfg, 24, Some(24));
    }
}

/// PPO splits the tasks as GRPO does; FOCUS allocates one budget over the
/// whole group's forest and VinePPO samples from every main trajectory's
/// states, each rank running its own tasks' continuations: all three train
/// on two ranks as on one.
#[test]
fn ppo_vineppo_and_focus_on_two_ranks_train_like_one() {
    let ppo = CONFIG.replace("algo = \"grpo\"", "algo = \"ppo\"");
    two_ranks_match_one(&ppo, 24, Some(24));
    let vine = CONFIG.replace("algo = \"grpo\"", "algo = \"vineppo\"");
    two_ranks_match_one(&vine, 6, None);
    // FOCUS with its own critic (started from the policy), a budget of 24
    // continuations over 6 roots, and extra critic passes.
    let focus = CONFIG
        .replace("algo = \"grpo\"", "algo = \"focus\"")
        .replace("[learner]\ncritic = \"shared\"\n", "")
        + "\n[focus]\nworker_capacity = 8\n\n[critic]\nepochs = 1\nminibatches = 2\n";
    two_ranks_match_one(&focus, 6, Some(24));
    // One task: rank 1 owns none and still takes part in every exchange.
    let one_task = focus.replace("prompts_per_step = 6", "prompts_per_step = 1");
    two_ranks_match_one(&one_task, 1, Some(4));
}

/// Prefix Sampling judges every group on every rank: the same re-rollout
/// groups, cuts, retries and controller state on two ranks as on one, with
/// each rank replaying (through execution) and running its own tasks'
/// prefixes; also with probes, two sources per skewed group, snapshot
/// replays and cuts placed by the pass estimate.
#[test]
fn prefix_sampling_on_two_ranks_trains_like_one() {
    let ps = CONFIG.replace("algo = \"grpo\"", "algo = \"ps\"");
    // More groups, so that probes agree and cuts are bisected.
    let probes = format!("{ps}\n[ps]\nprobe = 2\nsources = 2\nanchor = true\n")
        .replace("prompts_per_step = 6", "prompts_per_step = 8");
    let snapshot = format!("{ps}\n[ps]\nreplay = \"snapshot\"\nkeep_skewed = false\n");
    // Cuts and sources placed by the pass estimates of the gathered
    // first-pass logprobs.
    let estimate = format!("{ps}\n[ps]\ncut_rule = \"estimate\"\nsources = 2\n");
    let sum = |f: fn(&arbor_train::rollout::ps::PsReport) -> usize, ms: &[StepMetrics]| {
        ms.iter().map(|m| f(m.ps.as_ref().unwrap())).sum::<usize>()
    };
    let a = two_ranks_match_one(&ps, 16, None);
    let b = two_ranks_match_one(&probes, 24, None);
    let c = two_ranks_match_one(&snapshot, 16, None);
    let d = two_ranks_match_one(&estimate, 16, None);
    // The runs replayed prefixes, and the probes' runs bisected cuts.
    for ms in [&a, &b, &c, &d] {
        assert!(sum(|r| r.reroll_groups, ms) > 0);
    }
    assert!(sum(|r| r.reroll_retries + r.probes_agreed, &b) > 0);
}

/// `episodes`: the trees (GRPO and PPO: one per rollout) a step grows;
/// `continuations`: the rollouts it runs, where fixed.
fn two_ranks_match_one(
    cfg: &str,
    episodes: usize,
    continuations: Option<usize>,
) -> Vec<StepMetrics> {
    let (one_ms, one_w) = run_rank(cfg, Box::new(Single)).unwrap();
    let two = run_world(cfg, 2);
    let runs: Vec<RankRun> = two.into_iter().map(Result::unwrap).collect();
    // The run trains: tokens with gradients at every step, and its
    // episodes split between the ranks.
    assert_eq!(one_ms.len(), 3);
    for m in &one_ms {
        assert!(m.trained_tokens > 0 && m.grad_norm > 0.0, "{m:?}");
        assert_eq!(m.episodes, episodes);
        assert!(continuations.is_none_or(|c| c == m.continuations), "{m:?}");
    }
    for (ms, w) in &runs {
        assert_eq!(ms.len(), one_ms.len());
        for (a, b) in ms.iter().zip(&one_ms) {
            // Sampling follows the global launch order: the same rollouts.
            assert_eq!(a.generated_tokens, b.generated_tokens, "step {}", a.step);
            assert_eq!(a.episodes, b.episodes);
            assert_eq!(a.trained_tokens, b.trained_tokens);
            assert!((a.reward - b.reward).abs() < 1e-12, "{a:?}\n{b:?}");
            assert_eq!(a.effective_groups, b.effective_groups);
            // The all-reduce is timed on several ranks, absent on one.
            assert!(a.time_all_reduce_s > 0.0 && b.time_all_reduce_s == 0.0);
            assert!((a.policy_loss - b.policy_loss).abs() < 1e-5, "{a:?}\n{b:?}");
            assert!(
                (a.grad_norm - b.grad_norm).abs() < 1e-4 * b.grad_norm.max(1.0),
                "{a:?}\n{b:?}"
            );
            assert_eq!(a.eval_pass_rate, b.eval_pass_rate);
            // The same re-rollouts (PS), allocation (FOCUS) and critic fit.
            assert_eq!(a.ps, b.ps, "step {}", a.step);
            assert_eq!(a.continuations, b.continuations);
            assert_eq!(a.alloc_by_depth, b.alloc_by_depth);
            assert_eq!(a.alloc_mean_depth, b.alloc_mean_depth);
            assert_eq!(a.critic_rank_corr, b.critic_rank_corr);
            assert!((a.value_loss - b.value_loss).abs() < 1e-5, "{a:?}\n{b:?}");
            for (x, y) in [
                (a.critic_grad_norm, b.critic_grad_norm),
                (a.critic_pass_loss, b.critic_pass_loss),
            ] {
                assert_eq!(x.is_some(), y.is_some());
                let (x, y) = (x.unwrap_or(0.0), y.unwrap_or(0.0));
                assert!((x - y).abs() < 1e-4 * y.abs().max(1.0), "{a:?}\n{b:?}");
            }
        }
        assert_eq!(w.len(), one_w.len());
        let worst = w
            .iter()
            .zip(&one_w)
            .flat_map(|((n, x), (m, y))| {
                assert_eq!(n, m);
                x.iter().zip(y).map(|(a, b)| (a - b).abs())
            })
            .fold(0.0f32, f32::max);
        eprintln!("largest weight difference from one rank: {worst:e}");
        assert!(worst < 1e-5, "weights differ by {worst}");
    }
    // Both ranks hold bit-identical weights (they apply the same summed
    // gradients).
    assert_eq!(runs[0].1, runs[1].1);
    one_ms
}

/// The weight check names a rank whose weights drifted.
#[test]
fn drifted_weights_are_caught() {
    let ranks = ThreadGroup::new(2, Duration::from_secs(60));
    let errs: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = ranks
            .into_iter()
            .map(|g| {
                s.spawn(move || {
                    let dir = tempfile::tempdir().unwrap();
                    let cfg = TrainConfig::from_toml(CONFIG, "test").unwrap();
                    let rank = g.rank();
                    let mut t = Trainer::open(cfg, dir.path(), false, Box::new(g)).unwrap();
                    t.check_weights_agree().unwrap();
                    if rank == 1 {
                        let (_, v) = &t.learner.opt.vars()[0];
                        let bumped = (v.as_tensor() + 1e-3).unwrap();
                        v.set(&bumped).unwrap();
                    }
                    t.check_weights_agree().unwrap_err().to_string()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in errs {
        assert!(e.contains("rank 1's weights differ"), "{e}");
    }
}

#[test]
fn a_failed_rank_stops_the_others() {
    let t0 = std::time::Instant::now();
    let mut ranks = ThreadGroup::new(2, Duration::from_secs(120));
    let r1 = ranks.pop().unwrap();
    let r0 = ranks.pop().unwrap();
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(move || run_rank(CONFIG, Box::new(r0)));
        // Rank 1 fails at its first step: a config the trainer refuses
        // would fail before training; instead it stops right away by
        // leaving the group.
        let b = s.spawn(move || {
            drop(r1);
            Err::<RankRun, String>("rank 1 failed".into())
        });
        (a.join().unwrap(), b.join().unwrap())
    });
    assert!(b.is_err());
    let e = a.unwrap_err();
    assert!(e.contains("rank 1"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(60));
}

/// One rank's run in `dir`: its metrics (without wall-clock fields) and
/// its final trainable weights.
fn run_rank_in(
    cfg: &str,
    group: Box<dyn Collective>,
    dir: &std::path::Path,
) -> (Vec<serde_json::Value>, Vec<(String, Vec<f32>)>) {
    let cfg = TrainConfig::from_toml(cfg, "test").unwrap();
    let sharded = cfg.optimizer.shard_state;
    let mut t = Trainer::open(cfg, dir, false, group).unwrap();
    t.warmup(|_, _| {}).unwrap();
    let mut ms = Vec::new();
    t.run(|m| {
        let mut v = serde_json::to_value(m).unwrap();
        v.as_object_mut()
            .unwrap()
            .retain(|k, _| !k.starts_with("time_"));
        ms.push(v);
    })
    .unwrap();
    // Sharded, a rank keeps only its share of the moments.
    assert_eq!(t.learner.opt.is_sharded(), sharded);
    let kept = t.learner.opt.state().0.len();
    let all = 2 * t.learner.opt.vars().len();
    assert!(
        if sharded { kept < all } else { kept == all },
        "{kept} of {all}"
    );
    (ms, weights(&t))
}

/// ZeRO-1 (`[optimizer] shard_state`): each of two ranks updates its own
/// share of the parameters and keeps only those moments, and the run is
/// the plain data-parallel run bit for bit: the same metrics, the same
/// weights on every rank, and a checkpoint holding the whole optimizer
/// state, equal to the plain run's.
#[test]
fn sharded_optimizer_state_trains_like_the_whole() {
    let plain = CONFIG.replace("checkpoint_every = 0", "checkpoint_every = 3");
    let sharded = format!("{plain}\n[optimizer]\nshard_state = true\n");
    let run = |cfg: &str| {
        let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
        let ranks = ThreadGroup::new(2, Duration::from_secs(120));
        let runs: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = ranks
                .into_iter()
                .zip(&dirs)
                .map(|(g, d)| s.spawn(move || run_rank_in(cfg, Box::new(g), d.path())))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let ckpt = dirs[0]
            .path()
            .join("checkpoints/step-00000003/optimizer.safetensors");
        let opt = candle_core::safetensors::load(&ckpt, &candle_core::Device::Cpu).unwrap();
        (runs, opt)
    };
    let (a, opt_a) = run(&plain);
    let (b, opt_b) = run(&sharded);
    assert_eq!(a[0].0, b[0].0, "metrics differ");
    for r in 0..2 {
        assert_eq!(a[r].1, b[r].1, "rank {r}'s weights differ");
    }
    assert_eq!(b[0].1, b[1].1);
    let mut keys: Vec<&String> = opt_a.keys().collect();
    keys.sort();
    let mut keys_b: Vec<&String> = opt_b.keys().collect();
    keys_b.sort();
    assert_eq!(keys, keys_b);
    for k in keys {
        let x: Vec<f32> = opt_a[k].flatten_all().unwrap().to_vec1().unwrap();
        let y: Vec<f32> = opt_b[k].flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(x, y, "optimizer state `{k}` differs");
    }
}
