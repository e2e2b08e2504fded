//! How per-token PPO losses become one batch loss: the aggregation weights.
//!
//! The losses themselves (clipped surrogate with asymmetric clip, clipped
//! value loss, their gradients) are `arbor-ops` kernels (`ppo_loss`,
//! `value_loss`: a CPU op and a CUDA kernel) that take one weight per
//! token; this module computes those weights. A batch is a flat array of
//! tokens cut into sequences by `seq_lens`, with a per-token mask `m`
//! (1 for trained tokens, 0 for masked ones: prompts, observations,
//! replayed prefixes). The batch loss is `L = sum_t w_t l_t`.

use serde::{Deserialize, Serialize};

use crate::error::{check_range, Result, RlError};

/// How per-token losses become one batch loss.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Aggregation {
    /// Token level (DAPO): `w_t = m_t / sum_all m`; every trained token
    /// counts the same, long sequences weigh more.
    #[default]
    TokenMean,
    /// Sequence level (original GRPO): mean over sequences of each
    /// sequence's token mean, `w_t = m_t / (S * sum_{t' in seq(t)} m_t')`,
    /// `S` = sequences with a non-zero mask.
    SequenceMean,
    /// Sum divided by a constant (Dr. GRPO): `w_t = m_t / normalizer`.
    TokenSum { normalizer: f64 },
}

/// Settings of the clipped policy loss
/// `l_t = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)`,
/// `rho = exp(logp_new - logp_old)`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyLossConfig {
    /// Lower clip `eps_low` (ratio floor `1 - eps_low`), in `[0, 1]`.
    pub eps_low: f64,
    /// Upper clip `eps_high` (ratio ceiling `1 + eps_high`), `>= 0`; larger
    /// than `eps_low` is DAPO's clip-higher.
    pub eps_high: f64,
    /// How per-token losses become one batch loss.
    pub aggregation: Aggregation,
}

impl Default for PolicyLossConfig {
    fn default() -> Self {
        PolicyLossConfig {
            eps_low: 0.2,
            eps_high: 0.2,
            aggregation: Aggregation::TokenMean,
        }
    }
}

impl PolicyLossConfig {
    /// Check the clip ranges and the normaliser.
    pub fn validate(&self) -> Result<()> {
        check_range("eps_low", self.eps_low, 0.0, 1.0)?;
        check_range("eps_high", self.eps_high, 0.0, f64::MAX)?;
        if let Aggregation::TokenSum { normalizer } = self.aggregation {
            if !(normalizer.is_finite() && normalizer > 0.0) {
                return Err(RlError::config(
                    "aggregation.normalizer",
                    format!("{normalizer} must be finite and > 0"),
                ));
            }
        }
        Ok(())
    }
}

/// A batch of token arrays (all of the same length) cut into sequences.
#[derive(Clone, Copy, Debug)]
pub struct TokenBatch<'a, T> {
    pub mask: &'a [T],
    /// Lengths of the sequences, summing to the array length.
    pub seq_lens: &'a [usize],
}

/// Aggregation weights `w_t` for a batch.
pub fn aggregation_weights<T: Copy + Into<f64>>(
    agg: Aggregation,
    batch: &TokenBatch<'_, T>,
) -> Result<Vec<f64>> {
    let n = batch.mask.len();
    let total: usize = batch.seq_lens.iter().sum();
    if total != n {
        return Err(RlError::input(
            "seq_lens",
            format!("sum to {total}, but the arrays have {n} tokens"),
        ));
    }
    let mask: Vec<f64> = batch.mask.iter().map(|&m| m.into()).collect();
    if let Some((i, m)) = mask
        .iter()
        .enumerate()
        .find(|(_, m)| !(m.is_finite() && **m >= 0.0))
    {
        return Err(RlError::input(
            "mask",
            format!("token {i}: weight {m} is not finite and >= 0"),
        ));
    }
    let mut w = vec![0.0; n];
    match agg {
        Aggregation::TokenMean => {
            let s: f64 = mask.iter().sum();
            if s > 0.0 {
                w.iter_mut().zip(&mask).for_each(|(w, m)| *w = m / s);
            }
        }
        Aggregation::SequenceMean => {
            let mut start = 0;
            let mut sums = Vec::with_capacity(batch.seq_lens.len());
            for &l in batch.seq_lens {
                sums.push((start, l, mask[start..start + l].iter().sum::<f64>()));
                start += l;
            }
            let live = sums.iter().filter(|s| s.2 > 0.0).count() as f64;
            for (start, l, s) in sums.into_iter().filter(|s| s.2 > 0.0) {
                for t in start..start + l {
                    w[t] = mask[t] / (live * s);
                }
            }
        }
        Aggregation::TokenSum { normalizer } => {
            if !(normalizer.is_finite() && normalizer > 0.0) {
                return Err(RlError::config(
                    "aggregation.normalizer",
                    format!("{normalizer} must be finite and > 0"),
                ));
            }
            w.iter_mut()
                .zip(&mask)
                .for_each(|(w, m)| *w = m / normalizer);
        }
    }
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_vs_sequence_aggregation() {
        let mask = [1.0f32, 1.0, 1.0, 1.0];
        let lens = [1usize, 3];
        let b = TokenBatch {
            mask: &mask,
            seq_lens: &lens,
        };
        let w = aggregation_weights(Aggregation::TokenMean, &b).unwrap();
        assert_eq!(w, vec![0.25; 4]);
        let w = aggregation_weights(Aggregation::SequenceMean, &b).unwrap();
        assert!((w[0] - 0.5).abs() < 1e-12 && (w[1] - 1.0 / 6.0).abs() < 1e-12);
        let w = aggregation_weights(Aggregation::TokenSum { normalizer: 8.0 }, &b).unwrap();
        assert_eq!(w, vec![0.125; 4]);
    }

    #[test]
    fn masked_prefixes_and_empty_sequences_get_no_weight() {
        // A replayed prefix (masked) and a sequence with nothing trained.
        let mask = [0.0f64, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0];
        let lens = [4usize, 2, 1];
        let b = TokenBatch {
            mask: &mask,
            seq_lens: &lens,
        };
        let w = aggregation_weights(Aggregation::SequenceMean, &b).unwrap();
        assert_eq!(w, vec![0.0, 0.0, 0.25, 0.25, 0.0, 0.0, 0.5]);
        let w = aggregation_weights(Aggregation::TokenMean, &b).unwrap();
        let third = 1.0 / 3.0;
        assert_eq!(w, vec![0.0, 0.0, third, third, 0.0, 0.0, third]);
    }

    #[test]
    fn bad_inputs_are_errors() {
        let m = [1.0f64, 1.0];
        let b = TokenBatch {
            mask: &m,
            seq_lens: &[1],
        };
        assert!(
            aggregation_weights(Aggregation::TokenMean, &b).is_err(),
            "seq_lens"
        );
        let neg = TokenBatch {
            mask: &[-1.0f64, 1.0],
            seq_lens: &[2],
        };
        assert!(aggregation_weights(Aggregation::TokenMean, &neg).is_err());
        let b = TokenBatch {
            mask: &m,
            seq_lens: &[2],
        };
        let zero = Aggregation::TokenSum { normalizer: 0.0 };
        assert!(aggregation_weights(zero, &b).is_err());
        let bad = PolicyLossConfig {
            eps_low: 1.5,
            ..Default::default()
        };
        assert!(bad.validate().is_err());
        assert!(PolicyLossConfig::default().validate().is_ok());
    }
}
