//! One decode step of a SmolLM2-135M-shaped f32 model over `M` sequences
//! (default 32) of `C` context tokens (default 128): per layer the q/k/v,
//! o, gate/up and down matmuls (packed weights) and the paged attention,
//! then the LM head, as the engine runs them. Prints ms per step. `MODE`:
//! - `seq` (default): the engine's order, every op on all rows;
//! - `pipe`: the sequences in two halves, one half's attention
//!   (memory-bound) beside the other half's matmuls (compute-bound) through
//!   `rayon::join`, a two-stage pipeline through the layers;
//! - `pipe2`: as `pipe`, with each weight used by both halves back to back
//!   where the dependencies allow;
//! - `mm`, `mmhalf`: the matmuls alone, on all rows or in two halves;
//! - `attn`: the attention alone (no LM head).
//!
//! Dataflow is not real (buffers are reused); the memory and compute
//! pattern is. On a 2-core Zen 4 the pipelines were 2-6 ms slower than
//! `seq`, which is `mm` plus `attn` (docs/benchmarks.md, fifteenth
//! session): both threads are busy throughout, so there is no idle core
//! for the overlap to fill.
//! `cargo run --release -p arbor-ops --example step_overlap -- [M] [C] [STEPS]`
use arbor_ops::packed::PackedWeights;
use arbor_ops::{paged_attention, PagedAttentionArgs, WeightRows};

fn main() {
    let a: Vec<usize> = std::env::args()
        .skip(1)
        .map(|s| s.parse().expect("numbers"))
        .collect();
    let arg = |i: usize, d: usize| a.get(i).copied().unwrap_or(d);
    let (m, ctx, steps) = (arg(0, 32), arg(1, 128), arg(2, 20));
    let mode = std::env::var("MODE").unwrap_or_else(|_| "seq".into());
    let (h, inter, kvd, layers, vocab) = (576, 1536, 192, 30, 49152);
    let (nh, nkv, d, bs) = (9, 3, 64, 16);
    let mat = |n: usize, k: usize, s: usize| -> Vec<f32> {
        (0..n * k)
            .map(|i| ((i * 7 + s) % 13) as f32 * 0.01 - 0.06)
            .collect()
    };
    let shapes: Vec<Vec<(usize, usize)>> = vec![
        vec![(h, h), (kvd, h), (kvd, h)],
        vec![(h, h)],
        vec![(inter, h), (inter, h)],
        vec![(h, inter)],
    ];
    let mut s = 0;
    let w: Vec<Vec<Vec<PackedWeights>>> = (0..layers)
        .map(|_| {
            shapes
                .iter()
                .map(|g| {
                    g.iter()
                        .map(|&(n, k)| {
                            s += 1;
                            PackedWeights::pack(&mat(n, k, s), n, k)
                        })
                        .collect()
                })
                .collect()
        })
        .collect();
    let head = PackedWeights::pack(&mat(vocab, h, 1), vocab, h);
    // KV: every sequence its own blocks.
    let own = (ctx + bs).div_ceil(bs);
    let tables: Vec<Vec<u32>> = (0..m)
        .map(|c| (0..own).map(|b| (c * own + b) as u32).collect())
        .collect();
    let slots = m * own * bs * nkv * d;
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
    let positions: Vec<u32> = vec![ctx as u32; m];
    let token_seq: Vec<usize> = (0..m).collect();
    let q: Vec<f32> = (0..nh * m * d)
        .map(|i| (i % 17) as f32 * 0.05 - 0.4)
        .collect();
    let x: Vec<f32> = (0..m * inter)
        .map(|i| (i % 11) as f32 * 0.1 - 0.5)
        .collect();
    // Rows `r` of the batch through layer `l`'s matmul groups `gs`.
    let bufs: Vec<std::sync::Mutex<Vec<Vec<f32>>>> = (0..2)
        .map(|_| std::sync::Mutex::new((0..3).map(|_| vec![0f32; m * inter]).collect()))
        .collect();
    let mm = |l: usize, gs: std::ops::Range<usize>, r: std::ops::Range<usize>| {
        let rows = r.len();
        let mut outs = bufs[usize::from(r.start > 0)].lock().unwrap();
        for gi in gs {
            let g = &shapes[gi];
            let k = g[0].1;
            let ws: Vec<WeightRows<'_>> = (0..g.len())
                .map(|j| WeightRows::Packed(&w[l][gi][j]))
                .collect();
            let mut ys: Vec<&mut [f32]> = outs
                .iter_mut()
                .zip(g)
                .map(|(o, &(n, _))| &mut o[..rows * n])
                .collect();
            arbor_ops::matmul_nt_multi_into(&x[r.start * k..r.end * k], &ws, rows, k, &mut ys);
        }
        std::hint::black_box(&mut *outs);
    };
    // Attention of sequences `r` over layer `l`'s cache.
    let attn = |l: usize, r: std::ops::Range<usize>| {
        let (kc, vc) = &caches[l];
        let t = r.len();
        let mut qh = vec![0f32; nh * t * d];
        for hh in 0..nh {
            qh[hh * t * d..(hh + 1) * t * d]
                .copy_from_slice(&q[(hh * m + r.start) * d..(hh * m + r.end) * d]);
        }
        std::hint::black_box(paged_attention(PagedAttentionArgs {
            q: &qh,
            k_cache: kc,
            v_cache: vc,
            n_heads: nh,
            n_kv: nkv,
            head_dim: d,
            block_size: bs,
            positions: &positions[r.clone()],
            token_seq: &token_seq[r.clone()],
            tables: &tables,
        }));
    };
    let lm_head = || {
        let mut logits = vec![0f32; m * vocab];
        arbor_ops::matmul_nt_multi_into(
            &x[..m * h],
            &[WeightRows::Packed(&head)],
            m,
            h,
            &mut [&mut logits[..]],
        );
        std::hint::black_box(logits);
    };
    let (ha, hb) = (0..m / 2, m / 2..m);
    let step = || {
        match mode.as_str() {
            "pipe" => {
                // A's q/k/v of layer 0 alone; then per layer: A's attention
                // beside B's (o, mlp of the previous layer and) q/k/v; B's
                // attention beside A's o, mlp and next q/k/v.
                mm(0, 0..1, ha.clone());
                for l in 0..layers {
                    rayon::join(
                        || attn(l, ha.clone()),
                        || {
                            if l > 0 {
                                mm(l - 1, 1..4, hb.clone());
                            }
                            mm(l, 0..1, hb.clone());
                        },
                    );
                    rayon::join(
                        || attn(l, hb.clone()),
                        || {
                            mm(l, 1..4, ha.clone());
                            if l + 1 < layers {
                                mm(l + 1, 0..1, ha.clone());
                            }
                        },
                    );
                }
                mm(layers - 1, 1..4, hb.clone());
            }
            "pipe2" => {
                // Weights used by both halves back to back where possible.
                mm(0, 0..1, ha.clone());
                for l in 0..layers {
                    rayon::join(|| attn(l, ha.clone()), || mm(l, 0..1, hb.clone()));
                    rayon::join(|| attn(l, hb.clone()), || mm(l, 1..4, ha.clone()));
                    mm(l, 1..4, hb.clone());
                    if l + 1 < layers {
                        mm(l + 1, 0..1, ha.clone());
                    }
                }
            }
            "mm" => {
                for l in 0..layers {
                    mm(l, 0..1, 0..m);
                    mm(l, 1..4, 0..m);
                }
            }
            "mmhalf" => {
                for l in 0..layers {
                    mm(l, 0..1, ha.clone());
                    mm(l, 0..1, hb.clone());
                    mm(l, 1..4, ha.clone());
                    mm(l, 1..4, hb.clone());
                }
            }
            "attn" => {
                for l in 0..layers {
                    attn(l, 0..m);
                }
                return;
            }
            _ => {
                for l in 0..layers {
                    mm(l, 0..1, 0..m);
                    attn(l, 0..m);
                    mm(l, 1..4, 0..m);
                }
            }
        }
        lm_head();
    };
    let dt = arbor_ops::in_pool_polling(&candle_core::Device::Cpu, || {
        step();
        let t0 = std::time::Instant::now();
        for _ in 0..steps {
            step();
        }
        t0.elapsed().as_secs_f64() / steps as f64
    });
    println!("{mode} m {m} ctx {ctx}: {:.2} ms/step", dt * 1e3);
}
