//! The engine under random sequences of requests, forks, aborts,
//! invalidations and steps, on pools from tiny (constant preemption,
//! prompts that can never fit) to roomy: it never errors or panics, its
//! state stays consistent after every operation
//! ([`Engine::check_invariants`]), every accepted sample finishes exactly
//! once, every block is released at the end, and every completion equals
//! the same request run alone on a fresh engine with a large pool, bit for
//! bit (tokens and logprobs; a sequence that failed for lack of blocks or
//! was aborted got a prefix of them). A quarter of the cases keep the KV as
//! device tensors (the GPU engine's path, here on the CPU); the references
//! use host slices. A second property runs the bf16-matrices fixture with a
//! bf16 host KV cache.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::OnceLock;

use arbor_engine::{Completion, Engine, EngineConfig, EngineError, FinishReason, SamplingParams};
use arbor_model::{LoadOptions, LoadedModel, Transformer};
use candle_core::DType;
use proptest::prelude::*;

/// Context limit of every engine here (prompts of this length or more are
/// refused).
const MAX_CONTEXT: usize = 40;

fn load(name: &str, dtype: DType) -> Transformer {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../arbor-model/tests/fixtures")
        .join(name);
    let opts = LoadOptions {
        dtype,
        ..Default::default()
    };
    LoadedModel::load(p.to_str().unwrap(), &opts).unwrap().model
}

/// The f32 fixture.
fn model() -> &'static Transformer {
    static M: OnceLock<Transformer> = OnceLock::new();
    M.get_or_init(|| load("qwen2", DType::F32))
}

/// The bf16 fixture with bf16 matrices under f32 compute and a bf16 KV
/// cache (every CPU), or `None` where bf16 is bf16 throughout.
fn bf16_model() -> Option<&'static Transformer> {
    static M: OnceLock<Option<Transformer>> = OnceLock::new();
    M.get_or_init(|| {
        let m = load("qwen2-bf16", DType::BF16);
        (m.kv_dtype() == DType::BF16 && m.dtype() == DType::F32).then_some(m)
    })
    .as_ref()
}

/// One sample of a request.
#[derive(Debug, Clone)]
struct Sample {
    max_tokens: usize,
    /// Greedy, or temperature 0.8 with a top-p cut.
    greedy: bool,
    seed: u64,
    stop: Option<u32>,
}

impl Sample {
    fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: if self.greedy { 0.0 } else { 0.8 },
            top_p: if self.greedy { 1.0 } else { 0.9 },
            max_tokens: self.max_tokens,
            stop_tokens: self.stop.into_iter().collect(),
            seed: self.seed,
            ..Default::default()
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// A prompt of `len` tokens (0 and `MAX_CONTEXT` or more are refused),
    /// one sample per entry (none is refused).
    Submit {
        len: usize,
        salt: u32,
        samples: Vec<Sample>,
    },
    /// Fork one of the ids handed out so far (finished ones are refused).
    Fork {
        pick: usize,
        samples: Vec<Sample>,
    },
    /// Abort one of the ids handed out so far (finished ones are refused).
    Abort {
        pick: usize,
    },
    Invalidate,
    Step(usize),
}

fn sample() -> impl Strategy<Value = Sample> {
    (
        1usize..10,
        any::<bool>(),
        0u64..4,
        prop::option::weighted(0.3, 3u32..303),
    )
        .prop_map(|(max_tokens, greedy, seed, stop)| Sample {
            max_tokens,
            greedy,
            seed,
            stop,
        })
}

fn op() -> impl Strategy<Value = Op> {
    let samples = || prop::collection::vec(sample(), 0..4);
    prop_oneof![
        4 => (0usize..45, 0u32..50, samples())
            .prop_map(|(len, salt, samples)| Op::Submit { len, salt, samples }),
        2 => (any::<usize>(), samples()).prop_map(|(pick, samples)| Op::Fork { pick, samples }),
        1 => any::<usize>().prop_map(|pick| Op::Abort { pick }),
        1 => Just(Op::Invalidate),
        4 => (1usize..4).prop_map(Op::Step),
    ]
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 37 + salt * 11) % 300 + 3)
        .collect()
}

/// `prompt` with `params`, alone on a fresh engine with room for it.
fn alone(m: &Transformer, prompt: &[u32], params: &SamplingParams) -> Completion {
    let mut e = Engine::new(
        m,
        None,
        EngineConfig {
            block_size: 4,
            num_blocks: 64,
            max_context: MAX_CONTEXT,
            ..Default::default()
        },
    )
    .unwrap();
    e.submit(prompt.to_vec(), vec![params.clone()]).unwrap();
    e.run(|_| {}).unwrap().remove(0)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn run_ops(
    m: &Transformer,
    block_size: usize,
    num_blocks: usize,
    max_batch_tokens: usize,
    on_device: bool,
    ops: &[Op],
) -> Result<(), TestCaseError> {
    let mut e = Engine::new(
        m,
        None,
        EngineConfig {
            block_size,
            num_blocks,
            max_batch_tokens,
            max_context: MAX_CONTEXT,
            kv_on_device: Some(on_device),
            ..Default::default()
        },
    )
    .unwrap();
    // Accepted sample id -> its sampling parameters.
    let mut accepted: HashMap<u64, SamplingParams> = HashMap::new();
    let mut ids: Vec<u64> = Vec::new();
    let mut done: Vec<Completion> = Vec::new();
    for op in ops {
        match op {
            Op::Submit { len, salt, samples } => {
                let r = e.submit(
                    prompt(*len, *salt),
                    samples.iter().map(Sample::params).collect(),
                );
                let refused = *len == 0 || *len >= MAX_CONTEXT || samples.is_empty();
                match r {
                    Ok(new) => {
                        prop_assert!(!refused, "accepted a bad request: {op:?}");
                        prop_assert_eq!(new.len(), samples.len());
                        for (id, s) in new.iter().zip(samples) {
                            accepted.insert(*id, s.params());
                        }
                        ids.extend(new);
                    }
                    Err(EngineError::InvalidRequest(_)) => prop_assert!(refused, "{op:?}"),
                    Err(other) => prop_assert!(false, "{op:?}: {other}"),
                }
            }
            Op::Fork { pick, samples } => {
                if ids.is_empty() {
                    continue;
                }
                let parent = ids[pick % ids.len()];
                match e.fork(parent, samples.iter().map(Sample::params).collect()) {
                    Ok(new) => {
                        prop_assert!(!samples.is_empty());
                        for (id, s) in new.iter().zip(samples) {
                            accepted.insert(*id, s.params());
                        }
                        ids.extend(new);
                    }
                    // n = 0, or a sample of a prompt not computed yet.
                    Err(EngineError::InvalidRequest(msg)) => {
                        prop_assert!(
                            samples.is_empty() || msg.contains("has not started"),
                            "{}",
                            msg
                        );
                    }
                    // Finished.
                    Err(EngineError::UnknownSequence(id)) => prop_assert_eq!(id, parent),
                    Err(other) => prop_assert!(false, "{op:?}: {other}"),
                }
            }
            Op::Abort { pick } => {
                if ids.is_empty() {
                    continue;
                }
                let id = ids[pick % ids.len()];
                let finished = done.iter().any(|c| c.id == id);
                match e.abort(id) {
                    Ok(()) => prop_assert!(!finished, "aborted finished sample {}", id),
                    Err(EngineError::UnknownSequence(x)) => {
                        prop_assert_eq!(x, id);
                        prop_assert!(finished, "sample {} pending but refused", id);
                    }
                    Err(other) => prop_assert!(false, "{op:?}: {other}"),
                }
                done.extend(e.take_finished());
            }
            Op::Invalidate => {
                e.invalidate();
            }
            Op::Step(n) => {
                for _ in 0..*n {
                    if let Err(err) = e.step() {
                        prop_assert!(false, "step failed: {err}");
                    }
                }
                done.extend(e.take_finished());
            }
        }
        if let Err(msg) = e.check_invariants() {
            prop_assert!(false, "after {op:?}: {msg}");
        }
    }
    match e.run(|_| {}) {
        Ok(rest) => done.extend(rest),
        Err(err) => prop_assert!(false, "draining failed: {err}"),
    }
    if let Err(msg) = e.check_invariants() {
        prop_assert!(false, "after draining: {msg}");
    }
    prop_assert_eq!(e.num_pending(), 0);
    prop_assert_eq!(e.pool_stats().in_use, 0, "blocks still referenced");

    let mut seen: HashMap<u64, usize> = HashMap::new();
    for c in &done {
        *seen.entry(c.id).or_default() += 1;
    }
    for id in accepted.keys() {
        prop_assert_eq!(
            seen.get(id).copied(),
            Some(1),
            "sample {} finished {:?} times",
            id,
            seen.get(id)
        );
    }
    prop_assert_eq!(seen.len(), accepted.len(), "completions for unknown ids");

    let mut refs: HashMap<(Vec<u32>, String), Completion> = HashMap::new();
    for c in &done {
        let p = &accepted[&c.id];
        prop_assert_eq!(c.logprobs.len(), c.tokens.len());
        prop_assert!(c.tokens.len() <= p.max_tokens);
        match c.finish_reason {
            FinishReason::Length => prop_assert!(
                c.tokens.len() == p.max_tokens || c.prompt.len() + c.tokens.len() >= MAX_CONTEXT
            ),
            FinishReason::Stop => prop_assert!(p.stop_tokens.contains(c.tokens.last().unwrap())),
            FinishReason::Error => {
                let msg = c.error.as_deref().unwrap_or("");
                prop_assert!(msg.contains("pool too small"), "{}", msg);
            }
            FinishReason::Abort => prop_assert!(c.error.is_none()),
        }
        let key = (c.prompt.clone(), format!("{p:?}"));
        let r = refs
            .entry(key)
            .or_insert_with(|| alone(m, &c.prompt, p))
            .clone();
        if matches!(c.finish_reason, FinishReason::Error | FinishReason::Abort) {
            prop_assert!(r.tokens.starts_with(&c.tokens), "sample {}", c.id);
            prop_assert_eq!(bits(&c.logprobs), bits(&r.logprobs[..c.logprobs.len()]));
        } else {
            prop_assert_eq!(&c.tokens, &r.tokens, "sample {} of {:?}", c.id, c.prompt);
            prop_assert_eq!(bits(&c.logprobs), bits(&r.logprobs));
            prop_assert_eq!(c.finish_reason, r.finish_reason);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn random_operations_stay_exact(
        block_size in prop::sample::select(vec![1usize, 2, 4]),
        num_blocks in 3usize..40,
        max_batch_tokens in prop::sample::select(vec![4usize, 16, 64]),
        on_device in prop::bool::weighted(0.25),
        ops in prop::collection::vec(op(), 1..24),
    ) {
        run_ops(model(), block_size, num_blocks, max_batch_tokens, on_device, &ops)?;
    }

    /// The same with bf16 matrices and a bf16 host KV cache.
    #[test]
    fn random_operations_stay_exact_with_a_bf16_cache(
        block_size in prop::sample::select(vec![1usize, 2, 4]),
        num_blocks in 3usize..40,
        max_batch_tokens in prop::sample::select(vec![4usize, 16, 64]),
        ops in prop::collection::vec(op(), 1..24),
    ) {
        if let Some(m) = bf16_model() {
            run_ops(m, block_size, num_blocks, max_batch_tokens, false, &ops)?;
        }
    }
}
