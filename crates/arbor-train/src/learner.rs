//! The learner: policy and critic parameters, and the masked PPO / value
//! update from [`arbor_rl::credit::LossRow`]s.
//!
//! One update packs the rows into micro-batches of at most
//! `micro_batch_tokens` real tokens (sequences back to back, no padding:
//! [`arbor_model::Transformer::forward_packed`]), takes the trained
//! tokens' log-probabilities from the fused LM-head op, and computes the
//! losses with `arbor-ops`' kernels: [`arbor_ops::ppo_loss`] (clipped
//! surrogate, asymmetric clip) and [`arbor_ops::value_loss`], each with its
//! own backward. The per-token weights come from
//! [`arbor_rl::ppo::aggregation_weights`] over the whole step (token mean,
//! sequence mean or a constant normaliser), so micro-batching does not
//! change the loss: the micro-batches' losses and gradients add up to the
//! step's. Only tokens with a non-zero mask (policy actions and
//! context-management tokens) enter the policy term: observations, prompts
//! and replayed prefixes get zero weight.

use arbor_model::{
    ActorCritic, CriticMode, LayerCheckpoints, ModelConfig, ParamLoader, ParamSource, Transformer,
};
use arbor_ops::PpoClip;
use arbor_rl::credit::LossRow;
use arbor_rl::ppo::{aggregation_weights, PolicyLossConfig, TokenBatch};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use serde::{Deserialize, Serialize};

use crate::optim::{AdamW, AdamWConfig, GradAccum, ParamGroup, StepStats};
use crate::TrainError;

/// Margin keeping critic values strictly inside (0, 1) for FOCUS.
pub const VALUE_EPS: f64 = 0.01;

/// Update settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LearnerConfig {
    /// The clipped policy loss (`[learner.policy]`): clip range and how the
    /// step's per-token losses are averaged (`token_mean`, `sequence_mean`
    /// or `{ token_sum = { normalizer = N } }`).
    pub policy: PolicyLossConfig,
    /// Weight of the value loss.
    pub value_coef: f64,
    /// Micro-batch size in tokens: rows are packed back to back (no
    /// padding) until the next would exceed it; a longer row is a
    /// micro-batch of its own. Gradients accumulate over micro-batches.
    pub micro_batch_tokens: usize,
    /// Passes over the step's rows (each pass: one optimizer step).
    pub epochs: usize,
    /// Activation recomputation: `off` keeps every layer's intermediates
    /// for the backward; `layers` keeps only each layer's input and
    /// recomputes the layer during the backward (about one more forward of
    /// compute for activation memory of layers x hidden x tokens).
    pub recompute: Recompute,
    /// `shared`: the value head reads the policy's hidden state; `separate`:
    /// the critic has its own backbone (FOCUS and PPO only).
    pub critic: CriticMode,
    /// The training forward's arithmetic: `f32`, or `bf16` (mixed
    /// precision over f32 master weights, f32 gradients and AdamW state,
    /// log-probabilities and losses summed in f32: on a GPU bf16
    /// activations and matmuls, on a CPU bf16 matmuls of the decoder
    /// layers and the LM head with f32 activations).
    pub precision: Precision,
    /// The critic also reads the policy's surprise along the episode's path
    /// ([`surprise_features`]); set from `[critic] surprise`.
    #[serde(skip)]
    pub surprise: bool,
}

impl Default for LearnerConfig {
    fn default() -> Self {
        LearnerConfig {
            policy: PolicyLossConfig::default(),
            value_coef: 0.5,
            micro_batch_tokens: 4096,
            epochs: 1,
            recompute: Recompute::Off,
            critic: CriticMode::Shared,
            precision: Precision::F32,
            surprise: false,
        }
    }
}

/// Surprisal thresholds (nats) of the critic's surprise features.
pub const SURPRISE_NATS: [f32; 3] = [0.5, 1.0, 2.0];

/// Scale of the surprise features. AdamW moves each parameter by about the
/// learning rate per step whatever its gradient's size, so the three
/// feature weights would change the value no faster than any one trunk
/// weight; scaled by 10, they learn at ten times that rate (`arbor bench
/// critic --surprise`: held-out rank correlation 0.47 after 5 epochs on
/// 640 states, against 0.35 unscaled).
pub const SURPRISE_SCALE: f32 = 10.0;

/// The critic's surprise features of one sequence of `n` tokens, `[n, F]`
/// row-major with `F = SURPRISE_NATS.len()`: at position `t`, for each
/// threshold `c`, `SURPRISE_SCALE ln(1 + #{i <= t : -logprobs[i] > c})`,
/// from the number of tokens so far on the episode's path the policy
/// sampled against its own odds. `logprobs` ends aligned with the
/// sequence (`0.0` for tokens the policy did not generate); entries
/// before the sequence's are the path's before a context restart, counted
/// from the start; missing entries count as `0.0`.
///
/// Why: a state's value often hinges on whether an earlier action was a
/// mistake, which the trunk has to re-derive from the tokens, while the
/// policy's own logprob of that action says it directly: a token the
/// policy rarely picks is more often wrong. The critic's value is
/// `w . h_t + b + u . features_t` with `u` learnt (starting at 0, so the
/// critic starts as it would without them).
pub fn surprise_features(logprobs: &[f32], n: usize) -> Vec<f32> {
    let mut counts = [0u32; SURPRISE_NATS.len()];
    let count = |counts: &mut [u32; SURPRISE_NATS.len()], lp: f32| {
        for (c, &th) in counts.iter_mut().zip(&SURPRISE_NATS) {
            *c += u32::from(-lp > th);
        }
    };
    let history = logprobs.len().saturating_sub(n);
    for &lp in &logprobs[..history] {
        count(&mut counts, lp);
    }
    let mut out = Vec::with_capacity(n * counts.len());
    for i in 0..n {
        count(
            &mut counts,
            logprobs.get(history + i).copied().unwrap_or(0.0),
        );
        out.extend(counts.iter().map(|&c| SURPRISE_SCALE * (c as f32).ln_1p()));
    }
    out
}

/// Activation recomputation ([`LearnerConfig::recompute`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Recompute {
    /// Keep every intermediate of the forward for the backward.
    #[default]
    Off,
    /// Keep each layer's input only; recompute the layer in the backward.
    Layers,
}

/// The training forward's arithmetic ([`LearnerConfig::precision`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// f32 throughout.
    #[default]
    F32,
    /// bf16 compute over f32 master weights, as the device does it
    /// fastest ([`arbor_model::Transformer::set_mixed_precision`]): on a
    /// GPU bf16 activations; on a CPU f32 activations and bf16 matmuls.
    Bf16,
}

impl Precision {
    /// `f32` / `bf16`, as in the config.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            other => Err(format!("precision must be f32 or bf16, not `{other}`")),
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
    /// Gradient norm before clipping (the policy's, when the critic has
    /// its own optimizer group).
    pub grad_norm: f64,
    pub lr: f64,
    /// The critic's gradient norm and learning rate, when it has its own
    /// optimizer settings (`[critic]`).
    #[serde(default)]
    pub critic_grad_norm: Option<f64>,
    #[serde(default)]
    pub critic_lr: Option<f64>,
    /// Seconds in the forward passes (model, logprobs, losses).
    #[serde(default)]
    pub time_forward_s: f64,
    /// Seconds in the backward passes and gradient accumulation.
    #[serde(default)]
    pub time_backward_s: f64,
    /// Seconds in the optimizer steps.
    #[serde(default)]
    pub time_optimizer_s: f64,
    /// Seconds in the gradient all-reduce (and ZeRO-1's gather of the
    /// updated shares) over the data-parallel group; 0 on one rank.
    #[serde(default)]
    pub time_all_reduce_s: f64,
}

/// Policy + critic with their optimizer.
pub struct Learner {
    pub model: ActorCritic,
    pub policy_vars: VarMap,
    pub critic_vars: VarMap,
    pub opt: AdamW,
    pub cfg: LearnerConfig,
    /// `value_head.surprise` `[F, 1]`, the weights `u` of the surprise
    /// features, when `cfg.surprise` is on.
    pub surprise: Option<Tensor>,
}

impl Learner {
    /// Give the critic's parameters (`critic.*`: the value head, and a
    /// separate backbone) their own peak learning rate and gradient clip.
    pub fn set_critic_optimizer(&mut self, lr: f64, grad_clip: f64) {
        self.opt.set_group(ParamGroup {
            prefix: "critic.".into(),
            lr,
            grad_clip,
        });
    }

    /// Copy the policy's backbone into the separate critic's (every policy
    /// parameter with a critic parameter of the same name and shape; the
    /// value head keeps its initialisation). Returns how many tensors were
    /// copied (0 with a shared critic).
    pub fn init_critic_from_policy(&mut self) -> Result<usize, TrainError> {
        if self.model.critic_backbone.is_none() {
            return Ok(0);
        }
        let critic: std::collections::HashMap<String, Var> =
            named_vars(&self.critic_vars, "").into_iter().collect();
        let mut copied = 0;
        for (name, v) in named_vars(&self.policy_vars, "") {
            if let Some(c) = critic.get(&name) {
                if c.dims() == v.dims() {
                    c.set(v.as_tensor())?;
                    copied += 1;
                }
            }
        }
        Ok(copied)
    }

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

/// A row's value targets alone: its tokens up to the last target, and the
/// targets. What the critic's extra passes train on and what a replay of
/// earlier steps keeps (in checkpoints, without the policy's columns).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ValueRow {
    pub tokens: Vec<u32>,
    /// `(position, target)`, as in [`LossRow::value_targets`].
    pub value_targets: Vec<(usize, f32)>,
    /// The behaviour logprobs of the policy's tokens on the path (the
    /// critic's surprise features): [`LossRow::history_logprobs`] then
    /// [`LossRow::behaviour_logprobs`], the last `tokens.len()` aligned
    /// with the tokens; empty when not kept (the critic does not read
    /// them: every entry counts as `0.0`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logprobs: Vec<f32>,
}

impl ValueRow {
    /// `row` cut after its last value target (`None` without targets),
    /// with its path's logprobs when `with_logprobs` (the critic reads
    /// them).
    pub fn of(row: &LossRow, with_logprobs: bool) -> Option<Self> {
        let end = row.value_targets.iter().map(|&(p, _)| p + 1).max()?;
        let logprobs = if with_logprobs {
            [&row.history_logprobs[..], &row.behaviour_logprobs[..end]].concat()
        } else {
            Vec::new()
        };
        Some(ValueRow {
            tokens: row.tokens[..end].to_vec(),
            value_targets: row.value_targets.clone(),
            logprobs,
        })
    }

    /// As a loss row that trains no policy token.
    pub fn to_loss_row(&self) -> LossRow {
        let n = self.tokens.len();
        // The path's logprobs: the history, then the last `n`, the tokens'.
        let (history, behaviour) = match self.logprobs.len().checked_sub(n) {
            Some(h) => (self.logprobs[..h].to_vec(), self.logprobs[h..].to_vec()),
            None => (Vec::new(), vec![0.0; n]),
        };
        LossRow {
            episode: 0,
            leaf: arbor_rl::NodeId(0),
            tokens: self.tokens.clone(),
            mask: vec![0.0; n],
            advantages: vec![0.0; n],
            behaviour_logprobs: behaviour,
            history_logprobs: history,
            value_targets: self.value_targets.clone(),
        }
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

/// One micro-batch: rows packed back to back.
struct Packed {
    /// `[N]` token ids.
    ids: Tensor,
    seq_lens: Vec<usize>,
    /// Flat index of the hidden state whose logits give each trained token.
    lp_rows: Vec<u32>,
    lp_targets: Vec<u32>,
    /// Per trained token: behaviour logprob, advantage, loss weight.
    old_lp: Vec<f32>,
    adv: Vec<f32>,
    lp_w: Vec<f32>,
    /// Flat index and target of each value regression.
    v_rows: Vec<u32>,
    v_targets: Vec<f32>,
    /// `[N, F]` surprise features, when the critic reads them.
    surprise: Option<Tensor>,
}

/// [`Learner::forward_micro`]'s result: `h: [N, H]`, `values: [N]`, and
/// per recomputed backbone its checkpoints and final leaf.
struct MicroForward<'m> {
    h: Tensor,
    values: Tensor,
    recomputed: Vec<(&'m Transformer, LayerCheckpoints, Var)>,
}

/// A step's sums of the loss kernels' outputs: policy `(loss,
/// clipped weight, k3, weight)`, value loss, `-logp` of the trained tokens.
#[derive(Debug, Default)]
struct MicroSums {
    pol: [f64; 4],
    value: f64,
    nll: f64,
}

impl MicroSums {
    /// The sums over every rank of `group`.
    fn all_reduce(&mut self, group: &mut dyn crate::dist::Collective) -> Result<(), TrainError> {
        let p = self.pol;
        let mut v = [p[0], p[1], p[2], p[3], self.value, self.nll];
        group.all_reduce_sum_f64(&mut v)?;
        (self.pol, self.value, self.nll) = ([v[0], v[1], v[2], v[3]], v[4], v[5]);
        Ok(())
    }
}

/// Pack `rows` (with their per-token policy weights `w[row][i]`, aligned
/// with the row's tokens; missing weights are 0) into one token stream.
/// With `surprise`, also each row's [`surprise_features`].
fn pack(rows: &[(&LossRow, &[f64])], surprise: bool, dev: &Device) -> Result<Packed, TrainError> {
    let mut ids = Vec::new();
    let mut feats = Vec::new();
    let mut p = Packed {
        ids: Tensor::zeros(1, DType::U32, dev)?,
        seq_lens: Vec::with_capacity(rows.len()),
        lp_rows: Vec::new(),
        lp_targets: Vec::new(),
        old_lp: Vec::new(),
        adv: Vec::new(),
        lp_w: Vec::new(),
        v_rows: Vec::new(),
        v_targets: Vec::new(),
        surprise: None,
    };
    for (r, w) in rows {
        let at = ids.len();
        ids.extend_from_slice(&r.tokens);
        if surprise {
            let path = [&r.history_logprobs[..], &r.behaviour_logprobs[..]].concat();
            feats.extend(surprise_features(&path, r.tokens.len()));
        }
        p.seq_lens.push(r.tokens.len());
        for i in 1..r.tokens.len() {
            if r.mask[i] > 0.0 {
                p.lp_rows.push((at + i - 1) as u32);
                p.lp_targets.push(r.tokens[i]);
                p.old_lp.push(r.behaviour_logprobs[i]);
                p.adv.push(r.advantages[i]);
                p.lp_w.push(w.get(i).map_or(0.0, |&x| x as f32));
            }
        }
        for &(pos, target) in &r.value_targets {
            p.v_rows.push((at + pos) as u32);
            p.v_targets.push(target);
        }
    }
    let n = ids.len();
    p.ids = Tensor::from_vec(ids, n, dev)?;
    if surprise {
        p.surprise = Some(Tensor::from_vec(feats, (n, SURPRISE_NATS.len()), dev)?);
    }
    Ok(p)
}

/// Split items of `len(item)` tokens into consecutive groups of at most
/// `budget` tokens (an item longer than the budget is a group of its own).
fn micro_batches<T>(items: &[T], budget: usize, len: impl Fn(&T) -> usize) -> Vec<&[T]> {
    let mut out = Vec::new();
    let (mut start, mut tokens) = (0, 0);
    for (i, it) in items.iter().enumerate() {
        let l = len(it);
        if i > start && tokens + l > budget {
            out.push(&items[start..i]);
            (start, tokens) = (i, 0);
        }
        tokens += l;
    }
    if start < items.len() {
        out.push(&items[start..]);
    }
    out
}

/// The denominator of this share of a step under `cfg.aggregation`: the
/// masked tokens (token mean), the sequences with a masked token (sequence
/// mean); `None` for a token sum, whose weights do not depend on how the
/// step is split.
fn aggregation_denominator(rows: &[LossRow], cfg: &PolicyLossConfig) -> Option<f64> {
    use arbor_rl::ppo::Aggregation;
    let masked = |r: &LossRow| r.mask.iter().skip(1).filter(|&&m| m > 0.0).count();
    match cfg.aggregation {
        Aggregation::TokenMean => Some(
            rows.iter()
                .map(|r| {
                    r.mask
                        .iter()
                        .skip(1)
                        .map(|&m| f64::from(m.max(0.0)))
                        .sum::<f64>()
                })
                .sum(),
        ),
        Aggregation::SequenceMean => Some(rows.iter().filter(|r| masked(r) > 0).count() as f64),
        Aggregation::TokenSum { .. } => None,
    }
}

/// Per-row policy-loss weights over the whole step (`w[row][i]` for token
/// `i`; 0 at position 0 and wherever the mask is 0).
fn step_weights(rows: &[LossRow], cfg: &PolicyLossConfig) -> Result<Vec<Vec<f64>>, TrainError> {
    let mask: Vec<f64> = rows
        .iter()
        .flat_map(|r| r.mask.iter().skip(1).map(|&m| f64::from(m.max(0.0))))
        .collect();
    let lens: Vec<usize> = rows
        .iter()
        .map(|r| r.tokens.len().saturating_sub(1))
        .collect();
    let w = aggregation_weights(
        cfg.aggregation,
        &TokenBatch {
            mask: &mask,
            seq_lens: &lens,
        },
    )?;
    let mut at = 0;
    Ok(lens
        .iter()
        .map(|&l| {
            let mut row = vec![0.0; l + 1];
            row[1..].copy_from_slice(&w[at..at + l]);
            at += l;
            row
        })
        .collect())
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
        let mut model = ActorCritic::load(cfg, lcfg.critic, &pl, &cl)?;
        model.set_mixed_precision(lcfg.precision == Precision::Bf16)?;
        let surprise = if lcfg.surprise {
            Some(cl.get_or_init(
                "value_head.surprise",
                &[SURPRISE_NATS.len(), 1],
                arbor_model::Init::Zeros,
            )?)
        } else {
            None
        };
        let mut vars = named_vars(&pv, "policy.");
        vars.extend(named_vars(&cv, "critic."));
        let opt = AdamW::new(vars, ocfg)?;
        Ok(Learner {
            model,
            policy_vars: pv,
            critic_vars: cv,
            opt,
            cfg: lcfg,
            surprise,
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
    ///
    /// `logprobs[i]` holds the behaviour logprobs of the path ending with
    /// `seqs[i]` (for the critic's surprise features, see
    /// [`surprise_features`]; a missing sequence or entry counts as `0.0`,
    /// a token the policy did not generate).
    pub fn values_at(
        &self,
        seqs: &[Vec<u32>],
        logprobs: &[Vec<f32>],
        positions: &[Vec<usize>],
    ) -> Result<Vec<Vec<f64>>, TrainError> {
        arbor_ops::in_pool(&self.device(), || {
            self.values_here(seqs, logprobs, positions)
        })
    }

    /// [`Learner::values_at`] on the calling thread: contexts packed into
    /// forwards of at most `micro_batch_tokens` tokens.
    fn values_here(
        &self,
        seqs: &[Vec<u32>],
        logprobs: &[Vec<f32>],
        positions: &[Vec<usize>],
    ) -> Result<Vec<Vec<f64>>, TrainError> {
        let dev = self.device();
        let u: Option<Vec<f32>> = match &self.surprise {
            Some(u) => Some(u.flatten_all()?.to_vec1()?),
            None => None,
        };
        let wanted: Vec<(usize, &Vec<u32>)> = seqs
            .iter()
            .enumerate()
            .filter(|(i, s)| !positions[*i].is_empty() && !s.is_empty())
            .collect();
        let mut out = vec![Vec::new(); seqs.len()];
        for mb in micro_batches(&wanted, self.cfg.micro_batch_tokens, |(_, s)| s.len()) {
            let ids: Vec<u32> = mb.iter().flat_map(|(_, s)| s.iter().copied()).collect();
            let lens: Vec<usize> = mb.iter().map(|(_, s)| s.len()).collect();
            let n = ids.len();
            let v: Vec<f32> = self
                .model
                .values_packed(&Tensor::from_vec(ids, n, &dev)?, &lens)?
                .detach()
                .to_dtype(DType::F32)?
                .to_vec1()?;
            let mut at = 0;
            for (i, s) in mb {
                // The surprise term at the wanted positions only, on the
                // host (`features . u`, as `with_surprise` adds it in
                // training).
                let f = u
                    .as_ref()
                    .map(|_| surprise_features(logprobs.get(*i).map_or(&[][..], |l| l), s.len()));
                out[*i] = positions[*i]
                    .iter()
                    .map(|&p| {
                        let mut x = v[at + p];
                        if let (Some(u), Some(f)) = (&u, &f) {
                            let k = u.len();
                            x += f[p * k..(p + 1) * k]
                                .iter()
                                .zip(u)
                                .map(|(a, b)| a * b)
                                .sum::<f32>();
                        }
                        (x as f64).clamp(VALUE_EPS, 1.0 - VALUE_EPS)
                    })
                    .collect();
                at += s.len();
            }
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
        self.update_in_group(rows, train_policy, &mut crate::dist::Single)
    }

    /// [`Learner::update_with`] as one rank of a data-parallel `group`:
    /// `rows` are this rank's share of the step. The loss is normalised by
    /// the whole step's counts (trained tokens, sequences, value targets,
    /// summed over ranks), the gradients are summed over ranks before the
    /// optimizer step (every rank then applies the same update), and the
    /// returned statistics are the whole step's. With a group of one it
    /// is the plain update. Collectives run outside the compute pool, so a
    /// rank waiting for the others holds none of its workers.
    pub fn update_in_group(
        &mut self,
        rows: &[LossRow],
        train_policy: bool,
        group: &mut dyn crate::dist::Collective,
    ) -> Result<UpdateStats, TrainError> {
        let world = group.world();
        let n_tok: usize = rows
            .iter()
            .map(|r| r.mask.iter().skip(1).filter(|&&m| m > 0.0).count())
            .sum();
        let n_val: usize = rows.iter().map(|r| r.value_targets.len()).sum();
        let mut weights = step_weights(rows, &self.cfg.policy)?;
        let (mut n_tok_all, mut n_val_all) = (n_tok, n_val);
        if world > 1 {
            let den = aggregation_denominator(rows, &self.cfg.policy);
            let mut c = [n_tok as f64, n_val as f64, den.unwrap_or(0.0)];
            group.all_reduce_sum_f64(&mut c)?;
            (n_tok_all, n_val_all) = (c[0] as usize, c[1] as usize);
            // Local weights are over this rank's denominator; rescale to the
            // step's.
            if let Some(d) = den.filter(|&d| d > 0.0 && c[2] > 0.0) {
                let f = d / c[2];
                weights.iter_mut().flatten().for_each(|w| *w *= f);
            }
        }
        let mut stats = UpdateStats {
            trained_tokens: n_tok_all,
            value_targets: n_val_all,
            ..Default::default()
        };
        if n_tok_all == 0 && n_val_all == 0 {
            return Ok(stats);
        }
        let dev = self.device();
        let items: Vec<(&LossRow, &[f64])> = rows
            .iter()
            .zip(&weights)
            .map(|(r, w)| (r, w.as_slice()))
            .collect();
        let clip = PpoClip {
            eps_low: self.cfg.policy.eps_low as f32,
            eps_high: self.cfg.policy.eps_high as f32,
        };
        let v_w = 1.0 / n_val_all.max(1) as f32;
        let (mut t_fwd, mut t_bwd, mut t_opt, mut t_comm) = (0.0, 0.0, 0.0, 0.0);
        // Packed once, for every epoch.
        let packs = micro_batches(&items, self.cfg.micro_batch_tokens, |(r, _)| r.tokens.len())
            .into_iter()
            .map(|mb| pack(mb, self.surprise.is_some(), &dev))
            .collect::<Result<Vec<_>, _>>()?;
        for epoch in 0..self.cfg.epochs.max(1) {
            let (mut acc, mut sums) = arbor_ops::in_pool(&dev, || {
                let mut acc = GradAccum::default();
                let mut sums = MicroSums::default();
                for p in &packs {
                    let t0 = std::time::Instant::now();
                    let fwd = self.with_surprise(self.forward_micro(p)?, p)?;
                    let total = self.micro_loss(
                        p,
                        &fwd.h,
                        &fwd.values,
                        train_policy,
                        clip,
                        v_w,
                        &mut sums,
                    )?;
                    let t1 = std::time::Instant::now();
                    t_fwd += (t1 - t0).as_secs_f64();
                    if let Some(t) = total {
                        self.backward_into(p, &fwd, &t, &mut acc)?;
                    }
                    t_bwd += t1.elapsed().as_secs_f64();
                }
                Ok::<_, TrainError>((acc, sums))
            })?;
            if world > 1 {
                let t = std::time::Instant::now();
                acc.all_reduce(self.opt.vars(), group)?;
                sums.all_reduce(group)?;
                t_comm += t.elapsed().as_secs_f64();
            }
            let t0 = std::time::Instant::now();
            let s: StepStats = arbor_ops::in_pool(&dev, || self.opt.step(&acc))?;
            t_opt += t0.elapsed().as_secs_f64();
            if world > 1 {
                // ZeRO-1: the other ranks' shares of the update.
                let t = std::time::Instant::now();
                self.opt.gather_shards(group)?;
                t_comm += t.elapsed().as_secs_f64();
            }
            if epoch == 0 {
                let pol = sums.pol;
                let wsum = if pol[3] > 0.0 { pol[3] } else { 1.0 };
                stats.policy_loss = pol[0];
                stats.value_loss = sums.value;
                stats.clip_fraction = pol[1] / wsum;
                stats.approx_kl = pol[2] / wsum;
                stats.entropy = sums.nll / n_tok_all.max(1) as f64;
            }
            stats.grad_norm = s.grad_norm;
            stats.lr = s.lr;
            if let Some((lr, norm)) = s.group {
                stats.critic_lr = Some(lr);
                stats.critic_grad_norm = Some(norm);
            }
        }
        stats.time_forward_s = t_fwd;
        stats.time_backward_s = t_bwd;
        stats.time_optimizer_s = t_opt;
        stats.time_all_reduce_s = t_comm;
        Ok(stats)
    }

    /// Extra passes of the critic alone over value targets (`[critic]
    /// epochs`; [`ValueRow::of`] cuts a step's rows): `passes` times, the
    /// rows are shuffled from `seed` and split into
    /// `minibatches` equal parts, and each part is one
    /// [`AdamW::step_group`] of the critic's parameters on the mean value
    /// loss of its targets. The policy, its moments and the schedule do not
    /// move; with a shared critic only the value head does. In a
    /// data-parallel `group` every rank is given the whole group's rows
    /// (the same list on every rank), computes the gradient of its share of
    /// each minibatch, and the gradients and losses are summed: the ranks
    /// stay in step and take the steps one rank would. Returns the last
    /// pass's mean value loss and the steps taken.
    pub fn update_critic_in_group(
        &mut self,
        rows: &[ValueRow],
        passes: usize,
        minibatches: usize,
        seed: u64,
        group: &mut dyn crate::dist::Collective,
    ) -> Result<(f64, usize), TrainError> {
        let dev = self.device();
        let rows: Vec<LossRow> = rows.iter().map(ValueRow::to_loss_row).collect();
        let parts = minibatches.max(1);
        let mut order: Vec<usize> = (0..rows.len()).collect();
        let mut rng = seed;
        let (mut last_loss, mut steps) = (0.0, 0);
        for _ in 0..passes {
            crate::rollout::sched::shuffle(&mut order, &mut rng);
            let (mut loss, mut targets) = (0.0, 0usize);
            for part in 0..parts {
                let (lo, hi) = (part * order.len() / parts, (part + 1) * order.len() / parts);
                let whole = &order[lo..hi];
                let n = [whole
                    .iter()
                    .map(|&i| rows[i].value_targets.len())
                    .sum::<usize>() as f64];
                // This rank's share of the minibatch.
                let (rank, world) = (group.rank(), group.world());
                let share = &whole[whole.len() * rank / world..whole.len() * (rank + 1) / world];
                let mb: Vec<(&LossRow, &[f64])> =
                    share.iter().map(|&i| (&rows[i], &[][..])).collect();
                let v_w = 1.0 / n[0].max(1.0) as f32;
                let (mut acc, mut sums) = arbor_ops::in_pool(&dev, || {
                    let mut acc = GradAccum::default();
                    let mut sums = MicroSums::default();
                    for chunk in
                        micro_batches(&mb, self.cfg.micro_batch_tokens, |(r, _)| r.tokens.len())
                    {
                        let p = pack(chunk, self.surprise.is_some(), &dev)?;
                        let fwd = self.with_surprise(self.forward_values(&p)?, &p)?;
                        let total = self.micro_loss(
                            &p,
                            &fwd.h,
                            &fwd.values,
                            false,
                            // No policy tokens: the clip is never read.
                            PpoClip {
                                eps_low: 0.0,
                                eps_high: 0.0,
                            },
                            v_w,
                            &mut sums,
                        )?;
                        if let Some(t) = total {
                            self.backward_into(&p, &fwd, &t, &mut acc)?;
                        }
                    }
                    Ok::<_, TrainError>((acc, sums))
                })?;
                if group.world() > 1 {
                    acc.all_reduce(self.opt.vars(), group)?;
                    sums.all_reduce(group)?;
                }
                if n[0] > 0.0 {
                    arbor_ops::in_pool(&dev, || self.opt.step_group(&acc))?;
                    if group.world() > 1 {
                        self.opt.gather_shards(group)?;
                    }
                    steps += 1;
                }
                loss += sums.value * n[0];
                targets += n[0] as usize;
            }
            last_loss = loss / targets.max(1) as f64;
        }
        Ok((last_loss, steps))
    }

    /// Backpropagate a micro-batch's loss `total` into `acc`, through the
    /// recomputed layers of each backbone that kept only checkpoints.
    fn backward_into(
        &self,
        p: &Packed,
        fwd: &MicroForward<'_>,
        total: &Tensor,
        acc: &mut GradAccum,
    ) -> Result<(), TrainError> {
        let vars = self.opt.vars();
        let grads = total.backward()?;
        acc.add(vars, &grads)?;
        for (m, ck, x) in &fwd.recomputed {
            if let Some(d) = grads.get(x.as_tensor()) {
                m.backward_checkpoints(ck, &p.ids, d, |g| acc.add(vars, g))?;
            }
        }
        Ok(())
    }

    /// `fwd` with the surprise term `features . u` added to its values,
    /// when the critic reads the features.
    fn with_surprise<'m>(
        &self,
        mut fwd: MicroForward<'m>,
        p: &Packed,
    ) -> Result<MicroForward<'m>, TrainError> {
        if let (Some(u), Some(f)) = (&self.surprise, &p.surprise) {
            fwd.values = (fwd.values + f.matmul(u)?.squeeze(1)?)?;
        }
        Ok(fwd)
    }

    /// The critic's forward alone: its values (with `recompute =
    /// "layers"` through the critic backbone's checkpoints); `h` is empty.
    /// With a shared critic the policy's trunk is run without a graph:
    /// only the value head trains in these passes.
    fn forward_values(&self, p: &Packed) -> Result<MicroForward<'_>, TrainError> {
        let m = &self.model;
        let empty = Tensor::zeros(0, DType::F32, &self.device())?;
        let Some(backbone) = m.critic_backbone.as_ref() else {
            let h = m.policy.forward_packed(&p.ids, &p.seq_lens)?.detach();
            return Ok(MicroForward {
                h: empty,
                values: m.value_head.forward(&h)?,
                recomputed: Vec::new(),
            });
        };
        if self.cfg.recompute == Recompute::Off {
            return Ok(MicroForward {
                h: empty,
                values: m.values_packed(&p.ids, &p.seq_lens)?,
                recomputed: Vec::new(),
            });
        }
        let ck = backbone.forward_checkpoints(&p.ids, &p.seq_lens)?;
        let x = ck.last_leaf()?;
        let values = m.value_head.forward(&backbone.final_norm(x.as_tensor())?)?;
        Ok(MicroForward {
            h: empty,
            values,
            recomputed: vec![(backbone, ck, x)],
        })
    }

    /// A micro-batch's forward: final hidden states and values; with
    /// `recompute = "layers"` through [`Transformer::forward_checkpoints`],
    /// keeping each backbone's checkpoints and the leaf its gradient enters.
    fn forward_micro(&self, p: &Packed) -> Result<MicroForward<'_>, TrainError> {
        let m = &self.model;
        if self.cfg.recompute == Recompute::Off {
            let (h, values) = m.forward_packed(&p.ids, &p.seq_lens)?;
            return Ok(MicroForward {
                h,
                values,
                recomputed: Vec::new(),
            });
        }
        /// `t`'s final hidden states from a new leaf over its checkpoints
        /// (pushed to `out`).
        fn final_hidden<'m>(
            t: &'m Transformer,
            p: &Packed,
            out: &mut Vec<(&'m Transformer, LayerCheckpoints, Var)>,
        ) -> Result<Tensor, TrainError> {
            let ck = t.forward_checkpoints(&p.ids, &p.seq_lens)?;
            let x = ck.last_leaf()?;
            let h = t.final_norm(x.as_tensor())?;
            out.push((t, ck, x));
            Ok(h)
        }
        let mut recomputed = Vec::with_capacity(2);
        let h = final_hidden(&m.policy, p, &mut recomputed)?;
        let values = match &m.critic_backbone {
            None => m.value_head.forward(&h)?,
            Some(c) => m
                .value_head
                .forward(&final_hidden(c, p, &mut recomputed)?)?,
        };
        Ok(MicroForward {
            h,
            values,
            recomputed,
        })
    }

    /// One micro-batch's loss from its final hidden states `h: [N, H]` and
    /// values `[N]`: the policy term through [`arbor_ops::ppo_loss`] (unless
    /// `train_policy` is off; its statistics are summed either way) plus
    /// `value_coef` x [`arbor_ops::value_loss`]. `None` when nothing is
    /// trained.
    #[allow(clippy::too_many_arguments)]
    fn micro_loss(
        &self,
        p: &Packed,
        h: &Tensor,
        values: &Tensor,
        train_policy: bool,
        clip: PpoClip,
        v_w: f32,
        sums: &mut MicroSums,
    ) -> Result<Option<Tensor>, TrainError> {
        let dev = self.device();
        let mut total: Option<Tensor> = None;
        if !p.lp_rows.is_empty() {
            let n = p.lp_rows.len();
            let rows_t = Tensor::from_slice(&p.lp_rows, n, &dev)?;
            let hsel = h.index_select(&rows_t, 0)?;
            let tg = Tensor::from_slice(&p.lp_targets, n, &dev)?;
            let mut lp = self.model.policy.train_token_logprobs(&hsel, &tg, 256)?;
            if !train_policy {
                lp = lp.detach();
            }
            let aux =
                arbor_ops::pack_aux(&p.old_lp, &p.adv, &p.lp_w, &dev)?.to_dtype(lp.dtype())?;
            let out = arbor_ops::ppo_loss(&lp, &aux, clip)?;
            let o: Vec<f64> = out.to_dtype(DType::F64)?.to_vec1()?;
            sums.pol.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            sums.nll -= lp.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
            if train_policy {
                total = Some(out.narrow(0, 0, 1)?);
            }
        }
        if !p.v_rows.is_empty() && self.cfg.value_coef > 0.0 {
            let n = p.v_rows.len();
            let rows_t = Tensor::from_slice(&p.v_rows, n, &dev)?;
            let v = values.index_select(&rows_t, 0)?;
            let aux = arbor_ops::pack_aux(&p.v_targets, &p.v_targets, &vec![v_w; n], &dev)?
                .to_dtype(v.dtype())?;
            let out = arbor_ops::value_loss(&v, &aux, 0.0)?;
            sums.value += out.get(0)?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            let term = (out.narrow(0, 0, 1)? * self.cfg.value_coef)?;
            total = Some(match total {
                Some(t) => (t + term)?,
                None => term,
            });
        }
        total.map(|t| t.sum_all()).transpose().map_err(Into::into)
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
        // No policy-loss weights: the supervised loss is its own.
        let items: Vec<(&LossRow, &[f64])> = rows.iter().map(|r| (r, &[][..])).collect();
        for mb in micro_batches(&items, self.cfg.micro_batch_tokens, |(r, _)| r.tokens.len()) {
            let p = pack(mb, false, &dev)?;
            if p.lp_rows.is_empty() {
                continue;
            }
            let h = self.model.policy.forward_packed(&p.ids, &p.seq_lens)?;
            let n = p.lp_rows.len();
            let hsel = h.index_select(&Tensor::from_vec(p.lp_rows, n, &dev)?, 0)?;
            let tg = Tensor::from_vec(p.lp_targets, n, &dev)?;
            let lp = self.model.policy.train_token_logprobs(&hsel, &tg, 256)?;
            let loss = (lp.sum_all()? * (-1.0 / n_tok as f64))?;
            nll += loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            acc.add(self.opt.vars(), &loss.backward()?)?;
        }
        Ok((nll, self.opt.step(&acc)?))
    }
}
