//! Paged attention and KV-cache writes on tensors, for any device: the CPU
//! path runs [`crate::paged_attention`] (the slice kernel the engine uses),
//! the CUDA path `kernels/paged_attention.cu` (bf16/f16/f32 storage, f32
//! accumulation), reading the same block tables.
//!
//! Shapes: `q: [t, n_heads, d]` (RoPE applied), caches `[slots, n_kv, d]`
//! with slot `table[j / B] * B + j % B` holding position `j` of a sequence,
//! output `[t, n_heads, d]`. New token `i` attends to positions
//! `0..=positions[i]` of sequence `token_seq[i]`.

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp3, DType, Device, InplaceOp3, Layout, Result, Shape, Tensor,
};

/// Block-table metadata of one step, on the compute device. Built only by
/// [`PagedMeta::new`], which checks every position against its table: the
/// CUDA kernel reads the tables unchecked, relying on it.
#[derive(Debug, Clone)]
pub struct PagedMeta {
    /// `[t]` u32: position of each new token.
    positions: Tensor,
    /// `[t]` u32: row of `tables` for each new token.
    token_seq: Tensor,
    /// `[S, max_blocks]` u32 block tables, padded with 0.
    tables: Tensor,
    block_size: usize,
    /// Largest block id in `tables` (checked against the cache size).
    max_block: u32,
}

impl PagedMeta {
    pub fn new(
        positions: &[u32],
        token_seq: &[usize],
        tables: &[Vec<u32>],
        block_size: usize,
        dev: &Device,
    ) -> Result<Self> {
        let t = positions.len();
        let packed = PackedTables::new(positions, token_seq, tables, block_size)?;
        let seq: Vec<u32> = token_seq.iter().map(|&s| s as u32).collect();
        Ok(PagedMeta {
            positions: Tensor::from_slice(positions, t, dev)?,
            token_seq: Tensor::from_vec(seq, t, dev)?,
            tables: Tensor::from_vec(packed.flat, (packed.rows, packed.max_blocks), dev)?,
            block_size,
            max_block: packed.max_block,
        })
    }

    /// Metadata already on the device, as [`PackedTables`] laid it out
    /// (parts of one upload, say): `positions, token_seq: [t]` u32 and
    /// `tables: [rows, max_blocks]` u32 with the values `packed` checked.
    pub fn from_device(
        positions: Tensor,
        token_seq: Tensor,
        tables: Tensor,
        packed: &PackedTables,
        block_size: usize,
    ) -> Result<Self> {
        let t = positions.dims1()?;
        if token_seq.dims1()? != t || tables.dims2()? != (packed.rows, packed.max_blocks) {
            candle_core::bail!(
                "PagedMeta: {t} positions, {:?} sequence ids and tables {:?} do not match \
                 the packed tables [{}, {}]",
                token_seq.dims(),
                tables.dims(),
                packed.rows,
                packed.max_blocks
            );
        }
        Ok(PagedMeta {
            positions,
            token_seq,
            tables,
            block_size,
            max_block: packed.max_block,
        })
    }
}

/// Block tables of one step checked against its tokens and packed as the
/// kernels read them: `[rows, max_blocks]` u32, row-major, padded with 0.
#[derive(Debug, Clone)]
pub struct PackedTables {
    pub flat: Vec<u32>,
    pub rows: usize,
    pub max_blocks: usize,
    /// Largest block id (checked against the cache by the attention op).
    pub max_block: u32,
}

impl PackedTables {
    /// Checks that every token's sequence has a table that reaches its
    /// position, then packs the tables.
    pub fn new(
        positions: &[u32],
        token_seq: &[usize],
        tables: &[Vec<u32>],
        block_size: usize,
    ) -> Result<Self> {
        let t = positions.len();
        if token_seq.len() != t {
            candle_core::bail!(
                "PagedMeta: {t} positions but {} sequence ids",
                token_seq.len()
            );
        }
        let maxb = tables.iter().map(Vec::len).max().unwrap_or(0).max(1);
        for (i, (&p, &s)) in positions.iter().zip(token_seq).enumerate() {
            let Some(tab) = tables.get(s) else {
                candle_core::bail!(
                    "PagedMeta: token {i} names sequence {s} of {}",
                    tables.len()
                );
            };
            if (p as usize) / block_size >= tab.len() {
                candle_core::bail!(
                    "PagedMeta: token {i} at position {p} needs block {} but its table has {}",
                    p as usize / block_size,
                    tab.len()
                );
            }
        }
        let rows = tables.len().max(1);
        let mut flat = vec![0u32; rows * maxb];
        for (s, tab) in tables.iter().enumerate() {
            flat[s * maxb..s * maxb + tab.len()].copy_from_slice(tab);
        }
        Ok(PackedTables {
            flat,
            rows,
            max_blocks: maxb,
            max_block: tables.iter().flatten().copied().max().unwrap_or(0),
        })
    }
}

/// Attention of the step's new tokens over the paged caches (which must
/// already hold the new tokens' K/V, see [`cache_write`]).
pub fn paged_attention_op(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    meta: &PagedMeta,
) -> Result<Tensor> {
    let (t, nh, d) = q.dims3()?;
    let (_, nkv, d2) = k_cache.dims3()?;
    if d != d2 || k_cache.dims() != v_cache.dims() || nkv == 0 || nh % nkv != 0 {
        candle_core::bail!(
            "paged_attention: q {:?}, k cache {:?}, v cache {:?} do not fit",
            q.dims(),
            k_cache.dims(),
            v_cache.dims()
        );
    }
    if d > 256 {
        candle_core::bail!("paged_attention: head_dim {d} > 256 is not supported");
    }
    if meta.positions.dims1()? != t {
        candle_core::bail!(
            "paged_attention: {t} queries but {} positions",
            meta.positions.dims1()?
        );
    }
    let blocks = k_cache.dim(0)? / meta.block_size.max(1);
    if meta.max_block as usize >= blocks {
        candle_core::bail!(
            "paged_attention: block {} in the tables, the cache has {blocks} blocks of {}",
            meta.max_block,
            meta.block_size
        );
    }
    if t == 0 {
        return Tensor::zeros((0, nh, d), q.dtype(), q.device());
    }
    q.contiguous()?
        .apply_op3_no_bwd(k_cache, v_cache, &PagedAttn { meta: meta.clone() })
}

/// Write `rows: [t, n_kv, d]` into `cache: [slots, n_kv, d]` at `slots: [t]` (u32), in place.
pub fn cache_write(cache: &Tensor, rows: &Tensor, slots: &Tensor) -> Result<()> {
    let (t, nkv, d) = rows.dims3()?;
    let (_, nkv2, d2) = cache.dims3()?;
    if nkv != nkv2 || d != d2 || slots.dims() != [t] || slots.dtype() != DType::U32 {
        candle_core::bail!(
            "cache_write: rows {:?} / slots {:?} do not fit cache {:?}",
            rows.dims(),
            slots.dims(),
            cache.dims()
        );
    }
    if !cache.is_contiguous() {
        candle_core::bail!("cache_write: the cache must be contiguous");
    }
    // Slots are bounds-checked by the op: an error on the CPU; on CUDA the
    // kernel skips them (reading the slots back would sync every layer), so
    // callers check on the host, as `DevicePagedAttention::new` does.
    if t == 0 {
        return Ok(());
    }
    cache.inplace_op3(
        &rows.to_dtype(cache.dtype())?.contiguous()?,
        &slots.contiguous()?,
        &CacheWrite,
    )
}

#[derive(Debug, Clone)]
struct PagedAttn {
    meta: PagedMeta,
}

#[derive(Debug, Clone, Copy)]
struct CacheWrite;

fn f32s(s: &CpuStorage, l: &Layout) -> Result<Vec<f32>> {
    let c = s.to_dtype(l, DType::F32)?;
    match c {
        CpuStorage::F32(v) => Ok(v),
        _ => unreachable!("to_dtype(F32) gives F32"),
    }
}

impl CustomOp3 for PagedAttn {
    fn name(&self) -> &'static str {
        "arbor-paged-attention"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (t, nh, d) = ql.shape().dims3()?;
        let nkv = kl.shape().dims()[1];
        let q = f32s(qs, ql)?;
        // [t, nh, d] -> [nh, t, d] for the slice kernel.
        let mut qh = vec![0f32; q.len()];
        for i in 0..t {
            for h in 0..nh {
                qh[(h * t + i) * d..(h * t + i + 1) * d]
                    .copy_from_slice(&q[(i * nh + h) * d..(i * nh + h + 1) * d]);
            }
        }
        let (kc, vc) = (f32s(ks, kl)?, f32s(vs, vl)?);
        let positions = self.meta.positions.to_vec1::<u32>()?;
        let token_seq: Vec<usize> = self
            .meta
            .token_seq
            .to_vec1::<u32>()?
            .into_iter()
            .map(|s| s as usize)
            .collect();
        let tables = self.meta.tables.to_vec2::<u32>()?;
        let out = crate::paged_attention(crate::PagedAttentionArgs {
            q: &qh,
            k_cache: &kc,
            v_cache: &vc,
            n_heads: nh,
            n_kv: nkv,
            head_dim: d,
            block_size: self.meta.block_size,
            positions: &positions,
            token_seq: &token_seq,
            tables: &tables,
        });
        let n = out.len();
        let out = CpuStorage::F32(out).to_dtype(&Layout::contiguous(n), qs.dtype())?;
        Ok((out, Shape::from((t, nh, d))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qs: &candle_core::CudaStorage,
        ql: &Layout,
        ks: &candle_core::CudaStorage,
        kl: &Layout,
        vs: &candle_core::CudaStorage,
        vl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::{self, PushKernelArg, WrapErr};
        use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
        use candle_core::Storage;
        let dev = qs.device.clone();
        let (t, nh, d) = ql.shape().dims3()?;
        let nkv = kl.shape().dims()[1];
        let dt = qs.dtype();
        if ks.dtype() != dt || vs.dtype() != dt {
            candle_core::bail!(
                "paged_attention: q is {dt:?} but the caches are {:?}",
                ks.dtype()
            );
        }
        let f = cuda::Kernel::get(
            &dev,
            "paged_attention",
            &format!("paged_attention_{}", cuda::suffix(dt)?),
        )?;
        let (ps, pl) = self.meta.positions.storage_and_layout();
        let (ss, sl) = self.meta.token_seq.storage_and_layout();
        let (ts, tl) = self.meta.tables.storage_and_layout();
        let (Storage::Cuda(ps), Storage::Cuda(ss), Storage::Cuda(ts)) = (&*ps, &*ss, &*ts) else {
            candle_core::bail!("paged_attention: block tables must be on the same CUDA device");
        };
        let (pv, sv, tv) = (
            cuda::view::<u32>(ps, pl)?,
            cuda::view::<u32>(ss, sl)?,
            cuda::view::<u32>(ts, tl)?,
        );
        let maxb = tl.shape().dims()[1] as i32;
        let (nhi, nkvi, di, bsi) = (nh as i32, nkv as i32, d as i32, self.meta.block_size as i32);
        let scale = 1.0f32 / (d as f32).sqrt();
        let warps = 4u32;
        let cfg = LaunchConfig {
            grid_dim: (t as u32, nh as u32, 1),
            block_dim: (32 * warps, 1, 1),
            shared_mem_bytes: warps * d as u32 * 4,
        };
        macro_rules! go {
            ($ty:ty) => {{
                let qv = cuda::view::<$ty>(qs, ql)?;
                let kvw = cuda::view::<$ty>(ks, kl)?;
                let vvw = cuda::view::<$ty>(vs, vl)?;
                let mut out = cuda::alloc_out::<$ty>(&dev, t * nh * d)?;
                let mut b = f.builder();
                b.arg(&qv)
                    .arg(&kvw)
                    .arg(&vvw)
                    .arg(&pv)
                    .arg(&sv)
                    .arg(&tv)
                    .arg(&mut out);
                b.arg(&nhi)
                    .arg(&nkvi)
                    .arg(&di)
                    .arg(&bsi)
                    .arg(&maxb)
                    .arg(&scale);
                // SAFETY: matches `paged_attention_*` in kernels/paged_attention.cu;
                // tables were bounds-checked against positions in PagedMeta::new.
                #[allow(unsafe_code)]
                unsafe { b.launch(cfg) }.w()?;
                cuda::wrap(out, &dev)
            }};
        }
        // q, k and v share `dt` (checked above).
        let out = match dt {
            DType::F32 => go!(f32),
            DType::BF16 => go!(::half::bf16),
            DType::F16 => go!(::half::f16),
            _ => candle_core::bail!("paged_attention: unsupported CUDA dtype {dt:?}"),
        };
        Ok((out, Shape::from((t, nh, d))))
    }
}

impl InplaceOp3 for CacheWrite {
    fn name(&self) -> &'static str {
        "arbor-cache-write"
    }

    fn cpu_fwd(
        &self,
        cache: &mut CpuStorage,
        cl: &Layout,
        rows: &CpuStorage,
        rl: &Layout,
        slots: &CpuStorage,
        sl: &Layout,
    ) -> Result<()> {
        let (t, nkv, d) = rl.shape().dims3()?;
        let row = nkv * d;
        let n_slots = cl.shape().dims()[0];
        let slots = match slots {
            CpuStorage::U32(s) => &s[sl.start_offset()..sl.start_offset() + t],
            _ => candle_core::bail!("cache_write: slots must be u32"),
        };
        if let Some(&bad) = slots.iter().find(|&&s| s as usize >= n_slots) {
            candle_core::bail!("cache_write: slot {bad} outside the cache ({n_slots} slots)");
        }
        macro_rules! copy {
            ($c:expr, $r:expr) => {{
                let (c, r) = ($c, $r);
                let (c0, r0) = (cl.start_offset(), rl.start_offset());
                for (i, &s) in slots.iter().enumerate() {
                    let dst = c0 + s as usize * row;
                    c[dst..dst + row].copy_from_slice(&r[r0 + i * row..r0 + (i + 1) * row]);
                }
            }};
        }
        match (cache, rows) {
            (CpuStorage::F32(c), CpuStorage::F32(r)) => copy!(c, r),
            (CpuStorage::F64(c), CpuStorage::F64(r)) => copy!(c, r),
            (CpuStorage::BF16(c), CpuStorage::BF16(r)) => copy!(c, r),
            (CpuStorage::F16(c), CpuStorage::F16(r)) => copy!(c, r),
            _ => candle_core::bail!("cache_write: cache and rows differ in dtype"),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        cache: &mut candle_core::CudaStorage,
        cl: &Layout,
        rows: &candle_core::CudaStorage,
        rl: &Layout,
        slots: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> Result<()> {
        use crate::cuda::{self, PushKernelArg, WrapErr};
        use candle_core::cuda_backend::CudaStorageSlice as S;
        let dev = cache.device.clone();
        let (t, nkv, d) = rl.shape().dims3()?;
        let (ti, row) = (t as i32, (nkv * d) as i32);
        let n_slots = cl.shape().dims()[0] as u32;
        let f = cuda::Kernel::get(
            &dev,
            "paged_attention",
            &format!("cache_write_{}", cuda::suffix(rows.dtype())?),
        )?;
        let sv = cuda::view::<u32>(slots, sl)?;
        let c0 = cl.start_offset();
        let r0 = rl.start_offset();
        let n = t * nkv * d;
        macro_rules! go {
            ($c:expr, $r:expr) => {{
                let rv = $r.slice(r0..r0 + n);
                let mut cv = $c.slice_mut(c0..);
                let mut b = f.builder();
                b.arg(&rv)
                    .arg(&mut cv)
                    .arg(&sv)
                    .arg(&ti)
                    .arg(&row)
                    .arg(&n_slots);
                // SAFETY: matches `cache_write_*` in kernels/paged_attention.cu,
                // which skips slots past the cache.
                #[allow(unsafe_code)]
                unsafe { b.launch(cuda::grid1d(n, 256)) }.w()?;
            }};
        }
        match (&mut cache.slice, &rows.slice) {
            (S::F32(c), S::F32(r)) => go!(c, r),
            (S::BF16(c), S::BF16(r)) => go!(c, r),
            (S::F16(c), S::F16(r)) => go!(c, r),
            _ => candle_core::bail!("cache_write: cache and rows differ in dtype"),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// Float64 brute force attention over explicitly gathered rows.
    #[test]
    fn paged_attention_op_matches_f64_brute_force() -> Result<()> {
        let mut rng = StdRng::seed_from_u64(9);
        let (nh, nkv, d, bs) = (4, 2, 8, 4);
        let n_blocks = 12;
        let slots = n_blocks * bs;
        let dev = Device::Cpu;
        let k = Tensor::zeros((slots, nkv, d), DType::F32, &dev)?;
        let v = Tensor::zeros((slots, nkv, d), DType::F32, &dev)?;
        // Two sequences with shuffled blocks; lengths 7 and 10.
        let tables = vec![vec![5u32, 1], vec![9u32, 3, 7]];
        let lens = [7usize, 10];
        let mut kv_rows: Vec<Vec<(Vec<f64>, Vec<f64>)>> = vec![];
        for (s, &len) in lens.iter().enumerate() {
            let mut rows = vec![];
            let mut slot_ids = vec![];
            let mut kr = vec![];
            let mut vr = vec![];
            for j in 0..len {
                let kk: Vec<f64> = (0..nkv * d).map(|_| rng.random_range(-1.0..1.0)).collect();
                let vv: Vec<f64> = (0..nkv * d).map(|_| rng.random_range(-1.0..1.0)).collect();
                slot_ids.push(tables[s][j / bs] * bs as u32 + (j % bs) as u32);
                kr.extend(kk.iter().map(|&x| x as f32));
                vr.extend(vv.iter().map(|&x| x as f32));
                rows.push((kk, vv));
            }
            let st = Tensor::new(slot_ids.as_slice(), &dev)?;
            cache_write(&k, &Tensor::from_vec(kr, (len, nkv, d), &dev)?, &st)?;
            cache_write(&v, &Tensor::from_vec(vr, (len, nkv, d), &dev)?, &st)?;
            kv_rows.push(rows);
        }
        // Queries: the last two positions of seq 0, one of seq 1.
        let qs: Vec<(usize, usize)> = vec![(0, 5), (0, 6), (1, 9)];
        let q: Vec<f64> = (0..qs.len() * nh * d)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let meta = PagedMeta::new(
            &qs.iter().map(|&(_, p)| p as u32).collect::<Vec<_>>(),
            &qs.iter().map(|&(s, _)| s).collect::<Vec<_>>(),
            &tables,
            bs,
            &dev,
        )?;
        let qt = Tensor::from_vec(
            q.iter().map(|&x| x as f32).collect::<Vec<_>>(),
            (qs.len(), nh, d),
            &dev,
        )?;
        let got = paged_attention_op(&qt, &k, &v, &meta)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        for (i, &(s, p)) in qs.iter().enumerate() {
            for h in 0..nh {
                let g = h / (nh / nkv);
                let qh = &q[(i * nh + h) * d..(i * nh + h + 1) * d];
                let scores: Vec<f64> = (0..=p)
                    .map(|j| {
                        let kk = &kv_rows[s][j].0[g * d..(g + 1) * d];
                        qh.iter().zip(kk).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().map(|x| (x - m).exp()).sum();
                for e in 0..d {
                    let want: f64 = (0..=p)
                        .map(|j| (scores[j] - m).exp() / z * kv_rows[s][j].1[g * d + e])
                        .sum();
                    let gv = got[(i * nh + h) * d + e] as f64;
                    assert!(
                        (gv - want).abs() < 1e-5,
                        "token {i} head {h} dim {e}: {gv} vs {want}"
                    );
                }
            }
        }
        Ok(())
    }

    #[test]
    fn bad_tables_and_slots_are_errors() -> Result<()> {
        let dev = Device::Cpu;
        let e = PagedMeta::new(&[8], &[0], &[vec![0u32, 1]], 4, &dev)
            .unwrap_err()
            .to_string();
        assert!(e.contains("needs block 2"), "{e}");
        let cache = Tensor::zeros((4, 1, 2), DType::F32, &dev)?;
        let rows = Tensor::ones((1, 1, 2), DType::F32, &dev)?;
        let e = cache_write(&cache, &rows, &Tensor::new(&[4u32], &dev)?)
            .unwrap_err()
            .to_string();
        assert!(e.contains("outside the cache"), "{e}");
        // A table naming a block past the cache (4 slots = 2 blocks of 2).
        let meta = PagedMeta::new(&[0], &[0], &[vec![2u32]], 2, &dev)?;
        let q = Tensor::ones((1, 1, 2), DType::F32, &dev)?;
        let e = paged_attention_op(&q, &cache, &cache, &meta)
            .unwrap_err()
            .to_string();
        assert!(e.contains("block 2"), "{e}");
        Ok(())
    }
}
