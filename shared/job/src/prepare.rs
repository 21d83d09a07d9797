//! Job preparation: a job file's model and data read and checked against
//! each other, before any provider is touched. The server's upload handler
//! runs it before accepting a job (so a queued job has a readable model and
//! data that fit it), and its scheduler before planning one.

use rookery_model::{Analysis, Graph};

use crate::{Dataset, JobError, JobSpec, Split, load_split, validate_against_model};

/// Everything a job needs before any provider is touched.
#[derive(Debug)]
pub struct Prepared {
    pub spec: JobSpec,
    pub graph: Graph,
    pub analysis: Analysis,
    /// What the model's importer wants the Requester to know.
    pub warnings: Vec<String>,
    pub train: Dataset,
    pub test: Option<Dataset>,
}

/// Why a job cannot run, with the job file's field or file it is about
/// when there is one (so a form can show it next to that field).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct PrepareError {
    pub message: String,
    /// A dotted job-file field (`training.batch_size`) or a data or model
    /// file's path.
    pub field: Option<String>,
}

impl From<JobError> for PrepareError {
    fn from(error: JobError) -> Self {
        let field = match &error {
            JobError::Field { field, .. } => Some(field.clone()),
            JobError::File { path, .. } => Some(path.clone()),
            JobError::Model(_) => Some("model".into()),
            _ => None,
        };
        PrepareError {
            message: error.to_string(),
            field,
        }
    }
}

impl From<String> for PrepareError {
    fn from(message: String) -> Self {
        PrepareError {
            message,
            field: None,
        }
    }
}

/// Reads and checks a job's model and data against each other (blocking
/// work: files are read in full).
pub fn prepare(spec: JobSpec) -> Result<Prepared, PrepareError> {
    let loaded = spec.load_model()?;
    let loss = spec.training.loss;
    let mut train = load_split(&spec.data, Split::Train, loss)?
        .ok_or_else(|| "the job has no training data".to_string())?;
    let mut test = load_split(&spec.data, Split::Test, loss)?;
    // A label error names the labels' file.
    let naming = |labels: Option<&crate::spec::DataRef>, e: JobError| match (e, labels) {
        (JobError::Labels(reason), Some(file)) => JobError::file(file, reason),
        (e, _) => e,
    };
    validate_against_model(&loaded.graph, &spec.model.input_shape, &mut train, loss)
        .map_err(|e| naming(Some(&spec.data.train_labels), e))?;
    if let Some(test) = test.as_mut() {
        validate_against_model(&loaded.graph, &spec.model.input_shape, test, loss)
            .map_err(|e| naming(spec.data.test_labels.as_ref(), e))
            .map_err(|e| PrepareError {
                message: format!("test set: {e}"),
                ..PrepareError::from(e)
            })?;
    }
    let analysis = loaded
        .graph
        .analyze()
        .map_err(|e| PrepareError::from(e.to_string()))?;
    Ok(Prepared {
        spec,
        graph: loaded.graph,
        analysis,
        warnings: loaded.warnings,
        train,
        test,
    })
}
