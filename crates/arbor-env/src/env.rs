//! The multi-turn environment interface.
//!
//! An [`Env`] is one task instance. [`Env::reset`] returns the initial
//! observation; [`Env::step`] takes the policy's output (an [`Action`]: text,
//! or token ids for environments with a built-in [`SmallVocab`]) and returns
//! the next observation, the reward and whether the episode is done. Every
//! step boundary is a *resumable state*: [`Env::fork`] clones it where that is
//! cheap, and [`replay`] rebuilds it anywhere by re-executing the recorded
//! action list through the same parser and executor (Prefix Sampling's
//! replay-through-execution).
//!
//! The context contract, identical for every environment: the policy's
//! context is `obs_0 ++ act_1 ++ obs_1 ++ act_2 ++ ...`, where every
//! observation is appended verbatim after the action before it, except that
//! an observation with [`Observation::restart`] set *replaces* the context
//! (a context compaction: the harness restarts from the policy's summary).
//! Observations are masked out of the loss; actions are trained, with the
//! kind [`Observation::next`] announces (a task action, or context
//! management when the policy is asked to write a compaction summary).
//!
//! [`Episode`] wraps an env, records the transcript and exposes it per
//! segment with token kinds (the loss masks). It is synchronous: the trainer
//! drives episodes in batches from its own loop.
//!
//! ```
//! use arbor_env::{Action, Episode};
//! use arbor_env::synthetic::{RunningSum, RunningSumConfig};
//!
//! let env = RunningSum::new(RunningSumConfig::tokens(3), 7)?;
//! let digits = env.digits().to_vec();
//! let mut ep = Episode::new(Box::new(env));
//! let first = ep.reset()?;
//! assert_eq!(first.tokens.as_deref().map(|t| t.len()), Some(2)); // <bos>, d1
//! let mut sum = 0;
//! for d in digits {
//!     sum = (sum + d) % 10;
//!     let out = ep.step(Action::Tokens(vec![u32::from(sum)]))?;
//!     if out.done {
//!         assert_eq!(out.reward, 1.0);
//!     }
//! }
//! // Rebuild the state from the recorded actions.
//! let again = ep.replay_prefix(ep.actions().len())?;
//! assert_eq!(again.turns(), ep.turns());
//! # Ok::<(), arbor_env::EnvError>(())
//! ```

use arbor_rl::TokenKind;
use serde::{Deserialize, Serialize};

use crate::error::{EnvError, Result};
use crate::vocab::SmallVocab;

/// One policy output: the text it generated, or its token ids (accepted by
/// environments with a built-in vocabulary, see [`Env::vocab`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Generated text, verbatim (stop strings may or may not be included).
    Text(String),
    /// Generated token ids of the environment's [`SmallVocab`].
    Tokens(Vec<u32>),
}

impl Action {
    /// A text action.
    pub fn text(s: impl Into<String>) -> Self {
        Action::Text(s.into())
    }

    /// The action as text: text verbatim, tokens decoded with `vocab`.
    /// Token actions without a vocabulary (or with ids outside it) are an
    /// error naming `task`.
    pub fn to_text(&self, vocab: Option<&SmallVocab>, task: &str) -> Result<String> {
        match (self, vocab) {
            (Action::Text(s), _) => Ok(s.clone()),
            (Action::Tokens(t), Some(v)) => v
                .decode(t)
                .map_err(|e| EnvError::protocol(task, e.to_string())),
            (Action::Tokens(_), None) => Err(EnvError::protocol(
                task,
                "token actions need an environment with a built-in vocabulary; \
                 decode the tokens with your tokenizer and send Action::Text",
            )),
        }
    }
}

/// What the environment shows the policy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Observation {
    /// Text appended to the context (chat scaffolding included when the env
    /// uses a chat format).
    pub text: String,
    /// The same observation as token ids of the env's [`SmallVocab`]; `None`
    /// for text environments (tokenise `text` with the model's tokenizer).
    pub tokens: Option<Vec<u32>>,
    /// The context restarts from this observation instead of appending to it
    /// (context compaction). Always a segment boundary.
    pub restart: bool,
    /// The kind of the policy's next output: [`TokenKind::Action`] for a task
    /// turn, [`TokenKind::ContextManagement`] when it is asked to write a
    /// compaction summary. Both are trained.
    pub next: TokenKind,
}

impl Observation {
    /// A text observation appended to the context; the next turn is a task
    /// action.
    pub fn text(text: impl Into<String>) -> Self {
        Observation {
            text: text.into(),
            tokens: None,
            restart: false,
            next: TokenKind::Action,
        }
    }

    /// A token observation of a small-vocabulary env (text is its decoding).
    pub fn tokens(vocab: &SmallVocab, tokens: Vec<u32>) -> Self {
        Observation {
            text: vocab.decode_lossy(&tokens),
            tokens: Some(tokens),
            restart: false,
            next: TokenKind::Action,
        }
    }
}

/// The result of one [`Env::step`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepOutcome {
    /// The environment's response (empty text and tokens at the end).
    pub observation: Observation,
    /// Reward of this transition. Outcome-reward tasks give the verified
    /// reward in [0, 1] on the final step and 0 before.
    pub reward: f64,
    /// The episode is over; further steps are a protocol error.
    pub done: bool,
    /// Why the action was not executed as intended (malformed tool call,
    /// unknown tool, wrong answer format, sandbox limit hit). The episode goes
    /// on; the observation tells the policy.
    pub error: Option<String>,
}

impl StepOutcome {
    /// A non-final step with reward 0.
    pub fn next(observation: Observation, error: Option<String>) -> Self {
        StepOutcome {
            observation,
            reward: 0.0,
            done: false,
            error,
        }
    }

    /// The final step with the verified reward.
    pub fn last(observation: Observation, reward: f64, error: Option<String>) -> Self {
        StepOutcome {
            observation,
            reward,
            done: true,
            error,
        }
    }
}

/// One task instance that a policy interacts with for one episode at a time.
///
/// Implementations must be deterministic given the task (and its seed):
/// `reset` followed by the same actions yields the same observations,
/// rewards and [`Env::state_bytes`]. That is what makes [`replay`] a faithful
/// way to rebuild a resumable state.
pub trait Env: Send {
    /// A stable identifier of the task instance (dataset id, or the synthetic
    /// task's name, difficulty and seed).
    fn task_id(&self) -> &str;

    /// Starts (or restarts) the episode and returns the initial observation.
    fn reset(&mut self) -> Result<Observation>;

    /// Executes one policy output. Malformed outputs yield an error
    /// observation (see [`StepOutcome::error`]), not an `Err`; `Err` is for
    /// protocol misuse (before `reset`, after `done`) and infrastructure
    /// failures.
    fn step(&mut self, action: &Action) -> Result<StepOutcome>;

    /// A copy of the current state, independent of `self`, where that is
    /// cheap; `None` where it is not (use [`replay`] instead).
    fn fork(&self) -> Option<Box<dyn Env>>;

    /// A new instance of the same task, before `reset`.
    fn fresh(&self) -> Result<Box<dyn Env>>;

    /// The built-in vocabulary of a token-level env (`None`: text only).
    fn vocab(&self) -> Option<&SmallVocab> {
        None
    }

    /// Tool calls executed so far in this episode (malformed or failed
    /// calls not counted; 0 for tasks without tools). The trainer reports
    /// their mean per finished trajectory.
    fn tool_calls(&self) -> usize {
        0
    }

    /// Context-management counts of the current episode, for environments
    /// that bound the context (compactions, resets, malformed summaries;
    /// see [`crate::context::ContextStats`]). `None` for the others.
    fn context_stats(&self) -> Option<crate::context::ContextStats> {
        None
    }

    /// The task state a compaction summary must carry for the episode to
    /// go on (the running sum so far, on the token surface), where the
    /// task has a compact one: what a summary is checked against. `None`
    /// by default.
    fn state_tokens(&self) -> Option<Vec<u32>> {
        None
    }

    /// Whether `replayed`, the observation an action produces when it is
    /// executed again, counts as `recorded`, the one it produced before
    /// (Prefix Sampling's replay through execution). Exact by default;
    /// tool environments ignore what differs between two runs of the same
    /// command (durations).
    fn same_observation(&self, recorded: &str, replayed: &str) -> bool {
        recorded == replayed
    }

    /// A human-readable summary of the current state (what `arbor replay`
    /// prints).
    fn summary(&self) -> String;

    /// A canonical serialisation of the whole environment state (workspace
    /// files included), for byte-equality checks of replay and forks.
    fn state_bytes(&self) -> Result<Vec<u8>>;
}

impl std::fmt::Debug for dyn Env {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Env({})", self.task_id())
    }
}

/// Rebuilds a state by resetting `env` and re-executing `actions` through its
/// parser and executor, in order. Returns the initial observation and the
/// outcomes of every step. An action after the episode ended is an error.
pub fn replay(env: &mut dyn Env, actions: &[Action]) -> Result<(Observation, Vec<StepOutcome>)> {
    let first = env.reset()?;
    let mut outs = Vec::with_capacity(actions.len());
    for (i, a) in actions.iter().enumerate() {
        if outs.last().is_some_and(|o: &StepOutcome| o.done) {
            return Err(EnvError::protocol(
                env.task_id(),
                format!(
                    "replay: action {i} of {} comes after the episode ended",
                    actions.len()
                ),
            ));
        }
        outs.push(env.step(a)?);
    }
    Ok((first, outs))
}

/// A run of context with one token kind.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Span {
    /// Who produced it (the loss mask is [`TokenKind::is_trained`]).
    pub kind: TokenKind,
    /// Its text.
    pub text: String,
    /// Its token ids, for token-level envs (policy token actions, or
    /// small-vocabulary observations).
    pub tokens: Option<Vec<u32>>,
}

/// One recorded step: the policy's action and the environment's outcome.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Turn {
    /// What the policy produced.
    pub action: Action,
    /// The kind the action was trained as ([`TokenKind::Action`] or
    /// [`TokenKind::ContextManagement`]).
    pub kind: TokenKind,
    /// What the environment answered.
    pub outcome: StepOutcome,
}

/// One segment of an episode: a policy span and the environment's response,
/// from one resumable state to the next (the edge of the rollout tree).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SegmentSpans {
    /// Index of the step (0-based).
    pub index: usize,
    /// The policy's output (trained).
    pub policy: Span,
    /// The environment's response (masked; empty at the end of an episode).
    pub observation: Span,
    /// The response restarts the context (a compaction boundary).
    pub restart: bool,
    /// Reward of the transition.
    pub reward: f64,
    /// The episode ended here.
    pub done: bool,
}

/// A recorded episode, serialisable: the input of `arbor replay`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Trajectory {
    /// The task the actions were taken in.
    pub task: String,
    /// The action list, in order.
    pub actions: Vec<Action>,
    /// Rewards per step as recorded (checked against the replay when
    /// present).
    #[serde(default)]
    pub rewards: Vec<f64>,
}

/// An environment plus the transcript of the current episode. Synchronous.
pub struct Episode {
    env: Box<dyn Env>,
    initial: Option<Observation>,
    turns: Vec<Turn>,
    actions: Vec<Action>,
}

impl std::fmt::Debug for Episode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Episode")
            .field("task", &self.env.task_id())
            .field("steps", &self.turns.len())
            .field("done", &self.is_done())
            .finish()
    }
}

impl Episode {
    /// Wraps `env` (not yet reset).
    pub fn new(env: Box<dyn Env>) -> Self {
        Episode {
            env,
            initial: None,
            turns: Vec::new(),
            actions: Vec::new(),
        }
    }

    /// Resets the env and clears the transcript.
    pub fn reset(&mut self) -> Result<Observation> {
        let obs = self.env.reset()?;
        self.initial = Some(obs.clone());
        self.turns.clear();
        self.actions.clear();
        Ok(obs)
    }

    /// One step. Errors before `reset` and after the episode ended.
    pub fn step(&mut self, action: Action) -> Result<StepOutcome> {
        let Some(kind) = self.next_kind() else {
            return Err(EnvError::protocol(
                self.env.task_id(),
                "step called before reset",
            ));
        };
        if self.is_done() {
            return Err(EnvError::protocol(
                self.env.task_id(),
                format!(
                    "step called after the episode ended ({} steps)",
                    self.turns.len()
                ),
            ));
        }
        let outcome = self.env.step(&action)?;
        self.actions.push(action.clone());
        self.turns.push(Turn {
            action,
            kind,
            outcome: outcome.clone(),
        });
        Ok(outcome)
    }

    /// Drives the episode to its end with `policy`, which sees the latest
    /// observation and returns the next action; at most `max_steps` steps.
    /// Returns the summed reward.
    pub fn run(
        &mut self,
        max_steps: usize,
        mut policy: impl FnMut(&Observation) -> Result<Action>,
    ) -> Result<f64> {
        let mut obs = match self.latest_observation() {
            Some(o) if !self.is_done() => o.clone(),
            _ => self.reset()?,
        };
        for _ in 0..max_steps {
            if self.is_done() {
                break;
            }
            let a = policy(&obs)?;
            obs = self.step(a)?.observation;
        }
        Ok(self.total_reward())
    }

    /// The kind of the next policy output (`None` before reset).
    pub fn next_kind(&self) -> Option<TokenKind> {
        self.latest_observation().map(|o| o.next)
    }

    /// The observation the policy answers next (`None` before reset).
    pub fn latest_observation(&self) -> Option<&Observation> {
        match self.turns.last() {
            Some(t) => Some(&t.outcome.observation),
            None => self.initial.as_ref(),
        }
    }

    /// True once a step returned `done`.
    pub fn is_done(&self) -> bool {
        self.turns.last().is_some_and(|t| t.outcome.done)
    }

    /// Sum of the step rewards so far.
    pub fn total_reward(&self) -> f64 {
        self.turns.iter().map(|t| t.outcome.reward).sum()
    }

    /// The initial observation (`None` before reset).
    pub fn initial(&self) -> Option<&Observation> {
        self.initial.as_ref()
    }

    /// The recorded steps.
    pub fn turns(&self) -> &[Turn] {
        &self.turns
    }

    /// The recorded action list (what [`Episode::replay_prefix`] and
    /// `arbor replay` re-execute).
    pub fn actions(&self) -> &[Action] {
        &self.actions
    }

    /// The wrapped env.
    pub fn env(&self) -> &dyn Env {
        self.env.as_ref()
    }

    /// The wrapped env, mutably (for env-specific queries).
    pub fn env_mut(&mut self) -> &mut dyn Env {
        self.env.as_mut()
    }

    /// The serialisable record of this episode.
    pub fn trajectory(&self) -> Trajectory {
        Trajectory {
            task: self.env.task_id().to_string(),
            actions: self.actions.clone(),
            rewards: self.turns.iter().map(|t| t.outcome.reward).collect(),
        }
    }

    /// An independent copy of the current state: the env's cheap
    /// [`Env::fork`] when it has one, otherwise a fresh instance rebuilt by
    /// [`replay`].
    pub fn fork(&self) -> Result<Episode> {
        match self.env.fork() {
            Some(env) => Ok(Episode {
                env,
                initial: self.initial.clone(),
                turns: self.turns.clone(),
                actions: self.actions.clone(),
            }),
            None => self.replay_prefix(self.actions.len()),
        }
    }

    /// A new episode on a fresh instance of the task with the first `n`
    /// recorded actions replayed through the executor (Prefix Sampling).
    /// The replayed turns keep the kinds they had.
    pub fn replay_prefix(&self, n: usize) -> Result<Episode> {
        if n > self.actions.len() {
            return Err(EnvError::protocol(
                self.env.task_id(),
                format!(
                    "replay prefix of {n} actions, only {} recorded",
                    self.actions.len()
                ),
            ));
        }
        Episode::replay(self.env.fresh()?, &self.actions[..n])
    }

    /// Resets `env` and replays `actions` into a new episode.
    pub fn replay(env: Box<dyn Env>, actions: &[Action]) -> Result<Episode> {
        let mut ep = Episode::new(env);
        ep.reset()?;
        for a in actions {
            if ep.is_done() {
                return Err(EnvError::protocol(
                    ep.env.task_id(),
                    format!(
                        "replay: {} actions, but the episode ended after {}",
                        actions.len(),
                        ep.turns.len()
                    ),
                ));
            }
            ep.step(a.clone())?;
        }
        Ok(ep)
    }

    fn action_span(&self, t: &Turn) -> Span {
        let vocab = self.env.vocab();
        match &t.action {
            Action::Text(s) => Span {
                kind: t.kind,
                text: s.clone(),
                tokens: None,
            },
            Action::Tokens(ids) => Span {
                kind: t.kind,
                text: vocab.map(|v| v.decode_lossy(ids)).unwrap_or_default(),
                tokens: Some(ids.clone()),
            },
        }
    }

    fn observation_span(o: &Observation) -> Span {
        Span {
            kind: TokenKind::Observation,
            text: o.text.clone(),
            tokens: o.tokens.clone(),
        }
    }

    /// The episode per segment: each step's policy span (trained, with its
    /// kind) and the observation that answered it (masked).
    pub fn segments(&self) -> Vec<SegmentSpans> {
        self.turns
            .iter()
            .enumerate()
            .map(|(index, t)| SegmentSpans {
                index,
                policy: self.action_span(t),
                observation: Self::observation_span(&t.outcome.observation),
                restart: t.outcome.observation.restart,
                reward: t.outcome.reward,
                done: t.outcome.done,
            })
            .collect()
    }

    /// The current context as spans: from the latest restart (or the initial
    /// observation, kind [`TokenKind::Conditioning`]) to the latest
    /// observation. Concatenating the spans' texts (or tokens) gives exactly
    /// what the policy conditions on next.
    pub fn context(&self) -> Vec<Span> {
        let Some(init) = &self.initial else {
            return Vec::new();
        };
        let start = self
            .turns
            .iter()
            .rposition(|t| t.outcome.observation.restart);
        let mut spans = Vec::new();
        let rest = match start {
            Some(i) => {
                let mut s = Self::observation_span(&self.turns[i].outcome.observation);
                s.kind = TokenKind::Conditioning;
                spans.push(s);
                &self.turns[i + 1..]
            }
            None => {
                let mut s = Self::observation_span(init);
                s.kind = TokenKind::Conditioning;
                spans.push(s);
                &self.turns[..]
            }
        };
        for t in rest {
            spans.push(self.action_span(t));
            spans.push(Self::observation_span(&t.outcome.observation));
        }
        spans
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::{RunningSum, RunningSumConfig};

    fn solved(k: usize, seed: u64) -> Episode {
        let env = RunningSum::new(RunningSumConfig::tokens(k), seed).unwrap();
        let digits = env.digits().to_vec();
        let mut ep = Episode::new(Box::new(env));
        ep.reset().unwrap();
        let mut s = 0u8;
        for d in digits {
            s = (s + d) % 10;
            ep.step(Action::Tokens(vec![u32::from(s)])).unwrap();
        }
        ep
    }

    #[test]
    fn protocol_errors() {
        let env = RunningSum::new(RunningSumConfig::tokens(2), 1).unwrap();
        let mut ep = Episode::new(Box::new(env));
        assert!(matches!(
            ep.step(Action::Tokens(vec![1])),
            Err(EnvError::Protocol { .. })
        ));
        let mut ep = solved(2, 1);
        assert!(ep.is_done());
        assert_eq!(ep.total_reward(), 1.0);
        let e = ep.step(Action::Tokens(vec![1])).unwrap_err().to_string();
        assert!(e.contains("after the episode ended"), "{e}");
        assert!(ep.replay_prefix(3).is_err());
    }

    #[test]
    fn replay_rebuilds_equal_state_and_history() {
        let ep = solved(5, 42);
        for n in 0..=5 {
            let r = ep.replay_prefix(n).unwrap();
            assert_eq!(r.turns(), &ep.turns()[..n]);
            if n == 5 {
                assert_eq!(
                    r.env().state_bytes().unwrap(),
                    ep.env().state_bytes().unwrap()
                );
            }
        }
        let t = ep.trajectory();
        let json = serde_json::to_string(&t).unwrap();
        let back: Trajectory = serde_json::from_str(&json).unwrap();
        assert_eq!(back, t);
    }

    #[test]
    fn forks_are_independent() {
        let env = RunningSum::new(RunningSumConfig::tokens(4), 9).unwrap();
        let mut a = Episode::new(Box::new(env));
        a.reset().unwrap();
        a.step(Action::Tokens(vec![3])).unwrap();
        let mut b = a.fork().unwrap();
        let before = b.env().state_bytes().unwrap();
        a.step(Action::Tokens(vec![4])).unwrap();
        assert_eq!(b.env().state_bytes().unwrap(), before);
        assert_eq!(b.turns().len(), 1);
        b.step(Action::Tokens(vec![5])).unwrap();
        assert_ne!(
            a.env().state_bytes().unwrap(),
            b.env().state_bytes().unwrap()
        );
    }

    #[test]
    fn segments_and_context_masks() {
        let ep = solved(3, 5);
        let segs = ep.segments();
        assert_eq!(segs.len(), 3);
        for s in &segs {
            assert!(s.policy.kind.is_trained());
            assert!(!s.observation.kind.is_trained());
            assert_eq!(s.policy.tokens.as_ref().map(Vec::len), Some(1));
        }
        assert!(segs[2].done && segs[2].reward == 1.0);
        let ctx = ep.context();
        assert_eq!(ctx.len(), 1 + 2 * 3);
        assert_eq!(ctx[0].kind, TokenKind::Conditioning);
        let toks: Vec<u32> = ctx.iter().flat_map(|s| s.tokens.clone().unwrap()).collect();
        // <bos> d1 a1 d2 a2 d3 a3 (final observation empty)
        assert_eq!(toks.len(), 2 + 1 + 1 + 1 + 1 + 1);
    }

    #[test]
    fn text_action_for_token_env_without_vocab_is_an_error() {
        let e = Action::Tokens(vec![1]).to_text(None, "t").unwrap_err();
        assert!(e.to_string().contains("built-in vocabulary"));
    }
}
