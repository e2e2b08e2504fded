//! Device benchmarks: the copy and matmul ceilings, each kernel's time
//! against its bytes-moved or FLOP floor, and decode tokens/s against the
//! roofline.
use std::time::Instant;

use arbor_engine::paged::{DeviceKvCache, DevicePagedAttention, PagedBatch};
use candle_core::{DType, Device, Tensor, D};

#[cfg(feature = "cuda")]
use crate::bail;
use crate::model::{model_cfg, model_on};
use crate::util::{rand_t, Rng};
use crate::{Bench, Result};

/// Median ms of `f` (after warm-up), synchronising around every call.
fn time_ms(dev: &Device, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..2 {
        f()?;
    }
    dev.synchronize()?;
    let mut v = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = Instant::now();
        f()?;
        dev.synchronize()?;
        v.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    v.sort_by(f64::total_cmp);
    Ok(v[v.len() / 2])
}

/// Measured copy bandwidth (bytes read + written per second) and bf16 (f32
/// on the CPU) matmul rate.
pub fn ceilings(dev: &Device, quick: bool) -> Result<(f64, f64)> {
    let n = if quick { 1 << 24 } else { 1 << 29 };
    let x = Tensor::rand(0f32, 1f32, n, dev)?;
    let ms = copy_ms(dev, &x)?;
    let bw = 2.0 * 4.0 * n as f64 / (ms * 1e-3);
    let (m, dt) = if quick {
        (512, DType::F32)
    } else {
        (8192, DType::BF16)
    };
    let a = Tensor::rand(-1f32, 1f32, (m, m), dev)?.to_dtype(dt)?;
    let b = Tensor::rand(-1f32, 1f32, (m, m), dev)?.to_dtype(dt)?;
    let ms = time_ms(dev, 10, || {
        let _c = a.matmul(&b)?;
        Ok(())
    })?;
    let rate = 2.0 * (m as f64).powi(3) / (ms * 1e-3);
    eprintln!(
        "ceilings: copy {:.0} GB/s, {dt:?} matmul {:.1} TFLOP/s",
        bw / 1e9,
        rate / 1e12
    );
    Ok((bw, rate))
}

/// Median ms of one device-to-device copy of `x` (f32) into a buffer
/// allocated once: `Tensor::copy` would time the allocator too, and
/// `slice_set` candle's one-element-per-thread copy kernel, not the memory.
fn copy_ms(dev: &Device, x: &Tensor) -> Result<f64> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cd) = dev {
        let (st, layout) = x.storage_and_layout();
        let candle_core::Storage::Cuda(cs) = &*st else {
            bail!("a CUDA tensor without CUDA storage");
        };
        let src = cs
            .as_cuda_slice::<f32>()?
            .slice(layout.start_offset()..layout.start_offset() + x.elem_count());
        let mut dst = cd.alloc_zeros::<f32>(x.elem_count())?;
        return time_ms(dev, 10, || {
            cd.memcpy_dtod(&src, &mut dst)?;
            Ok(())
        });
    }
    let y = Tensor::zeros(x.shape(), x.dtype(), dev)?;
    time_ms(dev, 10, || {
        y.slice_set(x, 0, 0)?;
        Ok(())
    })
}

fn bench_row(
    name: &str,
    ms: f64,
    bytes: f64,
    flops: f64,
    bw: f64,
    rate: f64,
    note: String,
) -> Bench {
    let bf = bytes / bw * 1e3;
    let ff = flops / rate * 1e3;
    eprintln!("  {name:<40} {ms:9.3} ms  floors: bytes {bf:.3} ms, flops {ff:.3} ms");
    Bench {
        name: name.into(),
        ms,
        bytes_floor_ms: bf,
        flop_floor_ms: ff,
        of_floor: bf.max(ff) / ms,
        note,
    }
}

pub fn kernel_benches(
    dev: &Device,
    quick: bool,
    bw: f64,
    rate: f64,
    rng: &mut Rng,
    out: &mut Vec<Bench>,
) -> Result<()> {
    let dt = if dev.is_cpu() {
        DType::F32
    } else {
        DType::BF16
    };
    let es = dt.size_in_bytes() as f64;
    // Fused logprob forward + backward at Qwen3-0.6B's vocabulary.
    let (n, v, h) = if quick {
        (256, 4096, 64)
    } else {
        (8192, 151_936, 1024)
    };
    let (hd, _) = rand_t(rng, &[n, h], -1.0, 1.0, dt, dev)?;
    let (wd, _) = rand_t(rng, &[v, h], -0.05, 0.05, dt, dev)?;
    let y = Tensor::new(rng.below(n, v as u64).as_slice(), dev)?;
    let hv = candle_core::Var::from_tensor(&hd)?;
    let wv = candle_core::Var::from_tensor(&wd)?;
    let ms = time_ms(dev, 5, || {
        let o = arbor_ops::fused_logprobs(
            hv.as_tensor(),
            wv.as_tensor(),
            &y,
            arbor_ops::DEFAULT_CHUNK_ELEMS,
        )?;
        let _g = o.narrow(1, 0, 1)?.sum_all()?.backward()?;
        Ok(())
    })?;
    // fwd: 1 matmul; bwd: 3 matmuls (recompute, dW, dh).
    let flops = 4.0 * 2.0 * (n * v * h) as f64;
    let bytes = es * (2.0 * (v * h) as f64 + 2.0 * (n * h) as f64) * 2.0;
    out.push(bench_row(
        &format!("logprob fwd+bwd N={n} V={v} H={h}"),
        ms,
        bytes,
        flops,
        bw,
        rate,
        format!("{dt:?}"),
    ));
    // PPO loss forward + backward.
    let n = if quick { 1 << 16 } else { 1 << 24 };
    let lp = Tensor::rand(-3f32, -0.1, n, dev)?;
    let aux = Tensor::rand(0f32, 0.001, (n, 4), dev)?;
    let lv = candle_core::Var::from_tensor(&lp)?;
    let ms = time_ms(dev, 10, || {
        let o = arbor_ops::ppo_loss(
            lv.as_tensor(),
            &aux,
            arbor_ops::PpoClip {
                eps_low: 0.2,
                eps_high: 0.28,
            },
        )?;
        let _g = o.get(0)?.backward()?;
        Ok(())
    })?;
    // fwd reads logp + aux; bwd reads them again and writes the gradient.
    let bytes = 4.0 * n as f64 * (5.0 + 5.0 + 1.0);
    out.push(bench_row(
        &format!("ppo loss fwd+bwd N={n}"),
        ms,
        bytes,
        0.0,
        bw,
        rate,
        "f32".into(),
    ));
    // Segment broadcast.
    let s = n / 64;
    let seg: Vec<i64> = (0..n as i64).map(|i| i / 64).collect();
    let segt = Tensor::new(seg.as_slice(), dev)?;
    let vals = Tensor::rand(0f32, 1.0, s, dev)?;
    let ms = time_ms(dev, 10, || {
        let _b = arbor_ops::segment_broadcast(&vals, &segt)?;
        Ok(())
    })?;
    out.push(bench_row(
        &format!("segment broadcast N={n}"),
        ms,
        (8.0 + 4.0) * n as f64,
        0.0,
        bw,
        rate,
        "f32, i64 ids".into(),
    ));
    // Paged attention decode at Qwen3-0.6B's head shape.
    let (b, ctx, nh, nkv, d, bs) = if quick {
        (8, 256, 4, 2, 64, 16)
    } else {
        (64, 2048, 16, 8, 128, 16)
    };
    let nb = b * ctx / bs;
    let k = Tensor::rand(-1f32, 1.0, (nb * bs, nkv, d), dev)?.to_dtype(dt)?;
    let vv = Tensor::rand(-1f32, 1.0, (nb * bs, nkv, d), dev)?.to_dtype(dt)?;
    let q = Tensor::rand(-1f32, 1.0, (b, nh, d), dev)?.to_dtype(dt)?;
    let tables: Vec<Vec<u32>> = (0..b)
        .map(|i| ((i * ctx / bs) as u32..((i + 1) * ctx / bs) as u32).collect())
        .collect();
    let meta = arbor_ops::PagedMeta::new(
        &vec![(ctx - 1) as u32; b],
        &(0..b).collect::<Vec<_>>(),
        &tables,
        bs,
        dev,
    )?;
    let ms = time_ms(dev, 10, || {
        let _o = arbor_ops::paged_attention_op(&q, &k, &vv, &meta)?;
        Ok(())
    })?;
    let bytes = es * (2.0 * (b * ctx * nkv * d) as f64 + 2.0 * (b * nh * d) as f64);
    let flops = 4.0 * (b * ctx * nh * d) as f64;
    out.push(bench_row(
        &format!("paged attention decode B={b} ctx={ctx}"),
        ms,
        bytes,
        flops,
        bw,
        rate,
        format!("{dt:?}, {nh}/{nkv} heads, d {d}"),
    ));
    Ok(())
}

/// Decode tokens/s of a Qwen3-0.6B-shaped random model through the paged
/// device cache, at several batch sizes, vs the roofline
/// `max(weights + KV bytes / bandwidth, FLOPs / matmul rate)` per step.
pub fn decode_benches(
    dev: &Device,
    quick: bool,
    bw: f64,
    rate: f64,
    out: &mut Vec<Bench>,
) -> Result<()> {
    let cfg = model_cfg(quick);
    let dt = if dev.is_cpu() {
        DType::F32
    } else {
        DType::BF16
    };
    let m = model_on(&cfg, dt, dev)?;
    let params = cfg.num_parameters() as f64;
    let (prompt, steps): (usize, usize) = if quick { (16, 8) } else { (128, 32) };
    let batches: &[usize] = if quick { &[1, 4] } else { &[1, 64, 256] };
    let bs = 16;
    for &b in batches {
        let per = (prompt + steps + 2).div_ceil(bs);
        let cache = DeviceKvCache::new(&cfg, b * per, bs, dt, dev)?;
        let tables: Vec<Vec<u32>> = (0..b)
            .map(|i| ((i * per) as u32..((i + 1) * per) as u32).collect())
            .collect();
        let slot = |i: usize, p: usize| (tables[i][p / bs] as usize) * bs + p % bs;
        // Prefill every prompt in one packed step.
        let mut batch = PagedBatch {
            tables: tables.clone(),
            ..Default::default()
        };
        let mut ids = Vec::new();
        for i in 0..b {
            for p in 0..prompt {
                batch.slots.push(slot(i, p));
                batch.positions.push(p as u32);
                batch.token_seq.push(i);
                ids.push(((i * 31 + p * 7) % (cfg.vocab_size - 1)) as u32);
            }
        }
        let input = Tensor::from_vec(ids, (1, b * prompt), dev)?;
        let h = m.forward_with(
            &input,
            &batch.positions,
            &mut DevicePagedAttention::new(&cache, &batch)?,
        )?;
        let last: Vec<u32> = (0..b).map(|i| (i * prompt + prompt - 1) as u32).collect();
        let rows = Tensor::new(last.as_slice(), dev)?;
        let mut next = m
            .logits(&h.squeeze(0)?.index_select(&rows, 0)?)?
            .argmax(D::Minus1)?;
        dev.synchronize()?;
        let t0 = Instant::now();
        for s in 0..steps {
            let pos = prompt + s;
            let batch = PagedBatch {
                slots: (0..b).map(|i| slot(i, pos)).collect(),
                positions: vec![pos as u32; b],
                token_seq: (0..b).collect(),
                tables: tables.clone(),
            };
            let input = next.reshape((1, b))?;
            let h = m.forward_with(
                &input,
                &batch.positions,
                &mut DevicePagedAttention::new(&cache, &batch)?,
            )?;
            next = m.logits(&h.squeeze(0)?)?.argmax(D::Minus1)?;
        }
        let _ = next.to_vec1::<u32>()?;
        dev.synchronize()?;
        let ms = t0.elapsed().as_secs_f64() * 1e3 / steps as f64;
        let ctx = (prompt + steps / 2) as f64;
        let kv_bytes = b as f64
            * ctx
            * (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim) as f64
            * dt.size_in_bytes() as f64;
        let bytes = params * dt.size_in_bytes() as f64 + kv_bytes;
        let flops = 2.0 * params * b as f64
            + 4.0
                * b as f64
                * ctx
                * (cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim) as f64;
        let row = bench_row(
            &format!("decode B={b} (ctx {prompt}+{steps})"),
            ms,
            bytes,
            flops,
            bw,
            rate,
            String::new(),
        );
        let tps = b as f64 / (ms * 1e-3);
        let roof = b as f64 / (row.bytes_floor_ms.max(row.flop_floor_ms) * 1e-3);
        out.push(Bench {
            note: format!("{tps:.0} tok/s, roofline {roof:.0} tok/s, {dt:?}"),
            ..row
        });
    }
    Ok(())
}
