//! The GPU generation path's overhead cuts, each on by default. Setting
//! `ARBOR_GPU_OFF` to a comma-separated list of their names turns those
//! off (the plain candle path for that part), so `arbor bench generate`
//! can measure what each one is worth:
//!
//! - `events`: no per-tensor CUDA event tracking (candle records two events
//!   per op and makes each op wait on its inputs' events; Arbor runs each
//!   device from one thread, on one stream);
//! - `pool`: the device's memory pool keeps what it frees instead of
//!   returning it to the driver at each synchronisation;
//! - `detach`: the engine's weights are detached from autograd (the same
//!   storage), so generation records no backward graph;
//! - `sync`: the token ids of a step are checked on the host, never read
//!   back from the device inside the step;
//! - `upload`: a step's inputs (ids, positions, KV slots, block tables,
//!   rows to sample) go up in one copy, RoPE is gathered from a table on
//!   the device;
//! - `sampling`: tokens are sampled on the device; only ids and logprobs
//!   come back, never the `[B, vocab]` logits;
//! - `fused`: the steps of a Qwen-family model (bf16, or f32 with
//!   `bf16_rollouts`) run the engine's dedicated GPU step (fixed kernels
//!   per layer over buffers allocated once) instead of the candle forward;
//! - `graphs`: that step's decode steps are captured as a CUDA graph per
//!   batch bucket and replayed (needs `events`: candle's events cannot be
//!   captured).
//!
//! They are not all independent: `upload` includes `sync` (its step reads
//! nothing back either), and the dedicated step (`fused`) always uploads
//! once and samples on the device, whatever `upload`, `sync` and
//! `sampling` say; those three matter for the candle forward.
//!
//! The CPU path is unaffected by all of them but `detach`.

use std::sync::OnceLock;

/// One overhead cut of the GPU generation path (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuCut {
    Events,
    Pool,
    Detach,
    Sync,
    Upload,
    Sampling,
    Fused,
    Graphs,
}

impl GpuCut {
    pub const ALL: [GpuCut; 8] = [
        GpuCut::Events,
        GpuCut::Pool,
        GpuCut::Detach,
        GpuCut::Sync,
        GpuCut::Upload,
        GpuCut::Sampling,
        GpuCut::Fused,
        GpuCut::Graphs,
    ];

    pub fn name(self) -> &'static str {
        match self {
            GpuCut::Events => "events",
            GpuCut::Pool => "pool",
            GpuCut::Detach => "detach",
            GpuCut::Sync => "sync",
            GpuCut::Upload => "upload",
            GpuCut::Sampling => "sampling",
            GpuCut::Fused => "fused",
            GpuCut::Graphs => "graphs",
        }
    }

    /// Whether this cut is on (not named in `ARBOR_GPU_OFF`).
    pub fn on(self) -> bool {
        !off().contains(&self)
    }
}

/// The cuts a comma-separated list names (`all` for every one), or an
/// error naming the unknown entry.
pub fn parse_cuts(list: &str) -> Result<Vec<GpuCut>, String> {
    let mut out = Vec::new();
    for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        if name == "all" {
            out.extend(GpuCut::ALL);
            continue;
        }
        match GpuCut::ALL.iter().find(|c| c.name() == name) {
            Some(&c) => out.push(c),
            None => {
                return Err(format!(
                    "`{name}` is not one of all, {}",
                    GpuCut::ALL.map(GpuCut::name).join(", ")
                ))
            }
        }
    }
    Ok(out)
}

/// The cuts `ARBOR_GPU_OFF` turns off, or its error (read once).
pub fn cuts_off_from_env() -> Result<Vec<GpuCut>, String> {
    match std::env::var("ARBOR_GPU_OFF") {
        Ok(v) => parse_cuts(&v).map_err(|e| format!("ARBOR_GPU_OFF: {e}")),
        Err(_) => Ok(Vec::new()),
    }
}

fn off() -> &'static [GpuCut] {
    static OFF: OnceLock<Vec<GpuCut>> = OnceLock::new();
    // A bad value was reported by the command that started (which checks
    // it first); here it turns nothing off.
    OFF.get_or_init(|| cuts_off_from_env().unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_parse_and_unknown_names_are_named() {
        assert_eq!(parse_cuts("").unwrap(), []);
        assert_eq!(
            parse_cuts("pool, sampling").unwrap(),
            [GpuCut::Pool, GpuCut::Sampling]
        );
        assert_eq!(parse_cuts("all").unwrap(), GpuCut::ALL);
        let e = parse_cuts("events,kernels").unwrap_err();
        assert!(e.contains("`kernels`") && e.contains("graphs"), "{e}");
    }
}
