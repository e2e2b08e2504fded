//! The model step: one packed forward over every new token of a step,
//! through the paged KV cache (host slices or device tensors), and the
//! logits of each scheduled sequence's last new token.
//!
//! On a GPU a step's inputs go up in one copy (`arbor_ops::GpuCut::Upload`):
//! one u32 buffer holding, for `n` new tokens of `S` sequences,
//! `[ids: n | positions: n | slots: n | token_seq: n | rows: S | tables:
//! R x max_blocks]`, each part a view of it; everything is checked on the
//! host first, and nothing is read back until the sampled tokens.

use arbor_ops::GpuCut;
use candle_core::{DType, Device, Tensor};

use super::{Engine, KvStore};
use crate::paged::{DevicePagedAttention, PagedAttention, PagedBatch};
use crate::EngineError;

impl Engine {
    /// `[n_seqs, vocab]` f32 logits of the last new token of each of the
    /// `n_seqs` sequences of `batch` (token ids `ids`), in order: on the CPU
    /// the product's own buffer (no copy); a device's stay there.
    pub(super) fn forward_logits(
        &mut self,
        batch: &PagedBatch,
        ids: Vec<u32>,
        n_seqs: usize,
    ) -> Result<Tensor, EngineError> {
        #[cfg(test)]
        if std::mem::take(&mut self.fail_next_forward) {
            return Err(EngineError::InvalidRequest(
                "injected forward failure".into(),
            ));
        }
        let n_tokens = batch.len();
        let dev = self.model.device().clone();
        let rows = batch.last_tokens(n_seqs);
        // RoPE from the device table needs every position inside it.
        let in_table = batch
            .positions
            .iter()
            .all(|&p| (p as usize) < self.model.cfg.max_position_embeddings);
        let device_inputs = self.device_inputs(&dev) && in_table;
        // The hidden states `[1, n, H]` and the index of
        // each sequence's last token.
        let (hidden, rows) = match &mut self.cache {
            KvStore::Host(cache) => {
                let input = Tensor::from_vec(ids, (1, n_tokens), &dev)?;
                let mut backend = PagedAttention { cache, batch };
                let hidden = self
                    .model
                    .forward_with(&input, &batch.positions, &mut backend)?;
                (hidden, Tensor::from_vec(rows, n_seqs, &dev)?)
            }
            KvStore::Device(cache) if device_inputs && GpuCut::Upload.on() => {
                let packed = arbor_ops::PackedTables::new(
                    &batch.positions,
                    &batch.token_seq,
                    &batch.tables,
                    cache.block_size(),
                )?;
                let n = n_tokens;
                let mut buf = Vec::with_capacity(4 * n + n_seqs + packed.flat.len());
                buf.extend_from_slice(&ids);
                buf.extend_from_slice(&batch.positions);
                buf.extend(batch.slots.iter().map(|&s| s as u32));
                buf.extend(batch.token_seq.iter().map(|&s| s as u32));
                buf.extend_from_slice(&rows);
                buf.extend_from_slice(&packed.flat);
                let all = Tensor::from_vec(buf, 4 * n + n_seqs + packed.flat.len(), &dev)?;
                let part = |at: usize, len: usize| all.narrow(0, at, len);
                let meta = arbor_ops::PagedMeta::from_device(
                    part(n, n)?,
                    part(3 * n, n)?,
                    part(4 * n + n_seqs, packed.flat.len())?
                        .reshape((packed.rows, packed.max_blocks))?,
                    &packed,
                    cache.block_size(),
                )?;
                let mut backend =
                    DevicePagedAttention::from_parts(cache, batch, meta, part(2 * n, n)?)?;
                let hidden =
                    self.model
                        .forward_on_device(&part(0, n)?, &part(n, n)?, &mut backend)?;
                (hidden, part(4 * n, n_seqs)?)
            }
            KvStore::Device(cache) => {
                let mut backend = DevicePagedAttention::new(cache, batch)?;
                let hidden = if device_inputs && GpuCut::Sync.on() {
                    // Ids were checked at submission (and sampled ones are
                    // in the vocabulary): none is read back.
                    let input = Tensor::from_vec(ids, n_tokens, &dev)?;
                    let positions = Tensor::from_slice(&batch.positions, n_tokens, &dev)?;
                    self.model
                        .forward_on_device(&input, &positions, &mut backend)?
                } else {
                    let input = Tensor::from_vec(ids, (1, n_tokens), &dev)?;
                    self.model
                        .forward_with(&input, &batch.positions, &mut backend)?
                };
                (hidden, Tensor::from_vec(rows, n_seqs, &dev)?)
            }
        };
        let h = hidden.squeeze(0)?.index_select(&rows, 0)?;
        Ok(self.model.lm_head_logits(&h)?.to_dtype(DType::F32)?)
    }

    /// Whether a step's inputs are built for a device (a GPU; on the CPU,
    /// only when a test asks, since the CPU forward has its own row path).
    pub(super) fn device_inputs(&self, dev: &Device) -> bool {
        #[cfg(test)]
        if self.device_path_on_cpu {
            return true;
        }
        !dev.is_cpu()
    }
}
