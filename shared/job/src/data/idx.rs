//! IDX files (MNIST's format): `00 00 TYPE NDIM`, NDIM big-endian u32
//! dimensions, then the big-endian elements.

use std::path::Path;

use super::raw::{ElemType, RawArray, numel, open_maybe_gz, read_header, read_payload};
use crate::error::JobError;

pub(crate) fn read(path: &Path) -> Result<RawArray, JobError> {
    let source = path.display().to_string();
    let (mut r, avail) = open_maybe_gz(path)?;
    let magic = read_header(&mut *r, 4, "IDX header", &source)?;
    if magic[0] != 0 || magic[1] != 0 {
        return Err(JobError::file(
            &source,
            format!(
                "not an IDX file: it starts with {:02x} {:02x}, expected 00 00",
                magic[0], magic[1]
            ),
        ));
    }
    let elem = match magic[2] {
        0x08 => ElemType::U8,
        0x09 => ElemType::I8,
        0x0B => ElemType::I16,
        0x0C => ElemType::I32,
        0x0D => ElemType::F32,
        0x0E => ElemType::F64,
        t => {
            return Err(JobError::file(
                &source,
                format!(
                    "unknown IDX element type 0x{t:02x} (expected 08 u8, 09 i8, 0b i16, 0c i32, 0d f32 or 0e f64)"
                ),
            ));
        }
    };
    let ndim = usize::from(magic[3]);
    if ndim == 0 {
        return Err(JobError::file(&source, "IDX header has no dimensions"));
    }
    let dims = read_header(&mut *r, 4 * ndim, "IDX dimensions", &source)?;
    let shape: Vec<usize> = dims
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as usize)
        .collect();
    let claimed = numel(&shape)
        .and_then(|n| n.checked_mul(elem.size() as u64))
        .ok_or_else(|| JobError::file(&source, format!("dimensions {shape:?} are too large")))?;
    let header_len = 4 + 4 * ndim as u64;
    let bytes = read_payload(&mut *r, claimed, avail.minus(header_len), &source)?;
    RawArray::new(shape, elem, true, bytes, source)
}
