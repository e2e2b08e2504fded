//! The MLP blocks of one decode step of a SmolLM2-135M-shaped model (30
//! layers, `M` rows, default 32; f32 weights packed as the engine keeps
//! them), with and without the fused epilogues, alternating for `ROUNDS`
//! rounds (default 3): unfused is the gate and up products in one call,
//! `rows::silu_mul`, the down product, `rows::add` of the residual; fused is
//! `swiglu_packed` then `matmul_packed_add`. Prints ms per step of each.
//! `cargo run --release -p arbor-ops --example mlp_ab -- [M] [ROUNDS]`
use arbor_ops::packed::{matmul_packed, matmul_packed_add, swiglu_packed, PackedWeights};

fn main() {
    let a: Vec<usize> = std::env::args()
        .skip(1)
        .map(|s| s.parse().expect("numbers"))
        .collect();
    let m = a.first().copied().unwrap_or(32);
    let rounds = a.get(1).copied().unwrap_or(3);
    let (h, inter, layers) = (576usize, 1536usize, 30usize);
    let mat = |n: usize, k: usize, s: usize| -> Vec<f32> {
        (0..n * k)
            .map(|i| ((i * 7 + s) % 13) as f32 * 0.01 - 0.06)
            .collect()
    };
    let ws: Vec<[PackedWeights; 3]> = (0..layers)
        .map(|l| {
            [
                PackedWeights::pack(&mat(inter, h, l), inter, h),
                PackedWeights::pack(&mat(inter, h, l + 50), inter, h),
                PackedWeights::pack(&mat(h, inter, l + 99), h, inter),
            ]
        })
        .collect();
    let x: Vec<f32> = (0..m * h).map(|i| (i % 11) as f32 * 0.1 - 0.5).collect();
    let steps = 40;
    arbor_ops::in_pool_polling(&candle_core::Device::Cpu, || {
        for round in 0..rounds {
            for fused in [false, true] {
                let t = std::time::Instant::now();
                for _ in 0..steps {
                    for w in &ws {
                        let y = if fused {
                            let gu = swiglu_packed(&x, m, &w[0], &w[1]);
                            matmul_packed_add(&gu, m, &w[2], &x)
                        } else {
                            let gu2 = arbor_ops::matmul_nt_multi(
                                &x,
                                &[
                                    arbor_ops::WeightRows::Packed(&w[0]),
                                    arbor_ops::WeightRows::Packed(&w[1]),
                                ],
                                m,
                                h,
                                &[inter, inter],
                            );
                            let gu = arbor_ops::rows::silu_mul(&gu2[0], &gu2[1]);
                            let d = matmul_packed(&gu, m, &w[2]);
                            arbor_ops::rows::add(&x, &d)
                        };
                        std::hint::black_box(y);
                    }
                }
                println!(
                    "round {round} fused {fused}: {:.2} ms/step",
                    t.elapsed().as_secs_f64() / steps as f64 * 1e3
                );
            }
        }
    });
}
