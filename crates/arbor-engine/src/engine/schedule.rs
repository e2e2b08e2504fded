//! The scheduler: which sequences a step computes, and the KV slots their
//! new tokens go to. Running sequences first (preempting the most recently
//! admitted when blocks run out), then waiting ones while blocks, sequence
//! slots and the token budget allow.

use arbor_kv::Allocation;

use super::{Engine, FinishReason, KvStore};
use crate::paged::PagedBatch;
use crate::{EngineError, SeqId};

/// One step's work: the packed batch (slots, positions, block tables), its
/// token ids, and the sequences it computes, in batch order.
#[derive(Debug, Default)]
pub(super) struct StepPlan {
    pub(super) batch: PagedBatch,
    pub(super) ids: Vec<u32>,
    pub(super) scheduled: Vec<SeqId>,
}

impl Engine {
    /// Reserve this step's KV slots and lay out its batch; `None` when no
    /// sequence can run.
    pub(super) fn plan_step(&mut self) -> Result<Option<StepPlan>, EngineError> {
        let mut batch = PagedBatch::default();
        let mut ids: Vec<u32> = Vec::new();
        let mut scheduled: Vec<SeqId> = Vec::new();
        let mut budget = self.cfg.max_batch_tokens;

        // 1. Running sequences: reserve slots for their uncomputed tokens,
        //    preempting the most recently admitted ones when blocks run out.
        //    At most `max_seqs` a step: a wide fan-out (`fork`, `n` samples)
        //    can leave more running, and the rest wait, KV kept, for a later
        //    step.
        let mut i = 0;
        while i < self.running.len() && scheduled.len() < self.cfg.max_seqs {
            let id = self.running[i];
            let need = self.seqs[&id].tokens.len() - self.seqs[&id].computed;
            let mut preempted_self = false;
            while !self.kv.can_append(id, need)? {
                let victim = *self.running.last().expect("non-empty");
                if victim != id {
                    self.preempt(victim);
                } else if i > 0 {
                    // Sequences admitted earlier hold the blocks: wait for them.
                    self.preempt(id);
                    preempted_self = true;
                    break;
                } else {
                    break;
                }
            }
            if preempted_self {
                break;
            }
            if !self.kv.can_append(id, need)? {
                // Alone and still no room: this sequence cannot be served.
                let len = self.seqs[&id].tokens.len();
                self.finish(
                    id,
                    FinishReason::Error,
                    None,
                    Some(format!(
                        "KV pool too small: {len} tokens need {} blocks of {}, the pool has {}",
                        len.div_ceil(self.cfg.block_size),
                        self.cfg.block_size,
                        self.kv.pool().num_blocks()
                    )),
                );
                continue;
            }
            let alloc = self.kv.append(id, need)?;
            self.schedule(id, alloc, &mut batch, &mut ids)?;
            scheduled.push(id);
            budget = budget.saturating_sub(need);
            i += 1;
        }

        // 2. Admit waiting sequences while blocks, slots and budget allow.
        //    A sequence whose next cacheable block another admission
        //    computes in this step is passed over, keeping its place: next
        //    step it takes that block from the cache (forks of a sequence
        //    not yet computed, a group of equal prompts sent one by one).
        let mut admitted: Vec<SeqId> = Vec::new();
        let mut k = 0;
        while let Some(&id) = self.waiting.get(k) {
            if self.running.len() >= self.cfg.max_seqs {
                break;
            }
            let s = &self.seqs[&id];
            let (fresh, ok) = self.kv.blocks_needed(&s.tokens);
            let total = self.kv.pool().num_blocks();
            if s.tokens.len().div_ceil(self.cfg.block_size) > total {
                self.waiting.remove(k);
                let msg = format!(
                    "KV pool too small: {} tokens need {} blocks of {}, the pool has {total}",
                    s.tokens.len(),
                    s.tokens.len().div_ceil(self.cfg.block_size),
                    self.cfg.block_size
                );
                self.finish(id, FinishReason::Error, None, Some(msg));
                continue;
            }
            if !ok {
                break;
            }
            let hits = s.tokens.len().div_ceil(self.cfg.block_size) - fresh;
            if self.computes_next_block_of(&admitted, &s.tokens, hits) {
                k += 1;
                continue;
            }
            let work = (fresh * self.cfg.block_size).min(s.tokens.len());
            if work > budget && !scheduled.is_empty() {
                break;
            }
            self.waiting.remove(k);
            let alloc = self.kv.allocate(id, &self.seqs[&id].tokens)?;
            let s = self.seqs.get_mut(&id).expect("waiting seq exists");
            s.computed = alloc.cached_tokens;
            s.has_kv = true;
            if s.computed > 0 {
                let cached = s.computed.min(s.prompt_len) as u64;
                self.stats.prefill_cached += cached;
            }
            budget = budget.saturating_sub(alloc.slots.len());
            self.running.push(id);
            self.schedule(id, alloc, &mut batch, &mut ids)?;
            scheduled.push(id);
            admitted.push(id);
        }

        if scheduled.is_empty() {
            return Ok(None);
        }
        Ok(Some(StepPlan {
            batch,
            ids,
            scheduled,
        }))
    }

    /// Whether a sequence in `admitted` (this step's admissions, computed
    /// in this step's forward and committed to the prefix cache after it)
    /// computes the cacheable block after the first `hits` full blocks of
    /// `tokens`, with the same tokens before it: then `tokens` gains at
    /// least one more block from the cache by being admitted a step later.
    fn computes_next_block_of(&self, admitted: &[SeqId], tokens: &[u32], hits: usize) -> bool {
        let bs = self.cfg.block_size;
        // Never the block holding the last token (its logits are computed).
        if hits >= tokens.len().saturating_sub(1) / bs {
            return false;
        }
        let (head, next) = (hits * bs, (hits + 1) * bs);
        admitted.iter().any(|o| {
            let t = &self.seqs[o].tokens;
            t.len() >= next && t[head..next] == tokens[head..next] && t[..head] == tokens[..head]
        })
    }

    fn schedule(
        &mut self,
        id: SeqId,
        alloc: Allocation,
        batch: &mut PagedBatch,
        ids: &mut Vec<u32>,
    ) -> Result<(), EngineError> {
        for c in &alloc.copies {
            match &mut self.cache {
                KvStore::Host(cache) => cache.copy(c)?,
                KvStore::Device(cache) => cache.copy(c)?,
            }
            self.stats.cow_copies += 1;
        }
        let k = batch.tables.len();
        batch.tables.push(
            self.kv
                .block_table(id)
                .expect("scheduled seq has a table")
                .to_vec(),
        );
        let s = &self.seqs[&id];
        let start = s.computed;
        for (j, slot) in alloc.slots.into_iter().enumerate() {
            let pos = start + j;
            batch.slots.push(slot);
            batch.positions.push(pos as u32);
            batch.token_seq.push(k);
            ids.push(s.tokens[pos]);
        }
        Ok(())
    }
}
