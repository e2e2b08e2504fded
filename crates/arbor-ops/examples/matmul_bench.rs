//! Times `matmul_nt` against candle's matmul on SmolLM2-135M's layer shapes
//! (k x n = 576 x 1536 / 1536 x 576 / 576 x 576 / 576 x 192 / 576 x 49152)
//! at decode (m = 1, 8, 32) and prefill (m = 512, 2048) sizes, weights
//! cold (read from memory, as in a decode step); also the bf16-weight
//! kernel (`matmul_nt_op` on bf16 weights) on the same weights. The kernels
//! are this CPU's fastest instruction set (`MatmulIsa::detect`, printed).
//! `cargo run --release -p arbor-ops --example matmul_bench [-- --quick]`
use candle_core::{Device, Tensor};
use std::time::Instant;

fn main() -> candle_core::Result<()> {
    println!(
        "matmul_nt kernels: {}",
        arbor_ops::MatmulIsa::detect().name()
    );
    let quick = std::env::args().any(|a| a == "--quick");
    let dev = Device::Cpu;
    println!("| m | k x n | candle ms | matmul_nt ms | speedup | matmul_nt GFLOP/s | bf16 ms | bf16 GFLOP/s |");
    println!("|---|---|---|---|---|---|---|---|");
    let shapes: &[(usize, usize)] = &[
        (576, 1536),
        (1536, 576),
        (576, 576),
        (576, 192),
        (576, 49152),
    ];
    for &(k, n) in shapes {
        // Enough copies of the weights (>= 256 MB) that each call reads them
        // from memory, as a decode step does (its layers' weights do not fit
        // in cache).
        let copies = (256 << 20) / (n * k * 4) + 1;
        let ws: Vec<Tensor> = (0..copies)
            .map(|_| Tensor::randn(0f32, 1.0, (n, k), &dev))
            .collect::<candle_core::Result<_>>()?;
        let wb: Vec<Tensor> = ws
            .iter()
            .map(|w| w.to_dtype(candle_core::DType::BF16))
            .collect::<candle_core::Result<_>>()?;
        let next = std::cell::Cell::new(0usize);
        let w = || {
            next.set((next.get() + 1) % copies);
            &ws[next.get()]
        };
        let w16 = || {
            next.set((next.get() + 1) % copies);
            &wb[next.get()]
        };
        for &m in &[1usize, 8, 32, 512, 2048] {
            if n > 10_000 && m > 32 {
                continue; // the LM head runs on the last position only
            }
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
            let flop = 2.0 * (m * k * n) as f64;
            let reps = ((2e10 / flop) as usize).clamp(3, if quick { 20 } else { 200 });
            let time = |f: &dyn Fn() -> candle_core::Result<Tensor>| -> candle_core::Result<f64> {
                for _ in 0..3 {
                    f()?;
                }
                let mut v = Vec::new();
                for _ in 0..reps {
                    let t0 = Instant::now();
                    f()?;
                    v.push(t0.elapsed().as_secs_f64() * 1e3);
                }
                v.sort_by(|a, b| a.total_cmp(b));
                Ok(v[v.len() / 2])
            };
            let a = time(&|| x.matmul(&w().t()?))?;
            let b = time(&|| arbor_ops::matmul_nt_op(&x, w()))?;
            let c = time(&|| arbor_ops::matmul_nt_op(&x, w16()))?;
            let c = format!("{c:.3} | {:.1}", flop / (c * 1e-3) / 1e9);
            println!(
                "| {m} | {k} x {n} | {a:.3} | {b:.3} | {:.2}x | {:.1} | {c} |",
                a / b,
                flop / (b * 1e-3) / 1e9
            );
        }
    }
    Ok(())
}
