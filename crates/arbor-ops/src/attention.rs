//! Paged attention on the CPU.
//!
//! For new token `i` (sequence `s_i`, position `p_i`) and query head `h`
//! with KV head `h / g` (`g = n_heads / n_kv`):
//! `o_{i,h} = sum_{j <= p_i} softmax_j(q_{i,h} . k_{s_i, j} / sqrt(d)) v_{s_i, j}`,
//! where `k_{s, j}` lives at slot `table_s[j / B] * B + j % B` of the cache.
//! The `g` query heads of a KV head are scored in one pass over the
//! context, so each cached key and value row is read once per token per KV
//! head. Accumulation is in f32.
//!
//! On CPUs with AVX-512F and head sizes 16/32/64/128/256 a vectorised path
//! runs ([`one_token_avx512`]): 16 keys' dot products at a time, their
//! lanes summed by one transpose tree; a polynomial `exp` (relative error
//! below 2e-7); the value sum with the output rows held in registers.
//! Elsewhere the portable kernel runs (`multiversion`). Either way a token's
//! output depends only on its own query and context, never on the other
//! tokens of the batch.

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
    let fast = avx512_head_dim(d);
    out.par_chunks_mut(a.n_heads * d)
        .enumerate()
        .for_each(|(i, o)| {
            #[cfg(target_arch = "x86_64")]
            if fast {
                // SAFETY: AVX-512F was detected by `avx512_head_dim`.
                #[allow(unsafe_code)]
                unsafe {
                    one_token_avx512(&a, i, o)
                };
                return;
            }
            let _ = fast;
            one_token(&a, i, o)
        });
    out
}

/// Whether the AVX-512 path serves head size `d` on this CPU.
fn avx512_head_dim(d: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        matches!(d, 16 | 32 | 64 | 128 | 256) && std::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = d;
        false
    }
}

/// Token `i`'s context length (`position + 1`), with the offset of every
/// context position's row in the caches written to `rows`.
fn context_rows(a: &PagedAttentionArgs<'_>, i: usize, rows: &mut Vec<usize>) -> usize {
    let (bs, row) = (a.block_size, a.n_kv * a.head_dim);
    let table = &a.tables[a.token_seq[i]];
    let ctx = a.positions[i] as usize + 1;
    rows.clear();
    rows.extend((0..ctx).map(|j| (table[j / bs] as usize * bs + j % bs) * row));
    ctx
}

thread_local! {
    /// Per-thread scratch: cache row offsets and scores of one token.
    static SCRATCH: std::cell::RefCell<(Vec<usize>, Vec<f32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// The vectorised kernel: same maths as [`one_token`], `d / 16` vectors a
/// row.
///
/// # Safety
/// The CPU must support AVX-512F; `a.head_dim` must be 16, 32, 64, 128 or
/// 256; the slices must hold the rows the tables and positions name (as for
/// [`one_token`], which indexes them with bounds checks).
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f")]
unsafe fn one_token_avx512(a: &PagedAttentionArgs<'_>, i: usize, o: &mut [f32]) {
    match a.head_dim / 16 {
        1 => attend::<1>(a, i, o),
        2 => attend::<2>(a, i, o),
        4 => attend::<4>(a, i, o),
        8 => attend::<8>(a, i, o),
        16 => attend::<16>(a, i, o),
        _ => unreachable!("head_dim checked by avx512_head_dim"),
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f")]
unsafe fn attend<const DV: usize>(a: &PagedAttentionArgs<'_>, i: usize, o: &mut [f32]) {
    use std::arch::x86_64::*;
    let (d, nkv) = (a.head_dim, a.n_kv);
    let t = a.positions.len();
    let g = a.n_heads / nkv;
    let row = nkv * d;
    let scale = _mm512_set1_ps(1.0 / (d as f32).sqrt());
    let (mut rows, mut scores) = SCRATCH.with(|sc| sc.take());
    let ctx = context_rows(a, i, &mut rows);
    let padded = ctx.div_ceil(16) * 16;
    // Every row offset inside the caches: the unchecked loads below rely on it.
    let last = rows.iter().copied().max().unwrap_or(0) + row;
    assert!(
        last <= a.k_cache.len() && last <= a.v_cache.len(),
        "paged attention: slot outside the cache"
    );
    assert!(a.q.len() >= a.n_heads * t * d && o.len() >= a.n_heads * d);
    scores.clear();
    scores.resize(g * padded, 0.0);
    let kp = a.k_cache.as_ptr();
    let vp = a.v_cache.as_ptr();
    for kvh in 0..nkv {
        // Scores q . k * scale, 16 keys at a time.
        for r in 0..g {
            let qp = a.q.as_ptr().add(((kvh * g + r) * t + i) * d);
            let mut q = [_mm512_setzero_ps(); DV];
            for (c, v) in q.iter_mut().enumerate() {
                *v = _mm512_loadu_ps(qp.add(16 * c));
            }
            for j0 in (0..ctx).step_by(16) {
                let mut dots = [_mm512_setzero_ps(); 16];
                for (l, dot) in dots.iter_mut().enumerate().take((ctx - j0).min(16)) {
                    let kr = kp.add(rows[j0 + l] + kvh * d);
                    let mut acc = _mm512_mul_ps(q[0], _mm512_loadu_ps(kr));
                    for (c, qv) in q.iter().enumerate().skip(1) {
                        acc = _mm512_fmadd_ps(*qv, _mm512_loadu_ps(kr.add(16 * c)), acc);
                    }
                    *dot = acc;
                }
                let s = _mm512_mul_ps(hsum16(&dots), scale);
                _mm512_storeu_ps(scores.as_mut_ptr().add(r * padded + j0), s);
            }
        }
        // Softmax over each head's `ctx` scores.
        for r in 0..g {
            let s = &mut scores[r * padded..r * padded + ctx];
            let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mv = _mm512_set1_ps(m);
            let mut z = _mm512_setzero_ps();
            let sp = s.as_mut_ptr();
            for j0 in (0..ctx).step_by(16) {
                let n = (ctx - j0).min(16);
                let mask = ((1u32 << n) - 1) as __mmask16;
                let x = _mm512_maskz_loadu_ps(mask, sp.add(j0));
                let e = _mm512_maskz_mov_ps(mask, exp512(_mm512_sub_ps(x, mv)));
                z = _mm512_add_ps(z, e);
                _mm512_mask_storeu_ps(sp.add(j0), mask, e);
            }
            let inv = 1.0 / _mm512_reduce_add_ps(z);
            for x in s.iter_mut() {
                *x *= inv;
            }
        }
        // o_r = sum_j p_rj v_j, heads in groups whose rows fit in registers.
        let per = (24 / DV).clamp(1, 6);
        for r0 in (0..g).step_by(per) {
            let sp = scores.as_ptr().add(r0 * padded);
            let op = o.as_mut_ptr().add((kvh * g + r0) * d);
            let vh = vp.add(kvh * d);
            match per.min(g - r0) {
                1 => weigh_values::<DV, 1>(&rows, vh, sp, padded, op, d),
                2 => weigh_values::<DV, 2>(&rows, vh, sp, padded, op, d),
                3 => weigh_values::<DV, 3>(&rows, vh, sp, padded, op, d),
                4 => weigh_values::<DV, 4>(&rows, vh, sp, padded, op, d),
                5 => weigh_values::<DV, 5>(&rows, vh, sp, padded, op, d),
                _ => weigh_values::<DV, 6>(&rows, vh, sp, padded, op, d),
            }
        }
    }
    SCRATCH.with(|sc| sc.replace((rows, scores)));
}

/// `o[r] = sum_j p[r * ld + j] v_j` for `G` heads sharing the value rows
/// `v + rows[j]` (`16 * DV` floats each); `o[r]` is `d` floats apart.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f")]
unsafe fn weigh_values<const DV: usize, const G: usize>(
    rows: &[usize],
    v: *const f32,
    p: *const f32,
    ld: usize,
    o: *mut f32,
    d: usize,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); DV]; G];
    for (j, &base) in rows.iter().enumerate() {
        let vr = v.add(base);
        let mut vv = [_mm512_setzero_ps(); DV];
        for (c, x) in vv.iter_mut().enumerate() {
            *x = _mm512_loadu_ps(vr.add(16 * c));
        }
        for (r, acc) in acc.iter_mut().enumerate() {
            let w = _mm512_set1_ps(*p.add(r * ld + j));
            for c in 0..DV {
                acc[c] = _mm512_fmadd_ps(w, vv[c], acc[c]);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for (c, x) in acc.iter().enumerate() {
            _mm512_storeu_ps(o.add(r * d + 16 * c), *x);
        }
    }
}

/// `out[l] = sum of the 16 lanes of v[l]`, by one transpose tree (lanes
/// `i + (i+8)`, `+4`, `+2`, `+1`).
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn hsum16(v: &[std::arch::x86_64::__m512; 16]) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // Pairs: [a lo256 + a hi256 | b lo256 + b hi256].
    let mut u = [_mm512_setzero_ps(); 8];
    for (p, u) in u.iter_mut().enumerate() {
        let (x, y) = (v[2 * p], v[2 * p + 1]);
        *u = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y),
        );
    }
    // Quads: 128-bit lane q of w[r] holds v[4r + q]'s four partial sums.
    let mut w = [_mm512_setzero_ps(); 4];
    for (r, w) in w.iter_mut().enumerate() {
        let (x, y) = (u[2 * r], u[2 * r + 1]);
        *w = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
        );
    }
    let z0 = _mm512_add_ps(
        _mm512_shuffle_ps::<0x44>(w[0], w[1]),
        _mm512_shuffle_ps::<0xEE>(w[0], w[1]),
    );
    let z1 = _mm512_add_ps(
        _mm512_shuffle_ps::<0x44>(w[2], w[3]),
        _mm512_shuffle_ps::<0xEE>(w[2], w[3]),
    );
    // Lane 4q + t holds the sum of v[4t + q].
    let r = _mm512_add_ps(
        _mm512_shuffle_ps::<0x88>(z0, z1),
        _mm512_shuffle_ps::<0xDD>(z0, z1),
    );
    let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_ps(idx, r)
}

/// `exp(x)` lane-wise for `x <= 0` (underflows to 0 below -87.3): `x = n
/// ln 2 + r`, `|r| <= ln2 / 2`, a degree-7 Taylor polynomial in `r`, scaled
/// by `2^n`. Relative error below 2e-7.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn exp512(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let x = _mm512_max_ps(x, _mm512_set1_ps(-87.3));
    let n =
        _mm512_roundscale_ps::<0x08>(_mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)));
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_145_75), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428_606_8e-6), r);
    let mut p = _mm512_set1_ps(1.0 / 5040.0);
    for c in [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    _mm512_scalef_ps(p, n)
}

#[multiversion(targets("x86_64+avx2+fma", "x86_64+avx", "x86_64+sse4.1"))]
fn one_token(a: &PagedAttentionArgs<'_>, i: usize, o: &mut [f32]) {
    let (d, nkv) = (a.head_dim, a.n_kv);
    let t = a.positions.len();
    let g = a.n_heads / nkv;
    let scale = 1.0 / (d as f32).sqrt();
    let mut rows = Vec::new();
    let ctx = context_rows(a, i, &mut rows);
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

    /// Attention of `positions` (tokens of two sequences with scattered
    /// blocks) against a float64 dense reference.
    fn check(nh: usize, nkv: usize, d: usize, bs: usize, positions: &[u32], seed: u64) {
        let tables = vec![vec![5u32, 1, 7, 3, 9, 11, 2], vec![2u32, 0, 4, 6, 8]];
        let slots = 12 * bs;
        let mut s = seed;
        let mut r = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % 2001) as f32 / 1000.0 - 1.0
        };
        let kc: Vec<f32> = (0..slots * nkv * d).map(|_| 2.0 * r()).collect();
        let vc: Vec<f32> = (0..slots * nkv * d).map(|_| r()).collect();
        let token_seq: Vec<usize> = (0..positions.len()).map(|i| i % 2).collect();
        let t = positions.len();
        let q: Vec<f32> = (0..nh * t * d).map(|_| 2.0 * r()).collect();
        let out = paged_attention(PagedAttentionArgs {
            q: &q,
            k_cache: &kc,
            v_cache: &vc,
            n_heads: nh,
            n_kv: nkv,
            head_dim: d,
            block_size: bs,
            positions,
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
                        (got - want).abs() < 2e-5,
                        "d {d} g {} token {i} head {h} dim {x}: {got} vs {want}",
                        nh / nkv
                    );
                }
            }
        }
    }

    #[test]
    fn matches_f64_reference() {
        // Head size 12: the portable kernel everywhere.
        check(6, 2, 12, 3, &[7, 2, 4, 0], 12345);
    }

    /// Head sizes the AVX-512 path serves (where the CPU has it; the
    /// portable kernel otherwise), contexts across 16-key blocks, 1 to 7
    /// query heads per KV head.
    #[test]
    fn vector_path_matches_f64_reference() {
        for (nh, nkv, d) in [(2, 1, 16), (9, 3, 64), (4, 2, 128), (7, 1, 32), (14, 2, 64)] {
            check(nh, nkv, d, 16, &[0, 15, 16, 17, 40, 79], d as u64);
        }
    }

    /// A token's output is bit-identical alone and inside a batch.
    #[test]
    fn tokens_do_not_depend_on_the_batch() {
        let (nh, nkv, d, bs) = (6, 2, 64, 4);
        let tables = vec![vec![3u32, 0, 2, 1, 5, 4, 7, 6]];
        let n = 8 * bs * nkv * d;
        let kc: Vec<f32> = (0..n)
            .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
            .collect();
        let vc: Vec<f32> = (0..n)
            .map(|i| ((i * 53 % 97) as f32 / 48.0) - 1.0)
            .collect();
        let positions: Vec<u32> = (0..30).collect();
        let t = positions.len();
        let q: Vec<f32> = (0..nh * t * d)
            .map(|i| ((i * 29 % 89) as f32 / 44.0) - 1.0)
            .collect();
        let run = |pos: &[u32], q: &[f32]| {
            paged_attention(PagedAttentionArgs {
                q,
                k_cache: &kc,
                v_cache: &vc,
                n_heads: nh,
                n_kv: nkv,
                head_dim: d,
                block_size: bs,
                positions: pos,
                token_seq: &vec![0; pos.len()],
                tables: &tables,
            })
        };
        let all = run(&positions, &q);
        for i in [0usize, 17, 29] {
            let qi: Vec<f32> = (0..nh)
                .flat_map(|h| q[(h * t + i) * d..(h * t + i + 1) * d].to_vec())
                .collect();
            let one = run(&positions[i..=i], &qi);
            let got = &all[i * nh * d..(i + 1) * nh * d];
            assert!(
                got.iter()
                    .zip(&one)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "token {i}"
            );
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn exp512_is_accurate() {
        if !std::is_x86_feature_detected!("avx512f") {
            return;
        }
        let mut worst = 0f64;
        let mut x = -90.0f32;
        while x <= 0.0 {
            let xs = [x; 16];
            let mut out = [0f32; 16];
            // SAFETY: AVX-512F detected above.
            #[allow(unsafe_code)]
            unsafe {
                use std::arch::x86_64::*;
                _mm512_storeu_ps(out.as_mut_ptr(), exp512(_mm512_loadu_ps(xs.as_ptr())));
            }
            let want = (x as f64).exp();
            if x > -87.0 {
                worst = worst.max(((out[0] as f64 - want) / want).abs());
            } else {
                assert!(out[0] >= 0.0 && out[0] < 1e-37);
            }
            x += 0.0137;
        }
        assert!(worst < 3e-7, "max relative error {worst}");
    }
}
