//! With the `cuda` feature, compiles `kernels/*.cu` (workspace root) into
//! fat binaries in `$OUT_DIR`, where `src/cuda.rs` embeds them: SASS for
//! `sm_$CUDA_COMPUTE_CAP` (default 90: H100/H200), loaded with no JIT, plus
//! PTX of the same architecture, which the driver compiles for newer GPUs. Without it, does nothing: CPU builds need no
//! CUDA. nvcc is `$NVCC`, else `$CUDA_ROOT/bin/nvcc` (or CUDA_HOME /
//! CUDA_PATH), else `nvcc` on PATH; `scripts/cuda-toolchain.sh` sets these.

use std::path::{Path, PathBuf};
use std::process::Command;

const KERNELS: &[&str] = &[
    "logprob",
    "ppo",
    "segment",
    "paged_attention",
    "sample",
    "decode",
    "fused",
];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CARGO_FEATURE_CUDA");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    for v in [
        "NVCC",
        "CUDA_ROOT",
        "CUDA_HOME",
        "CUDA_PATH",
        "CUDA_COMPUTE_CAP",
    ] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let kdir = manifest.join("../../kernels");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let cap = cap.trim().replace('.', "");
    let nvcc = find_nvcc();
    println!(
        "cargo:rerun-if-changed={}",
        kdir.join("common.cuh").display()
    );
    for k in KERNELS {
        let src = kdir.join(format!("{k}.cu"));
        println!("cargo:rerun-if-changed={}", src.display());
        let fatbin = out.join(format!("{k}.fatbin"));
        let status = Command::new(&nvcc)
            .args(["--fatbin", "-O3", "-std=c++17", "--expt-relaxed-constexpr"])
            .arg(format!("-gencode=arch=compute_{cap},code=sm_{cap}"))
            .arg(format!("-gencode=arch=compute_{cap},code=compute_{cap}"))
            .arg("-I")
            .arg(&kdir)
            .arg(&src)
            .arg("-o")
            .arg(&fatbin)
            .status()
            .unwrap_or_else(|e| {
                panic!(
                    "arbor-ops: cannot run nvcc ({}): {e}. Install the CUDA toolchain with \
                     `eval \"$(scripts/cuda-toolchain.sh)\"` or set NVCC.",
                    nvcc.display()
                )
            });
        assert!(
            status.success(),
            "arbor-ops: nvcc failed on {}",
            src.display()
        );
    }
}

fn find_nvcc() -> PathBuf {
    if let Some(p) = std::env::var_os("NVCC") {
        return PathBuf::from(p);
    }
    for v in ["CUDA_ROOT", "CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = std::env::var_os(v) {
            let p = Path::new(&root).join("bin/nvcc");
            if p.exists() {
                return p;
            }
        }
    }
    PathBuf::from("nvcc")
}
