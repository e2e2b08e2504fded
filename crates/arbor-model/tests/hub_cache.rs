//! An HF model id resolves from the local HF cache with HF_HUB_OFFLINE=1
//! (its own test binary: it sets process environment variables).

mod common;

use arbor_model::{LoadOptions, LoadedModel, ModelFiles};
use common::{fixtures, read_json, u32s};

#[test]
fn model_id_resolves_offline_from_cache() {
    let home = tempfile::tempdir().unwrap();
    let repo = home.path().join("hub/models--arbor-test--tiny-qwen3");
    let snap = repo.join("snapshots/0123abcd");
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "0123abcd").unwrap();
    for f in std::fs::read_dir(fixtures().join("qwen3")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, snap.join(f.file_name().unwrap())).unwrap();
    }
    std::env::set_var("HF_HOME", home.path());
    std::env::set_var("HF_HUB_OFFLINE", "1");

    let files = ModelFiles::resolve("arbor-test/tiny-qwen3").unwrap();
    assert_eq!(
        files.weights.len(),
        8,
        "sharded checkpoint: {:?}",
        files.weights
    );
    let m = LoadedModel::load("arbor-test/tiny-qwen3", &LoadOptions::default()).unwrap();
    let r = read_json(fixtures().join("qwen3/reference.json"));
    let s = &r["sequences"][1];
    assert_eq!(
        m.score(&u32s(&s["tokens"])).unwrap().greedy,
        u32s(&s["greedy"])
    );

    // Not in the cache and offline: a clear error naming the id and the file.
    let e = ModelFiles::resolve("arbor-test/absent")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("arbor-test/absent")
            && e.contains("config.json")
            && e.contains("HF_HUB_OFFLINE"),
        "{e}"
    );
    // Neither a directory nor an id.
    let e = ModelFiles::resolve("./no/such/dir")
        .unwrap_err()
        .to_string();
    assert!(e.contains("./no/such/dir"), "{e}");
}
