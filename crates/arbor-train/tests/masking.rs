//! Masking end to end, from a rollout tree through `arbor_rl::loss_rows` to
//! the parameter update: prompt (conditioning), observation / tool-output
//! and replayed-prefix tokens get zero gradient; action and
//! context-management (compaction summary) tokens get gradient.

use arbor_model::{Arch, CriticMode, ModelConfig, RopeScaling};
use arbor_rl::credit::{loss_rows, EdgeTokens, LossRow, Sharing};
use arbor_rl::{RolloutTree, Segment, Step, TokenKind};
use arbor_train::learner::{Learner, LearnerConfig};
use arbor_train::optim::AdamWConfig;
use candle_core::Device;

fn cfg() -> ModelConfig {
    ModelConfig {
        arch: Arch::Qwen3,
        vocab_size: 24,
        hidden_size: 16,
        intermediate_size: 32,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        head_dim: 8,
        rms_norm_eps: 1e-6,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::Default,
        max_position_embeddings: 64,
        tie_word_embeddings: false,
        qkv_bias: false,
        o_bias: false,
        qk_norm: true,
        torch_dtype: None,
        bos_token_id: None,
        eos_token_ids: vec![],
    }
}

/// One trajectory: prompt, then a segment with every token kind.
fn rows() -> (Vec<LossRow>, Vec<TokenKind>) {
    let mut tree = RolloutTree::new();
    let root = tree.add_episode("t", vec![1, 2, 3], Some(0.5)).unwrap();
    let mut seg = Segment::new();
    seg.push(TokenKind::Replayed, &[9, 10], None).unwrap();
    seg.push(TokenKind::Action, &[4, 5], Some(&[-1.0, -2.0]))
        .unwrap();
    seg.push(TokenKind::Observation, &[6, 7], None).unwrap();
    seg.push(TokenKind::ContextManagement, &[8, 11], Some(&[-1.5, -0.5]))
        .unwrap();
    let kinds = seg.kinds.clone();
    let ids = tree
        .add_path(root, vec![Step::new(seg).terminal(1.0)])
        .unwrap();
    let mut adv = EdgeTokens::empty(&tree);
    adv.set(&tree, ids[0], vec![0.7; 8]).unwrap();
    (loss_rows(&tree, &adv, None, Sharing::Once).unwrap(), kinds)
}

fn learner() -> Learner {
    let lcfg = LearnerConfig {
        critic: CriticMode::Shared,
        value_coef: 0.0,
        ..Default::default()
    };
    Learner::new(
        &cfg(),
        None,
        None,
        3,
        &Device::Cpu,
        lcfg,
        AdamWConfig::default(),
        None,
    )
    .unwrap()
}

fn weights(l: &Learner) -> Vec<Vec<f32>> {
    l.opt
        .vars()
        .iter()
        .map(|(_, v)| v.as_tensor().flatten_all().unwrap().to_vec1().unwrap())
        .collect()
}

#[test]
fn masks_follow_token_kinds() {
    let (rows, kinds) = rows();
    let r = &rows[0];
    assert_eq!(r.tokens, vec![1, 2, 3, 9, 10, 4, 5, 6, 7, 8, 11]);
    assert_eq!(&r.mask[..3], &[0.0, 0.0, 0.0], "prompt is masked");
    for (k, m) in kinds.iter().zip(&r.mask[3..]) {
        let want = matches!(k, TokenKind::Action | TokenKind::ContextManagement);
        assert_eq!(*m == 1.0, want, "{k:?}");
    }
}

#[test]
fn masked_tokens_get_zero_gradient_and_trained_tokens_do_not() {
    let (base, _) = rows();
    let mut a = learner();
    a.update(&base).unwrap();
    let wa = weights(&a);

    // Garbage advantages and behaviour logprobs on every masked token: the
    // update must be bit-identical.
    let mut poisoned = base.clone();
    for r in &mut poisoned {
        for i in 0..r.tokens.len() {
            if r.mask[i] == 0.0 {
                r.advantages[i] = 1e6;
                r.behaviour_logprobs[i] = -1e6;
            }
        }
    }
    let mut b = learner();
    b.update(&poisoned).unwrap();
    assert_eq!(weights(&b), wa, "masked tokens influenced the update");

    // Changing the advantage of a compaction-summary token changes it.
    let mut cm = base.clone();
    let pos = 9; // token 8, ContextManagement
    assert_eq!(cm[0].mask[pos], 1.0);
    cm[0].advantages[pos] = -3.0;
    let mut c = learner();
    c.update(&cm).unwrap();
    assert_ne!(weights(&c), wa, "context-management tokens must be trained");

    // And the stats count exactly the trained tokens (2 actions + 2 summary).
    let mut d = learner();
    let s = d.update(&base).unwrap();
    assert_eq!(s.trained_tokens, 4);
}
