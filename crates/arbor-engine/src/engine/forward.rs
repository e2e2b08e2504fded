//! The model step: one packed forward over every new token of a step,
//! through the paged KV cache (host slices or device tensors), and the
//! logits of each scheduled sequence's last new token.

use candle_core::{DType, Tensor};

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
        let input = Tensor::from_vec(ids, (1, n_tokens), &dev)?;
        let positions = batch.positions.clone();
        let hidden = match &mut self.cache {
            KvStore::Host(cache) => {
                let mut backend = PagedAttention { cache, batch };
                self.model.forward_with(&input, &positions, &mut backend)?
            }
            KvStore::Device(cache) => {
                let mut backend = DevicePagedAttention::new(cache, batch)?;
                self.model.forward_with(&input, &positions, &mut backend)?
            }
        };
        // Last new token of each scheduled sequence (tokens are laid out
        // sequence after sequence).
        let n = n_seqs;
        let mut rows = vec![0u32; n];
        for (i, &k) in batch.token_seq.iter().enumerate() {
            rows[k] = i as u32;
        }
        let rows_t = Tensor::from_vec(rows, n, &dev)?;
        let h = hidden.squeeze(0)?.index_select(&rows_t, 0)?;
        Ok(self.model.lm_head_logits(&h)?.to_dtype(DType::F32)?)
    }
}
