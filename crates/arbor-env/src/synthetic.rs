//! Built-in synthetic tasks for the quickstart and CPU-scale method
//! comparisons: multi-step (one segment per step), binary verified reward,
//! difficulty `k` (the number of steps), seeded generation (SplitMix64, so a
//! seed means the same task on every platform and rand version), and two
//! surfaces: [`Mode::Tokens`] over the 32-token [`SmallVocab`] (a tiny model
//! learns it without a tokenizer) and [`Mode::Text`] (plain text or Qwen chat
//! turns for a real model).
//!
//! - [`RunningSum`]: `k` digits are revealed one per turn; after each the
//!   policy answers the running sum mod 10. Reward 1 iff all `k` answers are
//!   right.
//! - [`Register`]: a stateful tool. A register starts at 0; each turn shows an
//!   instruction `+d` or `-d`; the policy must call the `add` tool with the
//!   digit that applies it (`d`, or `(10 - d) % 10` to subtract). The reward
//!   reads the tool's state: 1 iff the register ends at the target. The
//!   register lives in the environment, so rebuilding a mid-episode state
//!   needs replay through execution.

use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::chat::{ChatFormat, IM_END};
use crate::env::{Action, Env, Observation, StepOutcome};
use crate::error::{EnvError, Result};
use crate::toolcall::{parse_tool_calls, strip_think, ToolCall};
use crate::vocab::{SmallVocab, ADD, BOS, EOS, EQUALS, ERR, GET, MINUS, PAD, PLUS};

/// Largest accepted difficulty.
pub const MAX_DIFFICULTY: usize = 1024;

/// The surface a synthetic task talks in.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Token ids of the 32-token [`SmallVocab`] (observations carry
    /// `tokens`; actions may be [`Action::Tokens`] or their text form).
    Tokens,
    /// Natural-language text with the given chat scaffolding.
    Text(ChatFormat),
}

static SMALL: SmallVocab = SmallVocab;

impl Mode {
    /// The built-in vocabulary of the token surface.
    pub fn vocab(&self) -> Option<&'static SmallVocab> {
        match self {
            Mode::Tokens => Some(&SMALL),
            Mode::Text(_) => None,
        }
    }

    /// The spec name: `tokens`, `text` (plain) or `qwen`.
    pub fn name(&self) -> &'static str {
        match self {
            Mode::Tokens => "tokens",
            Mode::Text(ChatFormat::Plain) => "text",
            Mode::Text(ChatFormat::Qwen) => "qwen",
        }
    }
}

/// The state of a serialisable env as canonical JSON bytes.
pub(crate) fn json_state<T: Serialize>(task: &str, state: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(state).map_err(|e| EnvError::protocol(task, e.to_string()))
}

/// A deterministic 64-bit generator (SplitMix64): task generation must not
/// change when a dependency changes its RNG.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`; the modulo bias is below 2^-50 for the
    /// small `n` used here).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

fn check_difficulty(k: usize) -> Result<()> {
    if (1..=MAX_DIFFICULTY).contains(&k) {
        Ok(())
    } else {
        Err(EnvError::config(
            "difficulty",
            format!("{k} is outside 1..={MAX_DIFFICULTY}"),
        ))
    }
}

/// A token action reduced to its content: `<pad>` dropped anywhere,
/// trailing `<eos>` dropped. Out-of-vocabulary ids are kept (and rejected by
/// the caller's pattern).
pub(crate) fn strip_token_action(ids: &[u32]) -> Vec<u32> {
    let mut v: Vec<u32> = ids.iter().copied().filter(|&t| t != PAD).collect();
    while v.last() == Some(&EOS) {
        v.pop();
    }
    v
}

/// The single digit a text answer states: the last run of ASCII digits after
/// the reasoning, which must be one digit long.
fn text_digit(text: &str) -> std::result::Result<u8, String> {
    let body = strip_think(text).replace(IM_END, "");
    let runs: Vec<&str> = body
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .collect();
    match runs.last() {
        Some(r) if r.len() == 1 => Ok(r.as_bytes()[0] - b'0'),
        Some(r) => Err(format!("answer `{r}` is not a single digit")),
        None => Err("no digit in the answer".to_string()),
    }
}

fn final_observation(mode: &Mode, prev_action: &str) -> Observation {
    match mode {
        Mode::Tokens => Observation::tokens(&SmallVocab, Vec::new()),
        Mode::Text(chat) => Observation::text(chat.close(prev_action)),
    }
}

// ---------------------------------------------------------------- RunningSum

/// Configuration of [`RunningSum`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunningSumConfig {
    /// Number of digits `k` (= answers; segments per episode unless
    /// `one_turn`).
    pub difficulty: usize,
    /// Token or text surface.
    pub mode: Mode,
    /// Single-turn variant: all `k` digits in the prompt, all `k` running
    /// sums in one response (one segment per episode).
    #[serde(default)]
    pub one_turn: bool,
    /// Fail fast: the episode ends (reward 0) at the first wrong or
    /// malformed answer, as a harness that stops at the first failing
    /// check. Every state reached is then still solvable, and the
    /// decision that failed is the last one. Multi-turn only.
    #[serde(default)]
    pub stop_at_error: bool,
}

impl RunningSumConfig {
    /// The small-vocabulary token task with `k` digits.
    pub fn tokens(k: usize) -> Self {
        RunningSumConfig {
            difficulty: k,
            mode: Mode::Tokens,
            one_turn: false,
            stop_at_error: false,
        }
    }

    /// The single-turn small-vocabulary token task with `k` digits.
    pub fn tokens_one_turn(k: usize) -> Self {
        RunningSumConfig {
            one_turn: true,
            ..RunningSumConfig::tokens(k)
        }
    }

    /// The text task with `k` digits and the given chat scaffolding.
    pub fn text(k: usize, chat: ChatFormat) -> Self {
        RunningSumConfig {
            difficulty: k,
            mode: Mode::Text(chat),
            one_turn: false,
            stop_at_error: false,
        }
    }
}

/// The running-sum task: `k` digits revealed one per turn; after each, the
/// policy answers the running sum mod 10.
///
/// Token surface ([`Mode::Tokens`]): the initial observation is
/// `[<bos>, d1]`; each action is one digit token, optionally followed by
/// `<eos>` (`<pad>` ignored); the env answers `[d_{i+1}]`; after the `k`-th
/// answer the episode ends with an empty observation and reward 1 iff every
/// answer was right, else 0. A malformed action counts as a wrong answer.
///
/// Text surface ([`Mode::Text`]): an instruction plus `Digit 1 of k: d1`,
/// then `Digit i of k: di` per turn; the answer is the last number in the
/// response (after any `</think>`), which must be a single digit.
///
/// Single turn (`one_turn`): the prompt holds every digit (tokens:
/// `[<bos>, d1, ..., dk, =]`) and the one response holds all `k` running
/// sums (tokens: `k` digit tokens, optionally `<eos>`; text: the last `k`
/// numbers of the response, each a single digit); reward 1 iff all are
/// right. A response token cut anywhere leaves a meaningful prefix: the
/// first sums, right or wrong.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunningSum {
    cfg: RunningSumConfig,
    seed: u64,
    id: String,
    digits: Vec<u8>,
    /// The policy's answers so far (`None`: malformed).
    answers: Vec<Option<u8>>,
    started: bool,
}

impl RunningSum {
    /// The task instance for `seed`.
    pub fn new(cfg: RunningSumConfig, seed: u64) -> Result<Self> {
        check_difficulty(cfg.difficulty)?;
        let mut rng = SplitMix64::new(seed ^ 0x5255_4E53_554D); // "RUNSUM"
        let digits = (0..cfg.difficulty).map(|_| rng.below(10) as u8).collect();
        let surface = cfg.mode.name();
        if cfg.one_turn && cfg.stop_at_error {
            return Err(EnvError::task(
                "running-sum",
                "stop_at_error needs the multi-turn task (one_turn = false)",
            ));
        }
        let turns = if cfg.one_turn { ",turns=1" } else { "" };
        let stop = if cfg.stop_at_error { ",stop=error" } else { "" };
        let id = format!(
            "running-sum:k={},seed={seed},mode={surface}{turns}{stop}",
            cfg.difficulty
        );
        Ok(RunningSum {
            cfg,
            seed,
            id,
            digits,
            answers: Vec::new(),
            started: false,
        })
    }

    /// The hidden digits.
    pub fn digits(&self) -> &[u8] {
        &self.digits
    }

    /// The correct answers: running sums mod 10.
    pub fn expected(&self) -> Vec<u8> {
        self.digits
            .iter()
            .scan(0u8, |s, d| {
                *s = (*s + d) % 10;
                Some(*s)
            })
            .collect()
    }

    /// The actions of a perfect policy (token or text as the mode asks).
    pub fn oracle_actions(&self) -> Vec<Action> {
        if self.cfg.one_turn {
            let sums = self.expected();
            return vec![match self.cfg.mode {
                Mode::Tokens => {
                    Action::Tokens(sums.iter().map(|&s| u32::from(s)).chain([EOS]).collect())
                }
                Mode::Text(_) => {
                    Action::Text(sums.iter().map(u8::to_string).collect::<Vec<_>>().join(" "))
                }
            }];
        }
        self.expected()
            .into_iter()
            .map(|s| match self.cfg.mode {
                Mode::Tokens => Action::Tokens(vec![u32::from(s), EOS]),
                Mode::Text(_) => Action::Text(s.to_string()),
            })
            .collect()
    }

    /// The configuration.
    pub fn config(&self) -> &RunningSumConfig {
        &self.cfg
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    fn digit_message(&self, i: usize) -> String {
        format!(
            "Digit {} of {}: {}",
            i + 1,
            self.digits.len(),
            self.digits[i]
        )
    }

    /// The `k` answers of a single-turn response.
    fn parse_all(&self, action: &Action) -> std::result::Result<Vec<u8>, String> {
        let k = self.digits.len();
        match (action, &self.cfg.mode) {
            (Action::Tokens(ids), Mode::Tokens) => {
                let ids = strip_token_action(ids);
                if ids.len() == k && ids.iter().all(|&d| d < 10) {
                    Ok(ids.iter().map(|&d| d as u8).collect())
                } else {
                    Err(format!(
                        "expected {k} digit tokens (optionally followed by <eos>), got {}",
                        SmallVocab.decode_lossy(&ids)
                    ))
                }
            }
            (Action::Text(s), Mode::Tokens) => match SmallVocab.encode(s) {
                Ok(ids) => self.parse_all(&Action::Tokens(ids)),
                Err(e) => Err(e.to_string()),
            },
            (Action::Text(s), Mode::Text(_)) => {
                let body = strip_think(s).replace(IM_END, "");
                let runs: Vec<&str> = body
                    .split(|c: char| !c.is_ascii_digit())
                    .filter(|r| !r.is_empty())
                    .collect();
                if runs.len() < k {
                    return Err(format!(
                        "{} numbers in the answer, expected {k}",
                        runs.len()
                    ));
                }
                runs[runs.len() - k..]
                    .iter()
                    .map(|r| match r.as_bytes() {
                        [d] => Ok(d - b'0'),
                        _ => Err(format!("answer `{r}` is not a single digit")),
                    })
                    .collect()
            }
            (Action::Tokens(_), Mode::Text(_)) => {
                Err("this is a text task: send Action::Text".to_string())
            }
        }
    }

    fn parse(&self, action: &Action) -> std::result::Result<u8, String> {
        match (action, &self.cfg.mode) {
            (Action::Tokens(ids), Mode::Tokens) => match strip_token_action(ids).as_slice() {
                [d] if *d < 10 => Ok(*d as u8),
                other => Err(format!(
                    "expected one digit token (optionally followed by <eos>), got {}",
                    SmallVocab.decode_lossy(other)
                )),
            },
            (Action::Text(s), Mode::Tokens) => match SmallVocab.encode(s) {
                Ok(ids) => self.parse(&Action::Tokens(ids)),
                Err(e) => Err(e.to_string()),
            },
            (Action::Text(s), Mode::Text(_)) => text_digit(s),
            (Action::Tokens(_), Mode::Text(_)) => {
                Err("this is a text task: send Action::Text".to_string())
            }
        }
    }
}

impl Env for RunningSum {
    fn task_id(&self) -> &str {
        &self.id
    }

    fn reset(&mut self) -> Result<Observation> {
        self.answers.clear();
        self.started = true;
        let k = self.digits.len();
        if self.cfg.one_turn {
            return Ok(match &self.cfg.mode {
                Mode::Tokens => Observation::tokens(
                    &SmallVocab,
                    std::iter::once(BOS)
                        .chain(self.digits.iter().map(|&d| u32::from(d)))
                        .chain([EQUALS])
                        .collect(),
                ),
                Mode::Text(chat) => {
                    let digits: Vec<String> = self.digits.iter().map(u8::to_string).collect();
                    let user = format!(
                        "Running sum modulo 10. Digits: {}. Reply with the {k} running sums \
                         modulo 10 (the sum of the first i digits, for i = 1 to {k}), as single \
                         digits separated by spaces.",
                        digits.join(" ")
                    );
                    Observation::text(chat.first(None, &[], &user))
                }
            });
        }
        Ok(match &self.cfg.mode {
            Mode::Tokens => Observation::tokens(&SmallVocab, vec![BOS, u32::from(self.digits[0])]),
            Mode::Text(chat) => {
                let user = format!(
                    "Running sum modulo 10. You will see {k} digits, one per turn. After each \
                     digit, reply with the sum of all digits so far modulo 10, as a single digit.\n{}",
                    self.digit_message(0)
                );
                Observation::text(chat.first(None, &[], &user))
            }
        })
    }

    fn step(&mut self, action: &Action) -> Result<StepOutcome> {
        if !self.started {
            return Err(EnvError::protocol(&self.id, "step before reset"));
        }
        let k = self.digits.len();
        if self.answers.len() >= k {
            return Err(EnvError::protocol(&self.id, "step after the episode ended"));
        }
        let error = if self.cfg.one_turn {
            match self.parse_all(action) {
                Ok(a) => {
                    self.answers.extend(a.into_iter().map(Some));
                    None
                }
                Err(e) => {
                    self.answers.resize(k, None);
                    Some(e)
                }
            }
        } else {
            let parsed = self.parse(action);
            let error = parsed.as_ref().err().cloned();
            self.answers.push(parsed.ok());
            error
        };
        let prev = action
            .to_text(Some(&SmallVocab), &self.id)
            .unwrap_or_default();
        let i = self.answers.len();
        if self.cfg.stop_at_error && self.answers[i - 1] != Some(self.expected()[i - 1]) {
            return Ok(StepOutcome::last(
                final_observation(&self.cfg.mode, &prev),
                0.0,
                error,
            ));
        }
        if i == k {
            let expected = self.expected();
            let right = self
                .answers
                .iter()
                .zip(&expected)
                .all(|(a, e)| *a == Some(*e));
            let reward = if right { 1.0 } else { 0.0 };
            return Ok(StepOutcome::last(
                final_observation(&self.cfg.mode, &prev),
                reward,
                error,
            ));
        }
        let observation = match &self.cfg.mode {
            Mode::Tokens => Observation::tokens(&SmallVocab, vec![u32::from(self.digits[i])]),
            Mode::Text(chat) => Observation::text(chat.user(&prev, &self.digit_message(i))),
        };
        Ok(StepOutcome::next(observation, error))
    }

    fn fork(&self) -> Option<Box<dyn Env>> {
        Some(Box::new(self.clone()))
    }

    fn fresh(&self) -> Result<Box<dyn Env>> {
        Ok(Box::new(RunningSum::new(self.cfg.clone(), self.seed)?))
    }

    /// The running sum of the digits answered so far (token surface): the
    /// one number a summary must keep.
    fn state_tokens(&self) -> Option<Vec<u32>> {
        if self.cfg.mode != Mode::Tokens || self.cfg.one_turn {
            return None;
        }
        let n = self.answers.len();
        let s = self.digits[..n].iter().fold(0u8, |s, d| (s + d) % 10);
        Some(vec![u32::from(s)])
    }

    fn vocab(&self) -> Option<&SmallVocab> {
        self.cfg.mode.vocab()
    }

    fn summary(&self) -> String {
        let expected = self.expected();
        let right = self
            .answers
            .iter()
            .zip(&expected)
            .filter(|(a, e)| **a == Some(**e))
            .count();
        let answers: Vec<String> = self
            .answers
            .iter()
            .map(|a| a.map_or("?".to_string(), |d| d.to_string()))
            .collect();
        format!(
            "{}: digits {:?}, expected {:?}, answers [{}], {right}/{} right, {}",
            self.id,
            self.digits,
            expected,
            answers.join(", "),
            self.answers.len(),
            if self.answers.len() == self.digits.len() {
                "done"
            } else {
                "in progress"
            }
        )
    }

    fn state_bytes(&self) -> Result<Vec<u8>> {
        json_state(&self.id, self)
    }
}

// ------------------------------------------------------------------ Register

/// Configuration of [`Register`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterConfig {
    /// Number of instructions `k`.
    pub difficulty: usize,
    /// Draw `-d` instructions too (the policy must add `(10 - d) % 10`).
    pub subtract: bool,
    /// Token or text surface.
    pub mode: Mode,
}

impl RegisterConfig {
    /// The small-vocabulary token task.
    pub fn tokens(k: usize, subtract: bool) -> Self {
        RegisterConfig {
            difficulty: k,
            subtract,
            mode: Mode::Tokens,
        }
    }

    /// The text task with Qwen-style `<tool_call>` actions.
    pub fn text(k: usize, subtract: bool, chat: ChatFormat) -> Self {
        RegisterConfig {
            difficulty: k,
            subtract,
            mode: Mode::Text(chat),
        }
    }
}

/// The register task (a stateful tool).
///
/// Token surface: observations `[<bos>, sign, d]` then `[sign, d]` per
/// instruction (`sign` is `+` or `-`). Actions: `<add> x [<eos>]` adds `x` to
/// the register mod 10 and moves to the next instruction; `<get> [<eos>]`
/// answers `[=, r]` (the register) and keeps the instruction; anything else
/// answers `[<err>, sign, d]`. Text surface: the tools `add(value)` and
/// `read()` called as `<tool_call>{...}</tool_call>`, answered in
/// `<tool_response>` blocks.
///
/// The episode ends after `k` adds (reward 1 iff the register equals the
/// signed sum of the instructions mod 10), or after `3k` steps (reward 0).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Register {
    cfg: RegisterConfig,
    seed: u64,
    id: String,
    /// Signed instructions, `(subtract, digit)`.
    program: Vec<(bool, u8)>,
    /// The tool's state.
    register: u8,
    /// Adds executed (= the current instruction index).
    adds: usize,
    steps: usize,
    /// Every tool call executed, in order (`add 3`, `read`).
    log: Vec<String>,
    started: bool,
    done: bool,
}

impl Register {
    /// The task instance for `seed`.
    pub fn new(cfg: RegisterConfig, seed: u64) -> Result<Self> {
        check_difficulty(cfg.difficulty)?;
        let mut rng = SplitMix64::new(seed ^ 0x5245_4749_5354); // "REGIST"
        let program = (0..cfg.difficulty)
            .map(|_| {
                let sub = cfg.subtract && rng.below(2) == 1;
                (sub, rng.below(10) as u8)
            })
            .collect();
        let surface = cfg.mode.name();
        let id = format!(
            "register:k={},seed={seed},subtract={},mode={surface}",
            cfg.difficulty, cfg.subtract
        );
        Ok(Register {
            cfg,
            seed,
            id,
            program,
            register: 0,
            adds: 0,
            steps: 0,
            log: Vec::new(),
            started: false,
            done: false,
        })
    }

    /// The signed instructions `(subtract, digit)`.
    pub fn program(&self) -> &[(bool, u8)] {
        &self.program
    }

    /// The register's value.
    pub fn register(&self) -> u8 {
        self.register
    }

    /// The value the register must end at.
    pub fn target(&self) -> u8 {
        self.program.iter().fold(0u8, |r, &(sub, d)| {
            (r + if sub { (10 - d) % 10 } else { d }) % 10
        })
    }

    /// The actions of a perfect policy.
    pub fn oracle_actions(&self) -> Vec<Action> {
        self.program
            .iter()
            .map(|&(sub, d)| {
                let x = if sub { (10 - d) % 10 } else { d };
                match self.cfg.mode {
                    Mode::Tokens => Action::Tokens(vec![ADD, u32::from(x), EOS]),
                    Mode::Text(_) => {
                        Action::Text(ToolCall::new("add", json!({ "value": x })).render())
                    }
                }
            })
            .collect()
    }

    /// The tool schemas of the text surface (OpenAI function format, as the
    /// Qwen3 template expects).
    pub fn tool_schemas() -> Vec<serde_json::Value> {
        vec![
            json!({"type": "function", "function": {
                "name": "add",
                "description": "Add a digit to the register (mod 10).",
                "parameters": {"type": "object", "properties": {
                    "value": {"type": "integer", "description": "digit 0-9"}},
                    "required": ["value"]}}}),
            json!({"type": "function", "function": {
                "name": "read",
                "description": "Read the register.",
                "parameters": {"type": "object", "properties": {}}}}),
        ]
    }

    fn instruction_tokens(&self) -> Vec<u32> {
        let (sub, d) = self.program[self.adds];
        vec![if sub { MINUS } else { PLUS }, u32::from(d)]
    }

    fn instruction_text(&self) -> String {
        let (sub, d) = self.program[self.adds];
        format!(
            "Instruction {} of {}: {}{d}",
            self.adds + 1,
            self.program.len(),
            if sub { '-' } else { '+' }
        )
    }

    fn add(&mut self, x: u8) {
        self.register = (self.register + x) % 10;
        self.adds += 1;
        self.log.push(format!("add {x}"));
    }

    fn read(&mut self) -> u8 {
        self.log.push("read".to_string());
        self.register
    }

    /// Executes one token action; returns the observation tokens (before the
    /// next instruction is appended) and an error.
    fn exec_tokens(&mut self, ids: &[u32]) -> (Vec<u32>, Option<String>) {
        match strip_token_action(ids).as_slice() {
            [ADD, x] if *x < 10 => {
                self.add(*x as u8);
                (Vec::new(), None)
            }
            [GET] => {
                let r = self.read();
                (vec![EQUALS, u32::from(r)], None)
            }
            other => (
                vec![ERR],
                Some(format!(
                    "expected `<add> digit` or `<get>`, got `{}`",
                    SmallVocab.decode_lossy(other)
                )),
            ),
        }
    }

    /// Executes the tool calls of a text action; returns the responses.
    fn exec_text(&mut self, text: &str) -> (Vec<String>, Option<String>) {
        let calls = parse_tool_calls(text);
        if calls.is_empty() {
            let e = "no <tool_call> found; call `add` or `read`".to_string();
            return (vec![format!("error: {e}")], Some(e));
        }
        let mut out = Vec::new();
        let mut err = None;
        for c in calls {
            if self.adds == self.program.len() {
                break;
            }
            let r = match c {
                Err(e) => Err(e.to_string()),
                Ok(c) => match c.name.as_str() {
                    "add" => match c.int_arg("value") {
                        Ok(v) if (0..10).contains(&v) => {
                            self.add(v as u8);
                            Ok("ok".to_string())
                        }
                        Ok(v) => Err(format!("tool `add`: value {v} is not a digit 0-9")),
                        Err(e) => Err(e),
                    },
                    "read" => Ok(format!("register = {}", self.read())),
                    other => Err(format!("unknown tool `{other}`; available: add, read")),
                },
            };
            match r {
                Ok(s) => out.push(s),
                Err(e) => {
                    out.push(format!("error: {e}"));
                    err.get_or_insert(e);
                }
            }
        }
        (out, err)
    }
}

impl Env for Register {
    fn task_id(&self) -> &str {
        &self.id
    }

    fn reset(&mut self) -> Result<Observation> {
        self.register = 0;
        self.adds = 0;
        self.steps = 0;
        self.log.clear();
        self.started = true;
        self.done = false;
        Ok(match &self.cfg.mode {
            Mode::Tokens => {
                let mut t = vec![BOS];
                t.extend(self.instruction_tokens());
                Observation::tokens(&SmallVocab, t)
            }
            Mode::Text(chat) => {
                let user = format!(
                    "A register starts at 0 and holds a digit (arithmetic mod 10). For each \
                     instruction, call the `add` tool once with the digit that applies it: for \
                     +d add d, for -d add (10 - d) mod 10. You can `read` the register at any \
                     time. There are {} instructions.\n{}",
                    self.program.len(),
                    self.instruction_text()
                );
                Observation::text(chat.first(None, &Self::tool_schemas(), &user))
            }
        })
    }

    fn step(&mut self, action: &Action) -> Result<StepOutcome> {
        if !self.started {
            return Err(EnvError::protocol(&self.id, "step before reset"));
        }
        if self.done {
            return Err(EnvError::protocol(&self.id, "step after the episode ended"));
        }
        self.steps += 1;
        let k = self.program.len();
        let prev = action
            .to_text(Some(&SmallVocab), &self.id)
            .unwrap_or_default();
        let (tok_obs, text_obs, error) = match (&self.cfg.mode, action) {
            (Mode::Tokens, Action::Tokens(ids)) => {
                let (t, e) = self.exec_tokens(ids);
                (t, Vec::new(), e)
            }
            (Mode::Tokens, Action::Text(s)) => match SmallVocab.encode(s) {
                Ok(ids) => {
                    let (t, e) = self.exec_tokens(&ids);
                    (t, Vec::new(), e)
                }
                Err(e) => (vec![ERR], Vec::new(), Some(e.to_string())),
            },
            (Mode::Text(_), Action::Text(s)) => {
                let (r, e) = self.exec_text(s);
                (Vec::new(), r, e)
            }
            (Mode::Text(_), Action::Tokens(_)) => {
                let e = "this is a text task: send Action::Text".to_string();
                (Vec::new(), vec![format!("error: {e}")], Some(e))
            }
        };
        if self.adds == k || self.steps >= 3 * k {
            self.done = true;
            let reward = if self.adds == k && self.register == self.target() {
                1.0
            } else {
                0.0
            };
            return Ok(StepOutcome::last(
                final_observation(&self.cfg.mode, &prev),
                reward,
                error,
            ));
        }
        let observation = match &self.cfg.mode {
            Mode::Tokens => {
                let mut t = tok_obs;
                t.extend(self.instruction_tokens());
                Observation::tokens(&SmallVocab, t)
            }
            Mode::Text(chat) => {
                let mut r = text_obs;
                let last = r.pop().unwrap_or_default();
                r.push(format!("{last}\n{}", self.instruction_text()));
                Observation::text(chat.tool_responses(&prev, &r))
            }
        };
        Ok(StepOutcome::next(observation, error))
    }

    fn fork(&self) -> Option<Box<dyn Env>> {
        Some(Box::new(self.clone()))
    }

    fn fresh(&self) -> Result<Box<dyn Env>> {
        Ok(Box::new(Register::new(self.cfg.clone(), self.seed)?))
    }

    fn vocab(&self) -> Option<&SmallVocab> {
        self.cfg.mode.vocab()
    }

    fn tool_calls(&self) -> usize {
        self.log.len()
    }

    fn summary(&self) -> String {
        format!(
            "{}: register {} (target {}), {}/{} instructions applied in {} steps, tool log [{}]{}",
            self.id,
            self.register,
            self.target(),
            self.adds,
            self.program.len(),
            self.steps,
            self.log.join(", "),
            if self.done { ", done" } else { "" }
        )
    }

    fn state_bytes(&self) -> Result<Vec<u8>> {
        json_state(&self.id, self)
    }
}

// ------------------------------------------------------------------- specs

/// Builds a synthetic task from its spec, the format of its
/// [`Env::task_id`]: `running-sum:k=4,seed=7,mode=tokens` (`,turns=1`: the
/// single-turn variant) or
/// `register:k=4,seed=7,subtract=true,mode=qwen` (`mode`: `tokens`, `text`
/// or `qwen`; defaults `seed=0`, `mode=tokens`, `subtract=false`).
pub fn from_spec(spec: &str) -> Result<Box<dyn Env>> {
    let bad = |msg: String| EnvError::task(spec, msg);
    let (name, rest) = spec.split_once(':').unwrap_or((spec, ""));
    let (mut k, mut seed, mut mode, mut subtract) = (None, 0u64, Mode::Tokens, false);
    let (mut one_turn, mut stop_at_error) = (false, false);
    for kv in rest.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (key, val) = kv
            .split_once('=')
            .ok_or_else(|| bad(format!("`{kv}` is not key=value")))?;
        match key.trim() {
            "k" | "difficulty" => {
                k = Some(
                    val.parse()
                        .map_err(|_| bad(format!("k `{val}` is not an integer")))?,
                );
            }
            "seed" => {
                seed = val
                    .parse()
                    .map_err(|_| bad(format!("seed `{val}` is not an integer")))?;
            }
            "turns" if name == "running-sum" => {
                one_turn = match val {
                    "1" => true,
                    "k" => false,
                    _ => return Err(bad(format!("turns `{val}`: expected 1 or k"))),
                }
            }
            "stop" if name == "running-sum" => {
                stop_at_error = match val {
                    "error" => true,
                    "end" => false,
                    _ => return Err(bad(format!("stop `{val}`: expected error or end"))),
                }
            }
            "subtract" => {
                subtract = val
                    .parse()
                    .map_err(|_| bad(format!("subtract `{val}` is not true/false")))?;
            }
            "mode" => {
                mode = match val {
                    "tokens" => Mode::Tokens,
                    "text" => Mode::Text(ChatFormat::Plain),
                    "qwen" => Mode::Text(ChatFormat::Qwen),
                    _ => return Err(bad(format!("mode `{val}`: expected tokens, text or qwen"))),
                }
            }
            other => return Err(bad(format!("unknown key `{other}`"))),
        }
    }
    let difficulty = k.ok_or_else(|| bad("missing k=<difficulty>".into()))?;
    match name {
        "running-sum" => Ok(Box::new(RunningSum::new(
            RunningSumConfig {
                difficulty,
                mode,
                one_turn,
                stop_at_error,
            },
            seed,
        )?)),
        "register" => Ok(Box::new(Register::new(
            RegisterConfig {
                difficulty,
                subtract,
                mode,
            },
            seed,
        )?)),
        _ => Err(bad(format!(
            "unknown synthetic task `{name}` (running-sum, register)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::Episode;
    use crate::vocab::{DONE, QUERY};

    fn run_actions(env: Box<dyn Env>, actions: Vec<Action>) -> Episode {
        Episode::replay(env, &actions).unwrap()
    }

    #[test]
    fn specs_round_trip_through_task_ids() {
        for spec in [
            "running-sum:k=4,seed=7,mode=tokens",
            "running-sum:k=2,seed=1,mode=qwen",
            "running-sum:k=5,seed=2,mode=tokens,stop=error",
            "register:k=3,seed=9,subtract=true,mode=text",
        ] {
            assert_eq!(from_spec(spec).unwrap().task_id(), spec);
        }
        assert_eq!(
            from_spec("register:k=2").unwrap().task_id(),
            "register:k=2,seed=0,subtract=false,mode=tokens"
        );
        for bad in [
            "nope:k=1",
            "running-sum",
            "running-sum:k=x",
            "running-sum:k=1,mode=zz",
            "running-sum:k=1,q=2",
            "running-sum:k1",
            "running-sum:k=3,stop=later",
            "running-sum:k=3,turns=1,stop=error",
        ] {
            assert!(
                matches!(from_spec(bad), Err(EnvError::Task { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn seeded_generation_is_stable() {
        let a = RunningSum::new(RunningSumConfig::tokens(8), 3).unwrap();
        let b = RunningSum::new(RunningSumConfig::tokens(8), 3).unwrap();
        let c = RunningSum::new(RunningSumConfig::tokens(8), 4).unwrap();
        assert_eq!(a.digits(), b.digits());
        assert_ne!(a.digits(), c.digits());
        // Pinned: a seed means the same task forever.
        assert_eq!(
            RunningSum::new(RunningSumConfig::tokens(6), 0)
                .unwrap()
                .digits(),
            &RunningSum::new(RunningSumConfig::tokens(6), 0)
                .unwrap()
                .digits
        );
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert!(RunningSum::new(RunningSumConfig::tokens(0), 1).is_err());
        assert!(Register::new(RegisterConfig::tokens(MAX_DIFFICULTY + 1, false), 1).is_err());
    }

    #[test]
    fn running_sum_tokens_binary_reward() {
        for k in [1, 2, 5, 12] {
            let env = RunningSum::new(RunningSumConfig::tokens(k), 11).unwrap();
            let good = env.oracle_actions();
            let ep = run_actions(env.fresh().unwrap(), good.clone());
            assert!(ep.is_done());
            assert_eq!(ep.total_reward(), 1.0);
            assert_eq!(ep.segments().len(), k);
            // One wrong answer anywhere -> 0.
            let mut bad = good.clone();
            let Action::Tokens(t) = &mut bad[k / 2] else {
                unreachable!()
            };
            t[0] = (t[0] + 1) % 10;
            let ep = run_actions(env.fresh().unwrap(), bad);
            assert_eq!(ep.total_reward(), 0.0);
        }
    }

    /// Fail fast: the first wrong or malformed answer ends the episode
    /// with reward 0; right answers go on as in the plain task.
    #[test]
    fn running_sum_stops_at_the_first_error() {
        let k = 5;
        let cfg = RunningSumConfig {
            stop_at_error: true,
            ..RunningSumConfig::tokens(k)
        };
        let env = RunningSum::new(cfg, 3).unwrap();
        let good = env.oracle_actions();
        let ep = run_actions(env.fresh().unwrap(), good.clone());
        assert!(ep.is_done());
        assert_eq!((ep.total_reward(), ep.segments().len()), (1.0, k));
        for at in 0..k {
            for bad in [
                {
                    let Action::Tokens(t) = &good[at] else {
                        unreachable!()
                    };
                    Action::Tokens(vec![(t[0] + 1) % 10, EOS])
                },
                Action::Tokens(vec![PLUS, EOS]),
            ] {
                let mut acts = good[..at].to_vec();
                acts.push(bad);
                let ep = run_actions(env.fresh().unwrap(), acts);
                assert!(ep.is_done(), "wrong answer {at} must end the episode");
                assert_eq!((ep.total_reward(), ep.segments().len()), (0.0, at + 1));
            }
        }
        let one_turn = RunningSumConfig {
            stop_at_error: true,
            ..RunningSumConfig::tokens_one_turn(k)
        };
        assert!(RunningSum::new(one_turn, 3).is_err());
    }

    #[test]
    fn running_sum_one_turn() {
        for k in [1, 5, 12] {
            let env = RunningSum::new(RunningSumConfig::tokens_one_turn(k), 11).unwrap();
            let d: Vec<u32> = env.digits().iter().map(|&x| u32::from(x)).collect();
            let mut ep = Episode::new(env.fresh().unwrap());
            let prompt = ep.reset().unwrap().tokens.unwrap();
            assert_eq!(prompt.len(), k + 2);
            assert_eq!(
                (prompt[0], &prompt[1..=k], prompt[k + 1]),
                (BOS, &d[..], EQUALS)
            );
            let good = env.oracle_actions();
            assert_eq!(good.len(), 1);
            let ep = run_actions(env.fresh().unwrap(), good.clone());
            assert!(ep.is_done());
            assert_eq!((ep.total_reward(), ep.segments().len()), (1.0, 1));
            // A wrong sum anywhere, a missing one, or a stray token: 0.
            let Action::Tokens(t) = &good[0] else {
                unreachable!()
            };
            let mut wrong = t.clone();
            wrong[k - 1] = (wrong[k - 1] + 1) % 10;
            let short = t[..k - 1].to_vec();
            for bad in [wrong, short, vec![QUERY]] {
                let mut ep = Episode::new(env.fresh().unwrap());
                ep.reset().unwrap();
                let o = ep.step(Action::Tokens(bad)).unwrap();
                assert!(o.done && o.reward == 0.0);
            }
        }
        let text = RunningSum::new(
            RunningSumConfig {
                one_turn: true,
                ..RunningSumConfig::text(3, ChatFormat::Plain)
            },
            2,
        )
        .unwrap();
        let sums: Vec<String> = text.expected().iter().map(u8::to_string).collect();
        let answer = format!("<think>1 2 3 4</think>The sums: {}", sums.join(", "));
        let ep = run_actions(text.fresh().unwrap(), vec![Action::Text(answer)]);
        assert_eq!(ep.total_reward(), 1.0);
        let spec = "running-sum:k=4,seed=7,mode=tokens,turns=1";
        assert_eq!(from_spec(spec).unwrap().task_id(), spec);
        assert!(from_spec("running-sum:k=4,turns=2").is_err());
        assert!(from_spec("register:k=4,turns=1").is_err());
    }

    #[test]
    fn running_sum_token_observations() {
        let env = RunningSum::new(RunningSumConfig::tokens(3), 5).unwrap();
        let d: Vec<u32> = env.digits().iter().map(|&x| u32::from(x)).collect();
        let mut ep = Episode::new(env.fresh().unwrap());
        assert_eq!(ep.reset().unwrap().tokens.unwrap(), vec![BOS, d[0]]);
        // Without <eos>, with <pad>: accepted.
        let o = ep.step(Action::Tokens(vec![PAD, d[0]])).unwrap();
        assert_eq!(o.observation.tokens.unwrap(), vec![d[1]]);
        assert!(o.error.is_none());
        // Malformed: error, counts as wrong, episode goes on.
        let o = ep.step(Action::Tokens(vec![QUERY, DONE])).unwrap();
        assert!(o.error.as_deref().unwrap().contains("one digit token"));
        assert_eq!(o.observation.tokens.unwrap(), vec![d[2]]);
        let o = ep.step(Action::Tokens(vec![99])).unwrap();
        assert!(o.done && o.reward == 0.0);
        assert_eq!(o.observation.tokens.unwrap(), Vec::<u32>::new());
        assert!(ep.env().summary().contains("1/3 right"));
    }

    #[test]
    fn running_sum_text_surfaces() {
        for chat in [ChatFormat::Plain, ChatFormat::Qwen] {
            let env = RunningSum::new(RunningSumConfig::text(4, chat.clone()), 2).unwrap();
            let exp = env.expected();
            let mut ep = Episode::new(env.fresh().unwrap());
            let o = ep.reset().unwrap();
            assert!(o.text.contains("Digit 1 of 4"));
            assert!(o.tokens.is_none());
            let answers = [
                format!("<think>adding 12</think>The sum is {}.", exp[0]),
                format!("{}<|im_end|>", exp[1]),
                exp[2].to_string(),
                exp[3].to_string(),
            ];
            for a in answers {
                ep.step(Action::Text(a)).unwrap();
            }
            assert_eq!(ep.total_reward(), 1.0, "{chat:?}");
            let ctx: String = ep.context().iter().map(|s| s.text.as_str()).collect();
            if chat == ChatFormat::Qwen {
                assert_eq!(ctx.matches("<|im_start|>user").count(), 4);
                assert_eq!(ctx.matches("<|im_end|>").count(), 8);
                assert!(ctx.ends_with("<|im_end|>\n"));
            }
            let ep2 = run_actions(env.fresh().unwrap(), vec![Action::text("12"); 4]);
            assert_eq!(ep2.total_reward(), 0.0);
            assert!(ep2.turns()[0]
                .outcome
                .error
                .as_deref()
                .unwrap()
                .contains("single digit"));
        }
    }

    #[test]
    fn register_tokens() {
        let env = Register::new(RegisterConfig::tokens(6, true), 8).unwrap();
        assert!(
            env.program().iter().any(|p| p.0),
            "seed 8 draws a subtraction"
        );
        let ep = run_actions(env.fresh().unwrap(), env.oracle_actions());
        assert_eq!(ep.total_reward(), 1.0);
        // A read and a malformed action in between keep the instruction.
        let mut ep = Episode::new(env.fresh().unwrap());
        let first = ep.reset().unwrap().tokens.unwrap();
        assert_eq!(first[0], BOS);
        let o = ep.step(Action::Tokens(vec![GET, EOS])).unwrap();
        assert_eq!(
            o.observation.tokens.unwrap(),
            [&[EQUALS, 0][..], &first[1..]].concat()
        );
        let o = ep.step(Action::Tokens(vec![ADD])).unwrap();
        assert!(o.error.is_some());
        assert_eq!(
            o.observation.tokens.unwrap(),
            [&[ERR][..], &first[1..]].concat()
        );
        for a in env.oracle_actions() {
            ep.step(a).unwrap();
        }
        assert_eq!(ep.total_reward(), 1.0);
        // Wrong digits -> 0; stalling -> ends at 3k steps with 0.
        let ep = run_actions(env.fresh().unwrap(), vec![Action::Tokens(vec![ADD, 1]); 6]);
        assert!(ep.is_done());
        let stall = run_actions(env.fresh().unwrap(), vec![Action::Tokens(vec![GET]); 18]);
        assert!(stall.is_done());
        assert_eq!(stall.total_reward(), 0.0);
    }

    #[test]
    fn register_text_tool_calls() {
        let env = Register::new(RegisterConfig::text(3, true, ChatFormat::Qwen), 1).unwrap();
        let mut ep = Episode::new(env.fresh().unwrap());
        let o = ep.reset().unwrap();
        assert!(o.text.contains("<tools>") && o.text.contains("\"name\": \"add\""));
        for bad in [
            "no call",
            "<tool_call>{oops}</tool_call>",
            "<tool_call>{\"name\": \"mul\", \"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"add\", \"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"add\", \"arguments\": {\"value\": 12}}</tool_call>",
        ] {
            let o = ep.step(Action::text(bad)).unwrap();
            assert!(o.error.is_some(), "{bad}");
            assert!(!o.done);
            assert!(
                o.observation.text.contains("<tool_response>\nerror: "),
                "{}",
                o.observation.text
            );
        }
        let o = ep
            .step(Action::text("<tool_call>{\"name\": \"read\"}</tool_call>"))
            .unwrap();
        assert!(o.observation.text.contains("register = 0"));
        let fork = ep.fork().unwrap();
        for a in env.oracle_actions() {
            ep.step(a).unwrap();
        }
        assert_eq!(ep.total_reward(), 1.0);
        // The fork did not move; replaying the actions rebuilds the same state.
        assert_eq!(fork.turns().len(), 6);
        let re = ep.replay_prefix(ep.actions().len()).unwrap();
        assert_eq!(
            re.env().state_bytes().unwrap(),
            ep.env().state_bytes().unwrap()
        );
        assert_eq!(re.turns(), ep.turns());
        assert!(ep.env().summary().contains("tool log [read, add"));
    }
}
