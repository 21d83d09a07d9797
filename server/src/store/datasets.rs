//! Datasets kept on the server: each folder under `<data dir>/datasets/`
//! (put there by whoever runs the server) is a dataset a Requester can pick
//! instead of uploading the files again. An upload names one; its files are
//! linked into the job's folder before the job is checked, so the job file
//! names them like uploaded files.

use std::path::{Component, Path, PathBuf};

use rookery_proto::api::{DatasetFile, DatasetInfo};

/// Why a dataset cannot join an upload.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    #[error("dataset `{0}`: a dataset is named by its folder name alone")]
    BadName(String),
    #[error("there is no dataset `{0}` on this server")]
    Missing(String),
    #[error("copying {path}: {source}")]
    Copy {
        path: String,
        source: std::io::Error,
    },
}

pub fn datasets_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("datasets")
}

/// Visible plain files and folders of `dir`, sorted by name.
fn visible(dir: &Path, want_dirs: bool) -> std::io::Result<Vec<(String, std::fs::Metadata)>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        // `metadata` follows links, so a linked file or folder counts as one.
        let Ok(meta) = std::fs::metadata(entry.path()) else {
            continue;
        };
        if !name.starts_with('.')
            && (if want_dirs {
                meta.is_dir()
            } else {
                meta.is_file()
            })
        {
            out.push((name, meta));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Every dataset with its files; none when the folder does not exist.
pub fn list(data_dir: &Path) -> std::io::Result<Vec<DatasetInfo>> {
    let root = datasets_dir(data_dir);
    if !root.is_dir() {
        return Ok(Vec::new());
    }
    visible(&root, true)?
        .into_iter()
        .map(|(name, _)| {
            let files = visible(&root.join(&name), false)?
                .into_iter()
                .map(|(file, meta)| DatasetFile {
                    name: file,
                    bytes: meta.len(),
                })
                .collect();
            Ok(DatasetInfo { name, files })
        })
        .collect()
}

/// A dataset name is one plain, visible folder name.
pub fn check_name(name: &str) -> Result<(), DatasetError> {
    let mut components = Path::new(name).components();
    let plain = matches!(components.next(), Some(Component::Normal(_)))
        && components.next().is_none()
        && !name.starts_with('.')
        && name.len() <= 255;
    if plain {
        Ok(())
    } else {
        Err(DatasetError::BadName(name.to_string()))
    }
}

/// Links (or, across file systems, copies) the dataset's files into `dest`,
/// leaving files the upload carried itself alone.
pub fn link_into(data_dir: &Path, name: &str, dest: &Path) -> Result<(), DatasetError> {
    check_name(name)?;
    let dir = datasets_dir(data_dir).join(name);
    let files = visible(&dir, false).map_err(|_| DatasetError::Missing(name.to_string()))?;
    for (file, _) in files {
        let to = dest.join(&file);
        if to.exists() {
            continue;
        }
        let from = dir.join(&file);
        if std::fs::hard_link(&from, &to).is_err() {
            std::fs::copy(&from, &to).map_err(|source| DatasetError::Copy {
                path: from.display().to_string(),
                source,
            })?;
        }
    }
    Ok(())
}
