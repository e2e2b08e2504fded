//! Rotary position embedding with per-token positions.
//!
//! Frequencies follow transformers exactly (f32 `inv_freq`, f32 products):
//! `inv_freq_i = 1 / theta^(2i/d)` for `i < d/2`, optionally rescaled
//! (linear, llama3), and for a token at position `p` the angle of pair `i`
//! is `p * inv_freq_i`. With `x = [x1 | x2]` split in halves,
//! `rope(x) = [x1 cos - x2 sin | x2 cos + x1 sin]` (HF's `rotate_half`).
//! Positions are given per token, so one call can mix sequences at
//! different offsets (the paged engine relies on this).

use candle_core::{DType, Device, Tensor, D};

use crate::config::{ModelConfig, RopeScaling};
use crate::error::Result;

/// Precomputed inverse frequencies for one model.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    /// Positions of the table [`Rope::cos_sin_gather`] reads.
    max_positions: usize,
    /// `(cos, sin)`, each `[max_positions, head_dim/2]`, on the device and
    /// in the dtype of the first [`Rope::cos_sin_gather`] call.
    table: std::sync::OnceLock<(Tensor, Tensor)>,
}

impl Rope {
    pub fn new(cfg: &ModelConfig) -> Self {
        let d = cfg.head_dim;
        let base = cfg.rope_theta as f32;
        let mut inv_freq: Vec<f32> = (0..d / 2)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / d as f32))
            .collect();
        match &cfg.rope_scaling {
            RopeScaling::Default => {}
            RopeScaling::Linear { factor } => {
                for f in &mut inv_freq {
                    *f /= *factor as f32;
                }
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let (factor, lo, hi, old) = (
                    *factor as f32,
                    *low_freq_factor as f32,
                    *high_freq_factor as f32,
                    *original_max_position_embeddings as f32,
                );
                let low_wavelen = old / lo;
                let high_wavelen = old / hi;
                for f in &mut inv_freq {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    let scaled = if wavelen > low_wavelen {
                        *f / factor
                    } else {
                        *f
                    };
                    let medium = (high_wavelen..=low_wavelen).contains(&wavelen);
                    *f = if medium {
                        let smooth = (old / wavelen - lo) / (hi - lo);
                        (1.0 - smooth) * scaled / factor + smooth * scaled
                    } else {
                        scaled
                    };
                }
            }
        }
        Rope {
            inv_freq,
            max_positions: cfg.max_position_embeddings.max(1),
            table: std::sync::OnceLock::new(),
        }
    }

    /// `(cos, sin)`, each `[n, head_dim/2]` in `dtype`, of the `n` positions
    /// held by `positions: [n]` (u32, on the model's device): gathered from
    /// a table of every position built once per model copy, so a step on a
    /// GPU uploads nothing for RoPE and reads no position back. The values
    /// are [`Rope::cos_sin`]'s. Positions must be below the model's
    /// `max_position_embeddings` (the engine's contexts are).
    pub fn cos_sin_gather(&self, positions: &Tensor, dtype: DType) -> Result<(Tensor, Tensor)> {
        let (cos, sin) = match self.table.get() {
            Some(t) => t,
            None => {
                let all: Vec<u32> = (0..self.max_positions as u32).collect();
                let t = self.cos_sin(&all, dtype, positions.device())?;
                self.table.get_or_init(|| t)
            }
        };
        let (cos, sin) = (
            cos.index_select(positions, 0)?,
            sin.index_select(positions, 0)?,
        );
        Ok((cos.to_dtype(dtype)?, sin.to_dtype(dtype)?))
    }

    /// The inverse frequencies, length `head_dim / 2`.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// `(cos, sin)` as f32 rows, each `[n, head_dim/2]` row-major.
    pub fn cos_sin_f32(&self, positions: &[u32]) -> (Vec<f32>, Vec<f32>) {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &f in &self.inv_freq {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        (cos, sin)
    }

    /// `(cos, sin)`, each `[n, head_dim/2]` in `dtype`, for the `n` positions.
    pub fn cos_sin(
        &self,
        positions: &[u32],
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let (cos, sin) = self.cos_sin_f32(positions);
        let n = positions.len();
        let cos = Tensor::from_vec(cos, (n, half), device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (n, half), device)?.to_dtype(dtype)?;
        Ok((cos, sin))
    }
}

/// Apply RoPE to `x: [B, H, T, D]` with `cos, sin: [B, 1, T, D/2]`
/// (broadcast over heads). Differentiable (narrow, mul, cat).
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let a = (x1.broadcast_mul(cos)? - x2.broadcast_mul(sin)?)?;
    let b = (x2.broadcast_mul(cos)? + x1.broadcast_mul(sin)?)?;
    Ok(Tensor::cat(&[a, b], D::Minus1)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_matches_complex_rotation_f64() {
        // Rotating pair (x_i, x_{i+d/2}) by angle p*f_i is multiplication by e^{i p f_i}.
        let cfg = ModelConfig::smollm2_135m();
        let rope = Rope::new(&cfg);
        let d = cfg.head_dim;
        let dev = Device::Cpu;
        let xs: Vec<f64> = (0..2 * d)
            .map(|i| ((i * 37 % 11) as f64 - 5.0) / 3.0)
            .collect();
        let x = Tensor::from_vec(xs.clone(), (1, 1, 2, d), &dev).unwrap();
        let pos = [3u32, 1000];
        let (c, s) = rope.cos_sin(&pos, DType::F64, &dev).unwrap();
        let c = c.reshape((1, 1, 2, d / 2)).unwrap();
        let s = s.reshape((1, 1, 2, d / 2)).unwrap();
        let y: Vec<f64> = apply_rope(&x, &c, &s)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        for (t, &p) in pos.iter().enumerate() {
            for i in 0..d / 2 {
                let ang = p as f64 * rope.inv_freq()[i] as f64;
                let (re, im) = (xs[t * d + i], xs[t * d + i + d / 2]);
                let want_re = re * ang.cos() - im * ang.sin();
                let want_im = im * ang.cos() + re * ang.sin();
                assert!((y[t * d + i] - want_re).abs() < 1e-4);
                assert!((y[t * d + i + d / 2] - want_im).abs() < 1e-4);
            }
        }
    }

    #[test]
    fn llama3_scaling_keeps_high_freqs_and_divides_low() {
        let mut cfg = ModelConfig::smollm2_135m();
        cfg.rope_theta = 500000.0;
        let plain = Rope::new(&cfg);
        cfg.rope_scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        };
        let scaled = Rope::new(&cfg);
        let (p, s) = (plain.inv_freq(), scaled.inv_freq());
        assert_eq!(p[0], s[0]);
        let last = p.len() - 1;
        assert!((s[last] - p[last] / 8.0).abs() < 1e-12);
    }
}
