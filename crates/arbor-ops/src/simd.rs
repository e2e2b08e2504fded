//! AVX-512 building blocks shared by the CPU kernels: a 16-way transposing
//! lane sum and a polynomial `exp`.
#![cfg(target_arch = "x86_64")]
#![allow(unsafe_code)]

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
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_145_75), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428_606_8e-6), r);
    let mut p = _mm512_set1_ps(1.0 / 5040.0);
    for c in [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Lane `l` of `hsum16(v)` is the tree `(i + i+8)`, `+4`, `+2`, `+1` over
    /// `v[l]`'s lanes, bit for bit (the matmul's dot products rely on it).
    #[test]
    fn hsum16_is_the_fixed_tree_per_vector() {
        if !std::is_x86_feature_detected!("avx512f") {
            return;
        }
        let mut s = 99u64;
        let mut r = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 10f32.powi((s % 7) as i32 - 3)
        };
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
        if !std::is_x86_feature_detected!("avx512f") {
            return;
        }
        let mut worst = 0f64;
        let mut x = -90.0f32;
        while x <= 0.0 {
            let xs = [x; 16];
            let mut out = [0f32; 16];
            // SAFETY: AVX-512F detected above.
            #[allow(unsafe_code)]
            unsafe {
                use std::arch::x86_64::*;
                _mm512_storeu_ps(out.as_mut_ptr(), exp512(_mm512_loadu_ps(xs.as_ptr())));
            }
            let want = (x as f64).exp();
            if x > -87.0 {
                worst = worst.max(((out[0] as f64 - want) / want).abs());
            } else {
                assert!(out[0] >= 0.0 && out[0] < 1e-37);
            }
            x += 0.0137;
        }
        assert!(worst < 3e-7, "max relative error {worst}");
        // NaN stays visible.
        let mut out = [0f32; 16];
        // SAFETY: AVX-512F detected above.
        unsafe {
            use std::arch::x86_64::*;
            _mm512_storeu_ps(out.as_mut_ptr(), exp512(_mm512_set1_ps(f32::NAN)));
        }
        assert!(out.iter().all(|v| v.is_nan()));
    }
}
