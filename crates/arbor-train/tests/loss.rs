//! The learner's losses, through the `arbor-ops` kernels, against a scalar
//! float64 reference computed here from the model's own logits: clipped
//! PPO with an asymmetric clip, token- and sequence-mean aggregation, rows
//! whose prefix is masked (prompts, replayed prefixes), and the value loss.
//! Micro-batching (rows packed into one stream, or one row at a time) and
//! activation recomputation do not change the step's loss or gradient.

use arbor_model::{Arch, CriticMode, ModelConfig, RopeScaling};
use arbor_rl::credit::LossRow;
use arbor_rl::ppo::{Aggregation, PolicyLossConfig};
use arbor_train::learner::{
    named_vars, surprise_features, Learner, LearnerConfig, Precision, Recompute, UpdateStats,
    ValueRow, SURPRISE_NATS, SURPRISE_SCALE,
};
use arbor_train::optim::AdamWConfig;
use candle_core::{DType, Device, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};

fn cfg() -> ModelConfig {
    ModelConfig {
        arch: Arch::Qwen3,
        vocab_size: 29,
        hidden_size: 16,
        intermediate_size: 24,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 8,
        rms_norm_eps: 1e-6,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::Default,
        max_position_embeddings: 64,
        tie_word_embeddings: false,
        qkv_bias: false,
        o_bias: false,
        qk_norm: true,
        torch_dtype: None,
        bos_token_id: None,
        eos_token_ids: vec![],
    }
}

const CLIP: (f64, f64) = (0.2, 0.28);

fn learner(agg: Aggregation, micro_batch_tokens: usize) -> Learner {
    learner_with(agg, micro_batch_tokens, CriticMode::Shared, Recompute::Off)
}

fn learner_with(
    agg: Aggregation,
    micro_batch_tokens: usize,
    critic: CriticMode,
    recompute: Recompute,
) -> Learner {
    learner_from(LearnerConfig {
        policy: PolicyLossConfig {
            eps_low: CLIP.0,
            eps_high: CLIP.1,
            aggregation: agg,
        },
        critic,
        value_coef: 0.5,
        micro_batch_tokens,
        epochs: 1,
        recompute,
        precision: Precision::F32,
        surprise: false,
    })
}

fn learner_from(lcfg: LearnerConfig) -> Learner {
    Learner::new(
        &cfg(),
        None,
        None,
        11,
        &Device::Cpu,
        lcfg,
        AdamWConfig::default(),
        None,
    )
    .unwrap()
}

/// Token logprobs `log p(tokens[i] | tokens[..i])` (index 0 unused) and
/// values of one row, from the model's full logits, in f64.
fn reference_row(l: &Learner, tokens: &[u32]) -> (Vec<f64>, Vec<f64>) {
    let ids = Tensor::from_vec(tokens.to_vec(), (1, tokens.len()), &Device::Cpu).unwrap();
    let h = l.model.policy.forward_hidden(&ids).unwrap();
    let logits: Vec<Vec<f64>> = l
        .model
        .policy
        .logits(&h)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec2()
        .unwrap();
    let mut lp = vec![0.0; tokens.len()];
    for i in 1..tokens.len() {
        let z = &logits[i - 1];
        let m = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + z.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        lp[i] = z[tokens[i] as usize] - lse;
    }
    let v: Vec<f64> = l
        .model
        .values(&ids)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1()
        .unwrap();
    (lp, v)
}

/// Rows of lengths 9, 4 and 13 with masked prefixes of 3, 1 and 6 tokens
/// (a prompt; a prompt plus a replayed prefix), behaviour logprobs off the
/// current policy by up to 0.5 nats (so both clip sides are hit), and
/// value targets.
fn rows(l: &Learner) -> Vec<LossRow> {
    let mut rng = StdRng::seed_from_u64(4);
    [(9usize, 3usize), (4, 1), (13, 6)]
        .iter()
        .enumerate()
        .map(|(e, &(len, masked))| {
            let tokens: Vec<u32> = (0..len).map(|_| rng.random_range(0..29)).collect();
            let (lp, _) = reference_row(l, &tokens);
            let mask: Vec<f32> = (0..len).map(|i| f32::from(u8::from(i >= masked))).collect();
            LossRow {
                episode: e,
                leaf: arbor_rl::NodeId(0),
                behaviour_logprobs: lp
                    .iter()
                    .map(|x| (x + rng.random_range(-0.5..0.5)) as f32)
                    .collect(),
                advantages: (0..len).map(|_| rng.random_range(-1.5f32..1.5)).collect(),
                value_targets: vec![(masked - 1, 1.0), (len - 1, rng.random_range(0.0..1.0))],
                history_logprobs: Vec::new(),
                tokens,
                mask,
            }
        })
        .collect()
}

/// `(policy loss, clip fraction, value loss)` in f64.
fn reference(l: &Learner, rows: &[LossRow], agg: Aggregation) -> (f64, f64, f64) {
    let n_tok: usize = rows
        .iter()
        .map(|r| r.mask.iter().skip(1).filter(|&&m| m > 0.0).count())
        .sum();
    let live = rows.len() as f64;
    let n_val: usize = rows.iter().map(|r| r.value_targets.len()).sum();
    let (mut loss, mut clipped, mut vloss) = (0.0, 0.0, 0.0);
    for r in rows {
        let (lp, v) = reference_row(l, &r.tokens);
        let in_row = r.mask.iter().skip(1).filter(|&&m| m > 0.0).count() as f64;
        for (i, &lpi) in lp.iter().enumerate().skip(1) {
            if r.mask[i] == 0.0 {
                continue;
            }
            let w = match agg {
                Aggregation::TokenMean => 1.0 / n_tok as f64,
                Aggregation::SequenceMean => 1.0 / (live * in_row),
                Aggregation::TokenSum { normalizer } => 1.0 / normalizer,
            };
            let rho = (lpi - r.behaviour_logprobs[i] as f64).exp();
            let a = r.advantages[i] as f64;
            let rc = rho.clamp(1.0 - CLIP.0, 1.0 + CLIP.1);
            loss += w * -(rho * a).min(rc * a);
            if rc * a < rho * a {
                clipped += w;
            }
        }
        for &(pos, target) in &r.value_targets {
            vloss += 0.5 * (v[pos] - target as f64).powi(2) / n_val as f64;
        }
    }
    let wsum = match agg {
        Aggregation::TokenSum { normalizer } => n_tok as f64 / normalizer,
        _ => 1.0,
    };
    (loss, clipped / wsum, vloss)
}

fn update(agg: Aggregation, budget: usize) -> (UpdateStats, (f64, f64, f64)) {
    let mut l = learner(agg, budget);
    let rows = rows(&l);
    let want = reference(&l, &rows, agg);
    (l.update(&rows).unwrap(), want)
}

#[test]
fn losses_match_the_scalar_reference_for_each_aggregation() {
    for agg in [
        Aggregation::TokenMean,
        Aggregation::SequenceMean,
        Aggregation::TokenSum { normalizer: 16.0 },
    ] {
        let (s, (loss, clip, vloss)) = update(agg, 4096);
        assert!(
            (s.policy_loss - loss).abs() < 1e-5 * (1.0 + loss.abs()),
            "{agg:?}: policy loss {} vs reference {loss}",
            s.policy_loss
        );
        assert!(
            (s.clip_fraction - clip).abs() < 1e-6,
            "{agg:?}: clip fraction {} vs {clip}",
            s.clip_fraction
        );
        assert!(
            clip > 0.0 && clip < 1.0,
            "{agg:?}: the test should clip some tokens"
        );
        assert!(
            (s.value_loss - vloss).abs() < 1e-5 * (1.0 + vloss),
            "{agg:?}: value loss {} vs {vloss}",
            s.value_loss
        );
        assert_eq!(s.trained_tokens, 6 + 3 + 7);
    }
    // The aggregations weigh the rows differently.
    let (a, _) = update(Aggregation::TokenMean, 4096);
    let (b, _) = update(Aggregation::SequenceMean, 4096);
    assert!((a.policy_loss - b.policy_loss).abs() > 1e-4);
}

#[test]
fn micro_batching_does_not_change_the_step() {
    for agg in [Aggregation::TokenMean, Aggregation::SequenceMean] {
        // All rows in one packed stream, then one row per micro-batch.
        let (one, _) = update(agg, 4096);
        let (many, _) = update(agg, 1);
        for (what, x, y) in [
            ("policy loss", one.policy_loss, many.policy_loss),
            ("value loss", one.value_loss, many.value_loss),
            ("gradient norm", one.grad_norm, many.grad_norm),
        ] {
            assert!(
                (x - y).abs() < 1e-5 * (1.0 + x.abs()),
                "{agg:?}: {what} {x} packed vs {y} row by row"
            );
        }
    }
}

#[test]
fn recomputation_gives_the_same_step() {
    for critic in [CriticMode::Shared, CriticMode::Separate] {
        let run = |recompute| {
            let mut l = learner_with(Aggregation::TokenMean, 12, critic, recompute);
            let rows = rows(&l);
            let s = l.update(&rows).unwrap();
            let params: Vec<Vec<f32>> = l
                .opt
                .vars()
                .iter()
                .map(|(_, v)| v.as_tensor().flatten_all().unwrap().to_vec1().unwrap())
                .collect();
            (s, params)
        };
        let (a, pa) = run(Recompute::Off);
        let (b, pb) = run(Recompute::Layers);
        for (what, x, y) in [
            ("policy loss", a.policy_loss, b.policy_loss),
            ("value loss", a.value_loss, b.value_loss),
            ("gradient norm", a.grad_norm, b.grad_norm),
        ] {
            assert!(
                (x - y).abs() < 1e-5 * (1.0 + x.abs()),
                "{critic:?}: {what} {x} without vs {y} with recomputation"
            );
        }
        for (x, y) in pa.iter().zip(&pb) {
            for (u, w) in x.iter().zip(y) {
                assert!((u - w).abs() < 1e-6, "{critic:?}: parameters {u} vs {w}");
            }
        }
    }
}

/// Mixed precision (`precision = "bf16"`): the same step as f32 to bf16's
/// precision (losses against the f64 reference of the f32 model with the
/// same weights, gradient norms against the f32 step), the master weights
/// and their updates stay f32, and activation recomputation replays the
/// bf16 forward exactly.
#[test]
fn bf16_mixed_precision_steps_track_the_f32_step() {
    for critic in [CriticMode::Shared, CriticMode::Separate] {
        // Every learner starts from the same seed: the same weights.
        let f32_learner = learner_with(Aggregation::TokenMean, 4096, critic, Recompute::Off);
        let rows = rows(&f32_learner);
        let (loss, _, vloss) = reference(&f32_learner, &rows, Aggregation::TokenMean);
        // `activations`: the GPU's form (bf16 activations) forced on the
        // CPU, whose own form is f32 activations with bf16 matmuls.
        let run = |precision, recompute, activations: bool| {
            let mut l = learner_from(LearnerConfig {
                precision,
                ..learner_with(Aggregation::TokenMean, 4096, critic, recompute).cfg
            });
            if activations {
                l.model.set_mixed_precision(false).unwrap();
                l.model.set_train_dtype(Some(DType::BF16)).unwrap();
            }
            let s = l.update(&rows).unwrap();
            let params: Vec<Vec<f32>> = l
                .opt
                .vars()
                .iter()
                .map(|(name, v)| {
                    assert_eq!(v.dtype(), DType::F32, "{name} stays f32");
                    v.as_tensor().flatten_all().unwrap().to_vec1().unwrap()
                })
                .collect();
            (s, params)
        };
        let (f, _) = run(Precision::F32, Recompute::Off, false);
        for activations in [false, true] {
            let form = if activations {
                "bf16 activations"
            } else {
                "bf16 matmuls"
            };
            let (b, pb) = run(Precision::Bf16, Recompute::Off, activations);
            let (r, pr) = run(Precision::Bf16, Recompute::Layers, activations);
            bf16_step_checks(critic, form, (loss, vloss), &f, (&b, &pb), (&r, &pr));
        }
    }
}

/// The checks of [`bf16_mixed_precision_steps_track_the_f32_step`] for
/// one form: the bf16 step `b` against the f64 reference losses and the
/// f32 step `f`, and its recomputed twin `r`.
fn bf16_step_checks(
    critic: CriticMode,
    form: &str,
    (loss, vloss): (f64, f64),
    f: &UpdateStats,
    (b, pb): (&UpdateStats, &[Vec<f32>]),
    (r, pr): (&UpdateStats, &[Vec<f32>]),
) {
    let critic = format!("{critic:?}, {form}");
    assert!(
        (f.policy_loss - loss).abs() < 1e-5 * (1.0 + loss.abs()),
        "{critic}: f32 policy loss {} vs reference {loss}",
        f.policy_loss
    );
    assert!(
        (b.policy_loss - loss).abs() < 0.02 * (0.1 + loss.abs()),
        "{critic}: bf16 policy loss {} vs reference {loss}",
        b.policy_loss
    );
    assert!(
        (b.value_loss - vloss).abs() < 0.02 * vloss,
        "{critic}: bf16 value loss {} vs reference {vloss}",
        b.value_loss
    );
    assert!(
        (b.grad_norm - f.grad_norm).abs() < 0.05 * f.grad_norm,
        "{critic}: bf16 gradient norm {} vs f32 {}",
        b.grad_norm,
        f.grad_norm
    );
    assert_eq!(b.trained_tokens, f.trained_tokens);
    // Not f32 under another name.
    assert_ne!(b.policy_loss, f.policy_loss, "{critic}: bf16 ran in f32");
    for (what, x, y) in [
        ("policy loss", b.policy_loss, r.policy_loss),
        ("value loss", b.value_loss, r.value_loss),
        ("gradient norm", b.grad_norm, r.grad_norm),
    ] {
        assert!(
            (x - y).abs() < 1e-5 * (1.0 + x.abs()),
            "{critic}: bf16 {what} {x} without vs {y} with recomputation"
        );
    }
    for (x, y) in pb.iter().zip(pr) {
        for (u, w) in x.iter().zip(y) {
            assert!((u - w).abs() < 1e-6, "{critic}: parameters {u} vs {w}");
        }
    }
}

/// The critic's extra passes (`[critic] epochs`) fit the value targets and
/// move nothing else: the policy's parameters and the optimizer's step
/// count stay, the critic's parameters move, the value loss falls, and
/// activation recomputation gives the same passes.
#[test]
fn critic_passes_fit_the_values_and_move_only_the_critic() {
    for critic in [CriticMode::Shared, CriticMode::Separate] {
        let run = |recompute| {
            let mut l = learner_with(Aggregation::TokenMean, 12, critic, recompute);
            l.set_critic_optimizer(1e-2, 1.0);
            let rows: Vec<ValueRow> = rows(&l)
                .iter()
                .filter_map(|r| ValueRow::of(r, false))
                .collect();
            let params = |l: &Learner| -> Vec<(String, Vec<f32>)> {
                l.opt
                    .vars()
                    .iter()
                    .map(|(n, v)| {
                        let x = v.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
                        (n.clone(), x)
                    })
                    .collect()
            };
            let before = params(&l);
            let single = &mut arbor_train::dist::Single;
            let (first, steps) = l.update_critic_in_group(&rows, 1, 2, 7, single).unwrap();
            assert_eq!(steps, 2);
            let (last, steps) = l.update_critic_in_group(&rows, 30, 2, 8, single).unwrap();
            assert_eq!(steps, 60);
            assert!(
                last < 0.5 * first,
                "{critic:?}: value loss {first} -> {last}"
            );
            assert_eq!((l.opt.steps_done(), l.opt.group_steps_done()), (0, 62));
            let after = params(&l);
            let mut moved = 0;
            for ((name, x), (_, y)) in before.iter().zip(&after) {
                if name.starts_with("critic.") {
                    moved += usize::from(x != y);
                } else {
                    assert_eq!(x, y, "{critic:?}: policy parameter `{name}` moved");
                }
            }
            assert!(moved > 0, "{critic:?}: no critic parameter moved");
            (first, last, after)
        };
        let (f0, l0, p0) = run(Recompute::Off);
        let (f1, l1, p1) = run(Recompute::Layers);
        assert!(
            (f0 - f1).abs() < 1e-5 && (l0 - l1).abs() < 1e-5,
            "{f0} {l0} vs {f1} {l1}"
        );
        for ((name, x), (_, y)) in p0.iter().zip(&p1) {
            for (u, w) in x.iter().zip(y) {
                assert!((u - w).abs() < 1e-5, "{critic:?}: `{name}` {u} vs {w}");
            }
        }
    }
}

/// The critic's surprise features (`[critic] surprise`): the value at a
/// position is the head's plus `features . u`. `u` starts at 0, so a fresh
/// critic's values are those of one without the features; with `u` set,
/// `values_at` (allocation) and the value loss (training) both read
/// `head + features . u`, and the loss's gradient moves `u`.
#[test]
fn surprise_features_add_to_the_critics_values() {
    for critic in [CriticMode::Shared, CriticMode::Separate] {
        let plain = learner_with(Aggregation::TokenMean, 4096, critic, Recompute::Off);
        let with = |recompute| {
            learner_from(LearnerConfig {
                surprise: true,
                recompute,
                ..plain.cfg
            })
        };
        let mut l = with(Recompute::Off);
        let mut rows = rows(&plain);
        // One row is a context after a restart: the path before it counts.
        rows[1].history_logprobs = vec![-3.0, -0.1, -1.5];
        let seqs: Vec<Vec<u32>> = rows.iter().map(|r| r.tokens.clone()).collect();
        let lps: Vec<Vec<f32>> = rows
            .iter()
            .map(|r| [&r.history_logprobs[..], &r.behaviour_logprobs[..]].concat())
            .collect();
        let pos: Vec<Vec<usize>> = seqs.iter().map(|s| (0..s.len()).collect()).collect();
        let values = |l: &Learner, lps: &[Vec<f32>]| l.values_at(&seqs, lps, &pos).unwrap();
        assert_eq!(values(&l, &lps), values(&plain, &lps), "{critic:?}: u = 0");

        let u = [0.002f32, -0.003, 0.001];
        let var = named_vars(&l.critic_vars, "")
            .into_iter()
            .find(|(n, _)| n == "value_head.surprise")
            .expect("the surprise weights are a critic parameter")
            .1;
        var.set(&Tensor::from_vec(u.to_vec(), (SURPRISE_NATS.len(), 1), &Device::Cpu).unwrap())
            .unwrap();
        let got = values(&l, &lps);
        let mut vloss = 0.0;
        let n_val: usize = rows.iter().map(|r| r.value_targets.len()).sum();
        for (i, r) in rows.iter().enumerate() {
            let f = surprise_features(&lps[i], r.tokens.len());
            let (_, v) = reference_row(&plain, &r.tokens);
            let k = SURPRISE_NATS.len();
            let fu = |p: usize| -> f64 {
                f[p * k..(p + 1) * k]
                    .iter()
                    .zip(&u)
                    .map(|(a, b)| f64::from(a * b))
                    .sum()
            };
            for p in 0..r.tokens.len() {
                let want = (v[p] + fu(p)).clamp(0.01, 0.99);
                assert!(
                    (got[i][p] - want).abs() < 1e-5,
                    "{critic:?}: row {i} position {p}: {} vs {want}",
                    got[i][p]
                );
            }
            for &(p, t) in &r.value_targets {
                vloss += 0.5 * (v[p] + fu(p) - f64::from(t)).powi(2) / n_val as f64;
            }
        }
        // Without the logprobs every feature is 0.
        assert_eq!(
            values(&l, &[]),
            values(&plain, &lps),
            "{critic:?}: no logprobs"
        );

        let before: Vec<f32> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        let s = l.update(&rows).unwrap();
        assert!(
            (s.value_loss - vloss).abs() < 1e-5 * (1.0 + vloss),
            "{critic:?}: value loss {} vs {vloss}",
            s.value_loss
        );
        let after: Vec<f32> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        assert!(
            before.iter().zip(&after).all(|(a, b)| a != b),
            "{critic:?}: the value loss moves every surprise weight: {before:?} -> {after:?}"
        );
        // Recomputation and the critic's own passes read the same values.
        let mut r = with(Recompute::Layers);
        named_vars(&r.critic_vars, "")
            .into_iter()
            .find(|(n, _)| n == "value_head.surprise")
            .unwrap()
            .1
            .set(&Tensor::from_vec(u.to_vec(), (SURPRISE_NATS.len(), 1), &Device::Cpu).unwrap())
            .unwrap();
        let sr = r.update(&rows).unwrap();
        assert!(
            (sr.value_loss - s.value_loss).abs() < 1e-6,
            "{critic:?}: recompute"
        );
    }
}

#[test]
fn surprise_features_count_the_policys_unlikely_tokens() {
    // Surprisals 0.1, 0.7, 3.0, 0 (not the policy's), 1.5 nats.
    let f = surprise_features(&[-0.1, -0.7, -3.0, 0.0, -1.5], 6);
    let k = SURPRISE_NATS.len();
    assert_eq!(SURPRISE_NATS, [0.5, 1.0, 2.0]);
    let counts: Vec<Vec<f32>> = f
        .chunks(k)
        .map(|c| {
            c.iter()
                .map(|x| (x / SURPRISE_SCALE).exp_m1().round())
                .collect()
        })
        .collect();
    assert_eq!(
        counts,
        vec![
            vec![0.0, 0.0, 0.0],
            vec![1.0, 0.0, 0.0],
            vec![2.0, 1.0, 1.0],
            vec![2.0, 1.0, 1.0],
            vec![3.0, 2.0, 1.0],
            vec![3.0, 2.0, 1.0],
        ]
    );
    assert!((f[k * 4] - SURPRISE_SCALE * 3f32.ln_1p()).abs() < 1e-6);
    // Entries before the sequence's (the path before a context restart)
    // are counted from the start: the last 3 of these 5 are the sequence.
    let g = surprise_features(&[-0.1, -0.7, -3.0, 0.0, -1.5], 3);
    assert_eq!(g, f[2 * k..5 * k]);
}
