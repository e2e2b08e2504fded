//! Times `small_matmul` against candle's matmul at decode shapes
//! (SmolLM2-135M: k = 576, n = 1536 / 576 / 49152) for m = 1, 8, 16, 32
//! (more than 8 rows as tiles of 8).
//! `cargo run --release -p arbor-ops --example small_matmul_bench`
use candle_core::{Device, Tensor};
use std::time::Instant;

fn main() -> candle_core::Result<()> {
    if !arbor_ops::small_matmul_available() {
        println!("no AVX-512F: nothing to compare");
        return Ok(());
    }
    let dev = Device::Cpu;
    println!("| m | k | n | candle ms | small ms | speedup | small GB/s |");
    println!("|---|---|---|---|---|---|---|");
    for &(k, n) in &[(576usize, 1536usize), (1536, 576), (576, 49152)] {
        let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?;
        for &m in &[1usize, 8, 16, 32] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
            let reps = 200;
            let time = |f: &dyn Fn() -> candle_core::Result<Tensor>| -> candle_core::Result<f64> {
                for _ in 0..5 {
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
            let a = time(&|| x.matmul(&w.t()?))?;
            // Rows beyond one tile run as tiles of 8 (the weights re-read per tile).
            let b = time(&|| {
                let tiles: Vec<Tensor> = (0..m.div_ceil(8))
                    .map(|t| arbor_ops::small_matmul_op(&x.narrow(0, 8 * t, 8.min(m - 8 * t))?, &w))
                    .collect::<candle_core::Result<_>>()?;
                Tensor::cat(&tiles, 0)
            })?;
            let gbs = (n * k * 4) as f64 / (b * 1e-3) / 1e9;
            println!(
                "| {m} | {k} | {n} | {a:.3} | {b:.3} | {:.2}x | {gbs:.1} |",
                a / b
            );
        }
    }
    Ok(())
}
