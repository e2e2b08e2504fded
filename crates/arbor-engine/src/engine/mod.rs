//! The engine: requests, sequences and their lifecycle. One step is
//! planned by [`schedule`] (continuous batching over the paged KV cache),
//! run by [`forward`] (the model over the packed batch), and finished by
//! [`sample`] (sampling, fan-out, stops); sizing is [`config`].

mod config;
#[cfg(any(feature = "cuda", test))]
mod fast_step;
mod forward;
mod sample;
mod schedule;

use config::physical_memory;
pub use config::EngineConfig;
use schedule::StepPlan;

use std::collections::{HashMap, VecDeque};

use arbor_kv::KvManager;
use arbor_model::model::with_cpu_f32;
use arbor_model::{Tokenizer, Transformer};
use candle_core::DType;
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use crate::paged::{DeviceKvCache, PagedBatch, PagedKvCache};
use crate::sampling::SamplingParams;
use crate::{EngineError, SeqId};

/// Where the KV lives: host slices (the CPU engine; f32, or bf16 when the
/// model's K/V are bf16 values) or device tensors.
#[derive(Debug)]
enum KvStore {
    Host(PagedKvCache),
    Device(DeviceKvCache),
}

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token or stop string was produced.
    Stop,
    /// `max_tokens` generated, or the context is full.
    Length,
    /// The request could not be served (see `Completion::error`).
    Error,
    /// Stopped by [`Engine::abort`].
    Abort,
}

/// A finished sequence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    pub id: SeqId,
    /// The prompt (or forked prefix) this sequence continued.
    pub prompt: Vec<u32>,
    /// Generated tokens (a stop token, when hit, is the last one).
    pub tokens: Vec<u32>,
    /// Sampling logprob of each generated token.
    pub logprobs: Vec<f32>,
    pub finish_reason: FinishReason,
    /// The stop string that ended generation, if any.
    pub stop_string: Option<String>,
    /// What went wrong, for `FinishReason::Error`.
    pub error: Option<String>,
}

/// Counters since the engine was created.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineStats {
    pub steps: u64,
    /// Prompt and recomputed tokens run through the model.
    pub prefill_computed: u64,
    /// Prompt tokens whose KV came from the prefix cache.
    pub prefill_cached: u64,
    /// Prompt tokens shared by forked samples instead of recomputed.
    pub prefill_forked: u64,
    /// Tokens generated (sampled).
    pub generated: u64,
    /// Sequences preempted for lack of KV blocks.
    pub preemptions: u64,
    /// KV block copies made for copy-on-write.
    pub cow_copies: u64,
    /// Highest number of KV blocks in use at once.
    pub peak_blocks_in_use: u64,
    /// KV rows attention read: the sum over computed tokens of their
    /// position + 1 (exact for decode tokens; what a decode step's
    /// memory-bandwidth roofline counts).
    #[serde(default)]
    pub kv_rows_read: u64,
}

#[derive(Debug)]
struct Seq {
    tokens: Vec<u32>,
    /// Length of the prompt/prefix this sequence continues.
    prompt_len: usize,
    /// Tokens whose KV is in the cache.
    computed: usize,
    /// Whether `tokens[..computed]` lives in KV blocks now.
    has_kv: bool,
    params: SamplingParams,
    rng: StdRng,
    logprobs: Vec<f32>,
    /// Pending fan-out: on this sequence's next logits, fork into these
    /// children (each samples its own first token) and retire.
    fan_out: Vec<(SeqId, SamplingParams)>,
}

impl Seq {
    fn new(tokens: Vec<u32>, params: SamplingParams) -> Self {
        Seq {
            prompt_len: tokens.len(),
            tokens,
            computed: 0,
            has_kv: false,
            rng: StdRng::seed_from_u64(params.seed),
            params,
            logprobs: Vec::new(),
            fan_out: Vec::new(),
        }
    }

    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

/// The generation engine.
#[derive(Debug)]
pub struct Engine {
    model: Transformer,
    tokenizer: Option<Tokenizer>,
    cfg: EngineConfig,
    max_context: usize,
    kv: KvManager,
    cache: KvStore,
    seqs: HashMap<SeqId, Seq>,
    waiting: VecDeque<SeqId>,
    running: Vec<SeqId>,
    finished: Vec<Completion>,
    next_id: SeqId,
    stats: EngineStats,
    /// The dedicated GPU step (a Qwen-family model on a GPU, bf16 or with
    /// `bf16_rollouts`).
    #[cfg(feature = "cuda")]
    fast: Option<crate::fast::FastDecoder>,
    /// Tests: make the next step's forward fail.
    #[cfg(test)]
    fail_next_forward: bool,
    /// Tests: build step inputs and sample as on a GPU, on the CPU.
    #[cfg(test)]
    device_path_on_cpu: bool,
    /// Tests: run steps through the dedicated step's engine logic with the
    /// candle forward as its runner.
    #[cfg(test)]
    fused_on_cpu: bool,
}

impl Engine {
    /// An engine over `model` (its tensors are shared, not copied).
    pub fn new(
        model: &Transformer,
        tokenizer: Option<Tokenizer>,
        cfg: EngineConfig,
    ) -> Result<Self, EngineError> {
        if cfg.block_size == 0 || cfg.max_seqs == 0 || cfg.max_batch_tokens == 0 {
            return Err(EngineError::Config(
                "block_size, max_seqs and max_batch_tokens must be >= 1".into(),
            ));
        }
        let on_device = cfg.kv_on_device.unwrap_or(!model.device().is_cpu());
        // Host caches hold f32, or bf16 when K/V are bf16 values already.
        let host_dtype = match model.kv_dtype() {
            DType::BF16 => DType::BF16,
            _ => DType::F32,
        };
        // bf16 rollouts of an f32 model on a GPU keep a bf16 cache.
        let bf16_kv = on_device && cfg.bf16_rollouts && !model.device().is_cpu();
        let kv_dtype = match (on_device, bf16_kv) {
            (true, true) => DType::BF16,
            (true, false) => model.dtype(),
            (false, _) => host_dtype,
        };
        let per_block = PagedKvCache::bytes_per_token_in(&model.cfg, kv_dtype)
            .checked_mul(cfg.block_size)
            .ok_or_else(|| {
                EngineError::Config(format!(
                    "block_size = {} makes a KV block more bytes than this machine can address",
                    cfg.block_size
                ))
            })?;
        let num_blocks = if cfg.num_blocks > 0 {
            cfg.num_blocks
        } else {
            let bytes = cfg.kv_memory_mib.checked_mul(1 << 20).ok_or_else(|| {
                EngineError::Config(format!(
                    "kv_memory_mib = {} is more bytes than this machine can address",
                    cfg.kv_memory_mib
                ))
            })?;
            bytes / per_block
        };
        let pool = num_blocks.checked_mul(per_block).ok_or_else(|| {
            EngineError::Config(format!(
                "a KV pool of {num_blocks} blocks of {per_block} bytes is more bytes than \
                 this machine can address: lower num_blocks or block_size"
            ))
        })?;
        if !on_device {
            // The host pool is one allocation per layer and K/V: one larger
            // than the machine would abort the process, not fail cleanly.
            if let Some(ram) = physical_memory().filter(|&r| pool > r) {
                return Err(EngineError::Config(format!(
                    "a KV pool of {num_blocks} blocks ({} MiB) exceeds this machine's \
                     memory ({} MiB): lower kv_memory_mib or num_blocks",
                    pool >> 20,
                    ram >> 20
                )));
            }
        }
        if num_blocks == 0 {
            return Err(EngineError::Config(format!(
                "kv_memory_mib = {} holds no block of {} bytes",
                cfg.kv_memory_mib, per_block
            )));
        }
        let max_context = match cfg.max_context {
            0 => model.cfg.max_position_embeddings,
            n => n,
        };
        // Pack first, so the packs go on huge pages too.
        // Generation records no backward graph (`GpuCut::Detach`); the
        // storage is the trainer's, so in-place updates still show.
        let mut own = if arbor_ops::GpuCut::Detach.on() {
            model.detached()
        } else {
            model.clone()
        };
        let cpu = own.device().is_cpu();
        let report = |what: &str, t0: std::time::Instant, bytes: usize| {
            tracing::debug!("{what}: {} MiB in {:.2?}", bytes >> 20, t0.elapsed());
        };
        if cfg.pack_weights && cpu {
            let t0 = std::time::Instant::now();
            report("weights packed", t0, own.pack_weights());
        }
        if cfg.huge_pages && cpu {
            let t0 = std::time::Instant::now();
            report(
                "weights on huge pages",
                t0,
                own.back_weights_with_huge_pages(),
            );
        }
        let cache = if on_device {
            KvStore::Device(DeviceKvCache::new(
                &model.cfg,
                num_blocks,
                cfg.block_size,
                kv_dtype,
                model.device(),
            )?)
        } else {
            KvStore::Host(PagedKvCache::with_dtype(
                &model.cfg,
                num_blocks,
                cfg.block_size,
                host_dtype,
            )?)
        };
        #[cfg(feature = "cuda")]
        let fast = match &cache {
            KvStore::Device(c) if !cpu && arbor_ops::GpuCut::Fused.on() => {
                let sizes = crate::fast::Sizes {
                    max_seqs: cfg.max_seqs,
                    max_batch_tokens: cfg.max_batch_tokens,
                    max_context,
                    bf16_copy: cfg.bf16_rollouts,
                };
                match crate::fast::FastDecoder::new(&own, c, sizes) {
                    Ok(f) => Some(f),
                    Err(why) if cfg.bf16_rollouts => {
                        tracing::warn!(
                            "bf16_rollouts: the dedicated GPU step is off ({why}); rollouts run \
                             the candle forward over a bf16 KV cache"
                        );
                        None
                    }
                    Err(why) => {
                        tracing::warn!("dedicated GPU step off, the candle forward runs: {why}");
                        None
                    }
                }
            }
            _ => None,
        };
        Ok(Engine {
            model: own,
            tokenizer,
            max_context,
            kv: KvManager::new(num_blocks, cfg.block_size),
            cache,
            cfg,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            finished: Vec::new(),
            next_id: 0,
            stats: EngineStats::default(),
            #[cfg(feature = "cuda")]
            fast,
            #[cfg(test)]
            fail_next_forward: false,
            #[cfg(test)]
            device_path_on_cpu: false,
            #[cfg(test)]
            fused_on_cpu: false,
        })
    }

    /// Longest sequence (prompt + generated) the engine accepts.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// KV pool counters (free, idle cached, in use, evictions).
    pub fn pool_stats(&self) -> arbor_kv::PoolStats {
        self.kv.stats()
    }

    /// Bytes of the KV pool.
    pub fn kv_bytes(&self) -> usize {
        match &self.cache {
            KvStore::Host(c) => c.bytes(),
            KvStore::Device(c) => c.bytes(),
        }
    }

    /// Whether steps run on the dedicated GPU step ([`crate::fast`]: a
    /// Qwen-family model on a GPU, bf16 or with `bf16_rollouts`).
    pub fn fast_decode_active(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.fast.is_some();
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// Bytes of KV one token slot holds (K and V of every layer).
    pub fn kv_bytes_per_token(&self) -> usize {
        self.kv_bytes() / (self.kv.stats().total * self.cfg.block_size).max(1)
    }

    /// Current policy version of the KV cache.
    pub fn policy_version(&self) -> u64 {
        self.kv.version()
    }

    /// The weights changed: cached KV is stale. Bumps the policy version so
    /// no block computed before is served to a new request, repacks the
    /// weights ([`EngineConfig::pack_weights`]), whose packs are copies,
    /// and refills the dedicated GPU step's weight copy in place.
    pub fn invalidate(&mut self) -> u64 {
        if self.cfg.pack_weights && self.model.device().is_cpu() {
            self.model.pack_weights();
        }
        #[cfg(feature = "cuda")]
        if let Some(f) = &mut self.fast {
            if let Err(e) = f.refresh() {
                tracing::warn!("dedicated decode step off: its weight copy failed: {e}");
                self.fast = None;
            }
        }
        self.forget_cached_kv()
    }

    /// Bumps the policy version, as [`Engine::invalidate`] does, without
    /// touching the weights: for starting afresh when they have not changed
    /// (no repack, and the GPU step's weight copy is not refilled: after a
    /// weight change, call [`Engine::invalidate`]).
    pub fn forget_cached_kv(&mut self) -> u64 {
        self.kv.invalidate()
    }

    /// Checks the scheduler's state against the KV manager's (for tests
    /// and debugging; cheap next to a step): every live sequence is queued
    /// once, running or waiting; a sequence holds KV exactly when the
    /// manager has its table, running ones always do, and the slots
    /// reserved equal the tokens computed; the manager's own invariants
    /// (reference counts, pool) hold. Between steps this always holds.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.kv.check_invariants()?;
        let mut seen = std::collections::HashSet::new();
        for (&id, running) in self
            .running
            .iter()
            .map(|id| (id, true))
            .chain(self.waiting.iter().map(|id| (id, false)))
        {
            if !seen.insert(id) {
                return Err(format!("sequence {id} is queued twice"));
            }
            let s = self
                .seqs
                .get(&id)
                .ok_or_else(|| format!("queued sequence {id} is not live"))?;
            if s.has_kv != self.kv.contains(id) {
                return Err(format!(
                    "sequence {id}: has_kv = {} but the KV manager {} it",
                    s.has_kv,
                    if s.has_kv { "lacks" } else { "holds" }
                ));
            }
            if running && !s.has_kv {
                return Err(format!("running sequence {id} holds no KV"));
            }
            if s.computed > s.tokens.len() {
                return Err(format!(
                    "sequence {id}: {} of {} tokens computed",
                    s.computed,
                    s.tokens.len()
                ));
            }
            if s.has_kv {
                let len = self.kv.seq_len(id).map_err(|e| e.to_string())?;
                if len != s.computed {
                    return Err(format!(
                        "sequence {id}: {len} KV slots for {} computed tokens",
                        s.computed
                    ));
                }
            }
        }
        if seen.len() != self.seqs.len() {
            return Err(format!(
                "{} live sequences, {} queued",
                self.seqs.len(),
                seen.len()
            ));
        }
        if let Some(id) = self.kv.sequences().find(|id| !seen.contains(id)) {
            return Err(format!("the KV manager holds untracked sequence {id}"));
        }
        Ok(())
    }

    /// Sequences not finished yet.
    pub fn num_pending(&self) -> usize {
        self.waiting.len() + self.running.len()
    }

    pub fn has_pending(&self) -> bool {
        self.num_pending() > 0
    }

    fn check_tokens(&self, what: &str, tokens: &[u32]) -> Result<(), EngineError> {
        let vocab = self.model.cfg.vocab_size as u32;
        if let Some(&t) = tokens.iter().find(|&&t| t >= vocab) {
            return Err(EngineError::InvalidRequest(format!(
                "{what} token {t} is outside the vocabulary (vocab_size = {vocab})"
            )));
        }
        Ok(())
    }

    fn check_params(&self, p: &SamplingParams) -> Result<(), EngineError> {
        p.validate()?;
        self.check_tokens("stop", &p.stop_tokens).map_err(|_| {
            EngineError::InvalidParams(format!(
                "stop_tokens = {:?}: unknown token id",
                p.stop_tokens
            ))
        })?;
        if !p.stop_strings.is_empty() && self.tokenizer.is_none() {
            return Err(EngineError::InvalidParams(
                "stop_strings need a tokenizer, and the engine has none".into(),
            ));
        }
        Ok(())
    }

    fn new_id(&mut self) -> SeqId {
        self.next_id += 1;
        self.next_id - 1
    }

    /// Queue `prompt` for one sample per entry of `samples`. With several
    /// samples the prompt is computed once and its KV forked to each.
    /// Returns the ids of the samples, in order.
    pub fn submit(
        &mut self,
        prompt: Vec<u32>,
        samples: Vec<SamplingParams>,
    ) -> Result<Vec<SeqId>, EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::InvalidRequest("empty prompt".into()));
        }
        if samples.is_empty() {
            return Err(EngineError::InvalidRequest(
                "n = 0 samples requested".into(),
            ));
        }
        if prompt.len() >= self.max_context {
            return Err(EngineError::InvalidRequest(format!(
                "prompt of {} tokens leaves no room in a context of {}",
                prompt.len(),
                self.max_context
            )));
        }
        self.check_tokens("prompt", &prompt)?;
        for p in &samples {
            self.check_params(p)?;
        }
        let ids: Vec<SeqId> = samples.iter().map(|_| self.new_id()).collect();
        if samples.len() == 1 {
            let p = samples.into_iter().next().expect("one");
            self.seqs.insert(ids[0], Seq::new(prompt, p));
            self.waiting.push_back(ids[0]);
        } else {
            let parent = self.new_id();
            let mut s = Seq::new(prompt, SamplingParams::default());
            s.fan_out = ids.iter().copied().zip(samples).collect();
            self.seqs.insert(parent, s);
            self.waiting.push_back(parent);
        }
        Ok(ids)
    }

    /// Branch the live sequence `seq` into one new sequence per entry of
    /// `samples`, each continuing from `seq`'s current tokens and sharing its
    /// KV blocks (copy-on-write for the partial last block). `seq` goes on.
    pub fn fork(
        &mut self,
        seq: SeqId,
        samples: Vec<SamplingParams>,
    ) -> Result<Vec<SeqId>, EngineError> {
        if samples.is_empty() {
            return Err(EngineError::InvalidRequest(
                "n = 0 samples requested".into(),
            ));
        }
        for p in &samples {
            self.check_params(p)?;
        }
        let Some(parent) = self.seqs.get(&seq).filter(|p| p.fan_out.is_empty()) else {
            // A sample of a multi-sample request exists once its prompt is
            // computed (the fan-out); before that it cannot branch.
            if self.fan_out_parent(seq).is_some() {
                return Err(EngineError::InvalidRequest(format!(
                    "sequence {seq} has not started: its prompt is still to be computed \
                     (fork it after a step)"
                )));
            }
            return Err(EngineError::UnknownSequence(seq));
        };
        let (tokens, computed, has_kv) = (parent.tokens.clone(), parent.computed, parent.has_kv);
        let is_running = self.running.contains(&seq);
        let mut ids = Vec::with_capacity(samples.len());
        for p in samples {
            let id = self.new_id();
            let mut child = Seq::new(tokens.clone(), p);
            if has_kv {
                self.kv.fork(seq, id)?;
                child.computed = computed;
                child.has_kv = true;
                self.stats.prefill_forked += computed as u64;
            }
            self.seqs.insert(id, child);
            if is_running && has_kv {
                self.running.push(id);
            } else {
                self.waiting.push_back(id);
            }
            ids.push(id);
        }
        Ok(ids)
    }

    /// Stop `seq` now (an agent's timeout, a branch no longer wanted): its
    /// KV blocks are released (full ones stay in the prefix cache for
    /// later prompts), and it finishes with [`FinishReason::Abort`] and the
    /// tokens generated so far, collected by [`Engine::take_finished`] or
    /// [`Engine::run`] like any other completion. A sample of a
    /// multi-sample request whose prompt is still to be computed leaves the
    /// request (the prompt is dropped with its last sample). Errors for an
    /// unknown or finished sequence.
    pub fn abort(&mut self, seq: SeqId) -> Result<(), EngineError> {
        if self.seqs.get(&seq).is_some_and(|s| s.fan_out.is_empty()) {
            self.finish(seq, FinishReason::Abort, None, None);
            return Ok(());
        }
        let parent = self
            .fan_out_parent(seq)
            .ok_or(EngineError::UnknownSequence(seq))?;
        let p = self.seqs.get_mut(&parent).expect("found above");
        p.fan_out.retain(|(id, _)| *id != seq);
        let (prompt, left) = (p.tokens[..p.prompt_len].to_vec(), p.fan_out.len());
        self.finished.push(Completion {
            id: seq,
            prompt,
            tokens: Vec::new(),
            logprobs: Vec::new(),
            finish_reason: FinishReason::Abort,
            stop_string: None,
            error: None,
        });
        if left == 0 {
            self.drop_seq(parent);
        }
        Ok(())
    }

    /// The multi-sample request whose prompt is still to be computed and
    /// whose samples include `seq`.
    fn fan_out_parent(&self, seq: SeqId) -> Option<SeqId> {
        self.seqs
            .iter()
            .find(|(_, p)| p.fan_out.iter().any(|(id, _)| *id == seq))
            .map(|(&id, _)| id)
    }

    /// Completions finished since the last call.
    pub fn take_finished(&mut self) -> Vec<Completion> {
        std::mem::take(&mut self.finished)
    }

    fn finish(
        &mut self,
        id: SeqId,
        reason: FinishReason,
        stop_string: Option<String>,
        error: Option<String>,
    ) {
        let Some(s) = self.drop_seq(id) else {
            return;
        };
        let outputs: Vec<(SeqId, SamplingParams)> = if s.fan_out.is_empty() {
            vec![(id, s.params.clone())]
        } else {
            // A fan-out parent that fails fails every sample it stood for.
            s.fan_out.clone()
        };
        for (oid, _) in outputs {
            self.finished.push(Completion {
                id: oid,
                prompt: s.tokens[..s.prompt_len].to_vec(),
                tokens: s.tokens[s.prompt_len..].to_vec(),
                logprobs: s.logprobs.clone(),
                finish_reason: reason,
                stop_string: stop_string.clone(),
                error: error.clone(),
            });
        }
    }

    /// Forget sequence `id`: free its KV, take it off the queues.
    fn drop_seq(&mut self, id: SeqId) -> Option<Seq> {
        let s = self.seqs.remove(&id)?;
        if s.has_kv {
            let _ = self.kv.free(id);
        }
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&r| r != id);
        Some(s)
    }

    /// Free a running sequence's KV and queue it for recomputation.
    fn preempt(&mut self, id: SeqId) {
        self.requeue(id);
        self.stats.preemptions += 1;
    }

    /// [`Engine::preempt`] without counting a preemption.
    fn requeue(&mut self, id: SeqId) {
        if let Some(s) = self.seqs.get_mut(&id) {
            if s.has_kv {
                let _ = self.kv.free(id);
            }
            s.has_kv = false;
            s.computed = 0;
        }
        self.running.retain(|&r| r != id);
        self.waiting.push_front(id);
    }

    /// Run one forward step over every running sequence plus newly
    /// admitted ones. Returns the number of tokens computed (0 when idle).
    ///
    /// On the CPU the step runs on a rayon worker, with the pool's other
    /// workers polling for work until it ends
    /// ([`arbor_ops::in_pool_polling`]), so the forward's ~200 parallel
    /// kernel calls start inside the pool and never wait for a sleeping
    /// thread.
    pub fn step(&mut self) -> Result<usize, EngineError> {
        let dev = self.model.device().clone();
        arbor_ops::in_pool_polling(&dev, || self.step_here())
    }

    /// [`Engine::step`] on the calling thread. A step that fails (a device
    /// error in the forward, say) leaves no slot reserved and uncomputed:
    /// the sequences it was computing give their KV back and wait to be
    /// recomputed, so the engine can step again.
    fn step_here(&mut self) -> Result<usize, EngineError> {
        // The sequences a failed step requeues count their cache hits again
        // when readmitted; its block copies are undone with it.
        let (cached, copies) = (self.stats.prefill_cached, self.stats.cow_copies);
        let r = self.try_step();
        if r.is_err() {
            self.stats.prefill_cached = cached;
            self.stats.cow_copies = copies;
            let stale: Vec<SeqId> = self
                .running
                .iter()
                .copied()
                .filter(|id| {
                    let computed = self.seqs.get(id).map_or(0, |s| s.computed);
                    self.kv.seq_len(*id).is_ok_and(|len| len > computed)
                })
                .collect();
            // In reverse, so they wait in their running order.
            for &id in stale.iter().rev() {
                self.requeue(id);
            }
        }
        r
    }

    /// One step: plan it ([`schedule`]), run the model ([`forward`]), then
    /// record, sample and stop ([`sample`]).
    fn try_step(&mut self) -> Result<usize, EngineError> {
        let Some(StepPlan {
            batch,
            ids,
            scheduled,
        }) = self.plan_step()?
        else {
            return Ok(0);
        };
        let n_tokens = batch.len();
        let in_use = self.kv.stats().in_use as u64;
        self.stats.peak_blocks_in_use = self.stats.peak_blocks_in_use.max(in_use);
        #[cfg(feature = "cuda")]
        if self.fast_step(&batch, &ids, &scheduled)? {
            return Ok(n_tokens);
        }
        #[cfg(test)]
        if self.fused_on_cpu && self.fused_step_on_cpu(&batch, &ids, &scheduled)? {
            return Ok(n_tokens);
        }
        let logits = self.forward_logits(&batch, ids, scheduled.len())?;
        self.count_step(&batch);
        let on_device = self.device_inputs(logits.device()) && arbor_ops::GpuCut::Sampling.on();
        if on_device {
            // A device's logits stay there: tokens are sampled on it.
            self.record_and_sample_on_device(scheduled, &logits)?;
        } else if logits.device().is_cpu() {
            with_cpu_f32(&logits, |flat| self.record_and_sample(scheduled, flat))??;
        } else {
            self.record_and_sample(scheduled, &logits.flatten_all()?.to_vec1::<f32>()?)?;
        }
        Ok(n_tokens)
    }

    /// Counts a computed step and the KV rows its attention read.
    fn count_step(&mut self, batch: &PagedBatch) {
        self.stats.steps += 1;
        self.stats.kv_rows_read += batch.positions.iter().map(|&p| p as u64 + 1).sum::<u64>();
    }

    /// Step until every queued sequence has finished; returns the completions
    /// in id order. `on_step(finished_so_far)` is called after each step.
    ///
    /// A failed step returns its error and leaves every completion gathered
    /// so far with the engine, for [`Engine::take_finished`].
    pub fn run(&mut self, mut on_step: impl FnMut(usize)) -> Result<Vec<Completion>, EngineError> {
        let mut out = self.take_finished();
        while self.has_pending() {
            if let Err(e) = self.step() {
                out.append(&mut self.finished);
                self.finished = out;
                return Err(e);
            }
            out.extend(self.take_finished());
            on_step(out.len());
        }
        out.sort_by_key(|c| c.id);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> Transformer {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../arbor-model/tests/fixtures/qwen2");
        arbor_model::LoadedModel::load(p.to_str().unwrap(), &Default::default())
            .unwrap()
            .model
    }

    fn engine(m: &Transformer) -> Engine {
        Engine::new(
            m,
            None,
            EngineConfig {
                block_size: 4,
                num_blocks: 64,
                ..Default::default()
            },
        )
        .unwrap()
    }

    /// `run` stopped by a failed step hands back nothing, but the
    /// completions it had gathered stay with the engine.
    #[test]
    fn a_failed_run_keeps_the_completions_it_gathered() {
        let m = fixture();
        let mut e = engine(&m);
        let a = e
            .submit((1..10).collect(), vec![SamplingParams::greedy(4)])
            .unwrap()[0];
        let b = e
            .submit((20..27).collect(), vec![SamplingParams::greedy(4)])
            .unwrap()[0];
        e.abort(a).unwrap();
        e.fail_next_forward = true;
        assert!(e.run(|_| {}).is_err());
        let kept = e.take_finished();
        assert_eq!(kept.len(), 1);
        assert_eq!(
            (kept[0].id, kept[0].finish_reason),
            (a, FinishReason::Abort)
        );
        let rest = e.run(|_| {}).unwrap();
        assert_eq!(rest.len(), 1);
        assert_eq!((rest[0].id, rest[0].tokens.len()), (b, 4));
    }

    /// A prompt admitted with cache hits in a step that fails is counted
    /// once, when the step that computes it succeeds.
    #[test]
    fn a_failed_step_does_not_count_cache_hits_twice() {
        let m = fixture();
        let mut e = engine(&m);
        let prompt: Vec<u32> = (1..10).collect();
        e.submit(prompt.clone(), vec![SamplingParams::greedy(1)])
            .unwrap();
        e.run(|_| {}).unwrap();
        assert_eq!(e.stats().prefill_cached, 0);
        e.submit(prompt, vec![SamplingParams::greedy(1)]).unwrap();
        e.fail_next_forward = true;
        assert!(e.step().is_err());
        e.run(|_| {}).unwrap();
        // 9 tokens: two full blocks of 4 from the cache.
        assert_eq!(e.stats().prefill_cached, 8);
    }

    /// The GPU step on the CPU (one upload of the step's inputs, RoPE from
    /// the device table, the candle forward, and sampling where the logits
    /// are: greedy and tempered rows by `arbor_ops::sample_rows`, rows with
    /// cuts on the host) gives the tokens of the CPU engine, each sequence
    /// drawing from its own RNG, fan-outs included, and its logprobs to
    /// round-off (the two forwards sum in different orders).
    #[test]
    fn the_gpu_step_on_the_cpu_matches_the_cpu_engine() {
        let m = fixture();
        let run = |on_device: bool| {
            let mut e = Engine::new(
                &m,
                None,
                EngineConfig {
                    block_size: 4,
                    num_blocks: 64,
                    kv_on_device: Some(on_device),
                    ..Default::default()
                },
            )
            .unwrap();
            e.device_path_on_cpu = on_device;
            let t = |seed, temperature, top_p| SamplingParams {
                temperature,
                top_p,
                max_tokens: 12,
                seed,
                ..Default::default()
            };
            e.submit(
                (1..10).collect(),
                vec![t(1, 1.0, 1.0), t(2, 0.7, 1.0), t(3, 1.0, 0.9)],
            )
            .unwrap();
            e.submit((20..27).collect(), vec![SamplingParams::greedy(12)])
                .unwrap();
            e.submit((30..41).collect(), vec![t(4, 1.3, 1.0)]).unwrap();
            e.run(|_| {}).unwrap()
        };
        let (host, dev) = (run(false), run(true));
        assert_eq!((host.len(), dev.len()), (5, 5));
        for (a, b) in host.iter().zip(&dev) {
            assert_eq!(a.tokens, b.tokens, "sequence {}", a.id);
            for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
                assert!((x - y).abs() < 1e-4, "sequence {}: {x} vs {y}", a.id);
            }
        }
    }

    /// The dedicated step's engine logic (samples in `record`'s order, a
    /// fan-out's children drawing from their own seeds, the last token of
    /// each prefill sampled, RNGs advanced as the host sampler advances
    /// them) with the CPU forward as its runner gives exactly the CPU
    /// engine's completions: prefills, fan-outs, greedy and tempered
    /// samples, forks, preemption by a small pool; a top-p request takes
    /// the host path.
    #[test]
    fn the_fused_step_logic_matches_the_cpu_engine() {
        let m = fixture();
        let run = |fused: bool| {
            let mut e = Engine::new(
                &m,
                None,
                EngineConfig {
                    block_size: 4,
                    num_blocks: 24,
                    max_batch_tokens: 32,
                    ..Default::default()
                },
            )
            .unwrap();
            e.fused_on_cpu = fused;
            let t = |seed, temperature, top_p| SamplingParams {
                temperature,
                top_p,
                max_tokens: 10,
                seed,
                ..Default::default()
            };
            e.submit(
                (1..10).collect(),
                vec![t(1, 1.0, 1.0), t(2, 0.7, 1.0), t(3, 0.0, 1.0)],
            )
            .unwrap();
            let g = e
                .submit((20..27).collect(), vec![SamplingParams::greedy(12)])
                .unwrap()[0];
            e.submit((30..41).collect(), vec![t(4, 1.3, 1.0)]).unwrap();
            e.submit((50..60).collect(), vec![t(5, 1.0, 0.8)]).unwrap();
            for _ in 0..3 {
                e.step().unwrap();
            }
            e.fork(g, vec![t(6, 1.0, 1.0), t(7, 0.0, 1.0)]).unwrap();
            let mut out = e.run(|_| {}).unwrap();
            out.sort_by_key(|c| c.id);
            (out, e.stats().clone())
        };
        let ((host, hs), (fused, fs)) = (run(false), run(true));
        assert_eq!(host.len(), 8);
        assert_eq!(
            host.iter().map(|c| c.id).collect::<Vec<_>>(),
            fused.iter().map(|c| c.id).collect::<Vec<_>>()
        );
        assert!(hs.preemptions > 0 && hs.prefill_forked > 0, "{hs:?}");
        assert_eq!(hs.preemptions, fs.preemptions);
        for (a, b) in host.iter().zip(&fused) {
            assert_eq!(a.tokens, b.tokens, "sequence {}", a.id);
            for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
                assert!((x - y).abs() < 1e-4, "sequence {}: {x} vs {y}", a.id);
            }
        }
    }

    /// A block size whose block (or pool) overflows the address space is a
    /// config error, not an overflow panic or a short allocation.
    #[test]
    fn an_overflowing_block_size_is_a_config_error() {
        let m = fixture();
        for (block_size, num_blocks) in [(1usize << 62, 0), (1 << 62, 4), (1 << 40, 1 << 30)] {
            let cfg = EngineConfig {
                block_size,
                num_blocks,
                ..Default::default()
            };
            match Engine::new(&m, None, cfg) {
                Err(EngineError::Config(msg)) => assert!(msg.contains("address"), "{msg}"),
                other => panic!("block_size {block_size}: {:?}", other.map(|_| ())),
            }
        }
    }

    /// A step whose forward fails (as a device error would) after its
    /// slots were reserved: the engine's invariants still hold (no slot
    /// reserved and uncomputed), and stepping on gives exactly the
    /// completions of a run that never failed.
    #[test]
    fn a_failed_step_reserves_nothing_and_the_engine_goes_on() {
        let m = fixture();
        let run = |fail_before: &[usize], fused: bool| {
            let mut e = engine(&m);
            // The dedicated step's logic too: its RNG rollback.
            e.fused_on_cpu = fused;
            for (i, p) in [(1..10).collect::<Vec<u32>>(), (20..27).collect()]
                .into_iter()
                .enumerate()
            {
                let samples = (0..2)
                    .map(|j| SamplingParams {
                        temperature: 1.0,
                        max_tokens: 8,
                        seed: (2 * i + j) as u64,
                        ..Default::default()
                    })
                    .collect();
                e.submit(p, samples).unwrap();
            }
            let mut steps = 0;
            while e.has_pending() {
                if fail_before.contains(&steps) {
                    e.fail_next_forward = true;
                    assert!(e.step().is_err());
                    e.check_invariants().unwrap();
                }
                e.step().unwrap();
                e.check_invariants().unwrap();
                steps += 1;
            }
            let mut out = e.take_finished();
            out.sort_by_key(|c| c.id);
            out
        };
        let clean = run(&[], false);
        assert_eq!(clean.len(), 4);
        for fused in [false, true] {
            for fail in [&[0][..], &[1], &[3, 4]] {
                let got = run(fail, fused);
                assert_eq!(got.len(), 4);
                for (a, b) in clean.iter().zip(&got) {
                    assert_eq!(
                        a.tokens, b.tokens,
                        "failing before steps {fail:?}, fused {fused}"
                    );
                    if !fused {
                        assert_eq!(a.logprobs, b.logprobs);
                    }
                }
            }
        }
    }
}
