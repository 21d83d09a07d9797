//! Lowering: a [`StageLayout`] at one batch size becomes a [`Program`], the
//! fixed list of kernel calls of a forward and of a backward pass, with
//! every buffer named symbolically ([`Buf`]) so one program serves every
//! micro-batch of that size.
//!
//! Backward is reverse-mode differentiation written out at lowering time:
//! nodes in reverse order, each adding its inputs' gradients. The first
//! contribution to a gradient is written straight into it; later ones go
//! through a scratch buffer and an add, so no gradient buffer needs zeroing
//! and the order of additions is fixed (the same every run).

use std::collections::{BTreeMap, HashMap, HashSet};

use rookery_kernels::conv::Conv2d;
use rookery_kernels::dropout::{self, DropoutMask};
use rookery_kernels::elementwise::{BinaryOp, Broadcast, Operand, Unary};
use rookery_kernels::gemm::{Linear, MatMul, Precision};
use rookery_kernels::norm::{BatchNorm, LayerNorm};
use rookery_kernels::pool::{GlobalAvgPool, Pool2d};
use rookery_kernels::reduce::{Softmax, split_at_axis};
use rookery_kernels::shape::{Concat, Gather, Transpose};
use rookery_kernels::spec::numel;
use rookery_kernels::winograd::{Step, Winograd};
use rookery_model::{DType, Graph, Op, ParamKind, Source, StageLayout};

use crate::StageError;
use crate::kernel::Kernel;

/// A buffer as a program names it; the executor binds the real one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Buf {
    /// A tensor's value: a stage input or node output of the micro-batch, or
    /// a parameter.
    Value(Source),
    /// The gradient of a tensor in the current backward pass (for a
    /// parameter: this micro-batch's share, added to its accumulated
    /// gradient afterwards).
    Grad(Source),
    /// Scratch space of the pass.
    Temp(usize),
    /// Per-micro-batch state a forward keeps for its backward (LayerNorm's
    /// row statistics, max pooling's argmax, ...), or constants it binds.
    Saved(usize),
}

/// One kernel call with its buffers in binding order.
#[derive(Debug)]
pub(crate) struct Call<P> {
    pub kernel: Kernel,
    pub prepared: P,
    pub args: Vec<Buf>,
}

/// Everything a micro-batch of one size runs.
#[derive(Debug)]
pub(crate) struct Program<P> {
    pub input_shapes: Vec<Vec<usize>>,
    pub local_shapes: Vec<Vec<usize>>,
    /// Elements of each scratch buffer.
    pub temp_lens: Vec<usize>,
    /// Words of each [`Buf::Saved`] buffer (one set per micro-batch in flight).
    pub saved_lens: Vec<usize>,
    pub forward: Vec<Call<P>>,
    pub backward: Vec<Call<P>>,
    /// Parameters whose gradient the backward writes.
    pub params_with_grad: Vec<usize>,
    /// Dropout nodes of a training program: the [`Buf::Saved`] buffer the
    /// executor writes each forward's key and first index into, the node's
    /// name and its elements per sample.
    pub dropouts: Vec<(usize, String, u64)>,
    /// Integer parameters each training forward adds one to (BatchNorm's
    /// `num_batches_tracked`).
    pub counted: Vec<usize>,
    /// Integer stage inputs used as Gather indices, with the size of the
    /// gathered axis: the executor checks them to lie in `[-size, size)`.
    pub index_checks: Vec<(usize, usize)>,
}

/// Shapes of every tensor of the stage when dimension 0 of the graph's
/// inputs is `batch`.
fn shapes_at(graph: &Graph, batch: usize) -> Result<BTreeMap<String, Vec<usize>>, StageError> {
    let mut g = graph.clone();
    for input in &mut g.inputs {
        if let Some(d) = input.shape.first_mut() {
            *d = batch;
        }
    }
    let analysis = g.analyze().map_err(|e| StageError::Graph(e.to_string()))?;
    Ok(analysis
        .tensors
        .into_iter()
        .map(|(name, info)| (name, info.shape))
        .collect())
}

/// Builds the program of `layout` for micro-batches of `batch` samples in
/// training (`train`: dropout active, BatchNorm on batch statistics) or
/// evaluation mode, its matrix products in `precision`, preparing each
/// kernel with `prepare`.
pub(crate) fn lower<P>(
    graph: &Graph,
    layout: &StageLayout,
    batch: usize,
    train: bool,
    local_dtypes: &[DType],
    precision: Precision,
    prepare: impl Fn(&Kernel) -> P,
) -> Result<Program<P>, StageError> {
    let shapes = shapes_at(graph, batch)?;
    let shape_of = |name: &str| -> Result<Vec<usize>, StageError> {
        shapes
            .get(name)
            .cloned()
            .ok_or_else(|| StageError::Graph(format!("no shape for `{name}`")))
    };
    let input_shapes = layout
        .inputs
        .iter()
        .map(|i| shape_of(&i.name))
        .collect::<Result<Vec<_>, _>>()?;
    let local_shapes = layout
        .nodes
        .iter()
        .map(|n| shape_of(&n.name))
        .collect::<Result<Vec<_>, _>>()?;
    let mut l = Lowering {
        layout,
        input_shapes: &input_shapes,
        local_shapes: &local_shapes,
        local_dtypes,
        temp_lens: Vec::new(),
        saved_lens: Vec::new(),
        free_temps: Vec::new(),
        kept: HashMap::new(),
        train,
        precision,
        dropouts: Vec::new(),
        counted: Vec::new(),
        index_checks: Vec::new(),
        written: HashSet::new(),
        calls: Vec::new(),
    };
    for (k, node) in layout.nodes.iter().enumerate() {
        l.forward_node(k, &node.op, &node.inputs)?;
    }
    let forward = std::mem::take(&mut l.calls);
    for (_, src) in &layout.outputs {
        if l.needs_grad(*src) {
            l.written.insert(*src);
        }
    }
    // An evaluation program has no backward.
    for (k, node) in layout.nodes.iter().enumerate().rev().filter(|_| train) {
        if l.written.contains(&Source::Local(k)) {
            l.backward_node(k, &node.op, &node.inputs)?;
        }
    }
    // Inputs no path reaches get a zero gradient, written before the rest.
    let mut backward: Vec<(Kernel, Vec<Buf>)> = Vec::new();
    for (i, input) in layout.inputs.iter().enumerate() {
        let src = Source::Input(i);
        if input.requires_grad && !l.written.contains(&src) {
            backward.push((
                Kernel::Fill {
                    len: numel(&input_shapes[i]),
                    value: 0.0,
                },
                vec![Buf::Grad(src)],
            ));
        }
    }
    backward.append(&mut l.calls);
    let params_with_grad = (0..layout.params.len())
        .filter(|&p| l.written.contains(&Source::Param(p)))
        .collect();
    let finish = |calls: Vec<(Kernel, Vec<Buf>)>| -> Vec<Call<P>> {
        calls
            .into_iter()
            .map(|(kernel, args)| Call {
                prepared: prepare(&kernel),
                kernel,
                args,
            })
            .collect()
    };
    Ok(Program {
        temp_lens: l.temp_lens,
        saved_lens: l.saved_lens,
        dropouts: l.dropouts,
        counted: l.counted,
        index_checks: l.index_checks,
        forward: finish(forward),
        backward: finish(backward),
        params_with_grad,
        input_shapes,
        local_shapes,
    })
}

/// What [`Lowering::settle`] does after a kernel wrote a routed gradient.
enum Routed {
    Direct,
    Discard(usize, usize),
    Add(Source, usize, usize),
}

struct Lowering<'a> {
    layout: &'a StageLayout,
    input_shapes: &'a [Vec<usize>],
    local_shapes: &'a [Vec<usize>],
    local_dtypes: &'a [DType],
    temp_lens: Vec<usize>,
    saved_lens: Vec<usize>,
    /// Scratch buffers free for reuse, as (index, elements).
    free_temps: Vec<(usize, usize)>,
    /// Saved buffers each node's forward wrote, for its backward.
    kept: HashMap<usize, Vec<Buf>>,
    train: bool,
    precision: Precision,
    dropouts: Vec<(usize, String, u64)>,
    counted: Vec<usize>,
    index_checks: Vec<(usize, usize)>,
    /// Tensors whose gradient has a first contribution already.
    written: HashSet<Source>,
    calls: Vec<(Kernel, Vec<Buf>)>,
}

impl Lowering<'_> {
    fn shape(&self, src: Source) -> &[usize] {
        match src {
            Source::Input(i) => &self.input_shapes[i],
            Source::Param(p) => &self.layout.params[p].shape,
            Source::Local(j) => &self.local_shapes[j],
        }
    }

    fn needs_grad(&self, src: Source) -> bool {
        match src {
            Source::Input(i) => self.layout.inputs[i].requires_grad,
            Source::Param(p) => self.layout.params[p].kind == ParamKind::Trainable,
            Source::Local(j) => self.local_dtypes[j] == DType::F32,
        }
    }

    fn temp(&mut self, len: usize) -> usize {
        if let Some(at) = self.free_temps.iter().position(|&(_, l)| l == len) {
            return self.free_temps.swap_remove(at).0;
        }
        self.temp_lens.push(len);
        self.temp_lens.len() - 1
    }

    fn saved(&mut self, len: usize) -> Buf {
        self.saved_lens.push(len);
        Buf::Saved(self.saved_lens.len() - 1)
    }

    /// Where a kernel writing several gradients at once puts the one of
    /// `src`: its gradient buffer for the first contribution, a scratch
    /// buffer otherwise (or when `src` needs none, to be discarded); pass
    /// the second part to [`Self::settle`] after the kernel.
    fn route(&mut self, src: Source, len: usize) -> (Buf, Routed) {
        if !self.needs_grad(src) {
            let t = self.temp(len);
            return (Buf::Temp(t), Routed::Discard(t, len));
        }
        if self.written.insert(src) {
            return (Buf::Grad(src), Routed::Direct);
        }
        let t = self.temp(len);
        (Buf::Temp(t), Routed::Add(src, t, len))
    }

    fn settle(&mut self, routed: Routed) {
        match routed {
            Routed::Direct => {}
            Routed::Discard(t, len) => self.free_temps.push((t, len)),
            Routed::Add(src, t, len) => {
                self.calls
                    .push((Kernel::AddInto { len }, vec![Buf::Temp(t), Buf::Grad(src)]));
                self.free_temps.push((t, len));
            }
        }
    }

    /// Adds `make(dest)`'s calls, which write one contribution to the
    /// gradient of `src` into `dest`, routing it as the module docs say.
    fn contribute(
        &mut self,
        src: Source,
        make: impl FnOnce(&mut Self, Buf) -> Vec<(Kernel, Vec<Buf>)>,
    ) {
        if !self.needs_grad(src) {
            return;
        }
        if self.written.insert(src) {
            let calls = make(self, Buf::Grad(src));
            self.calls.extend(calls);
        } else {
            let len = numel(self.shape(src));
            let t = self.temp(len);
            let calls = make(self, Buf::Temp(t));
            self.calls.extend(calls);
            self.calls
                .push((Kernel::AddInto { len }, vec![Buf::Temp(t), Buf::Grad(src)]));
            self.free_temps.push((t, len));
        }
    }

    /// Adds the calls of the Winograd convolution `w` of `input` by
    /// `weight` (plus `bias`) into `out`.
    fn winograd(&mut self, w: &Winograd, input: Buf, weight: Buf, bias: Option<Buf>, out: Buf) {
        let calls = self.winograd_calls(w, input, weight, bias, out);
        self.calls.extend(calls);
    }

    /// The calls of [`Self::winograd`].
    fn winograd_calls(
        &mut self,
        w: &Winograd,
        input: Buf,
        weight: Buf,
        bias: Option<Buf>,
        out: Buf,
    ) -> Vec<(Kernel, Vec<Buf>)> {
        let scratch = [w.u_len(), w.v_len(), w.m_len()];
        self.with_scratch(w, scratch, |b| w.product_steps(input, weight, bias, out, b))
    }

    /// The calls of the Winograd weight gradient `w` of `dy` and `x` into
    /// `dest`.
    fn winograd_weight_calls(
        &mut self,
        w: &Winograd,
        dy: Buf,
        x: Buf,
        dest: Buf,
    ) -> Vec<(Kernel, Vec<Buf>)> {
        let scratch = [w.v_len(), w.m_len(), w.du_len()];
        self.with_scratch(w, scratch, |b| w.weight_grad_steps(dy, x, dest, b))
    }

    /// `steps` of `w` as calls, given temps of `lens`, which go back to the
    /// pool once the calls are listed.
    fn with_scratch(
        &mut self,
        w: &Winograd,
        lens: [usize; 3],
        steps: impl FnOnce([Buf; 3]) -> Vec<(Step, Vec<Buf>)>,
    ) -> Vec<(Kernel, Vec<Buf>)> {
        let temps = lens.map(|len| self.temp(len));
        let calls = steps(temps.map(Buf::Temp))
            .into_iter()
            .map(|(step, bufs)| (Kernel::Winograd { w: *w, step }, bufs))
            .collect();
        self.free_temps.extend(temps.into_iter().zip(lens));
        calls
    }

    fn unsupported(&self, k: usize, op: &Op, why: &str) -> StageError {
        StageError::Unsupported {
            node: self.layout.nodes[k].name.clone(),
            op: op.name().to_string(),
            reason: why.to_string(),
        }
    }

    fn forward_node(&mut self, k: usize, op: &Op, ins: &[Source]) -> Result<(), StageError> {
        let out = Buf::Value(Source::Local(k));
        let y_len = numel(&self.local_shapes[k]);
        for (at, &src) in ins.iter().enumerate() {
            let integer = match src {
                Source::Param(p) => self.layout.params[p].dtype != DType::F32,
                Source::Local(j) => self.local_dtypes[j] != DType::F32,
                Source::Input(i) => self.layout.inputs[i].dtype != DType::F32,
            };
            // BatchNorm's batch counter lives on the host, never bound;
            // Gather binds stage inputs as i32 indices.
            let allowed = (matches!(op, Op::BatchNorm { .. }) && at == 5)
                || (matches!(op, Op::Gather { .. }) && at == 1 && matches!(src, Source::Input(_)));
            if integer && !allowed {
                return Err(self.unsupported(k, op, "integer tensors are not supported yet"));
            }
        }
        let call = match op {
            _ if let Some(unary) = op.as_unary() => (
                Kernel::Unary {
                    op: unary,
                    len: y_len,
                },
                vec![Buf::Value(ins[0]), out],
            ),
            Op::Flatten { .. } | Op::Reshape { .. } => {
                (Kernel::Copy { len: y_len }, vec![Buf::Value(ins[0]), out])
            }
            Op::Add | Op::Sub | Op::Mul | Op::Div => {
                let shapes = self.broadcast(k, op, ins)?;
                (
                    Kernel::Binary {
                        op: binary(op),
                        shapes,
                    },
                    vec![Buf::Value(ins[0]), Buf::Value(ins[1]), out],
                )
            }
            Op::Linear => {
                let linear = self.linear(k, op, ins)?;
                let mut args = vec![Buf::Value(ins[0]), Buf::Value(ins[1])];
                if linear.bias {
                    args.push(Buf::Value(ins[2]));
                }
                args.push(out);
                (Kernel::Linear(linear), args)
            }
            Op::MatMul => {
                let mm = self.matmul(k, op, ins)?;
                (
                    Kernel::MatMul(mm),
                    vec![Buf::Value(ins[0]), Buf::Value(ins[1]), out],
                )
            }
            Op::Softmax { axis } | Op::LogSoftmax { axis } => {
                let s = self.softmax(k, op, ins, *axis)?;
                (Kernel::Softmax(s), vec![Buf::Value(ins[0]), out])
            }
            // torch's softmin: the softmax of `-x`. The negation goes to a
            // buffer of the micro-batch (a forward has no scratch space);
            // the backward needs only the output.
            Op::Softmin { axis } => {
                let s = self.softmax(k, op, ins, *axis)?;
                let negated = self.saved(y_len);
                self.calls.push((
                    Kernel::Unary {
                        op: Unary::Neg,
                        len: y_len,
                    },
                    vec![Buf::Value(ins[0]), negated],
                ));
                (Kernel::Softmax(s), vec![negated, out])
            }
            Op::Transpose { perm } => {
                let t = Transpose::new(self.shape(ins[0]), perm).ok_or_else(|| {
                    self.unsupported(k, op, "not a permutation of the dimensions")
                })?;
                (Kernel::Transpose(t), vec![Buf::Value(ins[0]), out])
            }
            Op::Concat { axis } => {
                let concat = self.concat(k, op, ins, *axis)?;
                for (part, &src) in ins.iter().enumerate() {
                    self.calls.push((
                        Kernel::Concat {
                            concat: concat.clone(),
                            part,
                        },
                        vec![Buf::Value(src), out],
                    ));
                }
                return Ok(());
            }
            // A slice is one part of a concatenation: its forward is that
            // part's backward copy, its backward zeros and the forward copy.
            Op::Slice { axis, start, end } => {
                let concat = self.slice(k, op, ins, *axis, *start, *end)?;
                (
                    Kernel::ConcatBackward { concat, part: 1 },
                    vec![Buf::Value(ins[0]), out],
                )
            }
            Op::LayerNorm { axis, eps } => {
                let n = self.layer_norm(k, op, ins, *axis, *eps)?;
                let mean = self.saved(n.saved_mean_len());
                let rstd = self.saved(n.rows);
                let mut args = vec![Buf::Value(ins[0])];
                let mut kept = vec![mean, rstd];
                // A LayerNorm without weight or bias binds ones or zeros.
                for (at, value) in [(1, 1.0), (2, 0.0)] {
                    if let Some(&src) = ins.get(at) {
                        args.push(Buf::Value(src));
                    } else {
                        let c = self.saved(n.cols);
                        self.calls
                            .push((Kernel::Fill { len: n.cols, value }, vec![c]));
                        args.push(c);
                        kept.push(c);
                    }
                }
                args.extend([out, mean, rstd]);
                self.kept.insert(k, kept);
                (Kernel::LayerNorm(n), args)
            }
            Op::Conv2d { .. } => {
                let conv = self.conv(k, op, ins)?;
                if let Some(w) = Winograd::forward_of(&conv) {
                    let bias = conv.bias.then(|| Buf::Value(ins[2]));
                    self.winograd(&w, Buf::Value(ins[0]), Buf::Value(ins[1]), bias, out);
                    return Ok(());
                }
                let mut args = vec![Buf::Value(ins[0]), Buf::Value(ins[1])];
                if conv.bias {
                    args.push(Buf::Value(ins[2]));
                }
                args.push(out);
                (Kernel::Conv2d(conv), args)
            }
            Op::MaxPool2d { .. } => {
                let pool = self.pool(k, op, ins)?;
                let argmax = self.saved(pool.out_len());
                self.kept.insert(k, vec![argmax]);
                (Kernel::MaxPool(pool), vec![Buf::Value(ins[0]), out, argmax])
            }
            Op::AvgPool2d { .. } => {
                let pool = self.pool(k, op, ins)?;
                (Kernel::AvgPool(pool), vec![Buf::Value(ins[0]), out])
            }
            Op::GlobalAveragePool => {
                let g = self.global_pool(k, op, ins)?;
                (Kernel::GlobalAvgPool(g), vec![Buf::Value(ins[0]), out])
            }
            Op::Dropout { p } if self.train && *p > 0.0 => {
                if *p >= 1.0 {
                    return Err(self.unsupported(k, op, "p must be below 1"));
                }
                let d = DropoutMask {
                    len: y_len,
                    p: *p,
                    scale: dropout::scale(*p),
                };
                let args = self.saved(4);
                let noise = self.saved(y_len);
                let Buf::Saved(at) = args else {
                    return Err(StageError::Internal("saved buffer expected".into()));
                };
                let batch = self.local_shapes[k].first().copied().unwrap_or(1).max(1);
                self.dropouts.push((
                    at,
                    self.layout.nodes[k].name.clone(),
                    (y_len / batch) as u64,
                ));
                self.kept.insert(k, vec![noise]);
                (
                    Kernel::Dropout(d),
                    vec![args, Buf::Value(ins[0]), out, noise],
                )
            }
            Op::Dropout { .. } => (Kernel::Copy { len: y_len }, vec![Buf::Value(ins[0]), out]),
            Op::Gather { axis } => {
                let g = self.gather(k, op, ins, *axis)?;
                if let Source::Input(i) = ins[1] {
                    self.index_checks.push((i, g.axis));
                }
                (
                    Kernel::Gather(g),
                    vec![Buf::Value(ins[0]), Buf::Value(ins[1]), out],
                )
            }
            Op::BatchNorm { eps, momentum } => {
                let bn = self.batch_norm(k, op, ins, *eps, *momentum)?;
                let mut args: Vec<Buf> = ins[..5].iter().map(|&s| Buf::Value(s)).collect();
                args.push(out);
                if self.train {
                    let mean = self.saved(bn.channels);
                    let rstd = self.saved(bn.channels);
                    args.extend([mean, rstd]);
                    self.kept.insert(k, vec![mean, rstd]);
                    if let Some(&Source::Param(p)) = ins.get(5) {
                        self.counted.push(p);
                    }
                    (Kernel::BatchNormTrain(bn), args)
                } else {
                    (Kernel::BatchNormEval(bn), args)
                }
            }
            // The op set grows in `rookery-model` ahead of the backends; an
            // op added there without a lowering must reach the job as a clear
            // error, not break this crate's build.
            #[allow(unreachable_patterns)]
            other => {
                return Err(self.unsupported(k, other, "no kernel lowering yet"));
            }
        };
        self.calls.push(call);
        Ok(())
    }

    fn backward_node(&mut self, k: usize, op: &Op, ins: &[Source]) -> Result<(), StageError> {
        let dy = Buf::Grad(Source::Local(k));
        match op {
            _ if let Some(op) = op.as_unary() => {
                let len = numel(&self.local_shapes[k]);
                self.contribute(ins[0], |_, dest| {
                    vec![(
                        Kernel::UnaryBackward { op, len },
                        vec![Buf::Value(ins[0]), dy, dest],
                    )]
                });
            }
            Op::Flatten { .. } | Op::Reshape { .. } => {
                let len = numel(&self.local_shapes[k]);
                self.contribute(ins[0], |_, dest| {
                    vec![(Kernel::Copy { len }, vec![dy, dest])]
                });
            }
            Op::Add | Op::Sub | Op::Mul | Op::Div => {
                let shapes = self.broadcast(k, op, ins)?;
                let bop = binary(op);
                for (which, wrt) in [(0, Operand::A), (1, Operand::B)] {
                    let shapes = shapes.clone();
                    self.contribute(ins[which], |_, dest| {
                        vec![(
                            Kernel::BinaryBackward {
                                op: bop,
                                shapes,
                                wrt,
                            },
                            vec![Buf::Value(ins[0]), Buf::Value(ins[1]), dy, dest],
                        )]
                    });
                }
            }
            Op::Linear => {
                let linear = self.linear(k, op, ins)?;
                self.contribute(ins[0], |_, dest| {
                    vec![(
                        Kernel::LinearBackwardX(linear),
                        vec![dy, Buf::Value(ins[1]), dest],
                    )]
                });
                self.contribute(ins[1], |_, dest| {
                    vec![(
                        Kernel::LinearBackwardW(linear),
                        vec![dy, Buf::Value(ins[0]), dest],
                    )]
                });
                if linear.bias {
                    self.contribute(ins[2], |_, dest| {
                        vec![(
                            Kernel::SumToShape {
                                from: vec![linear.rows, linear.outputs],
                                to: vec![linear.outputs],
                            },
                            vec![dy, dest],
                        )]
                    });
                }
            }
            Op::MatMul => {
                let mm = self.matmul(k, op, ins)?;
                let (len_a, len_b) = mm.unreduced_lens();
                let full = |m: &MatMul, which: &[usize]| {
                    let mut s = m.out_shape();
                    let r = s.len();
                    s[r - 2] = which[which.len() - 2];
                    s[r - 1] = which[which.len() - 1];
                    s
                };
                let (full_a, full_b) = (full(&mm, &mm.a), full(&mm, &mm.b));
                let a_reduced = len_a == numel(&mm.a);
                let b_reduced = len_b == numel(&mm.b);
                let (m1, m2) = (mm.clone(), mm.clone());
                self.contribute(ins[0], |l, dest| {
                    if a_reduced {
                        return vec![(
                            Kernel::MatMulBackwardA(m1),
                            vec![dy, Buf::Value(ins[1]), dest],
                        )];
                    }
                    let t = Buf::Temp(l.temp(len_a));
                    vec![
                        (
                            Kernel::MatMulBackwardA(m1.clone()),
                            vec![dy, Buf::Value(ins[1]), t],
                        ),
                        (
                            Kernel::SumToShape {
                                from: full_a,
                                to: m1.a.clone(),
                            },
                            vec![t, dest],
                        ),
                    ]
                });
                self.contribute(ins[1], |l, dest| {
                    if b_reduced {
                        return vec![(
                            Kernel::MatMulBackwardB(m2),
                            vec![Buf::Value(ins[0]), dy, dest],
                        )];
                    }
                    let t = Buf::Temp(l.temp(len_b));
                    vec![
                        (
                            Kernel::MatMulBackwardB(m2.clone()),
                            vec![Buf::Value(ins[0]), dy, t],
                        ),
                        (
                            Kernel::SumToShape {
                                from: full_b,
                                to: m2.b.clone(),
                            },
                            vec![t, dest],
                        ),
                    ]
                });
            }
            Op::Softmax { axis } | Op::LogSoftmax { axis } => {
                let s = self.softmax(k, op, ins, *axis)?;
                let y = Buf::Value(Source::Local(k));
                self.contribute(ins[0], |_, dest| {
                    vec![(Kernel::SoftmaxBackward(s), vec![y, dy, dest])]
                });
            }
            // Softmax's backward from the output, then the negation's.
            Op::Softmin { axis } => {
                let s = self.softmax(k, op, ins, *axis)?;
                let y = Buf::Value(Source::Local(k));
                let len = numel(&self.local_shapes[k]);
                self.contribute(ins[0], |l, dest| {
                    let t = l.temp(len);
                    l.free_temps.push((t, len));
                    vec![
                        (Kernel::SoftmaxBackward(s), vec![y, dy, Buf::Temp(t)]),
                        (
                            Kernel::UnaryBackward {
                                op: Unary::Neg,
                                len,
                            },
                            vec![Buf::Value(ins[0]), Buf::Temp(t), dest],
                        ),
                    ]
                });
            }
            Op::Transpose { perm } => {
                let t = Transpose::new(self.shape(ins[0]), perm).ok_or_else(|| {
                    self.unsupported(k, op, "not a permutation of the dimensions")
                })?;
                self.contribute(ins[0], |_, dest| {
                    vec![(Kernel::Transpose(t.inverse()), vec![dy, dest])]
                });
            }
            Op::Concat { axis } => {
                let concat = self.concat(k, op, ins, *axis)?;
                for (part, &src) in ins.iter().enumerate() {
                    let concat = concat.clone();
                    self.contribute(src, |_, dest| {
                        vec![(Kernel::ConcatBackward { concat, part }, vec![dy, dest])]
                    });
                }
            }
            Op::Slice { axis, start, end } => {
                let concat = self.slice(k, op, ins, *axis, *start, *end)?;
                let len = numel(self.shape(ins[0]));
                self.contribute(ins[0], |_, dest| {
                    vec![
                        (Kernel::Fill { len, value: 0.0 }, vec![dest]),
                        (Kernel::Concat { concat, part: 1 }, vec![dy, dest]),
                    ]
                });
            }
            Op::LayerNorm { axis, eps } => {
                let n = self.layer_norm(k, op, ins, *axis, *eps)?;
                let kept = self.kept[&k].clone();
                let (mean, rstd) = (kept[0], kept[1]);
                let mut consts = kept[2..].iter().copied();
                let x = Buf::Value(ins[0]);
                let w = match ins.get(1) {
                    Some(&src) => Buf::Value(src),
                    None => consts
                        .next()
                        .ok_or_else(|| StageError::Internal("LayerNorm lost its ones".into()))?,
                };
                self.contribute(ins[0], |_, dest| {
                    vec![(
                        Kernel::LayerNormBackwardX(n),
                        vec![x, w, mean, rstd, dy, dest],
                    )]
                });
                let params: Vec<Source> = ins[1..].to_vec();
                if params.iter().any(|&p| self.needs_grad(p)) {
                    let mut dests = Vec::new();
                    let mut settle = Vec::new();
                    for at in 1..3 {
                        let (dest, routed) = match ins.get(at) {
                            Some(&src) => self.route(src, n.cols),
                            None => {
                                let t = self.temp(n.cols);
                                (Buf::Temp(t), Routed::Discard(t, n.cols))
                            }
                        };
                        dests.push(dest);
                        settle.push(routed);
                    }
                    self.calls.push((
                        Kernel::LayerNormBackwardParams(n),
                        vec![x, mean, rstd, dy, dests[0], dests[1]],
                    ));
                    for routed in settle {
                        self.settle(routed);
                    }
                }
            }
            Op::Conv2d { .. } => {
                let conv = self.conv(k, op, ins)?;
                self.contribute(ins[0], |l, dest| match Winograd::backward_input(&conv) {
                    Some(w) => l.winograd_calls(&w, dy, Buf::Value(ins[1]), None, dest),
                    None => vec![(
                        Kernel::Conv2dBackwardInput(conv),
                        vec![dy, Buf::Value(ins[1]), dest],
                    )],
                });
                self.contribute(ins[1], |l, dest| {
                    if let Some(w) = Winograd::weight_grad_of(&conv) {
                        return l.winograd_weight_calls(&w, dy, Buf::Value(ins[0]), dest);
                    }
                    let parts = conv.weight_parts();
                    if parts == 1 {
                        return vec![(
                            Kernel::Conv2dBackwardWeight(conv),
                            vec![dy, Buf::Value(ins[0]), dest],
                        )];
                    }
                    // A long reduction in parts on many workgroups, then
                    // added up in a fixed order.
                    let t = Buf::Temp(l.temp(conv.weight_len() * parts as usize));
                    let (from, to) = conv.weight_parts_sum_shapes(parts);
                    vec![
                        (
                            Kernel::Conv2dBackwardWeightParts { conv, parts },
                            vec![dy, Buf::Value(ins[0]), t],
                        ),
                        (Kernel::SumToShape { from, to }, vec![t, dest]),
                    ]
                });
                if conv.bias {
                    let (oh, ow) = conv.out_hw();
                    self.contribute(ins[2], |_, dest| {
                        vec![(
                            Kernel::SumToShape {
                                from: vec![conv.n, conv.o, oh * ow],
                                to: vec![conv.o, 1],
                            },
                            vec![dy, dest],
                        )]
                    });
                }
            }
            Op::MaxPool2d { .. } => {
                let pool = self.pool(k, op, ins)?;
                let argmax = self.kept[&k][0];
                self.contribute(ins[0], |_, dest| {
                    vec![(Kernel::MaxPoolBackward(pool), vec![argmax, dy, dest])]
                });
            }
            Op::AvgPool2d { .. } => {
                let pool = self.pool(k, op, ins)?;
                self.contribute(ins[0], |_, dest| {
                    vec![(Kernel::AvgPoolBackward(pool), vec![dy, dest])]
                });
            }
            Op::GlobalAveragePool => {
                let g = self.global_pool(k, op, ins)?;
                self.contribute(ins[0], |_, dest| {
                    vec![(Kernel::GlobalAvgPoolBackward(g), vec![dy, dest])]
                });
            }
            Op::Dropout { .. } => match self.kept.get(&k) {
                Some(kept) => {
                    let noise = kept[0];
                    let shape = self.local_shapes[k].clone();
                    let shapes = Broadcast::new(&shape, &shape)
                        .ok_or_else(|| StageError::Internal("shape does not broadcast".into()))?;
                    self.contribute(ins[0], |_, dest| {
                        vec![(
                            Kernel::Binary {
                                op: BinaryOp::Mul,
                                shapes,
                            },
                            vec![dy, noise, dest],
                        )]
                    });
                }
                None => {
                    let len = numel(&self.local_shapes[k]);
                    self.contribute(ins[0], |_, dest| {
                        vec![(Kernel::Copy { len }, vec![dy, dest])]
                    });
                }
            },
            Op::Gather { axis } => {
                let g = self.gather(k, op, ins, *axis)?;
                self.contribute(ins[0], |_, dest| {
                    vec![(
                        Kernel::GatherBackward(g),
                        vec![Buf::Value(ins[1]), dy, dest],
                    )]
                });
            }
            Op::BatchNorm { eps, momentum } => {
                let bn = self.batch_norm(k, op, ins, *eps, *momentum)?;
                let kept = self.kept[&k].clone();
                let len = numel(self.shape(ins[0]));
                let (dx, rx) = self.route(ins[0], len);
                let (dw, rw) = self.route(ins[1], bn.channels);
                let (db, rb) = self.route(ins[2], bn.channels);
                self.calls.push((
                    Kernel::BatchNormBackward(bn),
                    vec![
                        Buf::Value(ins[0]),
                        Buf::Value(ins[1]),
                        kept[0],
                        kept[1],
                        dy,
                        dx,
                        dw,
                        db,
                    ],
                ));
                for routed in [rx, rw, rb] {
                    self.settle(routed);
                }
            }
            #[allow(unreachable_patterns)]
            other => return Err(self.unsupported(k, other, "no kernel lowering yet")),
        }
        Ok(())
    }

    fn gather(&self, k: usize, op: &Op, ins: &[Source], a: i64) -> Result<Gather, StageError> {
        if ins.len() != 2 {
            return Err(self.unsupported(k, op, "expects data and indices"));
        }
        let data = self.shape(ins[0]);
        let a = self.axis(k, op, a, data.len())?;
        Ok(Gather {
            outer: data[..a].iter().product(),
            axis: data[a],
            inner: data[a + 1..].iter().product(),
            count: numel(self.shape(ins[1])),
        })
    }

    fn batch_norm(
        &self,
        k: usize,
        op: &Op,
        ins: &[Source],
        eps: f32,
        momentum: f32,
    ) -> Result<BatchNorm, StageError> {
        if ins.len() < 5 {
            return Err(self.unsupported(
                k,
                op,
                "expects x, weight, bias, running_mean, running_var",
            ));
        }
        let shape = self.shape(ins[0]);
        if shape.len() < 2 {
            return Err(self.unsupported(k, op, "expects x [N, C, ..]"));
        }
        let bn = BatchNorm {
            n: shape[0],
            channels: shape[1],
            spatial: shape[2..].iter().product(),
            eps,
            momentum,
        };
        for &p in &ins[1..5] {
            if numel(self.shape(p)) != bn.channels {
                return Err(self.unsupported(k, op, "statistics differ from the channels"));
            }
        }
        // nn.BatchNorm's own check: one value per channel has no variance.
        if self.train && bn.n * bn.spatial <= 1 {
            return Err(self.unsupported(
                k,
                op,
                &format!(
                    "expected more than 1 value per channel when training, got input size {shape:?}"
                ),
            ));
        }
        Ok(bn)
    }

    fn axis(&self, k: usize, op: &Op, a: i64, rank: usize) -> Result<usize, StageError> {
        let r = rank as i64;
        let resolved = if a < 0 { a + r } else { a };
        if resolved < 0 || resolved >= r.max(1) {
            return Err(self.unsupported(k, op, &format!("axis {a} out of range for rank {rank}")));
        }
        Ok(resolved as usize)
    }

    fn softmax(&self, k: usize, op: &Op, ins: &[Source], a: i64) -> Result<Softmax, StageError> {
        let shape = self.shape(ins[0]);
        let a = self.axis(k, op, a, shape.len())?;
        let (outer, axis, inner) = split_at_axis(shape, a);
        Ok(Softmax {
            outer,
            axis,
            inner,
            log: matches!(op, Op::LogSoftmax { .. }),
        })
    }

    fn concat(&self, k: usize, op: &Op, ins: &[Source], a: i64) -> Result<Concat, StageError> {
        let first = self.shape(ins[0]).to_vec();
        let a = self.axis(k, op, a, first.len())?;
        let mut sizes = Vec::with_capacity(ins.len());
        for &src in ins {
            let s = self.shape(src);
            if s.len() != first.len() || s[..a] != first[..a] || s[a + 1..] != first[a + 1..] {
                return Err(self.unsupported(k, op, "inputs differ off the concatenation axis"));
            }
            sizes.push(s[a]);
        }
        Ok(Concat {
            outer: first[..a].iter().product(),
            sizes,
            inner: first[a + 1..].iter().product(),
        })
    }

    /// `[start, end)` of axis `a` as part 1 of a three-part concatenation.
    fn slice(
        &self,
        k: usize,
        op: &Op,
        ins: &[Source],
        a: i64,
        start: usize,
        end: usize,
    ) -> Result<Concat, StageError> {
        let shape = self.shape(ins[0]);
        let a = self.axis(k, op, a, shape.len())?;
        if start >= end || end > shape[a] {
            return Err(self.unsupported(k, op, "the slice is empty or past the axis' end"));
        }
        Ok(Concat {
            outer: shape[..a].iter().product(),
            sizes: vec![start, end - start, shape[a] - end],
            inner: shape[a + 1..].iter().product(),
        })
    }

    fn layer_norm(
        &self,
        k: usize,
        op: &Op,
        ins: &[Source],
        a: i64,
        eps: f32,
    ) -> Result<LayerNorm, StageError> {
        let shape = self.shape(ins[0]);
        let a = self.axis(k, op, a, shape.len())?;
        let cols: usize = shape[a..].iter().product();
        for &p in &ins[1..] {
            if numel(self.shape(p)) != cols {
                return Err(self.unsupported(
                    k,
                    op,
                    "weight or bias differs from the normalised shape",
                ));
            }
        }
        Ok(LayerNorm {
            rows: shape[..a].iter().product(),
            cols,
            eps,
        })
    }

    fn conv(&self, k: usize, op: &Op, ins: &[Source]) -> Result<Conv2d, StageError> {
        let (x, weight) = (self.shape(ins[0]), self.shape(ins[1]));
        if x.len() != 4 || weight.len() != 4 {
            return Err(self.unsupported(
                k,
                op,
                "expects x [N, C, H, W] and weight [O, C/g, kh, kw]",
            ));
        }
        op.conv_geometry(x, weight, ins.len() > 2)
            .map(|c| Conv2d {
                precision: self.precision,
                ..c
            })
            .ok_or_else(|| self.unsupported(k, op, "invalid convolution geometry"))
    }

    fn pool(&self, k: usize, op: &Op, ins: &[Source]) -> Result<Pool2d, StageError> {
        let &[n, c, h, w] = self.shape(ins[0]) else {
            return Err(self.unsupported(k, op, "expects x [N, C, H, W]"));
        };
        op.pool_geometry(n * c, h, w)
            .ok_or_else(|| self.unsupported(k, op, "invalid pooling geometry"))
    }

    fn global_pool(&self, k: usize, op: &Op, ins: &[Source]) -> Result<GlobalAvgPool, StageError> {
        let shape = self.shape(ins[0]);
        if shape.len() < 3 {
            return Err(self.unsupported(k, op, "expects x [N, C, spatial..]"));
        }
        Ok(GlobalAvgPool {
            planes: shape[0] * shape[1],
            spatial: shape[2..].iter().product(),
        })
    }

    fn broadcast(&self, k: usize, op: &Op, ins: &[Source]) -> Result<Broadcast, StageError> {
        Broadcast::new(self.shape(ins[0]), self.shape(ins[1]))
            .ok_or_else(|| self.unsupported(k, op, "operand shapes do not broadcast"))
    }

    fn linear(&self, k: usize, op: &Op, ins: &[Source]) -> Result<Linear, StageError> {
        let x = self.shape(ins[0]);
        let w = self.shape(ins[1]);
        let (Some(&inputs), [outputs, w_in]) = (x.last(), w) else {
            return Err(self.unsupported(k, op, "expects x [.., in] and weight [out, in]"));
        };
        if inputs != *w_in || inputs == 0 {
            return Err(self.unsupported(k, op, "input width differs from the weight's"));
        }
        Ok(Linear {
            precision: self.precision,
            ..Linear::new(numel(x) / inputs, inputs, *outputs, ins.len() > 2)
        })
    }

    fn matmul(&self, k: usize, op: &Op, ins: &[Source]) -> Result<MatMul, StageError> {
        MatMul::new(self.shape(ins[0]), self.shape(ins[1]))
            .map(|m| MatMul {
                precision: self.precision,
                ..m
            })
            .ok_or_else(|| self.unsupported(k, op, "operand shapes do not multiply"))
    }
}

fn binary(op: &Op) -> BinaryOp {
    match op {
        Op::Sub => BinaryOp::Sub,
        Op::Mul => BinaryOp::Mul,
        Op::Div => BinaryOp::Div,
        _ => BinaryOp::Add,
    }
}
