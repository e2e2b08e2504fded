//! The critic: a scalar value head on the final hidden state, either on the
//! policy's own trunk or on a separate backbone copy.

use candle_core::{DType, Module, Tensor};
use serde::{Deserialize, Serialize};

use crate::config::ModelConfig;
use crate::error::Result;
use crate::model::{accum_dtype, Linear, Transformer, INIT_STD};
use crate::weights::{Init, ParamLoader};

/// `V(s_t) = w . h_t + b` for final hidden states `h: [B, T, H]` -> `[B, T]`.
#[derive(Debug, Clone)]
pub struct ValueHead {
    pub linear: Linear,
}

impl ValueHead {
    /// Loads `value_head.weight` `[1, H]` / `value_head.bias` `[1]` when the
    /// checkpoint has them; otherwise initialises `N(0, 0.02^2)` / zero.
    pub fn load(p: &ParamLoader<'_>, hidden: usize) -> Result<Self> {
        Ok(ValueHead {
            linear: Linear::new(
                p.get_or_init("value_head.weight", &[1, hidden], Init::Normal(INIT_STD))?,
                Some(p.get_or_init("value_head.bias", &[1], Init::Zeros)?),
            ),
        })
    }

    /// `[B, T, H]` -> `[B, T]`, in f32 (f64 for f64 models). Half-precision
    /// hidden states under f32 head weights (mixed precision) are read in
    /// f32, so the values carry no bf16 rounding.
    pub fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        let acc = accum_dtype(hidden.dtype());
        let hidden = if self.linear.weight.dtype() == acc && hidden.dtype() != acc {
            hidden.to_dtype(acc)?
        } else {
            hidden.clone()
        };
        let v = self
            .linear
            .forward(&hidden)?
            .squeeze(candle_core::D::Minus1)?;
        Ok(v.to_dtype(acc)?)
    }
}

/// Where the critic's hidden states come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum CriticMode {
    /// The value head reads the policy's final hidden state: one forward,
    /// policy and value losses both reach the trunk.
    #[default]
    Shared,
    /// The critic has its own copy of the backbone, trained only by the
    /// value loss: loaded from the critic's own checkpoint, else from the
    /// policy's; a randomly initialised policy's critic is initialised
    /// from another seed.
    Separate,
}

/// Policy plus critic.
#[derive(Debug, Clone)]
pub struct ActorCritic {
    pub policy: Transformer,
    /// `Some` in [`CriticMode::Separate`].
    pub critic_backbone: Option<Transformer>,
    pub value_head: ValueHead,
}

impl ActorCritic {
    /// `policy` loads the policy weights; in `Separate` mode the backbone is
    /// loaded again through `critic` (its own parameters), which also holds
    /// the value head. In `Shared` mode the value head comes from `critic`
    /// too, so policy and critic parameters can be optimised separately.
    pub fn load(
        cfg: &ModelConfig,
        mode: CriticMode,
        policy: &ParamLoader<'_>,
        critic: &ParamLoader<'_>,
    ) -> Result<Self> {
        let policy_model = Transformer::load(cfg, policy)?;
        let critic_backbone = match mode {
            CriticMode::Shared => None,
            CriticMode::Separate => Some(Transformer::load(cfg, critic)?),
        };
        Ok(ActorCritic {
            policy: policy_model,
            critic_backbone,
            value_head: ValueHead::load(critic, cfg.hidden_size)?,
        })
    }

    /// The policy's backbone, and the critic's own when it has one.
    fn backbones_mut(&mut self) -> impl Iterator<Item = &mut Transformer> {
        std::iter::once(&mut self.policy).chain(self.critic_backbone.as_mut())
    }

    /// Mixed precision for the training forward of the policy and the
    /// critic's backbone ([`Transformer::set_train_dtype`]); the value head
    /// reads their hidden states in f32 and returns f32 values.
    pub fn set_train_dtype(&mut self, dt: Option<DType>) -> Result<()> {
        self.backbones_mut().try_for_each(|t| t.set_train_dtype(dt))
    }

    /// [`Transformer::set_mixed_precision`] for the policy and the
    /// critic's backbone.
    pub fn set_mixed_precision(&mut self, on: bool) -> Result<()> {
        self.backbones_mut()
            .try_for_each(|t| t.set_mixed_precision(on))
    }

    pub fn mode(&self) -> CriticMode {
        if self.critic_backbone.is_some() {
            CriticMode::Separate
        } else {
            CriticMode::Shared
        }
    }

    /// Policy hidden states `[B, T, H]` and values `[B, T]` for `ids: [B, T]`.
    pub fn forward(&self, ids: &Tensor) -> Result<(Tensor, Tensor)> {
        let h = self.policy.forward_hidden(ids)?;
        let values = match &self.critic_backbone {
            None => self.value_head.forward(&h)?,
            Some(c) => self.value_head.forward(&c.forward_hidden(ids)?)?,
        };
        Ok((h, values))
    }

    /// Policy hidden states `[N, H]` and values `[N]` for sequences packed
    /// back to back (`ids: [N]`, `seq_lens` summing to `N`).
    pub fn forward_packed(&self, ids: &Tensor, seq_lens: &[usize]) -> Result<(Tensor, Tensor)> {
        let h = self.policy.forward_packed(ids, seq_lens)?;
        let values = match &self.critic_backbone {
            None => self.value_head.forward(&h)?,
            Some(c) => self.value_head.forward(&c.forward_packed(ids, seq_lens)?)?,
        };
        Ok((h, values))
    }

    /// Values `[N]` only, for packed sequences: with a separate backbone
    /// the policy is not run.
    pub fn values_packed(&self, ids: &Tensor, seq_lens: &[usize]) -> Result<Tensor> {
        let backbone = self.critic_backbone.as_ref().unwrap_or(&self.policy);
        self.value_head
            .forward(&backbone.forward_packed(ids, seq_lens)?)
    }

    /// Values `[B, T]` only: with a separate backbone the policy is not run.
    pub fn values(&self, ids: &Tensor) -> Result<Tensor> {
        let backbone = self.critic_backbone.as_ref().unwrap_or(&self.policy);
        self.value_head.forward(&backbone.forward_hidden(ids)?)
    }
}
