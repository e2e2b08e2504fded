//! The fixed 32-token vocabulary of the small-vocabulary synthetic tasks, so
//! a tiny model (vocab 32, a few layers, hidden 64) can learn them on a CPU
//! without a tokenizer.
//!
//! | id | text | meaning |
//! |---|---|---|
//! | 0-9 | `0`-`9` | digits |
//! | 10 | `<pad>` | padding (ignored in actions) |
//! | 11 | `<bos>` | start of an episode |
//! | 12 | `<eos>` | end of a policy segment (the stop token) |
//! | 13 | `+` | "add" sign of an instruction |
//! | 14 | `-` | "subtract" sign of an instruction |
//! | 15 | `=` | the target is next |
//! | 16 | `?` | a question: the policy answers |
//! | 17 | `<add>` | tool call: add the next digit to the register |
//! | 18 | `<get>` | tool call: read the register |
//! | 19 | `<ok>` | tool acknowledgement |
//! | 20 | `<err>` | error observation (malformed action) |
//! | 21 | `<done>` | the episode is over |
//! | 22 | `<compact>` | the context is full: write a summary (or save to the workspace) |
//! | 23 | `<memo>` | a summary or a stored value follows |
//! | 24 | `<put>` | workspace tool: store a value under a key |
//! | 25 | `<load>` | workspace tool: read the value under a key |
//! | 26 | `<reset>` | the context was cleared (workspace mode) |
//! | 27-30 | `<task>`, `<progress>`, `<state>`, `<next>` | sections of a structured summary |
//! | 31 | `<r31>` | reserved |

/// Number of ids in the vocabulary.
pub const VOCAB_SIZE: u32 = 32;
/// Padding.
pub const PAD: u32 = 10;
/// Start of an episode.
pub const BOS: u32 = 11;
/// End of a policy segment (the stop token of a token-level policy).
pub const EOS: u32 = 12;
/// `+`.
pub const PLUS: u32 = 13;
/// `-`.
pub const MINUS: u32 = 14;
/// `=`.
pub const EQUALS: u32 = 15;
/// `?`.
pub const QUERY: u32 = 16;
/// Tool call: add a digit to the register.
pub const ADD: u32 = 17;
/// Tool call: read the register.
pub const GET: u32 = 18;
/// Tool acknowledgement.
pub const OK: u32 = 19;
/// Error observation.
pub const ERR: u32 = 20;
/// End of episode.
pub const DONE: u32 = 21;
/// The context is full: the next turn is a summary (context management).
pub const COMPACT: u32 = 22;
/// A summary (after a restart) or a stored value (after `<load>`) follows.
pub const MEMO: u32 = 23;
/// Workspace tool: `<put> key value...` stores `value` under the digit `key`.
pub const PUT: u32 = 24;
/// Workspace tool: `<load> key` reads the value stored under `key`.
pub const LOAD: u32 = 25;
/// The context was cleared (workspace mode).
pub const RESET: u32 = 26;
/// Section markers of a structured summary, in their required order.
pub const SECTIONS: [u32; 4] = [27, 28, 29, 30];

const SPECIALS: [&str; 21] = [
    "<pad>",
    "<bos>",
    "<eos>",
    "+",
    "-",
    "=",
    "?",
    "<add>",
    "<get>",
    "<ok>",
    "<err>",
    "<done>",
    "<compact>",
    "<memo>",
    "<put>",
    "<load>",
    "<reset>",
    "<task>",
    "<progress>",
    "<state>",
    "<next>",
];

/// A token id outside the vocabulary or text that does not encode.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum VocabError {
    /// Token id `>= VOCAB_SIZE`.
    #[error("token id {id} at position {pos} is outside the {VOCAB_SIZE}-token vocabulary")]
    Id { id: u32, pos: usize },
    /// Text that is not a sequence of vocabulary entries.
    #[error("text at byte {pos} (`{rest}`) is not a vocabulary entry")]
    Text { pos: usize, rest: String },
}

/// The small vocabulary (stateless; all instances are equal).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SmallVocab;

impl SmallVocab {
    /// Number of ids (32).
    pub fn size(&self) -> u32 {
        VOCAB_SIZE
    }

    /// The id of digit `d` (0-9); `None` otherwise.
    pub fn digit(&self, d: u8) -> Option<u32> {
        (d < 10).then_some(u32::from(d))
    }

    /// The digit an id stands for, if it is a digit.
    pub fn as_digit(&self, id: u32) -> Option<u8> {
        u8::try_from(id).ok().filter(|d| *d < 10)
    }

    /// The text form of an id (`None` outside the vocabulary).
    pub fn token_text(&self, id: u32) -> Option<String> {
        match id {
            0..=9 => Some(id.to_string()),
            10..=30 => Some(SPECIALS[(id - 10) as usize].to_string()),
            31 => Some(format!("<r{id}>")),
            _ => None,
        }
    }

    /// Every `(id, text)` pair, in id order.
    pub fn entries(&self) -> Vec<(u32, String)> {
        (0..VOCAB_SIZE)
            .filter_map(|i| self.token_text(i).map(|t| (i, t)))
            .collect()
    }

    /// Encodes text written in the vocabulary's text forms; ASCII whitespace
    /// between entries is skipped. `"<bos>3 5<eos>"` -> `[11, 3, 5, 12]`.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, VocabError> {
        let mut out = Vec::new();
        let mut pos = 0;
        let b = text.as_bytes();
        'outer: while pos < b.len() {
            let c = b[pos];
            if c.is_ascii_whitespace() {
                pos += 1;
                continue;
            }
            if c.is_ascii_digit() {
                out.push(u32::from(c - b'0'));
                pos += 1;
                continue;
            }
            for id in 10..VOCAB_SIZE {
                let t = self.token_text(id).unwrap_or_default();
                if text[pos..].starts_with(&t) {
                    out.push(id);
                    pos += t.len();
                    continue 'outer;
                }
            }
            let rest: String = text[pos..].chars().take(12).collect();
            return Err(VocabError::Text { pos, rest });
        }
        Ok(out)
    }

    /// Decodes ids to their text forms, concatenated without separators
    /// (every entry re-encodes to itself, so `encode(decode(x)) == x`).
    pub fn decode(&self, ids: &[u32]) -> Result<String, VocabError> {
        let mut s = String::new();
        for (pos, &id) in ids.iter().enumerate() {
            s.push_str(&self.token_text(id).ok_or(VocabError::Id { id, pos })?);
        }
        Ok(s)
    }

    /// Like [`SmallVocab::decode`], with out-of-range ids written `<unk:ID>`.
    pub fn decode_lossy(&self, ids: &[u32]) -> String {
        ids.iter()
            .map(|&id| self.token_text(id).unwrap_or_else(|| format!("<unk:{id}>")))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn fixed_ids() {
        let v = SmallVocab;
        assert_eq!(v.encode("<bos>3 5<eos>").unwrap(), vec![BOS, 3, 5, EOS]);
        assert_eq!(v.encode("+-=?").unwrap(), vec![PLUS, MINUS, EQUALS, QUERY]);
        assert_eq!(
            v.encode("<add><get><ok><err><done><pad>").unwrap(),
            vec![ADD, GET, OK, ERR, DONE, PAD]
        );
        assert_eq!(
            v.encode("<compact><memo><put><load><reset><task><progress><state><next>")
                .unwrap(),
            vec![COMPACT, MEMO, PUT, LOAD, RESET, 27, 28, 29, 30]
        );
        assert_eq!(v.entries().len(), 32);
        assert_eq!(v.token_text(31).unwrap(), "<r31>");
        assert!(v.token_text(32).is_none());
        assert_eq!(v.digit(7), Some(7));
        assert_eq!(v.digit(10), None);
        assert_eq!(v.as_digit(EOS), None);
    }

    #[test]
    fn errors_name_the_position() {
        let v = SmallVocab;
        assert_eq!(
            v.decode(&[1, 99]).unwrap_err(),
            VocabError::Id { id: 99, pos: 1 }
        );
        let e = v.encode("12x").unwrap_err();
        assert!(matches!(e, VocabError::Text { pos: 2, .. }), "{e}");
        assert_eq!(v.decode_lossy(&[1, 99]), "1<unk:99>");
    }

    proptest! {
        #[test]
        fn roundtrip(ids in proptest::collection::vec(0u32..VOCAB_SIZE, 0..40)) {
            let v = SmallVocab;
            prop_assert_eq!(v.encode(&v.decode(&ids).unwrap()).unwrap(), ids);
        }
    }
}
