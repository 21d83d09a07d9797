//! `rookery plan`: the planner on a model file and a providers file, so a
//! Requester can see how a model would be split before submitting a job.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use rookery_model::{ClusterCount, Graph};
use rookery_plan::{PlanOptions, ProviderKind, ProviderSpec};
use serde::Deserialize;

#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// The model: an ONNX export (`.onnx`) or a layer-spec `.toml` file.
    #[arg(long)]
    pub model: PathBuf,
    /// One sample's shape, e.g. 1,28,28 (overrides the model file's own).
    #[arg(long)]
    pub input_shape: Option<String>,
    /// JSON list of providers: id, kind (native|browser), memory_gb, gflops, bandwidth_mbps.
    #[arg(long)]
    pub providers: PathBuf,
    /// Samples per micro-batch.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..))]
    pub micro_batch: u64,
    /// Number of data-parallel clusters, or `auto`.
    #[arg(long, default_value = "auto", value_parser = parse_clusters)]
    pub clusters: ClusterCount,
    /// Print the plan as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `rookery plan`: prints the plan of `args.model` over `args.providers`.
pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    let input_shape = args
        .input_shape
        .as_deref()
        .map(parse_shape)
        .transpose()
        .map_err(anyhow::Error::msg)?;
    let plan = plan(
        &args.model,
        input_shape.as_deref(),
        &args.providers,
        args.micro_batch as usize,
        args.clusters,
        args.json,
    )?;
    println!("{plan}");
    Ok(())
}

#[derive(Debug, thiserror::Error)]
pub enum PlanCliError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Model(#[from] rookery_model::load::LoadError),
    #[error("{path}: {reason}")]
    Providers { path: String, reason: String },
    /// The planner's own message says which constraint failed; it is shown
    /// inline rather than as a `source` so error chains print it once.
    #[error("no plan fits: {0}")]
    Plan(rookery_plan::PlanError),
}

impl From<rookery_plan::PlanError> for PlanCliError {
    fn from(error: rookery_plan::PlanError) -> Self {
        PlanCliError::Plan(error)
    }
}

/// One entry of `providers.json`, in the units people write.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProviderEntry {
    id: ProviderId,
    kind: String,
    memory_gb: f64,
    gflops: f64,
    bandwidth_mbps: f64,
    /// A browser's largest bindable buffer, in MiB (WebGPU's
    /// `maxStorageBufferBindingSize`, 128 MiB on most adapters).
    #[serde(default)]
    max_buffer_mb: Option<f64>,
}

/// Ids may be written as numbers or strings.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum ProviderId {
    Number(u64),
    Text(String),
}

/// Parses `1,28,28` (one sample, no batch dimension).
pub fn parse_shape(text: &str) -> Result<Vec<usize>, String> {
    let shape = text
        .split(',')
        .map(|part| match part.trim().parse::<usize>() {
            Ok(0) | Err(_) => Err(format!(
                "input shape {text:?} must be positive whole numbers separated by commas, like 1,28,28"
            )),
            Ok(size) => Ok(size),
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(shape)
}

/// Parses `auto` or a positive number of clusters.
pub fn parse_clusters(text: &str) -> Result<ClusterCount, String> {
    match text.trim() {
        "auto" => Ok(ClusterCount::Auto),
        number => match number.parse::<usize>() {
            Ok(count) if count > 0 => Ok(ClusterCount::Fixed(count)),
            _ => Err(format!(
                "clusters must be `auto` or a positive number, got {text:?}"
            )),
        },
    }
}

/// Reads a model (`.onnx` or layer-spec `.toml`), analysed at `micro_batch`.
/// `input_shape` (one sample) overrides a spec's own and is required for ONNX.
pub fn load_model(
    path: &Path,
    input_shape: Option<&[usize]>,
    micro_batch: usize,
) -> Result<Graph, PlanCliError> {
    let loaded = rookery_model::load::load_model_file(path, input_shape, micro_batch)?;
    for warning in &loaded.warnings {
        eprintln!("warning: {warning}");
    }
    Ok(loaded.graph)
}

/// Reads and validates `providers.json`.
pub fn load_providers(path: &Path) -> Result<Vec<ProviderSpec>, PlanCliError> {
    let shown = path.display().to_string();
    let providers_error = |reason: String| PlanCliError::Providers {
        path: shown.clone(),
        reason,
    };
    let entries: Vec<ProviderEntry> = serde_json::from_str(&read(path)?)
        .map_err(|e| providers_error(format!("not a list of providers: {e}")))?;
    if entries.is_empty() {
        return Err(providers_error("lists no providers".into()));
    }
    let mut seen = HashSet::new();
    entries
        .into_iter()
        .enumerate()
        .map(|(index, entry)| {
            let at = |reason: String| providers_error(format!("provider {index}: {reason}"));
            let id = match entry.id {
                ProviderId::Number(n) => n.to_string(),
                ProviderId::Text(text) => text,
            };
            if !seen.insert(id.clone()) {
                return Err(at(format!("id {id:?} appears twice")));
            }
            let kind = match entry.kind.as_str() {
                "native" => ProviderKind::Native,
                "browser" => ProviderKind::Browser,
                other => {
                    return Err(at(format!(
                        "kind must be `native` or `browser`, got {other:?}"
                    )));
                }
            };
            for (field, value) in [
                ("memory_gb", entry.memory_gb),
                ("gflops", entry.gflops),
                ("bandwidth_mbps", entry.bandwidth_mbps),
            ] {
                if !value.is_finite() || value <= 0.0 {
                    return Err(at(format!(
                        "{field} must be a positive number, got {value}"
                    )));
                }
            }
            if let Some(mb) = entry.max_buffer_mb
                && (!mb.is_finite() || mb <= 0.0)
            {
                return Err(at(format!(
                    "max_buffer_mb must be a positive number, got {mb}"
                )));
            }
            Ok(ProviderSpec {
                id,
                kind,
                memory_bytes: (entry.memory_gb * f64::from(1u32 << 30)) as u64,
                gflops: entry.gflops,
                bandwidth_mbps: entry.bandwidth_mbps,
                max_buffer_bytes: entry
                    .max_buffer_mb
                    .map(|mb| (mb * f64::from(1u32 << 20)) as u64),
            })
        })
        .collect()
}

/// Plans `model` over `providers`, rendered as a table or as JSON.
pub fn plan(
    model: &Path,
    input_shape: Option<&[usize]>,
    providers: &Path,
    micro_batch: usize,
    clusters: ClusterCount,
    json: bool,
) -> Result<String, PlanCliError> {
    let graph = load_model(model, input_shape, micro_batch)?;
    let providers = load_providers(providers)?;
    let options = PlanOptions {
        micro_batch,
        clusters,
        ..PlanOptions::default()
    };
    let plan = rookery_plan::clusterize(&graph, &providers, &options)?;
    Ok(if json {
        // The plan is plain data; serialising it cannot fail.
        plan.to_json().unwrap_or_default()
    } else {
        rookery_plan::render(&plan)
    })
}

fn read(path: &Path) -> Result<String, PlanCliError> {
    std::fs::read_to_string(path).map_err(|source| PlanCliError::Read {
        path: path.display().to_string(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_and_cluster_counts_parse_or_say_why() {
        assert_eq!(parse_shape("1,28,28"), Ok(vec![1, 28, 28]));
        assert_eq!(parse_shape(" 3, 32 ,32"), Ok(vec![3, 32, 32]));
        assert!(
            parse_shape("1,0")
                .unwrap_err()
                .contains("positive whole numbers")
        );
        assert!(parse_shape("a").is_err());
        assert_eq!(parse_clusters("auto"), Ok(ClusterCount::Auto));
        assert_eq!(parse_clusters("3"), Ok(ClusterCount::Fixed(3)));
        assert!(parse_clusters("0").is_err());
    }

    #[test]
    fn provider_files_are_validated_entry_by_entry() {
        let dir = tempfile::tempdir().unwrap();
        let cases = [
            ("[]", "lists no providers"),
            ("{}", "not a list of providers"),
            (
                r#"[{"id":1,"kind":"phone","memory_gb":1,"gflops":1,"bandwidth_mbps":1}]"#,
                "provider 0: kind must be",
            ),
            (
                r#"[{"id":1,"kind":"native","memory_gb":0,"gflops":1,"bandwidth_mbps":1}]"#,
                "provider 0: memory_gb must be a positive number",
            ),
            (
                r#"[{"id":"a","kind":"native","memory_gb":1,"gflops":1,"bandwidth_mbps":1},
                    {"id":"a","kind":"browser","memory_gb":1,"gflops":1,"bandwidth_mbps":1}]"#,
                "provider 1: id \"a\" appears twice",
            ),
        ];
        for (text, expected) in cases {
            let path = dir.path().join("providers.json");
            std::fs::write(&path, text).unwrap();
            let error = load_providers(&path).unwrap_err().to_string();
            assert!(error.contains(expected), "{text}: {error}");
        }
        let path = dir.path().join("providers.json");
        std::fs::write(
            &path,
            r#"[{"id":7,"kind":"browser","memory_gb":0.5,"gflops":20,"bandwidth_mbps":100}]"#,
        )
        .unwrap();
        let providers = load_providers(&path).unwrap();
        assert_eq!(providers[0].id, "7");
        assert_eq!(providers[0].memory_bytes, 512 << 20);
    }

    fn fixture(name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(name)
    }

    #[test]
    fn onnx_exports_and_layer_specs_both_plan() {
        let providers = fixture("examples/providers.json");
        for (model, shape) in [
            ("shared/model/fixtures/cnn.dynamo.onnx", vec![3, 16, 16]),
            ("shared/model/fixtures/resnet.legacy.onnx", vec![3, 16, 16]),
            ("examples/mnist-cnn.toml", vec![1, 28, 28]),
        ] {
            let out = plan(
                &fixture(model),
                Some(&shape),
                &providers,
                8,
                ClusterCount::Fixed(1),
                true,
            )
            .unwrap_or_else(|e| panic!("{model}: {e}"));
            let plan: serde_json::Value = serde_json::from_str(&out).unwrap();
            assert_eq!(
                plan["clusters"].as_array().map(Vec::len),
                Some(1),
                "{model}"
            );
        }
    }

    #[test]
    fn onnx_without_a_sample_shape_says_so() {
        let error = load_model(&fixture("shared/model/fixtures/mlp.dynamo.onnx"), None, 8)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("mlp.dynamo.onnx") && error.contains("shape of one input sample"),
            "{error}"
        );
    }
}
