//! Many episodes at once.
//!
//! [`Env`](crate::Env) is synchronous (a step may run a sandboxed process and
//! block). On tokio, [`AsyncEpisode`] runs each step on the blocking pool, so
//! thousands of episodes can wait on their policies and executors
//! concurrently; [`run_episodes`] drives a batch with an async policy. A
//! synchronous trainer that steps a batch in lock-step uses [`step_all`]
//! (scoped threads, no runtime).

use std::future::Future;
use std::sync::{Arc, Mutex};

use crate::env::{Action, Episode, Observation, StepOutcome};
use crate::error::{EnvError, Result};

/// An [`Episode`] shared with tokio's blocking pool.
#[derive(Clone)]
pub struct AsyncEpisode {
    inner: Arc<Mutex<Episode>>,
}

impl std::fmt::Debug for AsyncEpisode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AsyncEpisode")
    }
}

fn poisoned() -> EnvError {
    EnvError::Runtime("an earlier step panicked while holding the episode".into())
}

impl AsyncEpisode {
    /// Wraps an episode.
    pub fn new(ep: Episode) -> Self {
        AsyncEpisode {
            inner: Arc::new(Mutex::new(ep)),
        }
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Episode) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let inner = Arc::clone(&self.inner);
        tokio::task::spawn_blocking(move || {
            let mut ep = inner.lock().map_err(|_| poisoned())?;
            f(&mut ep)
        })
        .await
        .map_err(|e| EnvError::Runtime(format!("blocking step failed: {e}")))?
    }

    /// [`Episode::reset`] on the blocking pool.
    pub async fn reset(&self) -> Result<Observation> {
        self.blocking(|ep| ep.reset()).await
    }

    /// [`Episode::step`] on the blocking pool.
    pub async fn step(&self, action: Action) -> Result<StepOutcome> {
        self.blocking(move |ep| ep.step(action)).await
    }

    /// [`Episode::fork`] on the blocking pool (a fork may copy a workspace).
    pub async fn fork(&self) -> Result<AsyncEpisode> {
        self.blocking(|ep| ep.fork()).await.map(AsyncEpisode::new)
    }

    /// Runs `f` with the episode locked (cheap queries).
    pub fn with<T>(&self, f: impl FnOnce(&Episode) -> T) -> Result<T> {
        let ep = self.inner.lock().map_err(|_| poisoned())?;
        Ok(f(&ep))
    }

    /// The episode back, once no other handle exists.
    pub fn into_inner(self) -> Result<Episode> {
        Arc::try_unwrap(self.inner)
            .map_err(|_| EnvError::Runtime("the episode is still shared".into()))?
            .into_inner()
            .map_err(|_| poisoned())
    }
}

/// One finished run of [`run_episodes`].
#[derive(Debug)]
pub struct EpisodeRun {
    /// The episode with its transcript (`None` only if it could not be
    /// recovered from its task, which a panicking policy cannot cause).
    pub episode: Option<Episode>,
    /// The summed reward, or why the run stopped (policy error, env error).
    pub reward: Result<f64>,
}

/// Runs every episode to its end (or `max_steps`) concurrently: each is
/// reset, then `policy(index, observation)` produces its actions. Returns the
/// runs in input order.
pub async fn run_episodes<P, F>(
    episodes: Vec<Episode>,
    max_steps: usize,
    policy: P,
) -> Vec<EpisodeRun>
where
    P: Fn(usize, Observation) -> F + Send + Sync + 'static,
    F: Future<Output = Result<Action>> + Send + 'static,
{
    let policy = Arc::new(policy);
    let handles: Vec<(AsyncEpisode, tokio::task::JoinHandle<Result<f64>>)> = episodes
        .into_iter()
        .enumerate()
        .map(|(i, ep)| {
            let ae = AsyncEpisode::new(ep);
            let run = ae.clone();
            let policy = Arc::clone(&policy);
            let h = tokio::spawn(async move {
                let mut obs = run.reset().await?;
                for _ in 0..max_steps {
                    let a = policy(i, obs).await?;
                    let out = run.step(a).await?;
                    if out.done {
                        break;
                    }
                    obs = out.observation;
                }
                run.with(|e| e.total_reward())
            });
            (ae, h)
        })
        .collect();
    let mut out = Vec::with_capacity(handles.len());
    for (ae, h) in handles {
        let reward = match h.await {
            Ok(r) => r,
            Err(e) => Err(EnvError::Runtime(format!("episode task failed: {e}"))),
        };
        let episode = match Arc::try_unwrap(ae.inner) {
            Ok(m) => Some(m.into_inner().unwrap_or_else(|p| p.into_inner())),
            Err(_) => None,
        };
        out.push(EpisodeRun { episode, reward });
    }
    out
}

/// Steps every episode with its action, in parallel on up to `threads`
/// scoped threads (synchronous; no runtime). `actions.len()` must equal
/// `episodes.len()`.
pub fn step_all(
    episodes: &mut [Episode],
    actions: Vec<Action>,
    threads: usize,
) -> Result<Vec<Result<StepOutcome>>> {
    if actions.len() != episodes.len() {
        return Err(EnvError::config(
            "actions",
            format!("{} actions for {} episodes", actions.len(), episodes.len()),
        ));
    }
    let n = episodes.len();
    let threads = threads.clamp(1, n.max(1));
    let chunk = n.div_ceil(threads).max(1);
    let mut results: Vec<Option<Result<StepOutcome>>> = (0..n).map(|_| None).collect();
    let mut actions: Vec<Option<Action>> = actions.into_iter().map(Some).collect();
    std::thread::scope(|s| {
        for ((eps, acts), res) in episodes
            .chunks_mut(chunk)
            .zip(actions.chunks_mut(chunk))
            .zip(results.chunks_mut(chunk))
        {
            s.spawn(move || {
                for ((ep, a), r) in eps.iter_mut().zip(acts).zip(res) {
                    if let Some(a) = a.take() {
                        *r = Some(ep.step(a));
                    }
                }
            });
        }
    });
    Ok(results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(EnvError::Runtime("a step thread panicked".into()))))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::{RunningSum, RunningSumConfig};

    fn episodes(n: u64) -> Vec<Episode> {
        (0..n)
            .map(|s| {
                Episode::new(Box::new(
                    RunningSum::new(RunningSumConfig::tokens(4), s).unwrap(),
                ))
            })
            .collect()
    }

    #[test]
    fn many_episodes_concurrently() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .build()
            .unwrap();
        let oracle: Vec<Vec<Action>> = (0..16)
            .map(|s| {
                RunningSum::new(RunningSumConfig::tokens(4), s)
                    .unwrap()
                    .oracle_actions()
            })
            .collect();
        let oracle = Arc::new(oracle);
        let counters = Arc::new(Mutex::new(vec![0usize; 16]));
        let res = rt.block_on(run_episodes(episodes(16), 10, move |i, _obs| {
            let oracle = Arc::clone(&oracle);
            let counters = Arc::clone(&counters);
            async move {
                let mut c = counters.lock().unwrap();
                let a = oracle[i][c[i]].clone();
                c[i] += 1;
                // Episodes with odd index answer wrong at step 0.
                let wrong = match &a {
                    Action::Tokens(t) => Action::Tokens(vec![(t[0] + 1) % 10]),
                    Action::Text(_) => Action::text("x"),
                };
                Ok(if i % 2 == 1 && c[i] == 1 { wrong } else { a })
            }
        }));
        assert_eq!(res.len(), 16);
        for (i, run) in res.iter().enumerate() {
            assert_eq!(
                *run.reward.as_ref().unwrap(),
                if i % 2 == 0 { 1.0 } else { 0.0 }
            );
            let ep = run.episode.as_ref().unwrap();
            assert!(ep.env().task_id().contains(&format!("seed={i},")));
        }
    }

    #[test]
    fn async_episode_step_and_fork() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            let env = RunningSum::new(RunningSumConfig::tokens(2), 3).unwrap();
            let acts = env.oracle_actions();
            let ae = AsyncEpisode::new(Episode::new(Box::new(env)));
            ae.reset().await.unwrap();
            ae.step(acts[0].clone()).await.unwrap();
            let f = ae.fork().await.unwrap();
            let out = ae.step(acts[1].clone()).await.unwrap();
            assert!(out.done && out.reward == 1.0);
            assert_eq!(f.with(|e| e.turns().len()).unwrap(), 1);
            assert!(ae.into_inner().unwrap().is_done());
        });
    }

    #[test]
    fn step_all_in_parallel() {
        let mut eps = episodes(5);
        for e in &mut eps {
            e.reset().unwrap();
        }
        let acts = (0..5).map(|_| Action::Tokens(vec![0])).collect();
        let out = step_all(&mut eps, acts, 2).unwrap();
        assert_eq!(out.len(), 5);
        assert!(out.iter().all(|o| o.is_ok()));
        assert!(eps.iter().all(|e| e.turns().len() == 1));
        assert!(step_all(&mut eps, vec![], 2).is_err());
    }
}
