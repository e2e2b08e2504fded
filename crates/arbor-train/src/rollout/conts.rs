//! Continuations: each runs from a tree state to the end of its episode
//! (on the [`super::sched::Scheduler`]), then is recorded as tree steps.

use std::collections::HashMap;

use arbor_rl::{NodeId, RolloutTree, Segment, Step, TokenKind};

use super::TokenEpisode;
use crate::learner::Learner;
use crate::TrainError;

/// One finished segment: action tokens, their logprobs, the observation,
/// the environment state after it, and the terminal reward if it ended.
pub(crate) struct SegmentRecord {
    /// Replayed start of this segment's action (Prefix Sampling's token
    /// cuts): masked in the loss, sent to the environment with `action`.
    pub(crate) head: Vec<u32>,
    /// What the action is trained as: a task action or context management
    /// (a compaction summary).
    pub(crate) kind: TokenKind,
    /// The generated tokens of the action.
    pub(crate) action: Vec<u32>,
    pub(crate) logprobs: Vec<f32>,
    pub(crate) observation: Vec<u32>,
    /// The observation replaced the context (a compaction).
    pub(crate) restart: bool,
    /// The kind of the segment after this one.
    pub(crate) next: TokenKind,
    /// The environment after this segment (kept only where later work
    /// starts from it: FOCUS, PS sources, VinePPO; a SWE snapshot is a
    /// workspace copy).
    pub(crate) env_after: Option<Box<dyn TokenEpisode>>,
    pub(crate) reward: Option<f64>,
}

/// One segment of a replayed prefix (Prefix Sampling): the action and the
/// observation as recorded, already executed in the continuation's
/// environment; masked in the loss.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Replayed {
    pub(crate) action: Vec<u32>,
    pub(crate) observation: Vec<u32>,
    /// The observation replaced the context (a compaction).
    pub(crate) restart: bool,
}

impl Replayed {
    /// The replay of a recorded segment.
    pub(crate) fn of(s: &SegmentRecord) -> Self {
        Replayed {
            action: s.action.clone(),
            observation: s.observation.clone(),
            restart: s.restart,
        }
    }
}

/// `context` after `action` and `observation`: extended, or replaced by the
/// observation when it restarts the context.
pub(crate) fn advance(context: &mut Vec<u32>, action: &[u32], observation: &[u32], restart: bool) {
    if restart {
        context.clear();
    } else {
        context.extend(action);
    }
    context.extend(observation);
}

/// One continuation: where it starts in the tree, its context so far, its
/// environment, and the segments it has generated.
pub(crate) struct Cont {
    pub(crate) ticket: Option<arbor_rl::Ticket>,
    pub(crate) from: NodeId,
    pub(crate) context: Vec<u32>,
    pub(crate) env: Box<dyn TokenEpisode>,
    /// Replayed prefix (Prefix Sampling), already executed in `env`;
    /// masked in the loss.
    pub(crate) replayed: Vec<Replayed>,
    /// Replayed start of the next segment's action (a cut inside a
    /// segment), already at the end of `context`; the engine generates the
    /// rest of that segment.
    pub(crate) head: Vec<u32>,
    pub(crate) steps: Vec<SegmentRecord>,
    /// Sampling seed of the continuation (set at launch); segment `k`
    /// samples with a seed derived from it and `k`.
    pub(crate) seed: u64,
    /// The kind of the next segment (context management when the
    /// environment asked for a compaction summary).
    pub(crate) next: TokenKind,
}

impl Cont {
    /// A continuation from `from` with `context` and environment `env`
    /// (`ticket`: the tree's in-flight record, where the tree tracks it);
    /// its first segment is of the kind `env` asks for next.
    pub(crate) fn new(
        ticket: Option<arbor_rl::Ticket>,
        from: NodeId,
        context: Vec<u32>,
        env: Box<dyn TokenEpisode>,
    ) -> Self {
        let next = env.next_kind();
        Cont {
            ticket,
            from,
            context,
            env,
            replayed: Vec::new(),
            head: Vec::new(),
            steps: Vec::new(),
            seed: 0,
            next,
        }
    }

    /// The episode's terminal reward (0 before it ends).
    pub(crate) fn reward(&self) -> f64 {
        self.steps.last().and_then(|s| s.reward).unwrap_or(0.0)
    }

    /// Whether the episode ended with reward >= 1.
    pub(crate) fn succeeded(&self) -> bool {
        self.reward() >= 1.0
    }

    /// Tokens the policy generated in this continuation (replayed ones
    /// not counted).
    pub(crate) fn generated(&self) -> usize {
        self.steps.iter().map(|s| s.action.len()).sum()
    }
}

/// A finished continuation as data, without its environment: what another
/// rank of a data-parallel group needs to judge and train it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct ContRecord {
    context: Vec<u32>,
    replayed: Vec<Replayed>,
    steps: Vec<SegmentData>,
}

/// A [`SegmentRecord`] without its environment snapshot.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct SegmentData {
    head: Vec<u32>,
    kind: TokenKind,
    action: Vec<u32>,
    logprobs: Vec<f32>,
    observation: Vec<u32>,
    restart: bool,
    next: TokenKind,
    reward: Option<f64>,
}

impl Cont {
    /// This finished continuation as data.
    pub(crate) fn record(&self) -> ContRecord {
        ContRecord {
            context: self.context.clone(),
            replayed: self.replayed.clone(),
            steps: self
                .steps
                .iter()
                .map(|s| SegmentData {
                    head: s.head.clone(),
                    kind: s.kind,
                    action: s.action.clone(),
                    logprobs: s.logprobs.clone(),
                    observation: s.observation.clone(),
                    restart: s.restart,
                    next: s.next,
                    reward: s.reward,
                })
                .collect(),
        }
    }

    /// A continuation another rank ran, from its record: its environment
    /// (and the states after its segments) stayed there.
    pub(crate) fn from_record(r: ContRecord) -> Cont {
        let mut c = Cont::new(None, NodeId(0), r.context, Box::new(Elsewhere));
        c.replayed = r.replayed;
        c.steps = r
            .steps
            .into_iter()
            .map(|s| SegmentRecord {
                head: s.head,
                kind: s.kind,
                action: s.action,
                logprobs: s.logprobs,
                observation: s.observation,
                restart: s.restart,
                next: s.next,
                env_after: None,
                reward: s.reward,
            })
            .collect();
        c
    }
}

/// The environment of an episode that runs on another rank: never stepped
/// here (an error if it is).
pub(crate) struct Elsewhere;

impl TokenEpisode for Elsewhere {
    fn step(&mut self, _action: &[u32]) -> Result<super::StepOut, TrainError> {
        Err(TrainError::Rollout(
            "this episode's environment lives on another rank".into(),
        ))
    }

    fn fork(&self) -> Result<Box<dyn TokenEpisode>, TrainError> {
        Ok(Box::new(Elsewhere))
    }
}

/// Turn a finished continuation into tree steps, with critic values at each
/// new intermediate state (`None`: a method without a critic, 0.5 each).
pub(crate) fn to_steps(c: &Cont, values: Option<&[f64]>) -> Result<Vec<Step>, TrainError> {
    let mut out = Vec::with_capacity(c.replayed.len() + c.steps.len());
    for r in &c.replayed {
        let mut seg = Segment::new();
        seg.push(TokenKind::Replayed, &r.action, None)?;
        if !r.observation.is_empty() {
            seg.push(TokenKind::Observation, &r.observation, None)?;
        }
        seg.restart = r.restart;
        out.push(Step::new(seg).value(0.5));
    }
    for (k, r) in c.steps.iter().enumerate() {
        let mut seg = Segment::new();
        if !r.head.is_empty() {
            seg.push(TokenKind::Replayed, &r.head, None)?;
        }
        seg.push(r.kind, &r.action, Some(&r.logprobs))?;
        if !r.observation.is_empty() {
            seg.push(TokenKind::Observation, &r.observation, None)?;
        }
        seg.restart = r.restart;
        let step = Step::new(seg);
        out.push(match r.reward {
            Some(r) => step.terminal(r),
            None => step.value(values.map_or(0.5, |v| v[k])),
        });
    }
    Ok(out)
}

/// Critic values at the end of each non-final segment of each continuation,
/// each read at the end of the context the state sees (a compaction starts
/// a new sequence).
pub(crate) fn segment_values(
    learner: &Learner,
    conts: &[Cont],
    tree: &RolloutTree,
) -> Result<Vec<Vec<f64>>, TrainError> {
    let v = ValueInputs::of(conts, tree)?;
    let values = learner.values_at(&v.seqs, &v.logprobs, &v.positions)?;
    Ok(v.owner
        .windows(2)
        .map(|w| values[w[0]..w[1]].concat())
        .collect())
}

/// What [`segment_values`] asks the critic: one sequence per context a
/// continuation's states see (a compaction starts a new one), the path's
/// logprobs up to its end (the history before the context first), and the
/// positions of the states' last tokens in it.
#[derive(Debug, Default, PartialEq)]
struct ValueInputs {
    seqs: Vec<Vec<u32>>,
    logprobs: Vec<Vec<f32>>,
    positions: Vec<Vec<usize>>,
    /// The sequences of continuation `i` are `seqs[owner[i]..owner[i + 1]]`.
    owner: Vec<usize>,
}

impl ValueInputs {
    fn of(conts: &[Cont], tree: &RolloutTree) -> Result<Self, TrainError> {
        let mut v = ValueInputs {
            owner: vec![0],
            ..Default::default()
        };
        for c in conts {
            let mut ctx = tree.context_tokens(c.from)?;
            // The path's logprobs: the context's are their last entries.
            let mut lp = tree.path_logprobs(c.from)?;
            let mut p = Vec::new();
            for (k, r) in c.steps.iter().enumerate() {
                if r.restart {
                    v.seqs.push(std::mem::take(&mut ctx));
                    v.logprobs.push(lp.clone());
                    v.positions.push(std::mem::take(&mut p));
                }
                advance(&mut ctx, &r.action, &r.observation, r.restart);
                debug_assert_eq!(r.logprobs.len(), r.action.len());
                lp.extend_from_slice(&r.logprobs);
                lp.resize(lp.len() + r.observation.len(), 0.0);
                if k + 1 < c.steps.len() {
                    p.push(ctx.len() - 1);
                }
            }
            v.seqs.push(ctx);
            v.logprobs.push(lp);
            v.positions.push(p);
            v.owner.push(v.seqs.len());
        }
        Ok(v)
    }
}

/// Environment states kept at tree nodes, where later continuations fork.
pub(crate) type Snapshots = HashMap<NodeId, Box<dyn TokenEpisode>>;

/// A fresh copy of the environment state kept at node `n`.
fn fork_at(snapshots: &Snapshots, n: NodeId) -> Result<Box<dyn TokenEpisode>, TrainError> {
    snapshots
        .get(&n)
        .ok_or_else(|| TrainError::Rollout(format!("no environment state kept for node {n:?}")))?
        .fork()
}

/// Keep the environment states after each of `records` at the tree nodes
/// `new` they became (non-terminal states only have one).
pub(crate) fn keep_snapshots(
    snapshots: &mut Snapshots,
    new: Vec<NodeId>,
    records: Vec<SegmentRecord>,
) {
    for (id, s) in new.into_iter().zip(records) {
        if let Some(env) = s.env_after {
            snapshots.insert(id, env);
        }
    }
}

/// The continuation of an in-flight `ticket`: its node's context, and a
/// copy of the environment state kept there.
pub(crate) fn cont_for(
    tree: &RolloutTree,
    snapshots: &Snapshots,
    ticket: arbor_rl::Ticket,
) -> Result<Cont, TrainError> {
    let n = ticket.node();
    let (context, env) = (tree.context_tokens(n)?, fork_at(snapshots, n)?);
    Ok(Cont::new(Some(ticket), n, context, env))
}

/// Continuations from `from` nodes (one per entry), begun in `tree` and
/// resuming from the kept environment snapshots.
pub(crate) fn begin_conts(
    tree: &mut RolloutTree,
    snapshots: &Snapshots,
    from: &[NodeId],
) -> Result<Vec<Cont>, TrainError> {
    from.iter()
        .map(|&n| {
            let ticket = tree.begin(n)?;
            cont_for(tree, snapshots, ticket)
        })
        .collect()
}

/// Complete finished continuations in `tree` (values per new state, or 0.5),
/// keeping the environment snapshots of the new non-terminal states.
pub(crate) fn complete_conts(
    tree: &mut RolloutTree,
    snapshots: &mut Snapshots,
    conts: Vec<Cont>,
    values: Option<Vec<Vec<f64>>>,
) -> Result<(), TrainError> {
    for (i, c) in conts.into_iter().enumerate() {
        let steps = to_steps(&c, values.as_ref().map(|v| v[i].as_slice()))?;
        let ticket = c
            .ticket
            .ok_or_else(|| TrainError::Rollout("continuation without a ticket".into()))?;
        let new = tree.complete(ticket, steps)?;
        keep_snapshots(snapshots, new, c.steps);
    }
    Ok(())
}

/// The critic's value at each task's prompt (the roots' states).
pub(crate) fn root_values(
    learner: &Learner,
    tasks: &[super::TaskInstance],
) -> Result<Vec<f64>, TrainError> {
    if tasks.is_empty() {
        return Ok(Vec::new());
    }
    let prompts: Vec<Vec<u32>> = tasks.iter().map(|t| t.prompt.clone()).collect();
    let pos: Vec<Vec<usize>> = prompts.iter().map(|p| vec![p.len() - 1]).collect();
    Ok(learner
        .values_at(&prompts, &[], &pos)?
        .into_iter()
        .map(|v| v[0])
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(kind: TokenKind, action: u32, lp: f32, obs: &[u32], restart: bool) -> SegmentRecord {
        SegmentRecord {
            head: Vec::new(),
            kind,
            action: vec![action],
            logprobs: vec![lp],
            observation: obs.to_vec(),
            restart,
            next: TokenKind::Action,
            env_after: None,
            reward: None,
        }
    }

    /// The critic reads each new state of a continuation where the tree
    /// will hold it: the state's own context, and the path's logprobs up to
    /// it, through a compaction before the continuation and one inside it.
    #[test]
    fn value_inputs_match_the_tree_through_compactions() {
        let mut t = RolloutTree::new();
        let r = t.add_episode("t", vec![9], Some(0.5)).unwrap();
        let mut summary = Segment::new();
        summary
            .push(TokenKind::ContextManagement, &[1], Some(&[-0.1]))
            .unwrap();
        summary.push(TokenKind::Observation, &[2], None).unwrap();
        let a = t
            .add_path(r, vec![Step::new(summary.restarting()).value(0.5)])
            .unwrap()[0];
        let mut c = Cont::new(None, a, t.context_tokens(a).unwrap(), Box::new(Elsewhere));
        c.steps = vec![
            record(TokenKind::Action, 3, -0.3, &[4], false),
            record(TokenKind::ContextManagement, 5, -0.5, &[6], true),
            record(TokenKind::Action, 7, -0.7, &[8], false),
            record(TokenKind::Action, 10, -1.0, &[], false),
        ];
        c.steps[3].reward = Some(1.0);
        let v = ValueInputs::of(std::slice::from_ref(&c), &t).unwrap();
        assert_eq!(v.seqs, vec![vec![2, 3, 4], vec![6, 7, 8, 10]]);
        assert_eq!(v.positions, vec![vec![2], vec![0, 2]]);
        assert_eq!(v.owner, vec![0, 2]);
        let ids = t
            .add_path(a, to_steps(&c, Some(&[0.5, 0.5, 0.5])).unwrap())
            .unwrap();
        t.validate().unwrap();
        let states = [(0, 2), (1, 0), (1, 2)];
        for (k, &(w, p)) in states.iter().enumerate() {
            let (seq, lp) = (&v.seqs[w], &v.logprobs[w]);
            assert_eq!(t.context_tokens(ids[k]).unwrap(), seq[..=p], "state {k}");
            let upto = lp.len() - (seq.len() - (p + 1));
            assert_eq!(t.path_logprobs(ids[k]).unwrap(), lp[..upto], "state {k}");
        }
        // The last window's logprobs are the leaf's whole path.
        assert_eq!(t.path_logprobs(ids[3]).unwrap(), v.logprobs[1]);
        assert_eq!(
            v.logprobs[1],
            vec![0.0, -0.1, 0.0, -0.3, 0.0, -0.5, 0.0, -0.7, 0.0, -1.0]
        );
    }
}
