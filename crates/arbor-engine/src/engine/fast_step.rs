//! Steps that only decode, on the dedicated decode step
//! ([`crate::fast::FastDecoder`]) when the engine has one.

use rand::Rng;

use super::Engine;
use crate::fast::plan::DecodeRow;
use crate::paged::PagedBatch;
use crate::{EngineError, SeqId};

impl Engine {
    /// Runs this step on the dedicated decode step when it only decodes
    /// (one new token for each sequence, no fan-out, no top-k / top-p /
    /// min-p cuts) and fits it: writes the KV, samples on the device,
    /// records and stops as [`Engine::record_and_sample`] does. Returns
    /// whether it ran; a failed step leaves every sequence's RNG as it was.
    pub(super) fn fast_step(
        &mut self,
        batch: &PagedBatch,
        ids: &[u32],
        scheduled: &[SeqId],
    ) -> Result<bool, EngineError> {
        let Some(mut fast) = self.fast.take() else {
            return Ok(false);
        };
        let r = self.fast_step_with(&mut fast, batch, ids, scheduled);
        self.fast = Some(fast);
        r
    }

    fn fast_step_with(
        &mut self,
        fast: &mut crate::fast::FastDecoder,
        batch: &PagedBatch,
        ids: &[u32],
        scheduled: &[SeqId],
    ) -> Result<bool, EngineError> {
        let n = scheduled.len();
        let one_each = batch.len() == n && batch.token_seq.iter().enumerate().all(|(i, &s)| s == i);
        if !one_each || n > fast.max_rows() {
            return Ok(false);
        }
        if scheduled.iter().any(|id| {
            let s = &self.seqs[id];
            !s.fan_out.is_empty() || s.params.has_cuts()
        }) {
            return Ok(false);
        }
        // Each sequence's draw, as the host sampler would take it.
        let mut saved = Vec::with_capacity(n);
        let mut draws = Vec::with_capacity(n);
        for id in scheduled {
            let s = self.seqs.get_mut(id).expect("scheduled seq exists");
            saved.push(s.rng.clone());
            draws.push(if s.params.temperature == 0.0 {
                (0.0, 0.0)
            } else {
                (1.0 / s.params.temperature, s.rng.random::<f64>())
            });
        }
        let rows: Vec<DecodeRow<'_>> = (0..n)
            .map(|i| DecodeRow {
                token: ids[i],
                position: batch.positions[i],
                slot: batch.slots[i] as u32,
                table: &batch.tables[i],
                inv_temperature: draws[i].0,
                u: draws[i].1,
            })
            .collect();
        let sampled = match fast.step(&rows) {
            Ok(s) => s,
            Err(e) => {
                for (id, rng) in scheduled.iter().zip(saved) {
                    if let Some(s) = self.seqs.get_mut(id) {
                        s.rng = rng;
                    }
                }
                return Err(e.into());
            }
        };
        self.stats.steps += 1;
        self.stats.kv_rows_read += batch.positions.iter().map(|&p| p as u64 + 1).sum::<u64>();
        let todo = self.record(scheduled.to_vec())?;
        let work = self.take_seqs(&todo);
        let sampled = todo
            .iter()
            .map(|&(_, row)| sampled[row].map(|s| (s.token, s.logprob)))
            .collect();
        self.apply_samples(work, sampled);
        Ok(true)
    }
}
