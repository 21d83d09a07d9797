//! The activations beyond ReLU, GELU, sigmoid and tanh: the ONNX ops that
//! name them (`LeakyRelu`, `Elu`, `Selu`, `Softplus`, `Softsign`, `Shrink`,
//! `Clip` with constant bounds, `ThresholdedRelu`), and the spellings
//! PyTorch's two exporters write for the ones ONNX has no op for.
//!
//! What the exporters write (torch 2.13, `dynamo=True, optimize=False` and
//! the legacy TorchScript exporter in training mode):
//!
//! - softplus with beta or threshold (dynamo, always):
//!   `Where(Greater(Mul(x, b), t), x, Div(Softplus(Mul(x, b)), b))`; the
//!   legacy exporter drops the threshold (`Div(Softplus(Mul(x, b)), b)`,
//!   plain ops here, or `Softplus(x)` at beta 1);
//! - threshold (dynamo): `Where(LessOrEqual(x, t), v, x)` (the legacy
//!   exporter refuses any but threshold 0, value 0, which it writes as Relu);
//! - hardshrink: `Where(LessOrEqual(Abs(x), l), 0, x)` (dynamo),
//!   `Where(Or(Greater(x, l), Less(x, -l)), x, 0)` (legacy);
//! - softshrink: `Where(Greater(Abs(x), l), Sub(x, Mul(Sign(x), l)), Mul(x,
//!   0))` (dynamo), `Add(Where(Greater(x, l), Sub(x, l), 0), Where(Less(x,
//!   -l), Add(x, l), 0))` (legacy);
//! - elu (dynamo): `Mul(Elu(Mul(x, 1)), 1)`, torch's scale and input scale;
//! - tanhshrink `Sub(x, Tanh(x))`, log-sigmoid `Log(Sigmoid(x))`, softsign
//!   `Div(x, Add(Abs(x), 1))` (both), softmin `Softmax(Neg(x))` (both;
//!   imported as those two ops).
//!
//! Comparisons, `Sign` and `Where` of run-time tensors, which the op set
//! has no kernels for, are kept as expressions ([`Sym`]) rather than refused
//! at once; the node that completes one of the spellings above becomes the
//! one activation op, and the nodes it leaves unread are pruned. Anything
//! else that reads such an expression is refused, naming it. Tanhshrink,
//! log-sigmoid, softsign and elu are recognised on plain ops too, so the
//! graph runs the one activation (log-sigmoid without the `log(0)` of a
//! saturated sigmoid).

use super::{Here, Importer, Val};
use crate::error::OnnxError;
use crate::ops::Op;

/// A value of run-time tensors kept as an expression for the patterns above.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Sym {
    /// A tensor of the graph, by its graph name.
    Tensor(String),
    /// A constant with one element.
    Scalar(f64),
    /// An ONNX op of expressions.
    Node(String, Vec<Sym>),
    /// Anything else (a weight, a constant of many elements).
    Opaque,
}

/// ONNX ops kept as expressions where they read run-time values.
fn symbolic(op: &str) -> bool {
    matches!(
        op,
        "Greater"
            | "Less"
            | "GreaterOrEqual"
            | "LessOrEqual"
            | "Equal"
            | "Not"
            | "And"
            | "Or"
            | "Xor"
            | "Sign"
            | "Where"
    )
}

/// Ops that may complete a spelling, or pass an expression on.
fn carries(op: &str) -> bool {
    symbolic(op)
        || matches!(
            op,
            "Add"
                | "Sub"
                | "Mul"
                | "Div"
                | "Neg"
                | "Abs"
                | "Log"
                | "Cast"
                | "CastLike"
                | "Identity"
        )
}

/// The f32 of an ONNX attribute or constant, compared as torch's f32 are.
fn same(a: f64, b: f64) -> bool {
    a as f32 == b as f32
}

impl Importer<'_> {
    /// The ONNX ops that name one of these activations.
    pub(super) fn activation(&mut self, here: &Here) -> Result<(), OnnxError> {
        let attr = |name: &str, default: f32| here.attrs.float(name).unwrap_or(default);
        let op = match here.op {
            "LeakyRelu" => Op::LeakyRelu {
                negative_slope: attr("alpha", 0.01),
            },
            "Elu" => Op::Elu {
                alpha: attr("alpha", 1.0),
            },
            "Selu" => {
                // ONNX's defaults are torch's constants rounded to f32.
                let (alpha, gamma) = (attr("alpha", SELU_ALPHA), attr("gamma", SELU_GAMMA));
                if alpha != SELU_ALPHA || gamma != SELU_GAMMA {
                    return Err(self.unsupported(
                        here,
                        format!(
                            "alpha = {alpha}, gamma = {gamma}: only SELU's own constants \
                             (alpha {SELU_ALPHA}, gamma {SELU_GAMMA}, torch.nn.SELU's)"
                        ),
                    ));
                }
                Op::Selu
            }
            // ONNX's softplus has no threshold; above torch's 20, `log(1 +
            // exp(x))` is `x` to within 2e-9, which rounds away in f32.
            "Softplus" => Op::Softplus {
                beta: 1.0,
                threshold: 20.0,
            },
            "Softsign" => Op::Softsign,
            "Shrink" => {
                let (lambd, bias) = (attr("lambd", 0.5), attr("bias", 0.0));
                if bias == 0.0 {
                    Op::Hardshrink { lambd }
                } else if bias == lambd {
                    Op::Softshrink { lambd }
                } else {
                    return Err(self.unsupported(
                        here,
                        format!(
                            "lambd = {lambd} with bias = {bias}: only bias 0 (hardshrink) or \
                             bias = lambd (softshrink)"
                        ),
                    ));
                }
            }
            "Clip" => self.clip(here)?,
            "ThresholdedRelu" => Op::Threshold {
                threshold: attr("alpha", 1.0),
                value: 0.0,
            },
            _ => return Err(self.node_err(here, "not an activation")),
        };
        let x = self.tensor_input(here, 0)?;
        self.emit(here, &here.out, op, vec![x])
    }

    /// `Clip` with bounds known at import time, as hardtanh (whose gradient
    /// is 0 at the bounds, where `torch.clamp`'s passes; the two agree
    /// everywhere else). A missing bound is the largest finite f32, which
    /// only an infinite input reaches.
    fn clip(&self, here: &Here) -> Result<Op, OnnxError> {
        let bound = |i: usize, attr: &str, default: f32| -> Result<f32, OnnxError> {
            if self.opset < 11 {
                return Ok(here.attrs.float(attr).unwrap_or(default));
            }
            if !here.present(i) {
                return Ok(default);
            }
            let t = self.known(here, i).ok_or_else(|| {
                self.unsupported(here, format!("the {attr} bound is computed at run time"))
            })?;
            match t.to_f32().as_slice() {
                [v] => Ok(*v),
                _ => Err(self.unsupported(here, format!("a {attr} bound of shape {:?}", t.shape))),
            }
        };
        let (min_val, max_val) = (bound(1, "min", -f32::MAX)?, bound(2, "max", f32::MAX)?);
        if !(min_val.is_finite() && max_val.is_finite()) || min_val > max_val {
            return Err(self.unsupported(
                here,
                format!("bounds [{min_val}, {max_val}] (finite, min at most max)"),
            ));
        }
        Ok(Op::Hardtanh { min_val, max_val })
    }

    /// Keeps comparisons and `Where` of run-time tensors as expressions, and
    /// emits the activation where a node completes one of PyTorch's
    /// spellings of it. `Ok(true)` where the node is taken care of.
    pub(super) fn symbolic_node(&mut self, here: &Here) -> Result<bool, OnnxError> {
        let op = here.op;
        let pending = here
            .ins
            .iter()
            .position(|v| matches!(v, Some(Val::Pending { .. })));
        let runtime = here
            .ins
            .iter()
            .any(|v| matches!(v, Some(Val::Graph(_) | Val::Var(_))));
        let keeps = symbolic(op) && runtime;
        let roots = matches!(op, "Where" | "Add" | "Sub" | "Mul" | "Div" | "Log");
        if pending.is_none() && !keeps && !roots {
            return Ok(false);
        }
        let args = (0..here.ins.len()).map(|i| self.sym_of(here, i)).collect();
        let sym = Sym::Node(op.to_string(), args);
        if let Some((rop, x)) = self.recognize(&sym) {
            self.emit(here, &here.out, rop, vec![x])?;
            return Ok(true);
        }
        if let Some(i) = pending {
            if !carries(op) {
                let Some(Val::Pending { node, op: from, .. }) = here.ins[i].as_ref() else {
                    return Err(self.node_err(here, "lost an input"));
                };
                return Err(self.unsupported(
                    here,
                    format!(
                        "reads `{}`, computed by {from} of run-time tensors (node `{node}`), which \
                         Rookery runs only within the activations PyTorch's exporters spell \
                         with it (softplus, threshold, hardshrink, softshrink)",
                        here.proto.input.get(i).map_or("", String::as_str)
                    ),
                ));
            }
        } else if !keeps {
            return Ok(false);
        }
        let (node, from) = match pending.and_then(|i| here.ins[i].as_ref()) {
            Some(Val::Pending { node, op, .. }) => (node.clone(), op.clone()),
            _ => (here.node.clone(), op.to_string()),
        };
        self.vals.insert(
            here.out.clone(),
            Val::Pending {
                sym,
                node,
                op: from,
            },
        );
        Ok(true)
    }

    /// Input `i` as an expression.
    fn sym_of(&self, here: &Here, i: usize) -> Sym {
        let name = here.proto.input.get(i).map_or("", String::as_str);
        match here.ins.get(i) {
            Some(Some(Val::Graph(_))) => Sym::Tensor(name.to_string()),
            Some(Some(Val::Pending { sym, .. })) => sym.clone(),
            Some(Some(Val::Const(t, _))) => match t.to_f32().as_slice() {
                [v] => Sym::Scalar(f64::from(*v)),
                _ => Sym::Opaque,
            },
            _ => Sym::Opaque,
        }
    }

    /// A graph tensor's name, or a constant's value, as an expression.
    fn sym_of_name(&self, name: &str) -> Sym {
        if let Some(p) = self.constants.iter().find(|p| p.name == name)
            && let crate::init::Init::Values { data } = &p.init
            && let [v] = data.as_slice()
        {
            return Sym::Scalar(f64::from(*v));
        }
        match self.vals.get(name) {
            Some(Val::Const(t, _)) => match t.to_f32().as_slice() {
                [v] => Sym::Scalar(f64::from(*v)),
                _ => Sym::Opaque,
            },
            Some(Val::Graph(_)) => Sym::Tensor(name.to_string()),
            _ => Sym::Opaque,
        }
    }

    /// `s` as an op and its arguments: an expression's own, or the graph
    /// node that computes a tensor (for the ops the spellings use). Casts
    /// and `Identity` are looked through.
    fn view(&self, s: &Sym) -> Option<(String, Vec<Sym>)> {
        match s {
            Sym::Node(op, args) if matches!(op.as_str(), "Cast" | "CastLike" | "Identity") => {
                self.view(args.first()?)
            }
            Sym::Node(op, args) => Some((op.clone(), args.clone())),
            Sym::Tensor(name) => {
                let node = &self.nodes[*self.produced.get(name)?];
                let ins: Vec<Sym> = node.inputs.iter().map(|n| self.sym_of_name(n)).collect();
                let op = match node.op {
                    Op::Abs => "Abs",
                    Op::Neg => "Neg",
                    Op::Add => "Add",
                    Op::Sub => "Sub",
                    Op::Mul => "Mul",
                    Op::Div => "Div",
                    Op::Tanh => "Tanh",
                    Op::Sigmoid => "Sigmoid",
                    Op::Softplus {
                        beta: 1.0,
                        threshold: 20.0,
                    } => "Softplus",
                    Op::Elu { alpha } => {
                        let mut ins = ins;
                        ins.push(Sym::Scalar(f64::from(alpha)));
                        return Some(("Elu".into(), ins));
                    }
                    _ => return None,
                };
                Some((op.into(), ins))
            }
            _ => None,
        }
    }

    /// The arguments of `s` where it is `op`.
    fn args_of(&self, s: &Sym, op: &str) -> Option<Vec<Sym>> {
        let (o, args) = self.view(s)?;
        (o == op).then_some(args)
    }

    /// The value of a one-element constant.
    fn scalar_value(&self, s: &Sym) -> Option<f64> {
        match s {
            Sym::Scalar(v) => Some(*v),
            Sym::Node(op, args) if matches!(op.as_str(), "Cast" | "CastLike" | "Identity") => {
                self.scalar_value(args.first()?)
            }
            _ => None,
        }
    }

    /// `op(x, c)` or `op(c, x)` for a commutative `op`: `(x, c)`.
    fn with_scalar(&self, s: &Sym, op: &str) -> Option<(Sym, f64)> {
        let a = self.args_of(s, op)?;
        match (self.scalar_value(&a[0]), self.scalar_value(a.get(1)?)) {
            (None, Some(c)) => Some((a[0].clone(), c)),
            (Some(c), None) if matches!(op, "Mul" | "Add") => Some((a[1].clone(), c)),
            _ => None,
        }
    }

    /// The tensor `s` is, where it is one.
    fn tensor<'s>(&self, s: &'s Sym) -> Option<&'s str> {
        match s {
            Sym::Tensor(name) => Some(name),
            _ => None,
        }
    }

    /// Which activation of which tensor `s` computes, if it is one of the
    /// spellings in the module docs.
    fn recognize(&self, s: &Sym) -> Option<(Op, String)> {
        let Sym::Node(op, a) = s else {
            return None;
        };
        let one = |x: &Sym, op: Op| Some((op, self.tensor(x)?.to_string()));
        match (op.as_str(), a.as_slice()) {
            ("Where", [cond, yes, no]) => self.recognize_where(cond, yes, no),
            ("Add", [p, q]) => self
                .softshrink_halves(p, q)
                .or_else(|| self.softshrink_halves(q, p)),
            // elu: Mul(Elu(Mul(x, 1), alpha), 1).
            ("Mul", _) => {
                let (inner, scale) = self.with_scalar(s, "Mul")?;
                let e = self.args_of(&inner, "Elu")?;
                let (x, input_scale) = self.with_scalar(&e[0], "Mul")?;
                let alpha = self.scalar_value(e.get(1)?)? as f32;
                (scale == 1.0 && input_scale == 1.0).then_some(())?;
                one(&x, Op::Elu { alpha })
            }
            ("Sub", [x, t]) => {
                (self.args_of(t, "Tanh")?.first()? == x).then_some(())?;
                one(x, Op::Tanhshrink)
            }
            ("Div", [x, d]) => {
                let (abs, c) = self.with_scalar(d, "Add")?;
                (c == 1.0 && self.args_of(&abs, "Abs")?.first()? == x).then_some(())?;
                one(x, Op::Softsign)
            }
            ("Log", [s]) => one(self.args_of(s, "Sigmoid")?.first()?, Op::LogSigmoid),
            _ => None,
        }
    }

    fn recognize_where(&self, cond: &Sym, yes: &Sym, no: &Sym) -> Option<(Op, String)> {
        let (c, ca) = self.view(cond)?;
        let at = |i: usize| ca.get(i);
        let one = |x: &Sym, op: Op| Some((op, self.tensor(x)?.to_string()));
        match c.as_str() {
            // threshold: Where(x <= t, v, x); hardshrink: Where(|x| <= l, 0, x).
            "LessOrEqual" => {
                let t = self.scalar_value(at(1)?)?;
                if at(0)? == no {
                    let value = self.scalar_value(yes)?;
                    return one(
                        no,
                        Op::Threshold {
                            threshold: t as f32,
                            value: value as f32,
                        },
                    );
                }
                let x = self.args_of(at(0)?, "Abs")?;
                (x.first()? == no && self.scalar_value(yes)? == 0.0).then_some(())?;
                one(no, Op::Hardshrink { lambd: t as f32 })
            }
            "Greater" => {
                let t = self.scalar_value(at(1)?)?;
                // softplus: Where(x b > t, x, Softplus(x b) / b).
                if let Some((x, beta)) = self.with_scalar(at(0)?, "Mul") {
                    let (soft, b2) = self.with_scalar(no, "Div")?;
                    let (x2, b3) =
                        self.with_scalar(self.args_of(&soft, "Softplus")?.first()?, "Mul")?;
                    (&x == yes && x2 == x && same(beta, b2) && same(beta, b3)).then_some(())?;
                    return one(
                        &x,
                        Op::Softplus {
                            beta: beta as f32,
                            threshold: t as f32,
                        },
                    );
                }
                // softshrink: Where(|x| > l, x - sign(x) l, x 0).
                let x = self.args_of(at(0)?, "Abs")?.first()?.clone();
                let (x2, zero) = self.with_scalar(no, "Mul")?;
                let s = self.args_of(yes, "Sub")?;
                let (sign, l2) = self.with_scalar(s.get(1)?, "Mul")?;
                let ok = x2 == x
                    && zero == 0.0
                    && s[0] == x
                    && self.args_of(&sign, "Sign")?.first()? == &x
                    && same(t, l2);
                ok.then_some(())?;
                one(&x, Op::Softshrink { lambd: t as f32 })
            }
            // hardshrink: Where(x > l or x < -l, x, 0).
            "Or" => {
                let (x, l) = self.compared(at(0)?, "Greater")?;
                let (x2, m) = self.compared(at(1)?, "Less")?;
                let ok = x == x2 && &x == yes && same(m, -l) && self.scalar_value(no)? == 0.0;
                ok.then_some(())?;
                one(&x, Op::Hardshrink { lambd: l as f32 })
            }
            _ => None,
        }
    }

    /// `op(x, c)` of a comparison: `(x, c)`.
    fn compared(&self, s: &Sym, op: &str) -> Option<(Sym, f64)> {
        let a = self.args_of(s, op)?;
        Some((a.first()?.clone(), self.scalar_value(a.get(1)?)?))
    }

    /// The legacy softshrink: `p` is `Where(x > l, x - l, 0)` and `q` is
    /// `Where(x < -l, x + l, 0)`.
    fn softshrink_halves(&self, p: &Sym, q: &Sym) -> Option<(Op, String)> {
        let upper = self.args_of(p, "Where")?;
        let lower = self.args_of(q, "Where")?;
        let (x, l) = self.compared(upper.first()?, "Greater")?;
        let (x2, m) = self.compared(lower.first()?, "Less")?;
        let (x3, l2) = self.with_scalar(upper.get(1)?, "Sub")?;
        let (x4, l3) = self.with_scalar(lower.get(1)?, "Add")?;
        let zeros =
            self.scalar_value(upper.get(2)?)? == 0.0 && self.scalar_value(lower.get(2)?)? == 0.0;
        let ok = x == x2 && x == x3 && x == x4 && same(m, -l) && same(l, l2) && same(l, l3);
        (ok && zeros).then_some(())?;
        Some((
            Op::Softshrink { lambd: l as f32 },
            self.tensor(&x)?.to_string(),
        ))
    }
}

/// ONNX `Selu`'s default alpha and gamma: torch's SELU constants in f32.
const SELU_ALPHA: f32 = 1.673_263_2;
const SELU_GAMMA: f32 = 1.050_701;
