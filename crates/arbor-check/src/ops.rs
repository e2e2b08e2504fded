//! The custom ops against float64 references computed on the CPU from the
//! very inputs the device saw.
use candle_core::{DType, Device, Tensor};

use crate::util::{float_dtypes, push, rand_t, rel_err, Rng};
use crate::{Check, OrMsg, Result};

/// Fused logprob gather, forward and backward, f32 and bf16.
pub fn logprob_checks(
    dev: &Device,
    quick: bool,
    rng: &mut Rng,
    out: &mut Vec<Check>,
) -> Result<()> {
    let cpu = Device::Cpu;
    let (n, v, h) = if quick {
        (48, 1000, 32)
    } else {
        (256, 151_936, 1024)
    };
    for dt in float_dtypes(dev) {
        let (hd, h64) = rand_t(rng, &[n, h], -1.0, 1.0, dt, dev)?;
        let (wd, w64) = rand_t(rng, &[v, h], -0.1, 0.1, dt, dev)?;
        let y = rng.below(n, v as u64);
        let (yd, yc) = (
            Tensor::new(y.as_slice(), dev)?,
            Tensor::new(y.as_slice(), &cpu)?,
        );
        let coef = [0.7, -0.3, 0.1];
        let chunk = if quick {
            1 << 14
        } else {
            arbor_ops::DEFAULT_CHUNK_ELEMS
        };
        let run = |hh: &Tensor, ww: &Tensor, yy: &Tensor| -> Result<(Tensor, Tensor, Tensor)> {
            let hv = candle_core::Var::from_tensor(hh)?;
            let wv = candle_core::Var::from_tensor(ww)?;
            let o = arbor_ops::fused_logprobs(hv.as_tensor(), wv.as_tensor(), yy, chunk)?;
            let c = Tensor::new(&coef, hh.device())?.to_dtype(o.dtype())?;
            let g = o.broadcast_mul(&c)?.sum_all()?.backward()?;
            let gh = g.get(hv.as_tensor()).or_msg("no dh")?.clone();
            let gw = g.get(wv.as_tensor()).or_msg("no dW")?.clone();
            Ok((o, gh, gw))
        };
        let (o, gh, gw) = run(&hd, &wd, &yd)?;
        let (ro, rgh, rgw) = run(&h64, &w64, &yc)?;
        push(
            out,
            "kernel",
            "logprob fwd (logp, entropy, lse)",
            dt,
            rel_err(&o, &ro)?,
        );
        push(
            out,
            "kernel",
            "logprob bwd d hidden",
            dt,
            rel_err(&gh, &rgh)?,
        );
        push(
            out,
            "kernel",
            "logprob bwd d weight",
            dt,
            rel_err(&gw, &rgw)?,
        );
    }
    Ok(())
}

/// Token count of the loss and segment checks.
fn loss_len(quick: bool) -> usize {
    if quick {
        4096
    } else {
        1 << 20
    }
}

/// Masked clipped PPO loss and the value loss, forward and backward (f32).
pub fn loss_checks(dev: &Device, quick: bool, rng: &mut Rng, out: &mut Vec<Check>) -> Result<()> {
    let cpu = Device::Cpu;
    let n = loss_len(quick);
    let clip = arbor_ops::PpoClip {
        eps_low: 0.2,
        eps_high: 0.28,
    };
    // Inputs rounded to f32 (what the device sees) for both sides, and
    // log-ratios kept off the clip edges, where the gradient jumps between
    // -A r and 0 and a last-bit difference would flip a whole token.
    let f32r = |x: f64| x as f32 as f64;
    let lp: Vec<f64> = rng.uniform(n, -4.0, -0.05).into_iter().map(f32r).collect();
    let edges = [
        (1.0 - clip.eps_low as f64).ln(),
        (1.0 + clip.eps_high as f64).ln(),
    ];
    let old: Vec<f64> = lp
        .iter()
        .map(|&x| loop {
            let o = f32r(x + (rng.next_f64() - 0.5) * 0.6);
            if edges.iter().all(|e| ((x - o) - e).abs() > 1e-4) {
                break o;
            }
        })
        .collect();
    let adv: Vec<f64> = rng
        .uniform(n, -2.0, 2.0)
        .into_iter()
        .map(|x| x as f32 as f64)
        .collect();
    let mask: Vec<f32> = (0..n)
        .map(|_| if rng.next_f64() < 0.8 { 1.0 } else { 0.0 })
        .collect();
    // Sequence-mean weights (the trainer's aggregation) over sequences of
    // up to 97 tokens, rounded to the f32 the kernel reads.
    let seq_lens: Vec<usize> = (0..n).step_by(97).map(|s| (n - s).min(97)).collect();
    let w: Vec<f64> = arbor_rl::ppo::aggregation_weights(
        arbor_rl::ppo::Aggregation::SequenceMean,
        &arbor_rl::ppo::TokenBatch {
            mask: &mask,
            seq_lens: &seq_lens,
        },
    )?
    .into_iter()
    .map(|x| x as f32 as f64)
    .collect();
    let aux_rows = |a: &[f64], b: &[f64]| -> Vec<f64> {
        (0..n).flat_map(|i| [a[i], b[i], w[i], 0.0]).collect()
    };
    let aux = aux_rows(&old, &adv);
    let both = |x: &[f64],
                aux: &[f64],
                f: &dyn Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>|
     -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        let mut res = Vec::new();
        for (d, dt) in [(dev, DType::F32), (&cpu, DType::F64)] {
            let xv =
                candle_core::Var::from_tensor(&Tensor::new(x, &cpu)?.to_dtype(dt)?.to_device(d)?)?;
            let at = Tensor::from_slice(aux, (n, 4), &cpu)?
                .to_dtype(dt)?
                .to_device(d)?;
            let o = f(xv.as_tensor(), &at)?;
            let g = o.get(0)?.backward()?;
            res.push((o, g.get(xv.as_tensor()).or_msg("no grad")?.clone()));
        }
        let (b, a) = (res.pop().expect("two"), res.pop().expect("two"));
        Ok((a.0, a.1, b.0, b.1))
    };
    let (o, g, ro, rg) = both(&lp, &aux, &|x, a| arbor_ops::ppo_loss(x, a, clip))?;
    push(
        out,
        "kernel",
        "ppo loss fwd (loss, clip, kl, w)",
        DType::F32,
        rel_err(&o, &ro)?,
    );
    push(out, "kernel", "ppo loss bwd", DType::F32, rel_err(&g, &rg)?);
    let vals: Vec<f64> = rng.uniform(n, -1.0, 1.0).into_iter().map(f32r).collect();
    // Kept off the clip edges v - v_old = +-0.2, where a last-bit
    // difference would flip a token between clipped and not.
    let vold: Vec<f64> = vals
        .iter()
        .map(|x| loop {
            let o = f32r(x + (rng.next_f64() - 0.5) * 0.5);
            if ((x - o).abs() - 0.2).abs() > 1e-4 {
                break o;
            }
        })
        .collect();
    let ret: Vec<f64> = rng.uniform(n, -1.0, 1.0).into_iter().map(f32r).collect();
    let vaux = aux_rows(&ret, &vold);
    let (o, g, ro, rg) = both(&vals, &vaux, &|x, a| arbor_ops::value_loss(x, a, 0.2))?;
    push(
        out,
        "kernel",
        "value loss fwd",
        DType::F32,
        rel_err(&o, &ro)?,
    );
    push(
        out,
        "kernel",
        "value loss bwd",
        DType::F32,
        rel_err(&g, &rg)?,
    );
    Ok(())
}

/// Segment broadcast and its reverse, the segment sum (f32, i64 ids).
pub fn segment_checks(
    dev: &Device,
    quick: bool,
    rng: &mut Rng,
    out: &mut Vec<Check>,
) -> Result<()> {
    let cpu = Device::Cpu;
    let n = loss_len(quick);
    let s = n / 13;
    let seg: Vec<i64> = (0..n)
        .map(|_| (rng.next_f64() * (s as f64 + 8.0)) as i64 - 4)
        .collect();
    let segv = rng.uniform(s, -1.0, 1.0);
    let x = rng.uniform(n, -1.0, 1.0);
    let (sd, sc) = (
        Tensor::new(seg.as_slice(), dev)?,
        Tensor::new(seg.as_slice(), &cpu)?,
    );
    let b = arbor_ops::segment_broadcast(
        &Tensor::new(segv.as_slice(), &cpu)?
            .to_dtype(DType::F32)?
            .to_device(dev)?,
        &sd,
    )?;
    let rb = arbor_ops::segment_broadcast(&Tensor::new(segv.as_slice(), &cpu)?, &sc)?;
    push(
        out,
        "kernel",
        "segment broadcast",
        DType::F32,
        rel_err(&b, &rb)?,
    );
    let sm = arbor_ops::segment_sum(
        &Tensor::new(x.as_slice(), &cpu)?
            .to_dtype(DType::F32)?
            .to_device(dev)?,
        &sd,
        s,
    )?;
    let rs = arbor_ops::segment_sum(&Tensor::new(x.as_slice(), &cpu)?, &sc, s)?;
    push(out, "kernel", "segment sum", DType::F32, rel_err(&sm, &rs)?);
    Ok(())
}

/// Paged attention (decode and chunked prefill over a cached prefix) and the
/// KV cache write, f32 and bf16.
pub fn attention_checks(
    dev: &Device,
    quick: bool,
    rng: &mut Rng,
    out: &mut Vec<Check>,
) -> Result<()> {
    let cpu = Device::Cpu;
    let (nh, nkv, d, bs) = if quick {
        (4, 2, 32, 16)
    } else {
        (16, 8, 128, 16)
    };
    let lens: Vec<usize> = if quick {
        vec![5, 40, 17]
    } else {
        vec![1, 300, 2048, 777, 64]
    };
    let blocks_per: Vec<usize> = lens.iter().map(|l| l.div_ceil(bs)).collect();
    let total_blocks: usize = blocks_per.iter().sum::<usize>() + 3;
    // Shuffled block ids so tables are not contiguous.
    let mut ids: Vec<u32> = (0..total_blocks as u32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, (rng.next_f64() * (i + 1) as f64) as usize % (i + 1));
    }
    let mut tables = Vec::new();
    let mut next = 0;
    for &b in &blocks_per {
        tables.push(ids[next..next + b].to_vec());
        next += b;
    }
    // Queries: the last 3 positions of every sequence (prefill tail + decode).
    let (mut positions, mut token_seq) = (Vec::new(), Vec::new());
    for (si, &l) in lens.iter().enumerate() {
        for p in l.saturating_sub(3)..l {
            positions.push(p as u32);
            token_seq.push(si);
        }
    }
    let t = positions.len();
    let slots = total_blocks * bs;
    for dt in float_dtypes(dev) {
        let (kd, k64) = rand_t(rng, &[slots, nkv, d], -1.0, 1.0, dt, dev)?;
        let (vd, v64) = rand_t(rng, &[slots, nkv, d], -1.0, 1.0, dt, dev)?;
        let (qd, q64) = rand_t(rng, &[t, nh, d], -1.0, 1.0, dt, dev)?;
        let meta = arbor_ops::PagedMeta::new(&positions, &token_seq, &tables, bs, dev)?;
        let got = arbor_ops::paged_attention_op(&qd, &kd, &vd, &meta)?;
        let want = brute_attention(&q64, &k64, &v64, &positions, &token_seq, &tables, bs)?;
        push(out, "kernel", "paged attention", dt, rel_err(&got, &want)?);
        // KV write: scatter rows into fresh slots and read them back.
        let rows = Tensor::from_vec(rng.uniform(t * nkv * d, -1.0, 1.0), (t, nkv, d), &cpu)?
            .to_dtype(dt)?;
        let dst: Vec<u32> = (0..t as u32)
            .map(|i| (i * 7) % slots as u32)
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        let rows = rows.narrow(0, 0, dst.len())?;
        let cache = kd.copy()?;
        arbor_ops::cache_write(
            &cache,
            &rows.to_device(dev)?,
            &Tensor::new(dst.as_slice(), dev)?,
        )?;
        let back = cache.index_select(&Tensor::new(dst.as_slice(), dev)?, 0)?;
        push(out, "kernel", "kv cache write", dt, rel_err(&back, &rows)?);
    }
    Ok(())
}

/// Float64 attention by explicit gathers, `[t, nh, d]`.
fn brute_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    positions: &[u32],
    token_seq: &[usize],
    tables: &[Vec<u32>],
    bs: usize,
) -> Result<Tensor> {
    let (t, nh, d) = q.dims3()?;
    let nkv = k.dim(1)?;
    let q = q.flatten_all()?.to_vec1::<f64>()?;
    let k = k.flatten_all()?.to_vec1::<f64>()?;
    let v = v.flatten_all()?.to_vec1::<f64>()?;
    let mut o = vec![0f64; t * nh * d];
    for i in 0..t {
        let tab = &tables[token_seq[i]];
        let ctx = positions[i] as usize + 1;
        for h in 0..nh {
            let g = h / (nh / nkv);
            let qh = &q[(i * nh + h) * d..(i * nh + h + 1) * d];
            let row = |j: usize| (tab[j / bs] as usize * bs + j % bs) * nkv * d + g * d;
            let sc: Vec<f64> = (0..ctx)
                .map(|j| {
                    qh.iter()
                        .zip(&k[row(j)..row(j) + d])
                        .map(|(a, b)| a * b)
                        .sum::<f64>()
                        / (d as f64).sqrt()
                })
                .collect();
            let m = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = sc.iter().map(|s| (s - m).exp()).sum();
            for (j, s) in sc.iter().enumerate() {
                let p = (s - m).exp() / z;
                for e in 0..d {
                    o[(i * nh + h) * d + e] += p * v[row(j) + e];
                }
            }
        }
    }
    Ok(Tensor::from_vec(o, (t, nh, d), &Device::Cpu)?)
}

/// The training forward's fused ops (`rms_norm`, `rope`, `swiglu`,
/// `packed_causal_attention`), forward and the gradients of every input,
/// against the CPU's float64 kernels (finite-difference tested) on the same
/// inputs. On a GPU these are the ops the training forward runs there.
pub fn fused_checks(dev: &Device, quick: bool, rng: &mut Rng, out: &mut Vec<Check>) -> Result<()> {
    let cpu = Device::Cpu;
    // Qwen3-0.6B's attention and MLP shapes unless quick.
    let (lens, nh, nkv, d, hid, inter) = if quick {
        (vec![37usize, 20, 7], 4, 2, 64, 64, 96)
    } else {
        (vec![512usize, 300, 200, 12], 16, 8, 128, 1024, 3072)
    };
    let n: usize = lens.iter().sum();
    type Op = dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>;
    /// A named op with its inputs' shapes.
    type Case<'a> = (&'a str, Vec<Vec<usize>>, Box<Op>);
    /// Output and input gradients of `sum(f(inputs) * probe)`.
    fn grads(
        f: &dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>,
        xs: &[Tensor],
        probe: &Tensor,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let vars = xs
            .iter()
            .map(candle_core::Var::from_tensor)
            .collect::<candle_core::Result<Vec<_>>>()?;
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let y = f(&ts)?;
        let g = (y.to_dtype(DType::F32)?.to_dtype(probe.dtype())? * probe)?
            .sum_all()?
            .backward()?;
        let gs = vars
            .iter()
            .map(|v| g.get(v.as_tensor()).cloned().or_msg("no gradient"))
            .collect::<Result<Vec<_>>>()?;
        Ok((y, gs))
    }
    for dt in float_dtypes(dev) {
        let cases: Vec<Case<'_>> = vec![
            (
                "rms_norm",
                vec![vec![n, hid], vec![hid]],
                Box::new(|x: &[Tensor]| arbor_ops::rms_norm(&x[0], &x[1], 1e-6)),
            ),
            (
                "swiglu",
                vec![vec![n, inter], vec![n, inter]],
                Box::new(|x: &[Tensor]| arbor_ops::swiglu(&x[0], &x[1])),
            ),
            (
                "packed attention",
                vec![vec![n, nh, d], vec![n, nkv, d], vec![n, nkv, d]],
                Box::new({
                    let lens = lens.clone();
                    move |x: &[Tensor]| {
                        arbor_ops::packed_causal_attention(&x[0], &x[1], &x[2], &lens)
                    }
                }),
            ),
        ];
        for (name, shapes, f) in cases {
            let (xd, x64): (Vec<Tensor>, Vec<Tensor>) = shapes
                .iter()
                .map(|s| rand_t(rng, s, -1.0, 1.0, dt, dev))
                .collect::<Result<Vec<_>>>()?
                .into_iter()
                .unzip();
            let out_shape = f(&x64)?.dims().to_vec();
            let (pd, p64) = rand_t(rng, &out_shape, -1.0, 1.0, DType::F32, dev)?;
            let (y, g) = grads(&*f, &xd, &pd)?;
            let (ry, rg) = grads(&*f, &x64, &p64.to_device(&cpu)?)?;
            push(out, "fused", &format!("{name} fwd"), dt, rel_err(&y, &ry)?);
            for (i, (a, b)) in g.iter().zip(&rg).enumerate() {
                push(
                    out,
                    "fused",
                    &format!("{name} bwd d input {i}"),
                    dt,
                    rel_err(a, b)?,
                );
            }
        }
        // RoPE at every position of the packed sequences.
        let positions: Vec<f64> = lens
            .iter()
            .flat_map(|&l| (0..l).map(|p| p as f64))
            .collect();
        let mut cos = Vec::with_capacity(n * d / 2);
        let mut sin = Vec::with_capacity(n * d / 2);
        for &p in &positions {
            for i in 0..d / 2 {
                let a = p / 1e6f64.powf(2.0 * i as f64 / d as f64);
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        let table = |v: &[f64], dt: DType, dev: &Device| -> Result<Tensor> {
            Ok(Tensor::from_slice(v, (n, d / 2), &cpu)?
                .to_dtype(dt)?
                .to_device(dev)?)
        };
        let (cd, sd) = (table(&cos, dt, dev)?, table(&sin, dt, dev)?);
        let (c64, s64) = (
            table(&cos, DType::F64, &cpu)?,
            table(&sin, DType::F64, &cpu)?,
        );
        let (xd, x64) = rand_t(rng, &[n, nh, d], -1.0, 1.0, dt, dev)?;
        let (pd, p64) = rand_t(rng, &[n, nh, d], -1.0, 1.0, DType::F32, dev)?;
        let (y, g) = grads(&|x| arbor_ops::rope(&x[0], &cd, &sd), &[xd], &pd)?;
        let (ry, rg) = grads(
            &|x| arbor_ops::rope(&x[0], &c64, &s64),
            &[x64],
            &p64.to_device(&cpu)?,
        )?;
        push(out, "fused", "rope fwd", dt, rel_err(&y, &ry)?);
        push(out, "fused", "rope bwd", dt, rel_err(&g[0], &rg[0])?);
    }
    Ok(())
}

/// Sampling on the device ([`arbor_ops::sample_rows`]) against the host
/// reference ([`arbor_ops::sample_row`]) on the same f32 logits and draws:
/// greedy and three temperatures, masked (`-inf`) entries, and a NaN row
/// that must give no token. Checks the share of tokens that differ (a draw
/// within rounding of a token boundary may flip) and the logprobs and
/// entropies of the rest.
pub fn sampling_checks(
    dev: &Device,
    quick: bool,
    rng: &mut Rng,
    out: &mut Vec<Check>,
) -> Result<()> {
    let (rows, v) = if quick { (32, 1000) } else { (256, 151_936) };
    let mut logits = rng.uniform(rows * v, -4.0, 4.0);
    // Row 1 masks most of the vocabulary; row 2 is broken.
    for (i, x) in logits[v..2 * v].iter_mut().enumerate() {
        if i % 7 != 0 {
            *x = f64::NEG_INFINITY;
        }
    }
    logits[2 * v + v / 2] = f64::NAN;
    let host: Vec<f32> = logits.iter().map(|&x| x as f32).collect();
    let l = Tensor::from_vec(host.clone(), (rows, v), &Device::Cpu)?.to_device(dev)?;
    let reqs: Vec<arbor_ops::SampleRequest> = (0..rows)
        .map(|r| arbor_ops::SampleRequest {
            row: r as u32,
            inv_temperature: [0.0, 1.0, 1.0 / 0.7, 1.0 / 1.5][r % 4],
            u: rng.next_f64(),
        })
        .collect();
    let got = arbor_ops::sample_rows(&l, &reqs)?;
    let (mut differ, mut broken_ok) = (0usize, true);
    let (mut g, mut w) = (Vec::new(), Vec::new());
    for (r, got) in reqs.iter().zip(&got) {
        let want = arbor_ops::sample_row(&host[r.row as usize * v..][..v], r.inv_temperature, r.u);
        match (got, want) {
            (Some(a), Some(b)) if a.token == b.token => {
                g.extend([a.logprob as f64, a.entropy as f64]);
                w.extend([b.logprob as f64, b.entropy as f64]);
            }
            (Some(_), Some(_)) => differ += 1,
            (None, None) => {}
            _ => broken_ok = false,
        }
    }
    let frac = if broken_ok {
        differ as f64 / rows as f64
    } else {
        f64::NAN
    };
    crate::util::push_tol(
        out,
        "kernel",
        "sampling: tokens that differ",
        DType::F32,
        frac,
        2.0 / rows as f64,
    );
    let g = Tensor::new(g.as_slice(), &Device::Cpu)?;
    let w = Tensor::new(w.as_slice(), &Device::Cpu)?;
    push(
        out,
        "kernel",
        "sampling: logprob, entropy",
        DType::F32,
        rel_err(&g, &w)?,
    );
    Ok(())
}

/// The dedicated decode step's fused kernels (`arbor_ops::decode`), each
/// against its host reference on the same bf16 inputs: add + RMSNorm (the
/// residual and the normed rows), q/k-norm + bias + RoPE + KV write (the
/// queries, the K and V rows at their slots, and nothing written for a
/// padding row's out-of-cache slot), SiLU x up. GPU kernels: on the CPU
/// only their references run (in `cargo test`).
pub fn decode_kernel_checks(
    dev: &Device,
    quick: bool,
    rng: &mut Rng,
    out: &mut Vec<Check>,
) -> Result<()> {
    #[cfg(feature = "cuda")]
    if !dev.is_cpu() {
        return decode_kernels_cuda(dev, quick, rng, out);
    }
    let _ = (dev, quick, rng, out);
    eprintln!("  decode kernels: GPU kernels; their host references are tested by cargo test");
    Ok(())
}

#[cfg(feature = "cuda")]
fn decode_kernels_cuda(
    dev: &Device,
    quick: bool,
    rng: &mut Rng,
    out: &mut Vec<Check>,
) -> Result<()> {
    use arbor_ops::decode::{self as dk, cuda::RopeWrite};
    use half::bf16;
    let (b, h, nh, nkv, d, inter) = if quick {
        (5, 64, 4, 2, 16, 128)
    } else {
        (5, 1024, 16, 8, 128, 3072)
    };
    let bf = |v: Vec<f64>| -> Vec<bf16> { v.into_iter().map(bf16::from_f64).collect() };
    let up = |v: &[bf16], shape: &[usize]| -> Result<Tensor> {
        Ok(Tensor::from_slice(v, shape, &Device::Cpu)?.to_device(dev)?)
    };
    let bt = DType::BF16;
    // add + RMSNorm.
    let resid: Vec<f32> = rng
        .uniform(b * h, -2.0, 2.0)
        .iter()
        .map(|&x| x as f32)
        .collect();
    let delta = bf(rng.uniform(b * h, -1.0, 1.0));
    let w = bf(rng.uniform(h, 0.5, 1.5));
    let rd = Tensor::from_slice(&resid, (b, h), &Device::Cpu)?.to_device(dev)?;
    let normed = dk::cuda::add_rms_norm(&rd, Some(&up(&delta, &[b, h])?), &up(&w, &[h])?, 1e-6)?;
    let (mut want_r, mut want_n) = (resid.clone(), Vec::new());
    for (r, dl) in want_r.chunks_mut(h).zip(delta.chunks(h)) {
        want_n.extend(dk::add_rms_norm_row(r, Some(dl), &w, 1e-6));
    }
    let want_n = Tensor::from_slice(&want_n, (b, h), &Device::Cpu)?;
    push(
        out,
        "kernel",
        "decode: add + rmsnorm (normed)",
        bt,
        rel_err(&normed, &want_n)?,
    );
    let want_r = Tensor::from_slice(&want_r, (b, h), &Device::Cpu)?;
    crate::util::push_tol(
        out,
        "kernel",
        "decode: add + rmsnorm (residual)",
        DType::F32,
        rel_err(&rd, &want_r)?,
        1e-6,
    );
    // q/k-norm + bias + RoPE + KV write; row 4 is padding (slot past the cache).
    let (qw, kvw) = (nh * d, nkv * d);
    let q = bf(rng.uniform(b * qw, -1.0, 1.0));
    let k = bf(rng.uniform(b * kvw, -1.0, 1.0));
    let v = bf(rng.uniform(b * kvw, -1.0, 1.0));
    let (qb, kb, vb) = (
        bf(rng.uniform(qw, -0.2, 0.2)),
        bf(rng.uniform(kvw, -0.2, 0.2)),
        bf(rng.uniform(kvw, -0.2, 0.2)),
    );
    let (qn, kn) = (bf(rng.uniform(d, 0.5, 1.5)), bf(rng.uniform(d, 0.5, 1.5)));
    let inv_freq: Vec<f32> = (0..d / 2)
        .map(|i| 1.0 / 1e6f32.powf(2.0 * i as f32 / d as f32))
        .collect();
    let pos: Vec<u32> = rng.below(b, 4000);
    let n_slots = 64usize;
    let slots: Vec<u32> = vec![3, 17, 40, 63, u32::MAX];
    let cache = || Tensor::zeros((n_slots, nkv, d), bt, dev);
    let (kc, vc) = (cache()?, cache()?);
    let (qt, kt, vt) = (up(&q, &[b, qw])?, up(&k, &[b, kvw])?, up(&v, &[b, kvw])?);
    let (qbt, kbt, vbt, qnt, knt) = (
        up(&qb, &[qw])?,
        up(&kb, &[kvw])?,
        up(&vb, &[kvw])?,
        up(&qn, &[d])?,
        up(&kn, &[d])?,
    );
    let ft = Tensor::from_slice(&inv_freq, d / 2, &Device::Cpu)?.to_device(dev)?;
    let pt = Tensor::from_slice(&pos, b, &Device::Cpu)?.to_device(dev)?;
    let st = Tensor::from_slice(&slots, b, &Device::Cpu)?.to_device(dev)?;
    let rope = RopeWrite {
        fused: None,
        q: &qt,
        k: &kt,
        v: &vt,
        q_bias: Some(&qbt),
        k_bias: Some(&kbt),
        v_bias: Some(&vbt),
        q_norm: Some(&qnt),
        k_norm: Some(&knt),
        eps: 1e-6,
        inv_freq: &ft,
        pos: &pt,
        slots: &st,
        k_cache: &kc,
        v_cache: &vc,
        heads: nh,
        kv_heads: nkv,
        head_dim: d,
    };
    let q_out = dk::cuda::qk_rope_write(&rope)?;
    let (mut wq, mut wk, mut wv) = (Vec::new(), Vec::new(), Vec::new());
    let (mut gk, mut gv) = (Vec::new(), Vec::new());
    let kc_host = kc
        .to_dtype(DType::F32)?
        .to_device(&Device::Cpu)?
        .to_vec3::<f32>()?;
    let vc_host = vc
        .to_dtype(DType::F32)?
        .to_device(&Device::Cpu)?
        .to_vec3::<f32>()?;
    for row in 0..b {
        for hh in 0..nh {
            let x = &q[row * qw + hh * d..][..d];
            wq.extend(dk::qk_rope_head(
                x,
                Some(&qb[hh * d..][..d]),
                Some(&qn),
                1e-6,
                &inv_freq,
                pos[row],
            ));
        }
        if slots[row] as usize >= n_slots {
            continue;
        }
        for hh in 0..nkv {
            let x = &k[row * kvw + hh * d..][..d];
            wk.extend(dk::qk_rope_head(
                x,
                Some(&kb[hh * d..][..d]),
                Some(&kn),
                1e-6,
                &inv_freq,
                pos[row],
            ));
            wv.extend((0..d).map(|e| {
                bf16::from_f32(v[row * kvw + hh * d + e].to_f32() + vb[hh * d + e].to_f32())
                    .to_f32()
            }));
            gk.extend_from_slice(&kc_host[slots[row] as usize][hh]);
            gv.extend_from_slice(&vc_host[slots[row] as usize][hh]);
        }
    }
    let t = |v: Vec<f32>| Tensor::from_vec(v.clone(), v.len(), &Device::Cpu);
    push(
        out,
        "kernel",
        "decode: q norm + rope",
        bt,
        rel_err(&q_out.flatten_all()?, &t(wq)?)?,
    );
    push(
        out,
        "kernel",
        "decode: k norm + rope -> cache",
        bt,
        rel_err(&t(gk)?, &t(wk)?)?,
    );
    push(
        out,
        "kernel",
        "decode: v -> cache",
        bt,
        rel_err(&t(gv)?, &t(wv)?)?,
    );
    // The same through one fused row per token (q | k | v), as the step's
    // one QKV GEMM writes them: identical results.
    let fused = Tensor::cat(&[&qt, &kt, &vt], 1)?;
    let (kc2, vc2) = (cache()?, cache()?);
    let q_fused = dk::cuda::qk_rope_write(&RopeWrite {
        fused: Some(&fused),
        k_cache: &kc2,
        v_cache: &vc2,
        ..rope
    })?;
    let same = rel_err(&q_fused, &q_out)?
        .max(rel_err(&kc2, &kc)?)
        .max(rel_err(&vc2, &vc)?);
    crate::util::push_tol(
        out,
        "kernel",
        "decode: q/k/v from one fused row",
        bt,
        same,
        0.0,
    );
    let written: std::collections::BTreeSet<usize> = slots.iter().map(|&s| s as usize).collect();
    let stray = kc_host
        .iter()
        .chain(&vc_host)
        .enumerate()
        .filter(|(i, rows)| {
            !written.contains(&(i % n_slots)) && rows.iter().flatten().any(|&x| x != 0.0)
        })
        .count();
    crate::util::push_tol(
        out,
        "kernel",
        "decode: rows written outside the slots",
        bt,
        stray as f64,
        0.0,
    );
    // SiLU x up.
    let (g, u) = (
        bf(rng.uniform(b * inter, -4.0, 4.0)),
        bf(rng.uniform(b * inter, -2.0, 2.0)),
    );
    let got = dk::cuda::silu_mul(&up(&g, &[b, inter])?, &up(&u, &[b, inter])?)?;
    let want = Tensor::from_vec(dk::silu_mul(&g, &u), (b, inter), &Device::Cpu)?;
    push(
        out,
        "kernel",
        "decode: silu x up",
        bt,
        rel_err(&got, &want)?,
    );
    // Gate and up from one fused row per token, as the gate|up GEMM writes.
    let gu = Tensor::cat(&[&up(&g, &[b, inter])?, &up(&u, &[b, inter])?], 1)?;
    let fused = dk::cuda::silu_mul_rows(&gu)?;
    crate::util::push_tol(
        out,
        "kernel",
        "decode: silu x up from fused rows",
        bt,
        rel_err(&fused, &got)?,
        0.0,
    );
    Ok(())
}
