//! The model's logits on the device against float64 on the CPU, and one
//! PPO training step.
use arbor_engine::paged::{DeviceKvCache, DevicePagedAttention, PagedBatch};
use arbor_model::{ModelConfig, ParamLoader, ParamSource, Transformer};
use candle_core::{DType, Device, Tensor};
use candle_nn::Optimizer;

use crate::util::{float_dtypes, op_tol, push, push_tol, rel_err, Rng};
use crate::{bail, Check, CheckError, OrMsg, Result};

pub(crate) fn model_cfg(quick: bool) -> ModelConfig {
    let mut cfg = ModelConfig::qwen3_0_6b();
    if quick {
        cfg.hidden_size = 64;
        cfg.intermediate_size = 128;
        cfg.num_hidden_layers = 2;
        cfg.num_attention_heads = 4;
        cfg.num_key_value_heads = 2;
        cfg.head_dim = 16;
        cfg.vocab_size = 512;
    }
    cfg
}

/// Seed of the random weights of the model checks and decode benchmarks.
const MODEL_SEED: u64 = 7;

pub(crate) fn model_on(cfg: &ModelConfig, dt: DType, dev: &Device) -> Result<Transformer> {
    let p = ParamLoader::frozen(ParamSource::Random { seed: MODEL_SEED }, dt, dev);
    Ok(Transformer::load(cfg, &p)?)
}

/// Logits of the device model (f32 and bf16) vs the f32 CPU model on the
/// same random weights, dense forward and the paged decode path.
pub fn model_checks(dev: &Device, quick: bool, out: &mut Vec<Check>) -> Result<()> {
    let cfg = model_cfg(quick);
    let t = if quick { 24 } else { 64 };
    let ids: Vec<u32> = (0..t as u32)
        .map(|i| (i * 7919 + 13) % cfg.vocab_size as u32)
        .collect();
    let x = Tensor::from_vec(ids.clone(), (1, t), &Device::Cpu)?;
    for dt in float_dtypes(dev) {
        // The float64 reference holds the very weights the `dt` model holds
        // (the f32 draws rounded to `dt`), so the error measured is the
        // device model's arithmetic, not its weights' rounding.
        let cpu_model = Transformer::load(
            &cfg,
            &ParamLoader::frozen(
                ParamSource::Random { seed: MODEL_SEED },
                DType::F64,
                &Device::Cpu,
            )
            .rounded_through(dt),
        )?;
        let want = cpu_model.logits(&cpu_model.forward_hidden(&x)?)?;
        drop(cpu_model);
        // A whole model in bf16 rounds every activation of every layer, so
        // its logits drift further from float64 than one bf16 operation's
        // output does (1e-2). The tolerance is then twice the error of the
        // same bf16 model computed by an independent implementation,
        // candle's CPU ops (bf16 storage, f32 reductions, as here), floored
        // at the one-operation tolerance.
        let tol = if dt == DType::F32 || dev.is_cpu() {
            op_tol(dt)
        } else {
            let emu = Transformer::load(
                &cfg,
                &ParamLoader::frozen(ParamSource::Random { seed: MODEL_SEED }, dt, &Device::Cpu)
                    .all_in_dtype(),
            )?;
            let e = rel_err(&emu.logits(&emu.forward_hidden(&x)?)?, &want)?;
            eprintln!("  model    CPU {dt:?} model (candle) vs f64: {e:.2e}; tolerance 2x that");
            (2.0 * e).max(op_tol(dt))
        };
        let m = model_on(&cfg, dt, dev)?;
        let xd = x.to_device(dev)?;
        let got = m.logits(&m.forward_hidden(&xd)?)?;
        push_tol(
            out,
            "model",
            "logits, dense forward",
            dt,
            rel_err(&got, &want)?,
            tol,
        );
        // Paged path: prefill t-1 tokens then decode the last one.
        let bs = 16;
        let cache = DeviceKvCache::new(&cfg, t.div_ceil(bs) + 1, bs, dt, dev)?;
        let table: Vec<u32> = (0..(t.div_ceil(bs) + 1) as u32).collect();
        let mut last = None;
        for (lo, hi) in [(0, t - 1), (t - 1, t)] {
            let batch = PagedBatch {
                slots: (lo..hi).collect(),
                positions: (lo as u32..hi as u32).collect(),
                token_seq: vec![0; hi - lo],
                tables: vec![table.clone()],
            };
            let input = Tensor::from_vec(ids[lo..hi].to_vec(), (1, hi - lo), dev)?;
            let mut be = DevicePagedAttention::new(&cache, &batch)?;
            last = Some(m.forward_with(&input, &batch.positions, &mut be)?);
        }
        let h = last.or_msg("decode step")?;
        let got = m.logits(&h)?.squeeze(0)?;
        let want_last = want.squeeze(0)?.narrow(0, t - 1, 1)?;
        push_tol(
            out,
            "model",
            "logits, paged decode",
            dt,
            rel_err(&got, &want_last)?,
            tol,
        );
    }
    Ok(())
}

/// One PPO step on the device (trainable random model, fused logprobs, PPO
/// loss, backward): gradients vs the same step on the CPU, then AdamW steps
/// on the device must lower the loss. When the device is the CPU, the
/// reference step takes its logprobs by the independent path instead (full
/// logits, `log_softmax` and a gather, differentiated by candle), so the
/// comparison is never of a computation with itself.
pub fn train_check(dev: &Device, quick: bool, rng: &mut Rng, out: &mut Vec<Check>) -> Result<()> {
    let mut cfg = model_cfg(true);
    if !quick {
        cfg.hidden_size = 256;
        cfg.intermediate_size = 768;
        cfg.num_hidden_layers = 4;
        cfg.head_dim = 64;
        cfg.vocab_size = 151_936;
    }
    let (b, t) = (2, if quick { 16 } else { 128 });
    let ids: Vec<u32> = rng.below(b * t, cfg.vocab_size as u64);
    let adv = rng.uniform(b * (t - 1), -1.0, 1.0);
    let mut grads: Vec<Vec<(String, Tensor)>> = Vec::new();
    let mut logprobs: Vec<Tensor> = Vec::new();
    let mut losses = Vec::new();
    let naive_reference = dev.is_cpu();
    // The CPU reference, the device step in f32 (then AdamW steps), and the
    // device step in mixed precision (bf16 activations over the f32 master
    // weights, as `[learner] precision = "bf16"` trains).
    for (d, steps, naive, mixed) in [
        (Device::Cpu, 1, naive_reference, None),
        (dev.clone(), 4, false, None),
        (dev.clone(), 1, false, Some(DType::BF16)),
    ] {
        let vm = candle_nn::VarMap::new();
        let p = ParamLoader::trainable(ParamSource::Random { seed: 3 }, DType::F32, &d, vm.clone());
        let mut m = Transformer::load(&cfg, &p)?;
        m.set_train_dtype(mixed)?;
        let x = Tensor::from_vec(ids.clone(), (b, t), &d)?;
        let inputs = x.narrow(1, 0, t - 1)?;
        let targets = x.narrow(1, 1, t - 1)?.flatten_all()?;
        let loss_of = |m: &Transformer, old: Option<&Tensor>| -> Result<(Tensor, Tensor)> {
            let hid = m
                .forward_hidden(&inputs)?
                .reshape((b * (t - 1), cfg.hidden_size))?;
            let lp = if naive {
                let logits = hid.matmul(&m.lm_head.t()?)?;
                candle_nn::ops::log_softmax(&logits, 1)?
                    .gather(&targets.unsqueeze(1)?, 1)?
                    .squeeze(1)?
            } else {
                arbor_model::logprobs::token_logprobs(&hid, &m.lm_head, &targets, 256)?
            };
            let old = old.cloned().unwrap_or_else(|| lp.detach());
            let w = vec![1.0f32 / (b * (t - 1)) as f32; b * (t - 1)];
            let oldv: Vec<f32> = old.to_vec1()?;
            let advv: Vec<f32> = adv.iter().map(|&a| a as f32).collect();
            let aux = arbor_ops::pack_aux(&oldv, &advv, &w, &d)?;
            let l = arbor_ops::ppo_loss(
                &lp,
                &aux,
                arbor_ops::PpoClip {
                    eps_low: 0.2,
                    eps_high: 0.2,
                },
            )?
            .get(0)?;
            Ok((l, old))
        };
        let (l0, old) = loss_of(&m, None)?;
        logprobs.push(old.clone());
        let g = l0.backward()?;
        let mut named: Vec<(String, Tensor)> = vm
            .data()
            .lock()
            .map_err(|_| CheckError::Msg("varmap lock".into()))?
            .iter()
            .filter_map(|(k, v)| g.get(v.as_tensor()).map(|gr| (k.clone(), gr.clone())))
            .collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        grads.push(named);
        if steps > 1 {
            let mut opt = candle_nn::AdamW::new_lr(vm.all_vars(), 1e-3)?;
            let mut l = l0;
            losses.push(l.to_scalar::<f32>()?);
            for _ in 0..steps {
                opt.backward_step(&l)?;
                l = loss_of(&m, Some(&old))?.0;
                losses.push(l.to_scalar::<f32>()?);
            }
        }
    }
    let (dg, cg) = (&grads[1], &grads[0]);
    let names = |v: &[(String, Tensor)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    if names(dg) != names(cg) {
        bail!(
            "the device step has gradients for {:?}, the reference step for {:?}",
            names(dg),
            names(cg)
        );
    }
    let flat = |v: &[(String, Tensor)]| -> Result<Tensor> {
        let parts: Vec<Tensor> = v
            .iter()
            .map(|(_, t)| {
                t.to_device(&Device::Cpu)?
                    .to_dtype(DType::F64)?
                    .flatten_all()
            })
            .collect::<candle_core::Result<_>>()?;
        Ok(Tensor::cat(&parts, 0)?)
    };
    push(
        out,
        "train",
        &if naive_reference {
            format!("ppo step grads vs naive logprobs ({} tensors)", dg.len())
        } else {
            format!("ppo step grads ({} tensors)", dg.len())
        },
        DType::F32,
        rel_err(&flat(dg)?, &flat(cg)?)?,
    );
    // Mixed precision against the f32 reference: bf16's 8-bit mantissa
    // through every layer (`arbor-model`'s gradient test sees 3-4% on tiny
    // models with large weights).
    let (mg, ml) = (&grads[2], &logprobs[2]);
    if names(mg) != names(cg) {
        bail!(
            "the bf16 step has gradients for {:?}, the reference step for {:?}",
            names(mg),
            names(cg)
        );
    }
    if let Some((n, g)) = mg.iter().find(|(_, g)| g.dtype() != DType::F32) {
        bail!(
            "the bf16 step's gradient of {n} is {:?}, not f32",
            g.dtype()
        );
    }
    push_tol(
        out,
        "train",
        "bf16 step logprobs vs f32",
        DType::BF16,
        rel_err(ml, &logprobs[0])?,
        2e-2,
    );
    push_tol(
        out,
        "train",
        &format!("bf16 step grads vs f32 ({} tensors)", mg.len()),
        DType::BF16,
        rel_err(&flat(mg)?, &flat(cg)?)?,
        6e-2,
    );
    let fell = losses.last().copied().unwrap_or(0.0) < losses[0];
    eprintln!("  train    AdamW losses on device: {losses:?}");
    out.push(Check {
        section: "train".into(),
        name: format!("loss falls over {} AdamW steps", losses.len() - 1),
        dtype: "f32".into(),
        rel_err: (losses.last().copied().unwrap_or(0.0) - losses[0]) as f64,
        tol: 0.0,
        pass: fell,
    });
    Ok(())
}

/// The engines of the fast decode checks: a 512 MiB KV pool.
fn engine_cfg() -> arbor_engine::EngineConfig {
    arbor_engine::EngineConfig {
        max_seqs: 64,
        kv_memory_mib: 512,
        ..Default::default()
    }
}

/// The engine's dedicated decode step (a bf16 model on a GPU) against the
/// same weights in an f32 model on the device, scored by teacher forcing:
/// five prompts of different lengths (a bucket of 8 with padding rows,
/// block tables that widen mid-run) whose generations end at different
/// steps (the batch shrinks through smaller buckets, each its own captured
/// graph), four greedy and one sampled. Each generated token's logprob must
/// match the f32 model's log-softmax within 2e-2, and each greedy pick must
/// be the f32 model's argmax up to a near-tie of 2e-2.
pub fn fast_decode_checks(
    dev: &Device,
    quick: bool,
    _rng: &mut Rng,
    out: &mut Vec<Check>,
) -> Result<()> {
    if dev.is_cpu() {
        eprintln!("  fast decode: a GPU path; nothing to check on the CPU");
        return Ok(());
    }
    let cfg = model_cfg(quick);
    let m = model_on(&cfg, DType::BF16, dev)?;
    let mut e = arbor_engine::Engine::new(&m, None, engine_cfg())?;
    push_tol(
        out,
        "model",
        "fast decode: the engine runs the fused step",
        DType::BF16,
        if e.fast_decode_active() {
            0.0
        } else {
            f64::NAN
        },
        0.0,
    );
    let vocab = cfg.vocab_size as u32;
    let mut jobs = Vec::new();
    for (i, (len, new)) in [(17usize, 48usize), (24, 40), (31, 30), (40, 12), (9, 45)]
        .into_iter()
        .enumerate()
    {
        let prompt: Vec<u32> = (0..len as u32)
            .map(|j| (i as u32 * 131 + j * 7919 + 13) % vocab)
            .collect();
        let p = if i == 4 {
            arbor_engine::SamplingParams {
                temperature: 1.0,
                max_tokens: new,
                seed: 5,
                ..Default::default()
            }
        } else {
            arbor_engine::SamplingParams::greedy(new)
        };
        let id = e.submit(prompt.clone(), vec![p])?[0];
        jobs.push((id, prompt, i != 4));
    }
    let done = e.run(|_| {})?;
    drop(e);
    let reference = Transformer::load(
        &cfg,
        &ParamLoader::frozen(ParamSource::Random { seed: MODEL_SEED }, DType::F32, dev)
            .rounded_through(DType::BF16),
    )?;
    // The f32 engine (the candle forward) on the same greedy prompts: where
    // its tokens first differ from the fused step's (a bf16 near-tie, which
    // the teacher-forced checks below bound).
    let mut f32_engine = arbor_engine::Engine::new(&reference, None, engine_cfg())?;
    let greedy_jobs: Vec<_> = jobs.iter().filter(|j| j.2).collect();
    for (_, prompt, _) in &greedy_jobs {
        let n = done
            .iter()
            .find(|c| &c.prompt == prompt)
            .map_or(1, |c| c.tokens.len().max(1));
        f32_engine.submit(
            prompt.clone(),
            vec![arbor_engine::SamplingParams::greedy(n)],
        )?;
    }
    let mut f32_done = f32_engine.run(|_| {})?;
    f32_done.sort_by_key(|c| c.id);
    drop(f32_engine);
    let firsts: Vec<String> = greedy_jobs
        .iter()
        .zip(&f32_done)
        .map(|((id, _, _), r)| {
            let fused = done
                .iter()
                .find(|c| c.id == *id)
                .map_or(&[][..], |c| &c.tokens[..]);
            match fused.iter().zip(&r.tokens).position(|(a, b)| a != b) {
                Some(k) => format!("token {k} of {}", fused.len()),
                None => format!("none of {}", fused.len()),
            }
        })
        .collect();
    eprintln!(
        "  model    fast decode vs the f32 engine, first differing greedy token: {}",
        firsts.join(", ")
    );
    let (mut lp_err, mut gap) = (0f64, 0f64);
    for (id, prompt, greedy) in jobs {
        let c = done.iter().find(|c| c.id == id).or_msg("a completion")?;
        if let Some(err) = &c.error {
            bail!("fast decode: sequence {id} failed: {err}");
        }
        let ids: Vec<u32> = prompt.iter().chain(&c.tokens).copied().collect();
        let n = ids.len();
        let x = Tensor::from_vec(ids, (1, n), dev)?;
        let logits = reference
            .logits(&reference.forward_hidden(&x)?)?
            .squeeze(0)?;
        let lsm = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, 1)?;
        let lsm = lsm
            .narrow(0, prompt.len() - 1, c.tokens.len())?
            .to_vec2::<f32>()?;
        for ((row, &tok), &lp) in lsm.iter().zip(&c.tokens).zip(&c.logprobs) {
            let want = row[tok as usize];
            lp_err = lp_err.max((lp - want).abs() as f64);
            if greedy {
                let best = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                gap = gap.max((best - want) as f64);
            }
        }
    }
    push_tol(
        out,
        "model",
        "fast decode: logprobs vs f32 model",
        DType::BF16,
        lp_err,
        2e-2,
    );
    push_tol(
        out,
        "model",
        "fast decode: greedy pick below f32 argmax",
        DType::BF16,
        gap,
        2e-2,
    );
    bf16_rollout_checks(&cfg, dev, &done, out)
}

/// An f32 model with bf16-representable weights, rolled out through the
/// fused step's bf16 copy (`bf16_rollouts`), generates exactly what the
/// bf16 model did (`reference`: the completions of [`fast_decode_checks`],
/// the greedy ones re-run); after an in-place update of its variables and
/// `invalidate`, exactly what a fresh engine over the updated model
/// generates.
fn bf16_rollout_checks(
    cfg: &ModelConfig,
    dev: &Device,
    reference: &[arbor_engine::Completion],
    out: &mut Vec<Check>,
) -> Result<()> {
    let vars = candle_nn::VarMap::new();
    let m = Transformer::load(
        cfg,
        &ParamLoader::trainable(
            ParamSource::Random { seed: MODEL_SEED },
            DType::F32,
            dev,
            vars.clone(),
        )
        .rounded_through(DType::BF16),
    )?;
    let ecfg = arbor_engine::EngineConfig {
        bf16_rollouts: true,
        ..engine_cfg()
    };
    // The greedy completions (the sampled one is the last prompt's).
    let mut reference: Vec<&arbor_engine::Completion> = reference.iter().collect();
    reference.sort_by_key(|c| c.id);
    reference.truncate(4);
    let run = |e: &mut arbor_engine::Engine| -> Result<Vec<arbor_engine::Completion>> {
        for c in &reference {
            let p = arbor_engine::SamplingParams::greedy(c.tokens.len().max(1));
            e.submit(c.prompt.clone(), vec![p])?;
        }
        let mut done = e.run(|_| {})?;
        done.sort_by_key(|c| c.id);
        Ok(done)
    };
    let differ = |a: &[arbor_engine::Completion], b: &[&arbor_engine::Completion]| -> f64 {
        let mut worst = 0f64;
        for (x, y) in a.iter().zip(b) {
            if x.tokens != y.tokens {
                return f64::NAN;
            }
            for (p, q) in x.logprobs.iter().zip(&y.logprobs) {
                worst = worst.max((p - q).abs() as f64);
            }
        }
        worst
    };
    let mut e = arbor_engine::Engine::new(&m, None, ecfg.clone())?;
    let active = e.fast_decode_active();
    let first = run(&mut e)?;
    let err = if active {
        differ(&first, &reference)
    } else {
        f64::NAN
    };
    push_tol(
        out,
        "model",
        "bf16 rollouts of an f32 model = the bf16 model",
        DType::BF16,
        err,
        1e-6,
    );
    // An in-place update (as AdamW's), then the engine's refresh.
    for v in vars.all_vars() {
        let t = v.as_tensor();
        v.set(&((t * 0.9)? + t.randn_like(0.0, 0.01)?)?)?;
    }
    e.invalidate();
    let updated = run(&mut e)?;
    let fresh = run(&mut arbor_engine::Engine::new(&m, None, ecfg)?)?;
    let fresh: Vec<&arbor_engine::Completion> = fresh.iter().collect();
    let err = differ(&updated, &fresh);
    push_tol(
        out,
        "model",
        "bf16 rollouts after an update = a fresh engine",
        DType::BF16,
        err,
        1e-6,
    );
    Ok(())
}
