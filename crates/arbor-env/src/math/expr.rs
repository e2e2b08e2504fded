//! A small LaTeX expression parser and evaluator, enough to compare answers
//! numerically: numbers, `+ - * /`, `\cdot \times \div`, implicit
//! multiplication (`2\sqrt{3}`, `(a+5)(b+2)`, `12\pi`), powers (`x^2`,
//! `x^{n+1}`), `\frac{a}{b}` (also `\frac 34`, `\frac9{19}`), `\sqrt{x}`,
//! `\sqrt[n]{x}`, `\pi`, `\infty`, factorials, the usual functions
//! (`\sin`, `\cos`, `\tan`, `\cot`, `\sec`, `\csc`, `\ln`, `\log`, `\exp`
//! and the arc forms), and variables (single letters, Greek letters).
//!
//! Two expressions are compared by evaluating them at fixed pseudo-random
//! assignments of their variables ([`numeric_equal`]); polynomials and
//! rational functions written differently (`x^3+3x-6` vs `3x+x^3-6`) agree
//! at every point, different ones almost surely do not.

use std::collections::BTreeSet;

/// A parsed expression.
#[derive(Clone, Debug, PartialEq)]
pub enum Expr {
    /// A number.
    Num(f64),
    /// A variable.
    Var(String),
    /// `a + b`.
    Add(Box<Expr>, Box<Expr>),
    /// `a - b`.
    Sub(Box<Expr>, Box<Expr>),
    /// `a * b`.
    Mul(Box<Expr>, Box<Expr>),
    /// `a / b`.
    Div(Box<Expr>, Box<Expr>),
    /// `a ^ b`.
    Pow(Box<Expr>, Box<Expr>),
    /// `-a`.
    Neg(Box<Expr>),
    /// `a!`.
    Fact(Box<Expr>),
    /// A named function of one argument.
    Func(&'static str, Box<Expr>),
}

const FUNCS: [&str; 14] = [
    "sin", "cos", "tan", "cot", "sec", "csc", "ln", "log", "exp", "arcsin", "arccos", "arctan",
    "sinh", "cosh",
];

const GREEK: [&str; 18] = [
    "alpha", "beta", "gamma", "delta", "epsilon", "theta", "lambda", "mu", "nu", "rho", "sigma",
    "tau", "phi", "omega", "varphi", "psi", "chi", "eta",
];

impl Expr {
    /// Parses `s`; `None` when it is not an expression this grammar reads.
    pub fn parse(s: &str) -> Option<Expr> {
        let mut p = Parser {
            c: s.chars().collect(),
            i: 0,
        };
        let e = p.expr()?;
        p.ws();
        (p.i == p.c.len()).then_some(e)
    }

    /// The variables the expression mentions.
    pub fn vars(&self) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        self.collect(&mut out);
        out
    }

    fn collect(&self, out: &mut BTreeSet<String>) {
        match self {
            Expr::Num(_) => {}
            Expr::Var(v) => {
                out.insert(v.clone());
            }
            Expr::Add(a, b)
            | Expr::Sub(a, b)
            | Expr::Mul(a, b)
            | Expr::Div(a, b)
            | Expr::Pow(a, b) => {
                a.collect(out);
                b.collect(out);
            }
            Expr::Neg(a) | Expr::Fact(a) | Expr::Func(_, a) => a.collect(out),
        }
    }

    /// Evaluates with `var` giving each variable's value.
    pub fn eval(&self, var: &dyn Fn(&str) -> f64) -> f64 {
        match self {
            Expr::Num(x) => *x,
            Expr::Var(v) => var(v),
            Expr::Add(a, b) => a.eval(var) + b.eval(var),
            Expr::Sub(a, b) => a.eval(var) - b.eval(var),
            Expr::Mul(a, b) => a.eval(var) * b.eval(var),
            Expr::Div(a, b) => a.eval(var) / b.eval(var),
            Expr::Pow(a, b) => {
                let (x, y) = (a.eval(var), b.eval(var));
                if x < 0.0 && y.fract() != 0.0 {
                    // Odd roots of negatives: (-8)^(1/3) = -2.
                    let inv = 1.0 / y;
                    if (inv.round() - inv).abs() < 1e-9 && (inv.round() as i64) % 2 != 0 {
                        return -(-x).powf(y);
                    }
                }
                x.powf(y)
            }
            Expr::Neg(a) => -a.eval(var),
            Expr::Fact(a) => {
                let n = a.eval(var);
                if n >= 0.0 && n.fract() == 0.0 && n <= 170.0 {
                    (1..=n as u64).map(|k| k as f64).product()
                } else {
                    f64::NAN
                }
            }
            Expr::Func(f, a) => {
                let x = a.eval(var);
                match *f {
                    "sin" => x.sin(),
                    "cos" => x.cos(),
                    "tan" => x.tan(),
                    "cot" => 1.0 / x.tan(),
                    "sec" => 1.0 / x.cos(),
                    "csc" => 1.0 / x.sin(),
                    "ln" => x.ln(),
                    "log" => x.log10(),
                    "exp" => x.exp(),
                    "arcsin" => x.asin(),
                    "arccos" => x.acos(),
                    "arctan" => x.atan(),
                    "sinh" => x.sinh(),
                    "cosh" => x.cosh(),
                    _ => f64::NAN,
                }
            }
        }
    }
}

/// The value of variable `name` at assignment `k` (deterministic,
/// irrational-looking values in (0.5, 2.5), different per name).
pub fn assignment(name: &str, k: usize) -> f64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ (k as u64).wrapping_mul(0x9E37_79B9);
    for b in name.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    let mut r = crate::synthetic::SplitMix64::new(h);
    0.5 + 2.0 * (r.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// True when two floats agree: exactly when both are integers (below 2^53)
/// or infinite, else to a relative 1e-6.
pub fn close(a: f64, b: f64) -> bool {
    if a.is_nan() || b.is_nan() {
        return false;
    }
    if a.is_infinite() || b.is_infinite() {
        return a == b;
    }
    let exact = |x: f64| x.fract() == 0.0 && x.abs() < 9.0e15;
    if exact(a) && exact(b) {
        return a == b;
    }
    (a - b).abs() <= 1e-6 * a.abs().max(b.abs()) + 1e-12
}

/// True when `a` and `b` take the same value at three assignments of their
/// variables (`scale` multiplies `b`, for percentage comparisons).
pub fn numeric_equal(a: &Expr, b: &Expr, scale: f64) -> bool {
    let mut vars = a.vars();
    vars.extend(b.vars());
    let rounds = if vars.is_empty() { 1 } else { 3 };
    (0..rounds).all(|k| {
        let f = |v: &str| assignment(v, k);
        close(a.eval(&f), b.eval(&f) * scale)
    })
}

struct Parser {
    c: Vec<char>,
    i: usize,
}

impl Parser {
    fn ws(&mut self) {
        while self.c.get(self.i).is_some_and(|c| c.is_whitespace()) {
            self.i += 1;
        }
    }

    fn peek(&mut self) -> Option<char> {
        self.ws();
        self.c.get(self.i).copied()
    }

    fn eat(&mut self, ch: char) -> bool {
        if self.peek() == Some(ch) {
            self.i += 1;
            true
        } else {
            false
        }
    }

    /// The command name at the cursor (`\frac` -> `frac`) without consuming.
    fn command(&mut self) -> Option<String> {
        if self.peek() != Some('\\') {
            return None;
        }
        let name: String = self.c[self.i + 1..]
            .iter()
            .take_while(|c| c.is_ascii_alphabetic())
            .collect();
        (!name.is_empty()).then_some(name)
    }

    fn expr(&mut self) -> Option<Expr> {
        let mut e = self.term()?;
        loop {
            if self.eat('+') {
                e = Expr::Add(Box::new(e), Box::new(self.term()?));
            } else if self.eat('-') {
                e = Expr::Sub(Box::new(e), Box::new(self.term()?));
            } else {
                return Some(e);
            }
        }
    }

    fn term(&mut self) -> Option<Expr> {
        let mut e = self.unary()?;
        loop {
            if self.eat('*') {
                e = Expr::Mul(Box::new(e), Box::new(self.unary()?));
            } else if self.eat('/') {
                e = Expr::Div(Box::new(e), Box::new(self.unary()?));
            } else if let Some(cmd) = self.command() {
                match cmd.as_str() {
                    "cdot" | "times" => {
                        self.i += 1 + cmd.len();
                        e = Expr::Mul(Box::new(e), Box::new(self.unary()?));
                    }
                    "div" => {
                        self.i += 1 + cmd.len();
                        e = Expr::Div(Box::new(e), Box::new(self.unary()?));
                    }
                    _ if self.starts_atom() => {
                        e = Expr::Mul(Box::new(e), Box::new(self.power()?));
                    }
                    _ => return Some(e),
                }
            } else if self.starts_atom() {
                // Implicit multiplication binds like `*`.
                e = Expr::Mul(Box::new(e), Box::new(self.power()?));
            } else {
                return Some(e);
            }
        }
    }

    fn starts_atom(&mut self) -> bool {
        match self.peek() {
            Some(c)
                if c.is_ascii_alphanumeric() || c == '.' || c == '(' || c == '{' || c == '[' =>
            {
                true
            }
            Some('\\') => self.command().is_some_and(|c| {
                matches!(c.as_str(), "frac" | "sqrt" | "pi" | "infty")
                    || FUNCS.contains(&c.as_str())
                    || GREEK.contains(&c.as_str())
            }),
            _ => false,
        }
    }

    fn unary(&mut self) -> Option<Expr> {
        if self.eat('-') {
            return Some(Expr::Neg(Box::new(self.unary()?)));
        }
        if self.eat('+') {
            return self.unary();
        }
        self.power()
    }

    fn power(&mut self) -> Option<Expr> {
        let mut base = self.atom()?;
        while self.eat('!') {
            base = Expr::Fact(Box::new(base));
        }
        if self.eat('^') {
            let exp = if self.peek() == Some('-') {
                self.i += 1;
                Expr::Neg(Box::new(self.arg()?))
            } else {
                self.arg()?
            };
            return Some(Expr::Pow(Box::new(base), Box::new(exp)));
        }
        Some(base)
    }

    /// A macro argument: `{expr}` or a single character / command.
    fn arg(&mut self) -> Option<Expr> {
        match self.peek()? {
            '{' => {
                self.i += 1;
                let e = self.expr()?;
                self.eat('}').then_some(e)
            }
            c if c.is_ascii_digit() => {
                self.i += 1;
                Some(Expr::Num(f64::from(c.to_digit(10)?)))
            }
            c if c.is_ascii_alphabetic() => {
                self.i += 1;
                Some(Expr::Var(c.to_string()))
            }
            '\\' => self.atom(),
            '(' => self.atom(),
            _ => None,
        }
    }

    fn number(&mut self) -> Option<Expr> {
        let start = self.i;
        while self
            .c
            .get(self.i)
            .is_some_and(|c| c.is_ascii_digit() || *c == '.')
        {
            self.i += 1;
        }
        let s: String = self.c[start..self.i].iter().collect();
        s.parse().ok().map(Expr::Num)
    }

    fn atom(&mut self) -> Option<Expr> {
        match self.peek()? {
            c if c.is_ascii_digit() || c == '.' => self.number(),
            c if c.is_ascii_alphabetic() => {
                self.i += 1;
                Some(Expr::Var(c.to_string()))
            }
            open @ ('(' | '{' | '[') => {
                self.i += 1;
                let e = self.expr()?;
                let close = match open {
                    '(' => ')',
                    '{' => '}',
                    _ => ']',
                };
                self.eat(close).then_some(e)
            }
            '\\' => {
                let cmd = self.command()?;
                self.i += 1 + cmd.len();
                match cmd.as_str() {
                    "frac" => {
                        let a = self.arg()?;
                        let b = self.arg()?;
                        Some(Expr::Div(Box::new(a), Box::new(b)))
                    }
                    "sqrt" => {
                        if self.eat('[') {
                            let n = self.expr()?;
                            if !self.eat(']') {
                                return None;
                            }
                            let x = self.arg()?;
                            Some(Expr::Pow(
                                Box::new(x),
                                Box::new(Expr::Div(Box::new(Expr::Num(1.0)), Box::new(n))),
                            ))
                        } else {
                            Some(Expr::Pow(Box::new(self.arg()?), Box::new(Expr::Num(0.5))))
                        }
                    }
                    "pi" => Some(Expr::Num(std::f64::consts::PI)),
                    "infty" | "inf" => Some(Expr::Num(f64::INFINITY)),
                    g if GREEK.contains(&g) => Some(Expr::Var(cmd.clone())),
                    f => {
                        let name = FUNCS.iter().find(|n| **n == f)?;
                        // `\sin^2 x` = (sin x)^2.
                        let pow = if self.eat('^') {
                            Some(self.arg()?)
                        } else {
                            None
                        };
                        let x = self.power()?;
                        let e = Expr::Func(name, Box::new(x));
                        Some(match pow {
                            Some(p) => Expr::Pow(Box::new(e), Box::new(p)),
                            None => e,
                        })
                    }
                }
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn val(s: &str) -> f64 {
        Expr::parse(s)
            .unwrap_or_else(|| panic!("parse {s}"))
            .eval(&|_| f64::NAN)
    }

    fn same(a: &str, b: &str) -> bool {
        numeric_equal(&Expr::parse(a).unwrap(), &Expr::parse(b).unwrap(), 1.0)
    }

    #[test]
    fn arithmetic_and_macros() {
        assert_eq!(val("1+2*3"), 7.0);
        assert_eq!(val("2^{3+1}"), 16.0);
        assert_eq!(val("2^-1"), 0.5);
        assert_eq!(val("-2^2"), -4.0);
        assert_eq!(val("\\frac{1}{2}"), 0.5);
        assert_eq!(val("\\frac 34"), 0.75);
        assert_eq!(val("\\frac9{19}"), 9.0 / 19.0);
        assert_eq!(val("\\frac{\\sqrt{3}}{3}"), 3f64.sqrt() / 3.0);
        assert_eq!(val("11\\sqrt2"), 11.0 * 2f64.sqrt());
        assert_eq!(val("\\sqrt[3]{-8}"), -2.0);
        assert_eq!(val("12\\pi"), 12.0 * std::f64::consts::PI);
        assert_eq!(val("2(3+1)"), 8.0);
        assert_eq!(val("5!"), 120.0);
        assert_eq!(val(".5"), 0.5);
        assert_eq!(val("3\\cdot4\\div2"), 6.0);
        assert_eq!(val("-\\infty"), f64::NEG_INFINITY);
        assert!((val("\\cos\\pi") + 1.0).abs() < 1e-12);
        assert!((val("\\sin^2 1+\\cos^2 1") - 1.0).abs() < 1e-12);
    }

    #[test]
    fn variables_compare_by_evaluation() {
        assert!(same("x^3+3x-6", "3x+x^3-6"));
        assert!(same("(a+5)(b+2)", "ab+2a+5b+10"));
        assert!(!same("2k+2", "2k+1"));
        assert!(same("-2+7i", "7i-2"));
        assert!(same("\\frac{11+9a}{20}", "\\frac{11}{20}+\\frac{9a}{20}"));
        assert!(!same("x^2", "x^3"));
        assert!(same("\\theta+1", "1+\\theta"));
        assert_eq!(Expr::parse("x+y").unwrap().vars().len(), 2);
    }

    #[test]
    fn rejects_what_it_cannot_read() {
        for s in [
            "",
            "1+",
            "(1",
            "\\frac{1}",
            "204_5",
            "\\foo{1}",
            "1,2",
            "a=b",
        ] {
            assert!(Expr::parse(s).is_none(), "{s}");
        }
        assert!(close(1.0, 1.0 + 1e-9));
        assert!(!close(11111111100.0, 11111111101.0));
        assert!(!close(1234567.0, 1234568.0));
        assert!(!close(1.0, 1.001));
        assert!(!close(f64::NAN, f64::NAN));
    }
}
