//! The device check behind `arbor check-device`: every custom kernel against its CPU reference on
//! fresh random inputs, the model's logits on the device vs the CPU, a short
//! training step on the device, then the device benchmarks (kernel time vs
//! the bytes-moved or FLOP floor, decode tokens/s vs the roofline). Prints a
//! table last and writes JSON.
//!
//! Accuracy is `||out - ref|| / ||ref||` with the reference computed on the
//! CPU in float64 from the very inputs the device saw (bf16 inputs rounded
//! first). Tolerances: f32 paths 1e-4
//! (f32 arithmetic lands far under 1e-3), bf16 paths 1e-2. NaN never
//! passes; outputs are poisoned (NaN-filled) before every kernel writes them
//! so an unwritten element fails the check.
//!
//! On the CPU the same pipeline runs the CPU ops against the float64 brute
//! force, which is how CI exercises it without a GPU; the training step's
//! gradients are then compared with an independent path (full logits,
//! `log_softmax` and a gather through candle's autograd) instead of the
//! device itself.
//!
//! Sections: [`ops`] (logprob gather, PPO and value losses, segment ops,
//! paged attention), [`model`] (logits, a PPO step), [`bench`] (ceilings,
//! kernel and decode benchmarks).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use candle_core::Device;
use serde::Serialize;

pub mod bench;
pub mod model;
pub mod ops;
mod util;

pub use util::Rng;

/// Errors of the check (a failed check is not an error: it is a
/// [`Check`] with `pass: false`).
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Model(#[from] arbor_model::ModelError),
    #[error(transparent)]
    Engine(#[from] arbor_engine::EngineError),
    #[error(transparent)]
    Rl(#[from] arbor_rl::RlError),
    #[error("{0}")]
    Msg(String),
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

pub type Result<T> = std::result::Result<T, CheckError>;

/// `return Err(CheckError::Msg(format!(...)))`.
macro_rules! bail {
    ($($t:tt)*) => {
        return Err($crate::CheckError::Msg(format!($($t)*)))
    };
}
pub(crate) use bail;

/// A missing value as a [`CheckError::Msg`].
pub(crate) trait OrMsg<T> {
    fn or_msg(self, msg: &str) -> Result<T>;
}

impl<T> OrMsg<T> for Option<T> {
    fn or_msg(self, msg: &str) -> Result<T> {
        self.ok_or_else(|| CheckError::Msg(msg.to_string()))
    }
}

/// What to check, where.
#[derive(Debug, Clone)]
pub struct CheckConfig {
    /// The device under test (the CPU runs the same pipeline).
    pub device: Device,
    /// Small sizes everywhere (always on the CPU).
    pub quick: bool,
    /// Seed of the random inputs.
    pub seed: u64,
    /// Run the benchmarks after the checks.
    pub bench: bool,
    /// Where the JSON report is (re)written after every section.
    pub json: PathBuf,
}

#[derive(Debug, Serialize, Clone)]
pub struct Check {
    pub section: String,
    pub name: String,
    pub dtype: String,
    pub rel_err: f64,
    pub tol: f64,
    pub pass: bool,
}

#[derive(Debug, Serialize, Clone)]
pub struct Bench {
    pub name: String,
    /// Median time per call, ms.
    pub ms: f64,
    /// Floor from bytes moved at the measured copy bandwidth, ms.
    pub bytes_floor_ms: f64,
    /// Floor from FLOPs at the measured matmul rate, ms.
    pub flop_floor_ms: f64,
    /// max(floors) / ms.
    pub of_floor: f64,
    pub note: String,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub device: String,
    /// The CPU matmul kernels of this machine (`avx512`, `avx512-bf16`,
    /// `avx2`, `portable`): the CPU side of every check.
    pub cpu_kernels: &'static str,
    pub seed: u64,
    pub quick: bool,
    pub date_unix: u64,
    /// False while the run is in progress (the JSON is rewritten after
    /// every section) or when it was cut short.
    pub complete: bool,
    pub copy_gbps: Option<f64>,
    pub matmul_tflops: Option<f64>,
    pub checks: Vec<Check>,
    pub benches: Vec<Bench>,
    pub all_pass: bool,
}
/// `cpu` or `cuda:N`.
fn device_name(dev: &Device) -> String {
    match dev.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        other => format!("{other:?}"),
    }
}

/// Run every check (then the benchmarks) on `cfg.device`, rewriting
/// `cfg.json` after each section so a run cut short keeps what it measured.
pub fn run(cfg: &CheckConfig) -> Result<Report> {
    let dev = cfg.device.clone();
    let seed = cfg.seed;
    let quick = cfg.quick || dev.is_cpu();
    let cpu_kernels = arbor_ops::MatmulIsa::detect().name();
    eprintln!(
        "check-device: {} (seed {seed}{}; CPU kernels {cpu_kernels})",
        device_name(&dev),
        if quick { ", quick sizes" } else { "" }
    );
    arbor_ops::set_poison(true);
    let mut rng = Rng(seed);
    let mut rep = Report {
        device: format!("{dev:?}"),
        cpu_kernels,
        seed,
        quick,
        date_unix: 0,
        complete: false,
        copy_gbps: None,
        matmul_tflops: None,
        checks: Vec::new(),
        benches: Vec::new(),
        all_pass: false,
    };
    // Each section is guarded: an error or a panic (a kernel that fails to
    // load, a launch error) becomes one failed check naming the section, and
    // the rest still run. The JSON is rewritten after every section, so a
    // run cut short by a time limit keeps what it measured.
    type Section = fn(&Device, bool, &mut Rng, &mut Vec<Check>) -> Result<()>;
    let sections: [(&str, Section); 10] = [
        ("logprob", ops::logprob_checks),
        ("fused", ops::fused_checks),
        ("losses", ops::loss_checks),
        ("segment", ops::segment_checks),
        ("attention", ops::attention_checks),
        ("sampling", ops::sampling_checks),
        ("decode kernels", ops::decode_kernel_checks),
        ("model", |d, q, _, o| model::model_checks(d, q, o)),
        ("fast decode", model::fast_decode_checks),
        ("train", model::train_check),
    ];
    for (name, f) in sections {
        guarded(name, &mut rep.checks, |out| f(&dev, quick, &mut rng, out));
        rep.save(&cfg.json)?;
    }
    arbor_ops::set_poison(false);
    if cfg.bench {
        if let Some((bw, rate)) = guarded("ceilings", &mut rep.checks, |_| {
            bench::ceilings(&dev, quick)
        }) {
            rep.copy_gbps = Some(bw / 1e9);
            rep.matmul_tflops = Some(rate / 1e12);
            rep.save(&cfg.json)?;
            let mut benches = Vec::new();
            guarded("kernel benches", &mut rep.checks, |_| {
                bench::kernel_benches(&dev, quick, bw, rate, &mut rng, &mut benches)
            });
            rep.benches.append(&mut benches);
            rep.save(&cfg.json)?;
            guarded("decode benches", &mut rep.checks, |_| {
                bench::decode_benches(&dev, quick, bw, rate, &mut benches)
            });
            rep.benches.append(&mut benches);
        }
    }
    rep.complete = true;
    rep.save(&cfg.json)?;
    Ok(rep)
}

impl Report {
    /// Writes the report as it stands (`complete: false` until the end).
    fn save(&mut self, path: &Path) -> Result<()> {
        self.all_pass = !self.checks.is_empty() && self.checks.iter().all(|c| c.pass);
        self.date_unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let text =
            serde_json::to_string_pretty(self).map_err(|e| CheckError::Msg(e.to_string()))?;
        std::fs::write(path, text).map_err(|source| CheckError::Write {
            path: path.to_path_buf(),
            source,
        })
    }
}

/// Runs one section of the check. An error or a panic is recorded as a
/// failed check of that section named `did not finish: <message>` (error
/// NaN, written as null in the JSON) and `None` is returned; the caller goes
/// on with the next section.
fn guarded<T>(
    section: &str,
    out: &mut Vec<Check>,
    f: impl FnOnce(&mut Vec<Check>) -> Result<T>,
) -> Option<T> {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut *out)));
    let msg = match r {
        Ok(Ok(v)) => return Some(v),
        Ok(Err(e)) => e.to_string(),
        Err(p) => p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| {
                p.downcast_ref::<&str>()
                    .map(std::string::ToString::to_string)
            })
            .map(|s| format!("panic: {s}"))
            .unwrap_or_else(|| "panic".into()),
    };
    eprintln!("  {section:<8} did not finish: {msg}");
    out.push(Check {
        section: section.into(),
        name: format!("did not finish: {msg}"),
        dtype: String::new(),
        rel_err: f64::NAN,
        tol: 0.0,
        pass: false,
    });
    None
}

impl Report {
    /// The checks, then the benchmarks, as markdown tables.
    pub fn tables(&self) -> String {
        let (checks, benches, bw, rate) = (
            &self.checks,
            &self.benches,
            self.copy_gbps,
            self.matmul_tflops,
        );
        let mut s = String::new();
        s.push('\n');
        let _ = writeln!(s, "| section | check | dtype | rel err | tol | |");
        let _ = writeln!(s, "|---|---|---|---|---|---|");
        for c in checks {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.2e} | {:.0e} | {} |",
                c.section,
                c.name,
                c.dtype,
                c.rel_err,
                c.tol,
                if c.pass { "ok" } else { "FAIL" }
            );
        }
        if !benches.is_empty() {
            s.push('\n');
            let _ = writeln!(
                s,
                "ceilings: copy {:.0} GB/s, matmul {:.1} TFLOP/s",
                bw.unwrap_or(0.0),
                rate.unwrap_or(0.0)
            );
            let _ = writeln!(
                s,
                "| benchmark | ms | bytes floor ms | flop floor ms | of floor | note |"
            );
            let _ = writeln!(s, "|---|---|---|---|---|---|");
            for b in benches {
                let _ = writeln!(
                    s,
                    "| {} | {:.3} | {:.3} | {:.3} | {:.0}% | {} |",
                    b.name,
                    b.ms,
                    b.bytes_floor_ms,
                    b.flop_floor_ms,
                    100.0 * b.of_floor,
                    b.note
                );
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::push;
    use candle_core::DType;

    #[test]
    fn guarded_records_errors_and_panics_and_goes_on() {
        let mut out = Vec::new();
        assert_eq!(guarded("a", &mut out, |_| Ok(3)), Some(3));
        assert!(out.is_empty());
        assert_eq!(
            guarded("b", &mut out, |_| -> Result<()> { bail!("no kernel") }),
            None
        );
        assert_eq!(
            guarded("c", &mut out, |o| -> Result<()> {
                push(o, "c", "first", DType::F32, 0.0);
                panic!("launch failed")
            }),
            None
        );
        let names: Vec<_> = out
            .iter()
            .map(|c| (c.section.as_str(), c.name.as_str(), c.pass))
            .collect();
        assert_eq!(
            names,
            [
                ("b", "did not finish: no kernel", false),
                ("c", "first", true),
                ("c", "did not finish: panic: launch failed", false),
            ]
        );
    }
}
