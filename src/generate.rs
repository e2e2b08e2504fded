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
        // A byte-order mark (some Windows editors write one) is not JSON.
        let line = if i == 0 {
            line.strip_prefix('\u{feff}').unwrap_or(&line)
        } else {
            &line
        };
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{}:{}", path.display(), i + 1);
        let v: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("{}: malformed JSON", at()))?;
        let obj = v.as_object().with_context(|| {
            format!(
                "{}: expected an object with a `prompt`, `messages` or `tokens` key",
                at()
            )
        })?;
        let keys: Vec<&str> = ["prompt", "messages", "tokens"]
            .into_iter()
            .filter(|k| obj.contains_key(*k))
            .collect();
        let p = match keys[..] {
            ["prompt"] => PromptIn::Text(
                obj["prompt"]
                    .as_str()
                    .with_context(|| format!("{}: `prompt` must be a string", at()))?
                    .to_string(),
            ),
            ["messages"] => {
                let m = &obj["messages"];
                if !m.is_array() {
                    bail!(
                        "{}: `messages` must be a list of {{\"role\", \"content\"}} objects",
                        at()
                    );
                }
                PromptIn::Messages(m.clone())
            }
            ["tokens"] => {
                let ids = obj["tokens"]
                    .as_array()
                    .and_then(|t| {
                        t.iter()
                            .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
                            .collect::<Option<Vec<_>>>()
                    })
                    .with_context(|| {
                        format!(
                            "{}: `tokens` must be a list of token ids (integers from 0 to {})",
                            at(),
                            u32::MAX
                        )
                    })?;
                PromptIn::Tokens(ids)
            }
            [] => bail!(
                "{}: expected a `prompt` string, a `messages` list or a `tokens` list",
                at()
            ),
            _ => bail!(
                "{}: give one of `prompt`, `messages` and `tokens`, not {}",
                at(),
                keys.iter()
                    .map(|k| format!("`{k}`"))
                    .collect::<Vec<_>>()
                    .join(" and ")
            ),
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
    let inputs = match (&a.prompt, &a.prompts) {
        (Some(p), _) => vec![("--prompt".to_string(), PromptIn::Text(p.clone()))],
        (None, Some(f)) => read_prompts(f)?,
        (None, None) => bail!("give --prompt or --prompts"),
    };
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
                        let tmpl = m.chat_template()?;
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
    if let Some(t) = stops.iter().find(|&&t| t as usize >= m.config.vocab_size) {
        bail!(
            "`{}`: EOS token {t} (generation_config.json or config.json) is outside the \
             vocabulary of {}; pass --ignore-eos to generate without it",
            a.model,
            m.config.vocab_size
        );
    }
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
    let mut out = Printer {
        out: std::io::stdout(),
        json: a.json,
        tokenizer: m.tokenizer.as_ref(),
        groups: &groups,
        next: 0,
        done: std::collections::HashMap::new(),
        finished: 0,
    };
    let start = std::time::Instant::now();
    // Rows are printed, in prompt order, as soon as every sample of their
    // prompt is done, so a run stopped by an error keeps what it finished.
    while engine.has_pending() {
        if let Err(e) = engine.step() {
            bar.finish_and_clear();
            out.take(engine.take_finished());
            let missing = out.flush_finished()?;
            return Err(e).context(format!(
                "generation stopped: the rows of every prompt whose samples all finished are \
                 printed; missing: {missing} of {} prompts",
                groups.len()
            ));
        }
        out.take(engine.take_finished());
        bar.suspend(|| out.print_ready())?;
        bar.set_position(out.finished as u64);
    }
    out.take(engine.take_finished());
    bar.finish_and_clear();
    out.print_ready()?;
    let secs = start.elapsed().as_secs_f64();
    let st = engine.stats();
    eprintln!(
        "{} sequences, {} tokens generated in {secs:.2}s ({:.1} tokens/s); prefill {} computed, {} from cache, {} shared by forks",
        out.finished,
        st.generated,
        st.generated as f64 / secs,
        st.prefill_computed,
        st.prefill_cached,
        st.prefill_forked
    );
    Ok(())
}

/// Prints completions as rows, prompt by prompt in order, as soon as all of
/// a prompt's samples are done.
struct Printer<'a, W: std::io::Write> {
    out: W,
    json: bool,
    tokenizer: Option<&'a arbor_model::Tokenizer>,
    /// Sequence ids of each prompt's samples, in prompt order.
    groups: &'a [Vec<u64>],
    /// First prompt not printed yet.
    next: usize,
    /// Finished, not yet printed completions by sequence id.
    done: std::collections::HashMap<u64, Completion>,
    /// Completions taken so far.
    finished: usize,
}

impl<W: std::io::Write> Printer<'_, W> {
    fn take(&mut self, completions: Vec<Completion>) {
        self.finished += completions.len();
        self.done.extend(completions.into_iter().map(|c| (c.id, c)));
    }

    fn complete(&self, i: usize) -> bool {
        self.groups[i].iter().all(|id| self.done.contains_key(id))
    }

    /// Print the prompts from `next` on whose samples are all done.
    fn print_ready(&mut self) -> Result<()> {
        while self.next < self.groups.len() && self.complete(self.next) {
            self.print(self.next)?;
            self.next += 1;
        }
        Ok(())
    }

    /// After a failure: print every prompt whose samples are all done,
    /// skipping unfinished ones. Returns the number of prompts skipped.
    fn flush_finished(&mut self) -> Result<usize> {
        let mut skipped = 0;
        for i in self.next..self.groups.len() {
            if self.complete(i) {
                self.print(i)?;
            } else {
                skipped += 1;
            }
        }
        self.next = self.groups.len();
        Ok(skipped)
    }

    fn print(&mut self, i: usize) -> Result<()> {
        let w = &mut self.out;
        for (j, id) in self.groups[i].iter().enumerate() {
            let c = self.done.remove(id).expect("complete prompt");
            let text = self.tokenizer.and_then(|t| t.decode(&c.tokens, true).ok());
            if self.json {
                let row = Row {
                    prompt_index: i,
                    sample: j,
                    tokens: &c.tokens,
                    text,
                    logprobs: &c.logprobs,
                    finish_reason: c.finish_reason,
                    error: &c.error,
                };
                writeln!(w, "{}", serde_json::to_string(&row)?)?;
            } else {
                writeln!(
                    w,
                    "=== prompt {i}, sample {j} ({:?}, {} tokens)",
                    c.finish_reason,
                    c.tokens.len()
                )?;
                match (text, &c.error) {
                    (_, Some(e)) => writeln!(w, "error: {e}")?,
                    (Some(t), None) => writeln!(w, "{t}")?,
                    (None, None) => writeln!(w, "{:?}", c.tokens)?,
                }
            }
        }
        w.flush()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbor_engine::FinishReason;

    fn done(id: u64) -> Completion {
        Completion {
            id,
            prompt: vec![1],
            tokens: vec![id as u32],
            logprobs: vec![-0.5],
            finish_reason: FinishReason::Length,
            stop_string: None,
            error: None,
        }
    }

    fn printed(p: &Printer<'_, Vec<u8>>) -> Vec<(u64, u64)> {
        String::from_utf8(p.out.clone())
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                (
                    v["prompt_index"].as_u64().unwrap(),
                    v["tokens"][0].as_u64().unwrap(),
                )
            })
            .collect()
    }

    /// Rows come out in prompt order as soon as a prompt's samples are all
    /// done; after a failure, every complete prompt is still printed.
    #[test]
    fn rows_stream_in_prompt_order_and_survive_a_failure() {
        let groups = vec![vec![1, 2], vec![3], vec![4, 5], vec![6]];
        let mut p = Printer {
            out: Vec::new(),
            json: true,
            tokenizer: None,
            groups: &groups,
            next: 0,
            done: Default::default(),
            finished: 0,
        };
        p.take(vec![done(3), done(1)]);
        p.print_ready().unwrap();
        assert!(
            printed(&p).is_empty(),
            "prompt 0 still has a sample running"
        );
        p.take(vec![done(2), done(6), done(4)]);
        p.print_ready().unwrap();
        assert_eq!(printed(&p), [(0, 1), (0, 2), (1, 3)]);
        assert_eq!(p.flush_finished().unwrap(), 1);
        assert_eq!(printed(&p), [(0, 1), (0, 2), (1, 3), (3, 6)]);
        assert_eq!(p.finished, 5);
    }
}
