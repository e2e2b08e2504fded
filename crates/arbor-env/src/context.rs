//! A bounded context for the small-vocabulary tasks: compaction and
//! workspace memory on the token surface, so a tiny model can learn to
//! manage its own context on a CPU.
//!
//! [`BoundedContext`] wraps a token-level [`Env`] (one with a
//! [`SmallVocab`]) and keeps its context within
//! [`BoundedConfig::context_tokens`]. The context is counted exactly: the
//! initial observation, then every action and observation. When the next
//! observation would leave less than [`BoundedConfig::reserve`] tokens for
//! the policy's next turn, what happens depends on [`Compaction`]:
//!
//! | mode | at a full context | the next context |
//! |---|---|---|
//! | `none` | the episode ends, reward 0 (an overflow) | - |
//! | `free_form` | the observation is `<compact>`; the policy's next turn is its summary (any tokens, [`TokenKind::ContextManagement`]) | `task ++ <memo> summary <eos> ++ withheld observation` |
//! | `structured` | as free-form; the summary must hold the four sections `<task> .. <progress> .. <state> .. <next> ..` in order | as free-form |
//! | `workspace` | the observation is `<compact>`; the policy's next turn may store a value, `<put> key value..` | `task ++ <reset> ++ withheld observation`; the policy reads its memory back with `<load> key` |
//!
//! `task` is the inner environment's initial observation. The restart
//! observation has [`Observation::restart`] set, so the trainer replaces the
//! policy's context with it: a segment boundary FOCUS can fork from and
//! back values up through. The workspace tools are available on every turn
//! in `workspace` mode: `<put> k v..` answers `<ok>`, `<load> k` answers
//! `<memo> v..`. A malformed summary, a summary longer than the room the
//! restart leaves, a `<load>` of a key never stored, and a compaction past
//! [`BoundedConfig::max_compactions`] end the episode with reward 0 and are
//! counted in [`ContextStats`]; the run goes on.
//!
//! ```
//! use arbor_env::context::{BoundedConfig, BoundedContext, Compaction};
//! use arbor_env::synthetic::{RunningSum, RunningSumConfig};
//! use arbor_env::Env;
//!
//! let inner = RunningSum::new(RunningSumConfig::tokens(12), 3)?;
//! let answers = inner.oracle_actions();
//! let cfg = BoundedConfig::new(16, Compaction::FreeForm, 4);
//! let mut env = BoundedContext::new(Box::new(inner), cfg)?;
//! // The oracle answers, and summarises with the running sum when asked.
//! let (_, turns) = env.demonstrate(&answers)?;
//! assert_eq!(turns.last().unwrap().1.reward, 1.0);
//! let stats = env.context_stats().unwrap();
//! assert!(stats.compactions >= 2 && stats.summaries_kept_state == stats.compactions);
//! # Ok::<(), arbor_env::EnvError>(())
//! ```

use std::collections::BTreeMap;

use arbor_rl::TokenKind;
use serde::{Deserialize, Serialize};

use crate::env::{Action, Env, Observation, StepOutcome};
use crate::error::{EnvError, Result};
use crate::synthetic::strip_token_action;
use crate::vocab::{SmallVocab, COMPACT, EOS, ERR, LOAD, MEMO, OK, PUT, RESET, SECTIONS};

/// What the policy does when its context is full.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Compaction {
    /// Nothing: the episode ends at a full context (reward 0).
    #[default]
    None,
    /// The policy writes a free-form summary; the context restarts from the
    /// task and the summary.
    FreeForm,
    /// The policy writes a four-section summary (task, progress, state,
    /// next steps); the context restarts from the task and the summary.
    Structured,
    /// The policy keeps an in-memory workspace with put / load tools (and
    /// is asked to save when the context is full); the context restarts
    /// from the task alone.
    Workspace,
}

impl Compaction {
    /// The config name (`none`, `free_form`, `structured`, `workspace`).
    pub fn name(self) -> &'static str {
        match self {
            Compaction::None => "none",
            Compaction::FreeForm => "free_form",
            Compaction::Structured => "structured",
            Compaction::Workspace => "workspace",
        }
    }
}

/// Context-management counts of one episode (or, summed, of many).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ContextStats {
    /// Compactions done (summaries accepted, workspace saves).
    pub compactions: u64,
    /// Policy tokens spent on summaries and saves.
    pub summary_tokens: u64,
    /// Context restarts (one per compaction, plus any workspace reset).
    pub context_resets: u64,
    /// Task actions and tool calls the policy made after its first
    /// compaction.
    pub calls_after_compaction: u64,
    /// Episodes that ended on the first action after a compaction (the
    /// spec's failure mode: submitting right after a compaction).
    pub ended_after_compaction: u64,
    /// Summaries that were malformed or left no room (episode ended).
    pub malformed_summaries: u64,
    /// Loads of a workspace key never stored (episode ended).
    pub missing_keys: u64,
    /// Episodes that ended at a full context (`none`).
    pub overflows: u64,
    /// Episodes that ended at the compaction limit.
    pub compaction_limit: u64,
    /// Compactions whose summary (or workspace) was checked against the
    /// task's state, and those that carried it.
    pub summaries_checked: u64,
    pub summaries_kept_state: u64,
}

impl ContextStats {
    /// Number of counts ([`ContextStats::counts`]).
    pub const N: usize = 11;

    /// The counts in field order (for reductions across processes).
    pub fn counts(&self) -> [u64; Self::N] {
        [
            self.compactions,
            self.summary_tokens,
            self.context_resets,
            self.calls_after_compaction,
            self.ended_after_compaction,
            self.malformed_summaries,
            self.missing_keys,
            self.overflows,
            self.compaction_limit,
            self.summaries_checked,
            self.summaries_kept_state,
        ]
    }

    /// The inverse of [`ContextStats::counts`].
    pub fn from_counts(c: [u64; Self::N]) -> Self {
        ContextStats {
            compactions: c[0],
            summary_tokens: c[1],
            context_resets: c[2],
            calls_after_compaction: c[3],
            ended_after_compaction: c[4],
            malformed_summaries: c[5],
            missing_keys: c[6],
            overflows: c[7],
            compaction_limit: c[8],
            summaries_checked: c[9],
            summaries_kept_state: c[10],
        }
    }

    /// Adds `o`'s counts to these.
    pub fn add(&mut self, o: &ContextStats) {
        let (a, b) = (self.counts(), o.counts());
        *self = ContextStats::from_counts(std::array::from_fn(|i| a[i] + b[i]));
    }
}

/// Configuration of [`BoundedContext`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BoundedConfig {
    /// Largest context, tokens.
    pub context_tokens: usize,
    /// What happens when it is full.
    pub compaction: Compaction,
    /// Compactions per episode; one more ends the episode (reward 0).
    pub max_compactions: usize,
    /// Tokens kept free for the policy's next turn (its longest segment).
    pub reserve: usize,
}

impl BoundedConfig {
    /// `context_tokens` with `compaction`, a reserve of `reserve` tokens
    /// and at most 64 compactions.
    pub fn new(context_tokens: usize, compaction: Compaction, reserve: usize) -> Self {
        BoundedConfig {
            context_tokens,
            compaction,
            max_compactions: 64,
            reserve,
        }
    }
}

/// The wrapper's own state (what replay rebuilds besides the inner env's).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
struct State {
    started: bool,
    done: bool,
    /// Tokens in the current context.
    context: usize,
    /// The inner env's initial observation (the task statement).
    task: Vec<u32>,
    /// The observation withheld while the policy summarises.
    pending: Option<Vec<u32>>,
    /// Turns since the latest restart (`None` before the first).
    since_restart: Option<usize>,
    memory: BTreeMap<u32, Vec<u32>>,
    /// Workspace tool calls.
    tool_calls: usize,
    stats: ContextStats,
}

/// A token env under a bounded context (see the module docs).
pub struct BoundedContext {
    inner: Box<dyn Env>,
    cfg: BoundedConfig,
    st: State,
}

impl std::fmt::Debug for BoundedContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BoundedContext")
            .field("task", &self.inner.task_id())
            .field("cfg", &self.cfg)
            .finish()
    }
}

/// Whether `run` occurs in `s` as a contiguous run.
fn contains(s: &[u32], run: &[u32]) -> bool {
    run.is_empty() || s.windows(run.len()).any(|w| w == run)
}

/// The four sections of a structured summary, or why it is malformed.
fn sections(summary: &[u32]) -> std::result::Result<[&[u32]; 4], String> {
    let mut at = [0usize; 4];
    for (i, m) in SECTIONS.iter().enumerate() {
        let n = summary.iter().filter(|&&t| t == *m).count();
        let pos = summary.iter().position(|&t| t == *m);
        match (n, pos) {
            (1, Some(p)) if i == 0 && p == 0 => at[i] = p,
            (1, Some(p)) if i > 0 && p > at[i - 1] => at[i] = p,
            _ => {
                return Err(format!(
                    "a structured summary needs `<task> .. <progress> .. <state> .. <next> ..`, \
                     each once and in order; got {}",
                    SmallVocab.decode_lossy(summary)
                ))
            }
        }
    }
    let part = |i: usize| {
        let end = at.get(i + 1).copied().unwrap_or(summary.len());
        &summary[at[i] + 1..end]
    };
    Ok([part(0), part(1), part(2), part(3)])
}

impl BoundedContext {
    /// Wraps the token env `inner`. Errors if it has no small vocabulary or
    /// the context cannot hold the reserve.
    pub fn new(inner: Box<dyn Env>, cfg: BoundedConfig) -> Result<Self> {
        if inner.vocab().is_none() {
            return Err(EnvError::protocol(
                inner.task_id(),
                "a bounded context on the token surface needs a small-vocabulary task",
            ));
        }
        if cfg.reserve == 0 || cfg.context_tokens <= cfg.reserve {
            return Err(EnvError::protocol(
                inner.task_id(),
                format!(
                    "context_tokens = {} must exceed the reserve for one turn ({}, > 0)",
                    cfg.context_tokens, cfg.reserve
                ),
            ));
        }
        Ok(BoundedContext {
            inner,
            cfg,
            st: State::default(),
        })
    }

    /// The wrapped env.
    pub fn inner(&self) -> &dyn Env {
        self.inner.as_ref()
    }

    /// The configuration.
    pub fn config(&self) -> &BoundedConfig {
        &self.cfg
    }

    /// Tokens in the current context.
    pub fn context_len(&self) -> usize {
        self.st.context
    }

    /// Whether the policy's next turn is a summary (or a workspace save).
    pub fn summarising(&self) -> bool {
        self.st.pending.is_some()
    }

    /// The action an oracle takes here, given the inner task's oracle
    /// action `inner_next` for its next turn: a summary holding
    /// [`Env::state_tokens`] when asked for one, a `<load>` of key 0 right
    /// after a workspace reset, else `inner_next`. Returns the action and
    /// whether it consumed `inner_next`.
    pub fn oracle(&self, inner_next: &Action) -> Result<(Action, bool)> {
        let state = || {
            self.inner.state_tokens().ok_or_else(|| {
                EnvError::protocol(
                    self.inner.task_id(),
                    "the task has no compact state to demonstrate a summary with",
                )
            })
        };
        if self.summarising() {
            let s = state()?;
            let mut a = match self.cfg.compaction {
                Compaction::Structured => {
                    let [t, p, st, n] = SECTIONS;
                    [t, p, st].into_iter().chain(s).chain([n]).collect()
                }
                Compaction::Workspace => [PUT, 0].into_iter().chain(s).collect(),
                _ => s,
            };
            a.push(EOS);
            return Ok((Action::Tokens(a), false));
        }
        if self.cfg.compaction == Compaction::Workspace
            && self.st.since_restart == Some(0)
            && self.st.memory.contains_key(&0)
        {
            return Ok((Action::Tokens(vec![LOAD, 0, EOS]), false));
        }
        Ok((inner_next.clone(), true))
    }

    /// Runs one episode from `reset` with the oracle ([`BoundedContext::oracle`])
    /// over the inner task's oracle actions `inner` (a demonstration):
    /// the first observation and every `(action, outcome)`.
    pub fn demonstrate(
        &mut self,
        inner: &[Action],
    ) -> Result<(Observation, Vec<(Action, StepOutcome)>)> {
        let first = self.reset()?;
        let mut turns = Vec::new();
        let mut next = inner.iter();
        let mut pending = next.next();
        while !self.st.done {
            let Some(want) = pending else {
                return Err(EnvError::protocol(
                    self.inner.task_id(),
                    "the oracle ran out of actions before the episode ended",
                ));
            };
            let (a, used) = self.oracle(want)?;
            if used {
                pending = next.next();
            }
            let out = self.step(&a)?;
            turns.push((a, out));
        }
        Ok((first, turns))
    }

    fn end(&mut self, obs: Vec<u32>, error: String) -> StepOutcome {
        self.st.done = true;
        StepOutcome::last(Observation::tokens(&SmallVocab, obs), 0.0, Some(error))
    }

    /// Whether `summary` (or the workspace) carries the task's state.
    fn kept_state(&self, summary: &[u32]) -> Option<bool> {
        let s = self.inner.state_tokens()?;
        Some(match self.cfg.compaction {
            Compaction::Structured => sections(summary).is_ok_and(|p| contains(p[2], &s)),
            Compaction::Workspace => self.st.memory.values().any(|v| contains(v, &s)),
            _ => contains(summary, &s),
        })
    }

    /// The policy's summary (or workspace save) turn: restart the context.
    fn compact(&mut self, action: &[u32]) -> Result<StepOutcome> {
        let pending = self.st.pending.take().unwrap_or_default();
        let summary = strip_token_action(action);
        let mut restart = self.st.task.clone();
        let malformed = match self.cfg.compaction {
            Compaction::FreeForm if summary.is_empty() => Some("an empty summary".to_string()),
            Compaction::FreeForm => None,
            Compaction::Structured => sections(&summary).err(),
            Compaction::Workspace if summary.is_empty() => None,
            Compaction::Workspace => match self.workspace_call(&summary) {
                Some(Ok(_)) if summary[0] == PUT => None,
                _ => Some(format!(
                    "a save must be `<put> key value..` (or nothing); got {}",
                    SmallVocab.decode_lossy(&summary)
                )),
            },
            Compaction::None => Some("no compaction was asked for".to_string()),
        };
        if let Some(e) = malformed {
            self.st.stats.malformed_summaries += 1;
            return Ok(self.end(Vec::new(), format!("malformed summary: {e}")));
        }
        if self.cfg.compaction == Compaction::Workspace {
            restart.push(RESET);
        } else {
            restart.push(MEMO);
            restart.extend(&summary);
            restart.push(EOS);
        }
        restart.extend(&pending);
        if restart.len() + self.cfg.reserve > self.cfg.context_tokens {
            self.st.stats.malformed_summaries += 1;
            return Ok(self.end(
                Vec::new(),
                format!(
                    "a summary of {} tokens leaves no room: the restart context would be {} of \
                     {} tokens with {} kept for the next turn",
                    summary.len(),
                    restart.len(),
                    self.cfg.context_tokens,
                    self.cfg.reserve
                ),
            ));
        }
        let st = &mut self.st.stats;
        st.compactions += 1;
        st.context_resets += 1;
        st.summary_tokens += action.len() as u64;
        if let Some(kept) = self.kept_state(&summary) {
            let st = &mut self.st.stats;
            st.summaries_checked += 1;
            st.summaries_kept_state += u64::from(kept);
        }
        self.st.since_restart = Some(0);
        self.st.context = restart.len();
        Ok(StepOutcome::next(
            Observation {
                text: SmallVocab.decode_lossy(&restart),
                tokens: Some(restart),
                restart: true,
                next: TokenKind::Action,
            },
            None,
        ))
    }

    /// A workspace call (`<put> k v..` or `<load> k`): `None` if `call` is
    /// not one, else its observation or why it failed (`Err(true)`: a
    /// missing key).
    fn workspace_call(&mut self, call: &[u32]) -> Option<std::result::Result<Vec<u32>, bool>> {
        let key = call.get(1).copied().filter(|&k| k < 10);
        match (call.first().copied(), key) {
            (Some(PUT), Some(k)) if call.len() > 2 => {
                self.st.memory.insert(k, call[2..].to_vec());
                Some(Ok(vec![OK]))
            }
            (Some(LOAD), Some(k)) if call.len() == 2 => match self.st.memory.get(&k) {
                Some(v) => Some(Ok(std::iter::once(MEMO).chain(v.clone()).collect())),
                None => Some(Err(true)),
            },
            (Some(PUT | LOAD), _) => Some(Err(false)),
            _ => None,
        }
    }
}

impl Env for BoundedContext {
    fn task_id(&self) -> &str {
        self.inner.task_id()
    }

    fn reset(&mut self) -> Result<Observation> {
        let first = self.inner.reset()?;
        let task = first.tokens.clone().unwrap_or_default();
        if task.len() + self.cfg.reserve > self.cfg.context_tokens {
            return Err(EnvError::protocol(
                self.inner.task_id(),
                format!(
                    "the task's first observation ({} tokens) leaves no room for a turn in a \
                     context of {} tokens",
                    task.len(),
                    self.cfg.context_tokens
                ),
            ));
        }
        self.st = State {
            started: true,
            context: task.len(),
            task,
            ..State::default()
        };
        Ok(first)
    }

    fn step(&mut self, action: &Action) -> Result<StepOutcome> {
        if !self.st.started || self.st.done {
            return Err(EnvError::protocol(
                self.inner.task_id(),
                if self.st.done {
                    "step after the episode ended"
                } else {
                    "step before reset"
                },
            ));
        }
        let ids = match action {
            Action::Tokens(t) => t.clone(),
            Action::Text(s) => SmallVocab
                .encode(s)
                .map_err(|e| EnvError::protocol(self.inner.task_id(), e.to_string()))?,
        };
        if self.st.pending.is_some() {
            return self.compact(&ids);
        }
        let after = self.st.since_restart.is_some();
        let call = if self.cfg.compaction == Compaction::Workspace {
            self.workspace_call(&strip_token_action(&ids))
        } else {
            None
        };
        let (obs, error) = match call {
            Some(r) => {
                self.st.tool_calls += 1;
                self.st.stats.calls_after_compaction += u64::from(after);
                match r {
                    Ok(obs) => (obs, None),
                    Err(true) => {
                        self.st.stats.missing_keys += 1;
                        let k = SmallVocab.decode_lossy(&ids[1..2]);
                        return Ok(self.end(Vec::new(), format!("no workspace key `{k}`")));
                    }
                    Err(false) => (
                        vec![ERR],
                        Some("a workspace call is `<put> key value..` or `<load> key`".into()),
                    ),
                }
            }
            None => {
                let out = self.inner.step(action)?;
                self.st.stats.calls_after_compaction += u64::from(after);
                if out.done {
                    self.st.done = true;
                    if self.st.since_restart == Some(0) {
                        self.st.stats.ended_after_compaction += 1;
                    }
                    return Ok(out);
                }
                (out.observation.tokens.unwrap_or_default(), out.error)
            }
        };
        self.st.since_restart = self.st.since_restart.map(|n| n + 1);
        let context = self.st.context + ids.len() + obs.len();
        if context + self.cfg.reserve <= self.cfg.context_tokens {
            self.st.context = context;
            return Ok(StepOutcome::next(
                Observation::tokens(&SmallVocab, obs),
                error,
            ));
        }
        match self.cfg.compaction {
            Compaction::None => {
                self.st.stats.overflows += 1;
                Ok(self.end(
                    Vec::new(),
                    format!("the context of {} tokens is full", self.cfg.context_tokens),
                ))
            }
            _ if self.st.stats.compactions as usize >= self.cfg.max_compactions => {
                self.st.stats.compaction_limit += 1;
                Ok(self.end(
                    Vec::new(),
                    format!("compaction limit {} reached", self.cfg.max_compactions),
                ))
            }
            _ => {
                self.st.context += ids.len() + 1;
                self.st.pending = Some(obs);
                Ok(StepOutcome::next(
                    Observation {
                        text: SmallVocab.decode_lossy(&[COMPACT]),
                        tokens: Some(vec![COMPACT]),
                        restart: false,
                        next: TokenKind::ContextManagement,
                    },
                    error,
                ))
            }
        }
    }

    fn fork(&self) -> Option<Box<dyn Env>> {
        Some(Box::new(BoundedContext {
            inner: self.inner.fork()?,
            cfg: self.cfg.clone(),
            st: self.st.clone(),
        }))
    }

    fn fresh(&self) -> Result<Box<dyn Env>> {
        Ok(Box::new(BoundedContext::new(
            self.inner.fresh()?,
            self.cfg.clone(),
        )?))
    }

    fn vocab(&self) -> Option<&SmallVocab> {
        self.inner.vocab()
    }

    fn tool_calls(&self) -> usize {
        self.inner.tool_calls() + self.st.tool_calls
    }

    fn context_stats(&self) -> Option<ContextStats> {
        Some(self.st.stats.clone())
    }

    fn state_tokens(&self) -> Option<Vec<u32>> {
        self.inner.state_tokens()
    }

    fn summary(&self) -> String {
        let s = &self.st.stats;
        format!(
            "{} | context {}/{} tokens ({}), {} compactions, {} workspace calls",
            self.inner.summary(),
            self.st.context,
            self.cfg.context_tokens,
            self.cfg.compaction.name(),
            s.compactions,
            self.st.tool_calls
        )
    }

    fn state_bytes(&self) -> Result<Vec<u8>> {
        let mut b = crate::synthetic::json_state(self.inner.task_id(), &self.st)?;
        b.push(0);
        b.extend(self.inner.state_bytes()?);
        Ok(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::Episode;
    use crate::synthetic::{RunningSum, RunningSumConfig};

    fn bounded(k: usize, ctx: usize, mode: Compaction) -> (BoundedContext, Vec<Action>) {
        let inner = RunningSum::new(RunningSumConfig::tokens(k), 11).unwrap();
        let oracle = inner.oracle_actions();
        let env = BoundedContext::new(Box::new(inner), BoundedConfig::new(ctx, mode, 6)).unwrap();
        (env, oracle)
    }

    fn toks(a: &[u32]) -> Action {
        Action::Tokens(a.to_vec())
    }

    #[test]
    fn the_oracle_solves_every_mode_within_the_context() {
        for mode in [
            Compaction::FreeForm,
            Compaction::Structured,
            Compaction::Workspace,
        ] {
            let (mut env, oracle) = bounded(16, 24, mode);
            let (first, turns) = env.demonstrate(&oracle).unwrap();
            let last = &turns.last().unwrap().1;
            assert_eq!(last.reward, 1.0, "{mode:?}: {:?}", last.error);
            // Replaying the context as the trainer does never exceeds it.
            let mut ctx = first.tokens.unwrap().len();
            let mut restarts = 0;
            for (a, out) in &turns {
                let Action::Tokens(a) = a else { panic!() };
                let obs = out.observation.tokens.as_ref().unwrap().len();
                if out.observation.restart {
                    restarts += 1;
                    ctx = obs;
                } else {
                    ctx += a.len() + obs;
                }
                assert!(ctx <= 24, "{mode:?}: context {ctx}");
            }
            let s = env.context_stats().unwrap();
            assert!(s.compactions >= 2, "{mode:?}: {s:?}");
            assert_eq!(s.context_resets as usize, restarts);
            assert_eq!(s.summaries_kept_state, s.compactions, "{mode:?}");
            assert_eq!(s.malformed_summaries + s.overflows + s.missing_keys, 0);
            assert!(s.calls_after_compaction > 0);
        }
    }

    #[test]
    fn a_summary_is_a_trained_context_management_turn_and_replays() {
        let (env, oracle) = bounded(12, 16, Compaction::FreeForm);
        let mut ep = Episode::new(Box::new(env));
        ep.reset().unwrap();
        let mut answers = oracle.iter();
        let mut asked = false;
        while !ep.is_done() {
            let a = if ep.next_kind() == Some(TokenKind::ContextManagement) {
                asked = true;
                let s = ep.env().state_tokens().unwrap();
                toks(&[s[0], EOS])
            } else {
                answers.next().unwrap().clone()
            };
            let out = ep.step(a).unwrap();
            if asked && out.observation.restart {
                // Task, summary, and the withheld next digit.
                let t = out.observation.tokens.as_ref().unwrap();
                assert_eq!(&t[2..3], &[MEMO]);
                assert_eq!(t[4], EOS);
                let segs = ep.segments();
                let s = &segs[segs.len() - 1];
                assert_eq!(s.policy.kind, TokenKind::ContextManagement);
                assert!(s.restart);
                let re = ep.replay_prefix(ep.actions().len()).unwrap();
                assert_eq!(
                    re.env().state_bytes().unwrap(),
                    ep.env().state_bytes().unwrap()
                );
                let mut fork = ep.fork().unwrap();
                fork.step(toks(&[0, EOS])).unwrap();
                assert_ne!(
                    fork.env().state_bytes().unwrap(),
                    ep.env().state_bytes().unwrap()
                );
            }
        }
        assert!(asked);
        assert_eq!(ep.total_reward(), 1.0);
    }

    /// Steps the oracle's answers until a summary is asked for.
    fn until_asked(env: &mut BoundedContext, oracle: &[Action]) -> usize {
        env.reset().unwrap();
        for (i, a) in oracle.iter().enumerate() {
            let out = env.step(a).unwrap();
            if out.observation.next == TokenKind::ContextManagement {
                return i + 1;
            }
        }
        panic!("never asked for a summary");
    }

    #[test]
    fn bad_summaries_missing_keys_and_overflows_end_the_episode() {
        let cases: [(Compaction, &[u32], &str); 5] = [
            (Compaction::FreeForm, &[EOS], "empty summary"),
            (
                Compaction::Structured,
                &[3, EOS],
                "structured summary needs",
            ),
            (
                Compaction::Structured,
                &[28, 27, 29, 3, 30, EOS],
                "each once and in order",
            ),
            (Compaction::FreeForm, &[1; 15], "no room"),
            (Compaction::Workspace, &[LOAD, 3, EOS], "a save must be"),
        ];
        for (mode, summary, want) in cases {
            let (mut env, oracle) = bounded(16, 24, mode);
            until_asked(&mut env, &oracle);
            let out = env.step(&toks(summary)).unwrap();
            assert!(out.done && out.reward == 0.0);
            assert!(out.error.as_deref().unwrap().contains(want), "{out:?}");
            assert_eq!(env.context_stats().unwrap().malformed_summaries, 1);
            assert!(env.step(&toks(&[0])).is_err(), "the episode is over");
        }
        // A load of a key never stored.
        let (mut env, _) = bounded(16, 24, Compaction::Workspace);
        env.reset().unwrap();
        let out = env.step(&toks(&[LOAD, 4, EOS])).unwrap();
        assert!(out.done && out.reward == 0.0);
        assert!(out.error.unwrap().contains("no workspace key `4`"));
        assert_eq!(env.context_stats().unwrap().missing_keys, 1);
        // Put, load, and a malformed call that only errs.
        let (mut env, _) = bounded(16, 40, Compaction::Workspace);
        env.reset().unwrap();
        let out = env.step(&toks(&[PUT, 2, 7, 7, EOS])).unwrap();
        assert_eq!(out.observation.tokens.unwrap(), vec![OK]);
        let out = env.step(&toks(&[LOAD, 2, EOS])).unwrap();
        assert_eq!(out.observation.tokens.unwrap(), vec![MEMO, 7, 7]);
        let out = env.step(&toks(&[PUT, EOS])).unwrap();
        assert!(!out.done && out.observation.tokens.unwrap() == vec![ERR]);
        assert_eq!(env.tool_calls(), 3);
        // No compaction: the episode ends at a full context.
        let (mut env, oracle) = bounded(16, 24, Compaction::None);
        env.reset().unwrap();
        let mut last = None;
        for a in &oracle {
            let out = env.step(a).unwrap();
            if out.done {
                last = Some(out);
                break;
            }
        }
        let last = last.unwrap();
        assert_eq!(last.reward, 0.0);
        assert!(last.error.unwrap().contains("context of 24 tokens is full"));
        assert_eq!(env.context_stats().unwrap().overflows, 1);
    }

    #[test]
    fn the_compaction_limit_and_bad_configs() {
        let inner = RunningSum::new(RunningSumConfig::tokens(16), 11).unwrap();
        let oracle = inner.oracle_actions();
        let cfg = BoundedConfig {
            max_compactions: 1,
            ..BoundedConfig::new(24, Compaction::FreeForm, 6)
        };
        let mut env = BoundedContext::new(Box::new(inner), cfg).unwrap();
        let (_, turns) = env.demonstrate(&oracle).unwrap();
        let last = &turns.last().unwrap().1;
        assert_eq!(last.reward, 0.0);
        assert!(last
            .error
            .as_deref()
            .unwrap()
            .contains("compaction limit 1"));
        assert_eq!(env.context_stats().unwrap().compaction_limit, 1);
        let inner = RunningSum::new(RunningSumConfig::tokens(4), 1).unwrap();
        let e = BoundedContext::new(Box::new(inner), BoundedConfig::new(6, Compaction::None, 6))
            .unwrap_err();
        assert!(e.to_string().contains("must exceed the reserve"), "{e}");
        let text =
            RunningSum::new(RunningSumConfig::text(4, crate::chat::ChatFormat::Plain), 1).unwrap();
        assert!(
            BoundedContext::new(Box::new(text), BoundedConfig::new(60, Compaction::None, 6))
                .is_err()
        );
    }
}
