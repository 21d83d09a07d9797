//! Token files for language models: one flat sequence of token ids, cut into
//! next-token windows on demand.
//!
//! A file is either raw little-endian ids (u16 or u32, the width from
//! `data.token_dtype` or the name: `train.u16`, `train.u32`, either maybe
//! followed by `.gz`) or a one-dimensional `.npy` of u16, u32, i32 or i64 ids
//! (recognised by its magic bytes). Either may be gzipped (gzip is recognised
//! by its magic bytes too).
//!
//! Window `k` is tokens `[k * seq_len, k * seq_len + seq_len + 1)`: its inputs
//! are the first `seq_len` of them and its labels the last `seq_len`, the next
//! token at every position. Windows follow each other at a stride of
//! `seq_len`, so a file of `n` tokens holds `(n - 1) / seq_len` windows and
//! every token but the first is a label exactly once. Only the ids are kept
//! (at their own width): a batch's windows are copied out when it is asked for.

use std::io::Read;
use std::path::Path;

use super::npy;
use super::raw::{Avail, ElemType, MAX_DECODED_BYTES, open_maybe_gz};
use crate::error::JobError;
pub use crate::file::TokenDType;
use crate::spec::DataRef;

/// Token ids at the width they were stored with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenIds {
    U16(Vec<u16>),
    U32(Vec<u32>),
}

impl TokenIds {
    pub fn len(&self) -> usize {
        match self {
            TokenIds::U16(v) => v.len(),
            TokenIds::U32(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The id at `i`. Panics if `i` is out of range.
    pub fn get(&self, i: usize) -> u32 {
        match self {
            TokenIds::U16(v) => u32::from(v[i]),
            TokenIds::U32(v) => v[i],
        }
    }

    /// Appends ids `range` to `out` as i64.
    fn extend_i64(&self, range: std::ops::Range<usize>, out: &mut Vec<i64>) {
        match self {
            TokenIds::U16(v) => out.extend(v[range].iter().map(|&t| i64::from(t))),
            TokenIds::U32(v) => out.extend(v[range].iter().map(|&t| i64::from(t))),
        }
    }

    /// The first id at or above `bound`, and where it is.
    pub fn first_at_or_above(&self, bound: u64) -> Option<(usize, u32)> {
        match self {
            TokenIds::U16(v) => v
                .iter()
                .position(|&t| u64::from(t) >= bound)
                .map(|i| (i, u32::from(v[i]))),
            TokenIds::U32(v) => v
                .iter()
                .position(|&t| u64::from(t) >= bound)
                .map(|i| (i, v[i])),
        }
    }
}

/// A token file cut into `seq_len + 1` windows at a stride of `seq_len`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenWindows {
    ids: TokenIds,
    seq_len: usize,
    /// The file, as shown in errors.
    source: String,
}

impl TokenWindows {
    /// Cuts `ids` into windows. Errors (naming `source` and `field`) when
    /// there are fewer than `seq_len + 1` ids.
    pub fn new(ids: TokenIds, seq_len: usize, source: impl Into<String>) -> Result<Self, JobError> {
        let source = source.into();
        if seq_len == 0 {
            return Err(JobError::field(
                "data.seq_len",
                "must be at least 1 (got 0)",
            ));
        }
        if ids.len() < seq_len + 1 {
            return Err(JobError::file(
                &source,
                format!(
                    "holds {} tokens, fewer than one window needs: data.seq_len + 1 = {}",
                    ids.len(),
                    seq_len + 1
                ),
            ));
        }
        Ok(TokenWindows {
            ids,
            seq_len,
            source,
        })
    }

    /// Reads a token file (see the module's documentation for the forms).
    /// `dtype` is `data.token_dtype`; without it a raw file's name must say
    /// its width.
    pub fn read(r: &DataRef, dtype: Option<TokenDType>, seq_len: usize) -> Result<Self, JobError> {
        let ids = read_ids(&r.path, dtype)?;
        Self::new(ids, seq_len, r.to_string())
    }

    /// Windows in the file.
    pub fn len(&self) -> usize {
        (self.ids.len() - 1) / self.seq_len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    pub fn ids(&self) -> &TokenIds {
        &self.ids
    }

    /// The file, as shown in errors.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The inputs of windows `idx`, in that order: `idx.len() * seq_len` ids.
    /// Panics if a window is out of range.
    pub fn gather_inputs(&self, idx: &[usize]) -> Vec<i64> {
        self.gather(idx, 0)
    }

    /// The labels of windows `idx` (each input's next token), in that order.
    /// Panics if a window is out of range.
    pub fn gather_labels(&self, idx: &[usize]) -> Vec<i64> {
        self.gather(idx, 1)
    }

    fn gather(&self, idx: &[usize], shift: usize) -> Vec<i64> {
        let mut out = Vec::with_capacity(idx.len() * self.seq_len);
        for &k in idx {
            assert!(k < self.len(), "window {k} of {}", self.len());
            let start = k * self.seq_len + shift;
            self.ids.extend_i64(start..start + self.seq_len, &mut out);
        }
        out
    }
}

/// Reads every id of a token file.
fn read_ids(path: &Path, dtype: Option<TokenDType>) -> Result<TokenIds, JobError> {
    let shown = path.display().to_string();
    let (mut r, avail) = open_maybe_gz(path)?;
    let mut magic = [0u8; 6];
    let got = read_up_to(&mut *r, &mut magic, &shown)?;
    if got == 6 && &magic == b"\x93NUMPY" {
        if let Some(d) = dtype {
            return Err(JobError::field(
                "data.token_dtype",
                format!(
                    "`{}` is given, but {shown} is a .npy file, whose header says its dtype; leave token_dtype out",
                    d.as_str()
                ),
            ));
        }
        let mut whole = std::io::Cursor::new(magic).chain(r);
        return npy_ids(npy::parse(&mut whole, avail, shown)?);
    }
    let named = TokenDType::from_file_name(path);
    let width = match (dtype, named) {
        (Some(d), Some(n)) if d != n => {
            return Err(JobError::field(
                "data.token_dtype",
                format!(
                    "is `{}`, but the file's name {shown} says {}",
                    d.as_str(),
                    n.as_str()
                ),
            ));
        }
        (Some(d), _) | (None, Some(d)) => d,
        (None, None) => {
            return Err(JobError::field(
                "data.token_dtype",
                format!(
                    "missing: say how wide {shown}'s token ids are with token_dtype = \"u16\" or \"u32\", \
                     or name the file *.u16 or *.u32 (or give a .npy file)"
                ),
            ));
        }
    };
    let mut carry = magic[..got].to_vec();
    let mut total = got as u64;
    let capacity = match avail {
        Avail::Real(len) => usize::try_from(len).unwrap_or(0) / width.size(),
        _ => 0,
    };
    let mut ids = match width {
        TokenDType::U16 => TokenIds::U16(Vec::with_capacity(capacity)),
        TokenDType::U32 => TokenIds::U32(Vec::with_capacity(capacity)),
    };
    // Chunk by chunk, so the bytes never exist beside the ids.
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = r.read(&mut buf).map_err(|e| {
            JobError::file(&shown, format!("cannot read (corrupt or truncated?): {e}"))
        })?;
        let end = n == 0;
        total += n as u64;
        if total > MAX_DECODED_BYTES {
            return Err(JobError::file(
                &shown,
                format!(
                    "holds more than {} GiB of token ids, the most one data file may; split it",
                    MAX_DECODED_BYTES >> 30
                ),
            ));
        }
        carry.extend_from_slice(&buf[..n]);
        let whole = carry.len() / width.size() * width.size();
        match &mut ids {
            TokenIds::U16(v) => v.extend(
                carry[..whole]
                    .chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]])),
            ),
            TokenIds::U32(v) => v.extend(
                carry[..whole]
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            ),
        }
        carry.drain(..whole);
        if end {
            break;
        }
    }
    if !carry.is_empty() {
        return Err(JobError::file(
            &shown,
            format!(
                "holds {total} bytes, not a whole number of {} token ids ({} bytes each): \
                 truncated, or not {} (data.token_dtype)?",
                width.as_str(),
                width.size(),
                width.as_str()
            ),
        ));
    }
    Ok(ids)
}

/// Fills `buf` as far as the stream goes; returns how much it filled.
fn read_up_to(r: &mut dyn Read, buf: &mut [u8], shown: &str) -> Result<usize, JobError> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(JobError::file(
                    shown,
                    format!("cannot read (corrupt or truncated?): {e}"),
                ));
            }
        }
    }
    Ok(got)
}

/// A `.npy` array's ids: one dimension of u16, u32, i32 or i64, none negative
/// or past u32.
fn npy_ids(a: super::RawArray) -> Result<TokenIds, JobError> {
    if a.shape().len() != 1 {
        return Err(JobError::file(
            a.source(),
            format!(
                "has shape {:?}; a token file holds one flat sequence of ids (save it with .ravel())",
                a.shape()
            ),
        ));
    }
    match a.elem() {
        ElemType::U16 => Ok(TokenIds::U16(
            a.to_classes()?.into_iter().map(|v| v as u16).collect(),
        )),
        ElemType::U32 | ElemType::I32 | ElemType::I64 => {
            let values = a.to_classes()?;
            if let Some((i, v)) = values
                .iter()
                .enumerate()
                .find(|(_, v)| u32::try_from(**v).is_err())
            {
                return Err(JobError::file(
                    a.source(),
                    format!("token id {v} at position {i} is not an id (0 to 4294967295)"),
                ));
            }
            Ok(TokenIds::U32(
                values.into_iter().map(|v| v as u32).collect(),
            ))
        }
        other => Err(JobError::file(
            a.source(),
            format!("holds {other:?} values; token ids must be u16, u32, i32 or i64"),
        )),
    }
}
