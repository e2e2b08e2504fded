//! Checkpoints: `checkpoints/step-NNNNNNNN/` under the run directory, each
//! written atomically (a temporary directory, every file fsynced, one
//! rename), holding everything a resumed run needs to continue bit for bit:
//!
//! ```text
//! policy/               the policy as an HF checkpoint (merged, with LoRA)
//! policy_lora.safetensors   LoRA adapters (only with [model.lora])
//! critic.safetensors    the value head (and a separate critic's backbone)
//! optimizer.safetensors AdamW moments
//! trainer_state.json    TrainerState: step, task cursor, seeds, controllers
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use arbor_model::{Checkpoint, ModelConfig};
use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::config::TrainConfig;
use crate::learner::Learner;
use crate::optim::AdamWConfig;
use crate::rollout::PolicyState;
use crate::TrainError;

const CKPT_PREFIX: &str = "step-";

/// Resumable state besides the weights (`trainer_state.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct TrainerState {
    /// RL steps done.
    pub(crate) step: u64,
    /// Next training task index.
    pub(crate) cursor: u64,
    /// Sampling seed counter.
    pub(crate) seed_counter: u64,
    pub(crate) optimizer_step: u64,
    /// Optimizer steps of the critic's group where they differ from
    /// `optimizer_step` (its extra passes, `[critic] epochs`); absent: equal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) critic_optimizer_step: Option<u64>,
    pub(crate) warmup_nll: Vec<f64>,
    pub(crate) initial_eval: Option<f64>,
    /// The context management of that evaluation (bounded contexts).
    #[serde(default)]
    pub(crate) initial_eval_context: Option<crate::metrics::ContextMetrics>,
    /// Token budget left over (+) or overspent (-) by the steps so far.
    #[serde(default)]
    pub(crate) budget_carry: i64,
    /// The last step's generated tokens per task (token budgets).
    #[serde(default)]
    pub(crate) tokens_per_task: Option<f64>,
    /// Value targets of the last `[critic] replay_steps` steps, oldest
    /// first.
    #[serde(default, skip_serializing_if = "std::collections::VecDeque::is_empty")]
    pub(crate) critic_replay: std::collections::VecDeque<Vec<crate::learner::ValueRow>>,
}

/// `trainer_state.json` as written: the trainer's state and the rollout
/// policy's (Prefix Sampling's controller), side by side at the top level.
#[derive(Serialize)]
struct Saving<'a> {
    #[serde(flatten)]
    trainer: &'a TrainerState,
    #[serde(flatten)]
    policy: &'a PolicyState,
}

/// `trainer_state.json` as read back.
#[derive(Deserialize)]
struct Saved {
    #[serde(flatten)]
    trainer: TrainerState,
    #[serde(flatten)]
    policy: PolicyState,
}

impl TrainerState {
    /// The state of a fresh run with seed `seed`.
    pub(crate) fn fresh(seed: u64) -> Self {
        TrainerState {
            step: 0,
            cursor: 0,
            seed_counter: seed.wrapping_mul(7919),
            optimizer_step: 0,
            critic_optimizer_step: None,
            warmup_nll: Vec::new(),
            initial_eval: None,
            initial_eval_context: None,
            budget_carry: 0,
            tokens_per_task: None,
            critic_replay: Default::default(),
        }
    }
}

/// The newest complete checkpoint under `run_dir` (one with its
/// `trainer_state.json`, which is written last).
pub(crate) fn latest(run_dir: &Path) -> Option<(u64, PathBuf)> {
    let rd = std::fs::read_dir(run_dir.join("checkpoints")).ok()?;
    rd.filter_map(std::result::Result::ok)
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let n = name.strip_prefix(CKPT_PREFIX)?.parse::<u64>().ok()?;
            e.path()
                .join("trainer_state.json")
                .is_file()
                .then_some((n, e.path()))
        })
        .max_by_key(|(n, _)| *n)
}

fn save_tensors(map: HashMap<String, Tensor>, path: &Path) -> Result<(), TrainError> {
    candle_core::safetensors::save(&map, path)?;
    std::fs::File::open(path)?.sync_all()?;
    Ok(())
}

/// Write `checkpoints/step-N` under `run_dir` atomically and keep the
/// newest `keep_last` (at least 1). `opt`: the whole optimizer state
/// ([`crate::optim::AdamW::gathered_state`]).
pub(crate) fn write(
    run_dir: &Path,
    learner: &Learner,
    opt: HashMap<String, Tensor>,
    state: &TrainerState,
    policy: &PolicyState,
    lora: bool,
    keep_last: usize,
) -> Result<PathBuf, TrainError> {
    let root = run_dir.join("checkpoints");
    std::fs::create_dir_all(&root)?;
    let name = format!("{CKPT_PREFIX}{:08}", state.step);
    let tmp = root.join(format!(".{name}.tmp"));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)?;
    learner
        .model
        .policy
        .save_pretrained(&tmp.join("policy"), DType::F32)?;
    save_tensors(
        learner.critic_tensors().into_iter().collect(),
        &tmp.join("critic.safetensors"),
    )?;
    if lora {
        save_tensors(
            learner.policy_trainable_tensors().into_iter().collect(),
            &tmp.join("policy_lora.safetensors"),
        )?;
    }
    save_tensors(opt, &tmp.join("optimizer.safetensors"))?;
    let json = serde_json::to_vec_pretty(&Saving {
        trainer: state,
        policy,
    })
    .map_err(|e| TrainError::Checkpoint(e.to_string()))?;
    let sp = tmp.join("trainer_state.json");
    std::fs::write(&sp, json)?;
    std::fs::File::open(&sp)?.sync_all()?;
    let fin = root.join(&name);
    let _ = std::fs::remove_dir_all(&fin);
    std::fs::rename(&tmp, &fin)?;
    std::fs::File::open(&root)?.sync_all()?;
    // Keep the newest `keep_last`.
    let mut kept: Vec<(u64, PathBuf)> = std::fs::read_dir(&root)?
        .filter_map(std::result::Result::ok)
        .filter_map(|e| {
            let n = e
                .file_name()
                .to_string_lossy()
                .strip_prefix(CKPT_PREFIX)?
                .parse::<u64>()
                .ok()?;
            Some((n, e.path()))
        })
        .collect();
    kept.sort();
    let keep = keep_last.max(1);
    if kept.len() > keep {
        for (_, p) in &kept[..kept.len() - keep] {
            std::fs::remove_dir_all(p)?;
        }
    }
    Ok(fin)
}

/// The learner, trainer state and rollout-policy state saved in checkpoint
/// `dir`. With LoRA the
/// base is the original (frozen) model `hf_base` and the adapters come from
/// the checkpoint (`policy/` is the merged export).
pub(crate) fn restore(
    dir: &Path,
    cfg: &TrainConfig,
    mcfg: &ModelConfig,
    hf_base: Option<&Checkpoint>,
    dev: &Device,
    ocfg: AdamWConfig,
) -> Result<(Learner, TrainerState, PolicyState), TrainError> {
    let policy = Checkpoint::open(&[dir.join("policy/model.safetensors")])?;
    let critic = Checkpoint::open(&[dir.join("critic.safetensors")])?;
    let lora = cfg.model.lora.as_ref();
    let adapters = dir.join("policy_lora.safetensors");
    match (lora.is_some(), adapters.is_file()) {
        (true, false) => {
            return Err(TrainError::Checkpoint(format!(
                "{}: missing; the checkpoint was written without [model.lora]",
                adapters.display()
            )))
        }
        (false, true) => {
            return Err(TrainError::Checkpoint(format!(
                "{}: the checkpoint has LoRA adapters but the config has no [model.lora]",
                adapters.display()
            )))
        }
        _ => {}
    }
    let base = if lora.is_some() {
        hf_base
    } else {
        Some(&policy)
    };
    let mut learner = Learner::new(
        mcfg,
        base,
        Some(&critic),
        cfg.seed,
        dev,
        cfg.learner_config(),
        ocfg,
        lora,
    )?;
    if lora.is_some() {
        let t = candle_core::safetensors::load(&adapters, dev)
            .map_err(|e| TrainError::Checkpoint(format!("{}: {e}", adapters.display())))?;
        learner.load_policy_trainable(&t, &adapters.display().to_string())?;
    }
    let sp = dir.join("trainer_state.json");
    let text = std::fs::read_to_string(&sp)?;
    let saved: Saved = serde_json::from_str(&text)
        .map_err(|e| TrainError::Checkpoint(format!("{}: {e}", sp.display())))?;
    let mut opt = candle_core::safetensors::load(dir.join("optimizer.safetensors"), dev)?;
    // A critic parameter the checkpoint predates (the surprise weights of
    // `[critic] surprise`, switched on at the resume) starts as it would
    // in a fresh run: initialised by `Learner::new`, with zero moments.
    for (name, var) in learner.opt.vars() {
        let Some(own) = name.strip_prefix("critic.") else {
            continue;
        };
        if !critic.contains(own) {
            for m in ["m", "v"] {
                opt.entry(format!("{m}.{name}"))
                    .or_insert(var.as_tensor().zeros_like()?);
            }
        }
    }
    learner.opt.load_state(&opt, saved.trainer.optimizer_step)?;
    if let Some(n) = saved.trainer.critic_optimizer_step {
        learner.opt.set_group_steps(n);
    }
    Ok((learner, saved.trainer, saved.policy))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `trainer_state.json` keeps its keys at the top level (the policy's
    /// state is flattened in), so checkpoints read the same as before the
    /// policy state had a type of its own.
    #[test]
    fn trainer_state_json_is_flat() {
        let s = TrainerState::fresh(3);
        let v = serde_json::to_value(Saving {
            trainer: &s,
            policy: &PolicyState::default(),
        })
        .unwrap();
        let keys: Vec<&str> = v
            .as_object()
            .unwrap()
            .keys()
            .map(std::string::String::as_str)
            .collect();
        assert!(
            keys.contains(&"ps_buckets") && keys.contains(&"seed_counter"),
            "{keys:?}"
        );
        let old = r#"{"step":2,"cursor":32,"seed_counter":9,"optimizer_step":2,
                     "warmup_nll":[],"initial_eval":0.5}"#;
        let back: Saved = serde_json::from_str(old).unwrap();
        assert_eq!((back.trainer.step, back.trainer.cursor), (2, 32));
        assert!(back.policy.ps_buckets.is_empty());
    }
}
