//! The polynomial `exp` of the f32 kernels: its constants (shared by the
//! vector kernels of [`super::simd`]) and a scalar form written in plain
//! arithmetic, so that loops over it vectorise.

/// The degree-7 Taylor coefficients of `exp(r)`, highest first (Horner).
pub(crate) const EXP_POLY: [f32; 8] = [
    1.0 / 5040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];

/// `ln 2` in two parts, `LN2_HI + LN2_LO`, so that `x - n LN2_HI` is exact.
pub(crate) const LN2_HI: f32 = 0.693_145_75;
pub(crate) const LN2_LO: f32 = 1.428_606_8e-6;

/// `exp(x)` in f32 by arithmetic only, so loops over it vectorise:
/// `x = n ln 2 + r`, `|r| <= ln 2 / 2` (`ln 2` split in two for an exact
/// `r`), a degree-7 Taylor polynomial in `r` scaled by `2^n` through the
/// exponent bits. `x` is clamped to `[-87.3, 88.7]` (below: about 1e-38,
/// not a subnormal); relative error below 3e-7 (the engine's attention
/// uses the same polynomial, [`EXP_POLY`]).
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    // Not `clamp`: it passes NaN through, and NaN must not reach the
    // exponent conversion below.
    #[allow(clippy::manual_clamp)]
    let x = x.max(-87.3).min(88.7);
    let n = (x * std::f32::consts::LOG2_E + 0.5).floor();
    let r = x - n * LN2_HI;
    let r = r - n * LN2_LO;
    let mut p = EXP_POLY[0];
    for c in &EXP_POLY[1..] {
        p = p * r + c;
    }
    // SAFETY: `x` is clamped, so `n + 127` is in [1, 255], finite, an i32
    // (NaN `x` would not be: `max`/`min` map it to the bounds).
    #[allow(unsafe_code)]
    let e = unsafe { (n + 127.0).to_int_unchecked::<i32>() };
    p * f32::from_bits((e as u32) << 23)
}

/// Sweeps `exp` over `[-90, hi]`: relative error below 3e-7 above -87,
/// about 1e-38 below; with `nan_propagates`, NaN stays NaN.
#[cfg(test)]
pub(crate) fn check_exp(hi: f32, nan_propagates: bool, exp: impl Fn(f32) -> f32) {
    let mut worst = 0f64;
    let mut x = -90.0f32;
    while x <= hi {
        let (got, want) = (exp(x) as f64, (x as f64).exp());
        if x > -87.0 {
            worst = worst.max(((got - want) / want).abs());
        } else {
            assert!((0.0..1e-37).contains(&got));
        }
        x += 0.0137;
    }
    assert!(worst < 3e-7, "max relative error {worst}");
    if nan_propagates {
        assert!(exp(f32::NAN).is_nan());
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn exp_f32_is_accurate() {
        super::check_exp(88.0, false, super::exp_f32);
    }
}
