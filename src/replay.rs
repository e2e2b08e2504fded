//! `arbor replay`: re-execute a recorded action list through a task's parser
//! and executor, and print the final state summary and reward.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use arbor_env::tasks::{open_task, read_trajectory, replay_trajectory, TaskOptions};
use clap::Args;

#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// Task spec: `running-sum:k=4,seed=7,mode=tokens`,
    /// `register:k=4,seed=7,subtract=true,mode=qwen`, `math:FILE.jsonl#ID`
    /// or `swe:INSTANCES.jsonl#INSTANCE_ID`. Defaults to the task recorded
    /// in the trajectory.
    #[arg(long, value_name = "T")]
    pub task: Option<String>,
    /// Trajectory: a JSON object {task, actions, rewards}, a JSON array of
    /// actions, or JSONL with one action per line (an action is
    /// {"text": ...}, {"tokens": [...]} or a bare string).
    #[arg(long, value_name = "FILE")]
    pub trajectory: PathBuf,
    /// Directory of repository clones for SWE tasks (default: `repos/` next
    /// to the instance file).
    #[arg(long, value_name = "DIR")]
    pub repos: Option<PathBuf>,
    /// Run SWE commands without bubblewrap if it is not installed (no
    /// isolation: only for trusted trajectories).
    #[arg(long)]
    pub unsandboxed: bool,
    /// Score SWE tasks by file localization Acc@K instead of hidden tests.
    #[arg(long, value_name = "K")]
    pub localization: Option<usize>,
    /// Print every step's reward and error observation.
    #[arg(long, short)]
    pub verbose: bool,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: ReplayArgs) -> Result<()> {
    let traj = read_trajectory(&a.trajectory)
        .with_context(|| format!("reading {}", a.trajectory.display()))?;
    let spec = match (&a.task, traj.task.is_empty()) {
        (Some(t), _) => t.clone(),
        (None, false) => traj.task.clone(),
        (None, true) => bail!("the trajectory names no task: pass --task"),
    };
    let opts = TaskOptions {
        repos: a.repos.clone(),
        allow_unsandboxed: a.unsandboxed,
        localization_k: a.localization,
        chat: None,
    };
    let env = open_task(&spec, &opts).with_context(|| format!("opening task `{spec}`"))?;
    let (_, report) = replay_trajectory(env, &traj).context("replaying")?;
    if a.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    if a.verbose {
        for (i, (r, e)) in report.rewards.iter().zip(&report.errors).enumerate() {
            match e {
                Some(e) => println!("step {i}: reward {r}  error: {e}"),
                None => println!("step {i}: reward {r}"),
            }
        }
    }
    println!("{}", report.summary);
    println!(
        "task {}: {} steps, {}, reward {}",
        report.task,
        report.steps,
        if report.done { "done" } else { "not finished" },
        report.total_reward
    );
    if report.rewards_match == Some(false) {
        println!("warning: the replayed rewards differ from the recorded ones");
    }
    Ok(())
}
