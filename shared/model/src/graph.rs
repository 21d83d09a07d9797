//! The model graph: named inputs, named parameter tensors and a DAG of op nodes,
//! plus validation, static shape inference from the example input shapes, and
//! per-node cost estimates the planner works from.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};

use serde::{Deserialize, Serialize};

use crate::error::GraphError;
use crate::init::Init;
pub use crate::loss::{ClassAxis, Loss};
use crate::ops::{Op, OpError};
use crate::tensor::{DType, TensorInfo};

/// A graph input. `shape` is an example shape whose first dimension is the batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Input {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
}

/// Whether a parameter is trained (gets gradients and optimizer state) or is a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ParamKind {
    Trainable,
    /// Like BatchNorm running statistics: saved with the weights, never optimised.
    Buffer,
    /// A fixed tensor the model computes with that is not in its `state_dict`,
    /// e.g. an imported ONNX model's folded `arange` or a scalar divisor: never
    /// optimised, and not part of a checkpoint.
    Constant,
}

/// A named parameter tensor, named as in the PyTorch `state_dict`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Param {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub kind: ParamKind,
    pub init: Init,
}

impl Param {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn bytes(&self) -> u64 {
        self.numel() as u64 * self.dtype.size()
    }

    /// Initial values; see [`Init::materialize`] for why each name has its own stream.
    pub fn initial_values(&self, seed: u64) -> Vec<f32> {
        self.init.materialize(&self.name, self.numel(), seed)
    }
}

/// One op application. Its single output tensor is named after the node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Node {
    pub name: String,
    #[serde(flatten)]
    pub op: Op,
    pub inputs: Vec<String>,
}

/// A model: data only.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Graph {
    pub inputs: Vec<Input>,
    pub params: Vec<Param>,
    pub nodes: Vec<Node>,
    pub outputs: Vec<String>,
}

/// Shapes and estimates of one node, as found by [`Graph::analyze`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// Index into [`Graph::nodes`].
    pub index: usize,
    pub name: String,
    pub op: String,
    pub output: TensorInfo,
    /// Bytes of trainable parameters this node is the first (topological) user of.
    pub param_bytes: u64,
    /// Bytes of buffers (and constants) this node is the first user of.
    pub buffer_bytes: u64,
    /// Names of all parameters and buffers this node reads.
    pub params: Vec<String>,
    pub activation_bytes_per_sample: u64,
    pub forward_flops_per_sample: u64,
    pub backward_flops_per_sample: u64,
}

/// Result of validating a graph: topological order, every tensor's shape, estimates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Analysis {
    /// Batch size of the example inputs; estimates are divided by it.
    pub batch: usize,
    /// Nodes in the topological order the planner cuts (stable: ties keep graph order).
    pub nodes: Vec<NodeInfo>,
    /// Every tensor: inputs, parameters, node outputs (at the example batch size).
    pub tensors: BTreeMap<String, TensorInfo>,
}

impl Analysis {
    pub fn total_param_bytes(&self) -> u64 {
        self.nodes.iter().map(|n| n.param_bytes).sum()
    }

    pub fn total_forward_flops_per_sample(&self) -> u64 {
        self.nodes.iter().map(|n| n.forward_flops_per_sample).sum()
    }

    pub fn shape(&self, tensor: &str) -> Option<&[usize]> {
        self.tensors.get(tensor).map(|t| t.shape.as_slice())
    }
}

/// Where a tensor name comes from.
#[derive(Clone, Copy)]
enum Source {
    Input,
    Param(usize),
    Node(usize),
}

impl Graph {
    /// Validates the graph and infers every shape from the example input shapes.
    pub fn analyze(&self) -> Result<Analysis, GraphError> {
        if self.nodes.is_empty() {
            return Err(GraphError::Empty);
        }
        let mut sources: HashMap<&str, Source> = HashMap::new();
        let mut tensors = BTreeMap::new();
        let named = self
            .inputs
            .iter()
            .map(|i| (i.name.as_str(), Source::Input))
            .chain(
                self.params
                    .iter()
                    .enumerate()
                    .map(|(i, p)| (p.name.as_str(), Source::Param(i))),
            )
            .chain(
                self.nodes
                    .iter()
                    .enumerate()
                    .map(|(i, n)| (n.name.as_str(), Source::Node(i))),
            );
        for (name, src) in named {
            if sources.insert(name, src).is_some() {
                return Err(GraphError::Duplicate(name.to_string()));
            }
        }
        let batch = self.check_inputs_and_params(&mut tensors)?;

        let order = self.topological_order(&sources)?;
        let mut first_user = vec![false; self.params.len()];
        let mut infos = Vec::with_capacity(order.len());
        for &ni in &order {
            let node = &self.nodes[ni];
            let ins: Vec<TensorInfo> = node
                .inputs
                .iter()
                .map(|t| tensors.get(t).cloned())
                .collect::<Option<_>>()
                .ok_or_else(|| GraphError::Invalid {
                    node: node.name.clone(),
                    op: node.op.name().to_string(),
                    reason: "input shape unknown".into(),
                })?;
            let out = node.op.infer(&ins).map_err(|e| match e {
                OpError::Shape(reason) => GraphError::Shape {
                    node: node.name.clone(),
                    op: node.op.name().to_string(),
                    reason,
                },
                OpError::Invalid(reason) => GraphError::Invalid {
                    node: node.name.clone(),
                    op: node.op.name().to_string(),
                    reason,
                },
            })?;
            let flops = node.op.flops(&ins, &out);
            let (mut param_bytes, mut buffer_bytes, mut params) = (0, 0, Vec::new());
            for t in &node.inputs {
                if let Some(Source::Param(pi)) = sources.get(t.as_str()).copied() {
                    let p = &self.params[pi];
                    params.push(p.name.clone());
                    if !std::mem::replace(&mut first_user[pi], true) {
                        match p.kind {
                            ParamKind::Trainable => param_bytes += p.bytes(),
                            // Constants occupy memory like buffers do.
                            ParamKind::Buffer | ParamKind::Constant => buffer_bytes += p.bytes(),
                        }
                    }
                }
            }
            let b = batch as u64;
            let fwd = flops.div_ceil(b);
            infos.push(NodeInfo {
                index: ni,
                name: node.name.clone(),
                op: node.op.name().to_string(),
                activation_bytes_per_sample: out.bytes().div_ceil(b),
                forward_flops_per_sample: fwd,
                backward_flops_per_sample: (fwd as f64 * node.op.backward_factor()).round() as u64,
                output: out.clone(),
                param_bytes,
                buffer_bytes,
                params,
            });
            tensors.insert(node.name.clone(), out);
        }
        for o in &self.outputs {
            if !sources.contains_key(o.as_str()) {
                return Err(GraphError::UnknownOutput(o.clone()));
            }
        }
        Ok(Analysis {
            batch,
            nodes: infos,
            tensors,
        })
    }

    /// Checks inputs share a batch size and parameter initialisers match their shapes.
    fn check_inputs_and_params(
        &self,
        tensors: &mut BTreeMap<String, TensorInfo>,
    ) -> Result<usize, GraphError> {
        let mut batch = None;
        for input in &self.inputs {
            let err = |reason: String| GraphError::Input {
                name: input.name.clone(),
                reason,
            };
            let Some(&b) = input.shape.first() else {
                return Err(err("shape must start with the batch dimension".into()));
            };
            if input.shape.contains(&0) {
                return Err(err(format!("zero-sized dimension in {:?}", input.shape)));
            }
            match batch {
                Some(prev) if prev != b => {
                    return Err(err(format!(
                        "batch dimension {b} differs from other inputs' {prev}"
                    )));
                }
                _ => batch = Some(b),
            }
            tensors.insert(
                input.name.clone(),
                TensorInfo {
                    shape: input.shape.clone(),
                    dtype: input.dtype,
                },
            );
        }
        for p in &self.params {
            if let Init::Values { data } = &p.init
                && data.len() != p.numel()
            {
                return Err(GraphError::Param {
                    name: p.name.clone(),
                    reason: format!(
                        "{} values for shape {:?} ({} elements)",
                        data.len(),
                        p.shape,
                        p.numel()
                    ),
                });
            }
            tensors.insert(
                p.name.clone(),
                TensorInfo {
                    shape: p.shape.clone(),
                    dtype: p.dtype,
                },
            );
        }
        batch.ok_or_else(|| GraphError::Input {
            name: String::new(),
            reason: "graph has no inputs".into(),
        })
    }

    /// Kahn's algorithm, always taking the lowest-indexed ready node so the order
    /// (and therefore every plan) is deterministic and follows the author's order.
    fn topological_order(&self, sources: &HashMap<&str, Source>) -> Result<Vec<usize>, GraphError> {
        let n = self.nodes.len();
        let mut indegree = vec![0usize; n];
        let mut users: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (i, node) in self.nodes.iter().enumerate() {
            for t in &node.inputs {
                match sources.get(t.as_str()) {
                    None => {
                        return Err(GraphError::UnknownInput {
                            node: node.name.clone(),
                            op: node.op.name().to_string(),
                            input: t.clone(),
                        });
                    }
                    Some(Source::Node(j)) => {
                        indegree[i] += 1;
                        users[*j].push(i);
                    }
                    Some(_) => {}
                }
            }
        }
        let mut ready: BinaryHeap<Reverse<usize>> =
            (0..n).filter(|&i| indegree[i] == 0).map(Reverse).collect();
        let mut order = Vec::with_capacity(n);
        while let Some(Reverse(i)) = ready.pop() {
            order.push(i);
            for &u in &users[i] {
                indegree[u] -= 1;
                if indegree[u] == 0 {
                    ready.push(Reverse(u));
                }
            }
        }
        if order.len() < n {
            let nodes = (0..n)
                .filter(|&i| indegree[i] > 0)
                .map(|i| self.nodes[i].name.clone())
                .collect();
            return Err(GraphError::Cycle { nodes });
        }
        Ok(order)
    }

    /// Initial values of every parameter and buffer, by name.
    pub fn initial_values(&self, seed: u64) -> BTreeMap<String, Vec<f32>> {
        self.params
            .iter()
            .map(|p| (p.name.clone(), p.initial_values(seed)))
            .collect()
    }

    pub fn param(&self, name: &str) -> Option<&Param> {
        self.params.iter().find(|p| p.name == name)
    }

    pub fn to_json(&self) -> Result<String, serde_json::Error> {
        serde_json::to_string(self)
    }

    pub fn from_json(s: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(s)
    }
}
