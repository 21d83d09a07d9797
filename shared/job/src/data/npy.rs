//! NumPy `.npy` files, versions 1 to 3: magic `\x93NUMPY`, version, header
//! length, a Python dict literal header (`descr`, `fortran_order`, `shape`),
//! then the elements in C order.

use std::io::Read;
use std::path::Path;

use super::raw::{Avail, ElemType, RawArray, numel, open_maybe_gz, read_header, read_payload};
use crate::error::JobError;

/// Headers beyond this are not NumPy's (it pads to 64 bytes, and shapes are short).
const MAX_HEADER: u64 = 1 << 20;

/// Reads one `.npy` file (gzipped or not).
pub fn read(path: &Path) -> Result<RawArray, JobError> {
    let (mut r, avail) = open_maybe_gz(path)?;
    parse(&mut *r, avail, path.display().to_string())
}

/// Reads one `.npy` from `r`, which must end where its data ends.
pub(crate) fn parse(r: &mut dyn Read, avail: Avail, source: String) -> Result<RawArray, JobError> {
    let pre = read_header(r, 8, ".npy preamble", &source)?;
    if &pre[..6] != b"\x93NUMPY" {
        return Err(JobError::file(
            &source,
            "not a .npy file: it does not start with \\x93NUMPY",
        ));
    }
    let (major, minor) = (pre[6], pre[7]);
    let len_bytes = match major {
        1 => 2,
        2 | 3 => 4,
        _ => {
            return Err(JobError::file(
                &source,
                format!("unsupported .npy version {major}.{minor} (expected 1.0, 2.0 or 3.0)"),
            ));
        }
    };
    let len = read_header(r, len_bytes, ".npy header length", &source)?;
    let header_len = len
        .iter()
        .rev()
        .fold(0u64, |acc, &b| (acc << 8) | u64::from(b));
    if header_len > MAX_HEADER {
        return Err(JobError::file(
            &source,
            format!("the .npy header claims {header_len} bytes, more than a header can be"),
        ));
    }
    if let Avail::Real(have) | Avail::Claimed(have) = avail
        && header_len > have
    {
        return Err(JobError::file(
            &source,
            format!("truncated: the .npy header claims {header_len} bytes, the file has {have}"),
        ));
    }
    let header = read_header(r, header_len as usize, ".npy header", &source)?;
    let text = std::str::from_utf8(&header)
        .map_err(|_| JobError::file(&source, "the .npy header is not text"))?;
    let h = parse_header(text).map_err(|e| JobError::file(&source, format!(".npy header: {e}")))?;
    let (elem, big_endian) = parse_descr(&h.descr).map_err(|e| JobError::file(&source, e))?;
    if h.fortran_order && h.shape.iter().filter(|&&d| d > 1).count() > 1 {
        return Err(JobError::file(
            &source,
            "the array is in Fortran order (fortran_order: True); save it in C order \
             (np.save(f, np.ascontiguousarray(a)))",
        ));
    }
    let claimed = numel(&h.shape)
        .and_then(|n| n.checked_mul(elem.size() as u64))
        .ok_or_else(|| JobError::file(&source, format!("shape {:?} is too large", h.shape)))?;
    let prefix = 8 + len_bytes as u64 + header_len;
    let bytes = read_payload(r, claimed, avail.minus(prefix), &source)?;
    RawArray::new(h.shape, elem, big_endian, bytes, source)
}

/// Elements to write to a `.npy` file, row-major.
#[derive(Debug, Clone, Copy)]
pub enum NpyData<'a> {
    F32(&'a [f32]),
    I64(&'a [i64]),
}

/// Writes a version 1.0 `.npy` file NumPy reads with `np.load`.
pub fn write(path: &Path, shape: &[usize], data: NpyData) -> std::io::Result<()> {
    let (descr, bytes): (&str, Vec<u8>) = match data {
        NpyData::F32(v) => ("<f4", v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        NpyData::I64(v) => ("<i8", v.iter().flat_map(|x| x.to_le_bytes()).collect()),
    };
    let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
    let shape = match dims.as_slice() {
        [one] => format!("({one},)"),
        _ => format!("({})", dims.join(", ")),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    // NumPy pads the header with spaces to a multiple of 64 bytes, newline last.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    let len = u16::try_from(header.len()).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the shape is too long for a .npy header",
        )
    })?;
    let mut out = Vec::with_capacity(10 + header.len() + bytes.len());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&bytes);
    std::fs::write(path, out)
}

struct Header {
    descr: String,
    fortran_order: bool,
    shape: Vec<usize>,
}

/// `'<f4'` and friends: byte order, kind, size.
fn parse_descr(descr: &str) -> Result<(ElemType, bool), String> {
    let unsupported = || {
        format!(
            "unsupported dtype '{descr}' (expected one of <f2 <f4 <f8 |u1 <u2 <u4 <u8 |i1 <i2 <i4 <i8 |b1, or big-endian >)"
        )
    };
    let mut chars = descr.chars();
    let order = chars.next().ok_or_else(unsupported)?;
    let kind_size = chars.as_str();
    let elem = match kind_size {
        "f2" => ElemType::F16,
        "f4" => ElemType::F32,
        "f8" => ElemType::F64,
        "u1" | "b1" => ElemType::U8,
        "u2" => ElemType::U16,
        "u4" => ElemType::U32,
        "u8" => ElemType::U64,
        "i1" => ElemType::I8,
        "i2" => ElemType::I16,
        "i4" => ElemType::I32,
        "i8" => ElemType::I64,
        _ => return Err(unsupported()),
    };
    let big_endian = match order {
        '<' | '=' => false,
        '>' => true,
        '|' if elem.size() == 1 => false,
        _ => return Err(unsupported()),
    };
    Ok((elem, big_endian))
}

/// The header dict: `{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }`.
fn parse_header(text: &str) -> Result<Header, String> {
    let mut p = Cursor {
        s: text.as_bytes(),
        i: 0,
    };
    let (mut descr, mut fortran, mut shape) = (None, None, None);
    p.ws();
    p.expect(b'{')?;
    loop {
        p.ws();
        if p.eat(b'}') {
            break;
        }
        let key = p.string()?;
        p.ws();
        p.expect(b':')?;
        p.ws();
        match key.as_str() {
            "descr" => {
                if matches!(p.peek(), Some(b'[' | b'{')) {
                    return Err("structured dtypes are not supported".into());
                }
                descr = Some(p.string()?);
            }
            "fortran_order" => fortran = Some(p.boolean()?),
            "shape" => shape = Some(p.tuple()?),
            other => return Err(format!("unexpected key '{other}'")),
        }
        p.ws();
        if !p.eat(b',') {
            p.ws();
            p.expect(b'}')?;
            break;
        }
    }
    Ok(Header {
        descr: descr.ok_or("missing 'descr'")?,
        fortran_order: fortran.ok_or("missing 'fortran_order'")?,
        shape: shape.ok_or("missing 'shape'")?,
    })
}

struct Cursor<'a> {
    s: &'a [u8],
    i: usize,
}

impl Cursor<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn ws(&mut self) {
        while self.peek().is_some_and(|c| c.is_ascii_whitespace()) {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> bool {
        if self.peek() == Some(c) {
            self.i += 1;
            true
        } else {
            false
        }
    }

    fn expect(&mut self, c: u8) -> Result<(), String> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(format!("expected '{}' at offset {}", c as char, self.i))
        }
    }

    fn string(&mut self) -> Result<String, String> {
        let q = match self.peek() {
            Some(q @ (b'\'' | b'"')) => q,
            _ => return Err(format!("expected a quoted string at offset {}", self.i)),
        };
        self.i += 1;
        let start = self.i;
        while let Some(c) = self.peek() {
            if c == q {
                let s = String::from_utf8_lossy(&self.s[start..self.i]).into_owned();
                self.i += 1;
                return Ok(s);
            }
            self.i += 1;
        }
        Err("unterminated string".into())
    }

    fn boolean(&mut self) -> Result<bool, String> {
        let rest = &self.s[self.i..];
        if rest.starts_with(b"True") {
            self.i += 4;
            Ok(true)
        } else if rest.starts_with(b"False") {
            self.i += 5;
            Ok(false)
        } else {
            Err(format!("expected True or False at offset {}", self.i))
        }
    }

    fn tuple(&mut self) -> Result<Vec<usize>, String> {
        self.expect(b'(')?;
        let mut dims = Vec::new();
        loop {
            self.ws();
            if self.eat(b')') {
                return Ok(dims);
            }
            dims.push(self.int()?);
            self.ws();
            if !self.eat(b',') {
                self.ws();
                self.expect(b')')?;
                return Ok(dims);
            }
        }
    }

    fn int(&mut self) -> Result<usize, String> {
        let start = self.i;
        let mut v: usize = 0;
        while let Some(c @ b'0'..=b'9') = self.peek() {
            v = v
                .checked_mul(10)
                .and_then(|v| v.checked_add(usize::from(c - b'0')))
                .ok_or("a dimension is too large")?;
            self.i += 1;
        }
        if self.i == start {
            return Err(format!("expected a dimension at offset {}", self.i));
        }
        self.eat(b'L'); // Python 2's long literals
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::{NpyData, read, write};
    use crate::data::ElemType;

    #[test]
    fn written_arrays_read_back_with_their_shape_and_values() {
        let dir = tempfile::tempdir().unwrap();
        let f32s = [1.5f32, -2.0, 3.25, f32::MAX, 0.0, -0.0];
        let i64s = [i64::MIN, -1, 0, 7, i64::MAX, 42];
        let cases: [(&[usize], NpyData); 5] = [
            (&[], NpyData::F32(&f32s[..1])),
            (&[6], NpyData::F32(&f32s)),
            (&[2, 3], NpyData::F32(&f32s)),
            (&[3, 1, 2], NpyData::I64(&i64s)),
            (&[0, 4], NpyData::I64(&[])),
        ];
        for (i, (shape, data)) in cases.into_iter().enumerate() {
            let path = dir.path().join(format!("{i}.npy"));
            write(&path, shape, data).unwrap();
            let back = read(&path).unwrap();
            assert_eq!(back.shape(), shape, "case {i}");
            match data {
                NpyData::F32(v) => {
                    assert_eq!(back.elem(), ElemType::F32);
                    assert_eq!(back.to_f32(), v);
                }
                NpyData::I64(v) => {
                    assert_eq!(back.elem(), ElemType::I64);
                    assert_eq!(back.to_classes().unwrap(), v);
                }
            }
            // NumPy's own layout: the data starts on a 64-byte boundary.
            let bytes = std::fs::read(&path).unwrap();
            let header = usize::from(u16::from_le_bytes([bytes[8], bytes[9]]));
            assert_eq!((10 + header) % 64, 0, "case {i}");
        }
    }
}
