//! The real Qwen3 chat template renders exactly what HF transformers renders
//! (fixtures from `scripts/make_fixtures.py`), and the real Qwen3 tokenizer
//! encodes exactly as HF does when ../shared/data is present.

mod common;

use arbor_model::{ChatOptions, ChatTemplate, Tokenizer};
use common::*;

fn opts(case: &serde_json::Value) -> ChatOptions {
    ChatOptions {
        add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
        enable_thinking: case
            .get("enable_thinking")
            .and_then(serde_json::Value::as_bool),
    }
}

#[test]
fn qwen3_template_matches_hf() {
    let t =
        ChatTemplate::from_tokenizer_config(fixtures().join("chat/tokenizer_config.json")).unwrap();
    let fx = read_json(fixtures().join("chat/qwen3_chat.json"));
    let cases = fx["cases"].as_array().unwrap();
    assert!(cases.len() >= 4);
    for case in cases {
        let tools = case.get("tools").filter(|t| !t.is_null());
        let got = t.render(&case["messages"], tools, &opts(case)).unwrap();
        let want = case["rendered"].as_str().unwrap();
        assert_eq!(got, want, "case {}", case["name"]);
    }
}

#[test]
fn qwen3_tokenizer_matches_hf() {
    // The tokenizer is not committed: it comes from the shared data.
    let Some(path) = arbor_env::data::shared_data(
        "tokenizers/qwen3/tokenizer.json",
        "qwen3_tokenizer_matches_hf",
    ) else {
        return;
    };
    let tok = Tokenizer::from_file(path).unwrap();
    let fx = read_json(fixtures().join("chat/qwen3_chat.json"));
    for case in fx["cases"].as_array().unwrap() {
        let ids = tok
            .encode(case["rendered"].as_str().unwrap(), false)
            .unwrap();
        assert_eq!(ids, u32s(&case["token_ids"]), "case {}", case["name"]);
        assert_eq!(
            tok.decode(&ids, false).unwrap(),
            case["rendered"].as_str().unwrap()
        );
    }
    for e in fx["encode"].as_array().unwrap() {
        assert_eq!(
            tok.encode(e["text"].as_str().unwrap(), true).unwrap(),
            u32s(&e["ids"]),
            "{}",
            e["text"]
        );
    }
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(151645));
}

/// Prefix Sampling's line cuts: the ids whose text holds a newline are
/// exactly those of the tokens that end a line in an encoded text.
#[test]
fn qwen3_line_end_ids_mark_newlines() {
    let Some(path) = arbor_env::data::shared_data(
        "tokenizers/qwen3/tokenizer.json",
        "qwen3_line_end_ids_mark_newlines",
    ) else {
        return;
    };
    let tok = Tokenizer::from_file(path).unwrap();
    let ends = tok.line_end_ids();
    assert!(ends.windows(2).all(|w| w[0] < w[1]), "ascending");
    let text = "Step 1: add.\n\nStep 2: carry the 1.\nSo the answer is 42.";
    let ids = tok.encode(text, false).unwrap();
    for &id in &ids {
        let holds = tok.decode(&[id], false).unwrap().contains('\n');
        assert_eq!(ends.binary_search(&id).is_ok(), holds, "id {id}");
    }
    assert_eq!(
        ids.iter().filter(|i| ends.binary_search(i).is_ok()).count(),
        2,
        "two line ends in {ids:?}"
    );
}

#[test]
fn missing_template_is_a_clear_error() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("tokenizer_config.json");
    std::fs::write(&p, r#"{"eos_token": "</s>"}"#).unwrap();
    let e = ChatTemplate::from_tokenizer_config(&p)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tokenizer_config.json") && e.contains("chat_template"),
        "{e}"
    );
}

/// `chat_template.jinja` (where recent transformers save the template)
/// takes precedence over `tokenizer_config.json`'s template and renders
/// with that file's special tokens; it works alone too. Neither file with a
/// template means no template; one that does not compile is an error
/// naming its file.
#[test]
fn chat_template_jinja_is_found_and_takes_precedence() {
    let d = tempfile::tempdir().unwrap();
    let cfg = d.path().join("tokenizer_config.json");
    std::fs::write(
        &cfg,
        r#"{"chat_template": "config says {{ messages[0].content }}", "bos_token": {"content": "<s>"}}"#,
    )
    .unwrap();
    let jinja = d.path().join("chat_template.jinja");
    std::fs::write(
        &jinja,
        "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}",
    )
    .unwrap();
    let msgs = serde_json::json!([{"role": "user", "content": "hi"}]);
    let render = |t: ChatTemplate| t.render(&msgs, None, &ChatOptions::default()).unwrap();
    let both = ChatTemplate::from_model_files(Some(&cfg), Some(&jinja)).unwrap();
    assert_eq!(render(both.unwrap()), "<s>[user] hi\n");
    let alone = ChatTemplate::from_model_files(None, Some(&jinja)).unwrap();
    assert_eq!(render(alone.unwrap()), "[user] hi\n");
    let config = ChatTemplate::from_model_files(Some(&cfg), None).unwrap();
    assert_eq!(render(config.unwrap()), "config says hi");

    let base = d.path().join("base_config.json");
    std::fs::write(&base, r#"{"eos_token": "</s>"}"#).unwrap();
    assert!(ChatTemplate::from_model_files(Some(&base), None)
        .unwrap()
        .is_none());
    assert!(ChatTemplate::from_model_files(None, None)
        .unwrap()
        .is_none());

    let broken = d.path().join("broken.jinja");
    std::fs::write(&broken, "{% for m in messages %}no end").unwrap();
    let e = ChatTemplate::from_model_files(Some(&cfg), Some(&broken))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("broken.jinja"), "{e}");
    let bad_cfg = d.path().join("bad_config.json");
    std::fs::write(&bad_cfg, r#"{"chat_template": "{% if %}"}"#).unwrap();
    let e = ChatTemplate::from_model_files(Some(&bad_cfg), None)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("bad_config.json") && e.contains("chat_template"),
        "{e}"
    );
}

/// A loaded model says whether it has no chat template or an unusable one
/// (naming the file), and loads either way.
#[test]
fn loaded_models_say_why_they_have_no_template() {
    let d = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixtures().join("qwen2").join(f), d.path().join(f)).unwrap();
    }
    let dir = d.path().to_str().unwrap();
    let load = || arbor_model::LoadedModel::load(dir, &Default::default()).unwrap();
    let e = load().chat_template().err().unwrap().to_string();
    assert!(
        e.contains("has none") && e.contains("chat_template.jinja"),
        "{e}"
    );
    std::fs::write(d.path().join("chat_template.jinja"), "{% if %}").unwrap();
    let e = load().chat_template().err().unwrap().to_string();
    assert!(
        e.contains("unusable") && e.contains("chat_template.jinja:"),
        "{e}"
    );
    assert_eq!(e.matches("chat template").count(), 1, "{e}");
    std::fs::write(
        d.path().join("chat_template.jinja"),
        "[{{ messages[0].content }}]",
    )
    .unwrap();
    let m = load();
    let msgs = serde_json::json!([{"role": "user", "content": "hi"}]);
    let t = m.chat_template().unwrap();
    assert_eq!(
        t.render(&msgs, None, &ChatOptions::default()).unwrap(),
        "[hi]"
    );
}
