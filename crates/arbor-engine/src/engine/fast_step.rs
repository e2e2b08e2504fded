//! Steps on the dedicated GPU step ([`crate::fast::FastDecoder`]) when the
//! engine has one: decode steps replay a captured graph, prefills and
//! fan-outs run the same fused kernels directly.

use rand::rngs::StdRng;
use rand::SeedableRng;

use arbor_ops::{SampleRequest, Sampled};

use super::sample::device_draw as draw;
use super::Engine;
use crate::fast::plan::{table_width, StepIn, StepShape};
use crate::paged::PagedBatch;
use crate::{EngineError, SeqId};

/// What computes a fused step: its KV written, its samples drawn.
trait StepRunner {
    /// Whether a step of this shape fits the runner's buffers.
    fn fits(&self, shape: &StepShape) -> bool;
    fn run(
        &mut self,
        engine: &mut Engine,
        step: &StepIn<'_>,
    ) -> Result<Vec<Option<Sampled>>, EngineError>;
}

#[cfg(feature = "cuda")]
impl StepRunner for crate::fast::FastDecoder {
    fn fits(&self, shape: &StepShape) -> bool {
        crate::fast::FastDecoder::fits(self, shape)
    }

    fn run(
        &mut self,
        _: &mut Engine,
        step: &StepIn<'_>,
    ) -> Result<Vec<Option<Sampled>>, EngineError> {
        Ok(self.step(step)?)
    }
}

impl Engine {
    /// Runs this step on the dedicated decode step when no sequence it
    /// samples has top-k / top-p / min-p cuts and it fits the step's
    /// buffers: writes the KV, samples on the device (a fan-out's samples
    /// each from their own seed), then records and stops as
    /// [`Engine::record_and_sample`] does. Returns whether it ran; a failed
    /// step leaves every sequence's RNG as it was.
    #[cfg(feature = "cuda")]
    pub(super) fn fast_step(
        &mut self,
        batch: &PagedBatch,
        ids: &[u32],
        scheduled: &[SeqId],
    ) -> Result<bool, EngineError> {
        let Some(mut fast) = self.fast.take() else {
            return Ok(false);
        };
        let r = self.fused_step(batch, ids, scheduled, &mut fast);
        self.fast = Some(fast);
        r
    }

    /// [`Engine::fast_step`]'s logic around a step runner.
    fn fused_step(
        &mut self,
        batch: &PagedBatch,
        ids: &[u32],
        scheduled: &[SeqId],
        runner: &mut dyn StepRunner,
    ) -> Result<bool, EngineError> {
        let cut = scheduled.iter().any(|id| {
            let s = &self.seqs[id];
            s.fan_out.is_empty() && s.params.has_cuts()
                || s.fan_out.iter().any(|(_, p)| p.has_cuts())
        });
        let samples_len: usize = scheduled
            .iter()
            .map(|id| self.seqs[id].fan_out.len().max(1))
            .sum();
        let shape = StepShape {
            tokens: batch.len(),
            seqs: scheduled.len(),
            samples: samples_len,
            table_width: table_width(batch.tables.iter().map(Vec::len).max().unwrap_or(1)),
        };
        if cut || !runner.fits(&shape) {
            return Ok(false);
        }
        // Every sample, in the order `record` lists them: a sequence's own,
        // or its fan-out's children's.
        let mut saved = Vec::new();
        let mut samples = Vec::with_capacity(samples_len);
        for (row, id) in scheduled.iter().enumerate() {
            let s = self.seqs.get_mut(id).expect("scheduled seq exists");
            let mut push = |(inv_temperature, u): (f32, f64)| {
                samples.push(SampleRequest {
                    row: row as u32,
                    inv_temperature,
                    u,
                });
            };
            if s.fan_out.is_empty() {
                saved.push((*id, s.rng.clone()));
                push(draw(&s.params, &mut s.rng));
            } else {
                // A child's RNG starts from its seed when it is spawned
                // (in `record`), and then takes this same first draw.
                for (_, p) in &s.fan_out {
                    push(draw(p, &mut StdRng::seed_from_u64(p.seed)));
                }
            }
        }
        let last = batch.last_tokens(scheduled.len());
        let slots: Vec<u32> = batch.slots.iter().map(|&s| s as u32).collect();
        let token_seq: Vec<u32> = batch.token_seq.iter().map(|&q| q as u32).collect();
        let tables: Vec<&[u32]> = batch.tables.iter().map(Vec::as_slice).collect();
        let step = StepIn {
            tokens: ids,
            positions: &batch.positions,
            slots: &slots,
            token_seq: &token_seq,
            tables: &tables,
            last: &last,
            samples: &samples,
        };
        let sampled = match runner.run(self, &step) {
            Ok(s) => s,
            Err(e) => {
                for (id, rng) in saved {
                    if let Some(s) = self.seqs.get_mut(&id) {
                        s.rng = rng;
                    }
                }
                return Err(e);
            }
        };
        let todo = self.record(scheduled.to_vec())?;
        self.count_step(batch);
        // Children spawned by `record` take the draw their sample used.
        let own: std::collections::HashSet<SeqId> = saved.iter().map(|(id, _)| *id).collect();
        for (id, _) in &todo {
            if !own.contains(id) {
                if let Some(c) = self.seqs.get_mut(id) {
                    let _ = draw(&c.params, &mut c.rng);
                }
            }
        }
        let work = self.take_seqs(&todo);
        let sampled = sampled
            .into_iter()
            .map(|s| s.map(|s| (s.token, s.logprob)))
            .collect();
        self.apply_samples(work, sampled);
        Ok(true)
    }
}

/// The candle forward and `arbor_ops::sample_rows` as a fused step's
/// runner: the dedicated step's engine logic, checked on the CPU.
#[cfg(test)]
struct CpuRunner<'a> {
    batch: &'a PagedBatch,
    ids: &'a [u32],
}

#[cfg(test)]
impl StepRunner for CpuRunner<'_> {
    fn fits(&self, _: &StepShape) -> bool {
        true
    }

    fn run(
        &mut self,
        engine: &mut Engine,
        step: &StepIn<'_>,
    ) -> Result<Vec<Option<Sampled>>, EngineError> {
        let logits = engine.forward_logits(self.batch, self.ids.to_vec(), step.tables.len())?;
        Ok(arbor_ops::sample_rows(&logits, step.samples)?)
    }
}

#[cfg(test)]
impl Engine {
    /// [`Engine::fused_step`] with [`CpuRunner`].
    pub(super) fn fused_step_on_cpu(
        &mut self,
        batch: &PagedBatch,
        ids: &[u32],
        scheduled: &[SeqId],
    ) -> Result<bool, EngineError> {
        self.fused_step(batch, ids, scheduled, &mut CpuRunner { batch, ids })
    }
}
