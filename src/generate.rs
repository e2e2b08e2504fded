//! `arbor generate`: batched generation on the paged engine.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use arbor_engine::{Completion, Engine, EngineConfig, SamplingParams};
use arbor_model::{parse_dtype, ChatOptions, LoadOptions, LoadedModel};
use candle_core::Device;
use clap::{ArgGroup, Args};
use serde::Serialize;

#[derive(Debug, Args)]
#[command(group(ArgGroup::new("input").required(true).args(["prompt", "prompts"])))]
pub struct GenerateArgs {
    /// Model directory or HF model id (org/name[@rev]).
    #[arg(long, value_name = "PATH_OR_ID")]
    pub model: String,
    /// One prompt.
    #[arg(long, value_name = "STR")]
    pub prompt: Option<String>,
    /// A JSONL file, one prompt per line: {"prompt": STR}, {"messages": [...]}
    /// (chat) or {"tokens": [ids]}.
    #[arg(long, value_name = "FILE.jsonl")]
    pub prompts: Option<PathBuf>,
    /// Render text prompts as a user message in the chat template.
    #[arg(long)]
    pub chat: bool,
    /// With --chat on Qwen3: disable thinking (empty think block).
    #[arg(long, requires = "chat")]
    pub no_thinking: bool,
    /// Samples per prompt (the prompt is computed once and shared).
    #[arg(long, default_value_t = 1)]
    pub n: usize,
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// 0 means greedy.
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// 0 means no top-k cut.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Base seed: sample j of prompt i uses seed + i * n + j.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Extra stop string (repeatable).
    #[arg(long = "stop", value_name = "STR")]
    pub stop: Vec<String>,
    /// Do not stop at the model's EOS tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print one JSON object per prompt and sample.
    #[arg(long)]
    pub json: bool,
    /// f32, bf16, f16 or f64 (bf16 on a CPU: bf16 weight matrices and KV
    /// cache, f32 activations; on a GPU bf16 throughout).
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// KV-cache memory budget.
    #[arg(long, default_value_t = 2048)]
    pub kv_memory_mib: usize,
}

#[derive(Debug, Serialize)]
struct Row<'a> {
    prompt_index: usize,
    sample: usize,
    tokens: &'a [u32],
    text: Option<String>,
    logprobs: &'a [f32],
    finish_reason: arbor_engine::FinishReason,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: &'a Option<String>,
}

/// One prompt from the command line or a JSONL line.
enum PromptIn {
    Text(String),
    Messages(serde_json::Value),
    Tokens(Vec<u32>),
}

/// Every prompt of a JSONL file, with where it is (`FILE:LINE`) for errors.
fn read_prompts(path: &Path) -> Result<Vec<(String, PromptIn)>> {
    let f =
        std::fs::File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
        let line = line.with_context(|| format!("{}:{}: cannot read", path.display(), i + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{}:{}", path.display(), i + 1);
        let v: serde_json::Value =
            serde_json::from_str(&line).with_context(|| format!("{}: malformed JSON", at()))?;
        let p = if let Some(s) = v.get("prompt").and_then(|x| x.as_str()) {
            PromptIn::Text(s.to_string())
        } else if let Some(m) = v.get("messages").filter(|m| m.is_array()) {
            PromptIn::Messages(m.clone())
        } else if let Some(t) = v.get("tokens").and_then(|t| t.as_array()) {
            let ids = t
                .iter()
                .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
                .collect::<Option<Vec<_>>>()
                .with_context(|| {
                    format!(
                        "{}: `tokens` must be a list of token ids (integers from 0 to {})",
                        at(),
                        u32::MAX
                    )
                })?;
            PromptIn::Tokens(ids)
        } else {
            bail!(
                "{}: expected a `prompt` string, a `messages` list or a `tokens` list",
                at()
            );
        };
        out.push((at(), p));
    }
    if out.is_empty() {
        bail!("{}: no prompts", path.display());
    }
    Ok(out)
}

/// Most samples of one prompt (`--n`; also the benches' `--batch` and
/// `--n`): each is a sequence the engine keeps, with its own copy of the
/// prompt's tokens.
pub(crate) const MAX_SAMPLES: usize = 1 << 20;

pub fn run(a: GenerateArgs) -> Result<()> {
    if a.n == 0 {
        bail!("--n must be at least 1");
    }
    if a.n > MAX_SAMPLES {
        bail!(
            "--n {} is more than {MAX_SAMPLES} samples of one prompt",
            a.n
        );
    }
    // The sampling flags, checked before the model loads (the engine checks
    // them again per request, naming its fields).
    let params = |seed: u64, stop_tokens: Vec<u32>| SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        max_tokens: a.max_tokens,
        stop_tokens,
        stop_strings: a.stop.clone(),
        seed,
    };
    if let Err(arbor_engine::EngineError::InvalidParams(msg)) = params(0, Vec::new()).validate() {
        let flag = [
            ("temperature", "--temperature"),
            ("top_p", "--top-p"),
            ("min_p", "--min-p"),
            ("max_tokens", "--max-tokens"),
            ("stop_strings", "--stop"),
        ]
        .into_iter()
        .find(|(field, _)| msg.starts_with(field))
        .map_or("a sampling flag", |(_, flag)| flag);
        bail!("{flag} is invalid: {msg}");
    }
    let opts = LoadOptions {
        dtype: parse_dtype(&a.dtype)?,
        device: Device::Cpu,
    };
    let m = LoadedModel::load(&a.model, &opts)
        .with_context(|| format!("loading model `{}`", a.model))?;
    if !a.stop.is_empty() && m.tokenizer.is_none() {
        bail!(
            "--stop needs the model's tokenizer.json to read the output as text, and `{}` has none",
            a.model
        );
    }
    let inputs = match (&a.prompt, &a.prompts) {
        (Some(p), _) => vec![("--prompt".to_string(), PromptIn::Text(p.clone()))],
        (None, Some(f)) => read_prompts(f)?,
        (None, None) => bail!("give --prompt or --prompts"),
    };
    let chat_opts = ChatOptions {
        add_generation_prompt: true,
        enable_thinking: a.no_thinking.then_some(false),
    };
    let encode = |p: &PromptIn| -> Result<Vec<u32>> {
        match p {
            PromptIn::Tokens(t) => Ok(t.clone()),
            PromptIn::Text(_) | PromptIn::Messages(_) => {
                let tok = m.tokenizer.as_ref().with_context(|| {
                    format!("text prompts need tokenizer.json, and `{}` has none (use {{\"tokens\": [...]}})", a.model)
                })?;
                let msgs = match p {
                    PromptIn::Messages(ms) => Some(ms.clone()),
                    PromptIn::Text(t) if a.chat => {
                        Some(serde_json::json!([{"role": "user", "content": t}]))
                    }
                    _ => None,
                };
                match (msgs, p) {
                    (Some(ms), _) => {
                        let tmpl = m
                            .chat_template
                            .as_ref()
                            .with_context(|| format!("`{}` has no chat template", a.model))?;
                        Ok(tok.encode(&tmpl.render(&ms, None, &chat_opts)?, false)?)
                    }
                    (None, PromptIn::Text(t)) => Ok(tok.encode(t, true)?),
                    _ => unreachable!("tokens handled above"),
                }
            }
        }
    };
    let mut stops = if a.ignore_eos {
        Vec::new()
    } else {
        m.files.eos_token_ids(&m.config.eos_token_ids)?
    };
    stops.dedup();
    let mut engine = Engine::new(
        &m.model,
        m.tokenizer.clone(),
        EngineConfig {
            kv_memory_mib: a.kv_memory_mib,
            ..Default::default()
        },
    )?;
    let mut groups = Vec::with_capacity(inputs.len());
    for (i, (at, p)) in inputs.iter().enumerate() {
        let ids = encode(p).with_context(|| at.clone())?;
        let samples = (0..a.n)
            .map(|j| params(a.seed.wrapping_add((i * a.n + j) as u64), stops.clone()))
            .collect();
        groups.push(engine.submit(ids, samples).with_context(|| at.clone())?);
    }
    let total = (inputs.len() * a.n) as u64;
    let bar = if a.prompts.is_some() {
        let b = indicatif::ProgressBar::new(total);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:40} {pos}/{len} sequences [{elapsed_precise}<{eta_precise}] {msg}",
            )
            .expect("valid template"),
        );
        b
    } else {
        indicatif::ProgressBar::hidden()
    };
    let start = std::time::Instant::now();
    let done = engine.run(|n| bar.set_position(n as u64))?;
    bar.finish_and_clear();
    let secs = start.elapsed().as_secs_f64();
    let by_id: std::collections::HashMap<u64, &Completion> =
        done.iter().map(|c| (c.id, c)).collect();
    let text = |t: &[u32]| {
        m.tokenizer
            .as_ref()
            .and_then(|tok| tok.decode(t, true).ok())
    };
    for (i, ids) in groups.iter().enumerate() {
        for (j, id) in ids.iter().enumerate() {
            let c = by_id[id];
            if a.json {
                let row = Row {
                    prompt_index: i,
                    sample: j,
                    tokens: &c.tokens,
                    text: text(&c.tokens),
                    logprobs: &c.logprobs,
                    finish_reason: c.finish_reason,
                    error: &c.error,
                };
                println!("{}", serde_json::to_string(&row)?);
            } else {
                println!(
                    "=== prompt {i}, sample {j} ({:?}, {} tokens)",
                    c.finish_reason,
                    c.tokens.len()
                );
                match (text(&c.tokens), &c.error) {
                    (_, Some(e)) => println!("error: {e}"),
                    (Some(t), None) => println!("{t}"),
                    (None, None) => println!("{:?}", c.tokens),
                }
            }
        }
    }
    let st = engine.stats();
    eprintln!(
        "{} sequences, {} tokens generated in {secs:.2}s ({:.1} tokens/s); prefill {} computed, {} from cache, {} shared by forks",
        done.len(),
        st.generated,
        st.generated as f64 / secs,
        st.prefill_computed,
        st.prefill_cached,
        st.prefill_forked
    );
    Ok(())
}
