//! Locating a checkpoint (local directory or HF model id) and loading its
//! tensors from memory-mapped safetensors, single file or sharded.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;

use crate::error::{ModelError, Result};

/// The files that make up a model, wherever they came from.
#[derive(Debug, Clone)]
pub struct ModelFiles {
    /// What the user asked for (a path or an HF id), for messages.
    pub spec: String,
    pub config: PathBuf,
    /// One or more `.safetensors` files.
    pub weights: Vec<PathBuf>,
    pub tokenizer: Option<PathBuf>,
    pub tokenizer_config: Option<PathBuf>,
    /// `chat_template.jinja`: where recent transformers save a model's chat
    /// template; it takes precedence over `tokenizer_config.json`'s.
    pub chat_template: Option<PathBuf>,
    /// `generation_config.json` (default stop tokens, sampling defaults).
    pub generation_config: Option<PathBuf>,
}

const INDEX: &str = "model.safetensors.index.json";
const SINGLE: &str = "model.safetensors";

impl ModelFiles {
    /// Resolve `spec`: an existing local directory, or else an HF model id
    /// (`org/name`, optionally `org/name@revision`) looked up in the local HF
    /// cache first and downloaded only when the cache lacks a file and
    /// `HF_HUB_OFFLINE` is not set.
    pub fn resolve(spec: &str) -> Result<Self> {
        let p = Path::new(spec);
        if p.is_dir() {
            return Self::from_dir(p);
        }
        if p.exists() {
            return Err(ModelError::Resolve {
                model: spec.into(),
                msg: "is a file; pass the model directory (with config.json and *.safetensors)"
                    .into(),
            });
        }
        let looks_like_id = spec.split('/').count() == 2
            && !spec.starts_with('.')
            && !spec.starts_with('/')
            && !spec.is_empty();
        if !looks_like_id {
            return Err(ModelError::Resolve {
                model: spec.into(),
                msg: "no such directory, and not an HF model id of the form org/name".into(),
            });
        }
        Self::from_hub(spec)
    }

    /// A local directory holding `config.json` and the safetensors.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let config = dir.join("config.json");
        if !config.is_file() {
            return Err(ModelError::io(
                &config,
                std::io::Error::new(std::io::ErrorKind::NotFound, "config.json not found"),
            ));
        }
        let weights = if dir.join(INDEX).is_file() {
            let index = dir.join(INDEX);
            shard_files(&index)?
                .into_iter()
                .map(|f| dir.join(f))
                .collect()
        } else if dir.join(SINGLE).is_file() {
            vec![dir.join(SINGLE)]
        } else {
            let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|e| ModelError::io(dir, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            found.sort();
            if found.is_empty() {
                return Err(ModelError::io(
                    dir.join(SINGLE),
                    std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        "no model.safetensors, model.safetensors.index.json or *.safetensors in the directory",
                    ),
                ));
            }
            found
        };
        let opt = |name: &str| Some(dir.join(name)).filter(|p| p.is_file());
        Ok(ModelFiles {
            spec: dir.display().to_string(),
            config,
            weights,
            tokenizer: opt("tokenizer.json"),
            tokenizer_config: opt("tokenizer_config.json"),
            chat_template: opt("chat_template.jinja"),
            generation_config: opt("generation_config.json"),
        })
    }

    fn from_hub(spec: &str) -> Result<Self> {
        let (id, revision) = match spec.split_once('@') {
            Some((id, rev)) => (id.to_string(), rev.to_string()),
            None => (spec.to_string(), "main".to_string()),
        };
        let repo = hf_hub::Repo::with_revision(id.clone(), hf_hub::RepoType::Model, revision);
        let cache = match std::env::var("HF_HUB_CACHE") {
            Ok(p) if !p.is_empty() => hf_hub::Cache::new(p.into()),
            _ => hf_hub::Cache::from_env(),
        };
        let cached = cache.repo(repo.clone());
        let offline = std::env::var("HF_HUB_OFFLINE")
            .map(|v| !v.is_empty() && v != "0" && v.to_lowercase() != "false")
            .unwrap_or(false);
        let api = if offline {
            None
        } else {
            hf_hub::api::sync::ApiBuilder::from_cache(cache.clone())
                .with_progress(true)
                .build()
                .ok()
                .map(|a| a.repo(repo.clone()))
        };
        let fetch = |file: &str, required: bool| -> Result<Option<PathBuf>> {
            if let Some(p) = cached.get(file) {
                return Ok(Some(p));
            }
            let Some(api) = &api else {
                return if required {
                    Err(ModelError::Resolve {
                        model: spec.into(),
                        msg: format!(
                            "`{file}` is not in the HF cache at {} and HF_HUB_OFFLINE is set",
                            cache.path().display()
                        ),
                    })
                } else {
                    Ok(None)
                };
            };
            match api.get(file) {
                Ok(p) => Ok(Some(p)),
                Err(e) if required => Err(ModelError::Resolve {
                    model: spec.into(),
                    msg: format!("cannot fetch `{file}`: {e}"),
                }),
                Err(_) => Ok(None),
            }
        };
        let config = fetch("config.json", true)?.expect("required");
        let weights = match fetch(INDEX, false)? {
            Some(index) => shard_files(&index)?
                .iter()
                .map(|f| fetch(f, true).map(|p| p.expect("required")))
                .collect::<Result<Vec<_>>>()?,
            None => vec![fetch(SINGLE, true)?.expect("required")],
        };
        Ok(ModelFiles {
            spec: spec.into(),
            config,
            weights,
            tokenizer: fetch("tokenizer.json", false)?,
            tokenizer_config: fetch("tokenizer_config.json", false)?,
            chat_template: fetch("chat_template.jinja", false)?,
            generation_config: fetch("generation_config.json", false)?,
        })
    }
}

impl ModelFiles {
    /// Stop tokens for generation: `eos_token_id` of `generation_config.json`
    /// when present, else of `config.json` (`config_eos`).
    pub fn eos_token_ids(&self, config_eos: &[u32]) -> Result<Vec<u32>> {
        let Some(p) = &self.generation_config else {
            return Ok(config_eos.to_vec());
        };
        let text = std::fs::read_to_string(p).map_err(|e| ModelError::io(p, e))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| ModelError::json(p, &e))?;
        let bad = || ModelError::ConfigKey {
            path: p.clone(),
            key: "eos_token_id".into(),
            msg: "expected a token id or a list of token ids".into(),
        };
        match v.get("eos_token_id") {
            None | Some(serde_json::Value::Null) => Ok(config_eos.to_vec()),
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .map(|x| x.as_u64().map(|n| n as u32).ok_or_else(bad))
                .collect(),
            Some(x) => Ok(vec![x.as_u64().ok_or_else(bad)? as u32]),
        }
    }
}

/// The distinct shard file names listed in `model.safetensors.index.json`, sorted.
fn shard_files(index: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(index).map_err(|e| ModelError::io(index, e))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| ModelError::json(index, &e))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| ModelError::ConfigKey {
            path: index.to_path_buf(),
            key: "weight_map".into(),
            msg: "missing or not an object".into(),
        })?;
    let mut files: Vec<String> = Vec::new();
    for (name, f) in map {
        let f = f.as_str().ok_or_else(|| ModelError::ConfigKey {
            path: index.to_path_buf(),
            key: format!("weight_map.{name}"),
            msg: "expected a file name".into(),
        })?;
        if f.contains('/') || f.contains('\\') || f.starts_with('.') {
            return Err(ModelError::ConfigKey {
                path: index.to_path_buf(),
                key: format!("weight_map.{name}"),
                msg: format!("`{f}` is not a plain file name"),
            });
        }
        if !files.iter().any(|x| x == f) {
            files.push(f.to_string());
        }
    }
    files.sort();
    Ok(files)
}

/// Memory-mapped safetensors files, with an index from tensor name to file.
pub struct Checkpoint {
    files: Vec<(PathBuf, candle_core::safetensors::MmapedSafetensors)>,
    index: HashMap<String, usize>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field(
                "files",
                &self.files.iter().map(|(p, _)| p).collect::<Vec<_>>(),
            )
            .field("tensors", &self.index.len())
            .finish()
    }
}

impl Checkpoint {
    /// Memory-map each file and read its header. A truncated or corrupt file
    /// is reported with its path.
    pub fn open(paths: &[PathBuf]) -> Result<Self> {
        let mut files = Vec::with_capacity(paths.len());
        let mut index = HashMap::new();
        for (i, p) in paths.iter().enumerate() {
            if !p.is_file() {
                return Err(ModelError::io(
                    p,
                    std::io::Error::new(std::io::ErrorKind::NotFound, "weights file not found"),
                ));
            }
            let st = mmap(p)?;
            for (name, _) in st.tensors() {
                index.insert(name, i);
            }
            files.push((p.clone(), st));
        }
        Ok(Checkpoint { files, index })
    }

    /// All tensor names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// Whether the checkpoint holds `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn file_list(&self) -> String {
        self.files
            .iter()
            .map(|(p, _)| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Load `name`, check it has `shape`, convert to `dtype` on `device`.
    pub fn load(
        &self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let Some(&i) = self.index.get(name) else {
            return Err(ModelError::MissingTensor {
                name: name.into(),
                files: self.file_list(),
            });
        };
        let (path, st) = &self.files[i];
        let view = st.get(name).map_err(|e| ModelError::Safetensors {
            path: path.clone(),
            msg: format!("tensor `{name}`: {e}"),
        })?;
        if view.shape() != shape {
            return Err(ModelError::ShapeMismatch {
                name: name.into(),
                expected: shape.to_vec(),
                found: view.shape().to_vec(),
            });
        }
        use safetensors::Dtype as S;
        match view.dtype() {
            S::F32 | S::F16 | S::BF16 | S::F64 => {}
            other => {
                return Err(ModelError::TensorDtype {
                    name: name.into(),
                    dtype: format!("{other:?}"),
                })
            }
        }
        let t = st.load(name, device).map_err(|e| ModelError::Safetensors {
            path: path.clone(),
            msg: format!("tensor `{name}`: {e}"),
        })?;
        Ok(t.to_dtype(dtype)?)
    }
}

#[allow(unsafe_code)]
fn mmap(p: &Path) -> Result<candle_core::safetensors::MmapedSafetensors> {
    // SAFETY: the file is mapped read-only; like every safetensors reader we
    // assume it is not truncated or rewritten while mapped.
    unsafe { candle_core::safetensors::MmapedSafetensors::new(p) }.map_err(|e| {
        ModelError::Safetensors {
            path: p.to_path_buf(),
            msg: e.to_string(),
        }
    })
}

/// How a parameter is initialised when there is no checkpoint to read it from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// N(0, std^2).
    Normal(f64),
    Ones,
    Zeros,
}

/// Where parameters come from.
#[derive(Debug)]
pub enum ParamSource<'a> {
    /// A checkpoint on disk; every tensor must be present with the right shape.
    Checkpoint(&'a Checkpoint),
    /// Fresh random weights (benchmarks, the quickstart's tiny model),
    /// reproducible: each tensor is drawn from its own RNG seeded by
    /// `seed` and the tensor's name, whatever the loading order.
    Random { seed: u64 },
}

/// Builds parameters for a model: loads or initialises each tensor and, when
/// trainable, wraps it in a [`Var`] registered under its HF name in a
/// [`VarMap`] (so optimizers and checkpoint writers see HF names).
pub struct ParamLoader<'a> {
    pub source: ParamSource<'a>,
    pub dtype: DType,
    pub device: Device,
    vars: Option<VarMap>,
    lora: Option<crate::model::LoraConfig>,
    /// Set by [`all_in_dtype`](Self::all_in_dtype).
    all_in_dtype: bool,
    /// Set by [`rounded_through`](Self::rounded_through).
    round_through: Option<DType>,
}

impl std::fmt::Debug for ParamLoader<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParamLoader")
            .field("source", &self.source)
            .field("dtype", &self.dtype)
            .field("trainable", &self.vars.is_some())
            .field("bf16_matrices", &self.bf16_matrices())
            .finish()
    }
}

impl<'a> ParamLoader<'a> {
    /// Frozen parameters (inference). bf16 on the CPU keeps bf16 matrices
    /// under f32 compute ([`bf16_matrices`](Self::bf16_matrices)).
    pub fn frozen(source: ParamSource<'a>, dtype: DType, device: &Device) -> Self {
        ParamLoader {
            source,
            dtype,
            device: device.clone(),
            vars: None,
            lora: None,
            all_in_dtype: false,
            round_through: None,
        }
    }

    /// Every parameter and activation in `dtype`, also bf16 on the CPU
    /// (candle's bf16 arithmetic, as on a GPU; slow on a CPU).
    pub fn all_in_dtype(mut self) -> Self {
        self.all_in_dtype = true;
        self
    }

    /// Random weights (drawn in f32) are rounded to `dt` before they are
    /// cast to the loader's dtype: an f64 model built so holds exactly the
    /// weights of the `dt` model of the same seed, the reference that
    /// measures a bf16 model's arithmetic error apart from its weights'
    /// rounding. Checkpoint tensors are not affected.
    pub fn rounded_through(mut self, dt: DType) -> Self {
        self.round_through = Some(dt);
        self
    }

    /// Trainable parameters, registered in `vars`.
    pub fn trainable(source: ParamSource<'a>, dtype: DType, device: &Device, vars: VarMap) -> Self {
        ParamLoader {
            source,
            dtype,
            device: device.clone(),
            vars: Some(vars),
            lora: None,
            all_in_dtype: false,
            round_through: None,
        }
    }

    /// Put LoRA adapters on the projections `cfg` names. The base model's
    /// tensors (`model.*`, `lm_head.*`) are then frozen: only the adapters
    /// and any other head (a value head) are registered as trainable.
    pub fn with_lora(mut self, cfg: crate::model::LoraConfig) -> Self {
        self.lora = Some(cfg);
        self
    }

    /// The LoRA settings, if any.
    pub fn lora(&self) -> Option<&crate::model::LoraConfig> {
        self.lora.as_ref()
    }

    /// Whether this loader keeps bf16 matrices under f32 compute: frozen
    /// bf16 parameters on the CPU, unless
    /// [`all_in_dtype`](Self::all_in_dtype). A CPU has no fast bf16
    /// arithmetic besides dot products (AVX-512 BF16, or bf16 widened to
    /// f32 in registers), so the projections and embeddings stay bf16 (half
    /// the bytes; the matmuls round their inputs to bf16 and sum in f32, see
    /// [`crate::model::matmul_nt`]) while norms, biases and activations are
    /// f32; K and V are rounded to bf16 values, as a bf16 model's are, so
    /// the KV cache holds them in bf16 ([`crate::Transformer::kv_dtype`]).
    /// Elsewhere (a GPU, trainable or `all_in_dtype` parameters) bf16 means
    /// bf16 throughout.
    pub fn bf16_matrices(&self) -> bool {
        !self.all_in_dtype
            && self.vars.is_none()
            && self.dtype == DType::BF16
            && self.device.is_cpu()
    }

    /// The dtype activations are computed in: `dtype`, except f32 for
    /// [`bf16_matrices`](Self::bf16_matrices).
    pub fn compute_dtype(&self) -> DType {
        if self.bf16_matrices() {
            DType::F32
        } else {
            self.dtype
        }
    }

    /// The dtype a parameter of `shape` is kept in.
    fn param_dtype(&self, shape: &[usize]) -> DType {
        if self.bf16_matrices() && shape.len() == 2 {
            DType::BF16
        } else {
            self.compute_dtype()
        }
    }

    /// The registry of trainable parameters, if any.
    pub fn varmap(&self) -> Option<&VarMap> {
        self.vars.as_ref()
    }

    /// Whether the source already has `name` (random sources have nothing).
    pub fn has(&self, name: &str) -> bool {
        match &self.source {
            ParamSource::Checkpoint(c) => c.contains(name),
            ParamSource::Random { .. } => false,
        }
    }

    /// Get parameter `name` of `shape`: from the checkpoint, or initialised.
    pub fn get(&self, name: &str, shape: &[usize], init: Init) -> Result<Tensor> {
        let t = match &self.source {
            ParamSource::Checkpoint(c) => {
                c.load(name, shape, self.param_dtype(shape), &self.device)?
            }
            ParamSource::Random { seed } => init_tensor(
                name,
                *seed,
                shape,
                init,
                self.round_through,
                self.param_dtype(shape),
                &self.device,
            )?,
        };
        self.register(name, t)
    }

    /// Like [`get`](Self::get) but initialises when the checkpoint lacks the
    /// tensor (e.g. a fresh value head on a policy checkpoint).
    pub fn get_or_init(&self, name: &str, shape: &[usize], init: Init) -> Result<Tensor> {
        if self.has(name) {
            self.get(name, shape, init)
        } else {
            let seed = match &self.source {
                ParamSource::Random { seed } => *seed,
                ParamSource::Checkpoint(_) => 0,
            };
            let t = init_tensor(
                name,
                seed,
                shape,
                init,
                self.round_through,
                self.param_dtype(shape),
                &self.device,
            )?;
            self.register(name, t)
        }
    }

    fn register(&self, name: &str, t: Tensor) -> Result<Tensor> {
        let frozen_base = self.lora.is_some()
            && (name.starts_with("model.") || name.starts_with("lm_head."))
            && !name.contains(".lora_A.")
            && !name.contains(".lora_B.");
        match &self.vars {
            _ if frozen_base => Ok(t),
            None => Ok(t),
            Some(vm) => {
                let var = Var::from_tensor(&t)?;
                let out = var.as_tensor().clone();
                vm.data()
                    .lock()
                    .map_err(|_| ModelError::Input("parameter registry poisoned".into()))?
                    .insert(name.to_string(), var);
                Ok(out)
            }
        }
    }
}

fn init_tensor(
    name: &str,
    seed: u64,
    shape: &[usize],
    init: Init,
    round: Option<DType>,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let t = match init {
        Init::Normal(std) => {
            let v = normal_draws(seed ^ fnv1a(name.as_bytes()), n, std);
            let t = Tensor::from_vec(v, shape, device)?;
            match round {
                Some(r) => t.to_dtype(r)?.to_dtype(dtype)?,
                None => t.to_dtype(dtype)?,
            }
        }
        Init::Ones => Tensor::ones(shape, dtype, device)?,
        Init::Zeros => Tensor::zeros(shape, dtype, device)?,
    };
    Ok(t)
}

/// `n` normal draws of standard deviation `std` (f32): Box-Muller pairs over
/// the SplitMix64 stream that starts at `state`. Draw `k` of that stream
/// uses state `state + (k + 1) * gamma`, so pair `j` (uniforms `2j` and
/// `2j + 1`) is computed on its own and the pairs run in parallel; the
/// values are those of drawing the stream in order.
fn normal_draws(state: u64, n: usize, std: f64) -> Vec<f32> {
    use rayon::prelude::*;
    const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
    let uniform = |k: u64| {
        let mut z = state.wrapping_add(k.wrapping_add(1).wrapping_mul(GAMMA));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut v = vec![0f32; n.div_ceil(2) * 2];
    v.par_chunks_mut(2)
        .with_min_len(1 << 12)
        .enumerate()
        .for_each(|(j, pair)| {
            let u1 = uniform(2 * j as u64).max(f64::MIN_POSITIVE);
            let u2 = uniform(2 * j as u64 + 1);
            let r = (-2.0 * u1.ln()).sqrt() * std;
            let th = 2.0 * std::f64::consts::PI * u2;
            pair[0] = (r * th.cos()) as f32;
            pair[1] = (r * th.sin()) as f32;
        });
    v.truncate(n);
    v
}

/// FNV-1a hash (stable across runs and platforms).
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Write `config.json` (HF keys) and `model.safetensors` into `dir`
/// atomically (temp file, fsync, rename, fsync of the directory).
pub fn save_pretrained(
    dir: &Path,
    cfg: &crate::ModelConfig,
    tensors: &[(String, Tensor)],
    dtype: DType,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let mut cfg = cfg.clone();
    cfg.torch_dtype = Some(
        match dtype {
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
            DType::F64 => "float64",
            _ => "float32",
        }
        .to_string(),
    );
    let json = serde_json::to_vec_pretty(&cfg.to_hf_json())
        .map_err(|e| ModelError::Input(e.to_string()))?;
    write_atomic(&dir.join("config.json"), |p| {
        std::fs::write(p, &json).map_err(|e| ModelError::io(p, e))
    })?;
    let converted = tensors
        .iter()
        .map(|(n, t)| Ok((n.clone(), t.detach().to_dtype(dtype)?)))
        .collect::<Result<std::collections::HashMap<String, Tensor>>>()?;
    write_atomic(&dir.join(SINGLE), |p| {
        candle_core::safetensors::save(&converted, p).map_err(|e| ModelError::Safetensors {
            path: p.to_path_buf(),
            msg: e.to_string(),
        })
    })?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Write through `write` into `<path>.tmp`, fsync it, then rename onto `path`.
pub fn write_atomic(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    write(&tmp)?;
    std::fs::File::open(&tmp)
        .and_then(|f| f.sync_all())
        .map_err(|e| ModelError::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| ModelError::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parallel draws equal the SplitMix64 stream drawn in order (the
    /// values every earlier random-weight model, fixture and benchmark
    /// used).
    #[test]
    fn normal_draws_equal_the_sequential_stream() {
        let sequential = |mut state: u64, n: usize, std: f64| {
            let mut next = move || {
                state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = state;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
            };
            let mut v = Vec::with_capacity(n);
            while v.len() < n {
                let (u1, u2) = (next().max(f64::MIN_POSITIVE), next());
                let r = (-2.0 * u1.ln()).sqrt() * std;
                let th = 2.0 * std::f64::consts::PI * u2;
                v.push((r * th.cos()) as f32);
                v.push((r * th.sin()) as f32);
            }
            v.truncate(n);
            v
        };
        for (state, n) in [(0u64, 0usize), (1, 1), (7, 2), (u64::MAX, 9), (42, 100_003)] {
            let (a, b) = (normal_draws(state, n, 0.02), sequential(state, n, 0.02));
            assert_eq!(a.len(), n);
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "state {state} n {n}"
            );
        }
    }

    #[test]
    fn rounded_through_holds_the_bf16_weights_exactly() -> Result<()> {
        let dev = Device::Cpu;
        let src = || ParamSource::Random { seed: 11 };
        let init = Init::Normal(0.02);
        let bf = ParamLoader::frozen(src(), DType::BF16, &dev)
            .all_in_dtype()
            .get("w", &[64, 48], init)?;
        let plain = ParamLoader::frozen(src(), DType::F64, &dev).get("w", &[64, 48], init)?;
        let rounded = ParamLoader::frozen(src(), DType::F64, &dev)
            .rounded_through(DType::BF16)
            .get("w", &[64, 48], init)?;
        let (bf, plain, rounded) = (
            bf.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?,
            plain.flatten_all()?.to_vec1::<f64>()?,
            rounded.flatten_all()?.to_vec1::<f64>()?,
        );
        assert_eq!(rounded, bf);
        // The f32 draws themselves are not bf16 values.
        assert!(plain.iter().zip(&bf).filter(|(a, b)| a != b).count() > 3000);
        Ok(())
    }
}
