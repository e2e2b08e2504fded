//! The block pool: reference counts, free list, prefix-cache index and LRU.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

/// Index of a block in the pool.
pub type BlockId = u32;

/// Content key of a full, committed block.
#[derive(Debug, Clone, PartialEq, Eq)]
struct BlockKey {
    hash: u64,
    parent: u64,
    version: u64,
    tokens: Vec<u32>,
}

/// Hash of a block given its parent's hash, its tokens and the policy version.
pub(crate) fn chain_hash(parent: u64, tokens: &[u32], version: u64) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    parent.hash(&mut h);
    version.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// Counts describing the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolStats {
    pub total: usize,
    /// Blocks with no content (never cached, or invalidated).
    pub free: usize,
    /// Unreferenced blocks that still hold cached content (evictable).
    pub cached_idle: usize,
    /// Blocks referenced by at least one sequence.
    pub in_use: usize,
    /// Evictions of idle cached blocks so far.
    pub evictions: u64,
}

/// A fixed pool of KV blocks.
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    ref_count: Vec<u32>,
    free: Vec<BlockId>,
    key: Vec<Option<BlockKey>>,
    by_hash: HashMap<u64, BlockId>,
    /// Idle cached blocks by last use (tick -> block).
    lru: BTreeMap<u64, BlockId>,
    last_use: Vec<u64>,
    tick: u64,
    evictions: u64,
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        BlockPool {
            block_size,
            ref_count: vec![0; num_blocks],
            // Pop from the end: hand out low ids first.
            free: (0..num_blocks as BlockId).rev().collect(),
            key: vec![None; num_blocks],
            by_hash: HashMap::new(),
            lru: BTreeMap::new(),
            last_use: vec![0; num_blocks],
            tick: 0,
            evictions: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_count.len()
    }

    /// Blocks that can be handed out now (free + evictable).
    pub fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    pub fn ref_count(&self, b: BlockId) -> u32 {
        self.ref_count[b as usize]
    }

    pub fn stats(&self) -> PoolStats {
        PoolStats {
            total: self.num_blocks(),
            free: self.free.len(),
            cached_idle: self.lru.len(),
            in_use: self.ref_count.iter().filter(|&&r| r > 0).count(),
            evictions: self.evictions,
        }
    }

    /// A fresh, empty block with reference count 1 (evicting the least
    /// recently used idle cached block if no free block is left).
    pub fn allocate(&mut self) -> Option<BlockId> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (&tick, &b) = self.lru.iter().next()?;
                self.lru.remove(&tick);
                self.forget_key(b);
                self.evictions += 1;
                b
            }
        };
        debug_assert_eq!(self.ref_count[b as usize], 0);
        self.ref_count[b as usize] = 1;
        Some(b)
    }

    /// One more reference to a block already in use.
    pub fn retain(&mut self, b: BlockId) {
        debug_assert!(
            self.ref_count[b as usize] > 0,
            "retain of an unreferenced block"
        );
        self.ref_count[b as usize] += 1;
    }

    /// Drop one reference. An unreferenced block keeps its cached content
    /// (idle, evictable) or returns to the free list.
    pub fn release(&mut self, b: BlockId) {
        let r = &mut self.ref_count[b as usize];
        debug_assert!(*r > 0, "double free of block {b}");
        *r -= 1;
        if *r == 0 {
            if self.key[b as usize].is_some() {
                self.tick += 1;
                self.last_use[b as usize] = self.tick;
                self.lru.insert(self.tick, b);
            } else {
                self.free.push(b);
            }
        }
    }

    /// Look up a cached full block with exactly this content; on a hit its
    /// reference count goes up by one (leaving the idle list if it was idle).
    pub fn acquire_cached(
        &mut self,
        parent: u64,
        tokens: &[u32],
        version: u64,
    ) -> Option<(BlockId, u64)> {
        // Keys are compared in full: a hash collision never serves wrong content.
        let (b, hash) = self.peek_cached(parent, tokens, version)?;
        if self.ref_count[b as usize] == 0 {
            self.lru.remove(&self.last_use[b as usize]);
        }
        self.ref_count[b as usize] += 1;
        Some((b, hash))
    }

    /// Like [`acquire_cached`](Self::acquire_cached) without taking a reference.
    pub fn peek_cached(&self, parent: u64, tokens: &[u32], version: u64) -> Option<(BlockId, u64)> {
        let hash = chain_hash(parent, tokens, version);
        let &b = self.by_hash.get(&hash)?;
        let k = self.key[b as usize].as_ref()?;
        (k.parent == parent && k.version == version && k.tokens == tokens).then_some((b, hash))
    }

    /// Register a full block's content in the prefix cache; returns its key
    /// hash. If identical content is already cached in another block, that
    /// block stays the canonical one and `b` is left uncached.
    pub fn commit(&mut self, b: BlockId, parent: u64, tokens: &[u32], version: u64) -> u64 {
        debug_assert_eq!(tokens.len(), self.block_size);
        let hash = chain_hash(parent, tokens, version);
        if self.key[b as usize].is_none() && !self.by_hash.contains_key(&hash) {
            self.key[b as usize] = Some(BlockKey {
                hash,
                parent,
                version,
                tokens: tokens.to_vec(),
            });
            self.by_hash.insert(hash, b);
        }
        hash
    }

    fn forget_key(&mut self, b: BlockId) {
        if let Some(k) = self.key[b as usize].take() {
            if self.by_hash.get(&k.hash) == Some(&b) {
                self.by_hash.remove(&k.hash);
            }
        }
    }

    /// Drop every cached key (after a weight update). Idle cached blocks
    /// become free; referenced blocks keep their content for their current
    /// owners but can no longer be found by lookups.
    pub fn invalidate_all(&mut self) {
        for b in 0..self.num_blocks() as BlockId {
            self.forget_key(b);
        }
        let idle: Vec<BlockId> = self.lru.values().copied().collect();
        self.lru.clear();
        self.free.extend(idle);
    }

    /// The cached token content of block `b`, if it is a committed full block.
    pub fn cached_tokens(&self, b: BlockId) -> Option<&[u32]> {
        self.key[b as usize].as_ref().map(|k| k.tokens.as_slice())
    }

    /// Check the pool's internal invariants (used by tests): every block is in
    /// exactly one of {free, idle cached, referenced}; the hash index points at
    /// blocks holding that key.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut seen = vec![0u8; self.num_blocks()];
        for &b in &self.free {
            seen[b as usize] += 1;
            if self.ref_count[b as usize] != 0 || self.key[b as usize].is_some() {
                return Err(format!("free block {b} is referenced or keyed"));
            }
        }
        for &b in self.lru.values() {
            seen[b as usize] += 1;
            if self.ref_count[b as usize] != 0 || self.key[b as usize].is_none() {
                return Err(format!("idle block {b} is referenced or has no key"));
            }
        }
        for (b, &r) in self.ref_count.iter().enumerate() {
            if r > 0 {
                seen[b] += 1;
            }
            if seen[b] != 1 {
                return Err(format!("block {b} is in {} of free/idle/in-use", seen[b]));
            }
        }
        for (&h, &b) in &self.by_hash {
            match &self.key[b as usize] {
                Some(k) if k.hash == h && chain_hash(k.parent, &k.tokens, k.version) == h => {}
                _ => {
                    return Err(format!(
                        "hash index entry {h:x} -> block {b} does not match its key"
                    ))
                }
            }
        }
        Ok(())
    }
}
