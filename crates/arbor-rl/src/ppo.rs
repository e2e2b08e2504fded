//! PPO objective pieces on plain arrays, with analytic gradients.
//!
//! These are the CPU reference the CUDA loss kernels are tested against: a
//! batch is a flat array of tokens cut into sequences by `seq_lens`, with a
//! per-token loss weight `mask` (1 for trained tokens, 0 for masked ones).
//! Inputs may be `f32` or `f64`; everything is accumulated in `f64`.
//!
//! Per token, with `rho = exp(logp_new - logp_old)`:
//!
//! ```text
//! clipped surrogate  l_pg = -min(rho*A, clip(rho, 1-eps_low, 1+eps_high)*A)
//!                    dl_pg/dlogp_new = -A*rho   unless the clipped branch is active, then 0
//! KL to a reference  k1 = logp - logp_ref                 dk1/dlogp = 1
//!                    k2 = (logp - logp_ref)^2 / 2         dk2/dlogp = logp - logp_ref
//!                    k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1
//!                                                         dk3/dlogp = 1 - exp(logp_ref - logp)
//! token loss         l = l_pg + beta * k
//! value loss         l_v = max((v - R)^2, (v_c - R)^2) / 2,  v_c = v_old + clip(v - v_old, -eps_v, eps_v)
//!                    dl_v/dv = v - R   unless the clipped term is strictly larger and
//!                                      |v - v_old| > eps_v, then 0
//! ```
//!
//! The batch loss is `L = sum_t w_t * l_t` with aggregation weights `w`
//! ([`Aggregation`]), so `dL/dx_t = w_t * dl_t/dx_t`.

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

/// Estimator of the KL divergence to the reference policy, per token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlEstimator {
    K1,
    K2,
    K3,
}

impl KlEstimator {
    /// `(k, dk/dlogp)` at `logp` (new policy) against `logp_ref`.
    pub fn eval(self, logp: f64, logp_ref: f64) -> (f64, f64) {
        let d = logp - logp_ref;
        match self {
            KlEstimator::K1 => (d, 1.0),
            KlEstimator::K2 => (0.5 * d * d, d),
            KlEstimator::K3 => {
                let r = (-d).exp();
                (r + d - 1.0, 1.0 - r)
            }
        }
    }
}

/// KL penalty `beta * k` added to every trained token's loss.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct KlPenalty {
    /// How the per-token KL is estimated.
    pub estimator: KlEstimator,
    /// Weight `beta >= 0` of the penalty.
    pub beta: f64,
}

/// Settings of the policy loss.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PolicyLossConfig {
    /// Lower clip `eps_low` (ratio floor `1 - eps_low`).
    pub eps_low: f64,
    /// Upper clip `eps_high` (ratio ceiling `1 + eps_high`); larger than
    /// `eps_low` is DAPO's clip-higher.
    pub eps_high: f64,
    /// How per-token losses become one batch loss.
    pub aggregation: Aggregation,
    /// Optional KL penalty to the behaviour policy.
    pub kl: Option<KlPenalty>,
}

impl Default for PolicyLossConfig {
    fn default() -> Self {
        PolicyLossConfig {
            eps_low: 0.2,
            eps_high: 0.2,
            aggregation: Aggregation::TokenMean,
            kl: None,
        }
    }
}

/// A batch of token arrays (all of the same length) cut into sequences.
#[derive(Clone, Copy, Debug)]
pub struct TokenBatch<'a, T> {
    pub mask: &'a [T],
    /// Lengths of the sequences, summing to the array length.
    pub seq_lens: &'a [usize],
}

/// Loss value, gradient with respect to the optimised input, statistics.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossOutput {
    pub loss: f64,
    /// `dL/dx_t` for every token.
    pub grad: Vec<f64>,
    /// Weighted fraction of trained tokens on the clipped branch.
    pub clip_fraction: f64,
    /// Policy loss: weighted mean of `k3(old || new)` (the usual
    /// `approx_kl` monitor); value loss: weighted mean squared error.
    pub monitor: f64,
}

fn f<T: Copy + Into<f64>>(x: &[T], i: usize) -> f64 {
    x[i].into()
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

/// Aggregation weights after checking every input array: the right
/// length, and finite wherever the weight is non-zero.
fn weights_for<T: Copy + Into<f64>>(
    agg: Aggregation,
    batch: &TokenBatch<'_, T>,
    inputs: &[(&'static str, &[T])],
) -> Result<Vec<f64>> {
    let n = batch.mask.len();
    for (what, x) in inputs {
        if x.len() != n {
            return Err(RlError::input(
                what,
                format!("length {} != {n} tokens", x.len()),
            ));
        }
    }
    let w = aggregation_weights(agg, batch)?;
    for (what, x) in inputs {
        if let Some(i) = x
            .iter()
            .zip(&w)
            .position(|(v, w)| *w > 0.0 && !(*v).into().is_finite())
        {
            return Err(RlError::input(what, format!("token {i} is not finite")));
        }
    }
    Ok(w)
}

/// One token's contribution: loss, derivative, whether it was clipped, and
/// the monitored quantity.
struct TokenTerm {
    loss: f64,
    grad: f64,
    clipped: bool,
    monitor: f64,
}

/// `L = sum_t w_t l_t`, `dL/dx_t = w_t dl_t/dx_t`, with weighted means of
/// the clip indicator and the monitor over the trained tokens.
fn accumulate(w: &[f64], mut term: impl FnMut(usize) -> TokenTerm) -> LossOutput {
    let mut out = LossOutput {
        loss: 0.0,
        grad: vec![0.0; w.len()],
        clip_fraction: 0.0,
        monitor: 0.0,
    };
    let wsum: f64 = w.iter().sum();
    for (t, &wt) in w.iter().enumerate() {
        if wt == 0.0 {
            continue;
        }
        let x = term(t);
        out.loss += wt * x.loss;
        out.grad[t] = wt * x.grad;
        out.monitor += wt * x.monitor;
        if x.clipped {
            out.clip_fraction += wt;
        }
    }
    if wsum > 0.0 {
        out.clip_fraction /= wsum;
        out.monitor /= wsum;
    }
    out
}

/// Clipped-surrogate policy loss (plus optional KL penalty) and its
/// gradient with respect to `logp_new`. `logp_ref` is required iff
/// `cfg.kl` is set. Masked tokens may hold anything, NaN included.
pub fn policy_loss<T: Copy + Into<f64>>(
    cfg: &PolicyLossConfig,
    logp_new: &[T],
    logp_old: &[T],
    advantages: &[T],
    logp_ref: Option<&[T]>,
    batch: &TokenBatch<'_, T>,
) -> Result<LossOutput> {
    check_range("eps_low", cfg.eps_low, 0.0, 1.0)?;
    check_range("eps_high", cfg.eps_high, 0.0, f64::MAX)?;
    let kl = match (cfg.kl, logp_ref) {
        (Some(k), Some(r)) => {
            check_range("kl.beta", k.beta, 0.0, f64::MAX)?;
            Some((k, r))
        }
        (None, None) => None,
        (Some(_), None) => {
            return Err(RlError::input(
                "logp_ref",
                "the KL penalty needs reference log-probs",
            ))
        }
        (None, Some(_)) => {
            return Err(RlError::input(
                "logp_ref",
                "given but no KL penalty is configured",
            ))
        }
    };
    let mut inputs = vec![
        ("logp_new", logp_new),
        ("logp_old", logp_old),
        ("advantages", advantages),
    ];
    if let Some((_, r)) = kl {
        inputs.push(("logp_ref", r));
    }
    let w = weights_for(cfg.aggregation, batch, &inputs)?;
    let (lo, hi) = (1.0 - cfg.eps_low, 1.0 + cfg.eps_high);
    Ok(accumulate(&w, |t| {
        let (lp, a) = (f(logp_new, t), f(advantages, t));
        let log_ratio = lp - f(logp_old, t);
        let rho = log_ratio.exp();
        let clipped = (a > 0.0 && rho > hi) || (a < 0.0 && rho < lo);
        let (mut loss, mut grad) = if clipped {
            (-rho.clamp(lo, hi) * a, 0.0)
        } else {
            (-rho * a, -rho * a)
        };
        if let Some((k, r)) = kl {
            let (kv, kg) = k.estimator.eval(lp, f(r, t));
            loss += k.beta * kv;
            grad += k.beta * kg;
        }
        TokenTerm {
            loss,
            grad,
            clipped,
            monitor: (-log_ratio).exp() + log_ratio - 1.0,
        }
    }))
}

/// Value loss with optional clipping around the old values, and its
/// gradient with respect to `values`.
pub fn value_loss<T: Copy + Into<f64>>(
    clip: Option<f64>,
    aggregation: Aggregation,
    values: &[T],
    old_values: &[T],
    returns: &[T],
    batch: &TokenBatch<'_, T>,
) -> Result<LossOutput> {
    if let Some(e) = clip {
        check_range("value_clip", e, 0.0, f64::MAX)?;
    }
    let inputs = [
        ("values", values),
        ("old_values", old_values),
        ("returns", returns),
    ];
    let w = weights_for(aggregation, batch, &inputs)?;
    Ok(accumulate(&w, |t| {
        let (v, ret) = (f(values, t), f(returns, t));
        let plain = (v - ret) * (v - ret);
        let term = |loss, grad, clipped| TokenTerm {
            loss,
            grad,
            clipped,
            monitor: plain,
        };
        match clip {
            Some(e) => {
                let old = f(old_values, t);
                let vc = old + (v - old).clamp(-e, e);
                let cl = (vc - ret) * (vc - ret);
                if cl > plain && (v - old).abs() > e {
                    term(0.5 * cl, 0.0, true)
                } else {
                    term(0.5 * plain.max(cl), v - ret, false)
                }
            }
            None => term(0.5 * plain, v - ret, false),
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const H: f64 = 1e-6;

    /// Central finite differences of `loss(x)` at every coordinate.
    fn fd(x: &[f64], loss: impl Fn(&[f64]) -> f64) -> Vec<f64> {
        (0..x.len())
            .map(|i| {
                let (mut p, mut m) = (x.to_vec(), x.to_vec());
                p[i] += H;
                m[i] -= H;
                (loss(&p) - loss(&m)) / (2.0 * H)
            })
            .collect()
    }

    /// (seq_lens, x, shift, advantages/returns, reference, mask)
    type Batch = (Vec<usize>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>);

    fn batch_strategy() -> impl Strategy<Value = Batch> {
        prop::collection::vec(1usize..5, 1..4).prop_flat_map(|lens| {
            let n: usize = lens.iter().sum();
            (
                Just(lens),
                prop::collection::vec(-2.0f64..-0.05, n),
                prop::collection::vec(-0.4f64..0.4, n),
                prop::collection::vec(-2.0f64..2.0, n),
                prop::collection::vec(-2.0f64..-0.05, n),
                prop::collection::vec(prop::sample::select(vec![0.0, 1.0, 1.0, 0.5]), n),
            )
        })
    }

    fn aggregations() -> impl Strategy<Value = Aggregation> {
        prop_oneof![
            Just(Aggregation::TokenMean),
            Just(Aggregation::SequenceMean),
            Just(Aggregation::TokenSum { normalizer: 7.0 }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]
        #[test]
        fn policy_gradient_matches_finite_differences(
            (lens, new, shift, adv, reff, mask) in batch_strategy(),
            agg in aggregations(),
            est in prop::sample::select(vec![None, Some(KlEstimator::K1), Some(KlEstimator::K2), Some(KlEstimator::K3)]),
        ) {
            let old: Vec<f64> = new.iter().zip(&shift).map(|(n, s)| n - s).collect();
            let cfg = PolicyLossConfig {
                eps_low: 0.2,
                eps_high: 0.28,
                aggregation: agg,
                kl: est.map(|estimator| KlPenalty { estimator, beta: 0.3 }),
            };
            let batch = TokenBatch { mask: &mask, seq_lens: &lens };
            let r = est.map(|_| reff.as_slice());
            // Skip points within the FD step of a clip kink.
            let near_kink = shift.iter().any(|s| {
                let rho = s.exp();
                (rho - 0.8).abs() < 1e-4 || (rho - 1.28).abs() < 1e-4
            });
            prop_assume!(!near_kink);
            let out = policy_loss(&cfg, &new, &old, &adv, r, &batch).unwrap();
            let num = fd(&new, |x| policy_loss(&cfg, x, &old, &adv, r, &batch).unwrap().loss);
            for (a, b) in out.grad.iter().zip(&num) {
                prop_assert!((a - b).abs() < 1e-6 * (1.0 + b.abs()), "{a} vs {b}");
            }
        }

        #[test]
        fn value_gradient_matches_finite_differences(
            (lens, v, shift, ret, _r, mask) in batch_strategy(),
            agg in aggregations(),
            clip in prop::option::of(0.05f64..0.3),
        ) {
            let old: Vec<f64> = v.iter().zip(&shift).map(|(v, s)| v - s).collect();
            let batch = TokenBatch { mask: &mask, seq_lens: &lens };
            if let Some(e) = clip {
                // Skip kinks: |v - old| = e, or the two squared errors equal.
                prop_assume!(shift.iter().all(|s| (s.abs() - e).abs() > 1e-4));
                let ties = v.iter().zip(&old).zip(&ret).any(|((v, o), r)| {
                    let vc = o + (v - o).clamp(-e, e);
                    ((vc - r).powi(2) - (v - r).powi(2)).abs() < 1e-4
                });
                prop_assume!(!ties);
            }
            let out = value_loss(clip, agg, &v, &old, &ret, &batch).unwrap();
            let num = fd(&v, |x| value_loss(clip, agg, x, &old, &ret, &batch).unwrap().loss);
            for (a, b) in out.grad.iter().zip(&num) {
                prop_assert!((a - b).abs() < 1e-6 * (1.0 + b.abs()), "{a} vs {b}");
            }
        }
    }

    #[test]
    fn clip_higher_is_asymmetric() {
        let cfg = PolicyLossConfig {
            eps_low: 0.2,
            eps_high: 0.28,
            ..Default::default()
        };
        let batch = TokenBatch {
            mask: &[1.0f64, 1.0],
            seq_lens: &[2],
        };
        // rho = 1.25 with A > 0: inside [0.8, 1.28], so not clipped.
        let lr = 1.25f64.ln();
        let out = policy_loss(&cfg, &[lr, lr], &[0.0, 0.0], &[1.0, 1.0], None, &batch).unwrap();
        assert_eq!(out.clip_fraction, 0.0);
        assert!((out.loss + 1.25).abs() < 1e-12);
        // rho = 1.3 > 1.28: clipped, zero gradient, loss -1.28 A.
        let lr = 1.3f64.ln();
        let out = policy_loss(&cfg, &[lr, 0.0], &[0.0, 0.0], &[1.0, 0.0], None, &batch).unwrap();
        assert_eq!(out.grad[0], 0.0);
        assert!((out.loss + 0.5 * 1.28).abs() < 1e-12);
        assert!((out.clip_fraction - 0.5).abs() < 1e-12);
        // rho = 0.75 < 0.8 with A < 0: clipped at 0.8.
        let lr = 0.75f64.ln();
        let out = policy_loss(&cfg, &[lr, lr], &[0.0, 0.0], &[-1.0, -1.0], None, &batch).unwrap();
        assert!((out.loss - 0.8).abs() < 1e-12 && out.grad == vec![0.0, 0.0]);
    }

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
        // f32 inputs work the same.
        let z = [0.0f32; 4];
        let out = policy_loss(
            &PolicyLossConfig::default(),
            &z,
            &z,
            &[1.0f32, 2.0, 3.0, 4.0],
            None,
            &b,
        )
        .unwrap();
        assert!((out.loss + 2.5).abs() < 1e-6);
    }

    #[test]
    fn kl_estimators_at_known_points() {
        for e in [KlEstimator::K1, KlEstimator::K2, KlEstimator::K3] {
            assert_eq!(e.eval(-1.0, -1.0).0, 0.0);
        }
        let (k3, _) = KlEstimator::K3.eval(-1.0, -2.0);
        assert!((k3 - ((-1.0f64).exp() + 1.0 - 1.0)).abs() < 1e-12);
        assert!(k3 > 0.0);
    }

    #[test]
    fn bad_inputs_are_errors() {
        let cfg = PolicyLossConfig::default();
        let m = [1.0f64, 1.0];
        let b = TokenBatch {
            mask: &m,
            seq_lens: &[1],
        };
        let x = [0.0f64, 0.0];
        assert!(policy_loss(&cfg, &x, &x, &x, None, &b).is_err(), "seq_lens");
        let b = TokenBatch {
            mask: &m,
            seq_lens: &[2],
        };
        assert!(
            policy_loss(&cfg, &x[..1], &x, &x, None, &b).is_err(),
            "length"
        );
        assert!(
            policy_loss(&cfg, &x, &x, &[f64::NAN, 0.0], None, &b).is_err(),
            "NaN"
        );
        assert!(
            policy_loss(&cfg, &x, &x, &x, Some(&x), &b).is_err(),
            "ref without KL"
        );
        let kl = PolicyLossConfig {
            kl: Some(KlPenalty {
                estimator: KlEstimator::K3,
                beta: 0.1,
            }),
            ..cfg
        };
        assert!(
            policy_loss(&kl, &x, &x, &x, None, &b).is_err(),
            "KL without ref"
        );
        let neg = TokenBatch {
            mask: &[-1.0f64, 1.0],
            seq_lens: &[2],
        };
        assert!(value_loss(None, Aggregation::TokenMean, &x, &x, &x, &neg).is_err());
        // Masked NaNs are ignored.
        let half = TokenBatch {
            mask: &[0.0f64, 1.0],
            seq_lens: &[2],
        };
        assert!(policy_loss(&cfg, &[f64::NAN, 0.0], &x, &x, None, &half).is_ok());
    }
}
