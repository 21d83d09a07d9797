//! The shape of one pipeline stage, independent of any backend: which of
//! the graph's nodes it runs, where each node reads its inputs from (a
//! tensor the stage receives, one of its parameters, or an earlier node of
//! the stage), which tensors it sends on, and when each intermediate is last
//! read. Every stage executor (libtorch, our own kernels) builds on this, so
//! they agree on what a stage `[first, end)` receives and sends.

use std::collections::HashMap;
use std::ops::Range;

use crate::graph::{Analysis, Graph, ParamKind};
use crate::ops::Op;
use crate::tensor::DType;

/// Why a stage cannot be laid out. Messages name the tensor involved.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LayoutError {
    #[error("stage range {first}..{end} is not a non-empty range of the graph's {nodes} nodes")]
    Range {
        first: usize,
        end: usize,
        nodes: usize,
    },
    #[error("stage input `{name}`: {reason}")]
    Input { name: String, reason: String },
    #[error("stage output `{name}`: {reason}")]
    Output { name: String, reason: String },
}

/// Where a node reads a tensor from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    /// The stage's `i`-th input.
    Input(usize),
    /// The stage's `i`-th parameter.
    Param(usize),
    /// The output of the stage's `j`-th node.
    Local(usize),
}

/// One node of the stage.
#[derive(Debug, Clone, PartialEq)]
pub struct LayoutNode {
    pub name: String,
    pub op: Op,
    pub inputs: Vec<Source>,
}

/// A tensor the stage receives.
#[derive(Debug, Clone, PartialEq)]
pub struct LayoutInput {
    pub name: String,
    pub dtype: DType,
    /// Its shape at the analysed batch size (dimension 0 is the batch).
    pub shape: Vec<usize>,
    /// Float tensors made by an earlier node: the previous stage needs their
    /// gradient. Graph inputs (the Root's data) never get one.
    pub requires_grad: bool,
}

/// A parameter, buffer or constant the stage reads.
#[derive(Debug, Clone, PartialEq)]
pub struct LayoutParam {
    pub name: String,
    pub kind: ParamKind,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

/// The stage `[first, end)` of a graph's topological order.
#[derive(Debug, Clone, PartialEq)]
pub struct StageLayout {
    pub nodes: Vec<LayoutNode>,
    /// In order of first use.
    pub inputs: Vec<LayoutInput>,
    /// In order of first use.
    pub params: Vec<LayoutParam>,
    /// What the stage sends on, in the order it was asked for.
    pub outputs: Vec<(String, Source)>,
    /// For each node's output, the last stage node reading it; `usize::MAX`
    /// when it leaves the stage.
    pub last_use: Vec<usize>,
}

impl StageLayout {
    /// Lays out nodes `range` (positions in `analysis`'s topological order),
    /// sending `outputs` (node outputs of the stage, or tensors it receives
    /// and passes through to a later stage).
    pub fn new(
        graph: &Graph,
        analysis: &Analysis,
        range: Range<usize>,
        outputs: &[String],
    ) -> Result<Self, LayoutError> {
        let n = analysis.nodes.len();
        if range.start >= range.end || range.end > n {
            return Err(LayoutError::Range {
                first: range.start,
                end: range.end,
                nodes: n,
            });
        }
        let produced_at: HashMap<&str, usize> = analysis
            .nodes
            .iter()
            .enumerate()
            .map(|(p, info)| (info.name.as_str(), p))
            .collect();
        let mut b = Builder {
            graph,
            analysis,
            produced_at: &produced_at,
            first: range.start,
            local: HashMap::new(),
            inputs: Vec::new(),
            params: Vec::new(),
        };
        let mut nodes = Vec::with_capacity(range.len());
        for (j, info) in analysis.nodes[range.clone()].iter().enumerate() {
            let node = &graph.nodes[info.index];
            let inputs = node
                .inputs
                .iter()
                .map(|t| b.source(t))
                .collect::<Result<Vec<_>, _>>()?;
            nodes.push(LayoutNode {
                name: node.name.clone(),
                op: node.op.clone(),
                inputs,
            });
            b.local.insert(node.name.clone(), j);
        }
        let mut outs: Vec<(String, Source)> = Vec::with_capacity(outputs.len());
        for name in outputs {
            if outs.iter().any(|(o, _)| o == name) {
                return Err(LayoutError::Output {
                    name: name.clone(),
                    reason: "listed twice".into(),
                });
            }
            let src = b.output_source(name, range.end)?;
            outs.push((name.clone(), src));
        }
        let mut last_use = vec![0usize; nodes.len()];
        for (k, node) in nodes.iter().enumerate() {
            for s in &node.inputs {
                if let Source::Local(j) = *s {
                    last_use[j] = last_use[j].max(k);
                }
            }
        }
        for (_, s) in &outs {
            if let Source::Local(j) = *s {
                last_use[j] = usize::MAX;
            }
        }
        Ok(Self {
            nodes,
            inputs: b.inputs,
            params: b.params,
            outputs: outs,
            last_use,
        })
    }
}

/// Names of the tensors crossing cut `cut` of the graph's topological order
/// (cut `c` sits before node position `c`; cut `n` is the end): produced at
/// or before the cut and read at or after it, graph outputs counting as read
/// at the end. The same rule as the planner's boundary sets, in the same
/// order (graph inputs, then node outputs in topological order), so
/// `boundary(g, a, end)` is the `outputs` of a stage `[first, end)`.
pub fn boundary(graph: &Graph, analysis: &Analysis, cut: usize) -> Vec<String> {
    let n = analysis.nodes.len();
    let mut last_use: HashMap<&str, usize> = HashMap::new();
    for (p, info) in analysis.nodes.iter().enumerate() {
        for t in &graph.nodes[info.index].inputs {
            let e = last_use.entry(t.as_str()).or_insert(p);
            *e = (*e).max(p);
        }
    }
    for o in &graph.outputs {
        last_use.insert(o.as_str(), n);
    }
    let produced = graph.inputs.iter().map(|i| (i.name.as_str(), 0)).chain(
        analysis
            .nodes
            .iter()
            .enumerate()
            .map(|(p, info)| (info.name.as_str(), p + 1)),
    );
    produced
        .filter(|(name, from)| {
            last_use
                .get(name)
                .is_some_and(|&to| *from <= cut && cut <= to)
        })
        .map(|(name, _)| name.to_string())
        .collect()
}

/// Resolves tensor names to sources, creating input and parameter slots on
/// first use.
struct Builder<'a> {
    graph: &'a Graph,
    analysis: &'a Analysis,
    produced_at: &'a HashMap<&'a str, usize>,
    first: usize,
    local: HashMap<String, usize>,
    inputs: Vec<LayoutInput>,
    params: Vec<LayoutParam>,
}

impl Builder<'_> {
    fn source(&mut self, name: &str) -> Result<Source, LayoutError> {
        if let Some(&j) = self.local.get(name) {
            return Ok(Source::Local(j));
        }
        if let Some(i) = self.params.iter().position(|p| p.name == name) {
            return Ok(Source::Param(i));
        }
        if let Some(p) = self.graph.param(name) {
            self.params.push(LayoutParam {
                name: name.to_string(),
                kind: p.kind,
                dtype: p.dtype,
                shape: p.shape.clone(),
            });
            return Ok(Source::Param(self.params.len() - 1));
        }
        self.input(name).map(Source::Input)
    }

    /// A tensor from before the stage: a graph input or an earlier node's output.
    fn input(&mut self, name: &str) -> Result<usize, LayoutError> {
        if let Some(i) = self.inputs.iter().position(|i| i.name == name) {
            return Ok(i);
        }
        let from_node = match self.produced_at.get(name) {
            Some(&p) if p < self.first => true,
            Some(_) => {
                return Err(LayoutError::Input {
                    name: name.to_string(),
                    reason: "produced by a node after the start of the stage".into(),
                });
            }
            None if self.graph.inputs.iter().any(|i| i.name == name) => false,
            None => {
                return Err(LayoutError::Input {
                    name: name.to_string(),
                    reason: "not a tensor of this graph".into(),
                });
            }
        };
        let info = self
            .analysis
            .tensors
            .get(name)
            .ok_or_else(|| LayoutError::Input {
                name: name.to_string(),
                reason: "shape unknown".into(),
            })?;
        self.inputs.push(LayoutInput {
            name: name.to_string(),
            dtype: info.dtype,
            shape: info.shape.clone(),
            requires_grad: from_node && info.dtype == DType::F32,
        });
        Ok(self.inputs.len() - 1)
    }

    fn output_source(&mut self, name: &str, end: usize) -> Result<Source, LayoutError> {
        if let Some(&j) = self.local.get(name) {
            return Ok(Source::Local(j));
        }
        let err = |reason: &str| LayoutError::Output {
            name: name.to_string(),
            reason: reason.into(),
        };
        if self.graph.param(name).is_some() {
            return Err(err("is a parameter; parameters do not leave a stage"));
        }
        match self.produced_at.get(name) {
            Some(&p) if p >= end => Err(err("is produced by a later stage")),
            // Produced before the stage (or a graph input): passed through.
            _ => self.input(name).map(Source::Input),
        }
    }
}
