//! Plain-Rust planning of the dedicated decode step: batch-size buckets,
//! block-table widths, the one input buffer a step uploads, the activation
//! arena, and the keys of captured graphs. Nothing here touches a device,
//! so all of it is tested on the CPU.

use arbor_ops::SampleRequest;

/// Batch sizes a decode step is padded up to (one captured graph each).
pub const BUCKETS: [usize; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];

/// The smallest bucket that holds `n` sequences; `None` past the largest
/// (or for 0).
pub fn bucket(n: usize) -> Option<usize> {
    BUCKETS
        .iter()
        .copied()
        .find(|&b| b >= n.max(1))
        .filter(|_| n > 0)
}

/// Block-table width of a step whose longest table has `blocks` blocks:
/// the next power of two (at least 1), so a graph serves every context up
/// to it and the tables uploaded each step stay small.
pub fn table_width(blocks: usize) -> usize {
    blocks.max(1).next_power_of_two()
}

/// A captured step: the batch bucket and the block-table width it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GraphKey {
    pub bucket: usize,
    pub table_width: usize,
}

/// One step's host inputs: `n` new tokens of `s` sequences (packed
/// sequence after sequence, as the engine schedules them) and the tokens
/// to sample.
#[derive(Debug, Clone, Copy)]
pub struct StepIn<'a> {
    /// `[n]` each: token id, position, KV slot, sequence (index into
    /// `tables`).
    pub tokens: &'a [u32],
    pub positions: &'a [u32],
    pub slots: &'a [u32],
    pub token_seq: &'a [u32],
    /// `[s]`: each sequence's block table (covering its positions) and the
    /// index of its last new token.
    pub tables: &'a [&'a [u32]],
    pub last: &'a [u32],
    /// `[r]`: the samples, each from the logits of sequence `row`'s last
    /// token (a fan-out samples one row several times).
    pub samples: &'a [SampleRequest],
}

impl StepIn<'_> {
    /// A decode step: one token for each sequence, each sampled once, in
    /// order (what a captured graph runs).
    pub fn is_decode(&self) -> bool {
        let n = self.tokens.len();
        self.tables.len() == n
            && self.samples.len() == n
            && (0..n).all(|i| {
                self.token_seq[i] as usize == i
                    && self.last[i] as usize == i
                    && self.samples[i].row as usize == i
            })
    }

    /// Checks the parts against each other (lengths, indices in range,
    /// tables that reach every position), naming the first fault.
    pub fn check(&self, block_size: usize) -> Result<(), String> {
        let (n, s) = (self.tokens.len(), self.tables.len());
        if self.positions.len() != n || self.slots.len() != n || self.token_seq.len() != n {
            return Err(format!(
                "{n} tokens but positions, slots or sequence ids differ"
            ));
        }
        if self.last.len() != s {
            return Err(format!("{s} tables but {} last tokens", self.last.len()));
        }
        for i in 0..n {
            let q = self.token_seq[i] as usize;
            let table = self
                .tables
                .get(q)
                .ok_or(format!("token {i} names sequence {q} of {s}"))?;
            if self.positions[i] as usize / block_size >= table.len() {
                return Err(format!(
                    "token {i} at position {} is past its table of {} blocks",
                    self.positions[i],
                    table.len()
                ));
            }
        }
        if let Some(l) = self.last.iter().find(|&&l| l as usize >= n) {
            return Err(format!("last token {l} of {n}"));
        }
        if let Some(r) = self.samples.iter().find(|r| r.row as usize >= s) {
            return Err(format!("a sample of row {} of {s}", r.row));
        }
        Ok(())
    }
}

/// Sizes of a step's buffers: tokens, sequences, samples, table width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepShape {
    pub tokens: usize,
    pub seqs: usize,
    pub samples: usize,
    pub table_width: usize,
}

impl StepShape {
    /// A decode graph's shape: the bucket for every count.
    pub fn decode(key: GraphKey) -> Self {
        StepShape {
            tokens: key.bucket,
            seqs: key.bucket,
            samples: key.bucket,
            table_width: key.table_width,
        }
    }

    /// The exact shape of `step` (run without a graph).
    pub fn of(step: &StepIn<'_>) -> Self {
        StepShape {
            tokens: step.tokens.len(),
            seqs: step.tables.len(),
            samples: step.samples.len(),
            table_width: table_width(step.tables.iter().map(|t| t.len()).max().unwrap_or(1)),
        }
    }
}

/// Word offsets of the parts of a step's one upload (u32 words): for `N`
/// tokens, `S` sequences with tables `W` wide and `R` samples,
/// `[ids: N | positions: N | slots: N | seq: N | tables: S x W | last: S |
/// pad to even | samples: R f64 triples (row, 1/T, u)]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InputLayout {
    pub shape: StepShape,
    pub ids: usize,
    pub positions: usize,
    pub slots: usize,
    pub seq: usize,
    pub tables: usize,
    pub last: usize,
    /// Even, so the f64s are 8-byte aligned.
    pub params: usize,
    pub words: usize,
}

impl InputLayout {
    pub fn new(shape: StepShape) -> Self {
        let (n, s, w) = (shape.tokens, shape.seqs, shape.table_width);
        let tables = 4 * n;
        let last = tables + s * w;
        let params = (last + s).next_multiple_of(2);
        InputLayout {
            shape,
            ids: 0,
            positions: n,
            slots: 2 * n,
            seq: 3 * n,
            tables,
            last,
            params,
            words: params + 6 * shape.samples,
        }
    }

    /// The step's upload. Parts longer than `step`'s are padding (a decode
    /// step padded to its bucket): token 0 at position 0 of its own
    /// all-zero table, a slot past the cache (`no_slot`: nothing written),
    /// its own row, sampled greedily. Errors when `step` does not fit.
    pub fn pack(&self, step: &StepIn<'_>, no_slot: u32) -> Result<Vec<u32>, String> {
        let sh = self.shape;
        let (n, s, r) = (step.tokens.len(), step.tables.len(), step.samples.len());
        if n > sh.tokens || s > sh.seqs || r > sh.samples {
            return Err(format!(
                "{n} tokens, {s} sequences, {r} samples for a layout of {}, {}, {}",
                sh.tokens, sh.seqs, sh.samples
            ));
        }
        let mut buf = vec![0u32; self.words];
        for i in 0..sh.tokens {
            buf[self.seq + i] = (i.min(sh.seqs - 1)) as u32;
            buf[self.slots + i] = no_slot;
        }
        for q in 0..sh.seqs {
            buf[self.last + q] = (q.min(sh.tokens - 1)) as u32;
        }
        for k in 0..sh.samples {
            let p = self.params + 6 * k;
            buf[p..p + 2].copy_from_slice(&words_of(k.min(sh.seqs - 1) as f64));
        }
        buf[self.ids..self.ids + n].copy_from_slice(step.tokens);
        buf[self.positions..self.positions + n].copy_from_slice(step.positions);
        buf[self.slots..self.slots + n].copy_from_slice(step.slots);
        buf[self.seq..self.seq + n].copy_from_slice(step.token_seq);
        for (q, t) in step.tables.iter().enumerate() {
            if t.len() > sh.table_width {
                return Err(format!(
                    "sequence {q}: a table of {} blocks in a layout {} wide",
                    t.len(),
                    sh.table_width
                ));
            }
            let at = self.tables + q * sh.table_width;
            buf[at..at + t.len()].copy_from_slice(t);
        }
        buf[self.last..self.last + s].copy_from_slice(step.last);
        for (k, x) in step.samples.iter().enumerate() {
            let p = self.params + 6 * k;
            buf[p..p + 2].copy_from_slice(&words_of(x.row as f64));
            buf[p + 2..p + 4].copy_from_slice(&words_of(x.inv_temperature as f64));
            buf[p + 4..p + 6].copy_from_slice(&words_of(x.u));
        }
        Ok(buf)
    }
}

/// An f64 as two little-endian u32 words (its layout on the device).
fn words_of(x: f64) -> [u32; 2] {
    let b = x.to_bits();
    [b as u32, (b >> 32) as u32]
}

/// Model dimensions the decode step needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
}

/// Byte offsets of a step's activations in one arena, sized for `tokens`
/// new tokens and `rows` sequences (and samples): every buffer starts
/// 256-byte aligned. A smaller step uses the first rows of each buffer, so
/// one arena (and its addresses, which captured graphs keep) serves every
/// bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaPlan {
    pub tokens: usize,
    pub rows: usize,
    /// f32 `[tokens, hidden]`.
    pub resid: usize,
    /// bf16 `[tokens, hidden]`: a norm's output.
    pub normed: usize,
    /// bf16 `[tokens, (heads + 2 kv_heads) * head_dim]`: the QKV GEMM's
    /// output, each row q | k | v.
    pub qkv: usize,
    /// bf16 `[tokens, heads, head_dim]`: RoPE'd queries.
    pub q_rope: usize,
    /// bf16 `[tokens, heads * head_dim]`: attention output.
    pub attn: usize,
    /// bf16 `[tokens, hidden]`: the O or down projection (added to the
    /// residual by the next norm).
    pub delta: usize,
    /// bf16 `[tokens, 2 intermediate]`: the gate|up GEMM's output, each
    /// row gate | up.
    pub gate_up: usize,
    /// bf16 `[tokens, intermediate]`: silu(gate) * up.
    pub act: usize,
    /// bf16 `[rows, hidden]`: the final norm of each sequence's last token.
    pub last: usize,
    /// f32 `[rows, vocab]`.
    pub logits: usize,
    /// u32 `[rows, 3]`: sampled token, logprob bits, entropy bits.
    pub sampled: usize,
    pub bytes: usize,
}

impl ArenaPlan {
    pub fn new(d: &Dims, tokens: usize, rows: usize) -> Self {
        let mut at = 0usize;
        let mut take = |bytes: usize| {
            let here = at;
            at = (at + bytes).next_multiple_of(256);
            here
        };
        let (h, q, kv, i) = (
            d.hidden,
            d.heads * d.head_dim,
            d.kv_heads * d.head_dim,
            d.intermediate,
        );
        let t = tokens;
        ArenaPlan {
            tokens,
            rows,
            resid: take(t * h * 4),
            normed: take(t * h * 2),
            qkv: take(t * (q + 2 * kv) * 2),
            q_rope: take(t * q * 2),
            attn: take(t * q * 2),
            delta: take(t * h * 2),
            gate_up: take(t * 2 * i * 2),
            act: take(t * i * 2),
            last: take(rows * h * 2),
            logits: take(rows * d.vocab * 4),
            sampled: take(rows * 3 * 4),
            bytes: at,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_pad_up_and_stop_at_the_largest() {
        assert_eq!(bucket(0), None);
        assert_eq!(bucket(1), Some(1));
        assert_eq!(bucket(3), Some(4));
        assert_eq!(bucket(64), Some(64));
        assert_eq!(bucket(65), Some(128));
        assert_eq!(bucket(256), Some(256));
        assert_eq!(bucket(257), None);
        for n in 1..=256 {
            let b = bucket(n).unwrap();
            assert!(b >= n && BUCKETS.contains(&b));
            // The smallest such bucket.
            assert!(BUCKETS.iter().all(|&x| x < n || x >= b));
        }
        assert_eq!(table_width(0), 1);
        assert_eq!(table_width(5), 8);
        assert_eq!(table_width(16), 16);
    }

    fn decode_step<'a>(tables: &'a [&'a [u32]], samples: &'a [SampleRequest]) -> StepIn<'a> {
        StepIn {
            tokens: &[11, 12],
            positions: &[20, 40],
            slots: &[51, 66],
            token_seq: &[0, 1],
            tables,
            last: &[0, 1],
            samples,
        }
    }

    #[test]
    fn decode_inputs_pack_into_their_parts_with_padding_rows() {
        let key = GraphKey {
            bucket: 4,
            table_width: 4,
        };
        let l = InputLayout::new(StepShape::decode(key));
        assert_eq!((l.tables, l.last, l.params % 2), (16, 32, 0));
        assert_eq!(l.words, l.params + 24);
        let (ta, tb) = ([7u32, 3], [9u32, 1, 4]);
        let tables: [&[u32]; 2] = [&ta, &tb];
        let samples = [
            SampleRequest {
                row: 0,
                inv_temperature: 0.0,
                u: 0.0,
            },
            SampleRequest {
                row: 1,
                inv_temperature: 1.25,
                u: 0.375,
            },
        ];
        let step = decode_step(&tables, &samples);
        assert!(step.is_decode());
        step.check(16).unwrap();
        let buf = l.pack(&step, 999).unwrap();
        assert_eq!(&buf[l.ids..l.ids + 4], &[11, 12, 0, 0]);
        assert_eq!(&buf[l.positions..l.positions + 4], &[20, 40, 0, 0]);
        assert_eq!(&buf[l.slots..l.slots + 4], &[51, 66, 999, 999]);
        assert_eq!(&buf[l.seq..l.seq + 4], &[0, 1, 2, 3]);
        assert_eq!(&buf[l.tables..l.tables + 8], &[7, 3, 0, 0, 9, 1, 4, 0]);
        assert!(buf[l.tables + 8..l.tables + 16].iter().all(|&w| w == 0));
        assert_eq!(&buf[l.last..l.last + 4], &[0, 1, 2, 3]);
        let f = |b: usize, k: usize| {
            let p = l.params + 6 * b + 2 * k;
            f64::from_bits(buf[p] as u64 | (buf[p + 1] as u64) << 32)
        };
        assert_eq!((f(0, 0), f(0, 1), f(0, 2)), (0.0, 0.0, 0.0));
        assert_eq!((f(1, 0), f(1, 1), f(1, 2)), (1.0, 1.25, 0.375));
        // Padding rows sample their own row, greedily.
        assert_eq!((f(3, 0), f(3, 1)), (3.0, 0.0));
        let wide = [0u32; 5];
        let tables: [&[u32]; 2] = [&wide, &tb];
        assert!(l
            .pack(&decode_step(&tables, &samples), 999)
            .unwrap_err()
            .contains("sequence 0"));
    }

    /// A prefill with a fan-out: one prompt of 3 tokens (sampled twice) and
    /// a decode token of another sequence, packed at their exact sizes.
    #[test]
    fn prefill_and_fan_out_pack_exactly() {
        let (ta, tb) = ([4u32], [8u32, 2]);
        let tables: [&[u32]; 2] = [&ta, &tb];
        let samples = [
            SampleRequest {
                row: 0,
                inv_temperature: 1.0,
                u: 0.25,
            },
            SampleRequest {
                row: 0,
                inv_temperature: 1.0,
                u: 0.75,
            },
            SampleRequest {
                row: 1,
                inv_temperature: 0.0,
                u: 0.0,
            },
        ];
        let step = StepIn {
            tokens: &[5, 6, 7, 9],
            positions: &[0, 1, 2, 17],
            slots: &[64, 65, 66, 33],
            token_seq: &[0, 0, 0, 1],
            tables: &tables,
            last: &[2, 3],
            samples: &samples,
        };
        assert!(!step.is_decode());
        step.check(16).unwrap();
        let shape = StepShape::of(&step);
        assert_eq!(
            (shape.tokens, shape.seqs, shape.samples, shape.table_width),
            (4, 2, 3, 2)
        );
        let l = InputLayout::new(shape);
        let buf = l.pack(&step, 999).unwrap();
        assert_eq!(&buf[l.seq..l.seq + 4], &[0, 0, 0, 1]);
        assert_eq!(&buf[l.tables..l.tables + 4], &[4, 0, 8, 2]);
        assert_eq!(&buf[l.last..l.last + 2], &[2, 3]);
        let row = |k: usize| {
            let p = l.params + 6 * k;
            f64::from_bits(buf[p] as u64 | (buf[p + 1] as u64) << 32)
        };
        assert_eq!((row(0), row(1), row(2)), (0.0, 0.0, 1.0));
        // Faults are named.
        let bad = StepIn {
            positions: &[0, 1, 2, 40],
            ..step
        };
        assert!(bad.check(16).unwrap_err().contains("token 3"));
        let bad = StepIn {
            last: &[2, 4],
            ..step
        };
        assert!(bad.check(16).unwrap_err().contains("last token 4"));
        let few = [SampleRequest {
            row: 2,
            ..samples[0]
        }];
        let bad = StepIn {
            samples: &few,
            ..step
        };
        assert!(bad.check(16).unwrap_err().contains("row 2"));
    }

    #[test]
    fn arena_buffers_are_aligned_and_disjoint() {
        let d = Dims {
            hidden: 1024,
            intermediate: 3072,
            heads: 16,
            kv_heads: 8,
            head_dim: 128,
            vocab: 151_936,
        };
        let a = ArenaPlan::new(&d, 2048, 256);
        let t = 2048;
        let mut parts = [
            (a.resid, t * 1024 * 4),
            (a.normed, t * 1024 * 2),
            (a.qkv, t * 4096 * 2),
            (a.q_rope, t * 2048 * 2),
            (a.attn, t * 2048 * 2),
            (a.delta, t * 1024 * 2),
            (a.gate_up, t * 6144 * 2),
            (a.act, t * 3072 * 2),
            (a.last, 256 * 1024 * 2),
            (a.logits, 256 * 151_936 * 4),
            (a.sampled, 256 * 12),
        ];
        parts.sort();
        for w in parts.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{w:?} overlap");
        }
        assert!(parts.iter().all(|(at, _)| at % 256 == 0));
        let (last, len) = parts[parts.len() - 1];
        assert!(last + len <= a.bytes);
        // ~156 MB of logits and ~100 MB of token buffers.
        assert!(a.bytes < 280 << 20);
    }
}
