//! After the forward: record each sequence's computed KV, sample its next
//! token (or fan a computed prompt out into its samples), and stop the
//! sequences that are done.

use rand::Rng;
use rayon::prelude::*;

use super::{Engine, FinishReason, Seq};
use crate::sampling::sample;
use crate::{EngineError, SeqId};

/// A sequence's sample on the device: `1 / T` (0 for greedy) and, when
/// tempered, its uniform draw from `rng`, the draw [`sample`] takes on the
/// host.
pub(super) fn device_draw(p: &crate::SamplingParams, rng: &mut rand::rngs::StdRng) -> (f32, f64) {
    if p.temperature == 0.0 {
        (0.0, 0.0)
    } else {
        (1.0 / p.temperature, rng.random::<f64>())
    }
}

/// The samples of `work` (sequence, its logits row) from device `logits`:
/// rows without cuts by [`arbor_ops::sample_rows`], the others copied to
/// the host at once and sampled there in parallel.
fn sample_where(
    work: &mut [(SeqId, Seq, usize)],
    logits: &candle_core::Tensor,
) -> Result<Vec<Option<(u32, f32)>>, EngineError> {
    let mut sampled = vec![None; work.len()];
    let (mut reqs, mut at, mut host) = (Vec::new(), Vec::new(), Vec::new());
    for (i, (_, s, row)) in work.iter_mut().enumerate() {
        if s.params.has_cuts() {
            host.push(i);
            continue;
        }
        let (inv_temperature, u) = device_draw(&s.params, &mut s.rng);
        reqs.push(arbor_ops::SampleRequest {
            row: *row as u32,
            inv_temperature,
            u,
        });
        at.push(i);
    }
    if !reqs.is_empty() {
        for (i, r) in at.into_iter().zip(arbor_ops::sample_rows(logits, &reqs)?) {
            sampled[i] = r.map(|r| (r.token, r.logprob));
        }
    }
    if !host.is_empty() {
        let rows: Vec<u32> = host.iter().map(|&i| work[i].2 as u32).collect();
        let rows = candle_core::Tensor::new(rows.as_slice(), logits.device())?;
        let l = logits.index_select(&rows, 0)?.to_vec2::<f32>()?;
        let mut row_of: Vec<Option<&[f32]>> = vec![None; work.len()];
        for (&i, row) in host.iter().zip(&l) {
            row_of[i] = Some(row);
        }
        let got: Vec<(usize, Option<(u32, f32)>)> = work
            .par_iter_mut()
            .enumerate()
            .filter_map(|(i, (_, s, _))| row_of[i].map(|l| (i, sample(l, &s.params, &mut s.rng))))
            .collect();
        for (i, g) in got {
            sampled[i] = g;
        }
    }
    Ok(sampled)
}

/// Bytes of text decoded before the part searched for stop strings
/// (`Engine::stop_string_hit`).
const STOP_WINDOW_MARGIN: usize = 16;

impl Engine {
    /// Step 4 on the host: record, sample, fan out, stop. `logits` holds one
    /// row per scheduled sequence, in order.
    pub(super) fn record_and_sample(
        &mut self,
        scheduled: Vec<SeqId>,
        logits: &[f32],
    ) -> Result<(), EngineError> {
        let vocab = logits.len() / scheduled.len().max(1);
        let todo = self.record(scheduled)?;
        // Sample in parallel: each sequence has its own RNG.
        let mut work = self.take_seqs(&todo);
        let sampled: Vec<Option<(u32, f32)>> = work
            .par_iter_mut()
            .map(|(_, s, row)| sample(&logits[*row * vocab..][..vocab], &s.params, &mut s.rng))
            .collect();
        self.apply_samples(work, sampled);
        Ok(())
    }

    /// Step 4 with the logits on a device: the tokens of sequences without
    /// top-k / top-p / min-p cuts are sampled there
    /// ([`arbor_ops::sample_rows`], each with a uniform draw from its own
    /// RNG, the one the host sampler would take), so only their ids and
    /// logprobs come back; the rows of sequences with cuts are copied to
    /// the host in one copy and sampled there. Should the device fail, the
    /// sequences get their RNGs back and wait to be recomputed.
    pub(super) fn record_and_sample_on_device(
        &mut self,
        scheduled: Vec<SeqId>,
        logits: &candle_core::Tensor,
    ) -> Result<(), EngineError> {
        let todo = self.record(scheduled)?;
        let mut work = self.take_seqs(&todo);
        let saved: Vec<_> = work.iter().map(|(_, s, _)| s.rng.clone()).collect();
        match sample_where(&mut work, logits) {
            Ok(sampled) => {
                self.apply_samples(work, sampled);
                Ok(())
            }
            Err(e) => {
                for ((id, mut s, _), rng) in work.into_iter().zip(saved) {
                    s.rng = rng;
                    self.seqs.insert(id, s);
                    self.requeue(id);
                }
                Err(e)
            }
        }
    }

    /// Record each scheduled sequence's computed KV, and fan a computed
    /// prompt out into its samples. Returns the sequences to sample, each
    /// with its row of the step's logits (the samples of a fan-out share
    /// their parent's).
    pub(super) fn record(
        &mut self,
        scheduled: Vec<SeqId>,
    ) -> Result<Vec<(SeqId, usize)>, EngineError> {
        let mut todo = Vec::new();
        for (row, id) in scheduled.into_iter().enumerate() {
            let s = self.seqs.get_mut(&id).expect("scheduled seq exists");
            let computed_now = s.tokens.len() - s.computed;
            // Prompt prefill and preemption recompute; not the one decode token.
            if s.generated() == 0 || computed_now > 1 {
                self.stats.prefill_computed += computed_now as u64;
            }
            s.computed = s.tokens.len();
            let tokens = s.tokens.clone();
            self.kv.commit(id, &tokens)?;
            if !self.seqs[&id].fan_out.is_empty() {
                for child in self.spawn_fan_out(id)? {
                    todo.push((child, row));
                }
            } else {
                todo.push((id, row));
            }
        }
        Ok(todo)
    }

    /// The parent's prompt is computed: fork its KV into every child (each
    /// then samples its own first token from the shared logits). Returns
    /// the children.
    fn spawn_fan_out(&mut self, parent: SeqId) -> Result<Vec<SeqId>, EngineError> {
        let p = self.seqs.get_mut(&parent).expect("parent exists");
        let children = std::mem::take(&mut p.fan_out);
        let (tokens, computed) = (p.tokens.clone(), p.computed);
        let mut ids = Vec::new();
        for (cid, params) in children {
            self.kv.fork(parent, cid)?;
            let mut c = Seq::new(tokens.clone(), params);
            c.computed = computed;
            c.has_kv = true;
            self.seqs.insert(cid, c);
            self.running.push(cid);
            ids.push(cid);
        }
        self.stats.prefill_forked += (computed * ids.len().saturating_sub(1)) as u64;
        // The parent only held the shared prompt.
        self.seqs.remove(&parent);
        self.kv.free(parent)?;
        self.running.retain(|&r| r != parent);
        Ok(ids)
    }

    /// The sequences to sample, taken out of the table (with their rows)
    /// so they can be sampled in parallel.
    pub(super) fn take_seqs(&mut self, todo: &[(SeqId, usize)]) -> Vec<(SeqId, Seq, usize)> {
        todo.iter()
            .map(|&(id, row)| (id, self.seqs.remove(&id).expect("seq exists"), row))
            .collect()
    }

    /// Put the sampled sequences back with their new token (`None`: the
    /// logits held no distribution, NaN or infinite values) and stop those
    /// that are done.
    pub(super) fn apply_samples(
        &mut self,
        work: Vec<(SeqId, Seq, usize)>,
        sampled: Vec<Option<(u32, f32)>>,
    ) {
        let mut done = Vec::new();
        let mut failed = Vec::new();
        for ((id, mut s, _), got) in work.into_iter().zip(sampled) {
            let Some((tok, lp)) = got else {
                let msg = format!(
                    "the model's logits at position {} are not finite (NaN or infinite): \
                     no token can be sampled",
                    s.tokens.len() - 1
                );
                self.seqs.insert(id, s);
                failed.push((id, msg));
                continue;
            };
            s.tokens.push(tok);
            s.logprobs.push(lp);
            self.stats.generated += 1;
            let reason = if s.params.stop_tokens.contains(&tok) {
                Some((FinishReason::Stop, None))
            } else if let Some(stop) = self.stop_string_hit(&s) {
                Some((FinishReason::Stop, Some(stop)))
            } else if s.generated() >= s.params.max_tokens || s.tokens.len() >= self.max_context {
                Some((FinishReason::Length, None))
            } else {
                None
            };
            self.seqs.insert(id, s);
            if let Some(r) = reason {
                done.push((id, r));
            }
        }
        for (id, (reason, stop)) in done {
            self.finish(id, reason, stop, None);
        }
        for (id, msg) in failed {
            self.finish(id, FinishReason::Error, None, Some(msg));
        }
    }

    /// A stop string's first match, in the text of the last token plus the
    /// longest stop string before it.
    fn stop_string_hit(&self, s: &Seq) -> Option<String> {
        if s.params.stop_strings.is_empty() {
            return None;
        }
        let tok = self.tokenizer.as_ref()?;
        // Only the tail can contain a new match: look at the last token's
        // piece plus the longest stop string.
        let longest = s
            .params
            .stop_strings
            .iter()
            .map(std::string::String::len)
            .max()
            .unwrap_or(0);
        let generated = &s.tokens[s.prompt_len..];
        // Special tokens are skipped, as in the text a caller prints.
        let piece_len = tok
            .decode(&generated[generated.len() - 1..], true)
            .map(|p| p.len())
            .unwrap_or(0);
        let need = longest + piece_len;
        // Decode only the last tokens, not the whole output (which made each
        // token's check linear in the length, a generation quadratic): a
        // window with [`STOP_WINDOW_MARGIN`] bytes before the tail, doubled
        // until it has them (tokens outside the tokenizer's vocabulary
        // decode to nothing). The window's first bytes may differ from the
        // whole text's (a character cut in two, a leading space dropped);
        // the margin keeps them out of the tail.
        let mut w = (need + STOP_WINDOW_MARGIN).min(generated.len());
        let text = loop {
            let text = tok.decode(&generated[generated.len() - w..], true).ok()?;
            if w == generated.len() || text.len() >= need + STOP_WINDOW_MARGIN {
                break text;
            }
            w = (2 * w).min(generated.len());
        };
        let mut from = text.len().saturating_sub(need);
        while !text.is_char_boundary(from) {
            from -= 1;
        }
        let tail = &text[from..];
        s.params
            .stop_strings
            .iter()
            .find(|stop| tail.contains(stop.as_str()))
            .cloned()
    }
}
