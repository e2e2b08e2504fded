//! Paged attention over block tables equals the dense causal forward, for
//! several sequences packed in one batch, prefilled in chunks that attend to
//! their cached prefix.

use std::path::PathBuf;

use arbor_engine::paged::{
    DeviceKvCache, DevicePagedAttention, PagedAttention, PagedBatch, PagedKvCache,
};
use arbor_kv::KvManager;
use arbor_model::{LoadOptions, LoadedModel};
use candle_core::{DType, Tensor};

#[test]
#[allow(clippy::needless_range_loop)]
fn paged_chunks_equal_dense_hidden_states() {
    for name in ["qwen2", "qwen3", "llama"] {
        let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../arbor-model/tests/fixtures")
            .join(name);
        let m = LoadedModel::load(
            p.to_str().unwrap(),
            &LoadOptions {
                dtype: DType::F64,
                ..Default::default()
            },
        )
        .unwrap()
        .model;
        let seqs: Vec<Vec<u32>> = vec![(3..26).collect(), (100..111).collect(), vec![7, 7, 7]];
        let bs = 4;
        let mut kv = KvManager::new(32, bs);
        let mut cache = PagedKvCache::new(&m.cfg, 32, bs);
        let dcache = DeviceKvCache::new(&m.cfg, 32, bs, DType::F64, m.device()).unwrap();
        // Reserve every sequence; compute them in two packed chunks.
        let allocs: Vec<_> = seqs
            .iter()
            .enumerate()
            .map(|(i, s)| kv.allocate(i as u64, s).unwrap())
            .collect();
        let mut got: Vec<Vec<f64>> = vec![Vec::new(); seqs.len()];
        let split: Vec<usize> = seqs.iter().map(|s| s.len() / 2 + 1).collect();
        for chunk in 0..2 {
            let mut batch = PagedBatch::default();
            let mut ids = Vec::new();
            let mut owner = Vec::new();
            for (i, s) in seqs.iter().enumerate() {
                let (lo, hi) = if chunk == 0 {
                    (0, split[i])
                } else {
                    (split[i], s.len())
                };
                batch
                    .tables
                    .push(kv.block_table(i as u64).unwrap().to_vec());
                for pos in lo..hi {
                    batch.slots.push(allocs[i].slots[pos]);
                    batch.positions.push(pos as u32);
                    batch.token_seq.push(i);
                    ids.push(s[pos]);
                    owner.push(i);
                }
            }
            let n = ids.len();
            let input = Tensor::from_vec(ids, (1, n), m.device()).unwrap();
            let positions = batch.positions.clone();
            let h = m
                .forward_with(
                    &input,
                    &positions,
                    &mut PagedAttention {
                        cache: &mut cache,
                        batch: &batch,
                    },
                )
                .unwrap();
            // The tensor backend (the GPU engine's path, here on the CPU)
            // gives the same hidden states.
            let hd = m
                .forward_with(
                    &input,
                    &positions,
                    &mut DevicePagedAttention::new(&dcache, &batch).unwrap(),
                )
                .unwrap();
            let diff = (&h - &hd).unwrap().abs().unwrap().max_all().unwrap();
            assert!(
                diff.to_scalar::<f64>().unwrap() < 1e-9,
                "{name}: device backend differs"
            );
            // The GPU step's forward, inputs on the device and RoPE from
            // the device table: the same computation.
            let dev = m.device();
            let ho = m
                .forward_on_device(
                    &input.flatten_all().unwrap(),
                    &Tensor::new(positions.as_slice(), dev).unwrap(),
                    &mut DevicePagedAttention::new(&dcache, &batch).unwrap(),
                )
                .unwrap();
            let diff = (&h - &ho).unwrap().abs().unwrap().max_all().unwrap();
            assert!(
                diff.to_scalar::<f64>().unwrap() < 1e-12,
                "{name}: forward_on_device differs"
            );
            let rows: Vec<Vec<f64>> = h.squeeze(0).unwrap().to_vec2().unwrap();
            for (r, &i) in rows.into_iter().zip(&owner) {
                got[i].extend(r);
            }
        }
        for (i, s) in seqs.iter().enumerate() {
            let ids = Tensor::from_vec(s.clone(), (1, s.len()), m.device()).unwrap();
            let want: Vec<f64> = m
                .forward_hidden(&ids)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let d = want
                .iter()
                .zip(&got[i])
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            // The paged kernel accumulates in f32; the dense f64 forward does not.
            assert!(d < 1e-4, "{name} seq {i}: max |dh| = {d:e}");
        }
    }
}

/// A copy-on-write naming a block outside the pool, or more slots than a
/// block holds, is an error on both caches (on a GPU the slot write would
/// skip it silently), and a valid one copies.
#[test]
fn copies_outside_the_pool_are_refused() {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../arbor-model/tests/fixtures/qwen2");
    let m = LoadedModel::load(p.to_str().unwrap(), &LoadOptions::default())
        .unwrap()
        .model;
    let mut host = PagedKvCache::new(&m.cfg, 4, 8);
    let device = DeviceKvCache::new(&m.cfg, 4, 8, DType::F32, m.device()).unwrap();
    let op = |src, dst, len| arbor_kv::CopyOp { src, dst, len };
    for bad in [op(0, 4, 3), op(4, 0, 3), op(0, 1, 9)] {
        let e = host.copy(&bad).unwrap_err().to_string();
        assert!(e.contains("the cache has 4 blocks of 8"), "{e}");
        let e = device.copy(&bad).unwrap_err().to_string();
        assert!(e.contains("the cache has 4 blocks of 8"), "{e}");
    }
    host.copy(&op(0, 3, 8)).unwrap();
    device.copy(&op(0, 3, 8)).unwrap();
}
