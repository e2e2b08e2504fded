//! Fused row-wise f32 kernels for the generation forward on the CPU (no
//! autograd): RMSNorm, head split with optional q/k-norm and RoPE,
//! SwiGLU's `silu(g) * u`, and the residual `a + b`.
//!
//! Each replaces a chain of candle ops (RMSNorm alone is seven, each with
//! its own allocation and pass over memory) by one pass. They use the same
//! f32 operations in the same order as the training forward's candle ops,
//! except the RMSNorm sum of squares, whose order is this kernel's own, and
//! SiLU's `exp`, a vectorised polynomial on AVX-512 and AVX2 CPUs; every
//! row is computed on its own, so results never depend on the batch. Rows
//! are split across threads only when there are enough of them to pay for it.

use rayon::prelude::*;

/// Elements below which a call stays on the calling thread.
pub(crate) const PAR_MIN: usize = 1 << 16;

/// A new vector of `len` values whose `width`-value rows (the last one
/// shorter) are written by `f(i, row)`, in parallel from `par_min` values.
/// Each row is zeroed just before `f` runs on it, by the thread that runs
/// it, while it is in cache: a serial `vec![0; len]` first (a separate
/// pass over memory on one thread while the other waited) took 3% of a
/// batch-32 prefill.
pub(crate) fn new_rows<T: Copy + Default + Send>(
    len: usize,
    width: usize,
    par_min: usize,
    f: impl Fn(usize, &mut [T]) + Sync + Send,
) -> Vec<T> {
    use std::mem::MaybeUninit;
    let mut out: Vec<T> = Vec::with_capacity(len);
    let run = |(i, o): (usize, &mut [MaybeUninit<T>])| {
        for v in o.iter_mut() {
            v.write(T::default());
        }
        // SAFETY: every value of `o` was just initialised, and
        // `MaybeUninit<T>` has `T`'s layout.
        #[allow(unsafe_code)]
        let o = unsafe { &mut *(o as *mut [MaybeUninit<T>] as *mut [T]) };
        f(i, o);
    };
    let spare = &mut out.spare_capacity_mut()[..len];
    if len >= par_min {
        spare.par_chunks_mut(width).enumerate().for_each(run);
    } else {
        spare.chunks_mut(width).enumerate().for_each(run);
    }
    // SAFETY: the rows cover all of the first `len` values, and each was
    // initialised above (a panic in `f` leaves the length 0).
    #[allow(unsafe_code)]
    unsafe {
        out.set_len(len);
    };
    out
}

/// `sum x_i^2` in f32, 16 lanes then a fixed pairwise tree.
fn sum_sq(x: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for l in 0..16 {
            acc[l] += c[l] * c[l];
        }
    }
    for (l, v) in chunks.remainder().iter().enumerate() {
        acc[l] += v * v;
    }
    let mut w = 16;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            acc[l] += acc[l + w];
        }
    }
    acc[0]
}

/// One row of RMSNorm: `out = (x / sqrt(mean(x^2) + eps)) * w`.
fn rms_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let r = (sum_sq(x) / x.len() as f32 + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = (v / r) * g;
    }
}

/// RMSNorm over rows of `w.len()`: `x: [n, h]` -> `[n, h]`.
pub fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let h = w.len();
    assert!(
        h > 0 && x.len().is_multiple_of(h),
        "rms_norm_rows: {} values, rows of {h}",
        x.len()
    );
    new_rows(x.len(), h, PAR_MIN, |i, o| {
        rms_row(&x[i * h..(i + 1) * h], w, eps, o);
    })
}

/// Head split, optional per-head RMSNorm, then RoPE, for `t` tokens:
/// `y: [t, n * d]` (token-major, a projection's output) -> `[n, t, d]`
/// (head-major). `cos, sin: [t, d / 2]`. For each head row `x` (after the
/// norm), with halves `x1, x2`: `[x1 cos - x2 sin | x2 cos + x1 sin]`.
pub fn heads_rope(
    y: &[f32],
    t: usize,
    n: usize,
    d: usize,
    norm: Option<(&[f32], f32)>,
    cos: &[f32],
    sin: &[f32],
) -> Vec<f32> {
    let half = d / 2;
    assert!(
        d.is_multiple_of(2)
            && y.len() == t * n * d
            && cos.len() == t * half
            && sin.len() == t * half,
        "heads_rope: y {} cos {} sin {} for t {t} n {n} d {d}",
        y.len(),
        cos.len(),
        sin.len()
    );
    if let Some((w, _)) = norm {
        assert_eq!(w.len(), d, "heads_rope: norm weight");
    }
    // One output row per (head, token), in the output's order: the head's
    // values (normed if asked), then rotated in place.
    new_rows(y.len(), d, PAR_MIN, |r, o| {
        let (h, i) = (r / t, r % t);
        let src = &y[(i * n + h) * d..(i * n + h + 1) * d];
        match norm {
            Some((w, eps)) => rms_row(src, w, eps, o),
            None => o.copy_from_slice(src),
        }
        rope_row(
            o,
            &cos[i * half..(i + 1) * half],
            &sin[i * half..(i + 1) * half],
        );
    })
}

/// `o = [o1 cos - o2 sin | o2 cos + o1 sin]` in place, halves `o1, o2`.
fn rope_row(o: &mut [f32], cos: &[f32], sin: &[f32]) {
    let (o1, o2) = o.split_at_mut(cos.len());
    for j in 0..cos.len() {
        let (a, b) = (o1[j], o2[j]);
        o1[j] = a * cos[j] - b * sin[j];
        o2[j] = b * cos[j] + a * sin[j];
    }
}

/// `a + b`, elementwise: the residual additions of the generation forward
/// (candle's add would hand large inputs to candle's own thread pool, whose
/// threads compete for cores with the rayon workers of
/// [`crate::in_pool_polling`]).
pub fn add(a: &[f32], b: &[f32]) -> Vec<f32> {
    zip_chunks(a, b, 1 << 14, PAR_MIN, |a, b, o| {
        for ((o, &x), &y) in o.iter_mut().zip(a).zip(b) {
            *o = x + y;
        }
    })
}

/// SwiGLU's gate: `silu(g) * u = g / (1 + exp(-g)) * u`, elementwise.
/// On CPUs with AVX-512F or AVX2 `exp` is the f32 polynomial (relative
/// error below 3e-7; the rest is the same f32 operations in the same
/// order), 16 or 8 values at a time; elsewhere it is `f32::exp`, as in
/// candle's `silu`.
pub fn silu_mul(g: &[f32], u: &[f32]) -> Vec<f32> {
    // An `exp` per value: a decode step's 32 x 1536 values split across
    // threads too (on one, they took ~1% of `arbor bench generate` while
    // the other waited).
    zip_chunks(g, u, SILU_CHUNK, 2 * SILU_CHUNK, silu_mul_into)
}

/// [`silu_mul`] into `o` on the calling thread: `o[i] = silu(g[i]) * u[i]`
/// for `i < o.len()`, each value computed alone (so any split of the rows
/// gives the same bits).
///
/// # Panics
/// If `g` or `u` is shorter than `o`.
pub fn silu_mul_into(g: &[f32], u: &[f32], o: &mut [f32]) {
    assert!(
        g.len() >= o.len() && u.len() >= o.len(),
        "silu_mul: {} and {} values for {}",
        g.len(),
        u.len(),
        o.len()
    );
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F detected; `g` and `u` hold `o.len()` values.
        #[allow(unsafe_code)]
        unsafe {
            silu_mul_avx512(g, u, o);
        };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::simd::avx2_fma() {
        // SAFETY: AVX2 and FMA detected; `g` and `u` hold `o.len()` values.
        #[allow(unsafe_code)]
        unsafe {
            silu_mul_avx2(g, u, o);
        };
        return;
    }
    for ((o, &a), &b) in o.iter_mut().zip(g).zip(u) {
        *o = a / (1.0 + (-a).exp()) * b;
    }
}

/// `o[i] = g[i] / (1 + exp(-g[i])) * u[i]` for `i < o.len()`.
///
/// # Safety
/// The CPU supports AVX-512F; `g` and `u` hold at least `o.len()` values.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f")]
unsafe fn silu_mul_avx512(g: &[f32], u: &[f32], o: &mut [f32]) {
    use crate::cpu::simd::exp512;
    use std::arch::x86_64::*;
    let n = o.len();
    assert!(g.len() >= n && u.len() >= n);
    let one = _mm512_set1_ps(1.0);
    for i in (0..n).step_by(16) {
        let mask = ((1u32 << (n - i).min(16)) - 1) as __mmask16;
        let a = _mm512_maskz_loadu_ps(mask, g.as_ptr().add(i));
        let b = _mm512_maskz_loadu_ps(mask, u.as_ptr().add(i));
        let e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), a));
        let y = _mm512_mul_ps(_mm512_div_ps(a, _mm512_add_ps(one, e)), b);
        _mm512_mask_storeu_ps(o.as_mut_ptr().add(i), mask, y);
    }
}

/// [`silu_mul_avx512`] on 8 lanes with `exp256`.
///
/// # Safety
/// The CPU supports AVX2 and FMA; `g` and `u` hold at least `o.len()`
/// values.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(g: &[f32], u: &[f32], o: &mut [f32]) {
    use crate::cpu::simd::{exp256, lanes8, store8};
    use std::arch::x86_64::*;
    assert!(g.len() >= o.len() && u.len() >= o.len());
    let one = _mm256_set1_ps(1.0);
    for (i, o) in o.chunks_mut(8).enumerate() {
        let (a, b) = (lanes8(&g[8 * i..]), lanes8(&u[8 * i..]));
        let e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), a));
        store8(_mm256_mul_ps(_mm256_div_ps(a, _mm256_add_ps(one, e)), b), o);
    }
}

/// Values per parallel chunk of [`silu_mul`].
const SILU_CHUNK: usize = 1 << 12;

/// An elementwise kernel of two inputs: `f(a, b, out)` over matching
/// chunks of `ch` values of `a`, `b` and the new output (the last one
/// shorter), in parallel from `par_min` values.
fn zip_chunks(
    a: &[f32],
    b: &[f32],
    ch: usize,
    par_min: usize,
    f: impl Fn(&[f32], &[f32], &mut [f32]) + Sync + Send,
) -> Vec<f32> {
    assert_eq!(a.len(), b.len(), "elementwise kernel: lengths");
    new_rows(a.len(), ch, par_min, |c, o| {
        let r = c * ch..c * ch + o.len();
        f(&a[r.clone()], &b[r], o);
    })
}

/// `max_i x_i` (`-inf` for an empty slice), vectorised with AVX-512F or
/// AVX2.
pub fn max(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F detected.
        #[allow(unsafe_code)]
        return unsafe { crate::cpu::simd::max_f32(x) };
    }
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::simd::avx2_fma() {
        // SAFETY: AVX2 and FMA detected.
        #[allow(unsafe_code)]
        return unsafe { crate::cpu::simd::max8_f32(x) };
    }
    x.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// `e_i = exp((x_i - shift) * scale)` for every `i`, written to `out` when
/// given, and `sum_i e_i` accumulated in f64: a sampler's softmax weights
/// and normaliser over one row of logits. Requires `(x_i - shift) * scale
/// <= 0` (`shift` the row's max, `scale > 0`).
///
/// On CPUs with AVX-512F each `e_i` comes from the f32 polynomial `exp`
/// (relative error below 3e-7; arguments below -87.3 give about 1e-38
/// instead of a subnormal) and the sum from eight f64 lanes per half of
/// each 16-lane vector, then a fixed reduction; with AVX2 and FMA the same
/// `exp` on 8 lanes, summed in four f64 lanes per half of each vector, then
/// a fixed reduction; elsewhere `e_i` is the f64 `exp` of the f32 argument,
/// rounded to f32, summed in order. Either way the result depends on the
/// row alone.
pub fn exp_shifted(x: &[f32], shift: f32, scale: f32, out: Option<&mut [f32]>) -> f64 {
    if let Some(o) = &out {
        assert_eq!(o.len(), x.len(), "exp_shifted: output length");
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F detected; `out`, when given, has `x.len()` elements.
        #[allow(unsafe_code)]
        return unsafe { exp_shifted_avx512(x, shift, scale, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::simd::avx2_fma() {
        // SAFETY: AVX2 and FMA detected; `out`, when given, has `x.len()`
        // elements.
        #[allow(unsafe_code)]
        return unsafe { exp_shifted_avx2(x, shift, scale, out) };
    }
    // The sum is of the rounded values, so it is exactly the sum of `out`.
    let e = |v: f32| (((v - shift) * scale) as f64).exp() as f32;
    let mut sum = 0f64;
    match out {
        Some(o) => {
            for (o, &v) in o.iter_mut().zip(x) {
                *o = e(v);
                sum += *o as f64;
            }
        }
        None => {
            for &v in x {
                sum += e(v) as f64;
            }
        }
    }
    sum
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f")]
unsafe fn exp_shifted_avx512(
    x: &[f32],
    shift: f32,
    scale: f32,
    mut out: Option<&mut [f32]>,
) -> f64 {
    use crate::cpu::simd::exp512;
    use std::arch::x86_64::*;
    let (s, c) = (_mm512_set1_ps(shift), _mm512_set1_ps(scale));
    let (mut lo, mut hi) = (_mm512_setzero_pd(), _mm512_setzero_pd());
    let n = x.len();
    for i in (0..n).step_by(16) {
        let mask = ((1u32 << (n - i).min(16)) - 1) as __mmask16;
        let v = _mm512_maskz_loadu_ps(mask, x.as_ptr().add(i));
        let e = _mm512_maskz_mov_ps(mask, exp512(_mm512_mul_ps(_mm512_sub_ps(v, s), c)));
        if let Some(o) = out.as_deref_mut() {
            _mm512_mask_storeu_ps(o.as_mut_ptr().add(i), mask, e);
        }
        let ed = _mm512_castps_pd(e);
        lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
        hi = _mm512_add_pd(
            hi,
            _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(ed))),
        );
    }
    _mm512_reduce_add_pd(_mm512_add_pd(lo, hi))
}

/// [`exp_shifted_avx512`] on 8 lanes.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_shifted_avx2(x: &[f32], shift: f32, scale: f32, mut out: Option<&mut [f32]>) -> f64 {
    use crate::cpu::simd::{exp256, first8, lanes8, store8};
    use std::arch::x86_64::*;
    let (s, c) = (_mm256_set1_ps(shift), _mm256_set1_ps(scale));
    let (mut lo, mut hi) = (_mm256_setzero_pd(), _mm256_setzero_pd());
    for (i, xc) in x.chunks(8).enumerate() {
        // Lanes past the row add nothing.
        let e = first8(
            exp256(_mm256_mul_ps(_mm256_sub_ps(lanes8(xc), s), c)),
            xc.len(),
        );
        if let Some(o) = out.as_deref_mut() {
            store8(e, &mut o[8 * i..8 * i + xc.len()]);
        }
        lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(e)));
    }
    let mut l = [0f64; 4];
    _mm256_storeu_pd(l.as_mut_ptr(), _mm256_add_pd(lo, hi));
    (l[0] + l[2]) + (l[1] + l[3])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 33) % 4001) as f32 / 1000.0 - 2.0
            })
            .collect()
    }

    #[test]
    fn rms_norm_matches_f64() {
        for (n, h) in [(3usize, 64usize), (70, 576), (2, 13), (300, 576)] {
            let x = data(n * h, 1);
            let w = data(h, 2);
            let y = rms_norm_rows(&x, &w, 1e-6);
            for i in 0..n {
                let row = &x[i * h..(i + 1) * h];
                let ms: f64 = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / h as f64;
                for j in 0..h {
                    let want = row[j] as f64 / (ms + 1e-6).sqrt() * w[j] as f64;
                    assert!((y[i * h + j] as f64 - want).abs() < 1e-5 * (1.0 + want.abs()));
                }
            }
        }
    }

    #[test]
    fn heads_rope_matches_f64_with_and_without_norm() {
        let (t, n, d) = (5usize, 3usize, 8usize);
        let half = d / 2;
        let y = data(t * n * d, 3);
        let ang: Vec<f64> = (0..t * half)
            .map(|i| (i % 7) as f64 * 0.37 + (i / half) as f64)
            .collect();
        let cos: Vec<f32> = ang.iter().map(|a| a.cos() as f32).collect();
        let sin: Vec<f32> = ang.iter().map(|a| a.sin() as f32).collect();
        let w = data(d, 4);
        for norm in [None, Some((&w[..], 1e-6f32))] {
            let out = heads_rope(&y, t, n, d, norm, &cos, &sin);
            for h in 0..n {
                for i in 0..t {
                    let mut x: Vec<f64> = y[(i * n + h) * d..(i * n + h + 1) * d]
                        .iter()
                        .map(|&v| v as f64)
                        .collect();
                    if let Some((w, eps)) = norm {
                        let ms: f64 = x.iter().map(|v| v * v).sum::<f64>() / d as f64;
                        let r = (ms + eps as f64).sqrt();
                        for (v, &g) in x.iter_mut().zip(w) {
                            *v = *v / r * g as f64;
                        }
                    }
                    for j in 0..half {
                        let (c, s) = (cos[i * half + j] as f64, sin[i * half + j] as f64);
                        let a = x[j] * c - x[j + half] * s;
                        let b = x[j + half] * c + x[j] * s;
                        let o = &out[(h * t + i) * d..];
                        assert!(
                            (o[j] as f64 - a).abs() < 1e-5 && (o[j + half] as f64 - b).abs() < 1e-5
                        );
                    }
                }
            }
        }
    }

    /// Every row reaches `f` zeroed, once, with its own index, on the
    /// serial and the parallel path, for a last row of any length.
    #[test]
    fn new_rows_hands_out_every_row_zeroed() {
        for len in [0usize, 5, 4096, 100_003] {
            for width in [1usize, 7, 4096] {
                for par_min in [0, usize::MAX] {
                    let y: Vec<u32> = new_rows(len, width, par_min, |i, o| {
                        assert!(o.iter().all(|&v| v == 0), "row {i} not zeroed");
                        assert!(o.len() == width || (i + 1) * width >= len);
                        for (j, v) in o.iter_mut().enumerate() {
                            *v = (i * width + j) as u32 + 1;
                        }
                    });
                    assert_eq!(y.len(), len);
                    assert!(y.iter().enumerate().all(|(k, &v)| v == k as u32 + 1));
                }
            }
        }
    }

    /// The parallel path of `heads_rope` (more than `PAR_MIN` values) puts
    /// every (head, token) row where the serial path does.
    #[test]
    fn heads_rope_parallel_equals_serial_rows() {
        let (t, n, d) = (300usize, 9usize, 64usize);
        assert!(t * n * d >= PAR_MIN);
        let half = d / 2;
        let y = data(t * n * d, 10);
        let ang: Vec<f32> = (0..t * half).map(|i| (i % 13) as f32 * 0.21).collect();
        let cos: Vec<f32> = ang.iter().map(|a| a.cos()).collect();
        let sin: Vec<f32> = ang.iter().map(|a| a.sin()).collect();
        let all = heads_rope(&y, t, n, d, None, &cos, &sin);
        // Each token alone (serial): its rows must match bit for bit.
        for i in (0..t).step_by(37) {
            let yi = &y[i * n * d..(i + 1) * n * d];
            let one = heads_rope(
                yi,
                1,
                n,
                d,
                None,
                &cos[i * half..(i + 1) * half],
                &sin[i * half..(i + 1) * half],
            );
            for h in 0..n {
                assert_eq!(
                    &all[(h * t + i) * d..(h * t + i + 1) * d],
                    &one[h * d..(h + 1) * d]
                );
            }
        }
    }

    #[test]
    fn silu_mul_matches_f64_and_is_parallel_safe() {
        for n in [10usize, 17, 100_000] {
            let g = data(n, 5);
            let u = data(n, 6);
            let y = silu_mul(&g, &u);
            for i in (0..n).step_by(97) {
                let (a, b) = (g[i] as f64, u[i] as f64);
                let want = a / (1.0 + (-a).exp()) * b;
                assert!((y[i] as f64 - want).abs() < 1e-6 * (1.0 + want.abs()));
            }
        }
    }

    #[test]
    fn silu_mul_at_the_extremes() {
        let g = [
            -1e4f32,
            -100.0,
            -88.0,
            -20.0,
            0.0,
            20.0,
            100.0,
            1e4,
            f32::NAN,
        ];
        let u = [2.0f32; 9];
        let y = silu_mul(&g, &u);
        for (i, (&a, &y)) in g.iter().zip(&y).enumerate().take(8) {
            let want = (a as f64 / (1.0 + (-(a as f64)).exp()) * 2.0) as f32;
            assert!(
                (y - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "g = {a}: {y} vs {want}"
            );
            assert!(y.is_finite(), "{i}");
        }
        assert!(y[8].is_nan());
    }

    #[test]
    fn add_is_the_elementwise_sum() {
        for n in [10usize, 100_000] {
            let (a, b) = (data(n, 8), data(n, 9));
            let y = add(&a, &b);
            assert!(y
                .iter()
                .zip(a.iter().zip(&b))
                .all(|(y, (a, b))| *y == a + b));
        }
    }

    #[test]
    fn exp_shifted_matches_f64() {
        for n in [1usize, 15, 16, 17, 49_152] {
            let x = data(n, 7);
            let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            for scale in [1.0f32, 1.0 / 0.7] {
                let mut e = vec![0f32; n];
                let sum = exp_shifted(&x, m, scale, Some(&mut e));
                assert_eq!(sum, exp_shifted(&x, m, scale, None), "n = {n}");
                let mut want_sum = 0f64;
                for (i, &v) in x.iter().enumerate() {
                    let want = (((v - m) * scale) as f64).exp();
                    want_sum += want;
                    assert!(
                        (e[i] as f64 - want).abs() <= 4e-7 * want,
                        "n = {n}, i = {i}"
                    );
                }
                assert!((sum - want_sum).abs() <= 4e-7 * want_sum, "n = {n}");
            }
        }
    }
}
