//! `arbor check-device`: the device check of the `arbor-check` crate
//! (every custom kernel against its float64 CPU reference, the model's
//! logits and a PPO step on the device, then the device benchmarks),
//! printed as tables and written as JSON.

use std::path::PathBuf;

use anyhow::{bail, Result};
use candle_core::Device;

#[derive(Debug, clap::Args)]
pub struct CheckDeviceArgs {
    /// `cuda` (the default when built with `--features cuda`) or `cpu`.
    #[arg(long)]
    device: Option<String>,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    ordinal: usize,
    /// Where to write the JSON results.
    #[arg(long, default_value = "check-device.json")]
    json: PathBuf,
    /// Small sizes everywhere (CPU smoke runs).
    #[arg(long)]
    quick: bool,
    /// Seed of the random inputs (default: from the clock, so each run draws
    /// fresh inputs).
    #[arg(long)]
    seed: Option<u64>,
    /// Skip the benchmarks.
    #[arg(long)]
    no_bench: bool,
}

pub fn run(a: CheckDeviceArgs) -> Result<()> {
    let want = a.device.clone().unwrap_or_else(|| {
        if cfg!(feature = "cuda") {
            "cuda".into()
        } else {
            "cpu".into()
        }
    });
    let device = match want.as_str() {
        "cpu" => Device::Cpu,
        "cuda" => {
            if !cfg!(feature = "cuda") {
                bail!("this arbor was built without CUDA; rebuild with `--features cuda` (see scripts/gpu-check.sh) or pass --device cpu");
            }
            arbor_train::parse_device(&format!("cuda:{}", a.ordinal)).map_err(|e| {
                anyhow::anyhow!("no usable CUDA device: {e} (is the NVIDIA driver loaded, libcuda.so.1 the driver's?)")
            })?
        }
        other => bail!("--device must be cuda or cpu, not `{other}`"),
    };
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    let rep = arbor_check::run(&arbor_check::CheckConfig {
        device,
        quick: a.quick,
        seed,
        bench: !a.no_bench,
        json: a.json.clone(),
    })?;
    print!("\n{}", rep.tables());
    println!(
        "{} ({} checks, {} failed); JSON: {}",
        if rep.all_pass { "ALL PASS" } else { "FAILED" },
        rep.checks.len(),
        rep.checks.iter().filter(|c| !c.pass).count(),
        a.json.display()
    );
    if !rep.all_pass {
        bail!("some device checks are outside tolerance or did not run");
    }
    Ok(())
}
