//! Criterion benchmarks of the CPU generation kernels, on SmolLM2-135M's
//! shapes: the row-invariant matmuls against candle's matmul at decode
//! (m = 1, 32) and prefill (m = 512) sizes: f32 weights packed once (the
//! engine's path, `packed::matmul_packed`), f32 weights packed per call
//! (the training forward's `matmul_nt_op`) and bf16 weights; and one decode
//! step's
//! paged attention for a fork (8 children of a 512-token prompt, sharing
//! its blocks) against the same 8 sequences sharing nothing.
//!
//! `cargo bench -p arbor-ops --bench cpu_kernels`

use arbor_ops::cpu::packed::{matmul_packed, PackedWeights};
use arbor_ops::{paged_attention, PagedAttentionArgs};
use candle_core::{DType, Device, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

/// The projections of one SmolLM2-135M layer, `k x n`.
const SHAPES: [(usize, usize); 3] = [(576, 1536), (1536, 576), (576, 576)];

fn matmuls(c: &mut Criterion) {
    let dev = Device::Cpu;
    let mut g = c.benchmark_group(format!(
        "matmul_nt ({})",
        arbor_ops::MatmulIsa::detect().name()
    ));
    for (k, n) in SHAPES {
        let w = Tensor::randn(0f32, 1.0, (n, k), &dev).unwrap();
        let w16 = w.to_dtype(DType::BF16).unwrap();
        let packed = PackedWeights::pack(&w.flatten_all().unwrap().to_vec1::<f32>().unwrap(), n, k);
        for m in [1usize, 32, 512] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev).unwrap();
            g.throughput(Throughput::Elements((2 * m * k * n) as u64));
            let id = format!("{m}x{k}x{n}");
            g.bench_with_input(BenchmarkId::new("candle", &id), &x, |b, x| {
                b.iter(|| x.matmul(&w.t().unwrap()).unwrap());
            });
            let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            g.bench_with_input(BenchmarkId::new("f32 packed", &id), &xs, |b, xs| {
                b.iter(|| matmul_packed(xs, m, &packed));
            });
            g.bench_with_input(BenchmarkId::new("f32 op", &id), &x, |b, x| {
                b.iter(|| arbor_ops::matmul_nt_op(x, &w).unwrap());
            });
            g.bench_with_input(BenchmarkId::new("bf16", &id), &x, |b, x| {
                b.iter(|| arbor_ops::matmul_nt_op(x, &w16).unwrap());
            });
        }
    }
    g.finish();
}

/// One layer's paged attention for `n` sequences `p + t` tokens long;
/// `shared`: their first `p` tokens are the same blocks (a fork).
fn attention_case(n: usize, p: usize, t: usize, shared: bool) -> impl FnMut() {
    let (nh, nkv, d, bs) = (9, 3, 64, 16);
    let (prefix_blocks, own) = if shared {
        (p / bs, (t + bs).div_ceil(bs))
    } else {
        (0, (p + t + bs).div_ceil(bs))
    };
    let blocks = prefix_blocks + n * own;
    let tables: Vec<Vec<u32>> = (0..n)
        .map(|c| {
            (0..prefix_blocks as u32)
                .chain((0..own).map(|b| (prefix_blocks + c * own + b) as u32))
                .collect()
        })
        .collect();
    let slots = blocks * bs * nkv * d;
    let fill = |s: usize| -> Vec<f32> {
        (0..slots)
            .map(|i| ((i * 7 + s) % 13) as f32 * 0.1 - 0.6)
            .collect()
    };
    let (k_cache, v_cache) = (fill(0), fill(100));
    let positions: Vec<u32> = vec![(p + t) as u32; n];
    let token_seq: Vec<usize> = (0..n).collect();
    let q: Vec<f32> = (0..nh * n * d)
        .map(|i| (i % 17) as f32 * 0.05 - 0.4)
        .collect();
    move || {
        std::hint::black_box(paged_attention(PagedAttentionArgs {
            q: &q,
            k_cache: &k_cache,
            v_cache: &v_cache,
            n_heads: nh,
            n_kv: nkv,
            head_dim: d,
            block_size: bs,
            positions: &positions,
            token_seq: &token_seq,
            tables: &tables,
        }));
    }
}

fn attention(c: &mut Criterion) {
    let mut g = c.benchmark_group("paged_attention decode step, 8 x 512+64 tokens");
    for (name, shared) in [("fork", true), ("separate", false)] {
        let mut step = attention_case(8, 512, 64, shared);
        g.bench_function(name, |b| b.iter(&mut step));
    }
    g.finish();
}

criterion_group!(benches, matmuls, attention);
criterion_main!(benches);
