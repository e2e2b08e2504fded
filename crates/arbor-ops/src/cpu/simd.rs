//! SIMD building blocks shared by the CPU kernels: transposing lane sums
//! and a polynomial `exp`, for AVX-512 (16 lanes) and AVX2 (8 lanes).
#![cfg(target_arch = "x86_64")]
#![allow(unsafe_code)]

use super::exp::{EXP_POLY, LN2_HI, LN2_LO};

/// `out[l] = sum of the 16 lanes of v[l]`, by one transpose tree (lanes
/// `i + (i+8)`, `+4`, `+2`, `+1`).
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn hsum16(v: &[std::arch::x86_64::__m512; 16]) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // Pairs: [a lo256 + a hi256 | b lo256 + b hi256].
    let mut u = [_mm512_setzero_ps(); 8];
    for (p, u) in u.iter_mut().enumerate() {
        let (x, y) = (v[2 * p], v[2 * p + 1]);
        *u = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y),
        );
    }
    // Quads: 128-bit lane q of w[r] holds v[4r + q]'s four partial sums.
    let mut w = [_mm512_setzero_ps(); 4];
    for (r, w) in w.iter_mut().enumerate() {
        let (x, y) = (u[2 * r], u[2 * r + 1]);
        *w = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
        );
    }
    let z0 = _mm512_add_ps(
        _mm512_shuffle_ps::<0x44>(w[0], w[1]),
        _mm512_shuffle_ps::<0xEE>(w[0], w[1]),
    );
    let z1 = _mm512_add_ps(
        _mm512_shuffle_ps::<0x44>(w[2], w[3]),
        _mm512_shuffle_ps::<0xEE>(w[2], w[3]),
    );
    // Lane 4q + t holds the sum of v[4t + q].
    let r = _mm512_add_ps(
        _mm512_shuffle_ps::<0x88>(z0, z1),
        _mm512_shuffle_ps::<0xDD>(z0, z1),
    );
    let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_ps(idx, r)
}

/// `exp(x)` lane-wise for `x <= 0` (arguments below -87.3, `-inf`
/// included, give about 1e-38 instead of a subnormal or 0; NaN stays NaN):
/// `x = n ln 2 + r`, `|r| <= ln2 / 2`, a degree-7 Taylor polynomial in `r`,
/// scaled by `2^n`. Relative error below 3e-7.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn exp512(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // `max(c, x)` returns `x` when it is NaN, so NaN propagates.
    let x = _mm512_max_ps(_mm512_set1_ps(-87.3), x);
    let n =
        _mm512_roundscale_ps::<0x08>(_mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)));
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    let mut p = _mm512_set1_ps(EXP_POLY[0]);
    for c in &EXP_POLY[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
    }
    _mm512_scalef_ps(p, n)
}

/// `max_i x_i` of a slice (`-inf` when empty): four 16-lane running
/// maxima (independent chains), then one reduction. Exact, as any order of
/// `max` is (NaN aside).
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn max_f32(x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut m = [ninf; 4];
    let p = x.as_ptr();
    let n = x.len();
    let mut i = 0;
    while i + 64 <= n {
        for (c, m) in m.iter_mut().enumerate() {
            *m = _mm512_max_ps(*m, _mm512_loadu_ps(p.add(i + 16 * c)));
        }
        i += 64;
    }
    while i < n {
        let mask = ((1u32 << (n - i).min(16)) - 1) as __mmask16;
        m[0] = _mm512_max_ps(m[0], _mm512_mask_loadu_ps(ninf, mask, p.add(i)));
        i += 16;
    }
    let m = _mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3]));
    _mm512_reduce_max_ps(m)
}

/// [`max_f32`] on 8 lanes: four running maxima (independent chains), one
/// reduction, then the tail. NaN values are skipped, as
/// `fold(-inf, f32::max)` skips them (`max(x, m)` keeps `m` when `x` is
/// NaN); otherwise exact, as any order of `max` is.
///
/// # Safety
/// The CPU supports AVX2 and FMA.
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn max8_f32(x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut m = [ninf; 4];
    let p = x.as_ptr();
    let n = x.len();
    let mut i = 0;
    while i + 32 <= n {
        for (c, m) in m.iter_mut().enumerate() {
            *m = _mm256_max_ps(_mm256_loadu_ps(p.add(i + 8 * c)), *m);
        }
        i += 32;
    }
    while i + 8 <= n {
        m[0] = _mm256_max_ps(_mm256_loadu_ps(p.add(i)), m[0]);
        i += 8;
    }
    let v = _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3]));
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), v);
    lanes
        .into_iter()
        .chain(x[i..].iter().copied())
        .fold(f32::NEG_INFINITY, f32::max)
}

/// Whether this CPU runs the AVX2 kernels (AVX2 and FMA).
pub(crate) fn avx2_fma() -> bool {
    std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
}

/// The sum of `v`'s 8 lanes by the fixed tree `l + (l+4)`, `+2`, `+1`.
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn hsum8(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    // Lanes l + (l+4).
    let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    // Lanes l + (l+2).
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    // Lane 0 + lane 1.
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2)))
}

/// `out[l] = sum of the 8 lanes of v[l]`, every one by the tree `((0+1) +
/// (2+3)) + ((4+5) + (6+7))` (three rounds of pairwise adds, then the two
/// halves).
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn hsum8x8(v: &[std::arch::x86_64::__m256; 8]) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7].
    let t = [
        _mm256_hadd_ps(v[0], v[1]),
        _mm256_hadd_ps(v[2], v[3]),
        _mm256_hadd_ps(v[4], v[5]),
        _mm256_hadd_ps(v[6], v[7]),
    ];
    // Lane l of each half: v[l]'s ((0+1)+(2+3)) (low) or ((4+5)+(6+7)) (high).
    let u0 = _mm256_hadd_ps(t[0], t[1]);
    let u1 = _mm256_hadd_ps(t[2], t[3]);
    let lo = _mm256_permute2f128_ps::<0x20>(u0, u1);
    let hi = _mm256_permute2f128_ps::<0x31>(u0, u1);
    _mm256_add_ps(lo, hi)
}

/// [`exp512`] on 8 lanes: the same reduction and polynomial, scaled by
/// `2^n` built in the exponent bits (arguments clamped to `[-87.3, 88]`,
/// so `-126 <= n <= 127`; above 88 it gives `exp(88)`).
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn exp256(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // `max(c, x)` and `min(c, x)` return `x` when it is NaN, so NaN
    // propagates.
    let x = _mm256_min_ps(
        _mm256_set1_ps(88.0),
        _mm256_max_ps(_mm256_set1_ps(-87.3), x),
    );
    let n = _mm256_round_ps::<0x08>(_mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    let mut p = _mm256_set1_ps(EXP_POLY[0]);
    for c in &EXP_POLY[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
    }
    let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    _mm256_mul_ps(p, _mm256_castsi256_ps(bits))
}

/// The first (up to) 8 values of `x` as lanes, the rest zero.
///
/// # Safety
/// The CPU supports AVX.
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn lanes8(x: &[f32]) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    if x.len() >= 8 {
        _mm256_loadu_ps(x.as_ptr())
    } else {
        let mut l = [0f32; 8];
        l[..x.len()].copy_from_slice(x);
        _mm256_loadu_ps(l.as_ptr())
    }
}

/// The first `o.len() <= 8` lanes of `v` into `o`.
///
/// # Safety
/// The CPU supports AVX.
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn store8(v: std::arch::x86_64::__m256, o: &mut [f32]) {
    use std::arch::x86_64::*;
    if o.len() == 8 {
        _mm256_storeu_ps(o.as_mut_ptr(), v);
    } else {
        let mut l = [0f32; 8];
        _mm256_storeu_ps(l.as_mut_ptr(), v);
        let n = o.len();
        o.copy_from_slice(&l[..n]);
    }
}

/// `v` with the lanes from `n` on zeroed (`n >= 8`: `v` itself).
///
/// # Safety
/// The CPU supports AVX.
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn first8(v: std::arch::x86_64::__m256, n: usize) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    if n >= 8 {
        return v;
    }
    let mut l = [0f32; 8];
    store8(v, &mut l[..n]);
    _mm256_loadu_ps(l.as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pseudo-random values of magnitudes 1e-3 to 1e3, both signs.
    fn noise(mut s: u64) -> impl FnMut() -> f32 {
        move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 10f32.powi((s % 7) as i32 - 3)
        }
    }

    /// Lane `l` of `hsum16(v)` is the tree `(i + i+8)`, `+4`, `+2`, `+1` over
    /// `v[l]`'s lanes, bit for bit (the matmul's dot products rely on it).
    #[test]
    fn hsum16_is_the_fixed_tree_per_vector() {
        if !std::is_x86_feature_detected!("avx512f") {
            return;
        }
        let mut r = noise(99u64);
        for _ in 0..50 {
            let lanes: Vec<[f32; 16]> = (0..16).map(|_| std::array::from_fn(|_| r())).collect();
            let tree = |x: &[f32; 16]| {
                let s8: Vec<f32> = (0..8).map(|i| x[i] + x[i + 8]).collect();
                let s4: Vec<f32> = (0..4).map(|i| s8[i] + s8[i + 4]).collect();
                let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
                s2[0] + s2[1]
            };
            let mut out = [0f32; 16];
            // SAFETY: AVX-512F detected above.
            unsafe {
                use std::arch::x86_64::*;
                let v: [__m512; 16] = std::array::from_fn(|l| _mm512_loadu_ps(lanes[l].as_ptr()));
                _mm512_storeu_ps(out.as_mut_ptr(), hsum16(&v));
            }
            for l in 0..16 {
                assert_eq!(out[l].to_bits(), tree(&lanes[l]).to_bits(), "lane {l}");
            }
        }
    }

    #[test]
    fn max_f32_is_the_max() {
        if !std::is_x86_feature_detected!("avx512f") {
            return;
        }
        for n in [0usize, 1, 15, 16, 17, 63, 64, 65, 200, 49_152] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1009) as f32 - 600.0).collect();
            let want = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            // SAFETY: AVX-512F detected above.
            assert_eq!(unsafe { max_f32(&x) }, want, "n = {n}");
        }
    }

    #[test]
    fn exp512_is_accurate() {
        use crate::cpu::exp::check_exp;
        if !std::is_x86_feature_detected!("avx512f") {
            return;
        }
        check_exp(0.0, true, |x| {
            let mut out = [0f32; 16];
            // SAFETY: AVX-512F detected above.
            unsafe {
                use std::arch::x86_64::*;
                _mm512_storeu_ps(out.as_mut_ptr(), exp512(_mm512_set1_ps(x)));
            }
            assert!(out.iter().all(|v| v.to_bits() == out[0].to_bits()));
            out[0]
        });
    }

    /// `max8_f32` equals the scalar fold (NaN skipped) at every length.
    #[test]
    fn max8_matches_the_fold() {
        if !avx2_fma() {
            return;
        }
        let mut r = noise(11u64);
        for n in 0..100 {
            let mut x: Vec<f32> = (0..n).map(|_| r()).collect();
            if n % 7 == 3 {
                x[n / 2] = f32::NAN;
            }
            let want = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            // SAFETY: AVX2 and FMA detected above.
            let got = unsafe { max8_f32(&x) };
            assert_eq!(got.to_bits(), want.to_bits(), "n = {n}");
        }
    }

    /// `hsum8x8` and `hsum8` are the fixed trees, bit for bit.
    #[test]
    fn hsum8_trees_are_fixed() {
        if !avx2_fma() {
            return;
        }
        let mut r = noise(7u64);
        for _ in 0..50 {
            let lanes: Vec<[f32; 8]> = (0..8).map(|_| std::array::from_fn(|_| r())).collect();
            let pairs =
                |x: &[f32; 8]| ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
            let tree = |x: &[f32; 8]| {
                let s4: Vec<f32> = (0..4).map(|i| x[i] + x[i + 4]).collect();
                (s4[0] + s4[2]) + (s4[1] + s4[3])
            };
            let mut out = [0f32; 8];
            // SAFETY: AVX2 and FMA detected above.
            unsafe {
                use std::arch::x86_64::*;
                let v: [__m256; 8] = std::array::from_fn(|l| _mm256_loadu_ps(lanes[l].as_ptr()));
                _mm256_storeu_ps(out.as_mut_ptr(), hsum8x8(&v));
                for l in 0..8 {
                    assert_eq!(
                        hsum8(v[l]).to_bits(),
                        tree(&lanes[l]).to_bits(),
                        "hsum8 {l}"
                    );
                }
            }
            for l in 0..8 {
                assert_eq!(
                    out[l].to_bits(),
                    pairs(&lanes[l]).to_bits(),
                    "hsum8x8 lane {l}"
                );
            }
        }
    }

    #[test]
    fn exp256_is_accurate() {
        use crate::cpu::exp::check_exp;
        if !avx2_fma() {
            return;
        }
        check_exp(0.0, true, |x| {
            let mut out = [0f32; 8];
            // SAFETY: AVX2 and FMA detected above.
            unsafe {
                use std::arch::x86_64::*;
                _mm256_storeu_ps(out.as_mut_ptr(), exp256(_mm256_set1_ps(x)));
            }
            assert!(out.iter().all(|v| v.to_bits() == out[0].to_bits()));
            out[0]
        });
    }
}
