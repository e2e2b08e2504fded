//! Answer extraction from a model response (or a reference solution).
//!
//! In order of precedence, after dropping any `<think>...</think>` reasoning:
//! 1. the last `\boxed{...}` (nested braces; also `\fbox{...}` and the
//!    brace-less `\boxed 5`);
//! 2. the last `#### N` (GSM8K);
//! 3. the last "the answer is X" / "final answer: X" (to the end of the
//!    sentence or line, surrounding `$` removed);
//! 4. the last number in the text (integers with thousands commas,
//!    decimals, fractions `a/b`, a leading minus sign).

use serde::{Deserialize, Serialize};

use crate::toolcall::strip_think;

/// How an answer was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExtractMethod {
    /// `\boxed{...}`.
    Boxed,
    /// `#### N`.
    Hashes,
    /// "the answer is X".
    AnswerIs,
    /// The last number.
    LastNumber,
}

/// An extracted answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Extracted {
    /// The answer text as written.
    pub text: String,
    /// How it was found.
    pub method: ExtractMethod,
}

/// The content of the last `\boxed{...}` / `\fbox{...}` in `text`, with
/// nested braces; `\boxed 5` (no braces) yields the next token. `None` when
/// there is none or its braces never close.
pub fn last_boxed(text: &str) -> Option<String> {
    let mut best: Option<(usize, String)> = None;
    for cmd in ["\\boxed", "\\fbox"] {
        let Some(start) = text.rfind(cmd) else {
            continue;
        };
        if best.as_ref().is_some_and(|(b, _)| *b > start) {
            continue;
        }
        let rest = &text[start + cmd.len()..];
        let content = if let Some(body) = rest.trim_start().strip_prefix('{') {
            balanced(body)
        } else if rest.starts_with(' ') {
            let tok: String = rest
                .trim_start()
                .chars()
                .take_while(|c| !c.is_whitespace() && *c != '$')
                .collect();
            (!tok.is_empty()).then_some(tok)
        } else {
            None
        };
        if let Some(c) = content {
            best = Some((start, c));
        }
    }
    best.map(|(_, c)| c.trim().to_string())
}

/// The text up to the brace that closes an already-opened `{`.
fn balanced(body: &str) -> Option<String> {
    let mut depth = 1usize;
    let mut prev_backslash = false;
    for (i, c) in body.char_indices() {
        match c {
            '{' if !prev_backslash => depth += 1,
            '}' if !prev_backslash => {
                depth -= 1;
                if depth == 0 {
                    return Some(body[..i].to_string());
                }
            }
            _ => {}
        }
        prev_backslash = c == '\\' && !prev_backslash;
    }
    None
}

fn after_hashes(text: &str) -> Option<String> {
    let i = text.rfind("####")?;
    let line = text[i + 4..].lines().next().unwrap_or("").trim();
    let line = line.trim_matches('$').trim();
    (!line.is_empty()).then(|| line.to_string())
}

fn answer_is(text: &str) -> Option<String> {
    // ASCII lowercasing keeps byte offsets.
    let lower = text.to_ascii_lowercase();
    let mut best: Option<(usize, usize)> = None;
    for pat in [
        "the answer is",
        "the final answer is",
        "final answer:",
        "answer:",
        "final answer is",
    ] {
        if let Some(i) = lower.rfind(pat) {
            let end = i + pat.len();
            if best.is_none_or(|(b, _)| i > b) {
                best = Some((i, end));
            }
        }
    }
    let (_, end) = best?;
    let rest = text[end..].trim_start_matches([':', ' ', '\t']);
    let rest = rest.strip_prefix("is ").unwrap_or(rest);
    let mut out = String::new();
    let mut in_math = false;
    let chars: Vec<char> = rest.chars().collect();
    for (i, &c) in chars.iter().enumerate() {
        if c == '$' {
            in_math = !in_math;
        }
        if c == '\n' {
            break;
        }
        // A sentence ends at ". " or a final "." outside math, not inside
        // a decimal number.
        if c == '.' && !in_math {
            let next = chars.get(i + 1);
            if next.is_none_or(|n| n.is_whitespace()) {
                break;
            }
        }
        out.push(c);
    }
    let ans = out.trim().trim_matches('$').trim();
    let ans = last_boxed(ans).unwrap_or_else(|| ans.to_string());
    (!ans.is_empty()).then_some(ans)
}

/// The last number in the text: `-1,234.5`, `3/4`, `.5`.
pub fn last_number(text: &str) -> Option<String> {
    let b = text.as_bytes();
    let mut best = None;
    let mut i = 0;
    while i < b.len() {
        let starts =
            b[i].is_ascii_digit() || (b[i] == b'.' && b.get(i + 1).is_some_and(u8::is_ascii_digit));
        if !starts {
            i += 1;
            continue;
        }
        let start = if i > 0 && b[i - 1] == b'-' { i - 1 } else { i };
        let mut j = i;
        loop {
            while j < b.len() && b[j].is_ascii_digit() {
                j += 1;
            }
            // Thousands separator: a comma followed by exactly 3 digits.
            if j + 3 < b.len() + 1
                && b.get(j) == Some(&b',')
                && b[j + 1..]
                    .iter()
                    .take(3)
                    .filter(|c| c.is_ascii_digit())
                    .count()
                    == 3
                && !b.get(j + 4).is_some_and(u8::is_ascii_digit)
            {
                j += 4;
                continue;
            }
            if b.get(j) == Some(&b'.') && b.get(j + 1).is_some_and(u8::is_ascii_digit) {
                j += 1;
                continue;
            }
            if b.get(j) == Some(&b'/') && b.get(j + 1).is_some_and(u8::is_ascii_digit) {
                j += 1;
                continue;
            }
            break;
        }
        best = Some(text[start..j].to_string());
        i = j.max(i + 1);
    }
    best
}

/// Extracts the final answer of a response (see the module doc for the
/// order). `None` when the response contains no candidate at all.
pub fn extract_answer(response: &str) -> Option<Extracted> {
    let text = strip_think(response);
    if let Some(b) = last_boxed(text) {
        return Some(Extracted {
            text: b,
            method: ExtractMethod::Boxed,
        });
    }
    if let Some(h) = after_hashes(text) {
        return Some(Extracted {
            text: h,
            method: ExtractMethod::Hashes,
        });
    }
    if let Some(a) = answer_is(text) {
        return Some(Extracted {
            text: a,
            method: ExtractMethod::AnswerIs,
        });
    }
    last_number(&super::equiv::plain_thousands(text)).map(|n| Extracted {
        text: n,
        method: ExtractMethod::LastNumber,
    })
}

/// The reference answer of a gold field: the `#### N` of a GSM8K solution or
/// the last `\boxed{}` of a MATH solution when present, else the field
/// itself, trimmed.
pub fn gold_answer(field: &str) -> String {
    if let Some(b) = last_boxed(field) {
        return b;
    }
    if let Some(h) = after_hashes(field) {
        return h;
    }
    field.trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(s: &str) -> Option<(String, ExtractMethod)> {
        extract_answer(s).map(|e| (e.text, e.method))
    }

    #[test]
    fn boxed_with_nested_braces() {
        assert_eq!(
            ex("so $\\boxed{\\frac{1}{2}}$ and later \\boxed{\\dfrac{\\sqrt{3}}{4}}."),
            Some(("\\dfrac{\\sqrt{3}}{4}".into(), ExtractMethod::Boxed))
        );
        assert_eq!(last_boxed("\\boxed{\\{1,2\\}}").unwrap(), "\\{1,2\\}");
        assert_eq!(last_boxed("\\fbox{7}").unwrap(), "7");
        assert_eq!(last_boxed("$\\boxed 5$").unwrap(), "5");
        assert_eq!(last_boxed("\\boxed{unclosed"), None);
        // Boxed inside reasoning is ignored when there is a final part.
        assert_eq!(
            ex("<think>\\boxed{1}</think>The answer is 2."),
            Some(("2".into(), ExtractMethod::AnswerIs))
        );
    }

    #[test]
    fn hashes_answer_is_last_number() {
        assert_eq!(
            ex("She makes 9 * 2 = $18.\n#### 1,018"),
            Some(("1,018".into(), ExtractMethod::Hashes))
        );
        assert_eq!(
            ex("Thus the answer is $\\frac{3}{4}$. Done 7"),
            Some(("\\frac{3}{4}".into(), ExtractMethod::AnswerIs))
        );
        assert_eq!(
            ex("Final Answer: 3.25 dollars.\n"),
            Some(("3.25 dollars".into(), ExtractMethod::AnswerIs))
        );
        assert_eq!(
            ex("we get 12, then 1,250,000 and -3.5 units"),
            Some(("-3.5".into(), ExtractMethod::LastNumber))
        );
        assert_eq!(last_number("a 3/4 b").unwrap(), "3/4");
        assert_eq!(last_number("1,25").unwrap(), "25");
        assert_eq!(last_number("x=.5").unwrap(), ".5");
        assert_eq!(ex("no numbers"), None);
    }

    #[test]
    fn gold_fields() {
        assert_eq!(gold_answer("step\n#### 72"), "72");
        assert_eq!(gold_answer("so $\\boxed{2}$."), "2");
        assert_eq!(gold_answer(" \\frac{1}{2} "), "\\frac{1}{2}");
    }
}
