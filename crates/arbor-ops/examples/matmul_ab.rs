//! Fixed work for A/B runs of the f32 matmul: REPS calls over weights read
//! from memory (enough copies to exceed the caches; `COPIES=1` for hot).
//! The weights are packed once (`arbor_ops::packed`, as the engine keeps
//! them); `PER_CALL=1` times `matmul_nt_into` instead, which packs them on
//! every call (the training forward's path).
//! `cargo run --release -p arbor-ops --example matmul_ab -- M K N REPS`
use arbor_ops::packed::{matmul_packed, PackedWeights};

fn main() {
    let a: Vec<usize> = std::env::args()
        .skip(1)
        .map(|s| s.parse().unwrap())
        .collect();
    let (m, k, n, reps) = (a[0], a[1], a[2], a[3]);
    let copies = std::env::var("COPIES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or((256 << 20) / (n * k * 4) + 1);
    let ws: Vec<Vec<f32>> = (0..copies)
        .map(|c| {
            (0..n * k)
                .map(|i| ((i * 7 + c) % 13) as f32 * 0.01)
                .collect()
        })
        .collect();
    let per_call = std::env::var("PER_CALL").is_ok();
    let packed: Vec<PackedWeights> = if per_call {
        Vec::new()
    } else {
        ws.iter().map(|w| PackedWeights::pack(w, n, k)).collect()
    };
    let x: Vec<f32> = (0..m * k).map(|i| (i % 11) as f32 * 0.1).collect();
    let mut y = vec![0f32; m * n];
    let t0 = std::time::Instant::now();
    let mut calls = || {
        for r in 0..reps {
            if per_call {
                arbor_ops::matmul_nt_into(&x, &ws[r % copies], m, k, n, &mut y);
            } else {
                std::hint::black_box(matmul_packed(&x, m, &packed[r % copies]));
            }
        }
    };
    if std::env::var("OUTSIDE").is_ok() {
        calls()
    } else {
        rayon::scope(|_| calls());
    }
    let dt = t0.elapsed().as_secs_f64();
    println!(
        "{:.4} ms/call {:.1} GFLOP/s",
        dt / reps as f64 * 1e3,
        2.0 * (m * k * n * reps) as f64 / dt / 1e9
    );
}
