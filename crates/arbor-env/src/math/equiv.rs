//! Answer normalisation and equivalence.
//!
//! [`normalize`] rewrites an answer string to a canonical form (one rule per
//! step, each unit-tested below); [`parse_answer`] reads the canonical form
//! into a structure (multiple-choice letter, text, expression, equation,
//! tuple / interval, set, union of intervals, matrix); [`equivalent`]
//! compares two answers: equal canonical strings, else structurally with
//! expressions compared numerically (see [`super::expr`]).

use std::sync::LazyLock;

use regex::Regex;

use super::expr::{numeric_equal, Expr};

/// A canonical answer string plus what normalisation removed that still
/// matters for comparison.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Normalized {
    /// The canonical text.
    pub text: String,
    /// A percent sign was removed (`50\%` may equal `50` or `0.5`).
    pub percent: bool,
}

fn re(s: &str) -> Regex {
    // The patterns are literals of this file; a typo is caught by the unit
    // tests, which exercise every one.
    Regex::new(s).unwrap_or_else(|e| panic!("bad built-in regex {s}: {e}"))
}

static TEXT_CMD: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mbox|operatorname)\s*\{([^{}]*)\}(\^\{?[23]\}?)?",
    )
});
static UNIT_WORDS: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"^(?P<num>[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:/\d+)?|[-+]?\\frac\{\d+\}\{\d+\})\s*(?P<unit>[A-Za-z][A-Za-z .]*?)\s*(?:\^\{?[23]\}?)?\.?$",
    )
});
static IN_PREFIX: LazyLock<Regex> = LazyLock::new(|| re(r"^[A-Za-z]\s*\\in\s*"));
static BRACED_SUB: LazyLock<Regex> = LazyLock::new(|| re(r"([_^])\{([0-9A-Za-z])\}"));
static THOUSANDS: LazyLock<Regex> = LazyLock::new(|| re(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$"));
/// A LaTeX thousands separator between digit groups: `{,}`, `,\!`, `,\,`,
/// `\,` or `\!` (optionally followed by spaces) before exactly 3 digits.
static LATEX_THOUSANDS: LazyLock<Regex> =
    LazyLock::new(|| re(r"(\d)(?:\{,\}|,\s*\\[!,]|\\[!,]),?\s*(\d{3})"));
static MIXED: LazyLock<Regex> = LazyLock::new(|| re(r"^(-?)(\d+)\\frac\{?(\d+)\}?\{?(\d+)\}?$"));
static CHOICE: LazyLock<Regex> = LazyLock::new(|| re(r"^\(?([A-E])\)?$"));
static WORDS: LazyLock<Regex> = LazyLock::new(|| re(r"^[A-Za-z][A-Za-z ]+$"));
static SIZED: LazyLock<Regex> =
    LazyLock::new(|| re(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big)\b"));

/// Canonicalises an answer string:
///
/// 1. trims and strips math delimiters (`$..$`, `\(..\)`, `\[..\]`);
/// 2. `\dfrac` / `\tfrac` -> `\frac`;
/// 3. drops `\left` / `\right` / `\big` sizing;
/// 4. drops spacing macros (`\!`, `\,`, `\;`, `\:`, `\quad`, `~`) and
///    `\displaystyle`;
/// 5. drops degrees (`^\circ`, `^{\circ}`, `°`);
/// 6. drops dollar signs (`\$`, `$`);
/// 7. drops a percent sign (`\%`, `%`), remembering it;
/// 8. `\text{...}`-style wrappers: a unit after a number (`5.4 \text{ cents}`,
///    `15\mbox{ cm}^2`) is dropped, otherwise the wrapper is unwrapped;
/// 9. bare unit words after a plain number (`18 dollars`) are dropped;
/// 10. drops a leading `x \in`;
/// 11. `_{5}` / `^{2}` -> `_5` / `^2`;
/// 12. removes whitespace (keeping one space between a command and a letter,
///     as in `\cot x`) and a trailing period;
/// 13. thousands separators (`10,080`, `10{,}080`, `10\,080`, `10\!080`
///     -> `10080`);
/// 14. mixed numbers (`1\frac{4}{5}` -> `1+\frac{4}{5}`);
/// 15. a leading `+`.
pub fn normalize(answer: &str) -> Normalized {
    let mut t = answer.trim().to_string();
    // 1. delimiters
    for (open, close) in [("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")] {
        if t.len() >= open.len() + close.len() && t.starts_with(open) && t.ends_with(close) {
            t = t[open.len()..t.len() - close.len()].trim().to_string();
        }
    }
    // 2. (and LaTeX thousands separators as plain commas)
    t = plain_thousands(&t);
    t = t.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac");
    // 3.
    t = t.replace("\\left.", "").replace("\\right.", "");
    t = SIZED.replace_all(&t, "").into_owned();
    // 4.
    t = drop_control_space(&t);
    for sp in [
        "\\displaystyle",
        "\\qquad",
        "\\quad",
        "\\!",
        "\\,",
        "\\;",
        "\\:",
    ] {
        t = t.replace(sp, "");
    }
    t = t.replace('~', " ");
    // 5.
    for deg in ["^{\\circ}", "^\\circ", "\\circ", "°", "\\degree"] {
        t = t.replace(deg, "");
    }
    // 6.
    t = t.replace("\\$", "").replace('$', "");
    // 7.
    let percent = t.contains('%');
    t = t.replace("\\%", "").replace('%', "");
    // 8.
    // Terminates: every round shortens `t`.
    while let Some(m) = TEXT_CMD.captures(&t) {
        let whole = m.get(0).map(|g| g.range()).unwrap_or(0..0);
        let inner = m.get(1).map_or("", |g| g.as_str()).to_string();
        let power = m.get(2).map_or("", |g| g.as_str()).to_string();
        let before = &t[..whole.start];
        let is_unit = before.chars().any(|c| c.is_ascii_digit() || c == '}')
            && inner
                .trim()
                .chars()
                .all(|c| c.is_ascii_alphabetic() || c == ' ' || c == '.')
            && !inner.trim().is_empty();
        let repl = if is_unit {
            String::new()
        } else {
            inner + &power
        };
        t.replace_range(whole, &repl);
    }
    // 9.
    let t2 = t.trim().to_string();
    if let Some(c) = UNIT_WORDS.captures(&t2) {
        let unit: String = c["unit"]
            .chars()
            .filter(char::is_ascii_alphabetic)
            .collect();
        if unit.len() >= 2 && !matches!(unit.as_str(), "pi" | "i") {
            t = c["num"].to_string();
        }
    }
    // 10.
    t = IN_PREFIX.replace(t.trim(), "").into_owned();
    // 11.
    t = BRACED_SUB.replace_all(&t, "$1$2").into_owned();
    // 12.
    t = squeeze_spaces(&t);
    while t.ends_with('.') {
        t.pop();
    }
    // 13.
    if THOUSANDS.is_match(&t) {
        t = t.replace(',', "");
    }
    // 14.
    if let Some(c) = MIXED.captures(&t) {
        let body = format!("{}+\\frac{{{}}}{{{}}}", &c[2], &c[3], &c[4]);
        t = if &c[1] == "-" {
            format!("-({body})")
        } else {
            body
        };
    }
    // 15.
    if let Some(rest) = t.strip_prefix('+') {
        t = rest.to_string();
    }
    Normalized { text: t, percent }
}

/// Writes LaTeX thousands separators between digit groups as plain
/// commas, as math-verify reads them: `1{,}000`, `1\,000`, `1\!000` and
/// `10,\!080` become `1,000`, `1,000`, `1,000` and `10,080` (which
/// [`normalize`]'s thousands rule and [`super::extract::last_number`] then
/// read as one number).
pub fn plain_thousands(s: &str) -> String {
    let mut t = s.to_string();
    // Each round rewrites the non-overlapping separators; adjacent groups
    // (`1{,}000{,}000`) share a digit, so repeat until none is left.
    loop {
        let next = LATEX_THOUSANDS.replace_all(&t, "$1,$2").into_owned();
        if next == t {
            return t;
        }
        t = next;
    }
}

/// Replaces the control space `\ ` by a space, leaving the row separator
/// `\\` of a matrix followed by a space alone.
fn drop_control_space(s: &str) -> String {
    let mut out = String::new();
    let mut run = 0usize;
    for c in s.chars() {
        if c == ' ' && run % 2 == 1 {
            out.pop();
        }
        run = if c == '\\' { run + 1 } else { 0 };
        out.push(c);
    }
    out
}

/// Removes whitespace except a single space between a command name and a
/// following letter (`\cot x`, `\pi r`).
fn squeeze_spaces(s: &str) -> String {
    let mut out = String::new();
    let chars: Vec<char> = s.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            let mut j = i;
            while j < chars.len() && chars[j].is_whitespace() {
                j += 1;
            }
            let next_letter = chars.get(j).is_some_and(char::is_ascii_alphabetic);
            if next_letter && ends_with_command(&out) {
                out.push(' ');
            }
            i = j;
            continue;
        }
        out.push(c);
        i += 1;
    }
    out
}

fn ends_with_command(s: &str) -> bool {
    let letters = s
        .chars()
        .rev()
        .take_while(char::is_ascii_alphabetic)
        .count();
    letters > 0 && s[..s.len() - letters].ends_with('\\')
}

/// The structure of a canonical answer.
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    /// A multiple-choice letter `A`-`E`.
    Choice(char),
    /// A word answer (lowercase, spaces removed).
    Text(String),
    /// A numeric or symbolic expression.
    Expr(Expr),
    /// An equation `lhs = rhs` (compared as `lhs - rhs` up to sign).
    Eq(Expr, Expr),
    /// A tuple or interval with its brackets.
    Tuple {
        open: char,
        close: char,
        items: Vec<Answer>,
    },
    /// An unordered set (`\{..\}`, a bare comma list, `a \pm b`).
    Set(Vec<Answer>),
    /// A union of intervals.
    Union(Vec<Answer>),
    /// A matrix (a column vector is `n x 1`).
    Matrix(Vec<Vec<Answer>>),
    /// Anything else: compared as canonical text.
    Raw(String),
}

/// Splits at top-level occurrences of `sep` (outside `()[]{}`).
fn split_top(s: &str, sep: &str) -> Vec<String> {
    let mut parts = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' => depth -= 1,
            _ => {}
        }
        if depth == 0 && s[i..].starts_with(sep) && s.is_char_boundary(i) {
            parts.push(s[start..i].to_string());
            i += sep.len();
            start = i;
            continue;
        }
        i += 1;
    }
    parts.push(s[start..].to_string());
    parts
}

/// True when the first bracket of `s` closes at its last character.
fn outer_pair(s: &str) -> bool {
    let b = s.as_bytes();
    let mut depth = 0i32;
    for (i, &c) in b.iter().enumerate() {
        match c {
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' => depth -= 1,
            _ => {}
        }
        if depth == 0 {
            return i == b.len() - 1;
        }
    }
    false
}

fn is_variable(s: &str) -> bool {
    let s = s.trim();
    (s.len() == 1 && s.chars().all(|c| c.is_ascii_alphabetic()))
        || (s.starts_with('\\') && s[1..].chars().all(|c| c.is_ascii_alphabetic()) && s.len() > 2)
}

/// Reads a canonical answer (the `text` of [`normalize`]) into its
/// structure.
pub fn parse_answer(t: &str) -> Answer {
    let t = t.trim();
    if let Some(c) = CHOICE.captures(t) {
        return Answer::Choice(c[1].chars().next().unwrap_or('A'));
    }
    for env in ["pmatrix", "bmatrix", "vmatrix", "matrix"] {
        let open = format!("\\begin{{{env}}}");
        let close = format!("\\end{{{env}}}");
        if let Some(body) = t.strip_prefix(&open).and_then(|r| r.strip_suffix(&close)) {
            let rows = body
                .split("\\\\")
                .filter(|r| !r.trim().is_empty())
                .map(|r| r.split('&').map(|c| parse_answer(c.trim())).collect())
                .collect();
            return Answer::Matrix(rows);
        }
    }
    let union = split_top(t, "\\cup");
    if union.len() > 1 {
        return Answer::Union(union.iter().map(|p| parse_answer(p)).collect());
    }
    if let Some(inner) = t.strip_prefix("\\{").and_then(|r| r.strip_suffix("\\}")) {
        return Answer::Set(flatten(
            split_top(inner, ",").iter().map(|p| parse_answer(p)),
        ));
    }
    let first = t.chars().next().unwrap_or(' ');
    let last = t.chars().last().unwrap_or(' ');
    if matches!(first, '(' | '[') && matches!(last, ')' | ']') && outer_pair(t) {
        let items = split_top(&t[1..t.len() - 1], ",");
        if items.len() > 1 {
            return Answer::Tuple {
                open: first,
                close: last,
                items: items.iter().map(|p| parse_answer(p)).collect(),
            };
        }
    }
    let list = split_top(t, ",");
    if list.len() > 1 {
        return Answer::Set(flatten(list.iter().map(|p| parse_answer(p))));
    }
    for pm in ["\\pm", "\\mp"] {
        let parts = split_top(t, pm);
        if parts.len() == 2 {
            let plus = parse_answer(&format!("{}+{}", parts[0], parts[1]));
            let minus = parse_answer(&format!("{}-({})", parts[0], parts[1]));
            return Answer::Set(vec![plus, minus]);
        }
    }
    let eq = split_top(t, "=");
    if eq.len() == 2 {
        if is_variable(&eq[0]) && !eq[1].is_empty() {
            return parse_answer(&eq[1]);
        }
        if let (Some(l), Some(r)) = (Expr::parse(&eq[0]), Expr::parse(&eq[1])) {
            return Answer::Eq(l, r);
        }
    }
    if WORDS.is_match(t) && t.chars().filter(char::is_ascii_alphabetic).count() >= 3 {
        return Answer::Text(t.to_lowercase().replace(' ', ""));
    }
    match Expr::parse(t) {
        Some(e) => Answer::Expr(e),
        None => Answer::Raw(t.to_string()),
    }
}

fn flatten(items: impl Iterator<Item = Answer>) -> Vec<Answer> {
    let mut out = Vec::new();
    for a in items {
        match a {
            Answer::Set(inner) => out.extend(inner),
            other => out.push(other),
        }
    }
    out
}

/// Structural comparison; `scales` are the factors tried for `b`'s value
/// (percentages).
fn same(a: &Answer, b: &Answer, scales: &[f64]) -> bool {
    use Answer::*;
    match (a, b) {
        (Choice(x), Choice(y)) => x == y,
        (Text(x), Text(y)) => x == y,
        (Raw(x), Raw(y)) => x == y,
        (Text(x), Raw(y)) | (Raw(y), Text(x)) => *x == y.to_lowercase(),
        (Expr(x), Expr(y)) => scales.iter().any(|&s| numeric_equal(x, y, s)),
        (Eq(l1, r1), Eq(l2, r2)) => {
            let d1 = super::expr::Expr::Sub(Box::new(l1.clone()), Box::new(r1.clone()));
            let d2 = super::expr::Expr::Sub(Box::new(l2.clone()), Box::new(r2.clone()));
            numeric_equal(&d1, &d2, 1.0) || numeric_equal(&d1, &d2, -1.0)
        }
        (
            Tuple {
                open: o1,
                close: c1,
                items: i1,
            },
            Tuple {
                open: o2,
                close: c2,
                items: i2,
            },
        ) => {
            o1 == o2
                && c1 == c2
                && i1.len() == i2.len()
                && i1.iter().zip(i2).all(|(x, y)| same(x, y, &[1.0]))
        }
        (Set(x), Set(y)) | (Union(x), Union(y)) => matching(x, y),
        (Matrix(x), Matrix(y)) => {
            x.len() == y.len()
                && x.iter().zip(y).all(|(r1, r2)| {
                    r1.len() == r2.len() && r1.iter().zip(r2).all(|(p, q)| same(p, q, &[1.0]))
                })
        }
        _ => false,
    }
}

/// A perfect matching between two small multisets.
fn matching(x: &[Answer], y: &[Answer]) -> bool {
    fn go(x: &[Answer], y: &[Answer], used: &mut [bool]) -> bool {
        let Some((first, rest)) = x.split_first() else {
            return true;
        };
        for j in 0..y.len() {
            if !used[j] && same(first, &y[j], &[1.0]) {
                used[j] = true;
                if go(rest, y, used) {
                    return true;
                }
                used[j] = false;
            }
        }
        false
    }
    x.len() == y.len() && x.len() <= 16 && go(x, y, &mut vec![false; y.len()])
}

/// True when the predicted answer `pred` is equivalent to the reference
/// `gold` (both as written, e.g. extracted from `\boxed{}`).
pub fn equivalent(pred: &str, gold: &str) -> bool {
    let p = normalize(pred);
    let g = normalize(gold);
    if p.text.is_empty() || g.text.is_empty() {
        return false;
    }
    if p.text == g.text {
        return true;
    }
    let scales: &[f64] = if p.percent || g.percent {
        if g.percent {
            &[1.0, 0.01]
        } else {
            &[1.0, 100.0]
        }
    } else {
        &[1.0]
    };
    same(&parse_answer(&p.text), &parse_answer(&g.text), scales)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(s: &str) -> String {
        normalize(s).text
    }

    // One test per normalisation rule, in the order of `normalize`.
    #[test]
    fn rule_01_delimiters() {
        assert_eq!(n(" $5$ "), "5");
        assert_eq!(n("\\(x+1\\)"), "x+1");
        assert_eq!(n("\\[\\frac12\\]"), "\\frac12");
    }

    #[test]
    fn rule_02_frac_variants() {
        assert_eq!(n("\\dfrac{17}{50}"), "\\frac{17}{50}");
        assert_eq!(n("\\tfrac12"), "\\frac12");
        assert!(equivalent("\\dfrac{3}{4}", "3/4"));
    }

    #[test]
    fn rule_03_sizing() {
        assert_eq!(
            n("\\left( 3, \\frac{\\pi}{2} \\right)"),
            "(3,\\frac{\\pi}{2})"
        );
        assert_eq!(n("\\left\\{1,2\\right\\}"), "\\{1,2\\}");
        assert_eq!(n("\\Big(1\\Big)"), "(1)");
        assert_eq!(n("x\\rightarrow y"), "x\\rightarrow y");
    }

    #[test]
    fn rule_04_spacing() {
        assert_eq!(n("10,\\!080"), "10080");
        assert_eq!(n("1\\,000"), "1000");
        assert_eq!(n("\\displaystyle 2"), "2");
        assert_eq!(n("1\\ 000"), "1000");
        assert_eq!(n("a\\\\ b"), "a\\\\b");
    }

    #[test]
    fn rule_05_degrees() {
        assert_eq!(n("106^\\circ"), "106");
        assert_eq!(n("30^{\\circ}"), "30");
        assert_eq!(n("45°"), "45");
    }

    #[test]
    fn rule_06_dollars() {
        assert_eq!(n("\\$18.90"), "18.90");
        assert!(equivalent("$18.9", "\\$18.90"));
    }

    #[test]
    fn rule_07_percent() {
        let p = normalize("50\\%");
        assert_eq!(p.text, "50");
        assert!(p.percent);
        assert!(equivalent("50\\%", "50"));
        assert!(equivalent("0.5", "50\\%"));
        assert!(equivalent("50%", "0.5"));
        assert!(!equivalent("51%", "50"));
    }

    #[test]
    fn rule_08_text_and_units() {
        assert_eq!(n("5.4 \\text{ cents}"), "5.4");
        assert_eq!(n("15\\mbox{ cm}^2"), "15");
        assert_eq!(n("\\frac{270}7\\text{ degrees}"), "\\frac{270}7");
        assert_eq!(n("\\text{(B)}"), "(B)");
        assert_eq!(n("\\text{Evelyn}"), "Evelyn");
        assert_eq!(n("\\textbf{east}"), "east");
    }

    #[test]
    fn rule_09_bare_units() {
        assert_eq!(n("18 dollars"), "18");
        assert_eq!(n("1,250 square feet"), "1250");
        assert_eq!(n("5 cm^2"), "5");
        assert_eq!(n("2 pi"), "2pi");
        assert_eq!(n("3 i"), "3i");
    }

    #[test]
    fn rule_10_in_prefix() {
        assert_eq!(n("x \\in [-2,7]"), "[-2,7]");
    }

    #[test]
    fn rule_11_braced_subscripts() {
        assert_eq!(n("4210_{5}"), "4210_5");
        assert!(equivalent("204_{5}", "204_5"));
        assert_eq!(n("x^{2}"), "x^2");
    }

    #[test]
    fn rule_12_whitespace_and_period() {
        assert_eq!(n("\\cot  x"), "\\cot x");
        assert_eq!(n("3 \\sqrt{5} ."), "3\\sqrt{5}");
        assert_eq!(n("x ^ 2 + 1"), "x^2+1");
    }

    #[test]
    fn rule_13_thousands() {
        assert_eq!(n("11,\\! 111,\\! 111,\\! 100"), "11111111100");
        assert_eq!(n("-1,234.5"), "-1234.5");
        assert_eq!(n("1,-2"), "1,-2");
        assert_eq!(n("12,34"), "12,34");
        // LaTeX separators, as math-verify reads them.
        assert_eq!(n("1{,}000"), "1000");
        assert_eq!(n("12{,}345{,}678"), "12345678");
        assert_eq!(n("1\\,000\\,000"), "1000000");
        assert_eq!(n("1\\!000"), "1000");
        assert_eq!(n("10,\\,080.5"), "10080.5");
        // Not a thousands group: left alone.
        assert_eq!(n("(1{,}2)"), "(1{,}2)");
        assert_eq!(n("x\\,y"), "xy");
    }

    #[test]
    fn latex_thousands_separators_grade_as_plain_numbers() {
        for r in [
            "The total is $\\boxed{1{,}000}$.",
            "\\boxed{1\\,000}",
            "\\boxed{1\\!000}",
            "so we get 1{,}000 in all",
            "so we get 1\\,000 in all",
        ] {
            let g = super::super::grade(r, "1000");
            assert!(g.correct, "{r}: extracted {:?}", g.extracted);
        }
        assert!(!super::super::grade("\\boxed{1{,}001}", "1000").correct);
    }

    #[test]
    fn rule_14_mixed_numbers() {
        assert_eq!(n("1\\frac{4}{5}"), "1+\\frac{4}{5}");
        assert!(equivalent("137 \\frac{1}{2}", "137.5"));
        assert!(equivalent("-2\\frac12", "-2.5"));
    }

    #[test]
    fn rule_15_leading_plus() {
        assert_eq!(n("+7"), "7");
    }

    #[test]
    fn integers_decimals_fractions() {
        assert!(equivalent("1,018", "1018"));
        assert!(!equivalent(
            "11,\\! 111,\\! 111,\\! 101",
            "11,\\! 111,\\! 111,\\! 100"
        ));
        assert!(equivalent("0.15", "\\frac{3}{20}"));
        assert!(equivalent(".35625", "0.35625"));
        assert!(equivalent("\\frac{1}{3}", "1/3"));
        assert!(equivalent("2.0", "2"));
        assert!(!equivalent("0.33", "\\frac13"));
        assert!(!equivalent("3", "4"));
    }

    #[test]
    fn radicals_and_pi() {
        assert!(equivalent("2\\sqrt{5}", "\\sqrt{20}"));
        assert!(equivalent("\\frac{\\sqrt{3}}{3}", "\\frac{1}{\\sqrt{3}}"));
        assert!(equivalent("11\\sqrt2", "11 \\sqrt{2}"));
        assert!(equivalent("12\\pi", "\\pi \\cdot 12"));
        assert!(equivalent("\\frac{20000}{\\pi}", "20000/\\pi"));
        assert!(!equivalent("\\sqrt{5}", "\\sqrt{6}"));
    }

    #[test]
    fn tuples_intervals_sets() {
        assert!(equivalent("(-1, 6)", "\\left(-1,6\\right)"));
        assert!(!equivalent("(6,-1)", "(-1,6)"));
        assert!(equivalent("(3,4]", "\\left(3,4\\right]"));
        assert!(!equivalent("[3,4]", "(3,4]"));
        assert!(equivalent("(-\\infty,0]", "(-\\infty, 0]"));
        assert!(equivalent(
            "(3,\\infty)\\cup(-\\infty,2)",
            "(-\\infty, 2) \\cup (3, \\infty)"
        ));
        assert!(equivalent(
            "\\{-2, 1+\\sqrt5, 1-\\sqrt5\\}",
            "\\{1\\pm\\sqrt{5},-2\\}"
        ));
        assert!(equivalent("1,-2", "-2,1"));
        assert!(equivalent(
            "1-\\sqrt{19}, 1+\\sqrt{19}",
            "1 \\pm \\sqrt{19}"
        ));
        assert!(equivalent(
            "(\\frac{3}{2}, -13)",
            "\\left( \\frac{3}{2}, -13 \\right)"
        ));
        assert!(equivalent(
            "\\begin{pmatrix}-1/3\\\\2/3\\\\5/3\\end{pmatrix}",
            "\\begin{pmatrix} -\\frac13 \\\\ \\frac23 \\\\ \\frac53 \\end{pmatrix}"
        ));
        assert!(!equivalent(
            "\\begin{pmatrix}1\\\\2\\end{pmatrix}",
            "\\begin{pmatrix}2\\\\1\\end{pmatrix}"
        ));
    }

    #[test]
    fn equations_and_expressions() {
        assert!(equivalent("x=5", "5"));
        assert!(equivalent("2x+3", "y = 2x + 3"));
        assert!(equivalent("5x-7y+11z=-4", "5x - 7y + 11z + 4 = 0"));
        assert!(equivalent("x^3+3x-6", "3x - 6 + x^3"));
        assert!(equivalent("-2 + 7i", "7i-2"));
        assert!(equivalent("\\cot x", "\\frac{\\cos x}{\\sin x}"));
        assert!(!equivalent("2k", "2k+2"));
    }

    #[test]
    fn choices_and_text() {
        assert!(equivalent("(C)", "\\text{(C)}"));
        assert!(equivalent("C", "\\text{(C)}"));
        assert!(!equivalent("B", "\\text{(C)}"));
        assert!(equivalent("East", "\\text{east}"));
        assert!(equivalent("\\text{Navin}", "Navin"));
        assert!(!equivalent("odd", "\\text{even}"));
        assert!(!equivalent("", "5"));
    }
}
