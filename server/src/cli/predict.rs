//! `rookery predict`: one forward pass of a model on this machine, on any
//! backend Rookery has (RavDL's `predict()`): what a Requester runs to try
//! the weights they downloaded. Inputs and outputs are `.npy` files.
//!
//! An ONNX model is imported at the inputs' shapes to run once
//! ([`rookery_model::onnx::import_file_fed`]): its first input is fed at run
//! time and any other is fixed to its values. The forward runs through
//! [`rookery_stage::Predictor`], which `rookery generate` samples with too,
//! on our kernels' CPU references, on a GPU through wgpu (feature `gpu`) or
//! on libtorch (feature `torch`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use rookery_job::data::{NpyData, read_npy, write_npy};
use rookery_job::weights::read_safetensors;
use rookery_model::onnx::{BoundInput, BoundValues};
use rookery_model::{DType, Graph, ParamKind};
use rookery_proto::tensor::{WireDType, WireTensor};
use rookery_stage::{BackendFactory, CpuDevice, OwnFactory, Predictor};

/// Where the model runs.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PredictBackend {
    /// Rookery's kernels, their CPU references.
    Cpu,
    /// libtorch on the CPU (a `rookery` built with feature `torch`).
    Torch,
    /// Rookery's WGSL kernels on a GPU through wgpu (a `rookery` built with
    /// feature `gpu`).
    Wgpu,
}

impl PredictBackend {
    pub fn name(self) -> &'static str {
        match self {
            PredictBackend::Cpu => "cpu",
            PredictBackend::Torch => "torch",
            PredictBackend::Wgpu => "wgpu",
        }
    }
}

#[derive(clap::Args, Debug)]
pub struct PredictArgs {
    /// The model: an ONNX file or a layer spec (`.toml`).
    #[arg(long)]
    pub model: PathBuf,
    /// Trained weights (safetensors, `state_dict` names: what `rookery
    /// train` and `rookery download` write). Default: an ONNX file's own
    /// initializers; a layer spec's seeded initial values.
    #[arg(long)]
    pub weights: Option<PathBuf>,
    /// A graph input and its value, `NAME=FILE.npy`; one per input.
    #[arg(long = "input", value_name = "NAME=FILE.npy", required = true)]
    pub inputs: Vec<String>,
    /// The folder each output is written to, as `NAME.npy`.
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: PredictBackend,
}

/// `rookery predict`: writes every output of one forward pass.
pub async fn run(args: PredictArgs) -> anyhow::Result<()> {
    let feeds = args
        .inputs
        .iter()
        .map(|arg| {
            let (name, file) = arg
                .split_once('=')
                .with_context(|| format!("--input `{arg}`: expected NAME=FILE.npy"))?;
            read_feed(name, Path::new(file))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let model = prepare(&args.model, args.weights.as_deref(), &feeds)?;
    for warning in &model.warnings {
        eprintln!("warning: {warning}");
    }
    let engine = Engine::open(args.backend).await?;
    let outputs = engine.forward(&model).await?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    let mut stems: Vec<String> = Vec::with_capacity(outputs.len());
    for y in &outputs {
        // Two names that differ only in characters a file name cannot hold
        // must not overwrite each other.
        let mut stem = file_stem(&y.name);
        if stems.contains(&stem) {
            stem = format!("{stem}_{}", stems.len());
        }
        stems.push(stem.clone());
        let path = args.out.join(format!("{stem}.npy"));
        write_output(&path, y)?;
        println!(
            "{}: {:?} {} -> {}",
            y.name,
            y.shape_usize(),
            y.dtype.as_str(),
            path.display()
        );
    }
    Ok(())
}

/// A `.npy` file as the value of graph input `name`: floats as f32,
/// integers and booleans as i64.
pub fn read_feed(name: &str, path: &Path) -> anyhow::Result<BoundInput> {
    let array = read_npy(path).with_context(|| format!("input `{name}`"))?;
    let values = if array.elem().is_float() {
        BoundValues::F32(array.to_f32())
    } else {
        BoundValues::I64(
            array
                .to_classes()
                .with_context(|| format!("input `{name}`"))?,
        )
    };
    Ok(BoundInput {
        name: name.to_string(),
        shape: array.shape().to_vec(),
        values,
    })
}

/// A model ready to run once: the graph, every parameter, and the input
/// fed at run time.
pub struct PreparedModel {
    /// The graph the backend runs: the outputs that are not constants.
    pub graph: Graph,
    pub params: Vec<WireTensor>,
    pub input: WireTensor,
    /// Every output, in the model's order.
    pub outputs: Vec<String>,
    /// Outputs the import folded to constants (`Shape` of the input, say):
    /// known without running anything, so no backend runs them.
    pub constants: Vec<WireTensor>,
    pub warnings: Vec<String>,
}

/// Loads `model` for one forward pass on `feeds`, with `weights` if given.
pub fn prepare(
    model: &Path,
    weights: Option<&Path>,
    feeds: &[BoundInput],
) -> anyhow::Result<PreparedModel> {
    let (graph, warnings) = match model.extension().and_then(|e| e.to_str()) {
        Some("onnx") => {
            let imported = rookery_model::onnx::import_file_fed(model, feeds)?;
            (imported.graph, imported.warnings)
        }
        Some("toml") => {
            let [feed] = feeds else {
                bail!("a layer spec has one input; {} given", feeds.len());
            };
            let Some((batch, sample)) = feed.shape.split_first() else {
                bail!("input `{}` has no batch dimension", feed.name);
            };
            let loaded = rookery_model::load::load_model_file(model, Some(sample), *batch)?;
            (loaded.graph, loaded.warnings)
        }
        _ => bail!(
            "{}: the model must be an ONNX file (.onnx) or a layer spec (.toml)",
            model.display()
        ),
    };
    let [input] = graph.inputs.as_slice() else {
        bail!(
            "the model reads {} run-time inputs; one is fed",
            graph.inputs.len()
        );
    };
    let feed = feeds
        .iter()
        .find(|f| f.name == input.name)
        .or(feeds.first().filter(|_| feeds.len() == 1))
        .with_context(|| format!("no value given for input `{}`", input.name))?;
    let input = match (&feed.values, input.dtype) {
        (BoundValues::F32(v), DType::F32) => {
            WireTensor::from_f32(&input.name, &feed.shape, v, WireDType::F32)
        }
        (BoundValues::I64(v), DType::F32) => {
            let v: Vec<f32> = v.iter().map(|&x| x as f32).collect();
            WireTensor::from_f32(&input.name, &feed.shape, &v, WireDType::F32)
        }
        (BoundValues::I64(v), DType::I64) => WireTensor::from_i64(&input.name, &feed.shape, v),
        (BoundValues::F32(_), DType::I64) => bail!(
            "input `{}` holds integers (int64) in the model; the file holds floats",
            input.name
        ),
    };
    let params = parameters(&graph, weights)?;
    let outputs = graph.outputs.clone();
    let mut graph = graph;
    let constants: Vec<WireTensor> = outputs
        .iter()
        .filter_map(|out| constant_output(&graph, &params, out))
        .collect();
    graph
        .outputs
        .retain(|o| !constants.iter().any(|c| c.name == *o));
    Ok(PreparedModel {
        graph,
        params,
        input,
        outputs,
        constants,
        warnings,
    })
}

/// Output `out`'s value where it is an `Identity` of a constant, as an
/// import to run once gives an output that does not depend on the input.
fn constant_output(graph: &Graph, params: &[WireTensor], out: &str) -> Option<WireTensor> {
    let node = graph.nodes.iter().find(|n| n.name == out)?;
    let [source] = node.inputs.as_slice() else {
        return None;
    };
    let is_constant = graph
        .param(source)
        .is_some_and(|p| p.kind == ParamKind::Constant);
    if node.op != rookery_model::Op::Identity || !is_constant {
        return None;
    }
    let mut value = params.iter().find(|p| p.name == *source)?.clone();
    value.name = out.to_string();
    Some(value)
}

/// Every parameter and buffer of `graph`: from the weights file by name
/// where one is given; constants (and buffers the file lacks, such as a
/// causal mask) as the model holds them.
pub fn parameters(graph: &Graph, weights: Option<&Path>) -> anyhow::Result<Vec<WireTensor>> {
    let mut by_name: BTreeMap<String, _> = match weights {
        Some(path) => read_safetensors(path)
            .with_context(|| format!("cannot read weights {}", path.display()))?
            .into_iter()
            .map(|w| (w.name.clone(), w))
            .collect(),
        None => BTreeMap::new(),
    };
    let shown = weights.map(|p| p.display().to_string()).unwrap_or_default();
    let mut out = Vec::with_capacity(graph.params.len());
    for p in &graph.params {
        let values = match by_name.remove(&p.name) {
            Some(w) if w.shape == p.shape => w.values,
            Some(w) => bail!(
                "{shown}: `{}` has shape {:?}, the model's is {:?}",
                p.name,
                w.shape,
                p.shape
            ),
            None if weights.is_some() && p.kind == ParamKind::Trainable => bail!(
                "{shown}: the weights lack `{}` ({:?}); are they this model's?",
                p.name,
                p.shape
            ),
            None => p.initial_values(0),
        };
        let dtype = crate::run::on_wire(p.dtype, WireDType::F32);
        out.push(WireTensor::from_f32(&p.name, &p.shape, &values, dtype));
    }
    Ok(out)
}

/// A backend, opened once (a GPU adapter is slow to open) and used for
/// any number of forward passes.
pub enum Engine {
    Cpu,
    #[cfg(feature = "torch")]
    Torch,
    #[cfg(feature = "gpu")]
    Wgpu(std::sync::Arc<rookery_stage::GpuDevice>),
}

impl Engine {
    pub async fn open(backend: PredictBackend) -> anyhow::Result<Engine> {
        match backend {
            PredictBackend::Cpu => Ok(Engine::Cpu),
            #[cfg(feature = "torch")]
            PredictBackend::Torch => Ok(Engine::Torch),
            #[cfg(not(feature = "torch"))]
            PredictBackend::Torch => {
                bail!("this rookery was built without libtorch (build it with feature `torch`)")
            }
            #[cfg(feature = "gpu")]
            PredictBackend::Wgpu => {
                let device = rookery_stage::GpuDevice::open().await.context(
                    "opening a GPU through wgpu (install a Vulkan, Metal or DX12 driver)",
                )?;
                Ok(Engine::Wgpu(std::sync::Arc::new(device)))
            }
            #[cfg(not(feature = "gpu"))]
            PredictBackend::Wgpu => {
                bail!("this rookery was built without wgpu (build it with feature `gpu`)")
            }
        }
    }

    /// What runs the model, in words (the GPU adapter's name for wgpu).
    pub fn describe(&self) -> String {
        match self {
            Engine::Cpu => "Rookery's CPU reference kernels".into(),
            #[cfg(feature = "torch")]
            Engine::Torch => "libtorch (CPU)".into(),
            #[cfg(feature = "gpu")]
            Engine::Wgpu(device) => device.context().adapter_description(),
        }
    }

    /// Every output of `model` for its input, in the model's order.
    pub async fn forward(&self, model: &PreparedModel) -> anyhow::Result<Vec<WireTensor>> {
        let mut computed = match model.graph.outputs.is_empty() {
            true => Vec::new(),
            false => self.run(model).await?,
        };
        let mut constants = model.constants.clone();
        model
            .outputs
            .iter()
            .map(|name| {
                let from = |list: &mut Vec<WireTensor>| {
                    let i = list.iter().position(|t| t.name == *name)?;
                    Some(list.swap_remove(i))
                };
                from(&mut computed)
                    .or_else(|| from(&mut constants))
                    .with_context(|| format!("the backend gave no output `{name}`"))
            })
            .collect()
    }

    async fn run(&self, model: &PreparedModel) -> anyhow::Result<Vec<WireTensor>> {
        match self {
            Engine::Cpu => forward_on(&mut OwnFactory::new(CpuDevice), model).await,
            #[cfg(feature = "torch")]
            Engine::Torch => forward_on(&mut rookery_torch::TorchStageFactory::cpu(), model).await,
            #[cfg(feature = "gpu")]
            Engine::Wgpu(device) => forward_on(&mut OwnFactory::new(device.clone()), model).await,
        }
    }
}

async fn forward_on<F: BackendFactory>(
    factory: &mut F,
    model: &PreparedModel,
) -> anyhow::Result<Vec<WireTensor>> {
    let mut predictor = Predictor::new(factory, &model.graph, &model.params)?;
    Ok(predictor.predict_all(&model.input).await?)
}

/// An output as `.npy`: integers as int64, floats as float32.
fn write_output(path: &Path, y: &WireTensor) -> anyhow::Result<()> {
    let shape = y.shape_usize();
    let written = if y.dtype.is_float() {
        write_npy(path, &shape, NpyData::F32(&y.to_f32()?))
    } else {
        write_npy(path, &shape, NpyData::I64(&y.to_i64()?))
    };
    written.with_context(|| format!("cannot write {}", path.display()))
}

/// A graph name as a file name: path separators and other odd characters
/// become `_`.
fn file_stem(name: &str) -> String {
    let stem: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect();
    match stem.trim_start_matches('.') {
        "" => "output".to_string(),
        s => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::file_stem;

    #[test]
    fn output_names_become_file_names_that_stay_in_the_folder() {
        for (name, stem) in [
            ("logits", "logits"),
            ("/blocks.0/Add_output_0", "_blocks.0_Add_output_0"),
            ("../../etc/passwd", "_.._etc_passwd"),
            ("..", "output"),
            ("", "output"),
            ("y:1", "y_1"),
        ] {
            assert_eq!(file_stem(name), stem, "{name}");
        }
    }
}
