//! `arbor score` and `arbor info`.

use anyhow::{bail, Context, Result};
use arbor_model::{parse_dtype, ChatOptions, LoadOptions, LoadedModel};
use candle_core::Device;
use clap::{ArgGroup, Args};

#[derive(Debug, Args)]
#[command(group(ArgGroup::new("input").required(true).args(["tokens", "text"])))]
pub struct ScoreArgs {
    /// Model directory (config.json + *.safetensors) or HF model id (org/name[@rev]).
    #[arg(long, value_name = "PATH_OR_ID")]
    pub model: String,
    /// Comma-separated token ids, e.g. `--tokens 1,2,3` (needs no tokenizer files).
    #[arg(long, value_name = "IDS", value_delimiter = ',', num_args = 1..)]
    pub tokens: Option<Vec<u32>>,
    /// Text to tokenize with the model's tokenizer.json.
    #[arg(long, value_name = "STR")]
    pub text: Option<String>,
    /// Wrap --text as a user message in the model's chat template, followed
    /// by the assistant generation prompt (so the last greedy token is the
    /// model's first answer token).
    #[arg(long, requires = "text")]
    pub chat: bool,
    /// Print `{"tokens": [...], "logprobs": [...], "greedy": [...]}`.
    #[arg(long)]
    pub json: bool,
    /// Compute dtype: f32, bf16, f16 or f64 (bf16 on a CPU with AVX-512
    /// BF16: bf16 weight matrices, f32 activations).
    #[arg(long, default_value = "f32")]
    pub dtype: String,
}

#[derive(Debug, Args)]
pub struct InfoArgs {
    /// Model directory or HF model id.
    #[arg(long, value_name = "PATH_OR_ID")]
    pub model: String,
}

pub fn run(a: ScoreArgs) -> Result<()> {
    let opts = LoadOptions {
        dtype: parse_dtype(&a.dtype)?,
        device: Device::Cpu,
    };
    let m = LoadedModel::load(&a.model, &opts)
        .with_context(|| format!("loading model `{}`", a.model))?;
    let tokens = match (&a.tokens, &a.text) {
        (Some(t), _) => t.clone(),
        (None, Some(text)) => {
            let tok = m.tokenizer.as_ref().with_context(|| {
                format!(
                    "--text needs tokenizer.json, and model `{}` has none (use --tokens)",
                    a.model
                )
            })?;
            if a.chat {
                let tmpl = m.chat_template().context("--chat")?;
                let msgs = serde_json::json!([{"role": "user", "content": text}]);
                let rendered = tmpl.render(
                    &msgs,
                    None,
                    &ChatOptions {
                        add_generation_prompt: true,
                        enable_thinking: None,
                    },
                )?;
                tok.encode(&rendered, false)?
            } else {
                tok.encode(text, true)?
            }
        }
        (None, None) => bail!("give --tokens or --text"),
    };
    let scored = m.score(&tokens)?;
    if a.json {
        println!("{}", serde_json::to_string(&scored)?);
        return Ok(());
    }
    print_table(&m, &scored);
    Ok(())
}

pub fn info(a: InfoArgs) -> Result<()> {
    let files = arbor_model::ModelFiles::resolve(&a.model)?;
    let cfg = arbor_model::ModelConfig::from_file(&files.config)?;
    println!("model:      {}", files.spec);
    println!("config:     {}", files.config.display());
    for w in &files.weights {
        println!("weights:    {}", w.display());
    }
    let show = |p: &Option<std::path::PathBuf>| {
        p.as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "(none)".into())
    };
    println!("tokenizer:  {}", show(&files.tokenizer));
    println!("tok config: {}", show(&files.tokenizer_config));
    println!("chat tmpl:  {}", show(&files.chat_template));
    println!("parameters: {:.2}M", cfg.num_parameters() as f64 / 1e6);
    println!("{}", serde_json::to_string_pretty(&cfg)?);
    Ok(())
}

/// Human-readable table: one row per position, then a summary line.
fn print_table(m: &LoadedModel, scored: &arbor_model::Scored) {
    let piece = |id: u32| -> String {
        m.tokenizer
            .as_ref()
            .and_then(|t| t.decode(&[id], false).ok())
            .map(|s| format!("{s:?}"))
            .unwrap_or_default()
    };
    let text = m.tokenizer.is_some();
    if text {
        println!(
            "{:>5}  {:>8}  {:<16}  {:>12}  {:>8}  greedy text",
            "pos", "token", "text", "logp(next)", "greedy"
        );
    } else {
        println!(
            "{:>5}  {:>8}  {:>12}  {:>8}",
            "pos", "token", "logp(next)", "greedy"
        );
    }
    for (t, &id) in scored.tokens.iter().enumerate() {
        let lp = scored
            .logprobs
            .get(t)
            .map(|x| format!("{x:.5}"))
            .unwrap_or_else(|| "-".into());
        let g = scored.greedy[t];
        if text {
            println!(
                "{t:>5}  {id:>8}  {:<16}  {lp:>12}  {g:>8}  {}",
                piece(id),
                piece(g)
            );
        } else {
            println!("{t:>5}  {id:>8}  {lp:>12}  {g:>8}");
        }
    }
    if scored.logprobs.is_empty() {
        return;
    }
    let n = scored.logprobs.len();
    let mean = scored.logprobs.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
    let hits = scored
        .greedy
        .iter()
        .zip(&scored.tokens[1..])
        .filter(|(g, t)| g == t)
        .count();
    println!(
        "\nscored {} tokens: mean logprob {mean:.4}, perplexity {:.3}, greedy = next token at {hits}/{n} positions",
        scored.tokens.len(),
        (-mean).exp(),
    );
}
