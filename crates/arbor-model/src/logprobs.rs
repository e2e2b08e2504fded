//! Token log-probabilities from final hidden states, chunked over rows so
//! the full `[N, V]` logits never exist at once.
//!
//! For row `n` with hidden `h_n` and target `y_n`:
//! `logp_n = (W h_n)_{y_n} - logsumexp_v (W h_n)_v`, through
//! [`arbor_ops::fused_logprobs`]: forward in chunks of `chunk_rows` rows,
//! backward recomputing the logits in vocabulary chunks, so neither pass
//! holds `[N, V]` logits (the autograd graph keeps only `[N, 3]`). f32
//! results (f64 for f64 models); CUDA kernels with the `cuda` feature.

use candle_core::{DType, Tensor, D};

use crate::error::{ModelError, Result};
use crate::model::accum_dtype;

/// Default number of rows per chunk.
pub const DEFAULT_CHUNK_ROWS: usize = 256;

fn check(hidden: &Tensor, lm_head: &Tensor) -> Result<(usize, usize)> {
    let (n, h) = hidden.dims2()?;
    let (_, h2) = lm_head.dims2()?;
    if h != h2 {
        return Err(ModelError::Input(format!(
            "hidden size {h} does not match lm_head [.., {h2}]"
        )));
    }
    Ok((n, h))
}

/// Chunk logits in the accumulation dtype, `[c, V]`.
fn chunk_logits(hidden: &Tensor, lm_head: &Tensor, start: usize, len: usize) -> Result<Tensor> {
    let h = hidden.narrow(0, start, len)?;
    let logits = crate::model::matmul_nt(&h, lm_head)?;
    Ok(logits.to_dtype(accum_dtype(hidden.dtype()))?)
}

/// `log p(targets)`: `hidden: [N, H]`, `lm_head: [V, H]`, `targets: [N]`
/// (u32) -> `[N]` (f32, or f64 for f64 inputs). Differentiable in `hidden`
/// and `lm_head`.
pub fn token_logprobs(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    chunk_rows: usize,
) -> Result<Tensor> {
    // A bf16 LM head under f32 hidden states (bf16 matrices) goes to the
    // fused op as it is: its bf16 dot products round the hidden states as
    // the engine's bf16 LM head does.
    // Half-precision hidden states over an f32 LM head (mixed precision,
    // [`crate::Transformer::set_train_dtype`]): the head is cast to their
    // dtype inside the graph (its gradient arrives in f32); the fused op
    // sums the log-softmax in f32 and returns f32.
    let lm_head = match (hidden.dtype(), lm_head.dtype()) {
        (DType::BF16 | DType::F16, DType::F32) => lm_head.to_dtype(hidden.dtype())?,
        _ => lm_head.clone(),
    };
    fused(
        hidden,
        &lm_head,
        targets,
        chunk_rows,
        arbor_ops::fused_logprobs,
    )
}

/// [`token_logprobs`] of f32 `hidden` over an f32 `lm_head` through bf16
/// products (the CPU's mixed-precision training): the head is rounded to
/// bf16 inside [`arbor_ops::fused_logprobs_bf16`] and its gradient comes
/// back in f32.
pub fn token_logprobs_bf16(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    chunk_rows: usize,
) -> Result<Tensor> {
    fused(
        hidden,
        lm_head,
        targets,
        chunk_rows,
        arbor_ops::fused_logprobs_bf16,
    )
}

/// The log-probability column of `op` (a fused logprob op) in chunks of
/// `chunk_rows` rows, after checking the shapes and the targets against
/// the vocabulary.
fn fused(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    chunk_rows: usize,
    op: fn(&Tensor, &Tensor, &Tensor, usize) -> candle_core::Result<Tensor>,
) -> Result<Tensor> {
    check(hidden, lm_head)?;
    let vocab = lm_head.dim(0)?;
    if let Some(bad) = targets
        .to_vec1::<u32>()?
        .into_iter()
        .find(|&t| t as usize >= vocab)
    {
        return Err(ModelError::Input(format!(
            "target token {bad} is outside the vocabulary ({vocab})"
        )));
    }
    let out = op(hidden, lm_head, targets, chunk_rows.max(1) * vocab)?;
    Ok(out.narrow(1, 0, 1)?.squeeze(1)?)
}

/// Greedy (argmax) next token for every row of `hidden: [N, H]`.
pub fn greedy_tokens(hidden: &Tensor, lm_head: &Tensor, chunk_rows: usize) -> Result<Vec<u32>> {
    let (n, _) = check(hidden, lm_head)?;
    let chunk_rows = chunk_rows.max(1);
    let mut out = Vec::with_capacity(n);
    let mut start = 0;
    while start < n {
        let len = chunk_rows.min(n - start);
        let logits = chunk_logits(&hidden.detach(), &lm_head.detach(), start, len)?;
        out.extend(logits.argmax(D::Minus1)?.to_vec1::<u32>()?);
        start += len;
    }
    Ok(out)
}
