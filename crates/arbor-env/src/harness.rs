//! The tool harness: turns a [`ToolTask`] (a prompt, tool schemas and an
//! executor) into a multi-turn [`Env`] speaking Qwen-style tool calls, with
//! a context budget.
//!
//! Each policy turn is parsed for `<tool_call>` blocks; every call is checked
//! against the tool schemas (unknown tool, missing required argument, wrong
//! argument type) and executed in order; malformed calls become error
//! `<tool_response>`s and the episode goes on. Tool output is truncated to
//! [`HarnessConfig::max_output_chars`].
//!
//! Context management ([`ContextMode`]):
//! - **Compaction**: when the context would exceed the budget, the
//!   observation asks the policy for a summary (a free-form prompt or the
//!   four-section structured prompt); the policy's summary is a
//!   [`TokenKind::ContextManagement`] turn (trained), and the next
//!   observation restarts the context from the task prompt plus the summary
//!   ([`Observation::restart`]) — a segment boundary.
//! - **Workspace**: the policy gets `memory_put` / `memory_get` /
//!   `memory_scan` / `memory_delete` tools over an in-memory key-value
//!   store; when the budget is hit the context restarts from the task prompt
//!   and the list of stored keys, with no summary.

use std::collections::BTreeMap;
use std::sync::Arc;

use arbor_rl::TokenKind;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::chat::ChatFormat;
use crate::env::{Action, Env, Observation, StepOutcome};
use crate::error::{EnvError, Result};
use crate::toolcall::{parse_tool_calls, strip_think, text_outside_calls, ToolCall};

/// The reply of one tool call.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolReply {
    /// What the tool returned (shown in a `<tool_response>`).
    pub content: String,
    /// The call failed (bad arguments, command error); the episode goes on.
    pub is_error: bool,
    /// The call ends the episode with this reward (`submit`).
    pub finish: Option<f64>,
}

impl ToolReply {
    /// A successful reply.
    pub fn ok(content: impl Into<String>) -> Self {
        ToolReply {
            content: content.into(),
            is_error: false,
            finish: None,
        }
    }

    /// An error reply.
    pub fn error(content: impl Into<String>) -> Self {
        ToolReply {
            content: content.into(),
            is_error: true,
            finish: None,
        }
    }

    /// A reply that ends the episode with `reward`.
    pub fn finish(content: impl Into<String>, reward: f64) -> Self {
        ToolReply {
            content: content.into(),
            is_error: false,
            finish: Some(reward),
        }
    }
}

/// A task the harness runs: prompt, tools and their executor.
///
/// Determinism contract as for [`Env`]: after `reset`, the same calls give
/// the same replies and state.
pub trait ToolTask: Send {
    /// Stable task id.
    fn id(&self) -> &str;
    /// An optional system message.
    fn system(&self) -> Option<String> {
        None
    }
    /// The first user message.
    fn prompt(&self) -> String;
    /// Tool schemas, OpenAI function format
    /// (`{"type": "function", "function": {"name", "description", "parameters"}}`).
    fn tools(&self) -> Vec<Value>;
    /// Restores the task's initial state.
    fn reset(&mut self) -> Result<()>;
    /// Executes one schema-checked call. `Err` only for infrastructure
    /// failures; bad calls are [`ToolReply::error`].
    fn call(&mut self, call: &ToolCall) -> Result<ToolReply>;
    /// A final answer given as text without any tool call: `Some(reward)`
    /// ends the episode; `None` (the default) answers with an error asking
    /// for a tool call.
    fn answer(&mut self, _text: &str) -> Option<f64> {
        None
    }
    /// The reward when the episode is cut off (step or compaction limit).
    fn cutoff_reward(&mut self) -> f64 {
        0.0
    }
    /// A cheap independent copy, if there is one.
    fn fork(&self) -> Option<Box<dyn ToolTask>>;
    /// A new instance of the same task, before `reset`.
    fn fresh(&self) -> Result<Box<dyn ToolTask>>;
    /// A human-readable state summary.
    fn summary(&self) -> String;
    /// Canonical bytes of the task state.
    fn state_bytes(&self) -> Result<Vec<u8>>;
}

/// How the policy is asked to summarise at a compaction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CompactionPrompt {
    /// One free-form instruction (peaked higher in the paper's runs).
    FreeForm,
    /// Four fixed sections (improved more steadily).
    Structured,
    /// A user-given instruction.
    Custom(String),
}

/// The free-form compaction instruction.
pub const FREE_FORM_PROMPT: &str = "The context is full. Write a summary of everything you \
    need to continue this task: what the task is, what you have done and found, the current \
    state, and what to do next. Do not call tools now; your next context will contain only \
    the task and this summary.";

/// The four-section compaction instruction.
pub const STRUCTURED_PROMPT: &str = "The context is full. Write a summary with exactly these \
    four sections, then stop (do not call tools now; your next context will contain only the \
    task and this summary):\n## Task\nWhat must be achieved and how success is checked.\n\
    ## Progress\nWhat you have done so far and what you found.\n## State\nThe current state: \
    files changed, values, open questions.\n## Next steps\nWhat to do next, in order.";

impl CompactionPrompt {
    /// The instruction text.
    pub fn text(&self) -> &str {
        match self {
            CompactionPrompt::FreeForm => FREE_FORM_PROMPT,
            CompactionPrompt::Structured => STRUCTURED_PROMPT,
            CompactionPrompt::Custom(s) => s,
        }
    }
}

/// Context management of the harness.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContextMode {
    /// No budget.
    Unbounded,
    /// A budget of `budget` tokens and no compaction: the episode ends
    /// (reward 0, counted as an overflow) when the context would exceed it.
    Bounded { budget: usize },
    /// Policy-written summaries when the context would exceed `budget`
    /// tokens; at most `max_compactions` per episode (then cut off).
    Compaction {
        budget: usize,
        prompt: CompactionPrompt,
        max_compactions: usize,
    },
    /// In-memory workspace tools; the context restarts without a summary
    /// when it would exceed `budget` tokens.
    Workspace { budget: usize },
}

/// Counts tokens of context text (the harness has no tokenizer).
#[derive(Clone)]
pub enum TokenCounter {
    /// `ceil(chars / n)`: a tokenizer-free estimate (4 is typical for BPE
    /// on English and code).
    CharsPer(usize),
    /// A real tokenizer's count.
    Custom(Arc<dyn Fn(&str) -> usize + Send + Sync>),
}

impl std::fmt::Debug for TokenCounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenCounter::CharsPer(n) => write!(f, "CharsPer({n})"),
            TokenCounter::Custom(_) => f.write_str("Custom"),
        }
    }
}

impl TokenCounter {
    /// Tokens in `s`.
    pub fn count(&self, s: &str) -> usize {
        match self {
            TokenCounter::CharsPer(n) => s.chars().count().div_ceil((*n).max(1)),
            TokenCounter::Custom(f) => f(s),
        }
    }
}

/// Harness configuration.
#[derive(Clone, Debug)]
pub struct HarnessConfig {
    /// Chat scaffolding.
    pub chat: ChatFormat,
    /// Context management.
    pub context: ContextMode,
    /// Policy turns per episode (summaries included); then cut off.
    pub max_steps: usize,
    /// Longest tool output shown (longer output is cut in the middle).
    pub max_output_chars: usize,
    /// Token counting for the budget.
    pub counter: TokenCounter,
}

impl Default for HarnessConfig {
    fn default() -> Self {
        HarnessConfig {
            chat: ChatFormat::Qwen,
            context: ContextMode::Unbounded,
            max_steps: 50,
            max_output_chars: 8000,
            counter: TokenCounter::CharsPer(4),
        }
    }
}

/// Cuts `s` to at most `max` chars, keeping the head and the tail.
pub fn truncate_middle(s: &str, max: usize) -> String {
    let n = s.chars().count();
    if n <= max {
        return s.to_string();
    }
    let head = max / 2;
    let tail = max - head;
    let h: String = s.chars().take(head).collect();
    let t: String = s.chars().skip(n - tail).collect();
    format!("{h}\n[... {} characters truncated ...]\n{t}", n - max)
}

/// The harness state that replay must rebuild (besides the task's).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
struct State {
    started: bool,
    done: bool,
    steps: usize,
    context_tokens: usize,
    context_resets: usize,
    /// Tool responses waiting for the restart after a summary.
    pending: Option<Vec<String>>,
    tool_calls: usize,
    tool_errors: usize,
    memory: BTreeMap<String, String>,
    last_summary: Option<String>,
    /// Policy turns since the latest restart (`None` before the first).
    since_restart: Option<usize>,
    stats: crate::context::ContextStats,
}

/// A [`ToolTask`] run as an [`Env`] (see the module doc).
pub struct Harness {
    task: Box<dyn ToolTask>,
    cfg: HarnessConfig,
    st: State,
}

impl std::fmt::Debug for Harness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Harness")
            .field("task", &self.task.id())
            .field("cfg", &self.cfg)
            .field("steps", &self.st.steps)
            .finish()
    }
}

const MEMORY_TOOLS: [&str; 4] = ["memory_put", "memory_get", "memory_scan", "memory_delete"];

fn memory_schemas() -> Vec<Value> {
    let f = |name: &str, desc: &str, props: Value, req: Value| {
        json!({"type": "function", "function": {"name": name, "description": desc,
            "parameters": {"type": "object", "properties": props, "required": req}}})
    };
    vec![
        f(
            "memory_put",
            "Store a value under a key in your workspace memory (kept across context resets).",
            json!({"key": {"type": "string"}, "value": {"type": "string"}}),
            json!(["key", "value"]),
        ),
        f(
            "memory_get",
            "Read the value stored under a key.",
            json!({"key": {"type": "string"}}),
            json!(["key"]),
        ),
        f(
            "memory_scan",
            "List stored keys starting with a prefix (all keys for an empty prefix).",
            json!({"prefix": {"type": "string"}}),
            json!([]),
        ),
        f(
            "memory_delete",
            "Delete a key.",
            json!({"key": {"type": "string"}}),
            json!(["key"]),
        ),
    ]
}

/// Checks a call's arguments against its schema: required keys present,
/// basic JSON types right. The error is an observation for the policy.
pub fn check_call(call: &ToolCall, schemas: &[Value]) -> std::result::Result<(), String> {
    let names: Vec<&str> = schemas
        .iter()
        .filter_map(|s| s.pointer("/function/name").and_then(Value::as_str))
        .collect();
    let Some(schema) = schemas
        .iter()
        .find(|s| s.pointer("/function/name").and_then(Value::as_str) == Some(&call.name))
    else {
        return Err(format!(
            "unknown tool `{}`; available tools: {}",
            call.name,
            names.join(", ")
        ));
    };
    let params = schema.pointer("/function/parameters");
    if let Some(req) = params
        .and_then(|p| p.get("required"))
        .and_then(Value::as_array)
    {
        for r in req.iter().filter_map(Value::as_str) {
            if !call.arguments.contains_key(r) {
                return Err(format!(
                    "tool `{}`: missing required argument `{r}`",
                    call.name
                ));
            }
        }
    }
    if let Some(props) = params
        .and_then(|p| p.get("properties"))
        .and_then(Value::as_object)
    {
        for (k, v) in &call.arguments {
            let Some(ty) = props
                .get(k)
                .and_then(|p| p.get("type"))
                .and_then(Value::as_str)
            else {
                continue;
            };
            let ok = match ty {
                "string" => v.is_string(),
                "integer" => {
                    v.is_i64() || v.as_str().is_some_and(|s| s.trim().parse::<i64>().is_ok())
                }
                "number" => v.is_number(),
                "boolean" => v.is_boolean(),
                "array" => v.is_array(),
                "object" => v.is_object(),
                _ => true,
            };
            if !ok {
                return Err(format!(
                    "tool `{}`: argument `{k}` must be of type {ty}, got {v}",
                    call.name
                ));
            }
        }
    }
    Ok(())
}

impl Harness {
    /// Runs `task` under `cfg`.
    pub fn new(task: Box<dyn ToolTask>, cfg: HarnessConfig) -> Self {
        Harness {
            task,
            cfg,
            st: State::default(),
        }
    }

    /// The task.
    pub fn task(&self) -> &dyn ToolTask {
        self.task.as_ref()
    }

    /// Compactions so far in this episode.
    pub fn compactions(&self) -> usize {
        self.st.stats.compactions as usize
    }

    /// Context restarts of the workspace mode so far.
    pub fn context_resets(&self) -> usize {
        self.st.context_resets
    }

    /// Tool calls executed (a training-health metric: collapse shows as few
    /// calls per episode).
    pub fn tool_calls(&self) -> usize {
        self.st.tool_calls
    }

    /// The workspace memory.
    pub fn memory(&self) -> &BTreeMap<String, String> {
        &self.st.memory
    }

    /// The estimated tokens of the current context.
    pub fn context_tokens(&self) -> usize {
        self.st.context_tokens
    }

    fn schemas(&self) -> Vec<Value> {
        let mut s = self.task.tools();
        if matches!(self.cfg.context, ContextMode::Workspace { .. }) {
            s.extend(memory_schemas());
        }
        s
    }

    fn budget(&self) -> Option<usize> {
        match self.cfg.context {
            ContextMode::Unbounded => None,
            ContextMode::Bounded { budget }
            | ContextMode::Compaction { budget, .. }
            | ContextMode::Workspace { budget } => Some(budget),
        }
    }

    fn first_context(&self, extra: Option<&str>) -> String {
        let mut user = self.task.prompt();
        if let Some(e) = extra {
            user.push_str("\n\n");
            user.push_str(e);
        }
        self.cfg
            .chat
            .first(self.task.system().as_deref(), &self.schemas(), &user)
    }

    fn memory_call(&mut self, c: &ToolCall) -> ToolReply {
        let key = || c.str_arg("key").map(str::to_string);
        match c.name.as_str() {
            "memory_put" => match (key(), c.str_arg("value")) {
                (Ok(k), Ok(v)) => {
                    self.st.memory.insert(k.clone(), v.to_string());
                    ToolReply::ok(format!("stored `{k}`"))
                }
                (Err(e), _) | (_, Err(e)) => ToolReply::error(e),
            },
            "memory_get" => match key() {
                Ok(k) => match self.st.memory.get(&k) {
                    Some(v) => ToolReply::ok(v.clone()),
                    None => {
                        // Reading a key never stored ends the episode.
                        self.st.stats.missing_keys += 1;
                        ToolReply::finish(format!("error: no workspace key `{k}`"), 0.0)
                    }
                },
                Err(e) => ToolReply::error(e),
            },
            "memory_scan" => match c.opt_str_arg("prefix") {
                Ok(p) => {
                    let p = p.unwrap_or("");
                    let keys: Vec<&str> = self
                        .st
                        .memory
                        .keys()
                        .filter(|k| k.starts_with(p))
                        .map(String::as_str)
                        .collect();
                    ToolReply::ok(if keys.is_empty() {
                        "(no keys)".to_string()
                    } else {
                        keys.join("\n")
                    })
                }
                Err(e) => ToolReply::error(e),
            },
            _ => match key() {
                Ok(k) => match self.st.memory.remove(&k) {
                    Some(_) => ToolReply::ok(format!("deleted `{k}`")),
                    None => ToolReply::error(format!("no key `{k}`")),
                },
                Err(e) => ToolReply::error(e),
            },
        }
    }

    /// Executes the calls of one turn; returns the replies and the finish
    /// reward if a call ended the episode.
    fn execute(&mut self, text: &str) -> Result<(Vec<String>, Option<f64>, Option<String>)> {
        let calls = parse_tool_calls(text);
        let schemas = self.schemas();
        let mut replies = Vec::new();
        let mut first_err = None;
        for c in calls {
            let reply = match c {
                Err(e) => ToolReply::error(e.to_string()),
                Ok(c) => match check_call(&c, &schemas) {
                    Err(e) => ToolReply::error(e),
                    Ok(()) if MEMORY_TOOLS.contains(&c.name.as_str()) => self.memory_call(&c),
                    Ok(()) => self.task.call(&c)?,
                },
            };
            self.st.tool_calls += 1;
            if reply.is_error {
                self.st.tool_errors += 1;
                first_err.get_or_insert_with(|| reply.content.clone());
            }
            let content = truncate_middle(&reply.content, self.cfg.max_output_chars);
            replies.push(if reply.is_error {
                format!("error: {content}")
            } else {
                content
            });
            if let Some(r) = reply.finish {
                return Ok((replies, Some(r), first_err));
            }
        }
        Ok((replies, None, first_err))
    }

    fn count(&self, s: &str) -> usize {
        self.cfg.counter.count(s)
    }

    fn finish(&mut self, prev: &str, reward: f64, error: Option<String>) -> StepOutcome {
        self.st.done = true;
        if self.st.since_restart == Some(1) {
            self.st.stats.ended_after_compaction += 1;
        }
        StepOutcome::last(Observation::text(self.cfg.chat.close(prev)), reward, error)
    }

    fn restart(&mut self, extra: &str) -> Observation {
        let text = self.first_context(Some(extra));
        self.st.context_tokens = self.count(&text);
        self.st.stats.context_resets += 1;
        self.st.since_restart = Some(0);
        Observation {
            text,
            tokens: None,
            restart: true,
            next: TokenKind::Action,
        }
    }
}

/// `text` with every duration (a number followed by `s`, `ms`, `sec`,
/// `secs`, `second(s)`) replaced by `<duration>`.
fn without_durations(text: &str) -> String {
    static DURATION: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(r"\b\d+(?:\.\d+)?\s?(?:ms|s|secs?|seconds?)\b")
            .unwrap_or_else(|e| panic!("bad built-in regex: {e}"))
    });
    DURATION.replace_all(text, "<duration>").into_owned()
}

impl Env for Harness {
    fn task_id(&self) -> &str {
        self.task.id()
    }

    /// Tool calls executed (parsed calls minus those that failed to run).
    fn tool_calls(&self) -> usize {
        self.st.tool_calls.saturating_sub(self.st.tool_errors)
    }

    fn context_stats(&self) -> Option<crate::context::ContextStats> {
        Some(self.st.stats.clone())
    }

    /// Equal once durations (`0.12s`, `35 ms`, `1.5 seconds`) are set
    /// aside: a test run takes a different time each run.
    fn same_observation(&self, recorded: &str, replayed: &str) -> bool {
        recorded == replayed || without_durations(recorded) == without_durations(replayed)
    }

    fn reset(&mut self) -> Result<Observation> {
        self.task.reset()?;
        self.st = State {
            started: true,
            ..State::default()
        };
        let text = self.first_context(None);
        self.st.context_tokens = self.count(&text);
        Ok(Observation::text(text))
    }

    fn step(&mut self, action: &Action) -> Result<StepOutcome> {
        if !self.st.started || self.st.done {
            return Err(EnvError::protocol(
                self.task.id(),
                if self.st.done {
                    "step after the episode ended"
                } else {
                    "step before reset"
                },
            ));
        }
        let text = action.to_text(None, self.task.id())?;
        self.st.steps += 1;
        self.st.context_tokens += self.count(&text);
        self.st.since_restart = self.st.since_restart.map(|n| n + 1);

        // A compaction summary: restart from the task and the summary.
        if let Some(pending) = self.st.pending.take() {
            let summary = text_outside_calls(strip_think(&text));
            let mut extra = format!("# Summary of your earlier work\n{summary}");
            if !pending.is_empty() {
                extra.push_str("\n\n# Latest tool output\n");
                extra.push_str(&pending.join("\n\n"));
            }
            let restart = self.count(&self.first_context(Some(&extra)));
            let budget = self.budget().unwrap_or(usize::MAX);
            let malformed = if summary.trim().is_empty() {
                Some("malformed summary: it is empty".to_string())
            } else if restart >= budget {
                Some(format!(
                    "a summary of ~{} tokens leaves no room: the restart context would be ~{restart} \
                     of {budget} tokens",
                    self.count(&summary)
                ))
            } else {
                None
            };
            if let Some(e) = malformed {
                self.st.stats.malformed_summaries += 1;
                return Ok(self.finish(&text, 0.0, Some(e)));
            }
            self.st.stats.compactions += 1;
            self.st.stats.summary_tokens += self.count(&text) as u64;
            self.st.last_summary = Some(summary);
            let obs = self.restart(&extra);
            return Ok(StepOutcome::next(obs, None));
        }
        let calls_before = self.st.tool_calls;

        let (replies, finish, mut error) = if parse_tool_calls(&text).is_empty() {
            match self.task.answer(strip_think(&text)) {
                Some(r) => (Vec::new(), Some(r), None),
                None => {
                    let e = "no <tool_call> found: call a tool (see the tool list), or submit"
                        .to_string();
                    (vec![format!("error: {e}")], None, Some(e))
                }
            }
        } else {
            self.execute(&text)?
        };
        if self.st.since_restart.is_some() {
            self.st.stats.calls_after_compaction += (self.st.tool_calls - calls_before) as u64;
        }
        if let Some(r) = finish {
            return Ok(self.finish(&text, r, error));
        }
        if self.st.steps >= self.cfg.max_steps {
            let r = self.task.cutoff_reward();
            let e =
                error.get_or_insert_with(|| format!("step limit {} reached", self.cfg.max_steps));
            let e = Some(e.clone());
            return Ok(self.finish(&text, r, e));
        }
        let obs_text = self.cfg.chat.tool_responses(&text, &replies);
        let over = self
            .budget()
            .is_some_and(|b| self.st.context_tokens + self.count(&obs_text) > b);
        if over {
            match self.cfg.context.clone() {
                ContextMode::Compaction {
                    prompt,
                    max_compactions,
                    ..
                } => {
                    if self.st.stats.compactions as usize >= max_compactions {
                        self.st.stats.compaction_limit += 1;
                        let r = self.task.cutoff_reward();
                        return Ok(self.finish(
                            &text,
                            r,
                            Some(format!("compaction limit {max_compactions} reached")),
                        ));
                    }
                    let obs_text =
                        self.cfg
                            .chat
                            .tool_responses_with(&text, &replies, Some(prompt.text()));
                    self.st.context_tokens += self.count(&obs_text);
                    self.st.pending = Some(replies);
                    let obs = Observation {
                        text: obs_text,
                        tokens: None,
                        restart: false,
                        next: TokenKind::ContextManagement,
                    };
                    return Ok(StepOutcome::next(obs, error));
                }
                ContextMode::Bounded { budget } => {
                    self.st.stats.overflows += 1;
                    return Ok(self.finish(
                        &text,
                        0.0,
                        Some(format!("the context of {budget} tokens is full")),
                    ));
                }
                ContextMode::Workspace { .. } => {
                    self.st.context_resets += 1;
                    let keys: Vec<&str> = self.st.memory.keys().map(String::as_str).collect();
                    let mut extra = format!(
                        "Your context was cleared to stay within budget. Your workspace \
                         memory holds these keys: [{}].",
                        keys.join(", ")
                    );
                    if !replies.is_empty() {
                        extra.push_str("\n\n# Latest tool output\n");
                        extra.push_str(&replies.join("\n\n"));
                    }
                    let obs = self.restart(&extra);
                    return Ok(StepOutcome::next(obs, error));
                }
                ContextMode::Unbounded => {}
            }
        }
        self.st.context_tokens += self.count(&obs_text);
        Ok(StepOutcome::next(Observation::text(obs_text), error))
    }

    fn fork(&self) -> Option<Box<dyn Env>> {
        let task = self.task.fork()?;
        Some(Box::new(Harness {
            task,
            cfg: self.cfg.clone(),
            st: self.st.clone(),
        }))
    }

    fn fresh(&self) -> Result<Box<dyn Env>> {
        Ok(Box::new(Harness::new(self.task.fresh()?, self.cfg.clone())))
    }

    fn summary(&self) -> String {
        format!(
            "{} | {} steps, {} tool calls ({} errors), {} compactions, {} context resets, \
             ~{} context tokens{}",
            self.task.summary(),
            self.st.steps,
            self.st.tool_calls,
            self.st.tool_errors,
            self.st.stats.compactions,
            self.st.context_resets,
            self.st.context_tokens,
            if self.st.done { ", done" } else { "" }
        )
    }

    fn state_bytes(&self) -> Result<Vec<u8>> {
        let mut b = crate::synthetic::json_state(self.task.id(), &self.st)?;
        b.push(0);
        b.extend(self.task.state_bytes()?);
        Ok(b)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn replayed_tool_output_ignores_durations() {
        assert_eq!(
            without_durations("1 passed in 0.12s; took 35 ms, 2 seconds"),
            "1 passed in <duration>; took <duration>, <duration>"
        );
        assert_eq!(without_durations("exit 3s1 x2s"), "exit 3s1 x2s");
        assert_ne!(
            without_durations("2 failed in 0.1s"),
            without_durations("1 failed in 0.1s")
        );
    }

    use super::*;
    use crate::env::Episode;

    /// A counter with `inc(by)`, `get()` and `submit(value)`: reward 1 iff
    /// the submitted value equals the counter and the counter reached
    /// `target`.
    #[derive(Clone, Debug, Serialize)]
    struct Counter {
        target: i64,
        value: i64,
    }

    impl ToolTask for Counter {
        fn id(&self) -> &str {
            "counter"
        }
        fn prompt(&self) -> String {
            format!(
                "Increment the counter to {} and submit its value.",
                self.target
            )
        }
        fn tools(&self) -> Vec<Value> {
            vec![
                json!({"type": "function", "function": {"name": "inc", "parameters": {"type": "object",
                    "properties": {"by": {"type": "integer"}}, "required": ["by"]}}}),
                json!({"type": "function", "function": {"name": "get", "parameters": {"type": "object", "properties": {}}}}),
                json!({"type": "function", "function": {"name": "submit", "parameters": {"type": "object",
                    "properties": {"value": {"type": "integer"}}, "required": ["value"]}}}),
            ]
        }
        fn reset(&mut self) -> Result<()> {
            self.value = 0;
            Ok(())
        }
        fn call(&mut self, c: &ToolCall) -> Result<ToolReply> {
            Ok(match c.name.as_str() {
                "inc" => {
                    self.value += c.int_arg("by").unwrap_or(0);
                    ToolReply::ok(format!("counter = {}", self.value))
                }
                "get" => ToolReply::ok("x".repeat(200)),
                _ => {
                    let v = c.int_arg("value").unwrap_or(-1);
                    let ok = v == self.value && v == self.target;
                    ToolReply::finish("submitted", if ok { 1.0 } else { 0.0 })
                }
            })
        }
        fn fork(&self) -> Option<Box<dyn ToolTask>> {
            Some(Box::new(self.clone()))
        }
        fn fresh(&self) -> Result<Box<dyn ToolTask>> {
            Ok(Box::new(Counter {
                target: self.target,
                value: 0,
            }))
        }
        fn summary(&self) -> String {
            format!("counter {} / {}", self.value, self.target)
        }
        fn state_bytes(&self) -> Result<Vec<u8>> {
            crate::synthetic::json_state("counter", self)
        }
    }

    fn call(name: &str, args: Value) -> Action {
        Action::Text(format!(
            "<think>ok</think>{}",
            ToolCall::new(name, args).render()
        ))
    }

    fn harness(context: ContextMode) -> Harness {
        Harness::new(
            Box::new(Counter {
                target: 3,
                value: 0,
            }),
            HarnessConfig {
                context,
                max_output_chars: 100,
                ..HarnessConfig::default()
            },
        )
    }

    #[test]
    fn bad_calls_are_error_observations() {
        let mut ep = Episode::new(Box::new(harness(ContextMode::Unbounded)));
        let o = ep.reset().unwrap();
        assert!(o.text.contains("\"name\": \"inc\""));
        for (bad, want) in [
            ("hello", "no <tool_call> found"),
            ("<tool_call>{not json}</tool_call>", "invalid JSON"),
            (
                "<tool_call>{\"name\": \"dance\"}</tool_call>",
                "unknown tool `dance`",
            ),
            (
                "<tool_call>{\"name\": \"inc\", \"arguments\": {}}</tool_call>",
                "missing required argument `by`",
            ),
            (
                "<tool_call>{\"name\": \"inc\", \"arguments\": {\"by\": \"x\"}}</tool_call>",
                "must be of type integer",
            ),
        ] {
            let out = ep.step(Action::text(bad)).unwrap();
            assert!(!out.done);
            assert!(
                out.error.as_deref().unwrap().contains(want),
                "{bad}: {:?}",
                out.error
            );
            assert!(
                out.observation.text.contains("<tool_response>\nerror: "),
                "{}",
                out.observation.text
            );
        }
        // Long output is truncated.
        let out = ep.step(call("get", json!({}))).unwrap();
        assert!(out
            .observation
            .text
            .contains("[... 100 characters truncated ...]"));
        ep.step(call("inc", json!({"by": 3}))).unwrap();
        let out = ep.step(call("submit", json!({"value": 3}))).unwrap();
        assert!(out.done && out.reward == 1.0);
        let h = ep.env().summary();
        assert!(
            h.contains("counter 3 / 3") && h.contains("7 tool calls (4 errors)"),
            "{h}"
        );
    }

    #[test]
    fn step_limit_cuts_off() {
        let mut h = harness(ContextMode::Unbounded);
        h.cfg.max_steps = 2;
        let mut ep = Episode::new(Box::new(h));
        ep.reset().unwrap();
        ep.step(call("inc", json!({"by": 1}))).unwrap();
        let out = ep.step(call("inc", json!({"by": 1}))).unwrap();
        assert!(out.done && out.reward == 0.0);
        assert!(out.error.unwrap().contains("step limit"));
    }

    fn compaction(prompt: CompactionPrompt) -> ContextMode {
        ContextMode::Compaction {
            budget: 300,
            prompt,
            max_compactions: 2,
        }
    }

    #[test]
    fn compaction_is_a_trained_segment_boundary() {
        let mut ep = Episode::new(Box::new(harness(compaction(CompactionPrompt::Structured))));
        ep.reset().unwrap();
        let mut asked = None;
        for i in 0..10 {
            let out = ep.step(call("inc", json!({"by": 0}))).unwrap();
            if out.observation.next == TokenKind::ContextManagement {
                asked = Some(i);
                assert!(out.observation.text.contains("## Next steps"));
                break;
            }
        }
        let asked = asked.expect("the budget triggers a compaction");
        // Tool calls in a summary are not executed.
        let out = ep
            .step(Action::text("## Task\ncount to 3\n## Progress\nnone <tool_call>{\"name\": \"inc\", \"arguments\": {\"by\": 9}}</tool_call>"))
            .unwrap();
        assert!(out.observation.restart);
        assert_eq!(out.observation.next, TokenKind::Action);
        assert!(out
            .observation
            .text
            .contains("# Summary of your earlier work\n## Task\ncount to 3"));
        assert!(out
            .observation
            .text
            .starts_with("<|im_start|>system\n# Tools"));
        let segs = ep.segments();
        assert_eq!(segs[asked + 1].policy.kind, TokenKind::ContextManagement);
        assert!(segs[asked + 1].restart);
        assert_eq!(segs[asked].policy.kind, TokenKind::Action);
        // The context now starts at the restart.
        let ctx = ep.context();
        assert_eq!(ctx.len(), 1);
        assert_eq!(ctx[0].kind, TokenKind::Conditioning);
        let h = ep.env().summary();
        assert!(
            h.contains("counter 0 / 3") && h.contains("1 compactions"),
            "{h}"
        );
        // Replay rebuilds the same state and history; forks are independent.
        let re = ep.replay_prefix(ep.actions().len()).unwrap();
        assert_eq!(re.turns(), ep.turns());
        assert_eq!(
            re.env().state_bytes().unwrap(),
            ep.env().state_bytes().unwrap()
        );
        let mut fork = ep.fork().unwrap();
        fork.step(call("inc", json!({"by": 3}))).unwrap();
        assert_ne!(
            fork.env().state_bytes().unwrap(),
            ep.env().state_bytes().unwrap()
        );
        assert_eq!(
            re.env().state_bytes().unwrap(),
            ep.env().state_bytes().unwrap()
        );
    }

    #[test]
    fn bounded_context_and_bad_summaries_end_the_episode() {
        let mut ep = Episode::new(Box::new(harness(ContextMode::Bounded { budget: 220 })));
        ep.reset().unwrap();
        let last = (0..20)
            .map(|_| ep.step(call("inc", json!({"by": 0}))).unwrap())
            .find(|o| o.done)
            .expect("the budget ends the episode");
        assert_eq!(last.reward, 0.0);
        assert!(last
            .error
            .unwrap()
            .contains("context of 220 tokens is full"));
        assert_eq!(ep.env().context_stats().unwrap().overflows, 1);
        // An empty summary ends the episode and is counted.
        let mut ep = Episode::new(Box::new(harness(compaction(CompactionPrompt::FreeForm))));
        ep.reset().unwrap();
        while ep.next_kind() != Some(TokenKind::ContextManagement) {
            ep.step(call("inc", json!({"by": 0}))).unwrap();
        }
        let out = ep.step(Action::text("<think>hm</think>  ")).unwrap();
        assert!(out.done && out.reward == 0.0);
        assert!(out.error.unwrap().contains("empty"));
        assert_eq!(ep.env().context_stats().unwrap().malformed_summaries, 1);
        // A summary that would not fit the budget after the restart too.
        let mut ep = Episode::new(Box::new(harness(compaction(CompactionPrompt::FreeForm))));
        ep.reset().unwrap();
        while ep.next_kind() != Some(TokenKind::ContextManagement) {
            ep.step(call("inc", json!({"by": 0}))).unwrap();
        }
        let out = ep.step(Action::text("x".repeat(2000))).unwrap();
        assert!(out.done && out.error.unwrap().contains("leaves no room"));
    }

    #[test]
    fn compaction_limit_and_free_form() {
        let mut ep = Episode::new(Box::new(harness(compaction(CompactionPrompt::FreeForm))));
        ep.reset().unwrap();
        let mut summaries = 0;
        let mut last = None;
        for _ in 0..40 {
            let next = ep.next_kind().unwrap();
            let a = if next == TokenKind::ContextManagement {
                summaries += 1;
                Action::text("summary: counting")
            } else {
                call("inc", json!({"by": 0}))
            };
            let out = ep.step(a).unwrap();
            if out.done {
                last = Some(out);
                break;
            }
        }
        let last = last.expect("ends at the compaction limit");
        assert_eq!(summaries, 2);
        assert_eq!(last.reward, 0.0);
        assert!(last.error.unwrap().contains("compaction limit 2"));
        assert!(FREE_FORM_PROMPT.contains("summary"));
    }

    #[test]
    fn workspace_memory_instead_of_compaction() {
        let mut ep = Episode::new(Box::new(harness(ContextMode::Workspace { budget: 900 })));
        let o = ep.reset().unwrap();
        assert!(o.text.contains("memory_put"));
        let out = ep
            .step(call(
                "memory_put",
                json!({"key": "plan", "value": "inc by 3"}),
            ))
            .unwrap();
        assert!(out.observation.text.contains("stored `plan`"));
        let out = ep.step(call("memory_get", json!({"key": "plan"}))).unwrap();
        assert!(out.observation.text.contains("inc by 3"));
        ep.step(call("memory_put", json!({"key": "plan2", "value": "x"})))
            .unwrap();
        let out = ep
            .step(call("memory_scan", json!({"prefix": "plan"})))
            .unwrap();
        assert!(out.observation.text.contains("plan\nplan2"));
        let out = ep
            .step(call("memory_delete", json!({"key": "plan2"})))
            .unwrap();
        assert!(out.observation.text.contains("deleted"));
        let mut reset_seen = false;
        for _ in 0..20 {
            let out = ep.step(call("inc", json!({"by": 0}))).unwrap();
            if out.observation.restart {
                reset_seen = true;
                assert!(out
                    .observation
                    .text
                    .contains("memory holds these keys: [plan]"));
                assert_eq!(out.observation.next, TokenKind::Action);
                break;
            }
        }
        assert!(reset_seen);
        let s = ep.env().summary();
        assert!(s.contains("1 context resets"), "{s}");
        // Reading a key never stored ends the episode (reward 0, counted).
        let out = ep.step(call("memory_get", json!({"key": "nope"}))).unwrap();
        assert!(out.done && out.reward == 0.0);
        let stats = ep.env().context_stats().unwrap();
        assert_eq!((stats.missing_keys, stats.context_resets), (1, 1));
        assert!(stats.calls_after_compaction >= 1);
    }
}
