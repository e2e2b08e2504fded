//! Grades a JSONL of responses with the math grader, printing one JSON object
//! per row (the library side of `arbor grade --json`; used by
//! `scripts/math_verify_agreement.py`).
//!
//! ```text
//! cargo run --release -p arbor-env --example math_grade -- FILE.jsonl [RESPONSE_FIELD] [ANSWER_FIELD]
//! ```

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(file) = args.first() else {
        eprintln!("usage: math_grade FILE.jsonl [RESPONSE_FIELD] [ANSWER_FIELD]");
        std::process::exit(2);
    };
    let resp = args.get(1).map_or("response", String::as_str);
    let ans = args.get(2).map_or("answer", String::as_str);
    match arbor_env::math::grade_jsonl(std::path::Path::new(file), resp, ans) {
        Ok(rows) => {
            for r in rows {
                match serde_json::to_string(&r) {
                    Ok(s) => println!("{s}"),
                    Err(e) => {
                        eprintln!("error: {e}");
                        std::process::exit(1);
                    }
                }
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
