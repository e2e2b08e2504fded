//! The scheduler: continuous batching over the paged KV cache.

use std::collections::{HashMap, VecDeque};

use arbor_kv::KvManager;
use arbor_model::model::with_cpu_f32;
use arbor_model::{Tokenizer, Transformer};
use candle_core::{DType, Tensor};
use rand::rngs::StdRng;
use rand::SeedableRng;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::paged::{DeviceKvCache, DevicePagedAttention, PagedAttention, PagedBatch, PagedKvCache};
use crate::sampling::{sample, SamplingParams};
use crate::{EngineError, SeqId};

/// Engine sizing.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EngineConfig {
    /// Token slots per KV block.
    pub block_size: usize,
    /// KV blocks in the pool; 0 derives it from `kv_memory_mib`.
    pub num_blocks: usize,
    /// Memory for the KV pool when `num_blocks` is 0.
    pub kv_memory_mib: usize,
    /// Most sequences in one forward step: admission stops there, and
    /// running sequences beyond it (a fan-out wider than `max_seqs`) keep
    /// their KV and wait for a later step.
    pub max_seqs: usize,
    /// Most new tokens in one forward step (a single longer prompt still
    /// runs, alone).
    pub max_batch_tokens: usize,
    /// Longest sequence (prompt + generated); 0 means the model's
    /// `max_position_embeddings`.
    pub max_context: usize,
    /// Keep the KV cache as device tensors in the model's dtype
    /// ([`crate::paged::DeviceKvCache`]: the CUDA kernels on a GPU) instead
    /// of host slices (f32, or bf16 for a model whose
    /// [`Transformer::kv_dtype`] is bf16). `None`: on the device whenever
    /// the model is not on the CPU.
    #[serde(default)]
    pub kv_on_device: Option<bool>,
    /// Back the model's CPU weight matrices with transparent huge pages
    /// when the engine is built ([`Transformer::back_weights_with_huge_pages`]:
    /// 0.2-0.7 s once for 500 MB; generation then ran 3-13% faster on a
    /// 2-core Zen 2). Best effort; Linux with glibc only.
    #[serde(default = "yes")]
    pub huge_pages: bool,
    /// Keep the engine's f32 CPU weight matrices repacked for the
    /// outer-product matmul ([`Transformer::pack_weights`]; a copy of
    /// each, refreshed by [`Engine::invalidate`]). Off, the same bits come
    /// from packing every matrix on every call.
    #[serde(default = "yes")]
    pub pack_weights: bool,
}

fn yes() -> bool {
    true
}

/// Physical memory in bytes (`MemTotal` of `/proc/meminfo`), where known.
fn physical_memory() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: usize = info
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

/// Bytes of text decoded before the part searched for stop strings
/// (`Engine::stop_string_hit`).
const STOP_WINDOW_MARGIN: usize = 16;

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            num_blocks: 0,
            kv_memory_mib: 2048,
            max_seqs: 256,
            max_batch_tokens: 2048,
            max_context: 0,
            kv_on_device: None,
            huge_pages: true,
            pack_weights: true,
        }
    }
}

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
    /// Tests: make the next step's forward fail.
    #[cfg(test)]
    fail_next_forward: bool,
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
        let kv_dtype = if on_device { model.dtype() } else { host_dtype };
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
        let mut own = model.clone();
        let cpu = own.device().is_cpu();
        let report = |what: &str, t0: std::time::Instant, bytes: usize| {
            tracing::debug!("{what}: {} MiB in {:.2?}", bytes >> 20, t0.elapsed())
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
        Ok(Engine {
            model: own,
            tokenizer,
            max_context,
            kv: KvManager::new(num_blocks, cfg.block_size),
            cache: if on_device {
                KvStore::Device(DeviceKvCache::new(
                    &model.cfg,
                    num_blocks,
                    cfg.block_size,
                    model.dtype(),
                    model.device(),
                )?)
            } else {
                KvStore::Host(PagedKvCache::with_dtype(
                    &model.cfg,
                    num_blocks,
                    cfg.block_size,
                    host_dtype,
                )?)
            },
            cfg,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            finished: Vec::new(),
            next_id: 0,
            stats: EngineStats::default(),
            #[cfg(test)]
            fail_next_forward: false,
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

    /// Current policy version of the KV cache.
    pub fn policy_version(&self) -> u64 {
        self.kv.version()
    }

    /// The weights changed: cached KV is stale. Bumps the policy version so
    /// no block computed before is served to a new request, and repacks the
    /// weights ([`EngineConfig::pack_weights`]), whose packs are copies.
    pub fn invalidate(&mut self) -> u64 {
        if self.cfg.pack_weights && self.model.device().is_cpu() {
            self.model.pack_weights();
        }
        self.forget_cached_kv()
    }

    /// Bumps the policy version, as [`Engine::invalidate`] does, without
    /// touching the weights: for starting afresh when they have not changed
    /// (no repack).
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

    fn try_step(&mut self) -> Result<usize, EngineError> {
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
            return Ok(0);
        }
        let n_tokens = batch.len();
        let in_use = self.kv.stats().in_use as u64;
        self.stats.peak_blocks_in_use = self.stats.peak_blocks_in_use.max(in_use);

        // 3. One packed forward over every new token.
        #[cfg(test)]
        if std::mem::take(&mut self.fail_next_forward) {
            return Err(EngineError::InvalidRequest(
                "injected forward failure".into(),
            ));
        }
        let dev = self.model.device().clone();
        let input = Tensor::from_vec(ids, (1, n_tokens), &dev)?;
        let positions = batch.positions.clone();
        let hidden = match &mut self.cache {
            KvStore::Host(cache) => {
                let mut backend = PagedAttention {
                    cache,
                    batch: &batch,
                };
                self.model.forward_with(&input, &positions, &mut backend)?
            }
            KvStore::Device(cache) => {
                let mut backend = DevicePagedAttention::new(cache, &batch)?;
                self.model.forward_with(&input, &positions, &mut backend)?
            }
        };
        // Last new token of each scheduled sequence.
        // Tokens are laid out sequence after sequence.
        let mut rows = vec![0u32; scheduled.len()];
        for (i, &k) in batch.token_seq.iter().enumerate() {
            rows[k] = i as u32;
        }
        let rows_t = Tensor::from_vec(rows, scheduled.len(), &dev)?;
        let h = hidden.squeeze(0)?.index_select(&rows_t, 0)?;
        // `[scheduled, vocab]`: on the CPU, the product's own buffer (no
        // copy); a device's, copied to the host.
        let logits = self.model.lm_head_logits(&h)?.to_dtype(DType::F32)?;
        self.stats.steps += 1;
        if logits.device().is_cpu() {
            with_cpu_f32(&logits, |flat| self.record_and_sample(scheduled, flat))??;
        } else {
            self.record_and_sample(scheduled, &logits.flatten_all()?.to_vec1::<f32>()?)?;
        }
        Ok(n_tokens)
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

    /// Step 4: record, sample, fan out, stop. `logits` holds one row per
    /// scheduled sequence, in order.
    fn record_and_sample(
        &mut self,
        scheduled: Vec<SeqId>,
        logits: &[f32],
    ) -> Result<(), EngineError> {
        let vocab = logits.len() / scheduled.len().max(1);
        let mut todo: Vec<(SeqId, &[f32])> = Vec::new();
        for (id, row) in scheduled.into_iter().zip(logits.chunks_exact(vocab.max(1))) {
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
                self.spawn_fan_out(id, row)?;
            } else {
                todo.push((id, row));
            }
        }
        self.sample_and_stop(todo);
        Ok(())
    }

    fn schedule(
        &mut self,
        id: SeqId,
        alloc: arbor_kv::Allocation,
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

    /// The parent's prompt is computed: fork its KV into every child, each
    /// sampling its own first token from the shared logits.
    fn spawn_fan_out(&mut self, parent: SeqId, logits: &[f32]) -> Result<(), EngineError> {
        let p = self.seqs.get_mut(&parent).expect("parent exists");
        let children = std::mem::take(&mut p.fan_out);
        let (tokens, computed) = (p.tokens.clone(), p.computed);
        let mut todo = Vec::new();
        for (cid, params) in children {
            self.kv.fork(parent, cid)?;
            let mut c = Seq::new(tokens.clone(), params);
            c.computed = computed;
            c.has_kv = true;
            self.seqs.insert(cid, c);
            self.running.push(cid);
            todo.push((cid, logits));
        }
        self.stats.prefill_forked += (computed * todo.len().saturating_sub(1)) as u64;
        // The parent only held the shared prompt.
        self.seqs.remove(&parent);
        self.kv.free(parent)?;
        self.running.retain(|&r| r != parent);
        self.sample_and_stop(todo);
        Ok(())
    }

    fn sample_and_stop(&mut self, todo: Vec<(SeqId, &[f32])>) {
        // Sample in parallel: each sequence has its own RNG.
        let mut work: Vec<(SeqId, Seq, &[f32])> = todo
            .into_iter()
            .map(|(id, row)| (id, self.seqs.remove(&id).expect("seq exists"), row))
            .collect();
        // `false`: the logits held no distribution (NaN or infinite values).
        let sampled: Vec<bool> = work
            .par_iter_mut()
            .map(|(_, s, row)| match sample(row, &s.params, &mut s.rng) {
                Some((tok, lp)) => {
                    s.tokens.push(tok);
                    s.logprobs.push(lp);
                    true
                }
                None => false,
            })
            .collect();
        let mut done = Vec::new();
        let mut failed = Vec::new();
        for ((id, s, _), ok) in work.into_iter().zip(sampled) {
            if !ok {
                let msg = format!(
                    "the model's logits at position {} are not finite (NaN or infinite): \
                     no token can be sampled",
                    s.tokens.len() - 1
                );
                self.seqs.insert(id, s);
                failed.push((id, msg));
                continue;
            }
            self.stats.generated += 1;
            let last = *s.tokens.last().expect("just sampled");
            let reason = if s.params.stop_tokens.contains(&last) {
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
            .map(|x| x.len())
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
        let run = |fail_before: &[usize]| {
            let mut e = engine(&m);
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
        let clean = run(&[]);
        assert_eq!(clean.len(), 4);
        for fail in [&[0][..], &[1], &[3, 4]] {
            let got = run(fail);
            for (a, b) in clean.iter().zip(&got) {
                assert_eq!(a.tokens, b.tokens, "failing before steps {fail:?}");
                assert_eq!(a.logprobs, b.logprobs);
            }
        }
    }
}
