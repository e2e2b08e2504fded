//! What a run reports: one [`StepMetrics`] line per RL step in
//! `metrics.jsonl` (appended and fsynced as each step ends, mirrored into
//! TensorBoard event files under `tb/`), and the run's [`Summary`].

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::Algo;
use crate::tensorboard::EventWriter;
use crate::TrainError;

/// Context management of a step's finished trajectories (bounded
/// contexts): per-trajectory means and counts of the ends it caused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContextMetrics {
    /// Compactions (summaries, workspace saves) per trajectory.
    pub compactions_per_episode: f64,
    /// Policy tokens spent on summaries per trajectory.
    pub summary_tokens_per_episode: f64,
    /// Context restarts per trajectory.
    pub resets_per_episode: f64,
    /// Task actions and tool calls after the first compaction, per
    /// trajectory (collapse shows as few).
    pub calls_after_compaction_per_episode: f64,
    /// Trajectories that ended on the first action after a compaction
    /// (the spec's failure mode: submitting right after compacting).
    pub ended_after_compaction: u64,
    /// Trajectories ended by a malformed or oversized summary, a missing
    /// workspace key, a full context without compaction, the compaction
    /// limit.
    pub malformed_summaries: u64,
    pub missing_keys: u64,
    pub overflows: u64,
    pub compaction_limit: u64,
    /// Share of summaries that carried the task's state (tasks that can
    /// tell; `None` when no summary was checked).
    pub summaries_kept_state: Option<f64>,
}

impl ContextMetrics {
    /// The metrics of `s`, summed over `episodes` finished trajectories.
    pub fn new(s: &arbor_env::context::ContextStats, episodes: u64) -> Self {
        let per = |x: u64| x as f64 / episodes.max(1) as f64;
        ContextMetrics {
            compactions_per_episode: per(s.compactions),
            summary_tokens_per_episode: per(s.summary_tokens),
            resets_per_episode: per(s.context_resets),
            calls_after_compaction_per_episode: per(s.calls_after_compaction),
            ended_after_compaction: s.ended_after_compaction,
            malformed_summaries: s.malformed_summaries,
            missing_keys: s.missing_keys,
            overflows: s.overflows,
            compaction_limit: s.compaction_limit,
            summaries_kept_state: (s.summaries_checked > 0)
                .then(|| s.summaries_kept_state as f64 / s.summaries_checked as f64),
        }
    }
}

/// One line of `metrics.jsonl`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// RL step, from 1.
    pub step: u64,
    /// Mean terminal reward of the step's finished trajectories.
    pub reward: f64,
    /// Share of those trajectories with reward >= 1.
    pub pass_rate: f64,
    /// Share of task groups whose rewards are not all equal (PS: of every
    /// group generated, first-pass and re-rollout).
    pub effective_group_fraction: f64,
    /// Groups in the update whose rewards are not all equal.
    #[serde(default)]
    pub effective_groups: usize,
    /// Episodes started (roots of the rollout tree).
    pub episodes: usize,
    /// Continuations launched (a GRPO sample, a FOCUS fork, a PS re-rollout).
    pub continuations: usize,
    /// Tokens sampled by the engine.
    pub generated_tokens: u64,
    /// Tokens of replayed prefixes (Prefix Sampling), not generated.
    pub replayed_tokens: u64,
    /// Prompt tokens whose KV the engine computed.
    pub prefill_computed: u64,
    /// Prompt tokens whose KV the prefix cache served.
    pub prefill_cached: u64,
    /// Tokens with a policy gradient in the update.
    pub trained_tokens: usize,
    /// Mean `k3` KL of the new policy from the sampling one.
    pub kl: f64,
    /// Share of trained tokens whose ratio was clipped.
    pub clip_fraction: f64,
    /// Mean `-logp` of the trained tokens.
    pub entropy: f64,
    /// Policy loss of the update.
    pub policy_loss: f64,
    /// Value loss of the update (0 without a critic).
    pub value_loss: f64,
    /// Spearman correlation of critic values and backed-up targets.
    pub critic_rank_corr: Option<f64>,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate of the step.
    pub lr: f64,
    /// Greedy pass rate on held-out tasks, on evaluation steps.
    pub eval_pass_rate: Option<f64>,
    /// Seconds in the engine.
    pub time_generate_s: f64,
    /// Seconds in environments (tool calls, graders, sandboxes).
    pub time_env_s: f64,
    /// Seconds in the update.
    pub time_train_s: f64,
    /// Of which in the gradient all-reduce over the data-parallel group (0
    /// on one rank).
    #[serde(default)]
    pub time_all_reduce_s: f64,
    /// Mean tool calls executed per trajectory that ended this step (a FOCUS
    /// tree has one trajectory per leaf; replayed prefixes' calls included;
    /// 0 for tasks without tools).
    #[serde(default)]
    pub tool_calls_per_episode: f64,
    /// Context management of the trajectories that ended this step (runs
    /// with `[harness] context_tokens`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<ContextMetrics>,
    /// The same for the greedy held-out episodes of this step's evaluation
    /// (evaluation steps of runs with a bounded context): how the policy
    /// compacts when it does not sample.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_context: Option<ContextMetrics>,
    /// The step's generated-token budget where one is enforced (the run's
    /// `budget = { tokens = N }` with what earlier steps carried over; PS
    /// with `ps.match_budget`: the GRPO baseline's).
    #[serde(default)]
    pub budget_tokens: Option<u64>,
    /// Wall seconds of the step's rollouts.
    #[serde(default)]
    pub time_rollout_s: f64,
    /// Seconds the engine had nothing to decode while episodes waited for
    /// their environments (env workers only).
    #[serde(default)]
    pub time_engine_idle_s: f64,
    /// The critic's own gradient norm and learning rate (`[critic]`).
    #[serde(default)]
    pub critic_grad_norm: Option<f64>,
    #[serde(default)]
    pub critic_lr: Option<f64>,
    /// Mean value loss of the last of the critic's extra passes
    /// (`[critic] epochs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub critic_pass_loss: Option<f64>,
    /// Explained variance of the critic against Monte-Carlo values on
    /// held-out states (evaluation steps; `[critic] heldout_tasks`).
    #[serde(default)]
    pub critic_heldout_ev: Option<f64>,
    /// Spearman correlation of the critic and those Monte-Carlo values.
    #[serde(default)]
    pub critic_heldout_rank_corr: Option<f64>,
    /// Held-out states scored.
    #[serde(default)]
    pub critic_heldout_states: Option<usize>,
    /// The best rank correlation any critic could show against those
    /// Monte-Carlo values, given their sampling noise: the split-half rank
    /// correlation `r` of the states' continuations (two halves of
    /// `heldout_samples / 2`), stepped up by Spearman-Brown to the whole
    /// estimate, `sqrt(f r / (1 + (f - 1) r))` with `f` the ratio of the
    /// estimate's samples to a half's. `None` below 2 samples or at `r <= 0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub critic_heldout_rank_ceiling: Option<f64>,
    /// FOCUS: mean depth of the launched continuations' states (root 0).
    #[serde(default)]
    pub alloc_mean_depth: Option<f64>,
    /// FOCUS: mean `n_eff = n + m` of those states before each launch.
    #[serde(default)]
    pub alloc_mean_n_eff: Option<f64>,
    /// FOCUS: share of generated tokens spent from states whose subtree
    /// ended all-0 or all-1 (>= 2 outcomes).
    #[serde(default)]
    pub alloc_settled_fraction: Option<f64>,
    /// FOCUS: launches by depth, by score `g / g_max` (tenths), by `n_eff`.
    #[serde(default)]
    pub alloc_by_depth: Option<Vec<u64>>,
    #[serde(default)]
    pub alloc_by_score: Option<Vec<u64>>,
    #[serde(default)]
    pub alloc_by_n_eff: Option<Vec<u64>>,
    /// Prefix Sampling: groups, re-rollouts, replays and the controller's
    /// buckets (`reward` and `pass_rate` above are the first pass's).
    #[serde(default)]
    pub ps: Option<crate::rollout::ps::PsReport>,
}

/// Every number in `v`, keyed by its path (`ps/reroll_groups`); arrays
/// are left out (histograms stay in `metrics.jsonl`).
fn flatten_scalars(prefix: &str, v: &serde_json::Value, out: &mut Vec<(String, f64)>) {
    match v {
        serde_json::Value::Object(o) => {
            for (k, x) in o {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}/{k}")
                };
                flatten_scalars(&key, x, out);
            }
        }
        x => {
            if let Some(f) = x.as_f64() {
                out.push((prefix.to_string(), f));
            }
        }
    }
}

/// What a finished run reports.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    pub algo: Algo,
    /// RL steps done.
    pub steps: u64,
    /// Last supervised warm-up NLL (when a warm-up ran).
    pub warmup_final_nll: Option<f64>,
    /// Greedy held-out pass rate before the first RL step.
    pub initial_eval_pass_rate: f64,
    /// The last evaluation's greedy held-out pass rate.
    pub final_eval_pass_rate: f64,
    /// Mean reward over the first three steps.
    pub first_reward: f64,
    /// Mean reward over the last three steps.
    pub last_reward: f64,
    /// Tokens generated over the run.
    pub generated_tokens: u64,
    /// Wall time of the RL steps.
    pub seconds: f64,
    pub out_dir: PathBuf,
    /// Context management of the evaluation before RL (bounded contexts).
    pub initial_eval_context: Option<ContextMetrics>,
}

impl Summary {
    /// The summary of the steps in `all` (every line of the run, resumed
    /// ones included).
    pub(crate) fn of(
        all: &[StepMetrics],
        algo: Algo,
        steps: u64,
        warmup_final_nll: Option<f64>,
        initial_eval: f64,
        seconds: f64,
        out_dir: &Path,
    ) -> Summary {
        let k = all.len().clamp(1, 3) as f64;
        let first = all.iter().take(3).map(|m| m.reward).sum::<f64>() / k;
        let last = all.iter().rev().take(3).map(|m| m.reward).sum::<f64>() / k;
        let final_eval = all
            .iter()
            .rev()
            .find_map(|m| m.eval_pass_rate)
            .unwrap_or(0.0);
        Summary {
            algo,
            steps,
            warmup_final_nll,
            initial_eval_pass_rate: initial_eval,
            final_eval_pass_rate: final_eval,
            first_reward: first,
            last_reward: last,
            generated_tokens: all.iter().map(|m| m.generated_tokens).sum(),
            seconds,
            out_dir: out_dir.to_path_buf(),
            initial_eval_context: None,
        }
    }

    /// With the context management of the evaluation before RL.
    pub(crate) fn with_initial_context(mut self, c: Option<ContextMetrics>) -> Self {
        self.initial_eval_context = c;
        self
    }
}

pub use arbor_rl::diagnostics::spearman;

/// A run's metrics on disk: `metrics.jsonl` and its TensorBoard mirror.
#[derive(Debug)]
pub(crate) struct MetricsLog {
    jsonl: PathBuf,
    tb_dir: PathBuf,
    /// Opened on the first line written, so a run that writes none leaves
    /// no event file.
    tb: Option<EventWriter>,
}

impl MetricsLog {
    pub(crate) fn new(out_dir: &Path) -> Self {
        MetricsLog {
            jsonl: out_dir.join("metrics.jsonl"),
            tb_dir: out_dir.join("tb"),
            tb: None,
        }
    }

    /// Every line written so far (by this run and the one it resumes).
    pub(crate) fn read(&self) -> Result<Vec<StepMetrics>, TrainError> {
        read_metrics(&self.jsonl)
    }

    /// Append `m` (fsynced) and mirror its scalars into TensorBoard.
    pub(crate) fn append(&mut self, m: &StepMetrics) -> Result<(), TrainError> {
        append_metrics(&self.jsonl, m)?;
        if self.tb.is_none() {
            self.tb = Some(EventWriter::create(&self.tb_dir)?);
        }
        let v = serde_json::to_value(m).map_err(|e| TrainError::Config(e.to_string()))?;
        let mut scalars: Vec<(String, f64)> = Vec::new();
        flatten_scalars("", &v, &mut scalars);
        scalars.retain(|(k, _)| k != "step");
        if let Some(w) = self.tb.as_mut() {
            w.scalars(m.step, &scalars)?;
        }
        Ok(())
    }

    /// A fresh run: no earlier lines.
    pub(crate) fn clear(&self) -> Result<(), TrainError> {
        match std::fs::remove_file(&self.jsonl) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(TrainError::Io(
                std::io::Error::new(e.kind(), format!("{}: {e}", self.jsonl.display())),
            )),
            _ => Ok(()),
        }
    }

    /// A resumed run: keep the lines up to the checkpoint's step.
    pub(crate) fn truncate(&self, upto: u64) -> Result<(), TrainError> {
        truncate_metrics(&self.jsonl, upto)
    }
}

fn append_metrics(path: &Path, m: &StepMetrics) -> Result<(), TrainError> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    let line = serde_json::to_string(m).map_err(|e| TrainError::Config(e.to_string()))?;
    writeln!(f, "{line}")?;
    f.sync_data()?;
    Ok(())
}

/// Every complete line of a metrics file (a torn last line is ignored).
pub fn read_metrics(path: &Path) -> Result<Vec<StepMetrics>, TrainError> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(Vec::new());
    };
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect())
}

/// Keep the lines of a metrics file up to step `upto` byte for byte (a
/// line is never re-serialised, so what a run printed is what stays; torn or
/// unreadable lines are dropped), replacing the file atomically (a kill in
/// the middle leaves the old file whole).
fn truncate_metrics(path: &Path, upto: u64) -> Result<(), TrainError> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    let mut kept = String::new();
    for line in text.lines() {
        if serde_json::from_str::<StepMetrics>(line).is_ok_and(|m| m.step <= upto) {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    if kept == text {
        return Ok(());
    }
    let tmp = path.with_extension("jsonl.tmp");
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(kept.as_bytes())?;
        f.sync_data()?;
    }
    std::fs::rename(&tmp, path)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A resumed run keeps the earlier metrics lines exactly as printed.
    /// 0.021660075508255654 is a value serde_json's default float parser
    /// reads one ulp off (0.021660075508255657): re-serialising the parsed
    /// metrics changed the file (seen on a Zen 2, whose numbers differ).
    #[test]
    fn truncate_keeps_lines_byte_for_byte() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let line = |step: u64, loss: &str| {
            let mut m = serde_json::to_value(StepMetrics {
                step,
                ..Default::default()
            })
            .unwrap();
            m["policy_loss"] = serde_json::Value::Null;
            serde_json::to_string(&m)
                .unwrap()
                .replace("\"policy_loss\":null", &format!("\"policy_loss\":{loss}"))
        };
        let l1 = line(1, "0.021660075508255654");
        let l2 = line(2, "2.6391587328232322e-14");
        let l3 = line(3, "0.5");
        std::fs::write(&path, format!("{l1}\n{l2}\n{l3}\n{{\"step\": 4, \"tor")).unwrap();
        truncate_metrics(&path, 2).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            format!("{l1}\n{l2}\n")
        );
        // The values themselves parse exactly (serde_json's float_roundtrip).
        let back = read_metrics(&path).unwrap();
        assert_eq!(back[0].policy_loss, 0.021660075508255654);
        assert_eq!(back[1].policy_loss, 2.6391587328232322e-14);
        // Nothing to drop: the file is left alone.
        truncate_metrics(&path, 9).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            format!("{l1}\n{l2}\n")
        );
    }
}
