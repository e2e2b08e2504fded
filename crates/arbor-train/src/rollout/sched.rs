//! The rollout scheduler: one event loop that every method's continuations
//! run on.
//!
//! A policy [`launch`](Scheduler::launch)es continuations whenever it
//! likes and [`wait`](Scheduler::wait)s for the next ones to end their
//! episodes, so an allocator can decide the next fork each time a
//! continuation finishes while the others keep generating (FOCUS's `m`,
//! continuations in flight, is then real). Inside, a continuation cycles
//! between the engine and its environment:
//!
//! ```text
//!   launch ──► engine (one segment, batched with every other live one)
//!                 │ segment done
//!                 ▼
//!              environment step (inline, or on an env worker thread)
//!                 │ observation
//!                 ├── episode over ──► finished, returned by `wait`
//!                 └── otherwise ─────► engine again
//! ```
//!
//! With `env_workers = 0` environment steps run inline after the engine
//! step that completed the segment: cheap environments (math, synthetic
//! tasks) cost nothing to hand over, and the run is deterministic, so resume
//! stays bit-exact. With `env_workers = N > 0` they run on `N` threads
//! while the engine keeps decoding the other continuations, and a
//! continuation re-enters the engine when its observation arrives: a batch
//! of SWE episodes then takes about max(generation, the slowest episode's
//! tool time) instead of their sum. Which continuations share an engine
//! step then depends on timing, so results are reproducible only up to
//! the engine's batch composition.
//!
//! Sampling seeds are derived from the step's seed, the continuation's
//! launch index and the segment index, never from timing or batch order.

use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use arbor_engine::{Completion, Engine, SamplingParams, SeqId};

use super::conts::{advance, Cont, SegmentRecord};
use super::{RolloutConfig, RolloutStats};
use crate::TrainError;

/// SplitMix64 finaliser: a well-mixed 64-bit hash of `x`.
pub(crate) fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Fisher-Yates shuffle of `order` from the SplitMix stream in `state`
/// (advanced), the same on every platform.
pub(crate) fn shuffle(order: &mut [usize], state: &mut u64) {
    for i in (1..order.len()).rev() {
        *state = mix64(*state);
        order.swap(i, (*state % (i as u64 + 1)) as usize);
    }
}

/// An environment step handed to a worker: the continuation, the segment
/// the engine generated for it.
type EnvJob = (usize, Box<Cont>, Completion);
/// A worker's answer: the continuation with the segment applied, or the
/// error, and the seconds the step took.
type EnvDone = (usize, Result<Box<Cont>, TrainError>, f64);

/// A pool of environment worker threads.
struct EnvPool {
    jobs: Option<Sender<EnvJob>>,
    done: Receiver<EnvDone>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl EnvPool {
    fn new(n: usize, cfg: &RolloutConfig, keep_snapshots: bool) -> Result<Self, TrainError> {
        let (jobs_tx, jobs_rx) = channel::<EnvJob>();
        let (done_tx, done_rx) = channel::<EnvDone>();
        let jobs_rx = Arc::new(Mutex::new(jobs_rx));
        let mut threads = Vec::with_capacity(n);
        for i in 0..n {
            let (rx, tx, cfg) = (jobs_rx.clone(), done_tx.clone(), cfg.clone());
            let t = std::thread::Builder::new()
                .name(format!("arbor-env-{i}"))
                .spawn(move || loop {
                    let job = match rx.lock() {
                        Ok(r) => r.recv(),
                        Err(_) => return,
                    };
                    let Ok((key, mut cont, seg)) = job else {
                        return;
                    };
                    let t0 = Instant::now();
                    // A panicking environment must not leave the scheduler
                    // waiting forever for this answer.
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        apply_segment(&mut cont, seg, &cfg, keep_snapshots)
                    }))
                    .unwrap_or_else(|_| {
                        Err(TrainError::Rollout(
                            "an environment step panicked on an env worker".into(),
                        ))
                    })
                    .map(|()| cont);
                    if tx.send((key, r, t0.elapsed().as_secs_f64())).is_err() {
                        return;
                    }
                })
                .map_err(|e| TrainError::Rollout(format!("cannot start an env worker: {e}")))?;
            threads.push(t);
        }
        Ok(EnvPool {
            jobs: Some(jobs_tx),
            done: done_rx,
            threads,
        })
    }
}

impl Drop for EnvPool {
    fn drop(&mut self) {
        // Closing the job channel ends every worker after its current step.
        self.jobs.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Feed the engine's segment `seg` to `cont`'s environment and record it:
/// the observation, the environment snapshot (with `keep_snapshots`, at
/// non-final states), the reward when the episode ends (0 when it reaches
/// `cfg.max_segments` without ending).
pub(crate) fn apply_segment(
    cont: &mut Cont,
    seg: Completion,
    cfg: &RolloutConfig,
    keep_snapshots: bool,
) -> Result<(), TrainError> {
    let head = std::mem::take(&mut cont.head);
    let out = if head.is_empty() {
        cont.env.step(&seg.tokens)?
    } else {
        let whole: Vec<u32> = head.iter().chain(&seg.tokens).copied().collect();
        cont.env.step(&whole)?
    };
    advance(
        &mut cont.context,
        &seg.tokens,
        &out.observation,
        out.restart,
    );
    let kind = std::mem::replace(&mut cont.next, out.next);
    let segments = cont.replayed.len() + cont.steps.len() + 1;
    let truncated = out.reward.is_none() && segments >= cfg.max_segments;
    let reward = if truncated { Some(0.0) } else { out.reward };
    let snapshot = if keep_snapshots && reward.is_none() {
        Some(cont.env.fork()?)
    } else {
        None
    };
    cont.steps.push(SegmentRecord {
        head,
        kind,
        action: seg.tokens,
        logprobs: seg.logprobs,
        observation: out.observation,
        restart: out.restart,
        next: out.next,
        env_after: snapshot,
        reward,
    });
    Ok(())
}

/// The event loop over one engine; see the module docs.
pub(crate) struct Scheduler<'a> {
    engine: &'a mut Engine,
    cfg: &'a RolloutConfig,
    keep_snapshots: bool,
    /// The run's seed counter; continuation `i` samples from
    /// `mix64(base + i)`, and the counter moves past them on drop.
    seed: &'a mut u64,
    base_seed: u64,
    /// Continuations launched so far (the next one's key).
    launched: usize,
    /// Continuations generating a segment, by engine sequence: their key
    /// and state.
    in_engine: HashMap<SeqId, (usize, Box<Cont>)>,
    /// Continuations at an environment worker.
    at_env: usize,
    pool: Option<EnvPool>,
    /// Ended episodes, not yet returned by `wait`.
    ended: Vec<(usize, Box<Cont>)>,
    stats: RolloutStats,
    started: Instant,
}

impl<'a> Scheduler<'a> {
    /// A scheduler over `engine`; `keep_snapshots` keeps each non-final
    /// state's environment (FOCUS, VinePPO and PS sources fork there);
    /// `env_workers` environment threads (0: inline).
    pub(crate) fn new(
        engine: &'a mut Engine,
        cfg: &'a RolloutConfig,
        seed: &'a mut u64,
        keep_snapshots: bool,
        env_workers: usize,
    ) -> Result<Self, TrainError> {
        let pool = match env_workers {
            0 => None,
            n => Some(EnvPool::new(n, cfg, keep_snapshots)?),
        };
        Ok(Scheduler {
            base_seed: *seed,
            engine,
            cfg,
            keep_snapshots,
            seed,
            launched: 0,
            in_engine: HashMap::new(),
            at_env: 0,
            pool,
            ended: Vec::new(),
            stats: RolloutStats::default(),
            started: Instant::now(),
        })
    }

    /// Give the next launch index to a continuation another rank runs (the
    /// indices, and so the seeds, follow the launch order of the whole
    /// group); returns it.
    pub(crate) fn skip_launch(&mut self) -> usize {
        self.launched += 1;
        self.launched - 1
    }

    /// Start `cont` (its next segment joins the engine's queue); returns its
    /// launch index, the key [`Scheduler::wait`] returns it under.
    pub(crate) fn launch(&mut self, mut cont: Cont) -> Result<usize, TrainError> {
        let key = self.launched;
        self.launched += 1;
        cont.seed = mix64(self.base_seed.wrapping_add(key as u64));
        self.stats.continuations += 1;
        self.submit(key, Box::new(cont))?;
        Ok(key)
    }

    /// Drive the engine and the environments until at least one episode
    /// ends; returns every continuation whose episode has ended since the
    /// last call (launch order), or nothing once none is in flight.
    pub(crate) fn wait(&mut self) -> Result<Vec<(usize, Cont)>, TrainError> {
        loop {
            let out = self.poll()?;
            if !out.is_empty() || !self.busy() {
                return Ok(out);
            }
        }
    }

    /// One turn of the event loop: the episodes that have already ended if
    /// any, else one engine step (or, with nothing to decode, a wait for
    /// an environment worker's answer) and the episodes it ended, in launch
    /// order; possibly none. Ranks that allocate together (FOCUS on several
    /// ranks) take one turn each between exchanges, so their engines step
    /// in lockstep, as one engine over all their continuations would.
    pub(crate) fn poll(&mut self) -> Result<Vec<(usize, Cont)>, TrainError> {
        self.drain_env(false)?;
        if self.ended.is_empty() {
            if self.engine.has_pending() {
                let before = self.engine.stats().clone();
                let t0 = Instant::now();
                self.engine
                    .step()
                    .map_err(|e| TrainError::Rollout(format!("generation failed: {e}")))?;
                self.stats.generate_s += t0.elapsed().as_secs_f64();
                let after = self.engine.stats();
                self.stats.generated_tokens += after.generated - before.generated;
                self.stats.prefill_computed += after.prefill_computed - before.prefill_computed;
                self.stats.prefill_cached += after.prefill_cached - before.prefill_cached;
                for seg in self.engine.take_finished() {
                    self.on_segment(seg)?;
                }
            } else if self.at_env > 0 {
                // Nothing to decode until an observation comes back.
                let t0 = Instant::now();
                self.drain_env(true)?;
                self.stats.engine_idle_s += t0.elapsed().as_secs_f64();
            }
            self.drain_env(false)?;
        }
        let mut out: Vec<(usize, Cont)> = self.ended.drain(..).map(|(k, c)| (k, *c)).collect();
        out.sort_by_key(|(k, _)| *k);
        Ok(out)
    }

    /// Whether a continuation is still generating or at its environment.
    fn busy(&self) -> bool {
        self.engine.has_pending() || self.at_env > 0 || !self.ended.is_empty()
    }

    /// Launch every continuation of `conts` and run them all to the ends of
    /// their episodes; returns them in the order given.
    pub(crate) fn run_all(&mut self, conts: Vec<Cont>) -> Result<Vec<Cont>, TrainError> {
        let first = self.launched;
        let n = conts.len();
        for c in conts {
            self.launch(c)?;
        }
        let out: Vec<Cont> = self
            .drain()?
            .into_iter()
            .filter(|(k, _)| (first..first + n).contains(k))
            .map(|(_, c)| c)
            .collect();
        if out.len() != n {
            return Err(TrainError::Rollout(
                "the scheduler lost a continuation".into(),
            ));
        }
        Ok(out)
    }

    /// Run every continuation in flight to the end of its episode; returns
    /// them with their launch indices, in launch order.
    pub(crate) fn drain(&mut self) -> Result<Vec<(usize, Cont)>, TrainError> {
        let mut out = Vec::new();
        loop {
            let done = self.wait()?;
            if done.is_empty() {
                out.sort_by_key(|(k, _)| *k);
                return Ok(out);
            }
            out.extend(done);
        }
    }

    /// Continuations launched so far (the next launch index), those another
    /// rank runs included.
    pub(crate) fn launched(&self) -> usize {
        self.launched
    }

    /// The engine's context length (prompt and generated tokens).
    pub(crate) fn max_context(&self) -> usize {
        self.engine.max_context()
    }

    /// Count `secs` of environment work done outside the event loop
    /// (Prefix Sampling's replays).
    pub(crate) fn add_env_time(&mut self, secs: f64) {
        self.stats.env_s += secs;
    }

    /// Count `tokens` replayed (not generated) prefix tokens.
    pub(crate) fn add_replayed(&mut self, tokens: u64) {
        self.stats.replayed_tokens += tokens;
    }

    /// The accounting, with the rollout's wall time.
    pub(crate) fn finish(mut self) -> RolloutStats {
        self.stats.rollout_s = self.started.elapsed().as_secs_f64();
        std::mem::take(&mut self.stats)
    }

    /// Queue `cont`'s next segment, or end it (reward 0) when its context
    /// has no room for another token.
    fn submit(&mut self, key: usize, mut cont: Box<Cont>) -> Result<(), TrainError> {
        let room = self.engine.max_context();
        if cont.context.len() + 1 >= room {
            match cont.steps.last_mut() {
                Some(last) => last.reward = Some(0.0),
                None => {
                    return Err(TrainError::Rollout(format!(
                        "a prompt of {} tokens leaves no room in the engine's context ({room})",
                        cont.context.len()
                    )))
                }
            }
            self.end(key, cont);
            return Ok(());
        }
        let segment = (cont.replayed.len() + cont.steps.len()) as u64;
        let p = SamplingParams {
            temperature: self.cfg.temperature,
            // A replayed head counts toward the segment's length.
            max_tokens: self
                .cfg
                .max_segment_tokens
                .saturating_sub(cont.head.len())
                .max(1),
            stop_tokens: self.cfg.segment_stop.clone(),
            seed: mix64(cont.seed ^ mix64(segment)),
            ..Default::default()
        };
        let id = self.engine.submit(cont.context.clone(), vec![p])?[0];
        self.in_engine.insert(id, (key, cont));
        Ok(())
    }

    /// A segment came out of the engine: step its environment.
    fn on_segment(&mut self, seg: Completion) -> Result<(), TrainError> {
        let (key, mut cont) = self
            .in_engine
            .remove(&seg.id)
            .ok_or_else(|| TrainError::Rollout(format!("unknown engine sequence {}", seg.id)))?;
        if let Some(e) = &seg.error {
            return Err(TrainError::Rollout(format!("generation failed: {e}")));
        }
        match &self.pool {
            Some(pool) => {
                let tx = pool.jobs.as_ref().expect("open while the pool lives");
                tx.send((key, cont, seg))
                    .map_err(|_| TrainError::Rollout("the env workers have stopped".into()))?;
                self.at_env += 1;
                Ok(())
            }
            None => {
                let t0 = Instant::now();
                apply_segment(&mut cont, seg, self.cfg, self.keep_snapshots)?;
                self.stats.env_s += t0.elapsed().as_secs_f64();
                self.after_env(key, cont)
            }
        }
    }

    /// Take answers from the env workers (waiting for one if `block`).
    fn drain_env(&mut self, block: bool) -> Result<(), TrainError> {
        let mut answers = Vec::new();
        if let Some(pool) = &self.pool {
            if block && self.at_env > 0 {
                answers.push(
                    pool.done
                        .recv()
                        .map_err(|_| TrainError::Rollout("the env workers have stopped".into()))?,
                );
            }
            answers.extend(pool.done.try_iter());
        }
        for (key, r, secs) in answers {
            self.at_env -= 1;
            self.stats.env_s += secs;
            self.after_env(key, r?)?;
        }
        Ok(())
    }

    /// After an environment step: the episode ended, or its next segment.
    fn after_env(&mut self, key: usize, cont: Box<Cont>) -> Result<(), TrainError> {
        if cont.steps.last().is_some_and(|s| s.reward.is_some()) {
            self.end(key, cont);
            Ok(())
        } else {
            self.submit(key, cont)
        }
    }

    fn end(&mut self, key: usize, cont: Box<Cont>) {
        self.stats.finished_episodes += 1;
        self.stats.tool_calls += cont.env.tool_calls() as u64;
        if let Some(c) = cont.env.context_stats() {
            self.stats.context.add(&c);
        }
        self.ended.push((key, cont));
    }
}

impl Drop for Scheduler<'_> {
    fn drop(&mut self) {
        // Continuations still in the engine (an error ended the rollout)
        // are dropped there, so the engine can be used again.
        for id in self.in_engine.keys().copied().collect::<Vec<_>>() {
            let _ = self.engine.abort(id);
        }
        let _ = self.engine.take_finished();
        *self.seed = self
            .base_seed
            .wrapping_add(self.launched as u64)
            .wrapping_add(1);
    }
}
