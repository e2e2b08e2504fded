//! Per-sequence block tables on top of the [`BlockPool`].

use std::collections::HashMap;

use crate::pool::{BlockId, BlockPool, Link, PoolStats};
use crate::KvError;

/// Caller-chosen sequence id.
pub type SeqId = u64;

/// A token slot: flat index `block * block_size + offset` into the KV storage.
pub type Slot = usize;

/// Copy the first `len` slots of block `src` into block `dst` (copy-on-write).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOp {
    pub src: BlockId,
    pub dst: BlockId,
    pub len: usize,
}

/// Result of reserving slots for new tokens.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Allocation {
    /// Leading tokens whose KV was found in the prefix cache (not to be computed).
    pub cached_tokens: usize,
    /// One slot per token to compute, in order.
    pub slots: Vec<Slot>,
    /// Block copies the caller must perform before writing into `slots`.
    pub copies: Vec<CopyOp>,
}

#[derive(Debug, Clone)]
struct SeqState {
    blocks: Vec<BlockId>,
    /// Tokens with a reserved slot.
    len: usize,
    /// Full blocks whose key is known (committed or found in the cache).
    keyed: usize,
    /// What block `keyed` chains to in the prefix cache ([`Link::ROOT`]
    /// for the first); `None` once a hash collision took this prefix's key
    /// (the rest of the sequence stays out of the cache).
    last: Option<Link>,
    /// Policy version the KV was computed with.
    version: u64,
}

/// Block tables of all live sequences.
#[derive(Debug, Clone)]
pub struct KvManager {
    pool: BlockPool,
    seqs: HashMap<SeqId, SeqState>,
    version: u64,
}

impl KvManager {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self::with_pool(BlockPool::new(num_blocks, block_size))
    }

    fn with_pool(pool: BlockPool) -> Self {
        KvManager {
            pool,
            seqs: HashMap::new(),
            version: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// The current policy version.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The weights changed: bump the policy version and drop every cached
    /// key. Live sequences keep their blocks (their KV belongs to the old
    /// version and is never registered under the new one).
    pub fn invalidate(&mut self) -> u64 {
        self.version += 1;
        self.pool.invalidate_all();
        self.version
    }

    pub fn contains(&self, seq: SeqId) -> bool {
        self.seqs.contains_key(&seq)
    }

    /// Block table of `seq`.
    pub fn block_table(&self, seq: SeqId) -> Result<&[BlockId], KvError> {
        Ok(&self.state(seq)?.blocks)
    }

    /// Tokens with reserved slots in `seq`.
    pub fn seq_len(&self, seq: SeqId) -> Result<usize, KvError> {
        Ok(self.state(seq)?.len)
    }

    fn state(&self, seq: SeqId) -> Result<&SeqState, KvError> {
        self.seqs.get(&seq).ok_or(KvError::UnknownSequence(seq))
    }

    fn slot(&self, blocks: &[BlockId], pos: usize) -> Slot {
        let bs = self.block_size();
        blocks[pos / bs] as usize * bs + pos % bs
    }

    /// Blocks a sequence of `n` tokens occupies.
    fn blocks_for(&self, n: usize) -> usize {
        n.div_ceil(self.block_size())
    }

    /// Number of leading full blocks of `tokens` that may be served from the
    /// cache: never the block holding the last token, whose logits must be
    /// computed.
    fn cacheable_blocks(&self, n_tokens: usize) -> usize {
        n_tokens.saturating_sub(1) / self.block_size()
    }

    /// How many new blocks admitting `tokens` would take, and whether the
    /// pool can supply them now (cache hits counted, nothing changed).
    pub fn blocks_needed(&self, tokens: &[u32]) -> (usize, bool) {
        let bs = self.block_size();
        let mut parent = Link::ROOT;
        let mut hits = 0;
        let mut idle_hits = 0;
        for i in 0..self.cacheable_blocks(tokens.len()) {
            let chunk = &tokens[i * bs..(i + 1) * bs];
            match self.pool.peek_cached(parent, chunk, self.version) {
                Some((b, link)) => {
                    hits += 1;
                    if self.pool.ref_count(b) == 0 {
                        idle_hits += 1;
                    }
                    parent = link;
                }
                None => break,
            }
        }
        let fresh = self.blocks_for(tokens.len()) - hits;
        (fresh, fresh + idle_hits <= self.pool.available())
    }

    /// Reserve blocks for a new sequence holding `tokens`, reusing the
    /// longest cached prefix of full blocks. Returns the slots of the tokens
    /// that must be computed (`tokens[cached_tokens..]`).
    pub fn allocate(&mut self, seq: SeqId, tokens: &[u32]) -> Result<Allocation, KvError> {
        if self.seqs.contains_key(&seq) {
            return Err(KvError::DuplicateSequence(seq));
        }
        if tokens.is_empty() {
            return Err(KvError::Invalid("cannot allocate an empty sequence".into()));
        }
        let (fresh, ok) = self.blocks_needed(tokens);
        if !ok {
            return Err(KvError::OutOfBlocks {
                needed: fresh,
                available: self.pool.available(),
                total: self.pool.num_blocks(),
            });
        }
        let bs = self.block_size();
        let mut blocks = Vec::with_capacity(self.blocks_for(tokens.len()));
        let mut parent = Link::ROOT;
        for i in 0..self.cacheable_blocks(tokens.len()) {
            match self
                .pool
                .acquire_cached(parent, &tokens[i * bs..(i + 1) * bs], self.version)
            {
                Some((b, link)) => {
                    blocks.push(b);
                    parent = link;
                }
                None => break,
            }
        }
        let keyed = blocks.len();
        while blocks.len() < self.blocks_for(tokens.len()) {
            let b = self.pool.allocate().expect("availability checked above");
            blocks.push(b);
        }
        let cached_tokens = keyed * bs;
        let slots = (cached_tokens..tokens.len())
            .map(|p| self.slot(&blocks, p))
            .collect();
        self.seqs.insert(
            seq,
            SeqState {
                blocks,
                len: tokens.len(),
                keyed,
                last: Some(parent),
                version: self.version,
            },
        );
        Ok(Allocation {
            cached_tokens,
            slots,
            copies: Vec::new(),
        })
    }

    /// Whether `n` more tokens can be appended to `seq` now.
    pub fn can_append(&self, seq: SeqId, n: usize) -> Result<bool, KvError> {
        Ok(self.append_cost(self.state(seq)?, n) <= self.pool.available())
    }

    fn append_cost(&self, s: &SeqState, n: usize) -> usize {
        let bs = self.block_size();
        let cow = usize::from(
            !s.len.is_multiple_of(bs)
                && self.pool.ref_count(*s.blocks.last().expect("non-empty")) > 1,
        );
        self.blocks_for(s.len + n) - s.blocks.len() + cow
    }

    /// Reserve slots for `n` more tokens of `seq`. A shared, partially
    /// filled last block is copied first (copy-on-write).
    pub fn append(&mut self, seq: SeqId, n: usize) -> Result<Allocation, KvError> {
        let bs = self.block_size();
        let need = self.append_cost(self.state(seq)?, n);
        if need > self.pool.available() {
            return Err(KvError::OutOfBlocks {
                needed: need,
                available: self.pool.available(),
                total: self.pool.num_blocks(),
            });
        }
        let mut copies = Vec::new();
        let s = self.seqs.get_mut(&seq).expect("checked");
        let partial = s.len % bs;
        if partial != 0 {
            let last = *s.blocks.last().expect("non-empty");
            if self.pool.ref_count(last) > 1 {
                let fresh = self.pool.allocate().expect("availability checked above");
                copies.push(CopyOp {
                    src: last,
                    dst: fresh,
                    len: partial,
                });
                self.pool.release(last);
                *s.blocks.last_mut().expect("non-empty") = fresh;
            }
        }
        let start = s.len;
        s.len += n;
        while s.blocks.len() < s.len.div_ceil(bs) {
            s.blocks
                .push(self.pool.allocate().expect("availability checked above"));
        }
        let s = &self.seqs[&seq];
        let slots = (start..s.len).map(|p| self.slot(&s.blocks, p)).collect();
        Ok(Allocation {
            cached_tokens: 0,
            slots,
            copies,
        })
    }

    /// Register the newly full blocks of `seq` in the prefix cache once their
    /// KV has been written. `tokens` are all of the sequence's tokens so far
    /// (at least `seq_len`).
    pub fn commit(&mut self, seq: SeqId, tokens: &[u32]) -> Result<(), KvError> {
        let bs = self.block_size();
        let s = self
            .seqs
            .get_mut(&seq)
            .ok_or(KvError::UnknownSequence(seq))?;
        if tokens.len() < s.len {
            return Err(KvError::Invalid(format!(
                "commit of sequence {seq} with {} tokens, {} reserved",
                tokens.len(),
                s.len
            )));
        }
        if s.version != self.version {
            // KV of an older policy: never registered under the current one.
            s.keyed = s.len / bs;
            return Ok(());
        }
        let full = s.len / bs;
        while s.keyed < full {
            let i = s.keyed;
            if let Some(parent) = s.last {
                let chunk = &tokens[i * bs..(i + 1) * bs];
                s.last = self.pool.commit(s.blocks[i], parent, chunk, s.version);
            }
            s.keyed += 1;
        }
        Ok(())
    }

    /// `child` starts as an exact copy of `parent`'s block table, sharing
    /// every block (including a partial last block, copied on write).
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<(), KvError> {
        if self.seqs.contains_key(&child) {
            return Err(KvError::DuplicateSequence(child));
        }
        let s = self.state(parent)?.clone();
        for &b in &s.blocks {
            self.pool.retain(b);
        }
        self.seqs.insert(child, s);
        Ok(())
    }

    /// Release every block of `seq` (full committed blocks stay cached).
    pub fn free(&mut self, seq: SeqId) -> Result<(), KvError> {
        let s = self
            .seqs
            .remove(&seq)
            .ok_or(KvError::UnknownSequence(seq))?;
        for b in s.blocks {
            self.pool.release(b);
        }
        Ok(())
    }

    /// Live sequence ids.
    pub fn sequences(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }

    /// Invariants: reference counts equal the number of block-table entries;
    /// the pool's own invariants hold.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.pool.check_invariants()?;
        let mut refs = vec![0u32; self.pool.num_blocks()];
        for (id, s) in &self.seqs {
            if s.blocks.len() != self.blocks_for(s.len) {
                return Err(format!(
                    "sequence {id}: {} blocks for {} tokens",
                    s.blocks.len(),
                    s.len
                ));
            }
            for &b in &s.blocks {
                refs[b as usize] += 1;
            }
        }
        for (b, &r) in refs.iter().enumerate() {
            if self.pool.ref_count(b as BlockId) != r {
                return Err(format!(
                    "block {b}: ref count {} but {r} table references",
                    self.pool.ref_count(b as BlockId)
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key hash that ignores the parent and collides on the first token,
    /// so different prefixes share hashes all the time.
    fn weak(_parent: u64, tokens: &[u32], _version: u64) -> u64 {
        tokens[0] as u64
    }

    fn manager(blocks: usize) -> KvManager {
        KvManager::with_pool(BlockPool::with_hash(blocks, 2, weak))
    }

    /// Allocate, "compute" and commit `tokens` as sequence `id`; returns the
    /// tokens served from the cache.
    fn admit(m: &mut KvManager, id: SeqId, tokens: &[u32]) -> usize {
        let a = m.allocate(id, tokens).unwrap();
        m.commit(id, tokens).unwrap();
        m.pool().check_invariants().unwrap();
        a.cached_tokens
    }

    /// [1,3] collides with the cached [1,2]: the sequence after it must not
    /// chain its next block to [1,2]'s hash, or [1,2] + [7,7] would be
    /// served [7,7]'s KV computed after [1,3].
    #[test]
    fn a_colliding_block_leaves_the_rest_of_its_sequence_uncached() {
        let mut m = manager(16);
        assert_eq!(admit(&mut m, 1, &[1, 2, 0]), 0);
        assert_eq!(admit(&mut m, 2, &[1, 3, 7, 7, 0]), 0);
        // [1,2] is served; [7,7] after it was never computed.
        assert_eq!(admit(&mut m, 3, &[1, 2, 7, 7, 0]), 2);
        // The same prefix as sequence 2 is not served either: its first
        // block's key belongs to [1,2].
        assert_eq!(admit(&mut m, 4, &[1, 3, 7, 7, 0]), 0);
    }

    /// [1,2] + [5,6] cached, then [1,2]'s block evicted and its hash taken by
    /// [1,3]: the idle [5,6] block, keyed after the old [1,2], must not
    /// match after [1,3].
    #[test]
    fn a_block_keyed_after_an_evicted_parent_never_matches_again() {
        let mut m = manager(3);
        assert_eq!(admit(&mut m, 1, &[1, 2, 5, 6, 0]), 0);
        m.free(1).unwrap();
        // Two blocks: the free one and the least recently used idle one.
        assert_eq!(admit(&mut m, 2, &[1, 3, 0]), 0);
        assert!(m.pool().stats().evictions >= 1);
        m.free(2).unwrap();
        let served = admit(&mut m, 3, &[1, 3, 5, 6, 0]);
        assert!(served <= 2, "served {served} tokens: [5,6] after [1,3]");
    }

    /// Identical content in two blocks (two sequences computed the same
    /// prefix side by side): the second chains through the first's block,
    /// so its later blocks are found after that prefix.
    #[test]
    fn identical_blocks_chain_through_the_canonical_one() {
        let mut m = KvManager::new(16, 2);
        let a = [4, 4, 8, 8, 0];
        // Both allocated before either commits: no hits, separate blocks.
        m.allocate(1, &[4, 4, 0]).unwrap();
        m.allocate(2, &a).unwrap();
        m.commit(1, &[4, 4, 0]).unwrap();
        m.commit(2, &a).unwrap();
        m.pool().check_invariants().unwrap();
        assert_eq!(admit(&mut m, 3, &a), 4);
    }
}
