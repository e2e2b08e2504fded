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
//! runs (`attend_group`): 16 keys' dot products at a time, their lanes
//! summed by one transpose tree; a polynomial `exp` (relative error below
//! 3e-7); the value sum with the output rows held in registers. It attends
//! tokens in groups that share a prefix of cache rows (a fork's children,
//! which share their parent's blocks; the tokens of one prefill chunk;
//! prompts served from the prefix cache): each shared key and value row is
//! read once per group instead of once per token. A chunk of rows is scored
//! (and weighed) for every KV head before the next chunk, so the cache is
//! read in address order, and the rows ahead are prefetched into L2 a few
//! at a time (the decode step's context is scattered blocks far larger than
//! the caches; without the prefetches, misses took half its attention
//! time). CPUs with AVX2 and FMA (no AVX-512) run the same plan on 8-lane
//! vectors (`attend_group8`). Elsewhere the portable kernel runs
//! (`multiversion`), a token at a time. Either way a token's
//! output depends only on its own query and context, never on the other
//! tokens of the batch or on how they are grouped (tested bit for bit).

use multiversion::multiversion;

#[cfg(target_arch = "x86_64")]
use crate::cpu::simd::{exp512, hsum16, max_f32};
use rayon::prelude::*;

/// An element type of the KV cache: `f32`, or `bf16` (half the bytes to
/// stream each step; every bf16 value is exact in f32, so attention over a
/// bf16 cache equals attention over the same values held as f32, bit for
/// bit).
pub trait KvElem: Copy + Send + Sync + std::fmt::Debug + sealed::Sealed + 'static {
    /// The value as f32 (exact).
    fn to_f32(self) -> f32;

    /// 16 consecutive values from `p` as f32 lanes. Inlined into the
    /// AVX-512 kernels (which enable the feature).
    ///
    /// # Safety
    /// The CPU supports AVX-512F; `p..p + 16` is readable.
    #[cfg(target_arch = "x86_64")]
    #[doc(hidden)]
    #[allow(unsafe_code)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;

    /// 8 consecutive values from `p` as f32 lanes, for the AVX2 kernel.
    ///
    /// # Safety
    /// The CPU supports AVX2; `p..p + 8` is readable.
    #[cfg(target_arch = "x86_64")]
    #[doc(hidden)]
    #[allow(unsafe_code)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
}

impl KvElem for f32 {
    fn to_f32(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }

    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
}

impl KvElem for half::bf16 {
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }

    /// The bits widened to 32 and shifted up: the exact f32 value.
    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    #[inline(always)]
    unsafe fn load16(p: *const half::bf16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let h = _mm256_loadu_si256(p as *const __m256i);
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }

    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    #[inline(always)]
    unsafe fn load8(p: *const half::bf16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let h = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }
}

/// Inputs of [`paged_attention`], over a KV cache of `E` (`f32` or `bf16`).
#[derive(Debug, Clone, Copy)]
pub struct PagedAttentionArgs<'a, E = f32> {
    /// Queries `[n_heads, t, head_dim]` (head-major, RoPE applied).
    pub q: &'a [f32],
    /// Key cache `[slots, n_kv, head_dim]`, holding every token's K already.
    pub k_cache: &'a [E],
    /// Value cache, same layout.
    pub v_cache: &'a [E],
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
///
/// # Panics
/// If `n_kv` is 0 or does not divide `n_heads`.
pub fn paged_attention<E: KvElem>(a: PagedAttentionArgs<'_, E>) -> Vec<f32> {
    assert!(
        a.n_kv > 0 && a.n_heads.is_multiple_of(a.n_kv),
        "paged_attention: {} query heads over {} KV heads",
        a.n_heads,
        a.n_kv
    );
    let t = a.positions.len();
    let d = a.head_dim;
    let mut out = vec![0f32; t * a.n_heads * d];
    #[cfg(target_arch = "x86_64")]
    if avx512_head_dim(d) {
        attend_shared(&a, &mut out, true);
        return out;
    }
    #[cfg(target_arch = "x86_64")]
    if avx2_head_dim(d) {
        attend_shared(&a, &mut out, false);
        return out;
    }
    out.par_chunks_mut(a.n_heads * d)
        .enumerate()
        .for_each(|(i, o)| one_token(&a, i, o));
    out
}

/// Whether the AVX-512 path serves head size `d` on this CPU.
#[cfg(target_arch = "x86_64")]
fn avx512_head_dim(d: usize) -> bool {
    matches!(d, 16 | 32 | 64 | 128 | 256) && std::is_x86_feature_detected!("avx512f")
}

/// Whether the AVX2 path serves head size `d` on this CPU.
#[cfg(target_arch = "x86_64")]
fn avx2_head_dim(d: usize) -> bool {
    matches!(d, 16 | 32 | 64 | 128 | 256) && crate::cpu::simd::avx2_fma()
}

/// Token `i`'s context length (`position + 1`), with the offset of every
/// context position's row in the caches written to `rows`.
fn context_rows<E>(a: &PagedAttentionArgs<'_, E>, i: usize, rows: &mut Vec<usize>) -> usize {
    let ctx = a.positions[i] as usize + 1;
    rows.clear();
    push_rows(a, i, 0..ctx, rows);
    ctx
}

/// Append the cache row offsets of token `i`'s context positions `js`.
fn push_rows<E>(
    a: &PagedAttentionArgs<'_, E>,
    i: usize,
    js: std::ops::Range<usize>,
    rows: &mut Vec<usize>,
) {
    let (bs, row) = (a.block_size, a.n_kv * a.head_dim);
    let table = &a.tables[a.token_seq[i]];
    rows.extend(js.map(|j| (table[j / bs] as usize * bs + j % bs) * row));
}

/// Most tokens attended together over one shared prefix.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const MAX_GROUP: usize = 8;

/// Rows of keys prefetched ahead of the ones being scored.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const PF_AHEAD: usize = 16;

/// One unit of work of `attend_shared`: `tokens` (sorted by position)
/// whose first `shared` context positions are the same cache rows, over KV
/// heads `kv`.
#[derive(Debug)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct Group {
    tokens: Vec<usize>,
    shared: usize,
    kv: std::ops::Range<usize>,
}

/// Split the batch into [`Group`]s: tokens whose block tables start with the
/// same physical block (a forked family's children, a prefill chunk's
/// tokens, prompts replayed from the prefix cache) are grouped, at most
/// [`MAX_GROUP`] to a group, and share the positions every one of them
/// reaches through identical table entries. With fewer groups than two per
/// thread, the work is split further for balance: with `tokens_first`, the
/// families into at least one chunk of tokens per thread between them
/// (whole rows of the cache stream in order, and a group's queries pair up
/// in the AVX2 kernel), and the KV heads across tasks only if that still
/// leaves a thread idle (a single sequence's decode step); otherwise into
/// smaller chunks with one KV head per task (the AVX-512 kernel's plan).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn plan_groups<E>(a: &PagedAttentionArgs<'_, E>, tokens_first: bool) -> Vec<Group> {
    let t = a.positions.len();
    let first = |i: usize| a.tables[a.token_seq[i]].first().copied();
    let mut order: Vec<usize> = (0..t).collect();
    order.sort_by_key(|&i| (first(i), a.token_seq[i], a.positions[i], i));
    let mut families: Vec<&[usize]> = Vec::new();
    let mut rest = &order[..];
    while let Some(&i) = rest.first() {
        let n = rest.iter().take_while(|&&j| first(j) == first(i)).count();
        families.push(&rest[..n]);
        rest = &rest[n..];
    }
    let threads = rayon::current_num_threads().max(1);
    let chunks_of = |len: usize| len.div_ceil(MAX_GROUP);
    let total: usize = families.iter().map(|f| chunks_of(f.len())).sum();
    // Chunks of a family of `len` tokens when at least `want` are wanted.
    let n_chunks = |len: usize, want: usize| chunks_of(len).max(want.min(len));
    // Chunks per family wanted (at least), and whether KV heads split.
    let (want, split_kv) = if total >= 2 * threads {
        (0, false)
    } else if tokens_first {
        let want = threads.div_ceil(families.len().max(1));
        let chunks: usize = families.iter().map(|f| n_chunks(f.len(), want)).sum();
        (want, chunks < threads && a.n_kv > 1)
    } else if a.n_kv > 1 {
        ((2 * threads).div_ceil(a.n_kv), true)
    } else {
        (0, false)
    };
    let kvs: Vec<std::ops::Range<usize>> = if split_kv {
        (0..a.n_kv).map(|h| h..h + 1).collect()
    } else {
        std::iter::once(0..a.n_kv).collect()
    };
    let mut groups = Vec::new();
    for fam in families {
        let size = fam.len().div_ceil(n_chunks(fam.len(), want));
        for toks in fam.chunks(size) {
            let table0 = &a.tables[a.token_seq[toks[0]]];
            let min_ctx = toks
                .iter()
                .map(|&i| a.positions[i] as usize + 1)
                .min()
                .unwrap_or(0);
            let mut blocks = 0;
            while blocks < min_ctx.div_ceil(a.block_size)
                && toks
                    .iter()
                    .all(|&i| a.tables[a.token_seq[i]].get(blocks) == table0.get(blocks))
            {
                blocks += 1;
            }
            let shared = min_ctx.min(blocks * a.block_size);
            for kv in &kvs {
                groups.push(Group {
                    tokens: toks.to_vec(),
                    shared,
                    kv: kv.clone(),
                });
            }
        }
    }
    groups
}

/// The vector paths: [`plan_groups`], each group attended by
/// [`attend_group`] (`avx512`) or [`attend_group8`] (AVX2) in parallel,
/// outputs scattered into `out`.
#[cfg(target_arch = "x86_64")]
fn attend_shared<E: KvElem>(a: &PagedAttentionArgs<'_, E>, out: &mut [f32], avx512: bool) {
    let groups = plan_groups(a, !avx512);
    let (hd, g) = (a.n_heads * a.head_dim, a.n_heads / a.n_kv);
    let parts: Vec<Vec<f32>> = (0..groups.len())
        .into_par_iter()
        .map(|x| {
            let grp = &groups[x];
            let w = grp.kv.len() * g * a.head_dim;
            let mut o = vec![0f32; grp.tokens.len() * w];
            // SAFETY: the CPU features and the head size were checked by
            // `avx512_head_dim` or `avx2_head_dim`; `o` holds `w` floats
            // per token.
            #[allow(unsafe_code)]
            unsafe {
                if avx512 {
                    attend_group_avx512(a, grp, groups.get(x + 1), &mut o);
                } else {
                    attend_group_avx2(a, grp, groups.get(x + 1), &mut o);
                }
            };
            o
        })
        .collect();
    for (grp, o) in groups.iter().zip(&parts) {
        let w = grp.kv.len() * g * a.head_dim;
        let at = grp.kv.start * g * a.head_dim;
        for (u, &i) in grp.tokens.iter().enumerate() {
            out[i * hd + at..i * hd + at + w].copy_from_slice(&o[u * w..(u + 1) * w]);
        }
    }
}

/// The rows a chunk of keys prefetches (keys ahead, its own values),
/// handed out a few at a time over the chunk's `score16` calls: issuing
/// them all at once filled the miss queues and stalled the dot products
/// (2x slower at 32 sequences x 128 tokens on a 2-core Zen 4).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct Spread<'r> {
    k: &'r [usize],
    v: &'r [usize],
    per_k: usize,
    per_v: usize,
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
impl<'r> Spread<'r> {
    fn new(k: &'r [usize], v: &'r [usize], calls: usize) -> Self {
        let calls = calls.max(1);
        Spread {
            k,
            v,
            per_k: k.len().div_ceil(calls),
            per_v: v.len().div_ceil(calls),
        }
    }

    /// The next call's share: (key rows, value rows).
    #[inline(always)]
    fn take(&mut self) -> (&'r [usize], &'r [usize]) {
        let (k, k_rest) = self.k.split_at(self.per_k.min(self.k.len()));
        let (v, v_rest) = self.v.split_at(self.per_v.min(self.v.len()));
        (self.k, self.v) = (k_rest, v_rest);
        (k, v)
    }
}

thread_local! {
    /// Per-thread scratch of `attend_group`: shared rows, per-token tail
    /// rows, scores.
    static SCRATCH: std::cell::RefCell<(Vec<usize>, Vec<usize>, Vec<f32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// Where a group's rows and scores lie, for kernels of `lanes`-wide
/// vectors: per token, its context length, its score stride (padded to
/// `lanes`), the range `toff[u]..toff[u + 1]` of its own (tail) rows and
/// the offset of its scores.
#[cfg(target_arch = "x86_64")]
struct GroupLayout {
    ctx: Vec<usize>,
    padded: Vec<usize>,
    toff: Vec<usize>,
    soff: Vec<usize>,
}

#[cfg(target_arch = "x86_64")]
impl GroupLayout {
    /// Fills `srows` with the shared rows' cache offsets and `trows` with
    /// every token's tail rows, zeroes `scores` to the layout's size, and
    /// checks every row lies inside the caches (the kernels' unchecked
    /// loads rely on it).
    fn new<E>(
        a: &PagedAttentionArgs<'_, E>,
        grp: &Group,
        lanes: usize,
        srows: &mut Vec<usize>,
        trows: &mut Vec<usize>,
        scores: &mut Vec<f32>,
    ) -> Self {
        let (toks, shared) = (&grp.tokens, grp.shared);
        let g = a.n_heads / a.n_kv;
        srows.clear();
        push_rows(a, toks[0], 0..shared, srows);
        let ctx: Vec<usize> = toks.iter().map(|&i| a.positions[i] as usize + 1).collect();
        let padded: Vec<usize> = ctx.iter().map(|c| c.div_ceil(lanes) * lanes).collect();
        trows.clear();
        let mut toff = Vec::with_capacity(toks.len() + 1);
        let mut soff = Vec::with_capacity(toks.len());
        let mut stot = 0;
        for (u, &i) in toks.iter().enumerate() {
            toff.push(trows.len());
            push_rows(a, i, shared..ctx[u], trows);
            soff.push(stot);
            stot += grp.kv.len() * g * padded[u];
        }
        toff.push(trows.len());
        let row = a.n_kv * a.head_dim;
        let last = srows.iter().chain(trows.iter()).copied().max().unwrap_or(0) + row;
        assert!(
            last <= a.k_cache.len() && last <= a.v_cache.len(),
            "paged attention: slot outside the cache"
        );
        assert!(a.q.len() >= a.n_heads * a.positions.len() * a.head_dim);
        assert!(ctx.iter().all(|&c| c >= shared));
        scores.clear();
        scores.resize(stot, 0.0);
        GroupLayout {
            ctx,
            padded,
            toff,
            soff,
        }
    }
}

/// `weigh(tokens, rows, j0)` over a group's value rows in runs of 32 (the
/// shared rows for every token, then each token's own; `j0` the run's first
/// context position), prefetching the next group's first keys (its first
/// token's) through `pf`, a few rows per run.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn weigh_in_runs<E>(
    a: &PagedAttentionArgs<'_, E>,
    grp: &Group,
    next: Option<&Group>,
    srows: &[usize],
    trows: &[usize],
    toff: &[usize],
    pf: impl Fn(&[usize]),
    weigh: impl Fn(std::ops::Range<usize>, &[usize], usize),
) {
    let mut next_rows = Vec::new();
    if let Some(nx) = next {
        let n = (a.positions[nx.tokens[0]] as usize + 1).min(PF_AHEAD + 16);
        push_rows(a, nx.tokens[0], 0..n, &mut next_rows);
    }
    let mut next_rows = &next_rows[..];
    let mut pf_next = |n: usize| {
        let (now, later) = next_rows.split_at(n.min(next_rows.len()));
        pf(now);
        next_rows = later;
    };
    let n_toks = grp.tokens.len();
    for (c, rs) in srows.chunks(32).enumerate() {
        pf_next(8);
        weigh(0..n_toks, rs, 32 * c);
    }
    for u in 0..n_toks {
        for (c, rs) in trows[toff[u]..toff[u + 1]].chunks(32).enumerate() {
            pf_next(8);
            weigh(u..u + 1, rs, grp.shared + 32 * c);
        }
    }
    pf_next(usize::MAX);
}

/// # Safety
/// The CPU must support AVX-512F; `a.head_dim` must be 16, 32, 64, 128 or
/// 256; `o` must hold `grp.kv.len() * g * head_dim` floats per token.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f")]
unsafe fn attend_group_avx512<E: KvElem>(
    a: &PagedAttentionArgs<'_, E>,
    grp: &Group,
    next: Option<&Group>,
    o: &mut [f32],
) {
    match a.head_dim / 16 {
        1 => attend_group::<E, 1>(a, grp, next, o),
        2 => attend_group::<E, 2>(a, grp, next, o),
        4 => attend_group::<E, 4>(a, grp, next, o),
        8 => attend_group::<E, 8>(a, grp, next, o),
        16 => attend_group::<E, 16>(a, grp, next, o),
        _ => unreachable!("head_dim checked by avx512_head_dim"),
    }
}

/// The vectorised kernel, for a group of tokens over a shared prefix: each
/// token's arithmetic is exactly [`one_token`]'s maths as a lone token would
/// do it (so outputs never depend on the grouping), but every shared key
/// and value row is read once per group, 16 keys (then 32 values) at a
/// time for all the group's tokens while they sit in L1, instead of once
/// per token.
///
/// Per token and query head: scores `q . k_j / sqrt(d)`, 16 keys' dot
/// products at a time with their lanes summed by one transpose tree (a
/// key's score does not depend on its neighbours); softmax with the
/// polynomial `exp` (relative error below 3e-7), partial sums in 16 lanes
/// from position 0; then `sum_j p_j v_j` in ascending `j`, the output rows
/// held in registers within a run of values and in `o` between runs (f32
/// stores and loads are exact). Each chunk of rows serves every KV head of
/// the group before the next chunk. `next` is the group this thread most
/// likely attends next (the following one in the plan): its first keys are
/// prefetched while this group weighs its values.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f")]
unsafe fn attend_group<E: KvElem, const DV: usize>(
    a: &PagedAttentionArgs<'_, E>,
    grp: &Group,
    next: Option<&Group>,
    o: &mut [f32],
) {
    use std::arch::x86_64::*;
    let (d, nkv) = (a.head_dim, a.n_kv);
    let t = a.positions.len();
    let g = a.n_heads / nkv;
    let toks = &grp.tokens;
    let shared = grp.shared;
    let w = grp.kv.len() * g * d;
    let scale = _mm512_set1_ps(1.0 / (d as f32).sqrt());
    let (mut srows, mut trows, mut scores) = SCRATCH.with(std::cell::RefCell::take);
    let GroupLayout {
        ctx,
        padded,
        toff,
        soff,
    } = GroupLayout::new(a, grp, 16, &mut srows, &mut trows, &mut scores);
    assert!(o.len() >= toks.len() * w);
    let kp = a.k_cache.as_ptr();
    let vp = a.v_cache.as_ptr();
    let sp = scores.as_mut_ptr();
    let ob = o.as_mut_ptr();
    let nk = grp.kv.len();
    // Head `r` of KV head `grp.kv.start + kk` of token `u`: its scores.
    let srow = |u: usize, kk: usize, r: usize| sp.add(soff[u] + (kk * g + r) * padded[u]);
    // Scores q . k * scale of the 16 keys at `kr` (one KV head's part of
    // each row), the first `n` stored from `dst`.
    let score16 = |q: &[__m512; DV], kr: &[*const E; 16], n: usize, dst: *mut f32| {
        // Always 16 dot products (a short chunk's pointers repeat its first
        // row, the store drops those lanes), so the loop unrolls and the 16
        // sums stay in registers instead of going through the stack.
        let mut dots = [_mm512_setzero_ps(); 16];
        for (l, dot) in dots.iter_mut().enumerate() {
            let kr = kr[l];
            let mut acc = _mm512_mul_ps(q[0], E::load16(kr));
            for (c, qv) in q.iter().enumerate().skip(1) {
                acc = _mm512_fmadd_ps(*qv, E::load16(kr.add(16 * c)), acc);
            }
            *dot = acc;
        }
        let s = _mm512_mul_ps(hsum16(&dots), scale);
        _mm512_mask_storeu_ps(dst, ((1u32 << n) - 1) as __mmask16, s);
    };
    let load_q = |u: usize, kvh: usize, r: usize| {
        let qp = a.q.as_ptr().add(((kvh * g + r) * t + toks[u]) * d);
        let mut q = [_mm512_setzero_ps(); DV];
        for (c, v) in q.iter_mut().enumerate() {
            *v = _mm512_loadu_ps(qp.add(16 * c));
        }
        q
    };
    // Software prefetch into L2 (the cache misses of the context's rows,
    // scattered blocks, otherwise stall the dot products: half of a decode
    // step's attention on a 2-core Zen 4): a chunk's value rows while its
    // keys are scored, the keys [`PF_AHEAD`] rows ahead, and the next
    // group's first keys while this group weighs its values. Only the group's
    // KV heads' part of a row.
    let bytes = grp.kv.len() * d * std::mem::size_of::<E>();
    let (pf_off, pf_lines) = (grp.kv.start * d, bytes.div_ceil(64));
    let pf = |base: *const E, rs: &[usize]| {
        for &r in rs {
            let p = base.wrapping_add(r + pf_off) as *const i8;
            for c in 0..pf_lines {
                _mm_prefetch::<_MM_HINT_T2>(p.wrapping_add(64 * c));
            }
        }
    };
    // Keys: the 16 rows `rows[c0..]` (context positions from `j0`) for the
    // tokens `us`, every KV head of a row before the next rows (a row's heads
    // are contiguous, so the cache is read in order), with the chunk's
    // prefetches spread over its calls.
    let score_chunk = |us: std::ops::Range<usize>, rows: &[usize], c0: usize, j0: usize| {
        let end = rows.len();
        let rs = &rows[c0..(c0 + 16).min(end)];
        let at = (c0 + PF_AHEAD).min(end);
        let mut spread = Spread::new(&rows[at..(at + 16).min(end)], rs, nk * g * us.len());
        let n = rs.len();
        for (kk, kvh) in grp.kv.clone().enumerate() {
            // The chunk's key rows of this KV head, once for all its queries.
            let kr: [*const E; 16] = std::array::from_fn(|l| {
                kp.add(*rs.get_unchecked(if l < n { l } else { 0 }) + kvh * d)
            });
            for u in us.clone() {
                for r in 0..g {
                    let (k_rows, v_rows) = spread.take();
                    pf(kp, k_rows);
                    pf(vp, v_rows);
                    score16(&load_q(u, kvh, r), &kr, n, srow(u, kk, r).add(j0));
                }
            }
        }
    };
    // Shared keys for every token of the group, then each token's own.
    for c0 in (0..shared).step_by(16) {
        score_chunk(0..toks.len(), &srows, c0, c0);
    }
    for u in 0..toks.len() {
        let tail = &trows[toff[u]..toff[u + 1]];
        for c0 in (0..tail.len()).step_by(16) {
            score_chunk(u..u + 1, tail, c0, shared + c0);
        }
    }
    // Softmax over each head's `ctx` scores.
    for (u, &n) in ctx.iter().enumerate() {
        for kr in 0..nk * g {
            let s = std::slice::from_raw_parts_mut(srow(u, kr / g, kr % g), n);
            let m = max_f32(s);
            let mv = _mm512_set1_ps(m);
            let mut z = _mm512_setzero_ps();
            let p = s.as_mut_ptr();
            for j0 in (0..n).step_by(16) {
                let mask = ((1u32 << (n - j0).min(16)) - 1) as __mmask16;
                let x = _mm512_maskz_loadu_ps(mask, p.add(j0));
                let e = _mm512_maskz_mov_ps(mask, exp512(_mm512_sub_ps(x, mv)));
                z = _mm512_add_ps(z, e);
                _mm512_mask_storeu_ps(p.add(j0), mask, e);
            }
            let inv = 1.0 / _mm512_reduce_add_ps(z);
            for x in s.iter_mut() {
                *x *= inv;
            }
        }
    }
    // o_r = sum_j p_rj v_j over the value rows `rs` (context positions from
    // `j0`) for the tokens `us`: heads in groups whose rows fit in
    // registers, accumulated in `o` across runs of values; every KV head of
    // a run of rows before the next run.
    let per = (24 / DV).clamp(1, 6);
    let weigh = |us: std::ops::Range<usize>, rs: &[usize], j0: usize| {
        let init = j0 == 0;
        for kk in 0..nk {
            let vh = vp.add((grp.kv.start + kk) * d);
            for u in us.clone() {
                for r0 in (0..g).step_by(per) {
                    let p = srow(u, kk, r0).add(j0) as *const f32;
                    let op = ob.add(u * w + (kk * g + r0) * d);
                    let ld = padded[u];
                    match per.min(g - r0) {
                        1 => weigh_values::<E, DV, 1>(rs, vh, p, ld, op, d, init),
                        2 => weigh_values::<E, DV, 2>(rs, vh, p, ld, op, d, init),
                        3 => weigh_values::<E, DV, 3>(rs, vh, p, ld, op, d, init),
                        4 => weigh_values::<E, DV, 4>(rs, vh, p, ld, op, d, init),
                        5 => weigh_values::<E, DV, 5>(rs, vh, p, ld, op, d, init),
                        _ => weigh_values::<E, DV, 6>(rs, vh, p, ld, op, d, init),
                    }
                }
            }
        }
    };
    weigh_in_runs(a, grp, next, &srows, &trows, &toff, |rs| pf(kp, rs), weigh);
    SCRATCH.with(|sc| sc.replace((srows, trows, scores)));
}

/// `o[r] = (init ? 0 : o[r]) + sum_j p[r * ld + j] v_j` for `G` heads
/// sharing the value rows `v + rows[j]` (`16 * DV` floats each), `j`
/// ascending; `o[r]` is `d` floats apart.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f")]
unsafe fn weigh_values<E: KvElem, const DV: usize, const G: usize>(
    rows: &[usize],
    v: *const E,
    p: *const f32,
    ld: usize,
    o: *mut f32,
    d: usize,
    init: bool,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); DV]; G];
    if !init {
        for (r, acc) in acc.iter_mut().enumerate() {
            for (c, x) in acc.iter_mut().enumerate() {
                *x = _mm512_loadu_ps(o.add(r * d + 16 * c));
            }
        }
    }
    for (j, &base) in rows.iter().enumerate() {
        let vr = v.add(base);
        let mut vv = [_mm512_setzero_ps(); DV];
        for (c, x) in vv.iter_mut().enumerate() {
            *x = E::load16(vr.add(16 * c));
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

/// # Safety
/// The CPU must support AVX2 and FMA; `a.head_dim` must be 16, 32, 64, 128
/// or 256; `o` must hold `grp.kv.len() * g * head_dim` floats per token.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_group_avx2<E: KvElem>(
    a: &PagedAttentionArgs<'_, E>,
    grp: &Group,
    next: Option<&Group>,
    o: &mut [f32],
) {
    match a.head_dim / 8 {
        2 => attend_group8::<E, 2>(a, grp, next, o),
        4 => attend_group8::<E, 4>(a, grp, next, o),
        8 => attend_group8::<E, 8>(a, grp, next, o),
        16 => attend_group8::<E, 16>(a, grp, next, o),
        32 => attend_group8::<E, 32>(a, grp, next, o),
        _ => unreachable!("head_dim checked by avx2_head_dim"),
    }
}

/// [`attend_group`] on AVX2 (`DV = head_dim / 8` vectors a row): the same
/// plan (shared rows read once per group, every KV head of a chunk of rows
/// before the next chunk, prefetches into L2). The queries on a KV head
/// (every head of its group, of every token sharing the rows) go two at a
/// time: 4 keys' dot products for both (each `q_0 k_0`, then FMAs over the
/// row's vectors in order), each key vector loaded once for the two, the 8
/// sums by `hsum8x8`'s fixed tree; an odd last query gets 8 keys alone.
/// Softmax with `exp256`, partial sums in 8 lanes from position 0; values
/// weighed in ascending `j`, 4 vectors of two queries' output rows at a
/// time in registers (8 of an odd last one's). A token's arithmetic is that
/// of the token alone, whatever its group or the query it is paired with.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_group8<E: KvElem, const DV: usize>(
    a: &PagedAttentionArgs<'_, E>,
    grp: &Group,
    next: Option<&Group>,
    o: &mut [f32],
) {
    use crate::cpu::simd::{exp256, first8, hsum8, hsum8x8, lanes8, max8_f32, store8};
    use std::arch::x86_64::*;
    let (d, nkv) = (a.head_dim, a.n_kv);
    let t = a.positions.len();
    let g = a.n_heads / nkv;
    let toks = &grp.tokens;
    let shared = grp.shared;
    let w = grp.kv.len() * g * d;
    let scale = _mm256_set1_ps(1.0 / (d as f32).sqrt());
    let (mut srows, mut trows, mut scores) = SCRATCH.with(std::cell::RefCell::take);
    let GroupLayout {
        ctx,
        padded,
        toff,
        soff,
    } = GroupLayout::new(a, grp, 8, &mut srows, &mut trows, &mut scores);
    assert!(o.len() >= toks.len() * w);
    let kp = a.k_cache.as_ptr();
    let vp = a.v_cache.as_ptr();
    let sp = scores.as_mut_ptr();
    let ob = o.as_mut_ptr();
    let nk = grp.kv.len();
    let srow = |u: usize, kk: usize, r: usize| sp.add(soff[u] + (kk * g + r) * padded[u]);
    // Each dot product is `q_0 k_0`, then FMAs over the row's vectors in
    // order, its lanes summed by `hsum8x8`'s tree, times `scale`, whatever
    // the call computing it.
    // Scores of the query at `qp` against the 8 keys at `kr` (8 chains).
    let score8 = |qp: *const f32, kr: &[*const E; 8]| -> __m256 {
        let mut dots = [_mm256_setzero_ps(); 8];
        let q0 = _mm256_loadu_ps(qp);
        for (l, dot) in dots.iter_mut().enumerate() {
            *dot = _mm256_mul_ps(q0, E::load8(kr[l]));
        }
        for c in 1..DV {
            let qv = _mm256_loadu_ps(qp.add(8 * c));
            for (l, dot) in dots.iter_mut().enumerate() {
                *dot = _mm256_fmadd_ps(qv, E::load8(kr[l].add(8 * c)), *dot);
            }
        }
        _mm256_mul_ps(hsum8x8(&dots), scale)
    };
    // Scores of two queries against 4 keys, lanes `[a k0..k3, b k0..k3]`:
    // each key vector is loaded once for both, and the 8 chains advance
    // together (one query's 8 chains in a row left too few independent
    // FMAs in the scheduler's window: the scoring ran at a quarter of the
    // FMA peak on a Zen 2).
    let score2x4 = |qa: *const f32, qb: *const f32, kr: [*const E; 4]| -> __m256 {
        let mut dots = [_mm256_setzero_ps(); 8];
        let (a0, b0) = (_mm256_loadu_ps(qa), _mm256_loadu_ps(qb));
        for l in 0..4 {
            let kv = E::load8(kr[l]);
            dots[l] = _mm256_mul_ps(a0, kv);
            dots[4 + l] = _mm256_mul_ps(b0, kv);
        }
        for c in 1..DV {
            let (av, bv) = (
                _mm256_loadu_ps(qa.add(8 * c)),
                _mm256_loadu_ps(qb.add(8 * c)),
            );
            for l in 0..4 {
                let kv = E::load8(kr[l].add(8 * c));
                dots[l] = _mm256_fmadd_ps(av, kv, dots[l]);
                dots[4 + l] = _mm256_fmadd_ps(bv, kv, dots[4 + l]);
            }
        }
        _mm256_mul_ps(hsum8x8(&dots), scale)
    };
    // The first `n` lanes of `s` from `dst`.
    let store_n =
        |s: __m256, n: usize, dst: *mut f32| store8(s, std::slice::from_raw_parts_mut(dst, n));
    let q_at = |u: usize, kvh: usize, r: usize| a.q.as_ptr().add(((kvh * g + r) * t + toks[u]) * d);
    let bytes = grp.kv.len() * d * std::mem::size_of::<E>();
    let (pf_off, pf_lines) = (grp.kv.start * d, bytes.div_ceil(64));
    let pf = |base: *const E, rs: &[usize]| {
        for &r in rs {
            let p = base.wrapping_add(r + pf_off) as *const i8;
            for c in 0..pf_lines {
                _mm_prefetch::<_MM_HINT_T2>(p.wrapping_add(64 * c));
            }
        }
    };
    // The queries of tokens `us` on one KV head, `(u, r)` in order, scored
    // two at a time (the last one alone when their count is odd).
    let score_chunk = |us: std::ops::Range<usize>, rows: &[usize], c0: usize, j0: usize| {
        let end = rows.len();
        let rs = &rows[c0..(c0 + 8).min(end)];
        let n = rs.len();
        let at = (c0 + PF_AHEAD).min(end);
        // One prefetch share per 4 keys of a pair and per lone query: `nq`
        // calls per KV head.
        let nq = us.len() * g;
        let mut spread = Spread::new(&rows[at..(at + 8).min(end)], rs, nk * nq);
        let mut take_pf = || {
            let (k_rows, v_rows) = spread.take();
            pf(kp, k_rows);
            pf(vp, v_rows);
        };
        for (kk, kvh) in grp.kv.clone().enumerate() {
            // Always 8 keys (a short chunk repeats its first row; only `n`
            // scores are stored).
            let kr: [*const E; 8] = std::array::from_fn(|l| {
                kp.add(*rs.get_unchecked(if l < n { l } else { 0 }) + kvh * d)
            });
            let query = |i: usize| {
                let (u, r) = (us.start + i / g, i % g);
                (q_at(u, kvh, r), srow(u, kk, r).add(j0))
            };
            let mut i = 0;
            while i + 2 <= nq {
                let ((qa, da), (qb, db)) = (query(i), query(i + 1));
                take_pf();
                let lo = score2x4(qa, qb, [kr[0], kr[1], kr[2], kr[3]]);
                take_pf();
                let hi = score2x4(qa, qb, [kr[4], kr[5], kr[6], kr[7]]);
                store_n(_mm256_permute2f128_ps::<0x20>(lo, hi), n, da);
                store_n(_mm256_permute2f128_ps::<0x31>(lo, hi), n, db);
                i += 2;
            }
            if i < nq {
                let (q, dst) = query(i);
                take_pf();
                store_n(score8(q, &kr), n, dst);
            }
        }
    };
    for c0 in (0..shared).step_by(8) {
        score_chunk(0..toks.len(), &srows, c0, c0);
    }
    for u in 0..toks.len() {
        let tail = &trows[toff[u]..toff[u + 1]];
        for c0 in (0..tail.len()).step_by(8) {
            score_chunk(u..u + 1, tail, c0, shared + c0);
        }
    }
    // Softmax over each head's `ctx` scores.
    for (u, &n) in ctx.iter().enumerate() {
        for kr in 0..nk * g {
            let s = std::slice::from_raw_parts_mut(srow(u, kr / g, kr % g), n);
            let mv = _mm256_set1_ps(max8_f32(s));
            let mut z = _mm256_setzero_ps();
            for c in s.chunks_mut(8) {
                // Lanes past the context add nothing.
                let e = first8(exp256(_mm256_sub_ps(lanes8(c), mv)), c.len());
                z = _mm256_add_ps(z, e);
                store8(e, c);
            }
            let inv = 1.0 / hsum8(z);
            for x in s.iter_mut() {
                *x *= inv;
            }
        }
    }
    // The values, for the queries of tokens `us` on each KV head two at a
    // time (`CB` vectors of both output rows in registers), the last one
    // alone (up to 8 vectors of its row) when their count is odd.
    let weigh = |us: std::ops::Range<usize>, rs: &[usize], j0: usize| {
        let init = j0 == 0;
        for kk in 0..nk {
            let vh = vp.add((grp.kv.start + kk) * d);
            let nq = us.len() * g;
            let query = |i: usize| {
                let (u, r) = (us.start + i / g, i % g);
                (
                    srow(u, kk, r).add(j0) as *const f32,
                    ob.add(u * w + (kk * g + r) * d),
                )
            };
            let mut i = 0;
            while i + 2 <= nq {
                let ((pa, oa), (pb, o_b)) = (query(i), query(i + 1));
                let (p, op) = ([pa, pb], [oa, o_b]);
                if DV >= 4 {
                    weigh_values8::<E, DV, 4, 2>(rs, vh, p, op, init);
                } else {
                    weigh_values8::<E, DV, 2, 2>(rs, vh, p, op, init);
                }
                i += 2;
            }
            if i < nq {
                let (p, op) = query(i);
                match DV {
                    2 => weigh_values8::<E, DV, 2, 1>(rs, vh, [p], [op], init),
                    4 => weigh_values8::<E, DV, 4, 1>(rs, vh, [p], [op], init),
                    _ => weigh_values8::<E, DV, 8, 1>(rs, vh, [p], [op], init),
                }
            }
        }
    };
    weigh_in_runs(a, grp, next, &srows, &trows, &toff, |rs| pf(kp, rs), weigh);
    SCRATCH.with(|sc| sc.replace((srows, trows, scores)));
}

/// `o[r] = (init ? 0 : o[r]) + sum_j p[r][j] v_j` for `G` output rows
/// sharing the value rows `v + rows[j]` (`8 * DV` floats each), `j`
/// ascending, `CB` vectors of each output row at a time.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
unsafe fn weigh_values8<E: KvElem, const DV: usize, const CB: usize, const G: usize>(
    rows: &[usize],
    v: *const E,
    p: [*const f32; G],
    o: [*mut f32; G],
    init: bool,
) {
    use std::arch::x86_64::*;
    for c0 in (0..DV).step_by(CB) {
        let mut acc = [[_mm256_setzero_ps(); CB]; G];
        if !init {
            for (r, acc) in acc.iter_mut().enumerate() {
                for (c, x) in acc.iter_mut().enumerate() {
                    *x = _mm256_loadu_ps(o[r].add(8 * (c0 + c)));
                }
            }
        }
        for (j, &base) in rows.iter().enumerate() {
            let vr = v.add(base + 8 * c0);
            let ws: [__m256; G] = std::array::from_fn(|r| _mm256_set1_ps(*p[r].add(j)));
            for c in 0..CB {
                let vv = E::load8(vr.add(8 * c));
                for (r, acc) in acc.iter_mut().enumerate() {
                    acc[c] = _mm256_fmadd_ps(ws[r], vv, acc[c]);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (c, x) in acc.iter().enumerate() {
                _mm256_storeu_ps(o[r].add(8 * (c0 + c)), *x);
            }
        }
    }
}

#[multiversion(targets("x86_64+avx2+fma", "x86_64+avx", "x86_64+sse4.1"))]
fn one_token<E: KvElem>(a: &PagedAttentionArgs<'_, E>, i: usize, o: &mut [f32]) {
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
                        acc[l] += q[c + l] * kr[c + l].to_f32();
                    }
                }
                for x in n8..d {
                    tail += q[x] * kr[x].to_f32();
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
                    *x += p * v.to_f32();
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
        let token_seq: Vec<usize> = (0..positions.len()).map(|i| i % 2).collect();
        check_tables(nh, nkv, d, bs, &tables, positions, &token_seq, seed);
    }

    /// Attention of tokens (`positions`, `token_seq`) over `tables` against
    /// a float64 dense reference, and bit for bit against each token alone;
    /// returns the batch's output.
    #[allow(clippy::too_many_arguments)]
    fn check_tables(
        nh: usize,
        nkv: usize,
        d: usize,
        bs: usize,
        tables: &[Vec<u32>],
        positions: &[u32],
        token_seq: &[usize],
        seed: u64,
    ) -> Vec<f32> {
        let slots = (tables.iter().flatten().copied().max().unwrap_or(0) as usize + 1) * bs;
        let mut s = seed;
        let mut r = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % 2001) as f32 / 1000.0 - 1.0
        };
        let kc: Vec<f32> = (0..slots * nkv * d).map(|_| 2.0 * r()).collect();
        let vc: Vec<f32> = (0..slots * nkv * d).map(|_| r()).collect();
        let t = positions.len();
        let q: Vec<f32> = (0..nh * t * d).map(|_| 2.0 * r()).collect();
        let base = PagedAttentionArgs {
            q: &q,
            k_cache: &kc,
            v_cache: &vc,
            n_heads: nh,
            n_kv: nkv,
            head_dim: d,
            block_size: bs,
            positions,
            token_seq,
            tables,
        };
        let out = paged_attention(base);
        check_against_reference(base, &out, &|b| paged_attention(b));
        // On a CPU with AVX-512, the AVX2 kernel as well (which a CPU
        // without it dispatches to).
        #[cfg(target_arch = "x86_64")]
        if avx512_head_dim(d) && avx2_head_dim(d) {
            let avx2 = |b: PagedAttentionArgs<'_>| {
                let mut o = vec![0f32; b.positions.len() * b.n_heads * b.head_dim];
                attend_shared(&b, &mut o, false);
                o
            };
            check_against_reference(base, &avx2(base), &avx2);
        }
        check_bf16_cache(base);
        out
    }

    /// `out`, attention of `a` by the kernel `run`, against a float64 dense
    /// reference, and each token's output bit for bit against `run` on that
    /// token alone.
    fn check_against_reference(
        a: PagedAttentionArgs<'_>,
        out: &[f32],
        run: &dyn Fn(PagedAttentionArgs<'_>) -> Vec<f32>,
    ) {
        let (q, kc, vc) = (a.q, a.k_cache, a.v_cache);
        let (nh, nkv, d, bs) = (a.n_heads, a.n_kv, a.head_dim, a.block_size);
        let (positions, token_seq, tables) = (a.positions, a.token_seq, a.tables);
        let t = positions.len();
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
            let tq = token_q(q, nh, t, d, i);
            let one = run(PagedAttentionArgs {
                q: &tq,
                positions: &positions[i..=i],
                token_seq: &token_seq[i..=i],
                ..a
            });
            assert!(
                same_bits(&out[i * nh * d..(i + 1) * nh * d], &one),
                "token {i} alone differs from the batch"
            );
        }
    }

    /// A bf16 cache gives bit for bit what an f32 cache of the same
    /// (rounded) values gives, in the dispatched kernel and in the portable
    /// one; `a` is the batch over an f32 cache.
    fn check_bf16_cache(a: PagedAttentionArgs<'_>) {
        use half::bf16;
        let kb: Vec<bf16> = a.k_cache.iter().map(|&x| bf16::from_f32(x)).collect();
        let vb: Vec<bf16> = a.v_cache.iter().map(|&x| bf16::from_f32(x)).collect();
        let kr: Vec<f32> = kb.iter().map(|x| x.to_f32()).collect();
        let vr: Vec<f32> = vb.iter().map(|x| x.to_f32()).collect();
        let (a16, a32) = (over(a, &kb, &vb), over(a, &kr, &vr));
        let want = paged_attention(a32);
        assert!(same_bits(&paged_attention(a16), &want), "bf16 cache");
        let w = a.n_heads * a.head_dim;
        for i in 0..a.positions.len() {
            let (mut o16, mut o32) = (vec![0f32; w], vec![0f32; w]);
            one_token(&a16, i, &mut o16);
            one_token(&a32, i, &mut o32);
            assert!(
                same_bits(&o16, &o32),
                "portable kernel, bf16 cache, token {i}"
            );
        }
    }

    /// The batch `a` over another cache (of `F`).
    fn over<'a, F>(
        a: PagedAttentionArgs<'a>,
        k_cache: &'a [F],
        v_cache: &'a [F],
    ) -> PagedAttentionArgs<'a, F> {
        PagedAttentionArgs {
            q: a.q,
            k_cache,
            v_cache,
            n_heads: a.n_heads,
            n_kv: a.n_kv,
            head_dim: a.head_dim,
            block_size: a.block_size,
            positions: a.positions,
            token_seq: a.token_seq,
            tables: a.tables,
        }
    }

    /// Token `i`'s queries out of `q: [nh, t, d]`, as a batch of one.
    fn token_q(q: &[f32], nh: usize, t: usize, d: usize, i: usize) -> Vec<f32> {
        (0..nh)
            .flat_map(|h| q[(h * t + i) * d..(h * t + i + 1) * d].to_vec())
            .collect()
    }

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    /// Arguments for planning only (no queries or caches): SmolLM2's 9
    /// query and 3 KV heads of size 64.
    fn plan_args<'a>(
        tables: &'a [Vec<u32>],
        positions: &'a [u32],
        token_seq: &'a [usize],
        block_size: usize,
    ) -> PagedAttentionArgs<'a, f32> {
        PagedAttentionArgs {
            q: &[],
            k_cache: &[],
            v_cache: &[],
            n_heads: 9,
            n_kv: 3,
            head_dim: 64,
            block_size,
            positions,
            token_seq,
            tables,
        }
    }

    /// A forked family: children sharing the parent's first blocks
    /// physically (one child only the first two), each with its own last
    /// block; one child in a prefill chunk of three tokens; an unrelated
    /// sequence. The group plan finds the shared prefixes, and every token
    /// matches the f64 reference and its lone computation bit for bit.
    #[test]
    fn forked_families_share_prefix_reads_exactly() {
        let bs = 4;
        let mut tables: Vec<Vec<u32>> = (0..6u32).map(|c| vec![4, 9, 1, 10 + c]).collect();
        tables.push(vec![4, 9, 20, 21]);
        tables.push(vec![0, 2]);
        // Children 0..6 decode at position 12..=14 (their own block), child 0
        // also has a chunk at 13 and 14; seq 6 diverges after 8 positions;
        // seq 7 is unrelated.
        let mut positions: Vec<u32> = (0..6).map(|c| 12 + c % 3).collect();
        let mut token_seq: Vec<usize> = (0..6).collect();
        positions.extend([13, 14, 10, 6]);
        token_seq.extend([0, 0, 6, 7]);
        let a = plan_args(&tables, &positions, &token_seq, bs);
        for tokens_first in [false, true] {
            let groups = plan_groups(&a, tokens_first);
            let fam = groups
                .iter()
                .find(|g| g.tokens.contains(&0))
                .expect("token 0 planned");
            let members: usize = groups
                .iter()
                .filter(|g| g.kv.start == 0 && g.tokens.iter().any(|&i| token_seq[i] < 7))
                .map(|g| g.tokens.len())
                .sum();
            assert_eq!(members, 9, "all children and seq 6 in the family");
            assert!(fam.shared >= 8, "shared prefix {}", fam.shared);
            for g in &groups {
                for &i in &g.tokens {
                    assert!(g.shared <= positions[i] as usize + 1);
                }
            }
        }
        for (nh, nkv, d) in [(9, 3, 64), (4, 2, 32), (3, 1, 16)] {
            check_tables(
                nh,
                nkv,
                d,
                bs,
                &tables,
                &positions,
                &token_seq,
                7 + d as u64,
            );
        }
    }

    /// How few tokens are split on 2 threads: a fork's 8 children into two
    /// chunks of 4 over every KV head (tokens first) or into chunks with one
    /// KV head each; a single token over its KV heads either way. Every
    /// token lands in exactly one group per KV head.
    #[test]
    fn few_tokens_split_for_two_threads() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("pool");
        let plan = |n: usize, tokens_first: bool| {
            let tables: Vec<Vec<u32>> = (0..n as u32).map(|c| vec![0, 1, 2 + c]).collect();
            let positions = vec![9u32; n];
            let token_seq: Vec<usize> = (0..n).collect();
            let a = plan_args(&tables, &positions, &token_seq, 4);
            let groups = pool.install(|| plan_groups(&a, tokens_first));
            for h in 0..3 {
                let mut seen: Vec<usize> = groups
                    .iter()
                    .filter(|g| g.kv.contains(&h))
                    .flat_map(|g| g.tokens.iter().copied())
                    .collect();
                seen.sort_unstable();
                assert_eq!(seen, (0..n).collect::<Vec<_>>(), "KV head {h}");
            }
            let shared = if n > 1 { 8 } else { 10 };
            assert!(groups.iter().all(|g| g.shared == shared));
            groups
                .iter()
                .map(|g| (g.tokens.len(), g.kv.len()))
                .collect::<Vec<_>>()
        };
        assert_eq!(plan(8, true), vec![(4, 3), (4, 3)]);
        assert_eq!(plan(8, false), vec![(4, 1); 6]);
        assert_eq!(plan(1, true), vec![(1, 1); 3]);
        assert_eq!(plan(1, false), vec![(1, 1); 3]);
    }

    #[test]
    fn matches_f64_reference() {
        // Head size 12: the portable kernel everywhere.
        check(6, 2, 12, 3, &[7, 2, 4, 0], 12345);
    }

    /// Head sizes the vector paths serve (AVX-512 or AVX2, whichever the
    /// CPU has; the portable kernel otherwise), contexts across 16-key blocks, 1 to 7
    /// query heads per KV head.
    #[test]
    fn vector_path_matches_f64_reference() {
        for (nh, nkv, d) in [
            (2, 1, 16),
            (9, 3, 64),
            (4, 2, 128),
            (7, 1, 32),
            (14, 2, 64),
            (4, 2, 256),
        ] {
            check(nh, nkv, d, 16, &[0, 15, 16, 17, 40, 79], d as u64);
        }
    }

    /// No tokens: no output, on every kernel (the AVX2 plan divided by the
    /// number of sequences).
    #[test]
    fn an_empty_batch_gives_nothing() {
        let tables: Vec<Vec<u32>> = Vec::new();
        for d in [12, 16, 64] {
            let a = PagedAttentionArgs {
                q: &[],
                k_cache: &[0f32; 4096],
                v_cache: &[0f32; 4096],
                n_heads: 4,
                n_kv: 2,
                head_dim: d,
                block_size: 4,
                positions: &[],
                token_seq: &[],
                tables: &tables,
            };
            assert!(paged_attention(a).is_empty());
            #[cfg(target_arch = "x86_64")]
            if avx2_head_dim(d) {
                attend_shared(&a, &mut [], false);
            }
        }
    }

    /// A prefill chunk of 30 tokens of one sequence (scattered blocks):
    /// every token matches the f64 reference, and its output is
    /// bit-identical alone and inside the batch.
    #[test]
    fn tokens_do_not_depend_on_the_batch() {
        let tables = vec![vec![3u32, 0, 2, 1, 5, 4, 7, 6]];
        let positions: Vec<u32> = (0..30).collect();
        check_tables(6, 2, 64, 4, &tables, &positions, &[0; 30], 5);
    }
}
