//! # arbor-kv
//!
//! The bookkeeping of a paged KV cache, with no tensors: a fixed pool of
//! blocks of `block_size` token slots, per-sequence block tables, reference
//! counts, a prefix cache keyed by token content, and forks with
//! copy-on-write.
//!
//! ## Prefix cache
//!
//! A *full* block is identified by a hash chain, as in vLLM:
//! `key_i = H(key_{i-1}, tokens of block i, policy version)`, so a block is
//! only ever reused after exactly the same token prefix computed by the same
//! weights. Keys are verified on every hit: the tokens and version are
//! stored, and the parent is checked by identity (the block that matched
//! before it and that block's key generation, bumped whenever a key is
//! dropped), not by hash. So a hash collision can never serve wrong KV:
//! a block whose hash is taken by another prefix is not cached, nor is
//! the rest of its sequence, and a block keyed after an evicted parent
//! never matches again. Blocks whose
//! reference count drops to zero keep their content and stay findable until
//! the pool needs them; they are then evicted least-recently-used first.
//! Referenced blocks are never evicted. We chose the hash chain over SGLang's
//! radix tree: lookups are O(blocks) with no tree rebalancing, and block
//! granularity is what the pool allocates anyway.
//!
//! ## Forks and copy-on-write
//!
//! [`KvManager::fork`] gives a child the parent's whole block table (every
//! block's count goes up by one). A partially filled last block is shared
//! too; the first sequence to append to a shared partial block gets a fresh
//! copy ([`CopyOp`] tells the caller which slots to copy).
//!
//! ## Policy versions
//!
//! Every cached key includes the policy version. After a weight update the
//! caller bumps the version ([`KvManager::invalidate`]): stale blocks are
//! dropped from the cache and can never match a new lookup. Sequences alive
//! at the bump keep the KV they hold (and forks of them share it) and never
//! commit it under the new version; a caller that wants none of it finishes
//! or frees them first, as the trainer does between rollouts.

mod manager;
mod pool;

pub use manager::{Allocation, CopyOp, KvManager, SeqId, Slot};
pub use pool::{BlockId, BlockPool, Link, PoolStats};

/// Errors of the KV bookkeeping.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("out of KV blocks: need {needed}, {available} available (pool of {total})")]
    OutOfBlocks {
        needed: usize,
        available: usize,
        total: usize,
    },
    #[error("sequence {0} is not known to the KV manager")]
    UnknownSequence(SeqId),
    #[error("sequence {0} already has blocks")]
    DuplicateSequence(SeqId),
    #[error("invalid KV request: {0}")]
    Invalid(String),
}
