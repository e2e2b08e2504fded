//! Property tests of the KV bookkeeping against a shadow model of the KV
//! storage: every slot a sequence writes belongs to it alone, every cached
//! block served holds exactly the tokens (and policy version) it is keyed by,
//! no block is leaked or double-freed, and reference counts equal live
//! references.

use std::collections::HashMap;

use arbor_kv::{KvError, KvManager, SeqId};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    /// New sequence: a prefix drawn from a few shared stems plus a tail.
    Add {
        stem: usize,
        stem_len: usize,
        tail: Vec<u32>,
    },
    Append {
        who: usize,
        tail: Vec<u32>,
    },
    Fork {
        who: usize,
    },
    Free {
        who: usize,
    },
    Invalidate,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3usize, 0..40usize, prop::collection::vec(0..5u32, 1..12))
            .prop_map(|(stem, stem_len, tail)| Op::Add { stem, stem_len, tail }),
        5 => (any::<usize>(), prop::collection::vec(0..5u32, 1..9)).prop_map(|(who, tail)| Op::Append { who, tail }),
        2 => any::<usize>().prop_map(|who| Op::Fork { who }),
        3 => any::<usize>().prop_map(|who| Op::Free { who }),
        1 => Just(Op::Invalidate),
    ]
}

/// Shadow KV storage: what each slot holds, as (token, position, version).
type Store = HashMap<usize, (u32, usize, u64)>;

struct Harness {
    kv: KvManager,
    store: Store,
    seqs: Vec<(SeqId, Vec<u32>)>,
    next: SeqId,
    bs: usize,
}

impl Harness {
    fn write(&mut self, seq: SeqId, tokens: &[u32], start: usize, alloc: &arbor_kv::Allocation) {
        for c in &alloc.copies {
            assert_eq!(
                self.kv.pool().ref_count(c.dst),
                1,
                "copy target must be private"
            );
            for o in 0..c.len {
                if let Some(v) = self.store.get(&(c.src as usize * self.bs + o)).copied() {
                    self.store.insert(c.dst as usize * self.bs + o, v);
                }
            }
        }
        let table = self.kv.block_table(seq).unwrap().to_vec();
        for (i, &slot) in alloc.slots.iter().enumerate() {
            let pos = start + i;
            let block = slot / self.bs;
            assert_eq!(
                table[pos / self.bs] as usize,
                block,
                "slot outside the sequence's table"
            );
            assert_eq!(slot % self.bs, pos % self.bs);
            assert_eq!(
                self.kv.pool().ref_count(block as u32),
                1,
                "write into a shared block {block}"
            );
            self.store
                .insert(slot, (tokens[pos], pos, self.kv.version()));
        }
        self.kv.commit(seq, tokens).unwrap();
    }

    /// Every position of every live sequence holds its token in the store.
    fn check_content(&self) {
        for (id, toks) in &self.seqs {
            let table = self.kv.block_table(*id).unwrap();
            for (pos, &t) in toks.iter().enumerate() {
                let slot = table[pos / self.bs] as usize * self.bs + pos % self.bs;
                let got = self.store.get(&slot).map(|v| (v.0, v.1));
                assert_eq!(
                    got,
                    Some((t, pos)),
                    "seq {id} pos {pos}: KV content mismatch"
                );
            }
        }
        // Cached blocks hold exactly their key's tokens.
        for b in 0..self.kv.pool().num_blocks() as u32 {
            if let Some(key) = self.kv.pool().cached_tokens(b) {
                for (o, &t) in key.iter().enumerate() {
                    assert_eq!(
                        self.store.get(&(b as usize * self.bs + o)).map(|v| v.0),
                        Some(t),
                        "cached block {b}"
                    );
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn kv_invariants(ops in prop::collection::vec(op(), 1..60), bs in 1..6usize, blocks in 4..40usize) {
        let stems: Vec<Vec<u32>> = (0..3).map(|s| (0..40).map(|i| ((i * 7 + s * 3) % 5) as u32).collect()).collect();
        let mut h = Harness { kv: KvManager::new(blocks, bs), store: Store::new(), seqs: vec![], next: 0, bs };
        for op in ops {
            match op {
                Op::Add { stem, stem_len, tail } => {
                    let mut toks = stems[stem][..stem_len].to_vec();
                    toks.extend(tail);
                    let id = h.next;
                    h.next += 1;
                    match h.kv.allocate(id, &toks) {
                        Ok(a) => {
                            prop_assert!(a.cached_tokens < toks.len());
                            prop_assert_eq!(a.cached_tokens % bs, 0);
                            prop_assert_eq!(a.slots.len(), toks.len() - a.cached_tokens);
                            let start = a.cached_tokens;
                            // What the cache served was computed under the
                            // current policy version, never an older one.
                            let table = h.kv.block_table(id).unwrap().to_vec();
                            for pos in 0..start {
                                let slot = table[pos / bs] as usize * bs + pos % bs;
                                let v = h.store.get(&slot).map(|v| v.2);
                                prop_assert_eq!(
                                    v,
                                    Some(h.kv.version()),
                                    "pos {} served from a block of another policy version",
                                    pos
                                );
                            }
                            h.write(id, &toks, start, &a);
                            h.seqs.push((id, toks));
                        }
                        Err(KvError::OutOfBlocks { .. }) => {
                            prop_assert!(!h.kv.contains(id));
                        }
                        Err(e) => return Err(TestCaseError::fail(e.to_string())),
                    }
                }
                Op::Append { who, tail } if !h.seqs.is_empty() => {
                    let i = who % h.seqs.len();
                    let id = h.seqs[i].0;
                    let can = h.kv.can_append(id, tail.len()).unwrap();
                    match h.kv.append(id, tail.len()) {
                        Ok(a) => {
                            prop_assert!(can);
                            let start = h.seqs[i].1.len();
                            h.seqs[i].1.extend(&tail);
                            let toks = h.seqs[i].1.clone();
                            h.write(id, &toks, start, &a);
                        }
                        Err(KvError::OutOfBlocks { .. }) => prop_assert!(!can),
                        Err(e) => return Err(TestCaseError::fail(e.to_string())),
                    }
                }
                Op::Fork { who } if !h.seqs.is_empty() => {
                    let i = who % h.seqs.len();
                    let id = h.next;
                    h.next += 1;
                    h.kv.fork(h.seqs[i].0, id).unwrap();
                    let toks = h.seqs[i].1.clone();
                    h.seqs.push((id, toks));
                }
                Op::Free { who } if !h.seqs.is_empty() => {
                    let i = who % h.seqs.len();
                    let (id, _) = h.seqs.swap_remove(i);
                    h.kv.free(id).unwrap();
                    prop_assert!(h.kv.free(id).is_err(), "double free must be refused");
                }
                Op::Invalidate => {
                    h.kv.invalidate();
                }
                _ => {}
            }
            h.kv.check_invariants().map_err(TestCaseError::fail)?;
            h.check_content();
        }
        // Freeing everything returns every block (nothing leaked).
        for (id, _) in std::mem::take(&mut h.seqs) {
            h.kv.free(id).unwrap();
        }
        let st = h.kv.stats();
        prop_assert_eq!(st.in_use, 0);
        prop_assert_eq!(st.free + st.cached_idle, blocks);
        h.kv.check_invariants().map_err(TestCaseError::fail)?;
    }
}

#[test]
fn prefix_is_served_from_cache_and_version_bump_invalidates() {
    let mut kv = KvManager::new(16, 4);
    let toks: Vec<u32> = (0..10).collect();
    let a = kv.allocate(1, &toks).unwrap();
    assert_eq!(a.cached_tokens, 0);
    kv.commit(1, &toks).unwrap();
    kv.free(1).unwrap();
    // Same prefix, new tail: the two full blocks (8 tokens) come from the cache.
    let mut t2 = toks[..8].to_vec();
    t2.extend([77, 78]);
    let a = kv.allocate(2, &t2).unwrap();
    assert_eq!(a.cached_tokens, 8);
    assert_eq!(a.slots.len(), 2);
    kv.free(2).unwrap();
    // Exactly 8 tokens: the last block must be computed (its logits are needed).
    let a = kv.allocate(3, &toks[..8]).unwrap();
    assert_eq!(a.cached_tokens, 4);
    kv.free(3).unwrap();
    kv.invalidate();
    let a = kv.allocate(4, &t2).unwrap();
    assert_eq!(
        a.cached_tokens, 0,
        "stale blocks must not be reused after a weight update"
    );
}

#[test]
fn fork_shares_blocks_and_copies_partial_on_write() {
    let mut kv = KvManager::new(8, 4);
    let toks: Vec<u32> = (0..6).collect();
    kv.allocate(1, &toks).unwrap();
    kv.fork(1, 2).unwrap();
    kv.fork(1, 3).unwrap();
    let t1 = kv.block_table(1).unwrap().to_vec();
    assert_eq!(kv.block_table(2).unwrap(), &t1[..]);
    assert_eq!(kv.pool().ref_count(t1[0]), 3);
    let a = kv.append(2, 1).unwrap();
    assert_eq!(a.copies.len(), 1);
    assert_eq!((a.copies[0].src, a.copies[0].len), (t1[1], 2));
    assert_eq!(
        kv.block_table(2).unwrap()[0],
        t1[0],
        "full blocks stay shared"
    );
    assert_ne!(kv.block_table(2).unwrap()[1], t1[1]);
    assert!(kv.check_invariants().is_ok());
    kv.free(1).unwrap();
    kv.free(3).unwrap();
    kv.free(2).unwrap();
    assert_eq!(kv.stats().in_use, 0);
}

#[test]
fn errors_are_clear() {
    let mut kv = KvManager::new(2, 4);
    let e = kv.allocate(1, &[1; 9]).unwrap_err();
    assert_eq!(
        e,
        KvError::OutOfBlocks {
            needed: 3,
            available: 2,
            total: 2
        }
    );
    assert!(e.to_string().contains("need 3"));
    assert!(kv.allocate(1, &[]).is_err());
    assert_eq!(kv.free(7).unwrap_err(), KvError::UnknownSequence(7));
    kv.allocate(1, &[1]).unwrap();
    assert_eq!(
        kv.allocate(1, &[1]).unwrap_err(),
        KvError::DuplicateSequence(1)
    );
}

/// A sequence begun before an invalidation and completing its first block
/// after it never serves that block: its KV is of the old policy.
#[test]
fn a_block_completed_after_invalidation_is_not_served() {
    let mut kv = KvManager::new(16, 4);
    let toks: Vec<u32> = vec![1, 2, 3, 4, 5];
    kv.allocate(1, &toks[..2]).unwrap();
    kv.commit(1, &toks[..2]).unwrap();
    kv.invalidate();
    kv.append(1, 2).unwrap();
    kv.commit(1, &toks[..4]).unwrap();
    let a = kv.allocate(2, &toks).unwrap();
    assert_eq!(a.cached_tokens, 0, "a block of the old policy was served");
}
