//! `arbor check-device`: every custom kernel against its CPU reference on
//! fresh random inputs, the model's logits on the device vs the CPU, a short
//! training step on the device, then the device benchmarks (kernel time vs
//! the bytes-moved or FLOP floor, decode tokens/s vs the roofline). Prints a
//! table last and writes JSON.
//!
//! Accuracy is `||out - ref|| / ||ref||` with the reference computed on the
//! CPU in float64 from the very inputs the device saw (bf16 inputs rounded
//! first). Tolerances: f32 paths 1e-4
//! (f32 arithmetic lands far under 1e-3), bf16 paths 1e-2. NaN never
//! passes; outputs are poisoned (NaN-filled) before every kernel writes them
//! so an unwritten element fails the check.
//!
//! `--device cpu` runs the same pipeline on the CPU (the CPU ops against the
//! float64 brute force), which is how CI exercises this command without a GPU.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use arbor_engine::paged::{DeviceKvCache, DevicePagedAttention, PagedBatch};
use arbor_model::{ModelConfig, ParamLoader, ParamSource, Transformer};
use candle_core::{DType, Device, Tensor, D};
use candle_nn::Optimizer;
use serde::Serialize;

#[derive(Debug, clap::Args)]
pub struct CheckDeviceArgs {
    /// `cuda` (the default when built with `--features cuda`) or `cpu`.
    #[arg(long)]
    device: Option<String>,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    ordinal: usize,
    /// Where to write the JSON results.
    #[arg(long, default_value = "check-device.json")]
    json: PathBuf,
    /// Small sizes everywhere (CPU smoke runs).
    #[arg(long)]
    quick: bool,
    /// Seed of the random inputs (default: from the clock, so each run draws
    /// fresh inputs).
    #[arg(long)]
    seed: Option<u64>,
    /// Skip the benchmarks.
    #[arg(long)]
    no_bench: bool,
}

#[derive(Debug, Serialize, Clone)]
pub struct Check {
    pub section: String,
    pub name: String,
    pub dtype: String,
    pub rel_err: f64,
    pub tol: f64,
    pub pass: bool,
}

#[derive(Debug, Serialize, Clone)]
pub struct Bench {
    pub name: String,
    /// Median time per call, ms.
    pub ms: f64,
    /// Floor from bytes moved at the measured copy bandwidth, ms.
    pub bytes_floor_ms: f64,
    /// Floor from FLOPs at the measured matmul rate, ms.
    pub flop_floor_ms: f64,
    /// max(floors) / ms.
    pub of_floor: f64,
    pub note: String,
}

#[derive(Debug, Serialize)]
struct Report {
    device: String,
    /// The CPU matmul kernels of this machine (`avx512`, `avx512-bf16`,
    /// `avx2`, `portable`): the CPU side of every check.
    cpu_kernels: &'static str,
    seed: u64,
    quick: bool,
    date_unix: u64,
    /// False while the run is in progress (the JSON is rewritten after
    /// every section) or when it was cut short.
    complete: bool,
    copy_gbps: Option<f64>,
    matmul_tflops: Option<f64>,
    checks: Vec<Check>,
    benches: Vec<Bench>,
    all_pass: bool,
}

pub fn run(a: CheckDeviceArgs) -> Result<()> {
    let want = a.device.clone().unwrap_or_else(|| {
        if cfg!(feature = "cuda") {
            "cuda".into()
        } else {
            "cpu".into()
        }
    });
    let dev = match want.as_str() {
        "cpu" => Device::Cpu,
        "cuda" => {
            if !cfg!(feature = "cuda") {
                bail!("this arbor was built without CUDA; rebuild with `--features cuda` (see scripts/gpu-check.sh) or pass --device cpu");
            }
            arbor_train::parse_device(&format!("cuda:{}", a.ordinal)).map_err(|e| {
                anyhow::anyhow!("no usable CUDA device: {e} (is the NVIDIA driver loaded, libcuda.so.1 the driver's?)")
            })?
        }
        other => bail!("--device must be cuda or cpu, not `{other}`"),
    };
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    let quick = a.quick || dev.is_cpu();
    let cpu_kernels = arbor_ops::MatmulIsa::detect().name();
    eprintln!(
        "check-device: {want} (seed {seed}{}; CPU kernels {cpu_kernels})",
        if quick { ", quick sizes" } else { "" }
    );
    arbor_ops::set_poison(true);
    let mut rng = Rng(seed);
    let mut rep = Report {
        device: format!("{dev:?}"),
        cpu_kernels,
        seed,
        quick,
        date_unix: 0,
        complete: false,
        copy_gbps: None,
        matmul_tflops: None,
        checks: Vec::new(),
        benches: Vec::new(),
        all_pass: false,
    };
    // Each section is guarded: an error or a panic (a kernel that fails to
    // load, a launch error) becomes one failed check naming the section, and
    // the rest still run. The JSON is rewritten after every section, so a
    // run cut short by a time limit keeps what it measured.
    type Section = fn(&Device, bool, &mut Rng, &mut Vec<Check>) -> Result<()>;
    let sections: [(&str, Section); 6] = [
        ("logprob", logprob_checks),
        ("losses", loss_checks),
        ("segment", segment_checks),
        ("attention", attention_checks),
        ("model", |d, q, _, o| model_checks(d, q, o)),
        ("train", train_check),
    ];
    for (name, f) in sections {
        guarded(name, &mut rep.checks, |out| f(&dev, quick, &mut rng, out));
        rep.save(&a.json)?;
    }
    arbor_ops::set_poison(false);
    if !a.no_bench {
        if let Some((bw, rate)) = guarded("ceilings", &mut rep.checks, |_| ceilings(&dev, quick)) {
            rep.copy_gbps = Some(bw / 1e9);
            rep.matmul_tflops = Some(rate / 1e12);
            rep.save(&a.json)?;
            let mut benches = Vec::new();
            guarded("kernel benches", &mut rep.checks, |_| {
                kernel_benches(&dev, quick, bw, rate, &mut rng, &mut benches)
            });
            rep.benches.append(&mut benches);
            rep.save(&a.json)?;
            guarded("decode benches", &mut rep.checks, |_| {
                decode_benches(&dev, quick, bw, rate, &mut benches)
            });
            rep.benches.append(&mut benches);
        }
    }
    rep.complete = true;
    rep.save(&a.json)?;
    let all_pass = rep.all_pass;
    print_tables(&rep.checks, &rep.benches, rep.copy_gbps, rep.matmul_tflops);
    println!(
        "{} ({} checks, {} failed); JSON: {}",
        if all_pass { "ALL PASS" } else { "FAILED" },
        rep.checks.len(),
        rep.checks.iter().filter(|c| !c.pass).count(),
        a.json.display()
    );
    if !all_pass {
        bail!("some device checks are outside tolerance or did not run");
    }
    Ok(())
}

impl Report {
    /// Writes the report as it stands (`complete: false` until the end).
    fn save(&mut self, path: &std::path::Path) -> Result<()> {
        self.all_pass = !self.checks.is_empty() && self.checks.iter().all(|c| c.pass);
        self.date_unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        std::fs::write(path, serde_json::to_string_pretty(self)?)
            .with_context(|| format!("writing {}", path.display()))
    }
}

/// Runs one section of the check. An error or a panic is recorded as a
/// failed check of that section named `did not finish: <message>` (error
/// NaN, written as null in the JSON) and `None` is returned; the caller goes
/// on with the next section.
fn guarded<T>(
    section: &str,
    out: &mut Vec<Check>,
    f: impl FnOnce(&mut Vec<Check>) -> Result<T>,
) -> Option<T> {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut *out)));
    let msg = match r {
        Ok(Ok(v)) => return Some(v),
        Ok(Err(e)) => format!("{e:#}"),
        Err(p) => p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .map(|s| format!("panic: {s}"))
            .unwrap_or_else(|| "panic".into()),
    };
    eprintln!("  {section:<8} did not finish: {msg}");
    out.push(Check {
        section: section.into(),
        name: format!("did not finish: {msg}"),
        dtype: String::new(),
        rel_err: f64::NAN,
        tol: 0.0,
        pass: false,
    });
    None
}

/// SplitMix64: cheap, seeded, device-independent inputs.
struct Rng(u64);

impl Rng {
    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
    fn uniform(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n).map(|_| lo + (hi - lo) * self.next_f64()).collect()
    }
    fn below(&mut self, n: usize, k: u64) -> Vec<u32> {
        (0..n)
            .map(|_| (self.next_f64() * k as f64) as u32 % k as u32)
            .collect()
    }
}

/// A random tensor in `dt` on `dev`, and its (rounded) values as f64 on the CPU.
fn rand_t(
    rng: &mut Rng,
    shape: &[usize],
    lo: f64,
    hi: f64,
    dt: DType,
    dev: &Device,
) -> Result<(Tensor, Tensor)> {
    let n = shape.iter().product();
    let host = Tensor::from_vec(rng.uniform(n, lo, hi), shape, &Device::Cpu)?.to_dtype(dt)?;
    Ok((host.to_device(dev)?, host.to_dtype(DType::F64)?))
}

fn rel_err(got: &Tensor, want: &Tensor) -> Result<f64> {
    let g = got
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .flatten_all()?;
    let w = want
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .flatten_all()?;
    let num = (&g - &w)?.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    let den = w.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt().max(1e-300);
    let e = num / den;
    Ok(if e.is_finite() { e } else { f64::NAN })
}

/// The tolerance of one operation's output in `dt`: f32 and
/// f64 paths 1e-4, bf16 paths 1e-2.
fn op_tol(dt: DType) -> f64 {
    if dt == DType::F32 || dt == DType::F64 {
        1e-4
    } else {
        1e-2
    }
}

fn push(out: &mut Vec<Check>, section: &str, name: &str, dt: DType, err: f64) {
    push_tol(out, section, name, dt, err, op_tol(dt))
}

fn push_tol(out: &mut Vec<Check>, section: &str, name: &str, dt: DType, err: f64, tol: f64) {
    let pass = err.is_finite() && err <= tol;
    eprintln!(
        "  {section:<8} {name:<36} {dt:?}: {err:.2e} (tol {tol:.0e}) {}",
        if pass { "ok" } else { "FAIL" }
    );
    out.push(Check {
        section: section.into(),
        name: name.into(),
        dtype: format!("{dt:?}").to_lowercase(),
        rel_err: err,
        tol,
        pass,
    });
}

fn float_dtypes(dev: &Device) -> Vec<DType> {
    if dev.is_cpu() {
        vec![DType::F32]
    } else {
        vec![DType::F32, DType::BF16]
    }
}

/// Fused logprob gather, forward and backward, f32 and bf16.
fn logprob_checks(dev: &Device, quick: bool, rng: &mut Rng, out: &mut Vec<Check>) -> Result<()> {
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
            let gh = g.get(hv.as_tensor()).context("no dh")?.clone();
            let gw = g.get(wv.as_tensor()).context("no dW")?.clone();
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
fn loss_checks(dev: &Device, quick: bool, rng: &mut Rng, out: &mut Vec<Check>) -> Result<()> {
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
            res.push((o, g.get(xv.as_tensor()).context("no grad")?.clone()));
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
fn segment_checks(dev: &Device, quick: bool, rng: &mut Rng, out: &mut Vec<Check>) -> Result<()> {
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
fn attention_checks(dev: &Device, quick: bool, rng: &mut Rng, out: &mut Vec<Check>) -> Result<()> {
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
            let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
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

fn model_cfg(quick: bool) -> ModelConfig {
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

fn model_on(cfg: &ModelConfig, dt: DType, dev: &Device) -> Result<Transformer> {
    let p = ParamLoader::frozen(ParamSource::Random { seed: MODEL_SEED }, dt, dev);
    Ok(Transformer::load(cfg, &p)?)
}

/// Logits of the device model (f32 and bf16) vs the f32 CPU model on the
/// same random weights, dense forward and the paged decode path.
fn model_checks(dev: &Device, quick: bool, out: &mut Vec<Check>) -> Result<()> {
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
        let h = last.context("decode step")?;
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
/// on the device must lower the loss.
fn train_check(dev: &Device, quick: bool, rng: &mut Rng, out: &mut Vec<Check>) -> Result<()> {
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
    let mut losses = Vec::new();
    for (d, steps) in [(Device::Cpu, 1), (dev.clone(), 4)] {
        let vm = candle_nn::VarMap::new();
        let p = ParamLoader::trainable(ParamSource::Random { seed: 3 }, DType::F32, &d, vm.clone());
        let m = Transformer::load(&cfg, &p)?;
        let x = Tensor::from_vec(ids.clone(), (b, t), &d)?;
        let inputs = x.narrow(1, 0, t - 1)?;
        let targets = x.narrow(1, 1, t - 1)?.flatten_all()?;
        let loss_of = |m: &Transformer, old: Option<&Tensor>| -> Result<(Tensor, Tensor)> {
            let hid = m
                .forward_hidden(&inputs)?
                .reshape((b * (t - 1), cfg.hidden_size))?;
            let lp = arbor_ops::fused_logprobs(&hid, &m.lm_head, &targets, 1 << 16)?
                .narrow(1, 0, 1)?
                .squeeze(1)?;
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
        let g = l0.backward()?;
        let mut named: Vec<(String, Tensor)> = vm
            .data()
            .lock()
            .map_err(|_| anyhow::anyhow!("varmap lock"))?
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
    if dg.len() != cg.len() {
        bail!(
            "device step produced gradients for {} tensors, CPU for {}",
            dg.len(),
            cg.len()
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
        &format!("ppo step grads ({} tensors)", dg.len()),
        DType::F32,
        rel_err(&flat(dg)?, &flat(cg)?)?,
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
    v.sort_by(|a, b| a.total_cmp(b));
    Ok(v[v.len() / 2])
}

/// Measured copy bandwidth (bytes read + written per second) and bf16 (f32
/// on the CPU) matmul rate.
fn ceilings(dev: &Device, quick: bool) -> Result<(f64, f64)> {
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

fn kernel_benches(
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
fn decode_benches(
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

fn print_tables(checks: &[Check], benches: &[Bench], bw: Option<f64>, rate: Option<f64>) {
    println!();
    println!("| section | check | dtype | rel err | tol | |");
    println!("|---|---|---|---|---|---|");
    for c in checks {
        println!(
            "| {} | {} | {} | {:.2e} | {:.0e} | {} |",
            c.section,
            c.name,
            c.dtype,
            c.rel_err,
            c.tol,
            if c.pass { "ok" } else { "FAIL" }
        );
    }
    if !benches.is_empty() {
        println!();
        println!(
            "ceilings: copy {:.0} GB/s, matmul {:.1} TFLOP/s",
            bw.unwrap_or(0.0),
            rate.unwrap_or(0.0)
        );
        println!("| benchmark | ms | bytes floor ms | flop floor ms | of floor | note |");
        println!("|---|---|---|---|---|---|");
        for b in benches {
            println!(
                "| {} | {:.3} | {:.3} | {:.3} | {:.0}% | {} |",
                b.name,
                b.ms,
                b.bytes_floor_ms,
                b.flop_floor_ms,
                100.0 * b.of_floor,
                b.note
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guarded_records_errors_and_panics_and_goes_on() {
        let mut out = Vec::new();
        assert_eq!(guarded("a", &mut out, |_| Ok(3)), Some(3));
        assert!(out.is_empty());
        assert_eq!(
            guarded("b", &mut out, |_| -> Result<()> { bail!("no kernel") }),
            None
        );
        assert_eq!(
            guarded("c", &mut out, |o| -> Result<()> {
                push(o, "c", "first", DType::F32, 0.0);
                panic!("launch failed")
            }),
            None
        );
        let names: Vec<_> = out
            .iter()
            .map(|c| (c.section.as_str(), c.name.as_str(), c.pass))
            .collect();
        assert_eq!(
            names,
            [
                ("b", "did not finish: no kernel", false),
                ("c", "first", true),
                ("c", "did not finish: panic: launch failed", false),
            ]
        );
    }
}
