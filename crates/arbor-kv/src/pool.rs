//! The block pool: reference counts, free list, prefix-cache index and LRU.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

/// Index of a block in the pool.
pub type BlockId = u32;

/// What a full block's key chains to: the previous full block of its
/// prefix, by hash (for the index) and by identity (for the check): the
/// block that holds it and the generation of that block's key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Link {
    hash: u64,
    block: Option<(BlockId, u64)>,
}

impl Link {
    /// The start of every sequence: no previous block.
    pub const ROOT: Link = Link {
        hash: 0,
        block: None,
    };
}

/// Content key of a full, committed block.
#[derive(Debug, Clone, PartialEq, Eq)]
struct BlockKey {
    hash: u64,
    parent: Link,
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
    /// Per block: bumped whenever its key is dropped, so a key chained to
    /// the old one (`Link`) never matches again.
    generation: Vec<u64>,
    by_hash: HashMap<u64, BlockId>,
    /// Idle cached blocks by last use (tick -> block).
    lru: BTreeMap<u64, BlockId>,
    last_use: Vec<u64>,
    tick: u64,
    evictions: u64,
    /// The key hash ([`chain_hash`]; tests put in one that collides).
    hash: fn(u64, &[u32], u64) -> u64,
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self::with_hash(num_blocks, block_size, chain_hash)
    }

    /// A pool whose keys hash with `hash(parent hash, tokens, version)`.
    pub(crate) fn with_hash(
        num_blocks: usize,
        block_size: usize,
        hash: fn(u64, &[u32], u64) -> u64,
    ) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        BlockPool {
            hash,
            block_size,
            ref_count: vec![0; num_blocks],
            // Pop from the end: hand out low ids first.
            free: (0..num_blocks as BlockId).rev().collect(),
            key: vec![None; num_blocks],
            generation: vec![0; num_blocks],
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

    /// Look up a cached full block with exactly this content after the
    /// block `parent` links to; on a hit its reference count goes up by one
    /// (leaving the idle list if it was idle). Returns the block and the
    /// link to it, for the next block's lookup.
    pub fn acquire_cached(
        &mut self,
        parent: Link,
        tokens: &[u32],
        version: u64,
    ) -> Option<(BlockId, Link)> {
        let (b, link) = self.peek_cached(parent, tokens, version)?;
        if self.ref_count[b as usize] == 0 {
            self.lru.remove(&self.last_use[b as usize]);
        }
        self.ref_count[b as usize] += 1;
        Some((b, link))
    }

    /// Like [`acquire_cached`](Self::acquire_cached) without taking a reference.
    ///
    /// Keys are compared in full, the parent by identity (block and key
    /// generation), so a hit holds exactly this prefix's KV even if two
    /// prefixes' hashes collide: by induction from the first block, every
    /// block matched before it was.
    pub fn peek_cached(
        &self,
        parent: Link,
        tokens: &[u32],
        version: u64,
    ) -> Option<(BlockId, Link)> {
        self.lookup(
            (self.hash)(parent.hash, tokens, version),
            parent,
            tokens,
            version,
        )
    }

    /// [`BlockPool::peek_cached`] with the key's hash already computed.
    fn lookup(
        &self,
        hash: u64,
        parent: Link,
        tokens: &[u32],
        version: u64,
    ) -> Option<(BlockId, Link)> {
        let &b = self.by_hash.get(&hash)?;
        let k = self.key[b as usize].as_ref()?;
        (k.parent == parent && k.version == version && k.tokens == tokens)
            .then(|| (b, self.link(b, hash)))
    }

    fn link(&self, b: BlockId, hash: u64) -> Link {
        Link {
            hash,
            block: Some((b, self.generation[b as usize])),
        }
    }

    /// Register full block `b`'s content (after the block `parent` links
    /// to) in the prefix cache. Returns the link the sequence's next block
    /// chains to: to `b`, or to the block already caching identical
    /// content (which stays the canonical one, `b` uncached). `None` when
    /// a different prefix holds this key's hash (a collision): the rest of
    /// the sequence is then left out of the cache.
    pub fn commit(
        &mut self,
        b: BlockId,
        parent: Link,
        tokens: &[u32],
        version: u64,
    ) -> Option<Link> {
        debug_assert_eq!(tokens.len(), self.block_size);
        let hash = (self.hash)(parent.hash, tokens, version);
        if let Some((_, link)) = self.lookup(hash, parent, tokens, version) {
            return Some(link);
        }
        if self.key[b as usize].is_some() || self.by_hash.contains_key(&hash) {
            return None;
        }
        self.key[b as usize] = Some(BlockKey {
            hash,
            parent,
            version,
            tokens: tokens.to_vec(),
        });
        self.by_hash.insert(hash, b);
        Some(self.link(b, hash))
    }

    fn forget_key(&mut self, b: BlockId) {
        if let Some(k) = self.key[b as usize].take() {
            self.generation[b as usize] += 1;
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
                Some(k) if k.hash == h && (self.hash)(k.parent.hash, &k.tokens, k.version) == h => {
                }
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
