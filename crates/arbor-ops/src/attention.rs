//! Paged attention on the CPU.
//!
//! For new token `i` (sequence `s_i`, position `p_i`) and query head `h`
//! with KV head `h / g` (`g = n_heads / n_kv`):
//! `o_{i,h} = sum_{j <= p_i} softmax_j(q_{i,h} . k_{s_i, j} / sqrt(d)) v_{s_i, j}`,
//! where `k_{s, j}` lives at slot `table_s[j / B] * B + j % B` of the cache.
//! The `g` query heads of a KV head are scored in one pass over the
//! context, so each cached key and value row is read once per token per KV
//! head. Accumulation is in f32.

use multiversion::multiversion;
use rayon::prelude::*;

/// Inputs of [`paged_attention`].
#[derive(Debug, Clone, Copy)]
pub struct PagedAttentionArgs<'a> {
    /// Queries `[n_heads, t, head_dim]` (head-major, RoPE applied).
    pub q: &'a [f32],
    /// Key cache `[slots, n_kv, head_dim]`, holding every token's K already.
    pub k_cache: &'a [f32],
    /// Value cache, same layout.
    pub v_cache: &'a [f32],
    pub n_heads: usize,
    pub n_kv: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// Per new token: its position (it attends to positions `0..=p`).
    pub positions: &'a [u32],
    /// Per new token: index of its sequence in `tables`.
    pub token_seq: &'a [usize],
    /// Per sequence: block table.
    pub tables: &'a [Vec<u32>],
}

/// Attention output `[t, n_heads * head_dim]`.
pub fn paged_attention(a: PagedAttentionArgs<'_>) -> Vec<f32> {
    let t = a.positions.len();
    let d = a.head_dim;
    let mut out = vec![0f32; t * a.n_heads * d];
    out.par_chunks_mut(a.n_heads * d)
        .enumerate()
        .for_each(|(i, o)| one_token(&a, i, o));
    out
}

#[multiversion(targets("x86_64+avx2+fma", "x86_64+avx", "x86_64+sse4.1"))]
fn one_token(a: &PagedAttentionArgs<'_>, i: usize, o: &mut [f32]) {
    let (d, nkv, bs) = (a.head_dim, a.n_kv, a.block_size);
    let t = a.positions.len();
    let g = a.n_heads / nkv;
    let row = nkv * d;
    let table = &a.tables[a.token_seq[i]];
    let ctx = a.positions[i] as usize + 1;
    let scale = 1.0 / (d as f32).sqrt();
    // Row offset of every context position in the caches.
    let rows: Vec<usize> = (0..ctx)
        .map(|j| (table[j / bs] as usize * bs + j % bs) * row)
        .collect();
    let mut scores = vec![0f32; g * ctx];
    for kvh in 0..nkv {
        let qs: Vec<&[f32]> = (0..g)
            .map(|r| &a.q[((kvh * g + r) * t + i) * d..][..d])
            .collect();
        for (j, &base) in rows.iter().enumerate() {
            let kr = &a.k_cache[base + kvh * d..][..d];
            for (r, q) in qs.iter().enumerate() {
                let mut acc = [0f32; 8];
                let mut tail = 0f32;
                let n8 = d / 8 * 8;
                for c in (0..n8).step_by(8) {
                    for l in 0..8 {
                        acc[l] += q[c + l] * kr[c + l];
                    }
                }
                for x in n8..d {
                    tail += q[x] * kr[x];
                }
                scores[r * ctx + j] = (acc.iter().sum::<f32>() + tail) * scale;
            }
        }
        for r in 0..g {
            let s = &mut scores[r * ctx..(r + 1) * ctx];
            let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut z = 0.0;
            for x in s.iter_mut() {
                *x = (*x - m).exp();
                z += *x;
            }
            let inv = 1.0 / z;
            for x in s.iter_mut() {
                *x *= inv;
            }
        }
        for (j, &base) in rows.iter().enumerate() {
            let vr = &a.v_cache[base + kvh * d..][..d];
            for r in 0..g {
                let p = scores[r * ctx + j];
                let oh = &mut o[(kvh * g + r) * d..(kvh * g + r + 1) * d];
                for (x, v) in oh.iter_mut().zip(vr) {
                    *x += p * v;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two sequences with scattered blocks against a float64 dense reference.
    #[test]
    fn matches_f64_reference() {
        let (nh, nkv, d, bs) = (6, 2, 12, 3);
        let tables = vec![vec![5u32, 1, 7], vec![2u32, 0]];
        let slots = 8 * bs;
        let mut s = 12345u64;
        let mut r = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % 2001) as f32 / 1000.0 - 1.0
        };
        let kc: Vec<f32> = (0..slots * nkv * d).map(|_| r()).collect();
        let vc: Vec<f32> = (0..slots * nkv * d).map(|_| r()).collect();
        let positions = [7u32, 2, 4, 0];
        let token_seq = [0usize, 0, 1, 1];
        let t = positions.len();
        let q: Vec<f32> = (0..nh * t * d).map(|_| r()).collect();
        let out = paged_attention(PagedAttentionArgs {
            q: &q,
            k_cache: &kc,
            v_cache: &vc,
            n_heads: nh,
            n_kv: nkv,
            head_dim: d,
            block_size: bs,
            positions: &positions,
            token_seq: &token_seq,
            tables: &tables,
        });
        for i in 0..t {
            let table = &tables[token_seq[i]];
            for h in 0..nh {
                let kvh = h / (nh / nkv);
                let ctx = positions[i] as usize + 1;
                let at = |j: usize| (table[j / bs] as usize * bs + j % bs) * nkv * d + kvh * d;
                let sc: Vec<f64> = (0..ctx)
                    .map(|j| {
                        (0..d)
                            .map(|x| q[(h * t + i) * d + x] as f64 * kc[at(j) + x] as f64)
                            .sum::<f64>()
                            / (d as f64).sqrt()
                    })
                    .collect();
                let m = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                for x in 0..d {
                    let want: f64 = (0..ctx)
                        .map(|j| (sc[j] - m).exp() / z * vc[at(j) + x] as f64)
                        .sum();
                    let got = out[i * nh * d + h * d + x] as f64;
                    assert!(
                        (got - want).abs() < 1e-5,
                        "token {i} head {h} dim {x}: {got} vs {want}"
                    );
                }
            }
        }
    }
}
