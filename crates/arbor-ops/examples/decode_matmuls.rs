//! The matmuls of one decode step of a SmolLM2-135M-shaped model (30 layers
//! of q/k/v, o, gate/up, down; the tied LM head), bf16 weights (f32 with
//! `F32=1`, packed once as the engine keeps them), `m` rows, through `matmul_nt_multi_into` as the engine calls
//! them (inside the rayon pool); weights read from memory as in a real step. Prints ms per step,
//! GFLOP/s and the weight bytes streamed per second. `HOT=1` runs every
//! layer on layer 0's weights (cache-resident; the head stays cold), to
//! separate compute from weight streaming.
//! `cargo run --release -p arbor-ops --example decode_matmuls -- [M] [STEPS]`
use arbor_ops::packed::PackedWeights;
use arbor_ops::WeightRows;
use half::bf16;

fn main() {
    let a: Vec<usize> = std::env::args()
        .skip(1)
        .map(|s| s.parse().expect("numbers"))
        .collect();
    let m = a.first().copied().unwrap_or(8);
    let steps = a.get(1).copied().unwrap_or(50);
    let f32w = std::env::var("F32").is_ok();
    let (h, inter, kvd, layers, vocab) = (576, 1536, 192, 30, 49152);
    let mat = |n: usize, k: usize, s: usize| -> Vec<f32> {
        (0..n * k)
            .map(|i| ((i * 7 + s) % 13) as f32 * 0.01 - 0.06)
            .collect()
    };
    // Per layer: [q, k, v], [o], [gate, up], [down] as (n, k).
    let shapes: Vec<Vec<(usize, usize)>> = vec![
        vec![(h, h), (kvd, h), (kvd, h)],
        vec![(h, h)],
        vec![(inter, h), (inter, h)],
        vec![(h, inter)],
    ];
    let mut s = 0;
    let mut next = || {
        s += 1;
        s
    };
    let w32: Vec<Vec<Vec<Vec<f32>>>> = (0..layers)
        .map(|_| {
            shapes
                .iter()
                .map(|g| g.iter().map(|&(n, k)| mat(n, k, next())).collect())
                .collect()
        })
        .collect();
    let head32 = mat(vocab, h, 1);
    let to16 = |v: &Vec<f32>| -> Vec<bf16> { v.iter().map(|&x| bf16::from_f32(x)).collect() };
    let w16: Vec<Vec<Vec<Vec<bf16>>>> = w32
        .iter()
        .map(|l| l.iter().map(|g| g.iter().map(to16).collect()).collect())
        .collect();
    let head16 = to16(&head32);
    // f32 weights packed once, as the engine keeps them (`arbor_ops::packed`).
    let pack = |w: &Vec<f32>, n: usize, k: usize| PackedWeights::pack(w, n, k);
    let p32: Vec<Vec<Vec<PackedWeights>>> = w32
        .iter()
        .map(|l| {
            l.iter()
                .zip(&shapes)
                .map(|(g, sh)| g.iter().zip(sh).map(|(w, &(n, k))| pack(w, n, k)).collect())
                .collect()
        })
        .collect();
    let head_p = pack(&head32, vocab, h);
    let wr = |l: usize, gi: usize, j: usize| -> WeightRows<'_> {
        if f32w {
            WeightRows::Packed(&p32[l][gi][j])
        } else {
            WeightRows::Bf16(&w16[l][gi][j])
        }
    };
    let x: Vec<f32> = (0..m * inter)
        .map(|i| (i % 11) as f32 * 0.1 - 0.5)
        .collect();
    let mut outs: Vec<Vec<f32>> = (0..3).map(|_| vec![0f32; m * inter]).collect();
    let mut logits = vec![0f32; m * vocab];
    let mut flop = 0f64;
    let mut bytes = 0f64;
    let el = if f32w { 4.0 } else { 2.0 };
    let hot = std::env::var("HOT").is_ok();
    let mut step = |count: bool| {
        for l0 in 0..layers {
            let l = if hot { 0 } else { l0 };
            for (gi, g) in shapes.iter().enumerate() {
                let k = g[0].1;
                let ws: Vec<WeightRows<'_>> = (0..g.len()).map(|j| wr(l, gi, j)).collect();
                let mut ys: Vec<&mut [f32]> = outs
                    .iter_mut()
                    .zip(g)
                    .map(|(o, &(n, _))| &mut o[..m * n])
                    .collect();
                arbor_ops::matmul_nt_multi_into(&x[..m * k], &ws, m, k, &mut ys);
                if count {
                    for &(n, k) in g {
                        flop += 2.0 * (m * n * k) as f64;
                        bytes += (n * k) as f64 * el;
                    }
                }
            }
        }
        let head = if f32w {
            WeightRows::Packed(&head_p)
        } else {
            WeightRows::Bf16(&head16)
        };
        arbor_ops::matmul_nt_multi_into(&x[..m * h], &[head], m, h, &mut [&mut logits[..]]);
        if count {
            flop += 2.0 * (m * vocab * h) as f64;
            bytes += (vocab * h) as f64 * el;
        }
    };
    // Inside the pool, as the engine runs a step (`arbor_ops::in_pool_polling`).
    let dt = arbor_ops::in_pool_polling(&candle_core::Device::Cpu, || {
        step(false);
        let t0 = std::time::Instant::now();
        for _ in 0..steps {
            step(true);
        }
        t0.elapsed().as_secs_f64()
    });
    println!(
        "m {m} {}: {:.2} ms/step, {:.1} GFLOP/s, {:.1} GB/s of weights",
        if f32w { "f32" } else { "bf16" },
        dt / steps as f64 * 1e3,
        flop / dt / 1e9,
        bytes / dt / 1e9
    );
}
