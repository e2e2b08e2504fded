//! Token sampling from one row of logits.
//!
//! With temperature `T > 0` the policy distribution is
//! `pi(v) = softmax(logits / T)_v`. Top-k, top-p (nucleus) and min-p then
//! restrict the support: top-k keeps the k most likely tokens, top-p the
//! smallest most-likely set whose mass reaches `p`, min-p the tokens with
//! `pi(v) >= min_p * max_u pi(u)`; the kept mass is renormalised and one
//! uniform draw `u ~ U[0,1)` from the sequence's own RNG picks the token by
//! inverse CDF over the kept tokens in descending-probability order (ties by
//! token id). `T = 0` is greedy (argmax, lowest id on ties).
//!
//! The returned logprob is `log pi(token)` under the *tempered, untruncated*
//! distribution (`T = 1` for greedy), the behaviour logprob PPO's
//! importance ratio is computed against when the trainer recomputes
//! `log softmax(logits / T)`.

use rand::{rngs::StdRng, Rng};
use serde::{Deserialize, Serialize};

use crate::EngineError;

/// How to sample one sequence.
///
/// The cuts compose as in vLLM: over the tempered distribution `p`, top-k
/// and min-p each keep a head of the tokens in descending order (min-p
/// those with `p >= min_p * max p`), and top-p keeps the shortest head of
/// what they left whose share of it, renormalised, reaches `top_p`. The
/// token is drawn from what remains, renormalised; its returned logprob is
/// under the whole tempered distribution (`ln p`), as PPO wants it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    /// 1.0 means no nucleus cut.
    pub top_p: f32,
    /// 0.0 means no min-p cut.
    pub min_p: f32,
    /// Maximum number of generated tokens.
    pub max_tokens: usize,
    /// Generation stops after any of these tokens (it is kept in the output).
    pub stop_tokens: Vec<u32>,
    /// Generation stops once the decoded output (special tokens skipped,
    /// as `arbor generate` prints it) contains any of these.
    pub stop_strings: Vec<String>,
    /// Seed of this sequence's RNG: same seed, same tokens, whatever else is
    /// in the batch.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            max_tokens: 256,
            stop_tokens: Vec::new(),
            stop_strings: Vec::new(),
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding of at most `max_tokens`.
    pub fn greedy(max_tokens: usize) -> Self {
        SamplingParams {
            temperature: 0.0,
            max_tokens,
            ..Default::default()
        }
    }

    /// Whether top-k, top-p or min-p restrict the support (sampling then
    /// sorts the candidates, which the engine does on the host).
    pub fn has_cuts(&self) -> bool {
        self.temperature > 0.0 && (self.top_k > 0 || self.top_p < 1.0 || self.min_p > 0.0)
    }

    /// Reject nonsensical settings with an error naming the field.
    pub fn validate(&self) -> Result<(), EngineError> {
        let bad = |f: &str, v: String| Err(EngineError::InvalidParams(format!("{f} = {v}")));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad(
                "temperature",
                format!("{} (must be >= 0)", self.temperature),
            );
        }
        if self.temperature > 0.0 && !(1.0 / self.temperature).is_finite() {
            // Logits are divided by T: 1/T must be an f32 (T >= ~3e-39).
            return bad(
                "temperature",
                format!(
                    "{:e} (too small: 1/T overflows f32; 0 means greedy)",
                    self.temperature
                ),
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", format!("{} (must be in (0, 1])", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", format!("{} (must be in [0, 1])", self.min_p));
        }
        if self.max_tokens == 0 {
            return bad("max_tokens", "0 (must be >= 1)".into());
        }
        if self.stop_strings.iter().any(String::is_empty) {
            return bad("stop_strings", "an empty string".into());
        }
        Ok(())
    }
}

/// Sample one token from `logits` (length V). Returns `(token, logprob)`,
/// or `None` when the logits hold no distribution: NaN or `+inf` values (a
/// diverged model) or none above `-inf`.
pub fn sample(logits: &[f32], p: &SamplingParams, rng: &mut StdRng) -> Option<(u32, f32)> {
    let m = arbor_ops::cpu::rows::max(logits);
    // The normaliser counts the max's own exp(0) = 1: below that (or NaN),
    // some logit was NaN or infinite.
    let valid = |z: f64| m.is_finite() && z >= 1.0 && z.is_finite();
    if p.temperature == 0.0 {
        // Argmax (lowest id on ties) and its untempered log-softmax, the
        // normaliser summed in f64.
        let best = logits.iter().position(|&v| v == m)?;
        let z = arbor_ops::cpu::rows::exp_shifted(logits, m, 1.0, None);
        return valid(z).then(|| (best as u32, (logits[best] - m) - z.ln() as f32));
    }
    let inv_t = 1.0 / p.temperature;
    // Unnormalised probabilities exp((l - max) / T), their sum in f64.
    let mut w = vec![0f32; logits.len()];
    let total = arbor_ops::cpu::rows::exp_shifted(logits, m, inv_t, Some(&mut w));
    if !valid(total) {
        return None;
    }
    let u: f64 = rng.random::<f64>();
    let cut = p.top_k > 0 && p.top_k < logits.len() || p.top_p < 1.0 || p.min_p > 0.0;
    let token = if !cut {
        // Inverse CDF in id order.
        let target = u * total;
        let mut acc = 0.0;
        // Should rounding leave the running sum a hair short of the target,
        // the last token with any weight (never one of weight 0).
        let mut tok = w.iter().rposition(|&x| x > 0.0).unwrap_or(logits.len() - 1);
        for (i, &x) in w.iter().enumerate() {
            acc += x as f64;
            if acc > target {
                tok = i;
                break;
            }
        }
        tok
    } else {
        // Candidates in descending probability (ties by id). Tokens below
        // e^-40 of the max (mass < 1e-17 each) are dropped before sorting.
        let floor = (-40.0f32).exp();
        let mut idx: Vec<usize> = (0..w.len()).filter(|&i| w[i] >= floor).collect();
        idx.sort_unstable_by(|&a, &b| w[b].total_cmp(&w[a]).then(a.cmp(&b)));
        if p.top_k > 0 {
            idx.truncate(p.top_k);
        }
        if p.min_p > 0.0 {
            let thr = p.min_p * w[idx[0]];
            idx.retain(|&i| w[i] >= thr);
        }
        if p.top_p < 1.0 {
            // A share of what top-k and min-p kept, not of the whole.
            let need = p.top_p as f64 * idx.iter().map(|&i| w[i] as f64).sum::<f64>();
            let mut acc = 0.0;
            let mut keep = idx.len();
            for (n, &i) in idx.iter().enumerate() {
                acc += w[i] as f64;
                if acc >= need {
                    keep = n + 1;
                    break;
                }
            }
            idx.truncate(keep.max(1));
        }
        let kept: f64 = idx.iter().map(|&i| w[i] as f64).sum();
        let target = u * kept;
        let mut acc = 0.0;
        // The max logit's weight is exp(0) = 1, so it is always a candidate.
        let mut tok = *idx.last()?;
        for &i in &idx {
            acc += w[i] as f64;
            if acc > target {
                tok = i;
                break;
            }
        }
        tok
    };
    let lp = (w[token] as f64 / total).ln() as f32;
    Some((token as u32, lp))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn freq(logits: &[f32], p: &SamplingParams, n: usize) -> Vec<f64> {
        let mut rng = StdRng::seed_from_u64(1);
        let mut c = vec![0.0; logits.len()];
        for _ in 0..n {
            c[sample(logits, p, &mut rng).expect("finite logits").0 as usize] += 1.0 / n as f64;
        }
        c
    }

    #[test]
    fn greedy_is_argmax_with_exact_logprob() {
        let l = [0.5f32, 2.0, -1.0, 2.0];
        let (t, lp) = sample(
            &l,
            &SamplingParams::greedy(1),
            &mut StdRng::seed_from_u64(0),
        )
        .expect("finite logits");
        assert_eq!(t, 1);
        let z: f64 = l.iter().map(|&x| (x as f64).exp()).sum();
        assert!((lp as f64 - (2.0 - z.ln())).abs() < 1e-6);
    }

    #[test]
    fn frequencies_follow_the_tempered_distribution() {
        let l = [1.0f32, 0.0, -1.0, 0.5];
        let p = SamplingParams {
            temperature: 0.7,
            ..Default::default()
        };
        let f = freq(&l, &p, 200_000);
        let w: Vec<f64> = l.iter().map(|&x| (x as f64 / 0.7).exp()).collect();
        let z: f64 = w.iter().sum();
        for i in 0..4 {
            assert!(
                (f[i] - w[i] / z).abs() < 0.005,
                "{i}: {} vs {}",
                f[i],
                w[i] / z
            );
        }
        // The logprob is the tempered one.
        let (t, lp) = sample(&l, &p, &mut StdRng::seed_from_u64(3)).expect("finite logits");
        assert!((lp as f64 - (w[t as usize] / z).ln()).abs() < 1e-5);
    }

    #[test]
    fn top_k_top_p_min_p_restrict_support() {
        let l = [3.0f32, 2.0, 1.0, 0.0, -1.0];
        let w: Vec<f64> = l.iter().map(|&x| (x as f64).exp()).collect();
        let z: f64 = w.iter().sum();
        let k2 = freq(
            &l,
            &SamplingParams {
                top_k: 2,
                ..Default::default()
            },
            50_000,
        );
        assert!(k2[2] == 0.0 && k2[3] == 0.0 && k2[4] == 0.0);
        assert!((k2[0] - w[0] / (w[0] + w[1])).abs() < 0.01);
        // top_p = 0.8: p0 = 0.636, p0 + p1 = 0.870 >= 0.8, so {0, 1}.
        assert!(w[0] / z < 0.8 && (w[0] + w[1]) / z >= 0.8);
        let tp = freq(
            &l,
            &SamplingParams {
                top_p: 0.8,
                ..Default::default()
            },
            50_000,
        );
        assert!(tp[2] == 0.0 && tp[0] > 0.0 && tp[1] > 0.0);
        // min_p = 0.3: keep p >= 0.3 p_max, i.e. ids 0 and 1 (e^-1 = 0.37).
        let mp = freq(
            &l,
            &SamplingParams {
                min_p: 0.3,
                ..Default::default()
            },
            50_000,
        );
        assert!(mp[2] == 0.0 && mp[1] > 0.0);
    }

    /// The cuts together, against a float64 reference of vLLM's rule: top-p
    /// takes its share of what top-k and min-p kept (renormalised), not of
    /// the whole distribution. In both cases below a share of the whole
    /// would keep token 2 as well.
    #[test]
    fn top_p_takes_its_share_of_what_top_k_and_min_p_kept() {
        let l = [2.0f32, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5];
        let p: Vec<f64> = {
            let w: Vec<f64> = l.iter().map(|&x| (x as f64).exp()).collect();
            let z: f64 = w.iter().sum();
            w.iter().map(|x| x / z).collect()
        };
        // Kept by top-k / min-p (a descending head of `len` tokens), then
        // top-p over their renormalised share.
        let reference = |len: usize, top_p: f64| -> Vec<f64> {
            let s: f64 = p[..len].iter().sum();
            let mut acc = 0.0;
            let mut kept = Vec::new();
            for &x in &p[..len] {
                if acc < top_p {
                    kept.push(x);
                }
                acc += x / s;
            }
            let k: f64 = kept.iter().sum();
            (0..l.len())
                .map(|i| if i < kept.len() { p[i] / k } else { 0.0 })
                .collect()
        };
        for (params, len) in [
            (
                SamplingParams {
                    top_k: 3,
                    top_p: 0.75,
                    ..Default::default()
                },
                3,
            ),
            (
                SamplingParams {
                    min_p: 0.3,
                    top_p: 0.8,
                    ..Default::default()
                },
                3,
            ),
        ] {
            let want = reference(len, params.top_p as f64);
            assert_eq!(want.iter().filter(|&&x| x > 0.0).count(), 2);
            let got = freq(&l, &params, 100_000);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!((g - w).abs() < 0.005, "{params:?} token {i}: {g} vs {w}");
                assert_eq!(*g == 0.0, *w == 0.0, "{params:?} token {i}");
            }
        }
    }

    #[test]
    fn invalid_params_are_named() {
        let e = SamplingParams {
            top_p: 0.0,
            ..Default::default()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("top_p"));
        let e = SamplingParams {
            max_tokens: 0,
            ..Default::default()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("max_tokens"));
        let e = SamplingParams {
            temperature: -1.0,
            ..Default::default()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("temperature"));
        // 1/T must be finite: the smallest normal f32 passes, a subnormal
        // whose reciprocal overflows does not.
        for (t, ok) in [(f32::MIN_POSITIVE, true), (1e-39, false), (1e-45, false)] {
            let p = SamplingParams {
                temperature: t,
                ..Default::default()
            };
            assert_eq!(p.validate().is_ok(), ok, "temperature {t:e}");
        }
    }

    /// NaN or `+inf` logits (a diverged model) and rows with nothing above
    /// `-inf` give no token, whatever the settings; `-inf` entries next to
    /// finite ones are masked tokens and never drawn.
    #[test]
    fn non_finite_logits_give_no_token() {
        let settings = [
            SamplingParams::greedy(1),
            SamplingParams::default(),
            SamplingParams {
                top_k: 2,
                top_p: 0.9,
                min_p: 0.1,
                ..Default::default()
            },
            SamplingParams {
                temperature: f32::MIN_POSITIVE,
                top_k: 3,
                ..Default::default()
            },
        ];
        let mut rng = StdRng::seed_from_u64(5);
        for p in &settings {
            p.validate().unwrap();
            // 100 entries: the vector paths see a NaN in a full lane group.
            for bad in [f32::NAN, f32::INFINITY] {
                for at in [0, 37, 99] {
                    let mut l: Vec<f32> = (0..100).map(|i| (i % 7) as f32 * 0.3).collect();
                    l[at] = bad;
                    assert!(sample(&l, p, &mut rng).is_none(), "{bad} at {at}, {p:?}");
                }
            }
            assert!(sample(&[f32::NEG_INFINITY; 20], p, &mut rng).is_none());
            assert!(sample(&[], p, &mut rng).is_none());
            let mut l = vec![f32::NEG_INFINITY; 40];
            l[17] = -3.0;
            l[30] = -2.0;
            for _ in 0..50 {
                let (t, lp) = sample(&l, p, &mut rng).expect("two finite logits");
                assert!(t == 17 || t == 30, "drew masked token {t}");
                assert!(lp.is_finite() && lp <= 0.0);
            }
        }
    }
}
