//! Per-sequence block tables on top of the [`BlockPool`].

use std::collections::HashMap;

use crate::pool::{BlockId, BlockPool, PoolStats};
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
    /// Key hash of block `keyed - 1` (0 for none).
    last_hash: u64,
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
        KvManager {
            pool: BlockPool::new(num_blocks, block_size),
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
        let mut parent = 0;
        let mut hits = 0;
        let mut idle_hits = 0;
        for i in 0..self.cacheable_blocks(tokens.len()) {
            let chunk = &tokens[i * bs..(i + 1) * bs];
            match self.pool.peek_cached(parent, chunk, self.version) {
                Some((b, h)) => {
                    hits += 1;
                    if self.pool.ref_count(b) == 0 {
                        idle_hits += 1;
                    }
                    parent = h;
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
        let mut parent = 0;
        for i in 0..self.cacheable_blocks(tokens.len()) {
            match self
                .pool
                .acquire_cached(parent, &tokens[i * bs..(i + 1) * bs], self.version)
            {
                Some((b, h)) => {
                    blocks.push(b);
                    parent = h;
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
                last_hash: parent,
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
            let b = s.blocks[i];
            s.last_hash =
                self.pool
                    .commit(b, s.last_hash, &tokens[i * bs..(i + 1) * bs], s.version);
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
