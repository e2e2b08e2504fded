//! The learner: policy and critic parameters, and the masked PPO / value
//! update from [`arbor_rl::credit::LossRow`]s.
//!
//! Loss values and their gradients with respect to the per-token
//! log-probabilities and values come from `arbor_rl::ppo` (the CPU
//! reference); the parameter gradient is obtained by back-propagating the
//! surrogate `sum_t (dL/dlogp_t) logp_t + c_v sum_s (dL/dV_s) V_s` with the
//! coefficients held constant, which has exactly the gradient of `L`.
//! Only tokens with mask 1 (policy actions and context-management tokens)
//! enter the policy term: observations, prompts and replayed prefixes get
//! zero gradient by construction.

use arbor_model::logprobs::token_logprobs;
use arbor_model::{ActorCritic, CriticMode, ModelConfig, ParamLoader, ParamSource};
use arbor_rl::credit::LossRow;
use arbor_rl::ppo::{policy_loss, value_loss, Aggregation, PolicyLossConfig, TokenBatch};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use serde::{Deserialize, Serialize};

use crate::optim::{AdamW, AdamWConfig, GradAccum, StepStats};
use crate::TrainError;

/// Margin keeping critic values strictly inside (0, 1) for FOCUS.
pub const VALUE_EPS: f64 = 0.01;

/// Update settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LearnerConfig {
    /// The clipped policy loss (`[learner.policy]`). The learner averages
    /// it over the step's trained tokens, so `aggregation` must be
    /// `token_mean` (checked on load).
    pub policy: PolicyLossConfig,
    /// Weight of the value loss.
    pub value_coef: f64,
    /// Micro-batch size in padded tokens (rows are packed greedily).
    pub micro_batch_tokens: usize,
    /// Passes over the step's rows (each pass: one optimizer step).
    pub epochs: usize,
    /// `shared`: the value head reads the policy's hidden state; `separate`:
    /// the critic has its own backbone (FOCUS and PPO only).
    pub critic: CriticMode,
}

impl Default for LearnerConfig {
    fn default() -> Self {
        LearnerConfig {
            policy: PolicyLossConfig::default(),
            value_coef: 0.5,
            micro_batch_tokens: 4096,
            epochs: 1,
            critic: CriticMode::Shared,
        }
    }
}

/// What one update did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct UpdateStats {
    pub policy_loss: f64,
    pub value_loss: f64,
    pub clip_fraction: f64,
    /// Mean `k3(old || new)` over trained tokens.
    pub approx_kl: f64,
    /// Mean `-logp_new` of the trained tokens (a sampled-entropy estimate).
    pub entropy: f64,
    pub trained_tokens: usize,
    pub value_targets: usize,
    pub grad_norm: f64,
    pub lr: f64,
}

/// Policy + critic with their optimizer.
pub struct Learner {
    pub model: ActorCritic,
    pub policy_vars: VarMap,
    pub critic_vars: VarMap,
    pub opt: AdamW,
    pub cfg: LearnerConfig,
}

impl Learner {
    /// The critic's own tensors under their names (for checkpoints).
    pub fn critic_tensors(&self) -> Vec<(String, Tensor)> {
        named_vars(&self.critic_vars, "")
            .into_iter()
            .map(|(n, v)| (n, v.as_tensor().clone()))
            .collect()
    }

    /// The policy's trainable tensors (with LoRA: the adapters and any value
    /// head; the frozen base is not among them).
    pub fn policy_trainable_tensors(&self) -> Vec<(String, Tensor)> {
        named_vars(&self.policy_vars, "")
            .into_iter()
            .map(|(n, v)| (n, v.as_tensor().clone()))
            .collect()
    }

    /// Set the policy's trainable tensors from a checkpoint; every one must
    /// be present with its shape.
    pub fn load_policy_trainable(
        &self,
        t: &std::collections::HashMap<String, Tensor>,
        origin: &str,
    ) -> Result<(), TrainError> {
        for (name, var) in named_vars(&self.policy_vars, "") {
            let v = t.get(&name).ok_or_else(|| {
                TrainError::Checkpoint(format!("{origin}: tensor `{name}` missing"))
            })?;
            if v.dims() != var.dims() {
                return Err(TrainError::Checkpoint(format!(
                    "{origin}: tensor `{name}` is {:?}, the model needs {:?}",
                    v.dims(),
                    var.dims()
                )));
            }
            var.set(&v.to_dtype(var.dtype())?)?;
        }
        Ok(())
    }
}

impl std::fmt::Debug for Learner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Learner")
            .field("critic", &self.model.mode())
            .field("parameters", &self.opt.vars().len())
            .finish()
    }
}

/// Named variables of a var map, sorted by name.
pub fn named_vars(vm: &VarMap, prefix: &str) -> Vec<(String, Var)> {
    let data = vm.data().lock().expect("var map lock");
    let mut v: Vec<(String, Var)> = data
        .iter()
        .map(|(k, v)| (format!("{prefix}{k}"), v.clone()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Per-row layout of one micro-batch.
struct Packed {
    ids: Tensor,
    t: usize,
    /// Flat `b * T + (i - 1)` rows of the hidden states whose logits give token `i`.
    lp_rows: Vec<u32>,
    lp_targets: Vec<u32>,
    old_lp: Vec<f64>,
    adv: Vec<f64>,
    /// Flat `b * T + pos` and targets of value regression.
    v_rows: Vec<u32>,
    v_targets: Vec<f64>,
}

fn pack(rows: &[&LossRow], dev: &Device) -> Result<Packed, TrainError> {
    let t = rows
        .iter()
        .map(|r| r.tokens.len())
        .max()
        .unwrap_or(1)
        .max(1);
    let mut ids = vec![0u32; rows.len() * t];
    let mut p = Packed {
        ids: Tensor::zeros(1, DType::U32, dev)?,
        t,
        lp_rows: Vec::new(),
        lp_targets: Vec::new(),
        old_lp: Vec::new(),
        adv: Vec::new(),
        v_rows: Vec::new(),
        v_targets: Vec::new(),
    };
    for (b, r) in rows.iter().enumerate() {
        ids[b * t..b * t + r.tokens.len()].copy_from_slice(&r.tokens);
        for i in 1..r.tokens.len() {
            if r.mask[i] > 0.0 {
                p.lp_rows.push((b * t + i - 1) as u32);
                p.lp_targets.push(r.tokens[i]);
                p.old_lp.push(r.behaviour_logprobs[i] as f64);
                p.adv.push(r.advantages[i] as f64);
            }
        }
        for &(pos, target) in &r.value_targets {
            p.v_rows.push((b * t + pos) as u32);
            p.v_targets.push(target as f64);
        }
    }
    p.ids = Tensor::from_vec(ids, (rows.len(), t), dev)?;
    Ok(p)
}

/// Split rows into micro-batches of at most `budget` padded tokens.
fn micro_batches(rows: &[LossRow], budget: usize) -> Vec<Vec<&LossRow>> {
    let mut out: Vec<Vec<&LossRow>> = Vec::new();
    let mut cur: Vec<&LossRow> = Vec::new();
    let mut max_len = 0;
    for r in rows {
        let m = max_len.max(r.tokens.len());
        if !cur.is_empty() && m * (cur.len() + 1) > budget {
            out.push(std::mem::take(&mut cur));
            max_len = 0;
        }
        max_len = max_len.max(r.tokens.len());
        cur.push(r);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

impl Learner {
    /// Build from a model config and a parameter source (checkpoint or
    /// random init), f32 on `device`.
    /// `policy` holds the policy weights (HF names); `critic` the critic's
    /// own tensors (`value_head.*`, and `model.*` of a separate backbone).
    /// Without `critic`, a separate backbone starts from the policy weights
    /// and the value head is initialised.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: &ModelConfig,
        policy: Option<&arbor_model::Checkpoint>,
        critic: Option<&arbor_model::Checkpoint>,
        seed: u64,
        device: &Device,
        lcfg: LearnerConfig,
        ocfg: AdamWConfig,
        lora: Option<&arbor_model::LoraConfig>,
    ) -> Result<Self, TrainError> {
        let (pv, cv) = (VarMap::new(), VarMap::new());
        fn source(c: Option<&arbor_model::Checkpoint>, seed: u64) -> ParamSource<'_> {
            match c {
                Some(c) => ParamSource::Checkpoint(c),
                None => ParamSource::Random { seed },
            }
        }
        let mut pl = ParamLoader::trainable(source(policy, seed), DType::F32, device, pv.clone());
        if let Some(l) = lora {
            // Frozen base, trainable adapters (and value head).
            pl = pl.with_lora(l.clone());
        }
        let cl = ParamLoader::trainable(
            source(critic.or(policy), seed ^ 0xC817),
            DType::F32,
            device,
            cv.clone(),
        );
        let model = ActorCritic::load(cfg, lcfg.critic, &pl, &cl)?;
        let mut vars = named_vars(&pv, "policy.");
        vars.extend(named_vars(&cv, "critic."));
        let opt = AdamW::new(vars, ocfg)?;
        Ok(Learner {
            model,
            policy_vars: pv,
            critic_vars: cv,
            opt,
            cfg: lcfg,
        })
    }

    fn device(&self) -> Device {
        self.model.policy.device().clone()
    }

    /// Critic values `V(s)` at the last token of each context (no gradient),
    /// clamped into `[VALUE_EPS, 1 - VALUE_EPS]`: FOCUS's Beta prior
    /// `Beta(kappa v, kappa (1 - v))` is improper at `v = 0` or `1`, where its
    /// gain `g` would vanish and the node could never be sampled again
    /// (project choice).
    pub fn values_at(
        &self,
        seqs: &[Vec<u32>],
        positions: &[Vec<usize>],
    ) -> Result<Vec<Vec<f64>>, TrainError> {
        arbor_ops::in_pool(&self.device(), || self.values_here(seqs, positions))
    }

    /// [`Learner::values_at`] on the calling thread.
    fn values_here(
        &self,
        seqs: &[Vec<u32>],
        positions: &[Vec<usize>],
    ) -> Result<Vec<Vec<f64>>, TrainError> {
        let dev = self.device();
        let mut out = Vec::with_capacity(seqs.len());
        for (s, pos) in seqs.iter().zip(positions) {
            if pos.is_empty() {
                out.push(Vec::new());
                continue;
            }
            let ids = Tensor::from_vec(s.clone(), (1, s.len()), &dev)?;
            let v: Vec<f32> = self.model.values(&ids)?.squeeze(0)?.detach().to_vec1()?;
            out.push(
                pos.iter()
                    .map(|&p| (v[p] as f64).clamp(VALUE_EPS, 1.0 - VALUE_EPS))
                    .collect(),
            );
        }
        Ok(out)
    }

    /// One PPO (+ value) update over `rows`, `epochs` times.
    pub fn update(&mut self, rows: &[LossRow]) -> Result<UpdateStats, TrainError> {
        self.update_with(rows, true)
    }

    /// Like [`update`](Self::update); with `train_policy = false` only the
    /// value loss is applied (critic warm-up: the policy's advantages are
    /// only as good as the critic).
    pub fn update_with(
        &mut self,
        rows: &[LossRow],
        train_policy: bool,
    ) -> Result<UpdateStats, TrainError> {
        let dev = self.device();
        arbor_ops::in_pool(&dev, || self.update_here(rows, train_policy))
    }

    /// [`Learner::update_with`] on the calling thread.
    fn update_here(
        &mut self,
        rows: &[LossRow],
        train_policy: bool,
    ) -> Result<UpdateStats, TrainError> {
        let n_tok: usize = rows
            .iter()
            .map(|r| r.mask.iter().skip(1).filter(|&&m| m > 0.0).count())
            .sum();
        let n_val: usize = rows.iter().map(|r| r.value_targets.len()).sum();
        let mut stats = UpdateStats {
            trained_tokens: n_tok,
            value_targets: n_val,
            ..Default::default()
        };
        if n_tok == 0 && n_val == 0 {
            return Ok(stats);
        }
        let mut pcfg = self.cfg.policy;
        pcfg.aggregation = Aggregation::TokenSum {
            normalizer: n_tok.max(1) as f64,
        };
        let vagg = Aggregation::TokenSum {
            normalizer: n_val.max(1) as f64,
        };
        let dev = self.device();
        for epoch in 0..self.cfg.epochs.max(1) {
            let mut acc = GradAccum::default();
            let (mut pl, mut vl, mut clip, mut kl, mut ent) = (0.0, 0.0, 0.0, 0.0, 0.0);
            for mb in micro_batches(rows, self.cfg.micro_batch_tokens) {
                let p = pack(&mb, &dev)?;
                let (h, values) = self.model.forward(&p.ids)?;
                let hid = self.model.policy.cfg.hidden_size;
                let b = mb.len();
                let mut total: Option<Tensor> = None;
                if !p.lp_rows.is_empty() {
                    let rows_t = Tensor::from_vec(p.lp_rows.clone(), p.lp_rows.len(), &dev)?;
                    let hsel = h.reshape((b * p.t, hid))?.index_select(&rows_t, 0)?;
                    let tg = Tensor::from_vec(p.lp_targets.clone(), p.lp_targets.len(), &dev)?;
                    let lp = token_logprobs(&hsel, &self.model.policy.lm_head, &tg, 256)?;
                    let lpv: Vec<f64> = lp.to_dtype(DType::F64)?.to_vec1()?;
                    let n = lpv.len();
                    let ones = vec![1.0f64; n];
                    let out = policy_loss(
                        &pcfg,
                        &lpv,
                        &p.old_lp,
                        &p.adv,
                        None,
                        &TokenBatch {
                            mask: &ones,
                            seq_lens: &[n],
                        },
                    )?;
                    let w = n as f64 / n_tok as f64;
                    pl += out.loss;
                    clip += out.clip_fraction * w;
                    kl += out.monitor * w;
                    ent += -lpv.iter().sum::<f64>() / n_tok as f64;
                    if train_policy {
                        let g = Tensor::from_vec(
                            out.grad.iter().map(|&x| x as f32).collect::<Vec<_>>(),
                            n,
                            &dev,
                        )?;
                        total = Some((lp * g)?.sum_all()?);
                    }
                }
                if !p.v_rows.is_empty() && self.cfg.value_coef > 0.0 {
                    let rows_t = Tensor::from_vec(p.v_rows.clone(), p.v_rows.len(), &dev)?;
                    let v = values.flatten_all()?.index_select(&rows_t, 0)?;
                    let vv: Vec<f64> = v.to_dtype(DType::F64)?.to_vec1()?;
                    let n = vv.len();
                    let ones = vec![1.0f64; n];
                    let out = value_loss(
                        None,
                        vagg,
                        &vv,
                        &vv,
                        &p.v_targets,
                        &TokenBatch {
                            mask: &ones,
                            seq_lens: &[n],
                        },
                    )?;
                    vl += out.loss;
                    let g = Tensor::from_vec(
                        out.grad
                            .iter()
                            .map(|&x| (x * self.cfg.value_coef) as f32)
                            .collect::<Vec<_>>(),
                        n,
                        &dev,
                    )?;
                    let term = (v.to_dtype(DType::F32)? * g)?.sum_all()?;
                    total = Some(match total {
                        Some(t) => (t + term)?,
                        None => term,
                    });
                }
                if let Some(t) = total {
                    acc.add(self.opt.vars(), &t.backward()?)?;
                }
            }
            let s: StepStats = self.opt.step(&acc)?;
            if epoch == 0 {
                stats.policy_loss = pl;
                stats.value_loss = vl;
                stats.clip_fraction = clip;
                stats.approx_kl = kl;
                stats.entropy = ent;
            }
            stats.grad_norm = s.grad_norm;
            stats.lr = s.lr;
        }
        Ok(stats)
    }

    /// Supervised step: maximise the log-likelihood of the masked tokens of
    /// `rows` (token mean). Returns the mean negative log-likelihood.
    pub fn sft_step(&mut self, rows: &[LossRow]) -> Result<(f64, StepStats), TrainError> {
        let dev = self.device();
        arbor_ops::in_pool(&dev, || self.sft_here(rows))
    }

    /// [`Learner::sft_step`] on the calling thread.
    fn sft_here(&mut self, rows: &[LossRow]) -> Result<(f64, StepStats), TrainError> {
        let n_tok: usize = rows
            .iter()
            .map(|r| r.mask.iter().skip(1).filter(|&&m| m > 0.0).count())
            .sum();
        if n_tok == 0 {
            return Err(TrainError::Config(
                "supervised batch has no trained tokens".into(),
            ));
        }
        let dev = self.device();
        let mut acc = GradAccum::default();
        let mut nll = 0.0;
        for mb in micro_batches(rows, self.cfg.micro_batch_tokens) {
            let p = pack(&mb, &dev)?;
            let h = self.model.policy.forward_hidden(&p.ids)?;
            let hid = self.model.policy.cfg.hidden_size;
            let rows_t = Tensor::from_vec(p.lp_rows.clone(), p.lp_rows.len(), &dev)?;
            let hsel = h.reshape((mb.len() * p.t, hid))?.index_select(&rows_t, 0)?;
            let tg = Tensor::from_vec(p.lp_targets.clone(), p.lp_targets.len(), &dev)?;
            let lp = token_logprobs(&hsel, &self.model.policy.lm_head, &tg, 256)?;
            let loss = (lp.sum_all()? * (-1.0 / n_tok as f64))?;
            nll += loss.to_scalar::<f32>()? as f64;
            acc.add(self.opt.vars(), &loss.backward()?)?;
        }
        Ok((nll, self.opt.step(&acc)?))
    }
}
