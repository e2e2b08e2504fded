//! Shared pieces of the checks: seeded inputs, relative errors,
//! tolerances and recording.

use candle_core::{DType, Device, Tensor};

use crate::{Check, Result};

/// SplitMix64: cheap, seeded, device-independent inputs.
pub struct Rng(pub u64);

impl Rng {
    pub(crate) fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
    pub(crate) fn uniform(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n).map(|_| lo + (hi - lo) * self.next_f64()).collect()
    }
    pub(crate) fn below(&mut self, n: usize, k: u64) -> Vec<u32> {
        (0..n)
            .map(|_| (self.next_f64() * k as f64) as u32 % k as u32)
            .collect()
    }
}

/// A random tensor in `dt` on `dev`, and its (rounded) values as f64 on the CPU.
pub(crate) fn rand_t(
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

pub(crate) fn rel_err(got: &Tensor, want: &Tensor) -> Result<f64> {
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
pub(crate) fn op_tol(dt: DType) -> f64 {
    if dt == DType::F32 || dt == DType::F64 {
        1e-4
    } else {
        1e-2
    }
}

pub(crate) fn push(out: &mut Vec<Check>, section: &str, name: &str, dt: DType, err: f64) {
    push_tol(out, section, name, dt, err, op_tol(dt));
}

pub(crate) fn push_tol(
    out: &mut Vec<Check>,
    section: &str,
    name: &str,
    dt: DType,
    err: f64,
    tol: f64,
) {
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

pub(crate) fn float_dtypes(dev: &Device) -> Vec<DType> {
    if dev.is_cpu() {
        vec![DType::F32]
    } else {
        vec![DType::F32, DType::BF16]
    }
}
