//! NumPy `.npz` files: a zip (stored or deflated) of `.npy` files, one per
//! array, named `NAME.npy`.

use std::fs::File;

use super::raw::{Avail, RawArray};
use crate::error::JobError;
use crate::spec::DataRef;

pub(crate) fn read(r: &DataRef) -> Result<RawArray, JobError> {
    let file_shown = r.path.display().to_string();
    let file = File::open(&r.path)
        .map_err(|e| JobError::file(&file_shown, format!("cannot open: {e}")))?;
    let mut zip = zip::ZipArchive::new(file)
        .map_err(|e| JobError::file(&file_shown, format!("not a valid .npz (zip) file: {e}")))?;
    let mut names: Vec<String> = zip.file_names().map(str::to_string).collect();
    names.sort();
    let entry_name = match &r.member {
        Some(m) => {
            let with_ext = format!("{m}.npy");
            names
                .iter()
                .find(|n| **n == with_ext)
                .or_else(|| names.iter().find(|n| *n == m))
                .cloned()
                .ok_or_else(|| {
                    JobError::file(
                        &file_shown,
                        format!("has no array `{m}` (it holds: {})", list(&names)),
                    )
                })?
        }
        None => match names.as_slice() {
            [only] => only.clone(),
            _ => {
                return Err(JobError::file(
                    &file_shown,
                    format!(
                        "holds {} arrays ({}): name one as `{file_shown}:NAME`",
                        names.len(),
                        list(&names)
                    ),
                ));
            }
        },
    };
    let source = format!(
        "{file_shown}:{}",
        entry_name.strip_suffix(".npy").unwrap_or(&entry_name)
    );
    let mut entry = zip
        .by_name(&entry_name)
        .map_err(|e| JobError::file(&source, format!("cannot read the array: {e}")))?;
    let size = entry.size();
    super::npy::parse(&mut entry, Avail::Claimed(size), source)
}

fn list(names: &[String]) -> String {
    names
        .iter()
        .map(|n| n.strip_suffix(".npy").unwrap_or(n))
        .collect::<Vec<_>>()
        .join(", ")
}
