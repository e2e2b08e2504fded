//! The CPU kernels on slices, below the ops: the row-invariant matmuls of
//! every `Linear` ([`matmul`], with the outer-product f32 kernel in
//! [`packed`]), the fused row-wise kernels of the generation forward
//! ([`rows`]), and the engine's paged attention ([`attention`]), each
//! compiled for several x86 feature levels and picked at run time. The
//! candle ops that use them (with their backward, and a CUDA kernel where
//! there is one) live at the crate root.

pub mod attention;
pub(crate) mod exp;
pub mod matmul;
pub mod packed;
pub mod rows;
pub(crate) mod simd;
