//! The one error type of this crate. Every message names what it is about: a
//! job-file field (`training.optimizer.lr`), a file, or both.

use rookery_model::load::LoadError;

#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The job file is not valid TOML or JSON.
    #[error("job file is not valid {format}: {reason}")]
    Syntax {
        format: &'static str,
        reason: String,
    },
    /// A job-file field is missing, of the wrong type, or out of range.
    /// `field` is its dotted path, e.g. `training.optimizer.lr`.
    #[error("{field}: {reason}")]
    Field { field: String, reason: String },
    /// A data or weights file cannot be read or is malformed. `path` is the
    /// file as shown to the user (with `:array` for a member of an archive).
    #[error("{path}: {reason}")]
    File { path: String, reason: String },
    /// The model file cannot be loaded (the message names the file).
    #[error(transparent)]
    Model(#[from] LoadError),
    /// Data and model (or data and schedule) do not fit together.
    #[error("{0}")]
    Mismatch(String),
    /// The labels do not fit the model's output or the loss (their shape, or
    /// a class out of range); [`crate::prepare`] names the labels' file.
    #[error("the labels: {0}")]
    Labels(String),
}

impl JobError {
    pub(crate) fn field(field: impl Into<String>, reason: impl Into<String>) -> Self {
        JobError::Field {
            field: field.into(),
            reason: reason.into(),
        }
    }

    pub(crate) fn file(path: impl std::fmt::Display, reason: impl Into<String>) -> Self {
        JobError::File {
            path: path.to_string(),
            reason: reason.into(),
        }
    }
}
