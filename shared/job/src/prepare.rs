//! Job preparation: a job file's model and data read and checked against
//! each other, before any provider is touched. The server's upload handler
//! runs it before accepting a job (so a queued job has a readable model and
//! data that fit it), and its scheduler before planning one.

use rookery_model::{Analysis, Graph};

use crate::data::position_tables;
use crate::{
    DataFormat, Dataset, JobError, JobSpec, ModelSource, Split, load_split, validate_against_model,
};

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
    if let Some(e) = seq_len_beyond_export(&spec) {
        return Err(e.into());
    }
    let loaded = match spec.load_model() {
        Ok(loaded) => loaded,
        Err(e) => return Err(seq_len_beyond_positions(&spec).unwrap_or(e).into()),
    };
    if let Some(e) = positions_error(&spec, &loaded.graph) {
        return Err(e.into());
    }
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
        .map_err(|e| naming(spec.data.train_labels.as_ref(), e))?;
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
    let mut warnings = loaded.warnings;
    warnings.extend(double_softmax(&loaded.graph, loss));
    Ok(Prepared {
        spec,
        graph: loaded.graph,
        analysis,
        warnings,
        train,
        test,
    })
}

/// A warning when the model's output is a Softmax and the loss is
/// cross-entropy, which applies its own log-softmax to logits: the
/// probabilities would be softmaxed twice (a common slip when porting a
/// Keras or RavDL model, whose last layer often holds the softmax).
pub fn double_softmax(graph: &rookery_model::Graph, loss: rookery_model::Loss) -> Option<String> {
    if !matches!(loss, rookery_model::Loss::CrossEntropy { .. }) {
        return None;
    }
    let output = graph.outputs.first()?;
    let last = graph.nodes.iter().find(|n| &n.name == output)?;
    let kind = match last.op {
        rookery_model::Op::Softmax { .. } => "Softmax",
        // softmax(-x): probabilities too, not logits.
        rookery_model::Op::Softmin { .. } => "Softmin",
        _ => return None,
    };
    Some(format!(
        "the model ends in {kind} (`{output}`) and the loss is cross-entropy, which takes \
         logits and applies its own log-softmax: a softmax is applied twice. Remove the \
         last {kind} (PyTorch's nn.CrossEntropyLoss expects logits too)"
    ))
}

/// A token job's `data.seq_len` against the sequence dimension an ONNX
/// export fixed (the exporter bakes it into the graph's shape arithmetic).
fn seq_len_beyond_export(spec: &JobSpec) -> Option<JobError> {
    let seq_len = spec
        .data
        .seq_len
        .filter(|_| spec.data.format == DataFormat::Tokens)?;
    let ModelSource::Onnx(path) = &spec.model.source else {
        return None;
    };
    let dims = rookery_model::onnx::declared_input_dims(path).ok()??;
    let fixed = (*dims.get(1)?)?;
    (seq_len as u64 > fixed).then(|| {
        let shown: Vec<String> = dims
            .iter()
            .map(|d| d.map_or_else(|| "dynamic".to_string(), |d| d.to_string()))
            .collect();
        JobError::field(
            "data.seq_len",
            format!(
                "{seq_len} is longer than the {fixed} positions {} was exported for (its input \
                 is declared [{}]); use data.seq_len and model.input_shape of at most {fixed}, \
                 or export with a dynamic sequence dimension",
                path.display(),
                shown.join(", ")
            ),
        )
    })
}

/// Why a token job's model does not load at `data.seq_len`, when the cause
/// is that its position table has fewer rows (the importer then finds an
/// `arange` index out of range): loaded with windows of one token, the
/// model shows its position tables. `None` when that does not explain it.
fn seq_len_beyond_positions(spec: &JobSpec) -> Option<JobError> {
    spec.data
        .seq_len
        .filter(|_| spec.data.format == DataFormat::Tokens)?;
    let mut short = spec.clone();
    short.model.input_shape = vec![1];
    let graph = short.load_model().ok()?.graph;
    positions_error(spec, &graph)
}

/// `data.seq_len` against the rows of the model's position tables.
fn positions_error(spec: &JobSpec, graph: &Graph) -> Option<JobError> {
    let seq_len = spec
        .data
        .seq_len
        .filter(|_| spec.data.format == DataFormat::Tokens)?;
    let (table, rows) = position_tables(graph)
        .into_iter()
        .min_by_key(|&(_, rows)| rows)?;
    (seq_len > rows).then(|| {
        JobError::field(
            "data.seq_len",
            format!(
                "{seq_len} is longer than the model's {rows} positions (its position table \
                 `{table}` has {rows} rows); use data.seq_len and model.input_shape of at most {rows}"
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rookery_model::Loss;

    #[test]
    fn a_softmax_before_cross_entropy_is_warned_about_and_nothing_else_is() {
        let ending = |last: &str| {
            rookery_model::from_toml(&format!(
                "input_shape = [4]\n[[layers]]\ntype = \"Dense\"\nunits = 3\n{last}"
            ))
            .unwrap()
        };
        let softmax = ending("[[layers]]\ntype = \"Activation\"\nname = \"softmax\"\n");
        // (graph, loss, warned)
        let cases = [
            (&softmax, Loss::cross_entropy(), true),
            (&softmax, Loss::Mse, false),
            (
                &ending("[[layers]]\ntype = \"Activation\"\nname = \"log_softmax\"\n"),
                Loss::cross_entropy(),
                false,
            ),
            (
                &ending("[[layers]]\ntype = \"Activation\"\nname = \"softmin\"\n"),
                Loss::cross_entropy(),
                true,
            ),
            (
                &ending("[[layers]]\ntype = \"Activation\"\nname = \"logsigmoid\"\n"),
                Loss::cross_entropy(),
                false,
            ),
            (&ending(""), Loss::cross_entropy(), false),
        ];
        for (graph, loss, warned) in cases {
            let warning = double_softmax(graph, loss);
            assert_eq!(warning.is_some(), warned, "{loss:?}: {warning:?}");
        }
        assert!(
            double_softmax(&softmax, Loss::cross_entropy())
                .unwrap()
                .contains("twice")
        );
    }
}
