//! # arbor-ops
//!
//! Arbor's own kernels on plain slices. Each has a straightforward scalar
//! reference in its tests (float64 where it matters); the fast CPU versions
//! are compiled for several x86 feature levels and picked at run time
//! (`multiversion`), so a portable binary still uses AVX2/FMA where the
//! machine has it.
//!
//! - [`paged_attention`]: attention of new tokens over a paged KV cache
//!   through block tables.

mod attention;

pub use attention::{paged_attention, PagedAttentionArgs};
