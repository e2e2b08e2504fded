//! Finite-difference gradient checks in f64 for every parameter kind
//! (embeddings, q/k/v/o with biases, q/k norms, MLP, final norm, untied and
//! tied lm_head, value head), and a check that no parameter is cut off from
//! the gradient.
//!
//! Loss: `L = sum_{b,t} w_{bt} logp_{bt} + sum_{b,t} u_{bt} V_{bt}` with fixed
//! random weights, through the same chunked logprob path training uses.

use arbor_model::logprobs::token_logprobs;
use arbor_model::{
    ActorCritic, Arch, CriticMode, LoraConfig, ModelConfig, ParamLoader, ParamSource, RopeScaling,
};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use rand::{rngs::StdRng, Rng, SeedableRng};

fn tiny(arch: Arch) -> ModelConfig {
    let mut c = ModelConfig::smollm2_135m();
    c.arch = arch;
    c.vocab_size = 37;
    c.hidden_size = 16;
    c.intermediate_size = 24;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 6;
    c.rope_theta = 10000.0;
    c.rms_norm_eps = 1e-6;
    match arch {
        Arch::Qwen2 => {
            c.qkv_bias = true;
            c.tie_word_embeddings = true;
        }
        Arch::Qwen3 => {
            // Every bias and both q/k norms, untied head, head_dim != hidden/heads.
            c.qkv_bias = true;
            c.o_bias = true;
            c.qk_norm = true;
            c.tie_word_embeddings = false;
        }
        Arch::Llama => {
            c.num_key_value_heads = 1;
            c.head_dim = 4;
            c.tie_word_embeddings = true;
            c.rope_scaling = RopeScaling::Llama3 {
                factor: 4.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 16.0,
            };
        }
    }
    c
}

struct Setup {
    model: ActorCritic,
    vars: Vec<(String, Var)>,
    ids: Tensor,
    w: Tensor,
    u: Tensor,
}

fn setup(arch: Arch, mode: CriticMode, seed: u64, lora: Option<LoraConfig>) -> Setup {
    setup_in(arch, mode, seed, lora, DType::F64)
}

/// [`setup`] with parameters (and loss weights) in `dtype`, from the same
/// random values.
fn setup_in(
    arch: Arch,
    mode: CriticMode,
    seed: u64,
    lora: Option<LoraConfig>,
    dtype: DType,
) -> Setup {
    let cfg = tiny(arch);
    let dev = Device::Cpu;
    let pvars = VarMap::new();
    let cvars = VarMap::new();
    let mut pl = ParamLoader::trainable(ParamSource::Random { seed }, dtype, &dev, pvars.clone());
    if let Some(l) = lora {
        pl = pl.with_lora(l);
    }
    let cl = ParamLoader::trainable(ParamSource::Random { seed }, dtype, &dev, cvars.clone());
    let model = ActorCritic::load(&cfg, mode, &pl, &cl).unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut vars: Vec<(String, Var)> = Vec::new();
    for (prefix, vm) in [("policy.", &pvars), ("critic.", &cvars)] {
        let mut v: Vec<_> = vm
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| (format!("{prefix}{k}"), v.clone()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        vars.extend(v);
    }
    // Non-trivial values: norms far from 1, large weights, non-zero biases.
    for (name, var) in &vars {
        let n = var.elem_count();
        let fan_in = *var.dims().last().unwrap() as f64;
        let vals: Vec<f64> = (0..n)
            .map(|_| {
                let z: f64 = rng.random::<f64>() * 2.0 - 1.0;
                if name.ends_with("norm.weight") || name.contains("layernorm") {
                    1.0 + 0.5 * z
                } else if name.ends_with(".bias") {
                    0.3 * z
                } else {
                    z * 2.5 / fan_in.sqrt()
                }
            })
            .collect();
        var.set(
            &Tensor::from_vec(vals, var.shape(), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap(),
        )
        .unwrap();
    }
    let (b, t) = (2, 7);
    let toks: Vec<u32> = (0..b * t)
        .map(|_| rng.random_range(0..cfg.vocab_size as u32))
        .collect();
    let ids = Tensor::from_vec(toks, (b, t), &dev).unwrap();
    let w: Vec<f64> = (0..b * (t - 1))
        .map(|_| rng.random::<f64>() - 0.5)
        .collect();
    let u: Vec<f64> = (0..b * t).map(|_| rng.random::<f64>() - 0.5).collect();
    Setup {
        model,
        vars,
        ids,
        w: Tensor::from_vec(w, b * (t - 1), &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap(),
        u: Tensor::from_vec(u, (b, t), &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap(),
    }
}

fn loss(s: &Setup) -> Tensor {
    let (b, t) = s.ids.dims2().unwrap();
    let (h, values) = s.model.forward(&s.ids).unwrap();
    let hid = s.model.policy.cfg.hidden_size;
    let h_in = h
        .narrow(1, 0, t - 1)
        .unwrap()
        .reshape((b * (t - 1), hid))
        .unwrap();
    let targets = s.ids.narrow(1, 1, t - 1).unwrap().flatten_all().unwrap();
    let lp = token_logprobs(&h_in, &s.model.policy.lm_head, &targets, 5).unwrap();
    let pl = (lp * &s.w).unwrap().sum_all().unwrap();
    let vl = (values * &s.u).unwrap().sum_all().unwrap();
    (pl + vl).unwrap()
}

fn scalar(t: &Tensor) -> f64 {
    t.to_scalar::<f64>().unwrap()
}

fn fd_check(arch: Arch, mode: CriticMode) {
    fd_check_setup(arch, mode, setup(arch, mode, 7 + arch as u64, None));
}

fn fd_check_setup(arch: Arch, mode: CriticMode, s: Setup) {
    let l = loss(&s);
    let grads = l.backward().unwrap();
    let eps = 1e-5;
    let mut rng = StdRng::seed_from_u64(99);
    let mut worst = (0.0f64, String::new());
    let mut checked = 0;
    for (name, var) in &s.vars {
        let g = grads
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("{arch:?}/{mode:?}: parameter {name} got no gradient"));
        let gv: Vec<f64> = g.flatten_all().unwrap().to_vec1().unwrap();
        assert!(
            gv.iter().any(|x| *x != 0.0),
            "{arch:?}/{mode:?}: {name} has an all-zero gradient"
        );
        let orig: Vec<f64> = var.flatten_all().unwrap().to_vec1().unwrap();
        // Three random entries plus the entry with the largest gradient.
        let argmax = (0..gv.len())
            .max_by(|&a, &b| gv[a].abs().total_cmp(&gv[b].abs()))
            .unwrap();
        let mut idx: Vec<usize> = (0..3).map(|_| rng.random_range(0..gv.len())).collect();
        idx.push(argmax);
        for i in idx {
            let eval = |delta: f64| {
                let mut v = orig.clone();
                v[i] += delta;
                var.set(&Tensor::from_vec(v, var.shape(), &Device::Cpu).unwrap())
                    .unwrap();
                scalar(&loss(&s))
            };
            let fd = (eval(eps) - eval(-eps)) / (2.0 * eps);
            var.set(&Tensor::from_vec(orig.clone(), var.shape(), &Device::Cpu).unwrap())
                .unwrap();
            let an = gv[i];
            let rel = (fd - an).abs() / (fd.abs().max(an.abs()) + 1e-8);
            checked += 1;
            if rel > worst.0 {
                worst = (rel, format!("{name}[{i}] fd={fd:.6e} analytic={an:.6e}"));
            }
            assert!(
                rel <= 1e-4,
                "{arch:?}/{mode:?}: {name}[{i}]: fd {fd:.8e} vs analytic {an:.8e} (rel {rel:.2e})"
            );
        }
    }
    eprintln!(
        "{arch:?}/{mode:?}: {checked} entries over {} parameters, worst rel err {:.2e} ({})",
        s.vars.len(),
        worst.0,
        worst.1
    );
}

#[test]
fn qwen2_shared_critic_gradients() {
    fd_check(Arch::Qwen2, CriticMode::Shared);
}

#[test]
fn qwen3_all_biases_qk_norm_untied_gradients() {
    fd_check(Arch::Qwen3, CriticMode::Shared);
}

#[test]
fn llama_tied_separate_critic_gradients() {
    fd_check(Arch::Llama, CriticMode::Separate);
}

/// `(|a - b|, |a|)` for the gradients of `va` in `ga` (the reference)
/// and of `vb` in `gb`, as f64; `vb`'s gradient must exist and be
/// `dtype`.
fn grad_diff(
    (ga, va): (&GradStore, &Var),
    (gb, vb): (&GradStore, &Var),
    dtype: DType,
    what: &str,
) -> (f64, f64) {
    let flat = |g: &Tensor| -> Vec<f64> {
        g.to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    let a = flat(ga.get(va.as_tensor()).unwrap());
    let g = gb
        .get(vb.as_tensor())
        .unwrap_or_else(|| panic!("{what} got no gradient"));
    assert_eq!(g.dtype(), dtype, "{what}'s gradient");
    let b = flat(g);
    let diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).powi(2))
        .sum::<f64>()
        .sqrt();
    (diff, a.iter().map(|x| x * x).sum::<f64>().sqrt())
}

/// The f32 path (on AVX-512 CPUs every `Linear` runs Arbor's row-invariant
/// matmul kernel and its backward) gives, for every parameter, the f64
/// gradients that the finite-difference checks above verify.
#[test]
fn f32_gradients_match_the_checked_f64_ones() {
    for (arch, mode) in [
        (Arch::Qwen2, CriticMode::Shared),
        (Arch::Qwen3, CriticMode::Shared),
        (Arch::Llama, CriticMode::Separate),
    ] {
        let seed = 7 + arch as u64;
        let s64 = setup_in(arch, mode, seed, None, DType::F64);
        let s32 = setup_in(arch, mode, seed, None, DType::F32);
        let (g64, g32) = (
            loss(&s64).backward().unwrap(),
            loss(&s32).backward().unwrap(),
        );
        for ((name, v64), (_, v32)) in s64.vars.iter().zip(&s32.vars) {
            let (diff, norm) = grad_diff(
                (&g64, v64),
                (&g32, v32),
                DType::F32,
                &format!("{arch:?}: f32 {name}"),
            );
            assert!(
                diff <= 1e-4 * norm + 1e-9,
                "{arch:?}: {name}: |g32 - g64| = {diff:.3e}, |g64| = {norm:.3e}"
            );
        }
    }
}

/// Mixed precision over f32 master weights, both forms: bf16
/// activations (`set_train_dtype`, a GPU's) and f32 activations with bf16
/// matmuls (`set_train_matmul_dtype`, a CPU's). The forward really runs in
/// bf16, every parameter's gradient arrives in f32, and loss and gradients
/// track the f64 reference to bf16's precision (a relative error of a few
/// 2^-8 per op).
#[test]
fn bf16_mixed_precision_gradients_track_the_f64_ones() {
    for (arch, mode, activations) in [
        (Arch::Qwen2, CriticMode::Shared, true),
        (Arch::Qwen3, CriticMode::Shared, true),
        (Arch::Llama, CriticMode::Separate, true),
        (Arch::Qwen2, CriticMode::Shared, false),
        (Arch::Qwen3, CriticMode::Shared, false),
        (Arch::Llama, CriticMode::Separate, false),
    ] {
        let seed = 7 + arch as u64;
        let mut s64 = setup_in(arch, mode, seed, None, DType::F64);
        // Mixed precision needs f32 master weights.
        assert!(s64.model.set_train_dtype(Some(DType::BF16)).is_err());
        assert!(s64
            .model
            .policy
            .set_train_matmul_dtype(Some(DType::BF16))
            .is_err());
        s64.model.set_train_dtype(None).unwrap();
        let mut smp = setup_in(arch, mode, seed, None, DType::F32);
        if activations {
            smp.model.set_train_dtype(Some(DType::BF16)).unwrap();
        } else {
            smp.model
                .policy
                .set_train_matmul_dtype(Some(DType::BF16))
                .unwrap();
            if let Some(c) = &mut smp.model.critic_backbone {
                c.set_train_matmul_dtype(Some(DType::BF16)).unwrap();
            }
        }
        let arch = format!(
            "{arch:?}, {}",
            if activations {
                "bf16 activations"
            } else {
                "bf16 matmuls"
            }
        );
        let (b, t) = smp.ids.dims2().unwrap();
        let h = smp.model.policy.forward_hidden(&smp.ids).unwrap();
        let want = if activations { DType::BF16 } else { DType::F32 };
        assert_eq!(h.dtype(), want, "{arch:?}: the activations' dtype");
        assert_eq!(h.dims(), [b, t, smp.model.policy.cfg.hidden_size]);
        let (l64, lmp) = (loss(&s64), loss(&smp));
        assert_eq!(lmp.dtype(), DType::F32, "{arch:?}: the loss is f32");
        let (x, y) = (
            scalar(&l64),
            lmp.to_dtype(DType::F64)
                .unwrap()
                .to_scalar::<f64>()
                .unwrap(),
        );
        assert!(
            (x - y).abs() < 0.02 * x.abs().max(1.0),
            "{arch:?}: loss {y} vs f64 {x}"
        );
        let (g64, gmp) = (l64.backward().unwrap(), lmp.backward().unwrap());
        let (mut worst, mut diff2, mut norm2) = (0.0f64, 0.0f64, 0.0f64);
        for ((name, v64), (_, vmp)) in s64.vars.iter().zip(&smp.vars) {
            assert_eq!(vmp.dtype(), DType::F32, "{name}: master weights stay f32");
            let (diff, norm) = grad_diff(
                (&g64, v64),
                (&gmp, vmp),
                DType::F32,
                &format!("{arch:?}: {name} under bf16"),
            );
            worst = worst.max(diff / (norm + 1e-9));
            diff2 += diff * diff;
            norm2 += norm * norm;
            assert!(
                diff <= 0.15 * norm + 1e-6,
                "{arch:?}: {name}: |g_bf16 - g64| = {diff:.3e}, |g64| = {norm:.3e}"
            );
        }
        let all = (diff2 / norm2).sqrt();
        eprintln!("{arch:?}: relative gradient error under bf16: {all:.3e} overall, {worst:.3e} worst tensor");
        assert!(
            all <= 0.06,
            "{arch:?}: relative gradient error {all:.3e} overall"
        );
        // bf16 arithmetic, not f32 under another name: f32 is within 1e-4.
        assert!(worst > 1e-3, "{arch:?}: largest relative error {worst:.2e}");
    }
}

#[test]
fn every_parameter_kind_is_covered() {
    // The three configurations above together hold every parameter kind.
    let mut kinds = std::collections::BTreeSet::new();
    for (arch, mode) in [
        (Arch::Qwen2, CriticMode::Shared),
        (Arch::Qwen3, CriticMode::Shared),
        (Arch::Llama, CriticMode::Separate),
    ] {
        for (name, _) in setup(arch, mode, 1, None).vars {
            let kind: Vec<&str> = name
                .split('.')
                .filter(|p| p.parse::<usize>().is_err())
                .collect();
            kinds.insert(kind.join("."));
        }
    }
    for want in [
        "policy.model.embed_tokens.weight",
        "policy.model.layers.self_attn.q_proj.weight",
        "policy.model.layers.self_attn.q_proj.bias",
        "policy.model.layers.self_attn.k_proj.bias",
        "policy.model.layers.self_attn.v_proj.bias",
        "policy.model.layers.self_attn.o_proj.weight",
        "policy.model.layers.self_attn.o_proj.bias",
        "policy.model.layers.self_attn.q_norm.weight",
        "policy.model.layers.self_attn.k_norm.weight",
        "policy.model.layers.mlp.gate_proj.weight",
        "policy.model.layers.mlp.up_proj.weight",
        "policy.model.layers.mlp.down_proj.weight",
        "policy.model.layers.input_layernorm.weight",
        "policy.model.layers.post_attention_layernorm.weight",
        "policy.model.norm.weight",
        "policy.lm_head.weight",
        "critic.value_head.weight",
        "critic.value_head.bias",
        "critic.model.layers.self_attn.q_proj.weight",
    ] {
        assert!(
            kinds.contains(want),
            "parameter kind {want} not covered: {kinds:?}"
        );
    }
}

/// LoRA on every projection: only the adapters (and the value head) are
/// trainable, the base weights get no gradient slot at all, and the
/// adapters' gradients match finite differences (`B` is set non-zero so `A`
/// has a gradient too).
#[test]
fn lora_adapter_gradients() {
    let lora = LoraConfig {
        rank: 2,
        alpha: 3.0,
        ..LoraConfig::default()
    };
    let s = setup(Arch::Qwen3, CriticMode::Shared, 21, Some(lora));
    let policy: Vec<&str> = s
        .vars
        .iter()
        .filter_map(|(n, _)| n.strip_prefix("policy."))
        .collect();
    assert_eq!(
        policy.iter().filter(|n| n.contains(".lora_")).count(),
        2 * 7 * 2,
        "A and B on 7 projections of 2 layers: {policy:?}"
    );
    assert!(
        policy
            .iter()
            .all(|n| n.contains(".lora_") || n.starts_with("value_head.")),
        "base weights must be frozen: {policy:?}"
    );
    // The merged export equals the adapted forward.
    let m = &s.model.policy;
    let merged: std::collections::HashMap<String, Tensor> =
        m.named_tensors().unwrap().into_iter().collect();
    let q = &m.layers[0].attn.q;
    let x = Tensor::rand(-1f64, 1.0, (3, 16), &Device::Cpu).unwrap();
    use candle_core::Module;
    let want = q.forward(&x).unwrap();
    let w = &merged["model.layers.0.self_attn.q_proj.weight"];
    let got = x
        .matmul(&w.t().unwrap())
        .unwrap()
        .broadcast_add(q.bias.as_ref().unwrap())
        .unwrap();
    let d = (want - got).unwrap().abs().unwrap().max_all().unwrap();
    assert!(d.to_scalar::<f64>().unwrap() < 1e-12);
    fd_check_setup(Arch::Qwen3, CriticMode::Shared, s);
}

/// Sequences of different lengths packed into one stream give each
/// sequence's hidden states exactly as a forward of that sequence alone
/// (f64): positions restart and attention stops at the boundaries. The
/// gradient of a loss over the packed stream equals the sum of the
/// sequences' own gradients.
#[test]
fn packed_sequences_match_separate_forwards_and_gradients() {
    let s = setup(Arch::Qwen3, CriticMode::Shared, 5, None);
    let m = &s.model.policy;
    let dev = Device::Cpu;
    let lens = [5usize, 1, 9, 3];
    let mut rng = StdRng::seed_from_u64(3);
    let seqs: Vec<Vec<u32>> = lens
        .iter()
        .map(|&l| {
            (0..l)
                .map(|_| rng.random_range(0..m.cfg.vocab_size as u32))
                .collect()
        })
        .collect();
    let flat: Vec<u32> = seqs.concat();
    let n = flat.len();
    let packed = m
        .forward_packed(&Tensor::from_vec(flat, n, &dev).unwrap(), &lens)
        .unwrap();
    let probe = Tensor::from_vec(
        (0..n * m.cfg.hidden_size)
            .map(|i| ((i * 7919) % 13) as f64 / 13.0 - 0.5)
            .collect::<Vec<f64>>(),
        (n, m.cfg.hidden_size),
        &dev,
    )
    .unwrap();
    let packed_grads = (&packed * &probe)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let mut at = 0;
    let mut sum_grads: Vec<Vec<f64>> = vec![Vec::new(); s.vars.len()];
    for (seq, &l) in seqs.iter().zip(&lens) {
        let ids = Tensor::from_vec(seq.clone(), (1, l), &dev).unwrap();
        let alone = m.forward_hidden(&ids).unwrap().squeeze(0).unwrap();
        let want: Vec<f64> = alone.flatten_all().unwrap().to_vec1().unwrap();
        let got: Vec<f64> = packed
            .narrow(0, at, l)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-12, "sequence at {at}: {g} vs {w}");
        }
        let grads = (alone * probe.narrow(0, at, l).unwrap())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for ((_, var), acc) in s.vars.iter().zip(sum_grads.iter_mut()) {
            if let Some(g) = grads.get(var.as_tensor()) {
                let g: Vec<f64> = g.flatten_all().unwrap().to_vec1().unwrap();
                if acc.is_empty() {
                    *acc = vec![0.0; g.len()];
                }
                acc.iter_mut().zip(&g).for_each(|(a, b)| *a += b);
            }
        }
        at += l;
    }
    for ((name, var), want) in s.vars.iter().zip(&sum_grads) {
        let Some(g) = packed_grads.get(var.as_tensor()) else {
            assert!(
                want.is_empty(),
                "{name}: no gradient from the packed forward"
            );
            continue;
        };
        let g: Vec<f64> = g.flatten_all().unwrap().to_vec1().unwrap();
        for (i, (a, b)) in g.iter().zip(want).enumerate() {
            assert!(
                (a - b).abs() < 1e-10 * (1.0 + b.abs()),
                "{name}[{i}]: packed {a} vs separate {b}"
            );
        }
    }
}
