//! Layer-spec import: a sequential list of layers in RavDL's vocabulary (TOML),
//! for people who write models without PyTorch. Parameter names follow what
//! PyTorch's `nn.Sequential` would put in its `state_dict` (`0.weight`,
//! `2.running_mean`, ...), so weights trained here load into the equivalent
//! PyTorch model. An `activation` written inside a Dense/Conv2D layer counts as
//! its own module, as it must be in `nn.Sequential`, and shifts later indices.

use serde::{Deserialize, Serialize};

use crate::error::{GraphError, SpecError};
use crate::graph::{Graph, Input, Node, Param, ParamKind};
use crate::init::Init;
use crate::ops::{Op, OpError};
use crate::tensor::{DType, TensorInfo};

/// A whole layer-spec file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    #[serde(default)]
    pub name: Option<String>,
    /// Shape of one sample, without the batch dimension.
    pub input_shape: Vec<usize>,
    /// Defaults to f32, or i64 when the first layer is an Embedding.
    #[serde(default)]
    pub input_dtype: Option<DType>,
    pub layers: Vec<LayerSpec>,
}

/// One dimension given as `3` or `[3, 3]`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Pair {
    One(usize),
    Two([usize; 2]),
}

impl Pair {
    fn get(self) -> [usize; 2] {
        match self {
            Pair::One(v) => [v, v],
            Pair::Two(v) => v,
        }
    }
}

/// Padding given as a number, a pair, or `"valid"` / `"same"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Padding {
    Size(Pair),
    Named(String),
}

impl Default for Padding {
    fn default() -> Self {
        Padding::Size(Pair::One(0))
    }
}

fn one() -> Pair {
    Pair::One(1)
}
fn yes() -> bool {
    true
}
fn default_eps() -> f32 {
    1e-5
}
fn default_momentum() -> f32 {
    0.1
}
fn last_axis() -> i64 {
    -1
}

/// One layer, tagged by `type` with RavDL's names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", deny_unknown_fields)]
pub enum LayerSpec {
    Dense {
        #[serde(alias = "n_units")]
        units: usize,
        #[serde(default)]
        activation: Option<String>,
        #[serde(default = "yes", alias = "use_bias")]
        bias: bool,
    },
    Conv2D {
        #[serde(alias = "nb_filters", alias = "out_channels")]
        filters: usize,
        /// RavDL's and PyTorch's: the input's channels, which Rookery
        /// infers; checked when given.
        #[serde(default)]
        in_channels: Option<usize>,
        /// PyTorch's: only `zeros` (its default) is supported.
        #[serde(default)]
        padding_mode: Option<String>,
        kernel_size: Pair,
        #[serde(default = "one", alias = "strides")]
        stride: Pair,
        #[serde(default)]
        padding: Padding,
        #[serde(default = "one")]
        dilation: Pair,
        #[serde(default = "one_usize")]
        groups: usize,
        #[serde(default = "yes")]
        bias: bool,
        #[serde(default)]
        activation: Option<String>,
    },
    MaxPooling2D {
        #[serde(alias = "kernel_size")]
        pool_size: Pair,
        #[serde(default, alias = "strides")]
        stride: Option<Pair>,
        #[serde(default)]
        padding: Padding,
    },
    AveragePooling2D {
        #[serde(alias = "kernel_size")]
        pool_size: Pair,
        #[serde(default, alias = "strides")]
        stride: Option<Pair>,
        #[serde(default)]
        padding: Padding,
    },
    GlobalAveragePooling2D,
    /// `momentum` is PyTorch's: the share of each batch's statistics in
    /// the running ones (0.1); Keras's convention (the share kept, 0.99)
    /// gets a warning ([`ModelSpec::warnings`]).
    BatchNormalization1D {
        #[serde(default = "default_eps", alias = "epsilon")]
        eps: f32,
        #[serde(default = "default_momentum")]
        momentum: f32,
        /// Only `true`: the layer always learns a weight and a bias.
        #[serde(default = "yes")]
        affine: bool,
    },
    BatchNormalization2D {
        #[serde(default = "default_eps", alias = "epsilon")]
        eps: f32,
        #[serde(default = "default_momentum")]
        momentum: f32,
        #[serde(default = "yes")]
        affine: bool,
    },
    LayerNormalization {
        #[serde(default = "default_eps", alias = "epsilon")]
        eps: f32,
    },
    Dropout {
        #[serde(alias = "p")]
        rate: f32,
    },
    /// An activation by torch's name (or Keras's spelling), with torch's
    /// arguments and defaults; an argument the activation does not take is
    /// refused naming it.
    Activation {
        name: String,
        /// For softmax, log_softmax and softmin (torch's `dim`; default -1).
        #[serde(default, alias = "dim", skip_serializing_if = "Option::is_none")]
        axis: Option<i64>,
        /// leaky_relu's slope (default 0.01).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        negative_slope: Option<f32>,
        /// elu's alpha (default 1), or leaky_relu's slope under Keras's name.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        alpha: Option<f32>,
        /// softplus's (default 1).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        beta: Option<f32>,
        /// softplus's (default 20) and threshold's (required).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        threshold: Option<f32>,
        /// hardshrink's and softshrink's (default 0.5).
        #[serde(default, alias = "lambda", skip_serializing_if = "Option::is_none")]
        lambd: Option<f32>,
        /// hardtanh's ends (defaults -1 and 1).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        min_val: Option<f32>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_val: Option<f32>,
        /// threshold's replacement value (required; Keras's `default_value`).
        #[serde(
            default,
            alias = "default_value",
            skip_serializing_if = "Option::is_none"
        )]
        value: Option<f32>,
    },
    /// Every dimension after the batch into one: PyTorch's defaults
    /// `start_dim = 1`, `end_dim = -1`, the only values accepted.
    Flatten {
        #[serde(default = "one_i64")]
        start_dim: i64,
        #[serde(default = "last_axis")]
        end_dim: i64,
    },
    Embedding {
        #[serde(alias = "input_dim", alias = "vocab_size")]
        num_embeddings: usize,
        #[serde(alias = "output_dim", alias = "embed_dim")]
        embedding_dim: usize,
    },
}

fn one_i64() -> i64 {
    1
}

fn one_usize() -> usize {
    1
}

impl LayerSpec {
    fn type_name(&self) -> &'static str {
        match self {
            LayerSpec::Dense { .. } => "Dense",
            LayerSpec::Conv2D { .. } => "Conv2D",
            LayerSpec::MaxPooling2D { .. } => "MaxPooling2D",
            LayerSpec::AveragePooling2D { .. } => "AveragePooling2D",
            LayerSpec::GlobalAveragePooling2D => "GlobalAveragePooling2D",
            LayerSpec::BatchNormalization1D { .. } => "BatchNormalization1D",
            LayerSpec::BatchNormalization2D { .. } => "BatchNormalization2D",
            LayerSpec::LayerNormalization { .. } => "LayerNormalization",
            LayerSpec::Dropout { .. } => "Dropout",
            LayerSpec::Activation { .. } => "Activation",
            LayerSpec::Flatten { .. } => "Flatten",
            LayerSpec::Embedding { .. } => "Embedding",
        }
    }
}

/// Parses a TOML layer spec and builds its graph.
pub fn from_toml(text: &str) -> Result<Graph, SpecError> {
    ModelSpec::from_toml(text)?.to_graph()
}

impl ModelSpec {
    /// What the author should hear about a spec that builds: a BatchNorm
    /// `momentum` that looks like Keras's convention (the share of the
    /// running statistics kept) rather than PyTorch's, which Rookery follows.
    pub fn warnings(&self) -> Vec<String> {
        self.layers
            .iter()
            .enumerate()
            .filter_map(|(index, layer)| match layer {
                LayerSpec::BatchNormalization1D { momentum, .. }
                | LayerSpec::BatchNormalization2D { momentum, .. }
                    if *momentum > 0.5 =>
                {
                    Some(format!(
                        "layer {index} ({}): momentum {momentum} looks like Keras's convention (the \
                         share of the running statistics kept); Rookery follows PyTorch's (the share \
                         of each batch), so the equivalent is {:.3}",
                        layer.type_name(),
                        1.0 - momentum
                    ))
                }
                _ => None,
            })
            .collect()
    }

    /// Parses layer by layer so an error can name the layer index.
    pub fn from_toml(text: &str) -> Result<Self, SpecError> {
        let mut table: toml::Table =
            toml::from_str(text).map_err(|e| SpecError::Toml(e.to_string()))?;
        let layers = match table.remove("layers") {
            Some(toml::Value::Array(a)) => a,
            Some(_) => {
                return Err(SpecError::Top {
                    field: "layers".into(),
                    reason: "must be an array of tables ([[layers]])".into(),
                });
            }
            None => {
                return Err(SpecError::Top {
                    field: "layers".into(),
                    reason: "missing".into(),
                });
            }
        };
        let layers = layers
            .into_iter()
            .enumerate()
            .map(|(index, v)| {
                v.try_into::<LayerSpec>().map_err(|e| SpecError::Layer {
                    index,
                    reason: e.to_string().trim().to_string(),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        table.insert("layers".into(), toml::Value::Array(Vec::new()));
        let mut spec: ModelSpec =
            toml::Value::Table(table)
                .try_into()
                .map_err(|e: toml::de::Error| SpecError::Top {
                    field: "(top level)".into(),
                    reason: e.to_string().trim().to_string(),
                })?;
        spec.layers = layers;
        Ok(spec)
    }

    /// Builds the graph: one input `input` with example batch 1, PyTorch-style names.
    pub fn to_graph(&self) -> Result<Graph, SpecError> {
        if self.input_shape.is_empty() || self.input_shape.contains(&0) {
            return Err(SpecError::Top {
                field: "input_shape".into(),
                reason: format!("{:?} must be non-empty without zeros", self.input_shape),
            });
        }
        if self.layers.is_empty() {
            return Err(SpecError::Top {
                field: "layers".into(),
                reason: "no layers".into(),
            });
        }
        let first_is_embedding = matches!(self.layers.first(), Some(LayerSpec::Embedding { .. }));
        let dtype = self.input_dtype.unwrap_or(if first_is_embedding {
            DType::I64
        } else {
            DType::F32
        });
        let mut shape = vec![1];
        shape.extend(&self.input_shape);
        let mut b = Builder {
            graph: Graph {
                inputs: vec![Input {
                    name: "input".into(),
                    shape: shape.clone(),
                    dtype,
                }],
                ..Graph::default()
            },
            current: "input".into(),
            info: TensorInfo { shape, dtype },
            module: 0,
        };
        for (index, layer) in self.layers.iter().enumerate() {
            b.layer(index, layer)?;
        }
        b.graph.outputs = vec![b.current];
        Ok(b.graph)
    }
}

struct Builder {
    graph: Graph,
    current: String,
    info: TensorInfo,
    /// Next `nn.Sequential` index.
    module: usize,
}

impl Builder {
    fn layer(&mut self, index: usize, layer: &LayerSpec) -> Result<(), SpecError> {
        let ty = layer.type_name();
        let field = |field: &str, reason: String| SpecError::Field {
            index,
            layer: ty.into(),
            field: field.into(),
            reason,
        };
        let positive = |name: &str, v: usize| {
            if v == 0 {
                Err(field(name, "must be >= 1".into()))
            } else {
                Ok(())
            }
        };
        let m = self.module;
        match layer {
            LayerSpec::Dense {
                units,
                activation,
                bias,
            } => {
                positive("units", *units)?;
                let fan_in = self.info.shape.last().copied().unwrap_or(1);
                let mut ins = vec![self.param(
                    m,
                    "weight",
                    vec![*units, fan_in],
                    Init::torch_weight(fan_in),
                )];
                if *bias {
                    ins.push(self.param(m, "bias", vec![*units], Init::torch_bias(fan_in)));
                }
                self.node(index, ty, Op::Linear, ins)?;
                if let Some(a) = activation {
                    self.activation(index, ty, "activation", a, &ActivationArgs::default())?;
                }
            }
            LayerSpec::Conv2D {
                filters,
                in_channels,
                padding_mode,
                kernel_size,
                stride,
                padding,
                dilation,
                groups,
                bias,
                activation,
            } => {
                positive("filters", *filters)?;
                positive("groups", *groups)?;
                let k = kernel_size.get();
                let d = dilation.get();
                let channels = if self.info.shape.len() == 4 {
                    self.info.shape[1]
                } else {
                    return Err(field(
                        "input",
                        format!("needs a [C, H, W] input, got {:?}", &self.info.shape[1..]),
                    ));
                };
                if let Some(given) = in_channels
                    && *given != channels
                {
                    return Err(field(
                        "in_channels",
                        format!(
                            "{given} does not match the input's {channels} channels (Rookery infers them; leave in_channels out)"
                        ),
                    ));
                }
                if let Some(mode) = padding_mode.as_deref()
                    && mode != "zeros"
                {
                    return Err(field(
                        "padding_mode",
                        format!(
                            "`{mode}` is not supported: only `zeros`, PyTorch's default, pads here"
                        ),
                    ));
                }
                if channels % groups != 0 || filters % groups != 0 {
                    return Err(field(
                        "groups",
                        format!(
                            "{groups} must divide input channels {channels} and filters {filters}"
                        ),
                    ));
                }
                let pad = resolve_padding(padding, k, d, stride.get())
                    .map_err(|r| field("padding", r))?;
                let fan_in = (channels / groups)
                    .checked_mul(k[0])
                    .and_then(|n| n.checked_mul(k[1]))
                    .ok_or_else(|| field("kernel_size", format!("{k:?} is too large")))?;
                let mut ins = vec![self.param(
                    m,
                    "weight",
                    vec![*filters, channels / groups, k[0], k[1]],
                    Init::torch_weight(fan_in),
                )];
                if *bias {
                    ins.push(self.param(m, "bias", vec![*filters], Init::torch_bias(fan_in)));
                }
                let op = Op::Conv2d {
                    stride: stride.get(),
                    padding: pad,
                    dilation: d,
                    groups: *groups,
                };
                self.node(index, ty, op, ins)?;
                if let Some(a) = activation {
                    self.activation(index, ty, "activation", a, &ActivationArgs::default())?;
                }
            }
            LayerSpec::MaxPooling2D {
                pool_size,
                stride,
                padding,
            }
            | LayerSpec::AveragePooling2D {
                pool_size,
                stride,
                padding,
            } => {
                let kernel = pool_size.get();
                // Like PyTorch, the stride defaults to the window size.
                let stride = stride.unwrap_or(*pool_size).get();
                let padding = resolve_padding(padding, kernel, [1, 1], stride)
                    .map_err(|r| field("padding", r))?;
                let max = matches!(layer, LayerSpec::MaxPooling2D { .. });
                let op = Op::pool2d(max, kernel, stride, padding);
                self.node(index, ty, op, vec![])?;
            }
            LayerSpec::GlobalAveragePooling2D => {
                self.node(index, ty, Op::GlobalAveragePool, vec![])?;
            }
            LayerSpec::BatchNormalization1D {
                eps,
                momentum,
                affine,
            }
            | LayerSpec::BatchNormalization2D {
                eps,
                momentum,
                affine,
            } => {
                if !affine {
                    return Err(field(
                        "affine",
                        "`false` is not supported: BatchNorm here always learns a weight and a bias (leave affine out)".into(),
                    ));
                }
                let rank = self.info.shape.len();
                let ok = match layer {
                    LayerSpec::BatchNormalization1D { .. } => rank == 2 || rank == 3,
                    _ => rank == 4,
                };
                if !ok {
                    return Err(field(
                        "input",
                        format!("unexpected input shape {:?}", &self.info.shape[1..]),
                    ));
                }
                let c = self.info.shape[1];
                let ins = vec![
                    self.param(m, "weight", vec![c], Init::Ones),
                    self.param(m, "bias", vec![c], Init::Zeros),
                    self.buffer(m, "running_mean", vec![c], DType::F32, Init::Zeros),
                    self.buffer(m, "running_var", vec![c], DType::F32, Init::Ones),
                    self.buffer(m, "num_batches_tracked", vec![], DType::I64, Init::Zeros),
                ];
                let op = Op::BatchNorm {
                    eps: *eps,
                    momentum: *momentum,
                };
                self.node(index, ty, op, ins)?;
            }
            LayerSpec::LayerNormalization { eps } => {
                let d = self.info.shape.last().copied().unwrap_or(1);
                let ins = vec![
                    self.param(m, "weight", vec![d], Init::Ones),
                    self.param(m, "bias", vec![d], Init::Zeros),
                ];
                self.node(
                    index,
                    ty,
                    Op::LayerNorm {
                        axis: -1,
                        eps: *eps,
                    },
                    ins,
                )?;
            }
            LayerSpec::Dropout { rate } => {
                if !(0.0..1.0).contains(rate) {
                    return Err(field("rate", format!("{rate} must be in [0, 1)")));
                }
                self.node(index, ty, Op::Dropout { p: *rate }, vec![])?;
            }
            LayerSpec::Activation {
                name,
                axis,
                negative_slope,
                alpha,
                beta,
                threshold,
                lambd,
                min_val,
                max_val,
                value,
            } => {
                let args = ActivationArgs {
                    given: [
                        ("axis", axis.map(|a| a as f64)),
                        ("negative_slope", negative_slope.map(f64::from)),
                        ("alpha", alpha.map(f64::from)),
                        ("beta", beta.map(f64::from)),
                        ("threshold", threshold.map(f64::from)),
                        ("lambd", lambd.map(f64::from)),
                        ("min_val", min_val.map(f64::from)),
                        ("max_val", max_val.map(f64::from)),
                        ("value", value.map(f64::from)),
                    ]
                    .into_iter()
                    .filter_map(|(k, v)| Some((k, v?)))
                    .collect(),
                };
                self.activation(index, ty, "name", name, &args)?;
            }
            LayerSpec::Flatten { start_dim, end_dim } => {
                let last = self.info.shape.len() as i64 - 1;
                if *start_dim != 1 {
                    return Err(field(
                        "start_dim",
                        format!(
                            "{start_dim} is not supported: Flatten keeps the batch dimension and joins the rest (start_dim = 1)"
                        ),
                    ));
                }
                if *end_dim != -1 && *end_dim != last {
                    return Err(field(
                        "end_dim",
                        format!(
                            "{end_dim} is not supported: Flatten joins every dimension after the batch (end_dim = -1)"
                        ),
                    ));
                }
                self.node(index, ty, Op::Flatten { axis: 1 }, vec![])?;
            }
            LayerSpec::Embedding {
                num_embeddings,
                embedding_dim,
            } => {
                positive("num_embeddings", *num_embeddings)?;
                positive("embedding_dim", *embedding_dim)?;
                if self.info.dtype != DType::I64 {
                    return Err(field("input", "needs i64 token indices".into()));
                }
                let w = self.param(
                    m,
                    "weight",
                    vec![*num_embeddings, *embedding_dim],
                    Init::Normal {
                        mean: 0.0,
                        std: 1.0,
                    },
                );
                // Gather takes (data, indices): the table first, the tokens second.
                let tokens = std::mem::take(&mut self.current);
                let name = m.to_string();
                self.push(index, ty, Op::Gather { axis: 0 }, name, vec![w, tokens])?;
            }
        }
        Ok(())
    }

    fn activation(
        &mut self,
        index: usize,
        ty: &str,
        field: &str,
        name: &str,
        args: &ActivationArgs,
    ) -> Result<(), SpecError> {
        let err = |field: &str, reason: String| SpecError::Field {
            index,
            layer: ty.into(),
            field: field.into(),
            reason,
        };
        let lower = name.to_ascii_lowercase();
        let Some((op, takes)) = activation_op(&lower, args) else {
            return Err(err(
                field,
                format!(
                    "unknown activation `{lower}` ({})",
                    ACTIVATION_NAMES.join(", ")
                ),
            ));
        };
        // Every argument given must be one this activation takes.
        for (arg, _) in &args.given {
            if !takes.contains(arg) {
                let takes = if takes.is_empty() {
                    "none".to_string()
                } else {
                    takes.join(", ")
                };
                return Err(err(
                    arg,
                    format!("`{arg}` is not an argument of {lower} (it takes: {takes})"),
                ));
            }
        }
        let op = op.map_err(|(arg, reason)| err(arg, reason))?;
        self.node(index, ty, op, vec![])
    }

    fn param(&mut self, module: usize, what: &str, shape: Vec<usize>, init: Init) -> String {
        self.push_param(module, what, shape, DType::F32, ParamKind::Trainable, init)
    }

    fn buffer(
        &mut self,
        module: usize,
        what: &str,
        shape: Vec<usize>,
        dtype: DType,
        init: Init,
    ) -> String {
        self.push_param(module, what, shape, dtype, ParamKind::Buffer, init)
    }

    fn push_param(
        &mut self,
        module: usize,
        what: &str,
        shape: Vec<usize>,
        dtype: DType,
        kind: ParamKind,
        init: Init,
    ) -> String {
        let name = format!("{module}.{what}");
        self.graph.params.push(Param {
            name: name.clone(),
            shape,
            dtype,
            kind,
            init,
        });
        name
    }

    /// Adds a module reading the current tensor and then `params`.
    fn node(
        &mut self,
        index: usize,
        ty: &str,
        op: Op,
        params: Vec<String>,
    ) -> Result<(), SpecError> {
        let mut inputs = vec![std::mem::take(&mut self.current)];
        inputs.extend(params);
        let name = self.module.to_string();
        self.push(index, ty, op, name, inputs)
    }

    fn push(
        &mut self,
        index: usize,
        ty: &str,
        op: Op,
        name: String,
        inputs: Vec<String>,
    ) -> Result<(), SpecError> {
        let infos: Vec<TensorInfo> = inputs.iter().map(|t| self.info_of(t)).collect();
        let info = op.infer(&infos).map_err(|e| {
            let (node, op_name) = (name.clone(), op.name().to_string());
            let source = match e {
                OpError::Shape(reason) => GraphError::Shape {
                    node,
                    op: op_name,
                    reason,
                },
                OpError::Invalid(reason) => GraphError::Invalid {
                    node,
                    op: op_name,
                    reason,
                },
            };
            SpecError::Graph {
                index,
                layer: ty.into(),
                source,
            }
        })?;
        self.graph.nodes.push(Node {
            name: name.clone(),
            op,
            inputs,
        });
        self.current = name;
        self.info = info;
        self.module += 1;
        Ok(())
    }

    /// Shape of the current tensor or of a parameter just added.
    fn info_of(&self, name: &str) -> TensorInfo {
        match self.graph.param(name) {
            Some(p) => TensorInfo {
                shape: p.shape.clone(),
                dtype: p.dtype,
            },
            None => self.info.clone(),
        }
    }
}

/// An `Activation` layer's arguments as given, by torch's names.
#[derive(Default)]
struct ActivationArgs {
    given: Vec<(&'static str, f64)>,
}

impl ActivationArgs {
    fn get(&self, arg: &str) -> Option<f64> {
        self.given.iter().find(|(k, _)| *k == arg).map(|(_, v)| *v)
    }

    fn f32_or(&self, arg: &str, default: f32) -> f32 {
        self.get(arg).map_or(default, |v| v as f32)
    }
}

/// The names [`activation_op`] knows, for the error listing them.
const ACTIVATION_NAMES: [&str; 20] = [
    "relu",
    "relu6",
    "gelu",
    "sigmoid",
    "tanh",
    "softmax",
    "log_softmax",
    "softmin",
    "leaky_relu",
    "elu",
    "selu",
    "softplus",
    "softsign",
    "tanhshrink",
    "logsigmoid",
    "hardshrink",
    "hardtanh",
    "softshrink",
    "threshold",
    "linear",
];

/// An activation by its lowercased name (torch's, and the underscored or
/// run-together spellings of Keras and RavDL), with the arguments it takes;
/// `None` for an unknown name, `Err((argument, reason))` where a required
/// argument is missing or two name one thing.
#[allow(clippy::type_complexity)]
fn activation_op(
    name: &str,
    args: &ActivationArgs,
) -> Option<(Result<Op, (&'static str, String)>, &'static [&'static str])> {
    let axis = args.get("axis").map_or(-1, |a| a as i64);
    let op = match name {
        "relu" => (Ok(Op::Relu), &[][..]),
        "relu6" => (
            Ok(Op::Hardtanh {
                min_val: 0.0,
                max_val: 6.0,
            }),
            &[][..],
        ),
        "gelu" => (Ok(Op::Gelu), &[][..]),
        "sigmoid" => (Ok(Op::Sigmoid), &[][..]),
        "tanh" => (Ok(Op::Tanh), &[][..]),
        "softmax" => (Ok(Op::Softmax { axis }), &["axis"][..]),
        "log_softmax" | "logsoftmax" => (Ok(Op::LogSoftmax { axis }), &["axis"][..]),
        "softmin" => (Ok(Op::Softmin { axis }), &["axis"][..]),
        "linear" | "identity" | "none" => (Ok(Op::Identity), &[][..]),
        "leaky_relu" | "leakyrelu" => {
            let slope = match (args.get("negative_slope"), args.get("alpha")) {
                (Some(_), Some(_)) => Err((
                    "alpha",
                    "give negative_slope or alpha (Keras's name for it), not both".to_string(),
                )),
                (s, a) => Ok(s.or(a).map_or(0.01, |v| v as f32)),
            };
            (
                slope.map(|negative_slope| Op::LeakyRelu { negative_slope }),
                &["negative_slope", "alpha"][..],
            )
        }
        "elu" => (
            Ok(Op::Elu {
                alpha: args.f32_or("alpha", 1.0),
            }),
            &["alpha"][..],
        ),
        "selu" => (Ok(Op::Selu), &[][..]),
        "softplus" => (
            Ok(Op::Softplus {
                beta: args.f32_or("beta", 1.0),
                threshold: args.f32_or("threshold", 20.0),
            }),
            &["beta", "threshold"][..],
        ),
        "softsign" => (Ok(Op::Softsign), &[][..]),
        "tanhshrink" | "tanh_shrink" => (Ok(Op::Tanhshrink), &[][..]),
        "logsigmoid" | "log_sigmoid" => (Ok(Op::LogSigmoid), &[][..]),
        "hardshrink" | "hard_shrink" => (
            Ok(Op::Hardshrink {
                lambd: args.f32_or("lambd", 0.5),
            }),
            &["lambd"][..],
        ),
        "hardtanh" | "hard_tanh" => (
            Ok(Op::Hardtanh {
                min_val: args.f32_or("min_val", -1.0),
                max_val: args.f32_or("max_val", 1.0),
            }),
            &["min_val", "max_val"][..],
        ),
        "softshrink" | "soft_shrink" => (
            Ok(Op::Softshrink {
                lambd: args.f32_or("lambd", 0.5),
            }),
            &["lambd"][..],
        ),
        "threshold" => {
            let op = match (args.get("threshold"), args.get("value")) {
                (Some(t), Some(v)) => Ok(Op::Threshold {
                    threshold: t as f32,
                    value: v as f32,
                }),
                (None, _) => Err((
                    "threshold",
                    "threshold needs `threshold` and `value` (torch's nn.Threshold has no \
                     defaults): write it as an Activation layer with both"
                        .to_string(),
                )),
                (_, None) => Err((
                    "value",
                    "threshold needs `threshold` and `value` (torch's nn.Threshold has no \
                     defaults): write it as an Activation layer with both"
                        .to_string(),
                )),
            };
            (op, &["threshold", "value"][..])
        }
        _ => return None,
    };
    Some(op)
}

/// Turns `"valid"`, `"same"` or numbers into symmetric padding.
fn resolve_padding(
    p: &Padding,
    kernel: [usize; 2],
    dilation: [usize; 2],
    stride: [usize; 2],
) -> Result<[usize; 2], String> {
    match p {
        Padding::Size(pair) => Ok(pair.get()),
        Padding::Named(n) if n.eq_ignore_ascii_case("valid") => Ok([0, 0]),
        Padding::Named(n) if n.eq_ignore_ascii_case("same") => {
            let mut out = [0; 2];
            for i in 0..2 {
                let span = dilation[i] * (kernel[i].max(1) - 1);
                // Symmetric padding can only keep the size for odd spans at stride 1, as in PyTorch.
                if stride[i] != 1 || !span.is_multiple_of(2) {
                    return Err("\"same\" needs stride 1 and an odd kernel".into());
                }
                out[i] = span / 2;
            }
            Ok(out)
        }
        Padding::Named(n) => Err(format!(
            "`{n}` is not a number, pair, \"valid\" or \"same\""
        )),
    }
}
