//! Plain-Rust planning of the dedicated decode step: batch-size buckets,
//! block-table widths, the one input buffer a step uploads, the activation
//! arena, and the keys of captured graphs. Nothing here touches a device,
//! so all of it is tested on the CPU.

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

/// One sequence of a decode step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeRow<'a> {
    /// The token to run (its KV is written at `slot`).
    pub token: u32,
    pub position: u32,
    pub slot: u32,
    /// The sequence's block table (covering `position`).
    pub table: &'a [u32],
    /// `1 / T` of its sampling; 0 is greedy.
    pub inv_temperature: f32,
    /// Its uniform draw in [0, 1) (unused when greedy).
    pub u: f64,
}

/// Word offsets of the parts of a step's one upload (u32 words): for a
/// bucket of `B` rows and tables `W` wide,
/// `[ids: B | positions: B | slots: B | seq: B | tables: B x W | pad to
/// even | sampling: 3B f64 as (row, 1/T, u)]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InputLayout {
    pub bucket: usize,
    pub table_width: usize,
    pub ids: usize,
    pub positions: usize,
    pub slots: usize,
    pub seq: usize,
    pub tables: usize,
    /// Even, so the f64s are 8-byte aligned.
    pub params: usize,
    pub words: usize,
}

impl InputLayout {
    pub fn new(key: GraphKey) -> Self {
        let (b, w) = (key.bucket, key.table_width);
        let tables = 4 * b;
        let params = (tables + b * w).next_multiple_of(2);
        InputLayout {
            bucket: b,
            table_width: w,
            ids: 0,
            positions: b,
            slots: 2 * b,
            seq: 3 * b,
            tables,
            params,
            words: params + 6 * b,
        }
    }

    /// The step's upload. Rows past `rows.len()` are padding: token 0 at
    /// position 0, a slot past the cache (`no_slot`: nothing written), an
    /// all-zero table, greedy. Errors (naming the row) when there are more
    /// rows than the bucket or a table is wider than the layout.
    pub fn pack(&self, rows: &[DecodeRow<'_>], no_slot: u32) -> Result<Vec<u32>, String> {
        if rows.len() > self.bucket {
            return Err(format!(
                "{} rows for a bucket of {}",
                rows.len(),
                self.bucket
            ));
        }
        let mut buf = vec![0u32; self.words];
        for b in 0..self.bucket {
            buf[self.seq + b] = b as u32;
            buf[self.slots + b] = no_slot;
            let p = self.params + 6 * b;
            buf[p..p + 2].copy_from_slice(&words_of(b as f64));
        }
        for (b, r) in rows.iter().enumerate() {
            if r.table.len() > self.table_width {
                return Err(format!(
                    "row {b}: a table of {} blocks in a layout {} wide",
                    r.table.len(),
                    self.table_width
                ));
            }
            buf[self.ids + b] = r.token;
            buf[self.positions + b] = r.position;
            buf[self.slots + b] = r.slot;
            let t = self.tables + b * self.table_width;
            buf[t..t + r.table.len()].copy_from_slice(r.table);
            let p = self.params + 6 * b;
            buf[p + 2..p + 4].copy_from_slice(&words_of(r.inv_temperature as f64));
            buf[p + 4..p + 6].copy_from_slice(&words_of(r.u));
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

/// Byte offsets of a decode step's activations in one arena, sized for
/// `rows` rows (the largest bucket): every buffer starts 256-byte aligned.
/// A smaller bucket uses the first rows of each buffer, so one arena (and
/// its addresses, which captured graphs keep) serves every bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaPlan {
    pub rows: usize,
    /// f32 `[rows, hidden]`.
    pub resid: usize,
    /// bf16 `[rows, hidden]`: a norm's output.
    pub normed: usize,
    /// bf16 `[rows, heads * head_dim]`, `[rows, kv_heads * head_dim]` x 2.
    pub q: usize,
    pub k: usize,
    pub v: usize,
    /// bf16 `[rows, heads, head_dim]`: RoPE'd queries.
    pub q_rope: usize,
    /// bf16 `[rows, heads * head_dim]`: attention output.
    pub attn: usize,
    /// bf16 `[rows, hidden]`: the O or down projection (added to the
    /// residual by the next norm).
    pub delta: usize,
    /// bf16 `[rows, intermediate]` x 3: gate, up, silu(gate) * up.
    pub gate: usize,
    pub up: usize,
    pub act: usize,
    /// f32 `[rows, vocab]`.
    pub logits: usize,
    /// u32 `[rows, 3]`: sampled token, logprob bits, entropy bits.
    pub sampled: usize,
    pub bytes: usize,
}

impl ArenaPlan {
    pub fn new(d: &Dims, rows: usize) -> Self {
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
        ArenaPlan {
            rows,
            resid: take(rows * h * 4),
            normed: take(rows * h * 2),
            q: take(rows * q * 2),
            k: take(rows * kv * 2),
            v: take(rows * kv * 2),
            q_rope: take(rows * q * 2),
            attn: take(rows * q * 2),
            delta: take(rows * h * 2),
            gate: take(rows * i * 2),
            up: take(rows * i * 2),
            act: take(rows * i * 2),
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

    #[test]
    fn inputs_pack_into_their_parts_with_padding_rows() {
        let key = GraphKey {
            bucket: 4,
            table_width: 4,
        };
        let l = InputLayout::new(key);
        assert_eq!((l.tables, l.params % 2, l.words), (16, 0, l.params + 24));
        let (ta, tb) = ([7u32, 3], [9u32, 1, 4]);
        let rows = [
            DecodeRow {
                token: 11,
                position: 20,
                slot: 51,
                table: &ta,
                inv_temperature: 0.0,
                u: 0.0,
            },
            DecodeRow {
                token: 12,
                position: 40,
                slot: 66,
                table: &tb,
                inv_temperature: 1.25,
                u: 0.375,
            },
        ];
        let buf = l.pack(&rows, 999).unwrap();
        assert_eq!(&buf[l.ids..l.ids + 4], &[11, 12, 0, 0]);
        assert_eq!(&buf[l.positions..l.positions + 4], &[20, 40, 0, 0]);
        assert_eq!(&buf[l.slots..l.slots + 4], &[51, 66, 999, 999]);
        assert_eq!(&buf[l.seq..l.seq + 4], &[0, 1, 2, 3]);
        assert_eq!(&buf[l.tables..l.tables + 8], &[7, 3, 0, 0, 9, 1, 4, 0]);
        assert!(buf[l.tables + 8..l.tables + 16].iter().all(|&w| w == 0));
        let f = |b: usize, k: usize| {
            let p = l.params + 6 * b + 2 * k;
            f64::from_bits(buf[p] as u64 | (buf[p + 1] as u64) << 32)
        };
        assert_eq!((f(0, 0), f(0, 1), f(0, 2)), (0.0, 0.0, 0.0));
        assert_eq!((f(1, 0), f(1, 1), f(1, 2)), (1.0, 1.25, 0.375));
        // Padding rows sample their own row, greedily.
        assert_eq!((f(3, 0), f(3, 1)), (3.0, 0.0));
        let wide = [0u32; 5];
        let bad = [DecodeRow {
            table: &wide,
            ..rows[0]
        }];
        assert!(l.pack(&bad, 999).unwrap_err().contains("row 0"));
        assert!(l.pack(&[rows[0]; 5], 999).is_err());
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
        let a = ArenaPlan::new(&d, 256);
        let mut parts = [
            (a.resid, 256 * 1024 * 4),
            (a.normed, 256 * 1024 * 2),
            (a.q, 256 * 2048 * 2),
            (a.k, 256 * 1024 * 2),
            (a.v, 256 * 1024 * 2),
            (a.q_rope, 256 * 2048 * 2),
            (a.attn, 256 * 2048 * 2),
            (a.delta, 256 * 1024 * 2),
            (a.gate, 256 * 3072 * 2),
            (a.up, 256 * 3072 * 2),
            (a.act, 256 * 3072 * 2),
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
        // The logits dominate: ~156 MB of ~170 MB.
        assert!(a.bytes < 180 << 20);
    }
}
