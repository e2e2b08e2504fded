//! AdamW with f32 state, linear warm-up then cosine decay, global-norm
//! gradient clipping and gradient accumulation.
//!
//! Update of parameter `p` with gradient `g` at step `t` (1-based), learning
//! rate `lr_t`:
//! `m = b1 m + (1-b1) g`, `v = b2 v + (1-b2) g^2`,
//! `p <- p - lr_t (wd p + (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps))`.
//! Schedule: `lr_t = lr * t / warmup` for `t <= warmup`, then
//! `lr * (r + (1-r) (1 + cos(pi u)) / 2)` with `u` the fraction of the
//! remaining steps done and `r = min_lr_ratio`.

use std::collections::HashMap;

use candle_core::{backprop::GradStore, DType, Tensor, Var};
use serde::{Deserialize, Serialize};

use crate::TrainError;

/// Optimizer settings (`[optimizer]`): AdamW with decoupled weight decay,
/// a linear warm-up, then a cosine decay to `min_lr_ratio * lr`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdamWConfig {
    /// Peak learning rate (> 0).
    pub lr: f64,
    /// First-moment decay, in `[0, 1)`.
    pub beta1: f64,
    /// Second-moment decay, in `[0, 1)`.
    pub beta2: f64,
    /// Added to the second moment's square root (> 0).
    pub eps: f64,
    /// Decoupled weight decay per step, as a fraction of `lr` (>= 0).
    pub weight_decay: f64,
    /// Clip the global gradient norm to this (none when 0).
    pub grad_clip: f64,
    /// Optimizer steps of the linear warm-up from 0 to `lr`.
    pub warmup_steps: u64,
    /// Steps of the cosine schedule (0: constant after warm-up). The
    /// trainer sets it to `steps * learner.epochs`.
    pub total_steps: u64,
    /// Floor of the cosine decay, as a fraction of `lr`, in `[0, 1]`.
    pub min_lr_ratio: f64,
    /// ZeRO-1 on several ranks: each rank keeps the moments of, and
    /// updates, only its share of the parameters (whole tensors, balanced
    /// by size), then every rank's updated share is gathered by all. The
    /// same updates as without it, a `1/world` share of the optimizer
    /// state per rank. No effect on one rank.
    pub shard_state: bool,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            grad_clip: 1.0,
            warmup_steps: 0,
            total_steps: 0,
            min_lr_ratio: 0.1,
            shard_state: false,
        }
    }
}

/// Statistics of one optimizer step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepStats {
    pub lr: f64,
    /// Global gradient norm before clipping (of the parameters outside the
    /// group, when there is one).
    pub grad_norm: f64,
    /// The group's learning rate and gradient norm, when there is one.
    pub group: Option<(f64, f64)>,
}

/// Parameters (names starting with `prefix`) with their own peak learning
/// rate and gradient clip; the schedule's shape and AdamW's other settings
/// are the optimizer's. Its gradient norm is clipped apart from the rest.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamGroup {
    pub prefix: String,
    pub lr: f64,
    pub grad_clip: f64,
}

/// Summed gradients of several micro-batches.
#[derive(Debug, Default)]
pub struct GradAccum {
    sums: HashMap<candle_core::TensorId, Tensor>,
}

impl GradAccum {
    /// Add the gradients of `vars` found in `grads` (detached: a gradient
    /// that still referenced its forward graph would keep that graph alive
    /// in the sums and, through them, in the optimizer's moments).
    pub fn add(&mut self, vars: &[(String, Var)], grads: &GradStore) -> Result<(), TrainError> {
        for (_, v) in vars {
            if let Some(g) = grads.get(v.as_tensor()).map(Tensor::detach) {
                let id = v.as_tensor().id();
                let sum = match self.sums.remove(&id) {
                    Some(s) => (s + g)?,
                    None => g,
                };
                self.sums.insert(id, sum);
            }
        }
        Ok(())
    }

    pub fn get(&self, v: &Var) -> Option<&Tensor> {
        self.sums.get(&v.as_tensor().id())
    }

    pub fn is_empty(&self) -> bool {
        self.sums.is_empty()
    }

    /// Sum these gradients over the ranks of `group`, in f32 on their
    /// device ([`Collective::all_reduce_sum_tensors`], `vars` order):
    /// afterwards every rank holds the same sums, for the variables that
    /// had a gradient on any rank.
    ///
    /// [`Collective::all_reduce_sum_tensors`]: crate::dist::Collective::all_reduce_sum_tensors
    pub fn all_reduce(
        &mut self,
        vars: &[(String, Var)],
        group: &mut dyn crate::dist::Collective,
    ) -> Result<(), TrainError> {
        let mut present = Vec::with_capacity(vars.len());
        let mut grads = Vec::with_capacity(vars.len());
        for (_, v) in vars {
            let g = self.sums.remove(&v.as_tensor().id());
            present.push(if g.is_some() { 1.0 } else { 0.0 });
            grads.push(g);
        }
        group.all_reduce_sum_f64(&mut present)?;
        // Zeros stand in where another rank has a gradient and this one
        // has none; variables without one anywhere are left out.
        let mut anywhere = Vec::new();
        let mut tensors = Vec::new();
        for (((_, v), &p), g) in vars.iter().zip(&present).zip(grads) {
            if p > 0.0 {
                tensors.push(match g {
                    Some(g) => g.to_dtype(candle_core::DType::F32)?,
                    None => Tensor::zeros(v.shape(), candle_core::DType::F32, v.device())?,
                });
                anywhere.push(v);
            }
        }
        let summed = group.all_reduce_sum_tensors(tensors)?;
        for (v, t) in anywhere.into_iter().zip(summed) {
            self.sums.insert(v.as_tensor().id(), t.to_dtype(v.dtype())?);
        }
        Ok(())
    }
}

/// AdamW over a fixed list of named parameters.
#[derive(Debug)]
pub struct AdamW {
    pub cfg: AdamWConfig,
    group: Option<ParamGroup>,
    vars: Vec<(String, Var)>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    step: u64,
    /// Steps that updated the group's parameters: every [`AdamW::step`]
    /// and every [`AdamW::step_group`]. Their bias corrections use it.
    group_step: u64,
    /// ZeRO-1 ([`AdamW::shard`]): the rank owning each parameter, and this
    /// rank.
    shard: Option<(Vec<usize>, usize)>,
}

/// The rank owning each of `sizes` (parameters in order) among `world`
/// ranks: contiguous runs, each closing once its rank holds its share of
/// the elements, so every rank owns about `total / world`.
pub fn shard_owners(sizes: &[usize], world: usize) -> Vec<usize> {
    let world = world.max(1);
    let total: usize = sizes.iter().sum();
    let mut at = 0usize;
    sizes
        .iter()
        .map(|&n| {
            // The owner of a parameter is the rank whose share its middle
            // element falls in.
            let mid = at + n / 2;
            at += n;
            (mid * world / total.max(1)).min(world - 1)
        })
        .collect()
}

impl AdamW {
    pub fn new(mut vars: Vec<(String, Var)>, cfg: AdamWConfig) -> Result<Self, TrainError> {
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let zeros = |v: &Var| Tensor::zeros(v.shape(), DType::F32, v.device());
        let m = vars
            .iter()
            .map(|(_, v)| zeros(v))
            .collect::<Result<Vec<_>, _>>()?;
        let v = vars
            .iter()
            .map(|(_, v)| zeros(v))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(AdamW {
            cfg,
            group: None,
            vars,
            m,
            v,
            step: 0,
            group_step: 0,
            shard: None,
        })
    }

    /// Give the parameters named `group.prefix*` their own learning rate
    /// and gradient clip.
    pub fn set_group(&mut self, group: ParamGroup) {
        self.group = Some(group);
    }

    /// Start over with `cfg`: zero moments, step 0 (the group is kept).
    pub fn reset(&mut self, cfg: AdamWConfig) -> Result<(), TrainError> {
        for t in self.m.iter_mut().chain(self.v.iter_mut()) {
            *t = t.zeros_like()?;
        }
        self.step = 0;
        self.group_step = 0;
        self.cfg = cfg;
        Ok(())
    }

    fn in_group(&self, name: &str) -> bool {
        self.group
            .as_ref()
            .is_some_and(|g| name.starts_with(&g.prefix))
    }

    pub fn vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// Steps that updated the group (equal to [`AdamW::steps_done`] unless
    /// [`AdamW::step_group`] ran).
    pub fn group_steps_done(&self) -> u64 {
        self.group_step
    }

    /// Restore the group's step count (checkpoints).
    pub fn set_group_steps(&mut self, n: u64) {
        self.group_step = n;
    }

    /// Learning rate of (1-based) step `t`.
    pub fn lr_at(&self, t: u64) -> f64 {
        let c = &self.cfg;
        if c.warmup_steps > 0 && t <= c.warmup_steps {
            return c.lr * t as f64 / c.warmup_steps as f64;
        }
        if c.total_steps <= c.warmup_steps {
            return c.lr;
        }
        let u = ((t - c.warmup_steps) as f64 / (c.total_steps - c.warmup_steps) as f64).min(1.0);
        c.lr * (c.min_lr_ratio
            + (1.0 - c.min_lr_ratio) * 0.5 * (1.0 + (std::f64::consts::PI * u).cos()))
    }

    /// One update from accumulated gradients ([`arbor_ops::adamw_step`]: in
    /// place on the CPU). Parameters without a gradient are skipped, their
    /// moments included, as PyTorch skips parameters whose `grad` is None.
    pub fn step(&mut self, grads: &GradAccum) -> Result<StepStats, TrainError> {
        self.step += 1;
        self.group_step += 1;
        self.apply(grads, false)
    }

    /// A step of the group's parameters alone (the critic's extra passes):
    /// their moments and bias corrections advance with the group's own
    /// step count, at the learning rate of where the schedule stands; the
    /// other parameters and the schedule do not move.
    pub fn step_group(&mut self, grads: &GradAccum) -> Result<StepStats, TrainError> {
        if self.group.is_none() {
            return Err(TrainError::Config(
                "optimizer: a group step needs a parameter group".into(),
            ));
        }
        self.group_step += 1;
        self.apply(grads, true)
    }

    /// Apply `grads` (only the group's with `group_only`).
    fn apply(&mut self, grads: &GradAccum, group_only: bool) -> Result<StepStats, TrainError> {
        let t = self.step.max(1);
        let lr = self.lr_at(t);
        // Squared gradient norms: [rest, group].
        let mut sq = [0f64; 2];
        for (name, v) in &self.vars {
            if let Some(g) = grads.get(v) {
                sq[usize::from(self.in_group(name))] += arbor_ops::sum_sq(g)?;
            }
        }
        let norms = [sq[0].sqrt(), sq[1].sqrt()];
        if let Some(n) = norms.iter().find(|n| !n.is_finite()) {
            return Err(TrainError::NonFinite(format!(
                "gradient norm {n} at optimizer step {t}"
            )));
        }
        let clip = |limit: f64, norm: f64| {
            if limit > 0.0 && norm > limit {
                limit / norm
            } else {
                1.0
            }
        };
        let group_lr = self.group.as_ref().map(|g| lr * g.lr / self.cfg.lr);
        let (b1, b2) = (self.cfg.beta1, self.cfg.beta2);
        let hyper = |lr: f64, grad_scale: f64, t: u64| arbor_ops::AdamWStep {
            lr,
            beta1: b1,
            beta2: b2,
            eps: self.cfg.eps,
            weight_decay: self.cfg.weight_decay,
            bias1: 1.0 - b1.powi(t as i32),
            bias2: 1.0 - b2.powi(t as i32),
            grad_scale,
        };
        let h = [
            hyper(lr, clip(self.cfg.grad_clip, norms[0]), t),
            match &self.group {
                Some(g) => hyper(
                    group_lr.unwrap_or(lr),
                    clip(g.grad_clip, norms[1]),
                    self.group_step.max(1),
                ),
                None => hyper(lr, 1.0, t),
            },
        ];
        for (i, (name, var)) in self.vars.iter().enumerate() {
            let Some(g) = grads.get(var) else { continue };
            if !self.owns(i) {
                continue;
            }
            let in_group = self.in_group(name);
            if group_only && !in_group {
                continue;
            }
            let h = &h[usize::from(in_group)];
            arbor_ops::adamw_step(var, &mut self.m[i], &mut self.v[i], g, h)?;
        }
        Ok(StepStats {
            lr,
            grad_norm: norms[0],
            group: group_lr.map(|l| (l, norms[1])),
        })
    }

    /// Keep only this rank's share of the moments (ZeRO-1): from now on
    /// [`AdamW::step`] updates only the parameters `rank` owns
    /// ([`shard_owners`]), and [`AdamW::gather_shards`] must follow each
    /// step to bring every rank the others' updates. A group of one is
    /// left whole.
    pub fn shard(&mut self, rank: usize, world: usize) -> Result<(), TrainError> {
        if world <= 1 {
            return Ok(());
        }
        let sizes: Vec<usize> = self.vars.iter().map(|(_, v)| v.elem_count()).collect();
        let owners = shard_owners(&sizes, world);
        for (i, &o) in owners.iter().enumerate() {
            if o != rank {
                self.m[i] = Tensor::zeros(0, DType::F32, self.m[i].device())?;
                self.v[i] = self.m[i].clone();
            }
        }
        self.shard = Some((owners, rank));
        Ok(())
    }

    /// Whether the moments are sharded across ranks.
    pub fn is_sharded(&self) -> bool {
        self.shard.is_some()
    }

    /// Whether this rank updates parameter `i`.
    fn owns(&self, i: usize) -> bool {
        self.shard.as_ref().is_none_or(|(o, r)| o[i] == *r)
    }

    /// After a step of a sharded optimizer: every rank's parameters, as
    /// their owners updated them, on every rank (one all-gather). Nothing
    /// to do when whole.
    pub fn gather_shards(
        &mut self,
        group: &mut dyn crate::dist::Collective,
    ) -> Result<(), TrainError> {
        let Some((owners, _)) = &self.shard else {
            return Ok(());
        };
        let mine: Vec<u8> = self
            .vars
            .iter()
            .enumerate()
            .filter(|&(i, _)| self.owns(i))
            .map(|(_, (_, v))| f32_bytes(v.as_tensor()))
            .collect::<Result<Vec<_>, _>>()?
            .concat();
        let mut shares = Shares::new(group.all_gather(&mine)?);
        for (i, (name, var)) in self.vars.iter().enumerate() {
            let x = shares.next(owners[i], var.elem_count(), name)?;
            if !self.owns(i) {
                let t = Tensor::from_vec(x, var.shape(), var.device())?.to_dtype(var.dtype())?;
                var.set(&t)?;
            }
        }
        Ok(())
    }

    /// [`AdamW::state`] with every rank's moments (one all-gather when
    /// sharded; called by every rank of the group). Checkpoints hold the
    /// whole state, so a run resumes at any number of ranks; while one is
    /// written every rank holds the whole state in host memory for a
    /// moment (the collective has no gather to one rank).
    pub fn gathered_state(
        &self,
        group: &mut dyn crate::dist::Collective,
    ) -> Result<(HashMap<String, Tensor>, u64), TrainError> {
        let Some((owners, _)) = &self.shard else {
            return Ok(self.state());
        };
        let mut mine = Vec::new();
        for (i, _) in self.vars.iter().enumerate().filter(|&(i, _)| self.owns(i)) {
            mine.extend(f32_bytes(&self.m[i])?);
            mine.extend(f32_bytes(&self.v[i])?);
        }
        let mut shares = Shares::new(group.all_gather(&mine)?);
        let mut out = HashMap::new();
        for (i, (name, var)) in self.vars.iter().enumerate() {
            for prefix in ["m", "v"] {
                let key = format!("{prefix}.{name}");
                let x = shares.next(owners[i], var.elem_count(), &key)?;
                out.insert(key, Tensor::from_vec(x, var.shape(), var.device())?);
            }
        }
        Ok((out, self.step))
    }

    /// Optimizer state as named tensors (`m.NAME`, `v.NAME`) plus the step.
    /// Sharded, only this rank's moments ([`AdamW::gathered_state`] has
    /// them all).
    pub fn state(&self) -> (HashMap<String, Tensor>, u64) {
        let mut out = HashMap::new();
        for (i, (name, _)) in self.vars.iter().enumerate() {
            if self.owns(i) {
                out.insert(format!("m.{name}"), self.m[i].clone());
                out.insert(format!("v.{name}"), self.v[i].clone());
            }
        }
        (out, self.step)
    }

    /// Restore [`state`](Self::state); every moment must be present.
    pub fn load_state(
        &mut self,
        state: &HashMap<String, Tensor>,
        step: u64,
    ) -> Result<(), TrainError> {
        for (i, (name, var)) in self.vars.iter().enumerate() {
            let owned = self.owns(i);
            for (prefix, slot) in [("m", &mut self.m[i]), ("v", &mut self.v[i])] {
                let key = format!("{prefix}.{name}");
                let t = state.get(&key).ok_or_else(|| {
                    TrainError::Checkpoint(format!("optimizer state lacks `{key}`"))
                })?;
                if t.dims() != var.dims() {
                    return Err(TrainError::Checkpoint(format!(
                        "optimizer state `{key}` has shape {:?}, the parameter {:?}",
                        t.dims(),
                        var.dims()
                    )));
                }
                if owned {
                    *slot = t.to_dtype(DType::F32)?;
                }
            }
        }
        self.step = step;
        // The group's own count, when it differs, is restored apart
        // ([`AdamW::set_group_steps`]).
        self.group_step = step;
        Ok(())
    }
}

/// Every rank's all-gathered bytes, read back in order: each rank's share
/// is its tensors' f32 values, one after another.
struct Shares {
    parts: Vec<Vec<u8>>,
    at: Vec<usize>,
}

impl Shares {
    fn new(parts: Vec<Vec<u8>>) -> Self {
        let at = vec![0; parts.len()];
        Shares { parts, at }
    }

    /// The next `n` values of rank `r`'s share (`what`: the tensor, for
    /// the error).
    fn next(&mut self, r: usize, n: usize, what: &str) -> Result<Vec<f32>, TrainError> {
        let bytes = self
            .parts
            .get(r)
            .and_then(|p| p.get(self.at[r]..self.at[r] + 4 * n))
            .ok_or_else(|| {
                TrainError::Config(format!(
                    "sharded optimizer: rank {r} sent too few bytes for `{what}`"
                ))
            })?;
        self.at[r] += 4 * n;
        Ok(bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }
}

/// `t`'s elements as little-endian f32 bytes.
fn f32_bytes(t: &Tensor) -> Result<Vec<u8>, TrainError> {
    Ok(t.to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Accumulated gradients never hold a graph, even when the store's
    /// entry does (a custom op may return one attached to its inputs).
    #[test]
    fn accumulated_gradients_are_detached() {
        let dev = Device::Cpu;
        let var = Var::from_tensor(&Tensor::new(&[1.0f32, 2.0], &dev).unwrap()).unwrap();
        let x = Var::from_tensor(&Tensor::new(&[3.0f32, 4.0], &dev).unwrap()).unwrap();
        let attached = (x.as_tensor() * 2.0).unwrap();
        assert!(attached.track_op());
        let mut store = (var.as_tensor() * 0.0)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        store.insert(var.as_tensor(), attached);
        let vars = vec![("p".to_string(), var.clone())];
        let mut acc = GradAccum::default();
        acc.add(&vars, &store).unwrap();
        acc.add(&vars, &store).unwrap();
        let g = acc.get(&var).unwrap();
        assert!(!g.track_op());
        assert_eq!(g.to_vec1::<f32>().unwrap(), vec![12.0, 16.0]);
    }

    /// Two steps against a hand computation in f64.
    #[test]
    fn matches_hand_computed_adamw() {
        let p0 = [1.0f64, -2.0];
        let var = Var::from_tensor(&Tensor::new(&[1.0f32, -2.0], &Device::Cpu).unwrap()).unwrap();
        let cfg = AdamWConfig {
            lr: 0.1,
            weight_decay: 0.01,
            grad_clip: 0.0,
            ..Default::default()
        };
        let mut opt = AdamW::new(vec![("p".into(), var.clone())], cfg).unwrap();
        let (mut m, mut v, mut p) = ([0.0f64; 2], [0.0f64; 2], p0);
        for t in 1..=2 {
            // loss = sum(p^2) / 2 + sum(p): grad = p + 1
            let loss = ((var.as_tensor().sqr().unwrap().sum_all().unwrap() * 0.5).unwrap()
                + var.as_tensor().sum_all().unwrap())
            .unwrap();
            let mut acc = GradAccum::default();
            acc.add(&[("p".into(), var.clone())], &loss.backward().unwrap())
                .unwrap();
            opt.step(&acc).unwrap();
            for i in 0..2 {
                let g = p[i] + 1.0;
                m[i] = 0.9 * m[i] + 0.1 * g;
                v[i] = 0.999 * v[i] + 0.001 * g * g;
                let mh = m[i] / (1.0 - 0.9f64.powi(t));
                let vh = v[i] / (1.0 - 0.999f64.powi(t));
                p[i] -= 0.1 * (mh / (vh.sqrt() + 1e-8) + 0.01 * p[i]);
            }
        }
        let got: Vec<f32> = var.as_tensor().to_vec1().unwrap();
        for i in 0..2 {
            assert!((got[i] as f64 - p[i]).abs() < 1e-5, "{got:?} vs {p:?}");
        }
    }

    /// A group's parameters take their own learning rate and are clipped
    /// by their own norm; the others are untouched by the group's settings.
    #[test]
    fn group_has_its_own_lr_and_clip() {
        let dev = Device::Cpu;
        let a = Var::new(&[0f32, 0.0], &dev).unwrap();
        let b = Var::new(&[0f32, 0.0], &dev).unwrap();
        let vars = vec![
            ("policy.a".to_string(), a.clone()),
            ("critic.b".to_string(), b.clone()),
        ];
        let cfg = AdamWConfig {
            lr: 0.1,
            grad_clip: 100.0,
            ..Default::default()
        };
        let group = ParamGroup {
            prefix: "critic.".into(),
            lr: 0.01,
            grad_clip: 1.0,
        };
        let mut opt = AdamW::new(vars.clone(), cfg).unwrap();
        opt.set_group(group);
        // loss = 3 a0 + 4 a1 + 30 b0 + 40 b1: norms 5 and 50.
        let w = Tensor::new(&[3f32, 4.0], &dev).unwrap();
        let loss = ((a.as_tensor() * &w).unwrap().sum_all().unwrap()
            + (b.as_tensor() * (&w * 10.0).unwrap())
                .unwrap()
                .sum_all()
                .unwrap())
        .unwrap();
        let mut acc = GradAccum::default();
        acc.add(&vars, &loss.backward().unwrap()).unwrap();
        let s = opt.step(&acc).unwrap();
        assert!((s.grad_norm - 5.0).abs() < 1e-5);
        let (glr, gnorm) = s.group.unwrap();
        assert!((glr - 0.01).abs() < 1e-12 && (gnorm - 50.0).abs() < 1e-4);
        // Adam's first step moves each coordinate by ~lr * sign(g),
        // whatever the clip scale.
        let a1: Vec<f32> = a.as_tensor().to_vec1().unwrap();
        let b1: Vec<f32> = b.as_tensor().to_vec1().unwrap();
        for (x, y) in a1.iter().zip(&b1) {
            assert!((x + 0.1).abs() < 1e-4, "{a1:?}");
            assert!((y + 0.01).abs() < 1e-4, "{b1:?}");
        }
    }

    /// Group-only steps move the group's parameters with their own step
    /// count (bias corrections of steps 2 and 3 after one full step) and
    /// leave the other parameters, their moments and the schedule alone.
    #[test]
    fn group_steps_move_only_the_group() {
        let dev = Device::Cpu;
        let a = Var::new(&[1f32], &dev).unwrap();
        let b = Var::new(&[1f32], &dev).unwrap();
        let vars = vec![
            ("policy.a".to_string(), a.clone()),
            ("critic.b".to_string(), b.clone()),
        ];
        let cfg = AdamWConfig {
            lr: 0.1,
            weight_decay: 0.0,
            grad_clip: 0.0,
            ..Default::default()
        };
        let mut opt = AdamW::new(vars.clone(), cfg).unwrap();
        opt.set_group(ParamGroup {
            prefix: "critic.".into(),
            lr: 0.05,
            grad_clip: 0.0,
        });
        // loss = a^2 / 2 + b^2 / 2: grads a and b.
        let grads = |opt: &AdamW| {
            let loss = ((a.as_tensor().sqr().unwrap() + b.as_tensor().sqr().unwrap()).unwrap()
                * 0.5)
                .unwrap()
                .sum_all()
                .unwrap();
            let mut acc = GradAccum::default();
            acc.add(opt.vars(), &loss.backward().unwrap()).unwrap();
            acc
        };
        let (mut m, mut v, mut x) = (0.0f64, 0.0f64, 1.0f64);
        let mut reference = |t: i32, lr: f64| {
            let g = x;
            m = 0.9 * m + 0.1 * g;
            v = 0.999 * v + 0.001 * g * g;
            x -= lr * (m / (1.0 - 0.9f64.powi(t))) / ((v / (1.0 - 0.999f64.powi(t))).sqrt() + 1e-8);
        };
        let acc = grads(&opt);
        opt.step(&acc).unwrap();
        reference(1, 0.05);
        let a1 = a.as_tensor().to_vec1::<f32>().unwrap()[0];
        for t in 2..=3 {
            let acc = grads(&opt);
            opt.step_group(&acc).unwrap();
            reference(t, 0.05);
        }
        assert_eq!((opt.steps_done(), opt.group_steps_done()), (1, 3));
        assert_eq!(a.as_tensor().to_vec1::<f32>().unwrap()[0], a1);
        let got = b.as_tensor().to_vec1::<f32>().unwrap()[0] as f64;
        assert!((got - x).abs() < 1e-5, "{got} vs {x}");
        // Without a group there is nothing to step alone.
        let mut plain =
            AdamW::new(vec![("p".into(), Var::new(&[0f32], &dev).unwrap())], cfg).unwrap();
        assert!(plain.step_group(&GradAccum::default()).is_err());
    }

    /// Parameters go to ranks in contiguous runs of about equal size.
    #[test]
    fn shards_split_the_parameters_by_size() {
        assert_eq!(shard_owners(&[10, 10, 10, 10], 2), vec![0, 0, 1, 1]);
        assert_eq!(shard_owners(&[10, 10, 10, 10], 4), vec![0, 1, 2, 3]);
        assert_eq!(shard_owners(&[100, 1, 1], 2), vec![0, 1, 1]);
        assert_eq!(shard_owners(&[3, 3, 3], 1), vec![0, 0, 0]);
        assert_eq!(shard_owners(&[1, 1], 8), vec![0, 4]);
    }

    /// A sharded rank keeps and updates only its own parameters' moments.
    #[test]
    fn a_shard_steps_only_its_parameters() {
        let dev = Device::Cpu;
        let a = Var::new(&[1f32, 1.0], &dev).unwrap();
        let b = Var::new(&[1f32, 1.0], &dev).unwrap();
        let vars = vec![("a".to_string(), a.clone()), ("b".to_string(), b.clone())];
        let mut opt = AdamW::new(vars.clone(), AdamWConfig::default()).unwrap();
        opt.shard(1, 2).unwrap();
        assert!(opt.is_sharded());
        let (state, _) = opt.state();
        let mut keys: Vec<&String> = state.keys().collect();
        keys.sort();
        assert_eq!(keys, ["m.b", "v.b"]);
        let loss = (a.as_tensor().sum_all().unwrap() + b.as_tensor().sum_all().unwrap()).unwrap();
        let mut acc = GradAccum::default();
        acc.add(&vars, &loss.backward().unwrap()).unwrap();
        opt.step(&acc).unwrap();
        assert_eq!(a.as_tensor().to_vec1::<f32>().unwrap(), [1.0, 1.0]);
        assert!(b.as_tensor().to_vec1::<f32>().unwrap()[0] < 1.0);
        // A group of one is left whole.
        let mut whole = AdamW::new(vars, AdamWConfig::default()).unwrap();
        whole.shard(0, 1).unwrap();
        assert!(!whole.is_sharded());
    }

    #[test]
    fn schedule_warms_up_then_decays() {
        let var = Var::new(&[0f32], &Device::Cpu).unwrap();
        let cfg = AdamWConfig {
            lr: 1.0,
            warmup_steps: 10,
            total_steps: 110,
            min_lr_ratio: 0.1,
            ..Default::default()
        };
        let opt = AdamW::new(vec![("p".into(), var)], cfg).unwrap();
        assert!((opt.lr_at(5) - 0.5).abs() < 1e-12);
        assert!((opt.lr_at(10) - 1.0).abs() < 1e-12);
        assert!((opt.lr_at(60) - 0.55).abs() < 1e-12);
        assert!((opt.lr_at(110) - 0.1).abs() < 1e-12);
    }
}
