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
    /// Print the prompt, then every step's action and observation with its
    /// reward (long texts are cut in the middle; see --full).
    #[arg(long, short)]
    pub verbose: bool,
    /// With --verbose, print texts whole.
    #[arg(long)]
    pub full: bool,
    /// Print the report as one JSON object (the prompt and every step's
    /// action, observation, reward and error included).
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
        let cut = |s: &str| {
            if a.full {
                s.trim_end().to_string()
            } else {
                arbor_env::harness::truncate_middle(s.trim_end(), 4000)
            }
        };
        println!("=== prompt\n{}", cut(&report.initial));
        for (i, t) in report.turns.iter().enumerate() {
            println!("=== step {i}: action");
            println!("{}", cut(&t.action));
            let status = match (&t.error, t.restart) {
                (Some(_), _) => " (error)",
                (None, true) => " (context restarts here)",
                (None, false) => "",
            };
            println!("=== step {i}: observation, reward {}{status}", t.reward);
            println!("{}", cut(&t.observation));
        }
        println!("===");
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
