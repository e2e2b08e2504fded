//! Training under a bounded context: the policy's compaction summaries are
//! context-management segments the update trains, every compaction restarts
//! the context and is a tree state FOCUS forks from and backs values up
//! through, and no sequence the policy saw or the learner trains on is
//! longer than the context.

use arbor_engine::{Engine, EngineConfig};
use arbor_rl::TokenKind;
use arbor_train::rollout::{policy_for, StepContext};
use arbor_train::tasks::TaskSampler;
use arbor_train::{read_metrics, StepMetrics, TrainConfig, Trainer};

const CONTEXT: usize = 16;

fn config(algo: &str, compaction: &str) -> String {
    let critic = if algo == "focus" {
        "separate"
    } else {
        "shared"
    };
    format!(
        r#"
seed = 3
steps = 3
algo = "{algo}"
prompts_per_step = 4
samples_per_prompt = 3
eval_every = 3
eval_tasks = 8
checkpoint_every = 0

[task]
kind = "running_sum"
difficulty = 8

[harness]
context_tokens = {CONTEXT}
compaction = "{compaction}"

[warmup]
steps = 150
batch = 16
lr = 3e-3

[learner]
critic = "{critic}"
"#
    )
}

fn train(toml: &str) -> (Trainer, Vec<StepMetrics>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = TrainConfig::from_toml(toml, "test").unwrap();
    let mut t = Trainer::new(cfg, dir.path(), false).unwrap();
    t.warmup(|_, _| {}).unwrap();
    t.run(|_| {}).unwrap();
    let ms = read_metrics(&dir.path().join("metrics.jsonl")).unwrap();
    (t, ms, dir)
}

/// FOCUS's tree through compactions: restart states, summaries trained as
/// context management, contexts and loss rows within the bound, critic
/// targets at restart states.
#[test]
fn focus_forks_and_credits_through_compactions() {
    let toml = config("focus", "free_form");
    let (t, ms, _dir) = train(&toml);
    let cfg = t.cfg.clone();
    let sampler =
        TaskSampler::with_harness(cfg.task.clone(), 99, None, Vec::new(), cfg.harness).unwrap();
    let mut engine = Engine::new(
        &t.learner.model.policy,
        None,
        EngineConfig {
            kv_memory_mib: 16,
            ..Default::default()
        },
    )
    .unwrap();
    let rollout = sampler.rollout_config(1.0);
    let tasks = (0..4).map(|i| sampler.train_task(i).unwrap()).collect();
    let mut seed = 5;
    let r = policy_for(&cfg)
        .rollouts(
            StepContext {
                engine: &mut engine,
                learner: &t.learner,
                rollout: &rollout,
                seed: &mut seed,
                step: 1,
                env_workers: 0,
                budget_tokens: None,
                group: &mut arbor_train::dist::Single,
                owned: 0..4,
            },
            tasks,
        )
        .unwrap();
    let tree = &r.tree;
    tree.validate().unwrap();
    let mut restarts = 0;
    let mut forked_after_restart = 0;
    let mut summary_tokens = 0;
    for (id, n) in tree.nodes() {
        let ctx = tree.context_tokens(id).unwrap();
        assert_eq!(ctx.len(), n.context_len());
        assert!(ctx.len() <= CONTEXT, "{id}: context of {}", ctx.len());
        if let Some(seg) = n.segment() {
            summary_tokens += seg
                .kinds
                .iter()
                .filter(|k| **k == TokenKind::ContextManagement)
                .count();
        }
        if n.is_restart() {
            restarts += 1;
            // The segment that restarts the context is the summary, also
            // when a continuation forked at the summary request wrote it.
            let seg = n.segment().expect("a restart has a segment");
            assert!(
                seg.kinds
                    .iter()
                    .filter(|k| k.is_trained())
                    .all(|k| *k == TokenKind::ContextManagement),
                "{id}: a summary trained as an action"
            );
            // Below a restart the context starts with the task again.
            assert_eq!(ctx[..2], tree.episodes()[n.episode()].prompt[..2]);
            if n.children().len() > 1 {
                forked_after_restart += 1;
            }
        }
    }
    assert!(restarts > 0 && summary_tokens > 0);
    assert!(
        forked_after_restart > 0,
        "FOCUS launched no continuation from a post-compaction state"
    );
    // Every trained token of the tree is in exactly one loss row (FOCUS
    // trains each edge once), and no row is longer than the context.
    let trained: usize = tree
        .nodes()
        .filter_map(|(_, n)| n.segment())
        .map(arbor_rl::Segment::generated_tokens)
        .sum();
    let masked: f32 = r.rows.iter().map(|x| x.mask.iter().sum::<f32>()).sum();
    assert_eq!(masked as usize, trained);
    assert!(r.rows.iter().all(|x| x.tokens.len() <= CONTEXT));
    assert!(
        r.rows.len() > tree.leaves().len(),
        "one row per context window"
    );
    // The run's metrics count what happened.
    let c = ms.last().unwrap().context.clone().expect("context metrics");
    assert!(c.compactions_per_episode > 0.0 && c.resets_per_episode > 0.0);
    assert!(c.calls_after_compaction_per_episode > 0.0);
    assert!(c.summaries_kept_state.is_some());
    // Evaluation steps also report how the greedy policy compacts.
    let e = ms
        .last()
        .unwrap()
        .eval_context
        .clone()
        .expect("eval context");
    assert!(e.compactions_per_episode > 0.0 && e.summaries_kept_state.is_some());
    assert!(ms[0].eval_context.is_none(), "not an evaluation step");
}

/// Every compaction variant, GRPO and Prefix Sampling (whose replays cross
/// compactions) run end to end; without compaction
/// every episode overflows and ends with reward 0.
#[test]
fn every_variant_runs_and_none_overflows() {
    for (algo, mode) in [
        ("grpo", "structured"),
        ("grpo", "workspace"),
        ("ps", "free_form"),
        ("focus", "none"),
    ] {
        let (_, ms, _dir) = train(&config(algo, mode));
        assert_eq!(ms.len(), 3, "{algo} {mode}");
        let c = ms[0].context.clone().unwrap();
        if mode == "none" {
            assert!(ms.iter().all(|m| m.reward == 0.0));
            assert!(c.overflows > 0 && c.compactions_per_episode == 0.0);
        } else {
            assert!(c.compactions_per_episode > 0.0, "{mode}: {c:?}");
        }
    }
}

/// Bad `[harness]` settings name their key.
#[test]
fn harness_keys_are_checked() {
    let bad = config("grpo", "free_form").replace("context_tokens = 16\n", "");
    let e = TrainConfig::from_toml(&bad, "cfg.toml").unwrap_err();
    assert!(e.to_string().contains("harness.compaction"), "{e}");
    let bad = config("grpo", "sideways");
    let e = TrainConfig::from_toml(&bad, "cfg.toml").unwrap_err();
    assert!(e.to_string().contains("sideways"), "{e}");
    // A context too small for the task's first turn.
    let tiny = config("grpo", "none").replace("context_tokens = 16", "context_tokens = 5");
    let cfg = TrainConfig::from_toml(&tiny, "cfg.toml").unwrap();
    let e = Trainer::new(cfg, tempfile::tempdir().unwrap().path(), false)
        .and_then(|mut t| t.warmup(|_, _| {}))
        .unwrap_err();
    assert!(
        e.to_string().contains("harness.context_tokens") || e.to_string().contains("reserve"),
        "{e}"
    );
}

/// An episode asked for a compaction summary says so, and so does a fork of
/// it: a continuation forked at that state (FOCUS, VinePPO) trains its first
/// segment as context management, as the unforked episode would.
#[test]
fn a_fork_at_a_summary_request_knows_what_is_asked() {
    let cfg = TrainConfig::from_toml(&config("grpo", "free_form"), "test").unwrap();
    let sampler =
        TaskSampler::with_harness(cfg.task.clone(), 99, None, Vec::new(), cfg.harness).unwrap();
    let mut ep = sampler.train_task(0).unwrap().episode;
    assert_eq!(ep.next_kind(), TokenKind::Action);
    let answer = [0, arbor_env::vocab::EOS];
    let mut asked = false;
    for _ in 0..16 {
        let out = ep.step(&answer).unwrap();
        assert_eq!(ep.next_kind(), out.next);
        if out.reward.is_some() {
            break;
        }
        if out.next == TokenKind::ContextManagement {
            asked = true;
            assert_eq!(ep.fork().unwrap().next_kind(), TokenKind::ContextManagement);
            let summary = ep.step(&answer).unwrap();
            assert!(summary.restart);
            assert_eq!(ep.next_kind(), TokenKind::Action);
            break;
        }
    }
    assert!(asked, "the context never filled");
}
