//! Reading a model file from disk, whichever way it was written: an ONNX export
//! (with its external-data side file beside it) or a layer-spec TOML file. The
//! one entry point for every tool that takes a model path (`rookery plan`, job
//! files), so they accept the same files and word their errors alike.

use std::path::Path;

use crate::graph::Graph;
use crate::onnx;
use crate::spec::ModelSpec;

/// A model read from a file, plus anything its author should hear about.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedModel {
    pub graph: Graph,
    pub warnings: Vec<String>,
}

/// Why a model file could not be used. The message names the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct LoadError {
    pub path: String,
    /// The whole message, starting with the file.
    pub message: String,
}

/// Reads `path` (`.onnx` or `.toml`). `sample_shape` is one sample's shape
/// without the batch dimension; it overrides a layer spec's own
/// `input_shape`, and is required for ONNX. `batch` is the example batch the
/// graph is analysed at (a micro-batch size, say); shapes stay valid for
/// other batch sizes.
pub fn load_model_file(
    path: &Path,
    sample_shape: Option<&[usize]>,
    batch: usize,
) -> Result<LoadedModel, LoadError> {
    let shown = path.display().to_string();
    let fail = |reason: String| LoadError {
        path: shown.clone(),
        message: format!("{shown}: {reason}"),
    };
    match path.extension().and_then(|e| e.to_str()) {
        Some("toml") => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| fail(format!("cannot read the file: {e}")))?;
            let mut spec = ModelSpec::from_toml(&text).map_err(|e| fail(e.to_string()))?;
            if let Some(shape) = sample_shape {
                spec.input_shape = shape.to_vec();
            }
            let graph = spec.to_graph().map_err(|e| fail(e.to_string()))?;
            Ok(LoadedModel {
                graph,
                warnings: spec.warnings(),
            })
        }
        Some("onnx") => {
            let Some(sample) = sample_shape else {
                return Err(fail(
                    "an ONNX model needs the shape of one input sample (e.g. 1,28,28)".into(),
                ));
            };
            let mut shape = vec![batch.max(1)];
            shape.extend_from_slice(sample);
            // The importer's own errors already name the file.
            let imported = onnx::import_file(path, &shape).map_err(|e| LoadError {
                path: shown.clone(),
                message: e.to_string(),
            })?;
            Ok(LoadedModel {
                graph: imported.graph,
                warnings: imported.warnings,
            })
        }
        _ => Err(fail(
            "unknown model format: expected an ONNX export (.onnx) or a layer spec (.toml)".into(),
        )),
    }
}
