//! Structured mutations of valid inputs: bit flips, interesting bytes,
//! truncations, insertions (random bytes and LEB128 varints, the length
//! encoding of both postcard and protobuf), deletions, duplications,
//! splices of two seeds and, for text formats, token and line edits that
//! keep a file parseable far enough to reach the validation behind the syntax.
//!
//! A mutation is data ([`Mutation`]), so the benchmark draws them from a seeded
//! [`Rng`] and the proptests draw them from strategies that shrink.

/// What one mutation does. Positions are taken modulo the input's length, so
/// every mutation applies to every input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mutation {
    FlipBit {
        at: u32,
        bit: u8,
    },
    /// Overwrites a byte with one of [`INTERESTING_BYTES`].
    Interesting {
        at: u32,
        which: u8,
    },
    SetByte {
        at: u32,
        value: u8,
    },
    Truncate {
        at: u32,
    },
    Insert {
        at: u32,
        bytes: Vec<u8>,
    },
    Remove {
        at: u32,
        len: u16,
    },
    /// Copies `len` bytes from `from` to `to`.
    Duplicate {
        from: u32,
        len: u16,
        to: u32,
    },
    /// Keeps the input up to `at`, then another seed's bytes from `from`.
    Splice {
        seed: u16,
        at: u32,
        from: u32,
    },
    /// Inserts `value` as a LEB128 varint.
    Varint {
        at: u32,
        value: u64,
    },
    /// Text: replaces the `nth` token (a word, number or quoted string) with
    /// one of [`INTERESTING_TOKENS`].
    Token {
        nth: u16,
        which: u8,
    },
    /// Text: deletes, duplicates or moves down the `nth` line.
    Line {
        nth: u16,
        action: LineAction,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineAction {
    Delete,
    Duplicate,
    SwapWithNext,
}

pub const INTERESTING_BYTES: [u8; 8] = [0x00, 0x01, 0x7f, 0x80, 0xff, b'"', b'\n', b'['];

pub const INTERESTING_TOKENS: [&str; 24] = [
    "0",
    "-1",
    "1",
    "2",
    "65536",
    "4294967296",
    "9223372036854775807",
    "18446744073709551616",
    "-9223372036854775808",
    "1e308",
    "-1e308",
    "1e-320",
    "nan",
    "inf",
    "-inf",
    "true",
    "\"\"",
    "\"../x\"",
    "\"/etc/passwd\"",
    "\"data.npz:x\"",
    "[]",
    "{}",
    "[1, 0, 28]",
    "\"\u{feff}é\"",
];

fn pos(at: u32, len: usize) -> usize {
    if len == 0 { 0 } else { at as usize % (len + 1) }
}

/// Applies `ops` in order to `seeds[seed]`.
pub fn apply(seeds: &[Vec<u8>], seed: usize, ops: &[Mutation]) -> Vec<u8> {
    let mut out = seeds[seed % seeds.len()].clone();
    for op in ops {
        apply_one(&mut out, seeds, op);
    }
    out
}

fn apply_one(out: &mut Vec<u8>, seeds: &[Vec<u8>], op: &Mutation) {
    let len = out.len();
    match op {
        Mutation::FlipBit { at, bit } => {
            if len > 0 {
                out[*at as usize % len] ^= 1 << (bit % 8);
            }
        }
        Mutation::Interesting { at, which } => {
            if len > 0 {
                out[*at as usize % len] =
                    INTERESTING_BYTES[*which as usize % INTERESTING_BYTES.len()];
            }
        }
        Mutation::SetByte { at, value } => {
            if len > 0 {
                out[*at as usize % len] = *value;
            }
        }
        Mutation::Truncate { at } => out.truncate(pos(*at, len)),
        Mutation::Insert { at, bytes } => {
            let at = pos(*at, len);
            out.splice(at..at, bytes.iter().copied());
        }
        Mutation::Remove { at, len: n } => {
            let at = pos(*at, len);
            let end = (at + *n as usize).min(len);
            out.drain(at..end);
        }
        Mutation::Duplicate { from, len: n, to } => {
            let from = pos(*from, len);
            let end = (from + *n as usize).min(len);
            let chunk = out[from..end].to_vec();
            let to = pos(*to, len);
            out.splice(to..to, chunk);
        }
        Mutation::Splice { seed, at, from } => {
            let other = &seeds[*seed as usize % seeds.len()];
            out.truncate(pos(*at, len));
            out.extend_from_slice(&other[pos(*from, other.len()).min(other.len())..]);
        }
        Mutation::Varint { at, value } => {
            let at = pos(*at, len);
            let mut bytes = Vec::new();
            let mut v = *value;
            loop {
                let low = (v & 0x7f) as u8;
                v >>= 7;
                if v == 0 {
                    bytes.push(low);
                    break;
                }
                bytes.push(low | 0x80);
            }
            out.splice(at..at, bytes);
        }
        Mutation::Token { nth, which } => {
            let tokens = tokens(out);
            if !tokens.is_empty() {
                let (start, end) = tokens[*nth as usize % tokens.len()];
                let with = INTERESTING_TOKENS[*which as usize % INTERESTING_TOKENS.len()];
                out.splice(start..end, with.bytes());
            }
        }
        Mutation::Line { nth, action } => {
            let mut lines: Vec<Vec<u8>> = out.split(|&b| b == b'\n').map(<[u8]>::to_vec).collect();
            let i = *nth as usize % lines.len();
            match action {
                LineAction::Delete => {
                    lines.remove(i);
                }
                LineAction::Duplicate => {
                    let line = lines[i].clone();
                    lines.insert(i, line);
                }
                LineAction::SwapWithNext => {
                    if i + 1 < lines.len() {
                        lines.swap(i, i + 1);
                    }
                }
            }
            *out = lines.join(&b'\n');
        }
    }
}

/// Byte ranges of words, numbers and quoted strings.
fn tokens(text: &[u8]) -> Vec<(usize, usize)> {
    let word = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-' | b'+');
    let mut found = Vec::new();
    let mut i = 0;
    while i < text.len() {
        if text[i] == b'"' {
            let end = text[i + 1..]
                .iter()
                .position(|&b| b == b'"' || b == b'\n')
                .map_or(text.len(), |p| i + 1 + p + 1)
                .min(text.len());
            found.push((i, end));
            i = end;
        } else if word(text[i]) {
            let start = i;
            while i < text.len() && word(text[i]) {
                i += 1;
            }
            found.push((start, i));
        } else {
            i += 1;
        }
    }
    found
}

/// SplitMix64: small, fast, and the same stream everywhere.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next_u64() as u8).collect()
    }

    /// One random mutation; text ones only when `text`.
    pub fn mutation(&mut self, text: bool) -> Mutation {
        let at = self.next_u64() as u32;
        let kinds = if text { 11 } else { 9 };
        match self.below(kinds) {
            0 => Mutation::FlipBit {
                at,
                bit: self.below(8) as u8,
            },
            1 => Mutation::Interesting {
                at,
                which: self.next_u64() as u8,
            },
            2 => Mutation::SetByte {
                at,
                value: self.next_u64() as u8,
            },
            3 => Mutation::Truncate { at },
            4 => {
                let len = 1 + self.below(16) as usize;
                Mutation::Insert {
                    at,
                    bytes: self.bytes(len),
                }
            }
            5 => Mutation::Remove {
                at,
                len: 1 + self.below(64) as u16,
            },
            6 => Mutation::Duplicate {
                from: at,
                len: 1 + self.below(256) as u16,
                to: self.next_u64() as u32,
            },
            7 => Mutation::Splice {
                seed: self.next_u64() as u16,
                at,
                from: self.next_u64() as u32,
            },
            8 => {
                // Lengths and counts near the edges matter most.
                let bits = self.below(65);
                let value = if bits == 64 {
                    u64::MAX
                } else {
                    self.next_u64() & ((1u64 << bits) - 1)
                };
                Mutation::Varint { at, value }
            }
            9 => Mutation::Token {
                nth: self.next_u64() as u16,
                which: self.next_u64() as u8,
            },
            _ => Mutation::Line {
                nth: self.next_u64() as u16,
                action: match self.below(3) {
                    0 => LineAction::Delete,
                    1 => LineAction::Duplicate,
                    _ => LineAction::SwapWithNext,
                },
            },
        }
    }

    /// A fuzz input: usually a seed with one to four mutations, sometimes
    /// plain random bytes.
    pub fn input(&mut self, seeds: &[Vec<u8>], text: bool) -> (usize, Vec<u8>) {
        let seed = self.below(seeds.len() as u64) as usize;
        if self.below(32) == 0 {
            let len = self.below(512) as usize;
            return (seed, self.bytes(len));
        }
        let ops: Vec<Mutation> = (0..1 + self.below(4))
            .map(|_| self.mutation(text))
            .collect();
        (seed, apply(seeds, seed, &ops))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ops_do_what_they_say() {
        let seeds = vec![b"key = 12\nname = \"x\"".to_vec(), b"ABCDEF".to_vec()];
        let cases: Vec<(Mutation, &[u8])> = vec![
            (
                Mutation::FlipBit { at: 0, bit: 0 },
                b"jey = 12\nname = \"x\"",
            ),
            (Mutation::Truncate { at: 3 }, b"key"),
            (
                Mutation::Insert {
                    at: 0,
                    bytes: vec![b'!'],
                },
                b"!key = 12\nname = \"x\"",
            ),
            (Mutation::Remove { at: 3, len: 3 }, b"key12\nname = \"x\""),
            (
                Mutation::Splice {
                    seed: 1,
                    at: 4,
                    from: 2,
                },
                b"key CDEF",
            ),
            (
                Mutation::Varint { at: 0, value: 300 },
                b"\xac\x02key = 12\nname = \"x\"",
            ),
            (
                Mutation::Token { nth: 1, which: 1 },
                b"key = -1\nname = \"x\"",
            ),
            (Mutation::Token { nth: 3, which: 0 }, b"key = 12\nname = 0"),
            (
                Mutation::Line {
                    nth: 0,
                    action: LineAction::SwapWithNext,
                },
                b"name = \"x\"\nkey = 12",
            ),
            (
                Mutation::Line {
                    nth: 1,
                    action: LineAction::Delete,
                },
                b"key = 12",
            ),
        ];
        for (op, expected) in cases {
            let got = apply(&seeds, 0, std::slice::from_ref(&op));
            assert_eq!(
                String::from_utf8_lossy(&got),
                String::from_utf8_lossy(expected),
                "{op:?}"
            );
        }
        // Every op applies to an empty input too.
        let empty = vec![Vec::new()];
        let mut rng = Rng::new(7);
        for _ in 0..1000 {
            let op = rng.mutation(true);
            apply(&empty, 0, &[op]);
        }
    }

    #[test]
    fn the_rng_is_deterministic() {
        let (mut a, mut b) = (Rng::new(1), Rng::new(1));
        let seeds = vec![b"seed".to_vec()];
        for _ in 0..100 {
            assert_eq!(a.input(&seeds, true), b.input(&seeds, true));
        }
    }
}
