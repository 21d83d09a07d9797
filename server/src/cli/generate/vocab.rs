//! The tokenizers `rookery generate` reads to encode a prompt and decode
//! what the model samples:
//!
//! - a Hugging Face `tokenizers` JSON file with a byte-level BPE model
//!   (GPT-2's scheme, as `examples/gpt/data/tokenizer.json` is): the
//!   pre-tokenizer's split, the byte-to-character table and the merges,
//!   written out here so decoding needs no Python;
//! - a character vocabulary: a JSON list of strings, id `i` being the `i`-th
//!   (`["a", "b", " ", ...]`); prompts encode by longest match.

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value;

/// Why a tokenizer file cannot be used or a prompt cannot be encoded.
#[derive(Debug, thiserror::Error)]
pub enum VocabError {
    #[error("cannot read tokenizer {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("tokenizer {path}: {reason}")]
    Format { path: String, reason: String },
    #[error("the prompt cannot be encoded: {0}")]
    Encode(String),
}

/// A loaded tokenizer.
#[derive(Debug, Clone)]
pub enum Vocab {
    Chars(Vec<String>),
    Bpe(Bpe),
}

/// Byte-level BPE: tokens are strings over GPT-2's byte alphabet.
#[derive(Debug, Clone)]
pub struct Bpe {
    ids: HashMap<String, u32>,
    tokens: Vec<String>,
    /// Added tokens (`<|endoftext|>`), decoded as written.
    special: HashMap<u32, String>,
    ranks: HashMap<(String, String), usize>,
}

impl Vocab {
    pub fn load(path: &Path) -> Result<Self, VocabError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| VocabError::Read {
            path: shown.clone(),
            source,
        })?;
        let format = |reason: String| VocabError::Format {
            path: shown.clone(),
            reason,
        };
        let json: Value = serde_json::from_str(&text).map_err(|e| format(e.to_string()))?;
        match json {
            Value::Array(items) => {
                let chars = items
                    .into_iter()
                    .enumerate()
                    .map(|(i, v)| match v {
                        Value::String(s) => Ok(s),
                        _ => Err(format(format!("entry {i} is not a string"))),
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                if chars.is_empty() {
                    return Err(format("the character list is empty".into()));
                }
                Ok(Vocab::Chars(chars))
            }
            Value::Object(_) => Bpe::from_json(&json).map(Vocab::Bpe).map_err(format),
            _ => Err(format(
                "expected a tokenizers JSON file or a JSON list of strings".into(),
            )),
        }
    }

    /// Whether there are no ids (never, for a loaded vocabulary).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of ids.
    pub fn len(&self) -> usize {
        match self {
            Vocab::Chars(c) => c.len(),
            Vocab::Bpe(b) => b.tokens.len(),
        }
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>, VocabError> {
        match self {
            Vocab::Chars(chars) => {
                let mut ids = Vec::new();
                let mut rest = text;
                while !rest.is_empty() {
                    let best = chars
                        .iter()
                        .enumerate()
                        .filter(|(_, c)| !c.is_empty() && rest.starts_with(c.as_str()))
                        .max_by_key(|(_, c)| c.len())
                        .ok_or_else(|| {
                            VocabError::Encode(format!(
                                "no token of the vocabulary starts {:?}",
                                rest.chars().take(10).collect::<String>()
                            ))
                        })?;
                    ids.push(best.0 as u32);
                    rest = &rest[best.1.len()..];
                }
                Ok(ids)
            }
            Vocab::Bpe(b) => b.encode(text),
        }
    }

    pub fn decode(&self, ids: &[u32]) -> String {
        match self {
            Vocab::Chars(chars) => ids
                .iter()
                .map(|&i| chars.get(i as usize).map_or("\u{fffd}", String::as_str))
                .collect(),
            Vocab::Bpe(b) => b.decode(ids),
        }
    }
}

/// GPT-2's table: every byte as a printable character (printable ASCII and
/// Latin-1 stand for themselves, the rest are shifted past 255).
fn byte_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut shifted = 0u32;
    for b in 0..=255u32 {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
        table[b as usize] = if printable {
            char::from_u32(b).unwrap_or('\0')
        } else {
            shifted += 1;
            char::from_u32(255 + shifted).unwrap_or('\0')
        };
    }
    table
}

impl Bpe {
    fn from_json(json: &Value) -> Result<Self, String> {
        let model = &json["model"];
        if model["type"] != "BPE" {
            return Err(format!(
                "model type {} is not supported (byte-level BPE or a character list)",
                model["type"]
            ));
        }
        let pre = &json["pre_tokenizer"]["type"];
        if pre != "ByteLevel" {
            return Err(format!(
                "pre-tokenizer {pre} is not supported (only ByteLevel)"
            ));
        }
        let vocab = model["vocab"]
            .as_object()
            .ok_or("model.vocab is not an object")?;
        let mut tokens = vec![String::new(); vocab.len()];
        let mut ids = HashMap::new();
        for (token, id) in vocab {
            let id = id
                .as_u64()
                .filter(|&i| (i as usize) < tokens.len())
                .ok_or_else(|| {
                    format!("token {token:?} has id {id}, outside 0..{}", tokens.len())
                })?;
            tokens[id as usize] = token.clone();
            ids.insert(token.clone(), id as u32);
        }
        let mut ranks = HashMap::new();
        for (rank, merge) in model["merges"]
            .as_array()
            .ok_or("model.merges is not a list")?
            .iter()
            .enumerate()
        {
            // Older files write "a b", newer ones ["a", "b"].
            let pair = match merge {
                Value::String(s) => s
                    .split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string())),
                Value::Array(p) => match p.as_slice() {
                    [Value::String(a), Value::String(b)] => Some((a.clone(), b.clone())),
                    _ => None,
                },
                _ => None,
            }
            .ok_or_else(|| format!("merge {rank} is not a pair"))?;
            ranks.entry(pair).or_insert(rank);
        }
        let mut special = HashMap::new();
        for added in json["added_tokens"].as_array().into_iter().flatten() {
            if let (Some(id), Some(content)) = (added["id"].as_u64(), added["content"].as_str()) {
                special.insert(id as u32, content.to_string());
            }
        }
        Ok(Bpe {
            ids,
            tokens,
            special,
            ranks,
        })
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, VocabError> {
        let table = byte_chars();
        let mut out = Vec::new();
        for piece in pre_tokenize(text) {
            let mut word: Vec<String> = piece
                .bytes()
                .map(|b| table[b as usize].to_string())
                .collect();
            // Merge the lowest-ranked adjacent pair until none is in the table.
            loop {
                let best = word
                    .windows(2)
                    .enumerate()
                    .filter_map(|(i, w)| {
                        self.ranks
                            .get(&(w[0].clone(), w[1].clone()))
                            .map(|&r| (r, i))
                    })
                    .min();
                let Some((_, i)) = best else { break };
                let merged = format!("{}{}", word[i], word[i + 1]);
                word.splice(i..i + 2, [merged]);
            }
            for symbol in word {
                let id = self.ids.get(&symbol).ok_or_else(|| {
                    VocabError::Encode(format!("symbol {symbol:?} is not in the vocabulary"))
                })?;
                out.push(*id);
            }
        }
        Ok(out)
    }

    fn decode(&self, ids: &[u32]) -> String {
        let table = byte_chars();
        let back: HashMap<char, u8> = table
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        let mut bytes = Vec::new();
        for &id in ids {
            if let Some(s) = self.special.get(&id) {
                bytes.extend_from_slice(s.as_bytes());
            } else if let Some(token) = self.tokens.get(id as usize) {
                bytes.extend(token.chars().filter_map(|c| back.get(&c)));
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

#[derive(PartialEq, Clone, Copy)]
enum Class {
    Letter,
    Number,
    Space,
    Other,
}

fn class(c: char) -> Class {
    if c.is_alphabetic() {
        Class::Letter
    } else if c.is_numeric() {
        Class::Number
    } else if c.is_whitespace() {
        Class::Space
    } else {
        Class::Other
    }
}

/// GPT-2's pre-tokenizer split, `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+|
/// ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`, written out (the lookahead is beyond
/// the `regex` crate).
fn pre_tokenize(text: &str) -> Vec<&str> {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let at = |i: usize| chars.get(i).map_or(text.len(), |&(b, _)| b);
    let mut pieces = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let rest = &text[at(i)..];
        if let Some(c) = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d"]
            .iter()
            .find(|c| rest.starts_with(**c))
        {
            let end = i + c.chars().count();
            pieces.push(&text[at(i)..at(end)]);
            i = end;
            continue;
        }
        let mut j = i;
        if chars[i].1 == ' '
            && chars
                .get(i + 1)
                .is_some_and(|&(_, c)| class(c) != Class::Space)
        {
            j += 1;
        }
        let kind = class(chars[j].1);
        let mut end = j + 1;
        if kind == Class::Space {
            while end < chars.len() && class(chars[end].1) == Class::Space {
                end += 1;
            }
            // The last space of a run goes with the word after it.
            if end < chars.len() && end - i > 1 {
                end -= 1;
            }
        } else {
            while end < chars.len() && class(chars[end].1) == kind {
                end += 1;
            }
        }
        pieces.push(&text[at(i)..at(end)]);
        i = end;
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pre_tokenizer_splits_as_gpt2_does() {
        assert_eq!(
            pre_tokenize("Hello  world, it's 42!\n\nYes"),
            [
                "Hello", " ", " world", ",", " it", "'s", " 42", "!", "\n", "\n", "Yes"
            ]
        );
    }

    #[test]
    fn byte_table_is_a_bijection() {
        let t = byte_chars();
        let distinct: std::collections::HashSet<char> = t.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
    }
}
