//! CSV data: one sample a row of comma-separated numbers (surrounding spaces
//! and double quotes are ignored; quoted commas are not supported). A first
//! row that is not all numbers is a header and skipped; blank lines are skipped.

use std::path::Path;

use super::raw::{ElemType, MAX_DECODED_BYTES, RawArray, open_maybe_gz, read_to_end_capped};
use crate::error::JobError;

pub(crate) fn read(path: &Path) -> Result<RawArray, JobError> {
    let source = path.display().to_string();
    let (mut r, _) = open_maybe_gz(path)?;
    let bytes = read_to_end_capped(&mut *r, MAX_DECODED_BYTES, &source)?;
    let text = std::str::from_utf8(&bytes)
        .map_err(|e| JobError::file(&source, format!("not UTF-8 text: {e}")))?;
    let mut cols: Option<usize> = None;
    let mut rows = 0usize;
    // Straight to the bytes the array holds: no second f64 copy of the file.
    let mut data: Vec<u8> = Vec::new();
    let mut first = true;
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let fields: Vec<&str> = line
            .split(',')
            .map(|f| f.trim().trim_matches('"').trim())
            .collect();
        let parsed: Result<Vec<f64>, usize> = fields
            .iter()
            .enumerate()
            .map(|(c, f)| f.parse::<f64>().map_err(|_| c))
            .collect();
        let was_first = std::mem::replace(&mut first, false);
        match parsed {
            Ok(row) => {
                let want = *cols.get_or_insert(row.len());
                if row.len() != want {
                    return Err(JobError::file(
                        &source,
                        format!("line {}: {} values, expected {want}", i + 1, row.len()),
                    ));
                }
                data.extend(row.iter().flat_map(|v| v.to_le_bytes()));
                rows += 1;
            }
            Err(_) if was_first => {} // a header row
            Err(c) => {
                return Err(JobError::file(
                    &source,
                    format!(
                        "line {}, column {}: `{}` is not a number",
                        i + 1,
                        c + 1,
                        fields.get(c).copied().unwrap_or_default()
                    ),
                ));
            }
        }
    }
    let Some(cols) = cols else {
        return Err(JobError::file(&source, "no data rows"));
    };
    RawArray::new(vec![rows, cols], ElemType::F64, false, data, source)
}
