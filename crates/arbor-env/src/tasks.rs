//! Opening a task from a spec string, and replaying recorded trajectories
//! (`arbor replay`).
//!
//! Task specs:
//! - synthetic: `running-sum:k=4,seed=7,mode=tokens`,
//!   `register:k=4,seed=7,subtract=true,mode=qwen` (the env's task id);
//! - math: `math:FILE.jsonl#ID` (`ID`: the problem id, or `line=N`);
//! - SWE: `swe:INSTANCES.jsonl#INSTANCE_ID` (repository clones under
//!   [`TaskOptions::repos`], default `<dir of the file>/repos`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::chat::ChatFormat;
use crate::env::{Action, Env, Episode, Trajectory};
use crate::error::{EnvError, Result};
use crate::harness::HarnessConfig;
use crate::math::{load_problems, MathEnv};
use crate::swe::sandbox::{Limits, Sandbox};
use crate::swe::task::{load_instances, swe_env, SweConfig, SweReward, SweTask};

/// Options for opening tasks.
#[derive(Clone, Debug, Default)]
pub struct TaskOptions {
    /// Where SWE repository clones live.
    pub repos: Option<PathBuf>,
    /// Run SWE commands without bubblewrap when it is missing (explicit
    /// opt-in).
    pub allow_unsandboxed: bool,
    /// Localization reward with this `k` instead of hidden tests.
    pub localization_k: Option<usize>,
    /// Chat scaffolding of text tasks (default Qwen).
    pub chat: Option<ChatFormat>,
}

/// Opens the task named by `spec` (see the module doc).
pub fn open_task(spec: &str, opts: &TaskOptions) -> Result<Box<dyn Env>> {
    let chat = opts.chat.clone().unwrap_or(ChatFormat::Qwen);
    if let Some(rest) = spec.strip_prefix("math:") {
        let (file, id) = split_ref(spec, rest)?;
        let probs = load_problems(Path::new(file), None)?;
        let p = match id.strip_prefix("line=") {
            Some(n) => {
                let n: usize = n
                    .parse()
                    .map_err(|_| EnvError::task(spec, format!("`{n}` is not a line number")))?;
                probs
                    .into_iter()
                    .find(|p| p.id.ends_with(&format!(":{n}")) || p.id == id)
            }
            None => probs.into_iter().find(|p| p.id == id),
        }
        .ok_or_else(|| EnvError::task(spec, format!("no problem `{id}` in {file}")))?;
        return Ok(Box::new(MathEnv::new(p, chat)));
    }
    if let Some(rest) = spec.strip_prefix("swe:") {
        let (file, id) = split_ref(spec, rest)?;
        let inst = load_instances(Path::new(file))?
            .into_iter()
            .find(|i| i.instance_id == id)
            .ok_or_else(|| EnvError::task(spec, format!("no instance `{id}` in {file}")))?;
        let repos = match &opts.repos {
            Some(r) => r.clone(),
            None => Path::new(file)
                .parent()
                .unwrap_or(Path::new("."))
                .join("repos"),
        };
        let source = SweTask::locate(&inst, &repos)?;
        let mut cfg = SweConfig::tests(Sandbox::detect(Limits::default(), opts.allow_unsandboxed)?);
        if let Some(k) = opts.localization_k {
            cfg.reward = SweReward::Localization { k };
        }
        let harness = HarnessConfig {
            chat,
            ..HarnessConfig::default()
        };
        return Ok(Box::new(swe_env(
            SweTask::new(inst, &source, cfg)?,
            harness,
        )));
    }
    crate::synthetic::from_spec(spec)
}

fn split_ref<'a>(spec: &str, rest: &'a str) -> Result<(&'a str, &'a str)> {
    rest.rsplit_once('#')
        .filter(|(f, i)| !f.is_empty() && !i.is_empty())
        .ok_or_else(|| EnvError::task(spec, "expected FILE.jsonl#ID"))
}

/// Reads a trajectory: a [`Trajectory`] JSON object, a JSON array of
/// actions (`{"text": ...}`, `{"tokens": [...]}` or bare strings), or JSONL
/// with one such action per line.
pub fn read_trajectory(path: &Path) -> Result<Trajectory> {
    let text = std::fs::read_to_string(path).map_err(|e| EnvError::io(path, e))?;
    let data = |line: usize, msg: String| EnvError::Data {
        path: path.to_path_buf(),
        line,
        msg,
    };
    let action = |v: serde_json::Value, line: usize| -> Result<Action> {
        match v {
            serde_json::Value::String(s) => Ok(Action::Text(s)),
            other => serde_json::from_value(other).map_err(|e| {
                data(
                    line,
                    format!("not an action ({{\"text\": ...}} or {{\"tokens\": [...]}}): {e}"),
                )
            }),
        }
    };
    match serde_json::from_str::<serde_json::Value>(&text) {
        Ok(serde_json::Value::Object(o)) => serde_json::from_value(serde_json::Value::Object(o))
            .map_err(|e| {
                data(
                    1,
                    format!("not a trajectory {{task, actions, rewards}}: {e}"),
                )
            }),
        Ok(serde_json::Value::Array(items)) => Ok(Trajectory {
            task: String::new(),
            actions: items
                .into_iter()
                .map(|v| action(v, 1))
                .collect::<Result<_>>()?,
            rewards: Vec::new(),
        }),
        _ => {
            let mut actions = Vec::new();
            for (i, l) in text
                .lines()
                .enumerate()
                .filter(|(_, l)| !l.trim().is_empty())
            {
                let v = serde_json::from_str(l)
                    .map_err(|e| data(i + 1, format!("invalid JSON: {e}")))?;
                actions.push(action(v, i + 1)?);
            }
            Ok(Trajectory {
                task: String::new(),
                actions,
                rewards: Vec::new(),
            })
        }
    }
}

/// What a replay produced.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReplayReport {
    /// The task id.
    pub task: String,
    /// Steps replayed.
    pub steps: usize,
    /// Reward per step.
    pub rewards: Vec<f64>,
    /// Summed reward.
    pub total_reward: f64,
    /// The episode ended.
    pub done: bool,
    /// Error observations per step (`None`: the action executed cleanly).
    pub errors: Vec<Option<String>>,
    /// The final state summary.
    pub summary: String,
    /// The recorded rewards, when the trajectory had them, equal the
    /// replayed ones.
    pub rewards_match: Option<bool>,
    /// The first observation (the prompt the policy saw).
    pub initial: String,
    /// Every step: the action as recorded and what the environment
    /// answered.
    pub turns: Vec<ReplayTurn>,
}

/// One replayed step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReplayTurn {
    /// The action (text, or token ids as `[1, 2, ...]`).
    pub action: String,
    /// The observation the environment returned.
    pub observation: String,
    /// The step's reward.
    pub reward: f64,
    /// The error observation, when the action failed.
    pub error: Option<String>,
    /// The context restarted from this observation (compaction).
    pub restart: bool,
}

/// Replays `traj` in `env` through its parser and executor.
pub fn replay_trajectory(env: Box<dyn Env>, traj: &Trajectory) -> Result<(Episode, ReplayReport)> {
    let ep = Episode::replay(env, &traj.actions)?;
    let rewards: Vec<f64> = ep.turns().iter().map(|t| t.outcome.reward).collect();
    let report = ReplayReport {
        task: ep.env().task_id().to_string(),
        steps: ep.turns().len(),
        total_reward: rewards.iter().sum(),
        done: ep.is_done(),
        errors: ep.turns().iter().map(|t| t.outcome.error.clone()).collect(),
        summary: ep.env().summary(),
        rewards_match: (!traj.rewards.is_empty()).then(|| traj.rewards == rewards),
        rewards,
        initial: ep.initial().map(|o| o.text.clone()).unwrap_or_default(),
        turns: ep
            .turns()
            .iter()
            .map(|t| ReplayTurn {
                action: match &t.action {
                    Action::Text(s) => s.clone(),
                    Action::Tokens(ids) => format!("{ids:?}"),
                },
                observation: t.outcome.observation.text.clone(),
                reward: t.outcome.reward,
                error: t.outcome.error.clone(),
                restart: t.outcome.observation.restart,
            })
            .collect(),
    };
    Ok((ep, report))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_from_files() {
        let env = open_task(
            "register:k=3,seed=4,subtract=true,mode=tokens",
            &TaskOptions::default(),
        )
        .unwrap();
        let reg =
            crate::synthetic::Register::new(crate::synthetic::RegisterConfig::tokens(3, true), 4)
                .unwrap();
        let mut ep = Episode::replay(env, &reg.oracle_actions()).unwrap();
        assert_eq!(ep.total_reward(), 1.0);
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.json");
        std::fs::write(&p, serde_json::to_string(&ep.trajectory()).unwrap()).unwrap();
        let t = read_trajectory(&p).unwrap();
        let (_, r) =
            replay_trajectory(open_task(&t.task, &TaskOptions::default()).unwrap(), &t).unwrap();
        assert_eq!(
            (r.steps, r.total_reward, r.done, r.rewards_match),
            (3, 1.0, true, Some(true))
        );
        assert!(
            r.summary.contains("register 9") || r.summary.contains("target"),
            "{}",
            r.summary
        );
        // Arrays and JSONL of actions.
        std::fs::write(&p, "[{\"tokens\": [17, 1]}, \"<get>\"]").unwrap();
        assert_eq!(read_trajectory(&p).unwrap().actions.len(), 2);
        std::fs::write(&p, "{\"tokens\": [17, 1]}\n\n\"<get>\"\n{\"bad\": 1}\n").unwrap();
        let e = read_trajectory(&p).unwrap_err().to_string();
        assert!(e.contains("t.json:4: not an action"), "{e}");
        // Too many actions for the episode.
        ep.reset().unwrap();
        let mut t2 = t.clone();
        t2.actions.push(Action::Tokens(vec![18]));
        assert!(
            replay_trajectory(open_task(&t.task, &TaskOptions::default()).unwrap(), &t2).is_err()
        );
    }

    #[test]
    fn math_and_swe_specs() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.jsonl");
        std::fs::write(&p, "{\"problem\": \"1+1?\", \"answer\": \"2\", \"unique_id\": \"u/1\", \"solution\": \"\"}\n").unwrap();
        let env = open_task(
            &format!("math:{}#u/1", p.display()),
            &TaskOptions::default(),
        )
        .unwrap();
        let (_, r) = replay_trajectory(
            env,
            &Trajectory {
                task: String::new(),
                actions: vec![Action::text("\\boxed{2}")],
                rewards: vec![],
            },
        )
        .unwrap();
        assert_eq!(r.total_reward, 1.0);
        assert!(open_task(
            &format!("math:{}#nope", p.display()),
            &TaskOptions::default()
        )
        .is_err());
        assert!(open_task("math:nofile", &TaskOptions::default()).is_err());
        let e = open_task(&format!("swe:{}#x", p.display()), &TaskOptions::default()).unwrap_err();
        assert!(e.to_string().contains("field `instance_id`"), "{e}");
    }
}
