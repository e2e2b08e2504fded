//! Math: answer extraction, normalisation and equivalence, dataset loaders
//! (GSM8K, MATH, MATH-500, AIME, a user's own JSONL) and a single-turn math
//! environment.
//!
//! ```
//! use arbor_env::math::grade;
//!
//! let g = grade("... so the total is $\\boxed{\\dfrac{3}{4}}$.", "0.75");
//! assert!(g.correct);
//! assert_eq!(g.extracted.as_deref(), Some("\\dfrac{3}{4}"));
//! ```

pub mod equiv;
pub mod expr;
pub mod extract;

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::chat::ChatFormat;
use crate::data::{read_jsonl, Row};
use crate::env::{Action, Env, Observation, StepOutcome};
use crate::error::{EnvError, Result};

pub use equiv::{equivalent, normalize};
pub use extract::{extract_answer, gold_answer, ExtractMethod, Extracted};

/// The verdict on one response.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Grade {
    /// The extracted answer is equivalent to the reference.
    pub correct: bool,
    /// The answer read from the response (`None`: nothing found).
    pub extracted: Option<String>,
    /// How it was found.
    pub method: Option<ExtractMethod>,
}

/// Grades a response against a reference answer (a bare answer, or a
/// GSM8K / MATH solution whose `####` / `\boxed{}` answer is used).
pub fn grade(response: &str, reference: &str) -> Grade {
    let gold = gold_answer(reference);
    match extract_answer(response) {
        Some(e) => Grade {
            correct: equivalent(&e.text, &gold),
            extracted: Some(e.text),
            method: Some(e.method),
        },
        None => Grade {
            correct: false,
            extracted: None,
            method: None,
        },
    }
}

/// The grade of one row of a JSONL of responses (`arbor grade`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RowGrade {
    /// 1-based line number in the input.
    pub line: usize,
    /// The extracted answer is equivalent to the reference.
    pub correct: bool,
    /// The answer read from the response, or `None`.
    pub extracted: Option<String>,
    /// How it was found.
    pub method: Option<ExtractMethod>,
    /// The reference answer used (after `####` / `\boxed{}` extraction).
    pub reference: String,
}

/// Grades every row of a JSONL file: `response_field` holds the model's
/// response (`null` counts as no answer), `answer_field` the reference
/// (a bare answer or a GSM8K / MATH solution). A missing field is an error
/// naming `file:line`.
pub fn grade_jsonl(path: &Path, response_field: &str, answer_field: &str) -> Result<Vec<RowGrade>> {
    read_jsonl(path)?
        .iter()
        .map(|row| {
            if !row.fields.contains_key(response_field) {
                return Err(row.field_error(
                    response_field,
                    "missing (the response field; set it with --response-field)".into(),
                ));
            }
            let response = row.opt_str_field(response_field)?.unwrap_or_default();
            let reference = gold_answer(&row.str_field(answer_field)?);
            let g = grade(&response, &reference);
            Ok(RowGrade {
                line: row.line,
                correct: g.correct,
                extracted: g.extracted,
                method: g.method,
                reference,
            })
        })
        .collect()
}

/// One math problem with its reference answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MathProblem {
    /// Stable id (`unique_id`/`id` field, else `file:line`).
    pub id: String,
    /// The problem statement.
    pub problem: String,
    /// The reference final answer.
    pub answer: String,
    /// The worked solution, when the dataset has one.
    pub solution: Option<String>,
    /// Difficulty level, when given.
    pub level: Option<String>,
    /// Subject / type / source, when given.
    pub subject: Option<String>,
}

/// Field names of a user's own JSONL.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fields {
    /// The problem field.
    pub problem: String,
    /// The answer field (a bare answer, or a solution with `####` /
    /// `\boxed{}`: the final answer is extracted).
    pub answer: String,
    /// An id field (else `file:line`).
    pub id: Option<String>,
}

/// A dataset layout (formats in `shared/data/README.md`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DatasetFormat {
    /// `question`, `answer` (solution ending `#### N`).
    Gsm8k,
    /// Hendrycks MATH: `problem`, `solution` (answer in `\boxed{}`),
    /// `level`, `type`.
    Math,
    /// MATH-500: `problem`, `solution`, `answer`, `subject`, `level`,
    /// `unique_id`.
    Math500,
    /// AIME: `question`, `answer`, `source`, `id`.
    Aime,
    /// A user's own JSONL.
    Custom(Fields),
}

impl DatasetFormat {
    /// The format named `gsm8k`, `math`, `math500`, `aime`.
    pub fn from_name(name: &str) -> Result<Self> {
        match name.to_ascii_lowercase().replace(['-', '_'], "").as_str() {
            "gsm8k" => Ok(DatasetFormat::Gsm8k),
            "math" | "hendrycksmath" => Ok(DatasetFormat::Math),
            "math500" => Ok(DatasetFormat::Math500),
            "aime" => Ok(DatasetFormat::Aime),
            _ => Err(EnvError::config(
                "dataset format",
                format!("`{name}`: expected gsm8k, math, math500 or aime"),
            )),
        }
    }

    /// Guesses the format from a row's fields.
    pub fn detect(row: &Row) -> Option<Self> {
        let has = |k: &str| row.fields.contains_key(k);
        if has("unique_id") && has("answer") && has("problem") {
            Some(DatasetFormat::Math500)
        } else if has("problem") && has("solution") {
            Some(DatasetFormat::Math)
        } else if has("question") && has("answer") && has("source") {
            Some(DatasetFormat::Aime)
        } else if has("question") && has("answer") {
            Some(DatasetFormat::Gsm8k)
        } else {
            None
        }
    }

    fn problem(&self, row: &Row) -> Result<MathProblem> {
        let loc = format!("{}:{}", row.path.display(), row.line);
        let opt = |k: &str| row.opt_str_field(k);
        Ok(match self {
            DatasetFormat::Gsm8k => {
                let sol = row.str_field("answer")?;
                let answer = gsm8k_answer(&sol)
                    .ok_or_else(|| row.field_error("answer", "no `#### N` final answer".into()))?;
                MathProblem {
                    id: opt("idx")?.map_or(loc, |i| format!("gsm8k-{i}")),
                    problem: row.str_field("question")?,
                    answer,
                    solution: Some(sol),
                    level: None,
                    subject: None,
                }
            }
            DatasetFormat::Math => {
                let sol = row.str_field("solution")?;
                let answer = extract::last_boxed(&sol)
                    .ok_or_else(|| row.field_error("solution", "no \\boxed{} answer".into()))?;
                MathProblem {
                    id: opt("idx")?.map_or(loc, |i| format!("math-{i}")),
                    problem: row.str_field("problem")?,
                    answer,
                    solution: Some(sol),
                    level: opt("level")?,
                    subject: opt("type")?,
                }
            }
            DatasetFormat::Math500 => MathProblem {
                id: opt("unique_id")?.unwrap_or(loc),
                problem: row.str_field("problem")?,
                answer: row.str_field("answer")?,
                solution: opt("solution")?,
                level: opt("level")?,
                subject: opt("subject")?,
            },
            DatasetFormat::Aime => MathProblem {
                id: opt("id")?.unwrap_or(loc),
                problem: row.str_field("question")?,
                answer: row.str_field("answer")?,
                solution: None,
                level: None,
                subject: opt("source")?,
            },
            DatasetFormat::Custom(f) => MathProblem {
                id: match &f.id {
                    Some(k) => row.str_field(k)?,
                    None => loc,
                },
                problem: row.str_field(&f.problem)?,
                answer: gold_answer(&row.str_field(&f.answer)?),
                solution: None,
                level: None,
                subject: None,
            },
        })
    }
}

/// The final answer of a GSM8K solution (`#### 1,234` -> `1234`).
pub fn gsm8k_answer(solution: &str) -> Option<String> {
    let i = solution.rfind("####")?;
    let a = solution[i + 4..].trim().replace(',', "");
    (!a.is_empty()).then_some(a)
}

/// Loads a math dataset. `format: None` detects it from the first row.
/// Every bad row is an error naming `file:line` and the field.
pub fn load_problems(path: &Path, format: Option<&DatasetFormat>) -> Result<Vec<MathProblem>> {
    let rows = read_jsonl(path)?;
    let Some(first) = rows.first() else {
        return Ok(Vec::new());
    };
    let fmt = match format {
        Some(f) => f.clone(),
        None => DatasetFormat::detect(first).ok_or_else(|| EnvError::Data {
            path: path.to_path_buf(),
            line: first.line,
            msg: "cannot tell the dataset format from the fields; name it \
                  (gsm8k, math, math500, aime) or give the field names"
                .into(),
        })?,
    };
    rows.iter().map(|r| fmt.problem(r)).collect()
}

/// The default instruction appended to a math problem.
pub const BOXED_INSTRUCTION: &str =
    "Please reason step by step, and put your final answer within \\boxed{}.";

/// A single-turn math environment: the problem is the observation, the
/// response is graded (reward 1 iff equivalent), the episode ends.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MathEnv {
    problem: MathProblem,
    chat: ChatFormat,
    started: bool,
    graded: Option<Grade>,
}

impl MathEnv {
    /// An environment for `problem` with the given chat scaffolding.
    pub fn new(problem: MathProblem, chat: ChatFormat) -> Self {
        MathEnv {
            problem,
            chat,
            started: false,
            graded: None,
        }
    }

    /// The problem.
    pub fn problem(&self) -> &MathProblem {
        &self.problem
    }

    /// The grade of the episode's response, once given.
    pub fn graded(&self) -> Option<&Grade> {
        self.graded.as_ref()
    }
}

impl Env for MathEnv {
    fn task_id(&self) -> &str {
        &self.problem.id
    }

    fn reset(&mut self) -> Result<Observation> {
        self.started = true;
        self.graded = None;
        let user = format!("{}\n{BOXED_INSTRUCTION}", self.problem.problem);
        Ok(Observation::text(self.chat.first(None, &[], &user)))
    }

    fn step(&mut self, action: &Action) -> Result<StepOutcome> {
        if !self.started || self.graded.is_some() {
            return Err(EnvError::protocol(
                &self.problem.id,
                "math episodes take one step after reset",
            ));
        }
        let text = action.to_text(None, &self.problem.id)?;
        let g = grade(&text, &self.problem.answer);
        let reward = if g.correct { 1.0 } else { 0.0 };
        let error = g.extracted.is_none().then(|| "no answer found".to_string());
        self.graded = Some(g);
        Ok(StepOutcome::last(
            Observation::text(self.chat.close(&text)),
            reward,
            error,
        ))
    }

    fn fork(&self) -> Option<Box<dyn Env>> {
        Some(Box::new(self.clone()))
    }

    fn fresh(&self) -> Result<Box<dyn Env>> {
        Ok(Box::new(MathEnv::new(
            self.problem.clone(),
            self.chat.clone(),
        )))
    }

    fn summary(&self) -> String {
        match &self.graded {
            Some(g) => format!(
                "{}: reference `{}`, extracted {:?}, {}",
                self.problem.id,
                self.problem.answer,
                g.extracted,
                if g.correct { "correct" } else { "wrong" }
            ),
            None => format!("{}: not answered", self.problem.id),
        }
    }

    fn state_bytes(&self) -> Result<Vec<u8>> {
        crate::synthetic::json_state(&self.problem.id, self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::Episode;
    use std::path::PathBuf;

    fn shared(rel: &str) -> Option<PathBuf> {
        crate::data::shared_data(rel, "math dataset test")
    }

    #[test]
    fn grade_paths() {
        let g = grade("The answer is 18.", "Janet ... \n#### 18");
        assert!(g.correct);
        assert_eq!(g.method, Some(ExtractMethod::AnswerIs));
        let g = grade("nothing", "5");
        assert!(!g.correct && g.extracted.is_none());
        assert_eq!(gsm8k_answer("x\n#### 1,080").unwrap(), "1080");
    }

    #[test]
    fn fixture_loaders() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("g.jsonl");
        std::fs::write(
            &p,
            "{\"question\": \"q\", \"answer\": \"s\\n#### 1,080\", \"idx\": 3}\n",
        )
        .unwrap();
        let v = load_problems(&p, None).unwrap();
        assert_eq!(
            (v[0].id.as_str(), v[0].answer.as_str()),
            ("gsm8k-3", "1080")
        );
        std::fs::write(&p, "{\"question\": \"q\", \"answer\": \"no hashes\"}\n").unwrap();
        let e = load_problems(&p, Some(&DatasetFormat::Gsm8k))
            .unwrap_err()
            .to_string();
        assert!(e.contains("g.jsonl:1: field `answer`: no `#### N`"), "{e}");
        std::fs::write(
            &p,
            "{\"q\": \"2+2\", \"a\": \"so \\\\boxed{4}\"}\n{\"q\": \"x\"}\n",
        )
        .unwrap();
        let custom = DatasetFormat::Custom(Fields {
            problem: "q".into(),
            answer: "a".into(),
            id: None,
        });
        let e = load_problems(&p, Some(&custom)).unwrap_err().to_string();
        assert!(e.contains("g.jsonl:2: field `a`: missing"), "{e}");
        std::fs::write(&p, "{\"q\": \"2+2\", \"a\": \"so \\\\boxed{4}\"}\n").unwrap();
        let v = load_problems(&p, Some(&custom)).unwrap();
        assert_eq!(v[0].answer, "4");
        assert!(v[0].id.ends_with("g.jsonl:1"));
        std::fs::write(&p, "{\"zzz\": 1}\n").unwrap();
        assert!(load_problems(&p, None)
            .unwrap_err()
            .to_string()
            .contains("cannot tell"));
        assert!(DatasetFormat::from_name("MATH-500").is_ok());
        assert!(DatasetFormat::from_name("nope").is_err());
    }

    #[test]
    fn shared_datasets_load_and_self_grade() {
        let sets = [
            ("math/gsm8k/test.jsonl", 1319),
            ("math/hendrycks-math/test.jsonl", 5000),
            ("math/math500/test.jsonl", 500),
            ("math/aime/test.jsonl", 45),
        ];
        for (rel, n) in sets {
            let Some(p) = shared(rel) else { continue };
            let probs = load_problems(&p, None).unwrap();
            assert_eq!(probs.len(), n, "{rel}");
            // The reference answer, boxed, grades as correct.
            let wrong: Vec<&MathProblem> = probs
                .iter()
                .filter(|q| !grade(&format!("So \\boxed{{{}}}", q.answer), &q.answer).correct)
                .collect();
            assert!(
                wrong.is_empty(),
                "{rel}: {:?}",
                wrong.iter().map(|q| &q.answer).take(5).collect::<Vec<_>>()
            );
            // The MATH solutions themselves grade as correct.
            if rel.contains("math500") {
                let bad = probs
                    .iter()
                    .filter(|q| !grade(q.solution.as_deref().unwrap_or(""), &q.answer).correct)
                    .count();
                assert!(
                    bad <= 5,
                    "{bad} MATH-500 solutions disagree with their answers"
                );
            }
        }
    }

    #[test]
    fn grade_jsonl_rows_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.jsonl");
        std::fs::write(
            &p,
            "{\"response\": \"\\\\boxed{4}\", \"answer\": \"4\"}\n\
             {\"response\": null, \"answer\": 7}\n\
             {\"response\": \"the answer is 3\", \"answer\": \"so #### 5\"}\n",
        )
        .unwrap();
        let g = grade_jsonl(&p, "response", "answer").unwrap();
        assert_eq!(g.len(), 3);
        assert!(g[0].correct);
        assert_eq!(
            (g[1].correct, g[1].extracted.as_deref(), g[1].line),
            (false, None, 2)
        );
        assert_eq!(
            (g[2].extracted.as_deref(), g[2].reference.as_str()),
            (Some("3"), "5")
        );
        let e = grade_jsonl(&p, "output", "answer").unwrap_err().to_string();
        assert!(e.contains("r.jsonl:1: field `output`: missing"), "{e}");
    }

    #[test]
    fn math_env_single_turn() {
        let prob = MathProblem {
            id: "p1".into(),
            problem: "What is 1/2 + 1/4?".into(),
            answer: "\\frac34".into(),
            solution: None,
            level: None,
            subject: None,
        };
        let env = MathEnv::new(prob, ChatFormat::Qwen);
        let mut ep = Episode::new(env.fresh().unwrap());
        let o = ep.reset().unwrap();
        assert!(o.text.contains("\\boxed{}") && o.text.ends_with("<|im_start|>assistant\n"));
        let out = ep
            .step(Action::text("<think>add</think>$\\boxed{0.75}$"))
            .unwrap();
        assert!(out.done && out.reward == 1.0);
        assert!(ep.env().summary().contains("correct"));
        let mut ep = Episode::new(env.fresh().unwrap());
        ep.reset().unwrap();
        let out = ep.step(Action::text("I don't know")).unwrap();
        assert_eq!(out.reward, 0.0);
        assert_eq!(out.error.as_deref(), Some("no answer found"));
    }
}
