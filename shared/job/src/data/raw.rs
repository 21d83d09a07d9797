//! An array as a file stores it (shape, element type, bytes), and the reading
//! helpers every format shares: transparent gzip, and payload reads checked
//! against the size the header claims before anything large is allocated.

use std::fs::File;
use std::io::{BufRead, BufReader, ErrorKind, Read};
use std::path::Path;

use crate::error::JobError;

/// Element type of an array in a data file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ElemType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    U64,
    I64,
    F16,
    Bf16,
    F32,
    F64,
}

impl ElemType {
    pub fn size(self) -> usize {
        match self {
            ElemType::U8 | ElemType::I8 => 1,
            ElemType::U16 | ElemType::I16 | ElemType::F16 | ElemType::Bf16 => 2,
            ElemType::U32 | ElemType::I32 | ElemType::F32 => 4,
            ElemType::U64 | ElemType::I64 | ElemType::F64 => 8,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(
            self,
            ElemType::F16 | ElemType::Bf16 | ElemType::F32 | ElemType::F64
        )
    }
}

/// One element, widened.
#[derive(Clone, Copy)]
enum Num {
    Int(i128),
    Float(f64),
}

/// An array read from a data file: row-major, with its first dimension the
/// sample index when it is a dataset's inputs or labels.
#[derive(Debug, Clone)]
pub struct RawArray {
    shape: Vec<usize>,
    elem: ElemType,
    big_endian: bool,
    bytes: Vec<u8>,
    source: String,
}

impl RawArray {
    /// `bytes` must hold exactly the elements `shape` and `elem` describe.
    pub(crate) fn new(
        shape: Vec<usize>,
        elem: ElemType,
        big_endian: bool,
        bytes: Vec<u8>,
        source: String,
    ) -> Result<Self, JobError> {
        let expected = numel(&shape)
            .and_then(|n| n.checked_mul(elem.size() as u64))
            .ok_or_else(|| JobError::file(&source, format!("shape {shape:?} is too large")))?;
        if expected != bytes.len() as u64 {
            return Err(JobError::file(
                &source,
                format!(
                    "shape {shape:?} of {elem:?} needs {expected} bytes, found {}",
                    bytes.len()
                ),
            ));
        }
        Ok(RawArray {
            shape,
            elem,
            big_endian,
            bytes,
            source,
        })
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn elem(&self) -> ElemType {
        self.elem
    }

    /// The file (and array) it was read from, as shown in errors.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.elem.size()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    fn nums(&self) -> impl Iterator<Item = Num> + '_ {
        let (elem, be) = (self.elem, self.big_endian);
        self.bytes
            .chunks_exact(elem.size())
            .map(move |c| decode(elem, be, c))
    }

    /// Every element as f32 (large integers round).
    pub fn to_f32(&self) -> Vec<f32> {
        self.map_f32(|x| x)
    }

    /// Every element as f32, through `f`.
    pub fn map_f32(&self, f: impl Fn(f32) -> f32) -> Vec<f32> {
        if self.elem == ElemType::U8 {
            // The common case (images), without the widening detour.
            return self.bytes.iter().map(|&b| f(f32::from(b))).collect();
        }
        self.nums()
            .map(|n| {
                f(match n {
                    Num::Int(v) => v as f32,
                    Num::Float(v) => v as f32,
                })
            })
            .collect()
    }

    /// Every element as f64 (integers beyond 2^53 round).
    pub fn to_f64(&self) -> Vec<f64> {
        self.nums()
            .map(|n| match n {
                Num::Int(v) => v as f64,
                Num::Float(v) => v,
            })
            .collect()
    }

    /// Every element as an integer class: integer types as they are, floats
    /// only when integral (`3.0`); anything else is an error naming the index.
    pub fn to_classes(&self) -> Result<Vec<i64>, JobError> {
        self.nums()
            .enumerate()
            .map(|(i, n)| {
                let v = match n {
                    Num::Int(v) => i64::try_from(v).ok(),
                    Num::Float(v)
                        if v.is_finite() && v.fract() == 0.0 && (-9.2e18..=9.2e18).contains(&v) =>
                    {
                        Some(v as i64)
                    }
                    Num::Float(_) => None,
                };
                v.ok_or_else(|| {
                    let shown = match n {
                        Num::Int(v) => v.to_string(),
                        Num::Float(v) => v.to_string(),
                    };
                    JobError::file(
                        &self.source,
                        format!("label {shown} at index {i} is not an integer class"),
                    )
                })
            })
            .collect()
    }
}

fn decode(elem: ElemType, be: bool, c: &[u8]) -> Num {
    fn word<const N: usize>(c: &[u8], be: bool) -> [u8; N] {
        let mut a = [0u8; N];
        a.copy_from_slice(&c[..N]);
        if be {
            a.reverse();
        }
        a // little-endian from here on
    }
    match elem {
        ElemType::U8 => Num::Int(i128::from(c[0])),
        ElemType::I8 => Num::Int(i128::from(c[0] as i8)),
        ElemType::U16 => Num::Int(i128::from(u16::from_le_bytes(word(c, be)))),
        ElemType::I16 => Num::Int(i128::from(i16::from_le_bytes(word(c, be)))),
        ElemType::U32 => Num::Int(i128::from(u32::from_le_bytes(word(c, be)))),
        ElemType::I32 => Num::Int(i128::from(i32::from_le_bytes(word(c, be)))),
        ElemType::U64 => Num::Int(i128::from(u64::from_le_bytes(word(c, be)))),
        ElemType::I64 => Num::Int(i128::from(i64::from_le_bytes(word(c, be)))),
        ElemType::F16 => Num::Float(half::f16::from_bits(u16::from_le_bytes(word(c, be))).to_f64()),
        ElemType::Bf16 => {
            Num::Float(half::bf16::from_bits(u16::from_le_bytes(word(c, be))).to_f64())
        }
        ElemType::F32 => Num::Float(f64::from(f32::from_le_bytes(word(c, be)))),
        ElemType::F64 => Num::Float(f64::from_le_bytes(word(c, be))),
    }
}

/// Product of the dimensions, `None` on overflow.
pub(crate) fn numel(shape: &[usize]) -> Option<u64> {
    shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
}

/// Most bytes one data array may decode to from a compressed stream or a
/// zip entry. The server holds every job's data in memory, and a gzip
/// member can expand about a thousandfold, so an upload well within the
/// upload limit could otherwise claim (and fill) all of the server's memory.
pub const MAX_DECODED_BYTES: u64 = 4 << 30;

/// How many bytes are known to follow what has been read so far.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Avail {
    /// A plain file's real remaining length: safe to allocate up front.
    Real(u64),
    /// A length a container claims (a zip entry's size): checked, not trusted.
    Claimed(u64),
    /// A decompression stream.
    Unknown,
}

impl Avail {
    pub(crate) fn minus(self, n: u64) -> Avail {
        match self {
            Avail::Real(a) => Avail::Real(a.saturating_sub(n)),
            Avail::Claimed(a) => Avail::Claimed(a.saturating_sub(n)),
            Avail::Unknown => Avail::Unknown,
        }
    }

    fn known(self) -> Option<u64> {
        match self {
            Avail::Real(a) | Avail::Claimed(a) => Some(a),
            Avail::Unknown => None,
        }
    }
}

/// Opens `path`, decompressing transparently when it starts with gzip's magic
/// bytes (1f 8b), whatever its name.
pub(crate) fn open_maybe_gz(path: &Path) -> Result<(Box<dyn Read>, Avail), JobError> {
    let shown = path.display().to_string();
    let file = File::open(path).map_err(|e| JobError::file(&shown, format!("cannot open: {e}")))?;
    let len = file
        .metadata()
        .map_err(|e| JobError::file(&shown, format!("cannot read: {e}")))?
        .len();
    let mut reader = BufReader::new(file);
    let head = reader
        .fill_buf()
        .map_err(|e| JobError::file(&shown, format!("cannot read: {e}")))?;
    if head.starts_with(&[0x1f, 0x8b]) {
        Ok((
            Box::new(flate2::bufread::MultiGzDecoder::new(reader)),
            Avail::Unknown,
        ))
    } else {
        Ok((Box::new(reader), Avail::Real(len)))
    }
}

fn too_large(source: &str, bytes: u64) -> JobError {
    JobError::file(
        source,
        format!(
            "decompresses to {bytes} bytes, more than the {} GiB one data array may hold; \
             split the data or send it uncompressed",
            MAX_DECODED_BYTES >> 30
        ),
    )
}

/// Reads the rest of `r` whole, refusing to decode more than `cap` bytes.
pub(crate) fn read_to_end_capped(
    r: &mut dyn Read,
    cap: u64,
    source: &str,
) -> Result<Vec<u8>, JobError> {
    let mut bytes = Vec::new();
    r.take(cap.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| read_error(source, &e))?;
    if bytes.len() as u64 > cap {
        return Err(JobError::file(
            source,
            format!(
                "decompresses to more than {cap} bytes, the most one data array may hold; \
                 split the data or send it uncompressed"
            ),
        ));
    }
    Ok(bytes)
}

fn read_error(source: &str, e: &std::io::Error) -> JobError {
    JobError::file(source, format!("cannot read (corrupt or truncated?): {e}"))
}

/// Reads exactly `n` header bytes (`n` is small: callers bound it).
pub(crate) fn read_header(
    r: &mut dyn Read,
    n: usize,
    what: &str,
    source: &str,
) -> Result<Vec<u8>, JobError> {
    let mut buf = vec![0u8; n];
    r.read_exact(&mut buf).map_err(|e| {
        if e.kind() == ErrorKind::UnexpectedEof {
            JobError::file(
                source,
                format!("truncated: the file ends inside the {what}"),
            )
        } else {
            read_error(source, &e)
        }
    })?;
    Ok(buf)
}

/// Reads the `claimed` bytes of data that must end the file. A plain file's
/// length is checked first, so nothing is allocated for a size it cannot
/// hold; streams grow the buffer only as data actually arrives.
pub(crate) fn read_payload(
    r: &mut dyn Read,
    claimed: u64,
    avail: Avail,
    source: &str,
) -> Result<Vec<u8>, JobError> {
    let mismatch = |have: u64, known: bool| {
        let more = if known { "" } else { " or more" };
        if have < claimed {
            JobError::file(
                source,
                format!(
                    "truncated: the header claims {claimed} bytes of data, the file has {have}"
                ),
            )
        } else {
            JobError::file(
                source,
                format!(
                    "{}{more} unexpected bytes after the {claimed} bytes of data the header claims",
                    have - claimed
                ),
            )
        }
    };
    if let Some(have) = avail.known()
        && have != claimed
    {
        return Err(mismatch(have, true));
    }
    if !matches!(avail, Avail::Real(_)) && claimed > MAX_DECODED_BYTES {
        return Err(too_large(source, claimed));
    }
    let capacity = match avail {
        Avail::Real(_) => claimed,
        Avail::Claimed(_) | Avail::Unknown => claimed.min(1 << 24),
    };
    let capacity = usize::try_from(capacity)
        .map_err(|_| JobError::file(source, format!("{claimed} bytes is too large")))?;
    let mut buf = Vec::with_capacity(capacity);
    r.take(claimed.saturating_add(1))
        .read_to_end(&mut buf)
        .map_err(|e| read_error(source, &e))?;
    if buf.len() as u64 != claimed {
        return Err(mismatch(buf.len() as u64, buf.len() as u64 <= claimed));
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capped_reads_stop_one_byte_past_the_cap() {
        let mut stream = std::io::repeat(0);
        let err = read_to_end_capped(&mut stream, 1000, "bomb.csv").unwrap_err();
        assert!(err.to_string().contains("more than 1000 bytes"), "{err}");
        let exact = read_to_end_capped(&mut &[7u8; 1000][..], 1000, "ok.csv").unwrap();
        assert_eq!(exact.len(), 1000);
    }
}
