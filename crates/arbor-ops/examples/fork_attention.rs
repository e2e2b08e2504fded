//! Paged attention of one decode step of a fork: `N` children (default 8)
//! of a `P`-token prompt (default 512), each `T` tokens (default 64) past
//! it, over 30 layers of a SmolLM2-135M-shaped cache (9 query heads, 3 KV
//! heads, head size 64, blocks of 16; 71 MB, more than the L3, as in a real
//! step). Prints ms per step and the effective GFLOP/s. With `SEPARATE=1`
//! the `N` sequences share nothing (a batch of different prompts, as in
//! `arbor bench generate`).
//! `cargo run --release -p arbor-ops --example fork_attention -- [N] [P] [T] [STEPS]`
use arbor_ops::{paged_attention, PagedAttentionArgs};

fn main() {
    let a: Vec<usize> = std::env::args()
        .skip(1)
        .map(|s| s.parse().expect("numbers"))
        .collect();
    let arg = |i: usize, d: usize| a.get(i).copied().unwrap_or(d);
    let (n, p, t, steps) = (arg(0, 8), arg(1, 512), arg(2, 64), arg(3, 50));
    let layers = std::env::var("LAYERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    let (nh, nkv, d, bs) = (9, 3, 64, 16);
    let separate = std::env::var("SEPARATE").is_ok();
    let (pb, own) = if separate {
        (0, (p + t + bs).div_ceil(bs))
    } else {
        (p / bs, (t + bs).div_ceil(bs))
    };
    let blocks = pb + n * own;
    // The prompt's blocks shared by every child, then each child's own.
    let tables: Vec<Vec<u32>> = (0..n)
        .map(|c| {
            (0..pb as u32)
                .chain((0..own).map(|b| (pb + c * own + b) as u32))
                .collect()
        })
        .collect();
    let slots = blocks * bs * nkv * d;
    let caches: Vec<(Vec<f32>, Vec<f32>)> = (0..layers)
        .map(|l| {
            let f = |s: usize| {
                (0..slots)
                    .map(|i| ((i * 7 + s) % 13) as f32 * 0.1 - 0.6)
                    .collect()
            };
            (f(l), f(l + 100))
        })
        .collect();
    let positions: Vec<u32> = vec![(p + t) as u32; n];
    let token_seq: Vec<usize> = (0..n).collect();
    let q: Vec<f32> = (0..nh * n * d)
        .map(|i| (i % 17) as f32 * 0.05 - 0.4)
        .collect();
    let step = || {
        for (kc, vc) in &caches {
            std::hint::black_box(paged_attention(PagedAttentionArgs {
                q: &q,
                k_cache: kc,
                v_cache: vc,
                n_heads: nh,
                n_kv: nkv,
                head_dim: d,
                block_size: bs,
                positions: &positions,
                token_seq: &token_seq,
                tables: &tables,
            }));
        }
    };
    let dt = arbor_ops::in_pool_polling(&candle_core::Device::Cpu, || {
        step();
        let t0 = std::time::Instant::now();
        for _ in 0..steps {
            step();
        }
        t0.elapsed().as_secs_f64() / steps as f64
    });
    let flop = 4.0 * (n * nh * (p + t + 1) * d * layers) as f64;
    println!(
        "{n} {} x {p}+{t} tokens: {:.3} ms/step, {:.1} GFLOP/s",
        if separate { "sequences" } else { "children" },
        dt * 1e3,
        flop / dt / 1e9
    );
}
