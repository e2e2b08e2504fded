//! Token sampling from rows of logits where they are: on a GPU only token
//! ids, logprobs and entropies leave the device, never the `[B, vocab]`
//! logits.
//!
//! Request `r` reads row `row` of `logits: [n, V]` (f32). With
//! `s_v = (l_v - max l) / T` (`T = 1` for greedy), `w_v = exp(s_v)` and
//! `Z = sum_v w_v` (f64):
//!
//! - greedy (`inv_temperature = 0`): the argmax, lowest id on ties, with
//!   logprob `(l_tok - max l) - ln Z`;
//! - otherwise the inverse CDF in id order: the first `v` with
//!   `sum_{j <= v} w_j > u Z` for the request's uniform draw `u` in [0, 1)
//!   (the last `v` with `w_v > 0` should rounding leave the sum short),
//!   with logprob `ln(w_tok / Z)`;
//! - entropy of the tempered distribution, `ln Z - sum_v w_v s_v / Z`.
//!
//! This is the engine's sampling rule without top-k / top-p / min-p cuts
//! (`arbor_engine::sampling`), so a sequence that draws its `u` from its own
//! RNG gets the same token on either device. A row holding a NaN or `+inf`,
//! or nothing above `-inf`, has no distribution: `None`.

use candle_core::{DType, Result, Tensor};

/// One token to sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleRequest {
    /// Row of the logits.
    pub row: u32,
    /// `1 / T`; 0 is greedy.
    pub inv_temperature: f32,
    /// The sequence's uniform draw in [0, 1) (unused when greedy).
    pub u: f64,
}

/// A sampled token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// `ln p(token)` under the tempered distribution (`T = 1` for greedy).
    pub logprob: f32,
    /// Entropy of the tempered distribution, in nats.
    pub entropy: f32,
}

/// One token per request from `logits: [n, V]` (f32): on the CPU by
/// [`sample_row`], on a GPU by one kernel launch (one block per request)
/// with one upload of the requests and one download of the results.
pub fn sample_rows(logits: &Tensor, reqs: &[SampleRequest]) -> Result<Vec<Option<Sampled>>> {
    let (n, v) = logits.dims2()?;
    if logits.dtype() != DType::F32 {
        candle_core::bail!("sample_rows: logits must be f32, not {:?}", logits.dtype());
    }
    if let Some(r) = reqs.iter().find(|r| r.row as usize >= n) {
        candle_core::bail!("sample_rows: row {} of {n} rows", r.row);
    }
    if reqs.is_empty() {
        return Ok(Vec::new());
    }
    if v == 0 {
        return Ok(vec![None; reqs.len()]);
    }
    match logits.device() {
        candle_core::Device::Cpu => {
            let flat = logits.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
            Ok(reqs
                .iter()
                .map(|r| sample_row(&flat[r.row as usize * v..][..v], r.inv_temperature, r.u))
                .collect())
        }
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(dev) => cuda_sample(dev, logits, v, reqs),
        other => candle_core::bail!("sample_rows: no kernel for {other:?}"),
    }
}

/// The `sample_rows` kernel's output, three words a request (token,
/// logprob bits, entropy bits; token `u32::MAX`: no distribution), as
/// results.
pub fn unpack_samples(words: &[u32]) -> Vec<Option<Sampled>> {
    words
        .chunks_exact(3)
        .map(|w| {
            (w[0] != u32::MAX).then(|| Sampled {
                token: w[0],
                logprob: f32::from_bits(w[1]),
                entropy: f32::from_bits(w[2]),
            })
        })
        .collect()
}

/// [`sample_rows`] of one row, on the host: the reference the kernel is
/// checked against.
pub fn sample_row(l: &[f32], inv_temperature: f32, u: f64) -> Option<Sampled> {
    let greedy = inv_temperature == 0.0;
    let inv_t = if greedy { 1.0 } else { inv_temperature };
    let (mut m, mut arg) = (f32::NEG_INFINITY, 0usize);
    for (i, &x) in l.iter().enumerate() {
        if x > m {
            (m, arg) = (x, i);
        }
    }
    let (mut z, mut ws, mut last) = (0f64, 0f64, None);
    for (i, &x) in l.iter().enumerate() {
        let s = (x - m) * inv_t;
        let w = s.exp();
        z += w as f64;
        if w > 0.0 {
            ws += w as f64 * s as f64;
            last = Some(i);
        }
    }
    if !(m.is_finite() && z >= 1.0 && z.is_finite()) {
        return None;
    }
    let entropy = (z.ln() - ws / z) as f32;
    if greedy {
        return Some(Sampled {
            token: arg as u32,
            logprob: (l[arg] - m) - z.ln() as f32,
            entropy,
        });
    }
    let target = u * z;
    let mut acc = 0f64;
    let mut tok = last?;
    for (i, &x) in l.iter().enumerate() {
        acc += ((x - m) * inv_t).exp() as f64;
        if acc > target {
            tok = i;
            break;
        }
    }
    let w = ((l[tok] - m) * inv_t).exp() as f64;
    Some(Sampled {
        token: tok as u32,
        logprob: (w / z).ln() as f32,
        entropy,
    })
}

#[cfg(feature = "cuda")]
fn cuda_sample(
    dev: &candle_core::CudaDevice,
    logits: &Tensor,
    v: usize,
    reqs: &[SampleRequest],
) -> Result<Vec<Option<Sampled>>> {
    use crate::cuda::{self, PushKernelArg, WrapErr};
    use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
    let logits = logits.contiguous()?;
    let (s, l) = logits.storage_and_layout();
    let candle_core::Storage::Cuda(s) = &*s else {
        candle_core::bail!("sample_rows: logits are not on the CUDA device");
    };
    let lv = cuda::view::<f32>(s, l)?;
    let params: Vec<f64> = reqs
        .iter()
        .flat_map(|r| [r.row as f64, r.inv_temperature as f64, r.u])
        .collect();
    let params = dev.clone_htod(&params)?;
    let mut out = dev.alloc_zeros::<u32>(3 * reqs.len())?;
    let f = cuda::Kernel::get(dev, "sample", "sample_rows")?;
    let vi = v as i32;
    let mut b = f.builder();
    b.arg(&lv).arg(&params).arg(&vi).arg(&mut out);
    let cfg = LaunchConfig {
        grid_dim: (reqs.len() as u32, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: matches `sample_rows` in kernels/sample.cu: every request's
    // row was checked to be inside the `[n, v]` logits, `out` holds 3 words
    // per request, and the block size is the kernel's SAMPLE_THREADS.
    #[allow(unsafe_code)]
    unsafe { b.launch(cfg) }.w()?;
    Ok(unpack_samples(&dev.clone_dtoh(&out)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Float64 brute force of the rule in the module docs.
    fn brute(l: &[f32], inv_t: f64, u: f64) -> (usize, f64, f64) {
        let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let w: Vec<f64> = l.iter().map(|&x| ((x as f64 - m) * inv_t).exp()).collect();
        let z: f64 = w.iter().sum();
        let ent = -w
            .iter()
            .map(|&x| if x > 0.0 { x / z * (x / z).ln() } else { 0.0 })
            .sum::<f64>();
        let mut acc = 0.0;
        let tok = w
            .iter()
            .position(|&x| {
                acc += x;
                acc > u * z
            })
            .unwrap();
        (tok, (w[tok] / z).ln(), ent)
    }

    #[test]
    fn sample_row_follows_the_float64_rule() {
        let mut seed = 7u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 11) as f64 / (1u64 << 53) as f64
        };
        for n in [1usize, 2, 17, 1000] {
            let l: Vec<f32> = (0..n).map(|_| (next() * 8.0 - 4.0) as f32).collect();
            for t in [0.5f64, 1.0, 1.7] {
                for _ in 0..20 {
                    let u = next();
                    let got = sample_row(&l, (1.0 / t) as f32, u).unwrap();
                    let (tok, lp, ent) = brute(&l, 1.0 / t, u);
                    // A draw within rounding of a token boundary may go
                    // either way; none of these is.
                    assert_eq!(got.token as usize, tok, "n {n} t {t} u {u}");
                    assert!((got.logprob as f64 - lp).abs() < 1e-5);
                    assert!(
                        (got.entropy as f64 - ent).abs() < 1e-4,
                        "{} vs {ent}",
                        got.entropy
                    );
                }
            }
            let g = sample_row(&l, 0.0, 0.5).unwrap();
            let (m, arg) = l
                .iter()
                .enumerate()
                .fold(
                    (f32::NEG_INFINITY, 0),
                    |(m, a), (i, &x)| if x > m { (x, i) } else { (m, a) },
                );
            assert_eq!(g.token as usize, arg);
            let z: f64 = l.iter().map(|&x| (x as f64 - m as f64).exp()).sum();
            assert!((g.logprob as f64 + z.ln()).abs() < 1e-5);
        }
    }

    #[test]
    fn ties_masks_and_broken_rows() {
        // Greedy ties go to the lowest id; -inf entries are never drawn.
        let l = [1.0f32, 3.0, 3.0, f32::NEG_INFINITY];
        assert_eq!(sample_row(&l, 0.0, 0.0).unwrap().token, 1);
        for k in 0..100 {
            let t = sample_row(&l, 1.0, k as f64 / 100.0).unwrap().token;
            assert!(t < 3, "drew a masked token");
        }
        // u at the very top falls on the last token with weight.
        assert_eq!(sample_row(&l, 1.0, 1.0 - 1e-17).unwrap().token, 2);
        for bad in [f32::NAN, f32::INFINITY] {
            let mut l = vec![0.5f32; 10];
            l[4] = bad;
            assert!(sample_row(&l, 1.0, 0.3).is_none());
            assert!(sample_row(&l, 0.0, 0.3).is_none());
        }
        assert!(sample_row(&[f32::NEG_INFINITY; 5], 1.0, 0.3).is_none());
    }

    #[test]
    fn sample_rows_picks_each_requests_row() {
        let l = Tensor::new(
            &[[0f32, 9.0, 0.0], [9.0, 0.0, 0.0]],
            &candle_core::Device::Cpu,
        )
        .unwrap();
        let reqs = [
            SampleRequest {
                row: 1,
                inv_temperature: 0.0,
                u: 0.0,
            },
            SampleRequest {
                row: 0,
                inv_temperature: 0.0,
                u: 0.0,
            },
            SampleRequest {
                row: 0,
                inv_temperature: 1.0,
                u: 0.5,
            },
        ];
        let got: Vec<u32> = sample_rows(&l, &reqs)
            .unwrap()
            .iter()
            .map(|s| s.unwrap().token)
            .collect();
        assert_eq!(got, [0, 1, 1]);
        assert!(sample_rows(
            &l,
            &[SampleRequest {
                row: 2,
                inv_temperature: 0.0,
                u: 0.0
            }]
        )
        .is_err());
    }
}
