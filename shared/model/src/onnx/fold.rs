//! Import-time evaluation of the ops exporters use for shape arithmetic
//! (`Constant`, `Concat`, `Slice`, `Gather`, `Range`, `Div`, `Cast`, ...). The
//! graph's shapes are all known from the example input, so every such chain ends
//! in a constant, which the importer folds into an op attribute (a `Reshape`
//! target, a `Dropout` ratio) or keeps as a constant tensor. Errors are plain
//! strings; the caller adds the node, op and file.

use super::pb::AttributeProto;
use super::tensor::{Data, Elem, Tensor, decode};

/// Largest constant the folder will build; larger ones mean something other
/// than shape arithmetic is being folded, which would bloat the graph.
const MAX_FOLDED_ELEMENTS: usize = 1 << 24;

/// A node's attributes, looked up by name.
pub(crate) struct Attrs<'a>(pub &'a [AttributeProto]);

impl Attrs<'_> {
    pub(crate) fn get(&self, name: &str) -> Option<&AttributeProto> {
        self.0.iter().find(|a| a.name() == name)
    }

    pub(crate) fn int(&self, name: &str) -> Option<i64> {
        self.get(name).map(|a| a.i())
    }

    pub(crate) fn ints(&self, name: &str) -> Option<Vec<i64>> {
        self.get(name).map(|a| a.ints.clone())
    }

    pub(crate) fn float(&self, name: &str) -> Option<f32> {
        self.get(name).map(|a| a.f())
    }

    pub(crate) fn string(&self, name: &str) -> Option<String> {
        self.get(name)
            .map(|a| String::from_utf8_lossy(a.s()).into_owned())
    }

    fn tensor(&self, name: &str) -> Result<Option<Tensor>, String> {
        match self.get(name).and_then(|a| a.t.as_ref()) {
            Some(t) => decode(t, None)
                .map(Some)
                .map_err(|e| format!("attribute `{name}`: {e}")),
            None => Ok(None),
        }
    }
}

/// Ops [`eval`] can fold when all their inputs are constants.
pub(crate) fn is_foldable(op: &str) -> bool {
    matches!(
        op,
        "Constant"
            | "Identity"
            | "Cast"
            | "CastLike"
            | "Concat"
            | "Slice"
            | "Unsqueeze"
            | "Squeeze"
            | "Gather"
            | "Reshape"
            | "Flatten"
            | "Transpose"
            | "Expand"
            | "ConstantOfShape"
            | "Range"
            | "Where"
            | "ReduceProd"
            | "ReduceSum"
            | "ReduceMax"
            | "ReduceMin"
    ) || binary_op(op).is_some()
        || unary_op(op).is_some()
}

/// Evaluates a foldable op. `ins` has one entry per node input; `None` marks an
/// omitted optional input (an empty name).
pub(crate) fn eval(
    op: &str,
    attrs: &Attrs,
    ins: &[Option<&Tensor>],
    opset: i64,
) -> Result<Tensor, String> {
    let input = |i: usize| -> Result<&Tensor, String> {
        ins.get(i)
            .copied()
            .flatten()
            .ok_or_else(|| format!("missing input {i}"))
    };
    let opt = |i: usize| ins.get(i).copied().flatten();
    let out = match op {
        "Constant" => constant(attrs)?,
        "Identity" => input(0)?.clone(),
        "Cast" => {
            let to = attrs.int("to").ok_or("missing attribute `to`")?;
            let elem = Elem::from_onnx(to as i32)
                .ok_or_else(|| format!("cast to element type {to} is not supported"))?;
            input(0)?.cast(elem)
        }
        "CastLike" => input(0)?.cast(input(1)?.elem),
        "Concat" => {
            let parts: Vec<&Tensor> = ins.iter().flatten().copied().collect();
            concat(&parts, attrs.int("axis").ok_or("missing attribute `axis`")?)?
        }
        "Slice" => {
            let x = input(0)?;
            // Opset 10 moved starts/ends/axes/steps from attributes to inputs.
            let (starts, ends, axes, steps) = if opset >= 10 {
                (
                    input(1)?.as_i64(),
                    input(2)?.as_i64(),
                    opt(3).map(Tensor::as_i64),
                    opt(4).map(Tensor::as_i64),
                )
            } else {
                (
                    attrs.ints("starts").ok_or("missing attribute `starts`")?,
                    attrs.ints("ends").ok_or("missing attribute `ends`")?,
                    attrs.ints("axes"),
                    None,
                )
            };
            slice(x, &starts, &ends, axes, steps)?
        }
        "Unsqueeze" => {
            let x = input(0)?;
            let axes = axes_of(opt(1), attrs).ok_or("missing axes")?;
            x.reshaped(unsqueeze_shape(&x.shape, &axes)?)
        }
        "Squeeze" => {
            let x = input(0)?;
            let axes = axes_of(opt(1), attrs);
            x.reshaped(squeeze_shape(&x.shape, axes.as_deref())?)
        }
        "Gather" => gather(input(0)?, input(1)?, attrs.int("axis").unwrap_or(0))?,
        "Reshape" => {
            let x = input(0)?;
            let allowzero = attrs.int("allowzero").unwrap_or(0) != 0;
            x.reshaped(reshape_shape(&x.shape, &input(1)?.as_i64(), allowzero)?)
        }
        "Flatten" => {
            let x = input(0)?;
            let a = norm_axis(attrs.int("axis").unwrap_or(1), x.shape.len() + 1)?;
            let front = x.shape[..a].iter().product();
            x.reshaped(vec![front, x.numel() / front.max(1)])
        }
        "Transpose" => {
            let x = input(0)?;
            let perm = match attrs.ints("perm") {
                Some(p) => p
                    .iter()
                    .map(|&a| norm_axis(a, x.shape.len()))
                    .collect::<Result<Vec<_>, _>>()?,
                None => (0..x.shape.len()).rev().collect(),
            };
            transpose(x, &perm)?
        }
        "Expand" => {
            let x = input(0)?;
            let target = dims(&input(1)?.as_i64())?;
            let shape = broadcast_shapes(&x.shape, &target)?;
            broadcast_to(x, &shape)?
        }
        "ConstantOfShape" => {
            let shape = dims(&input(0)?.as_i64())?;
            let value = attrs.tensor("value")?.unwrap_or_else(|| Tensor {
                elem: Elem::F32,
                shape: vec![1],
                data: Data::Float(vec![0.0]),
            });
            if value.len() != 1 {
                return Err("`value` must hold exactly one element".into());
            }
            let one = value.reshaped(vec![]);
            broadcast_to(&one, &shape)?
        }
        "Range" => range(input(0)?, input(1)?, input(2)?)?,
        "Where" => {
            let (c, x, y) = (input(0)?, input(1)?, input(2)?);
            let shape = broadcast_shapes(&broadcast_shapes(&c.shape, &x.shape)?, &y.shape)?;
            let (c, x, y) = (
                broadcast_to(c, &shape)?,
                broadcast_to(x, &shape)?,
                broadcast_to(y, &shape)?,
            );
            let cond = c.as_i64();
            let data = match (&x.data, &y.data) {
                (Data::Float(a), Data::Float(b)) => Data::Float(
                    cond.iter()
                        .zip(a.iter().zip(b))
                        .map(|(&c, (&a, &b))| if c != 0 { a } else { b })
                        .collect(),
                ),
                (Data::Int(a), Data::Int(b)) => Data::Int(
                    cond.iter()
                        .zip(a.iter().zip(b))
                        .map(|(&c, (&a, &b))| if c != 0 { a } else { b })
                        .collect(),
                ),
                _ => return Err("branches have different element types".into()),
            };
            Tensor {
                elem: x.elem,
                shape,
                data,
            }
        }
        "ReduceProd" | "ReduceSum" | "ReduceMax" | "ReduceMin" => {
            let x = input(0)?;
            let axes = axes_of(opt(1), attrs);
            let keep = attrs.int("keepdims").unwrap_or(1) != 0;
            let noop = attrs.int("noop_with_empty_axes").unwrap_or(0) != 0;
            reduce(op, x, axes.as_deref(), keep, noop)?
        }
        _ => {
            if let Some(f) = binary_op(op) {
                let mut acc = input(0)?.clone();
                // Min and Max are variadic; the others have exactly two inputs.
                for other in ins.iter().skip(1).flatten() {
                    acc = binary(&acc, other, f, attrs)?;
                }
                acc
            } else if let Some(f) = unary_op(op) {
                unary(input(0)?, f)?
            } else {
                return Err("cannot be evaluated at import time".into());
            }
        }
    };
    if out.numel() > MAX_FOLDED_ELEMENTS {
        return Err(format!(
            "folds to a constant of shape {:?}, too large to embed",
            out.shape
        ));
    }
    Ok(out)
}

/// The value of a `Constant` node.
fn constant(attrs: &Attrs) -> Result<Tensor, String> {
    let Some(a) = attrs.0.first() else {
        return Err("has no value attribute".into());
    };
    let float = |v: Vec<f32>, shape| Tensor {
        elem: Elem::F32,
        shape,
        data: Data::Float(v.into_iter().map(f64::from).collect()),
    };
    Ok(match a.name() {
        "value" => attrs.tensor("value")?.ok_or("`value` holds no tensor")?,
        "value_float" => float(vec![a.f()], vec![]),
        "value_floats" => float(a.floats.clone(), vec![a.floats.len()]),
        "value_int" => Tensor::ints(vec![], vec![a.i()]),
        "value_ints" => Tensor::ints(vec![a.ints.len()], a.ints.clone()),
        other => return Err(format!("value attribute `{other}` is not supported")),
    })
}

/// Axes given as an input (newer opsets) or as an attribute (older ones).
fn axes_of(input: Option<&Tensor>, attrs: &Attrs) -> Option<Vec<i64>> {
    input.map(Tensor::as_i64).or_else(|| attrs.ints("axes"))
}

/// Resolves a possibly negative axis against `rank`.
pub(crate) fn norm_axis(axis: i64, rank: usize) -> Result<usize, String> {
    let a = if axis < 0 { axis + rank as i64 } else { axis };
    if a < 0 || a >= rank as i64 {
        return Err(format!("axis {axis} out of range for rank {}", rank));
    }
    Ok(a as usize)
}

/// Non-negative dimensions from an i64 shape tensor.
fn dims(v: &[i64]) -> Result<Vec<usize>, String> {
    v.iter()
        .map(|&d| usize::try_from(d).map_err(|_| format!("negative dimension in {v:?}")))
        .collect()
}

pub(crate) fn unsqueeze_shape(shape: &[usize], axes: &[i64]) -> Result<Vec<usize>, String> {
    let rank = shape.len() + axes.len();
    let mut norm = axes
        .iter()
        .map(|&a| norm_axis(a, rank))
        .collect::<Result<Vec<_>, _>>()?;
    norm.sort_unstable();
    norm.dedup();
    if norm.len() != axes.len() {
        return Err(format!("repeated axis in {axes:?}"));
    }
    let mut rest = shape.iter();
    Ok((0..rank)
        .map(|i| {
            if norm.binary_search(&i).is_ok() {
                1
            } else {
                rest.next().copied().unwrap_or(1)
            }
        })
        .collect())
}

pub(crate) fn squeeze_shape(shape: &[usize], axes: Option<&[i64]>) -> Result<Vec<usize>, String> {
    match axes {
        None => Ok(shape.iter().copied().filter(|&d| d != 1).collect()),
        Some(axes) => {
            let norm = axes
                .iter()
                .map(|&a| norm_axis(a, shape.len()))
                .collect::<Result<Vec<_>, _>>()?;
            for &a in &norm {
                if shape[a] != 1 {
                    return Err(format!(
                        "cannot squeeze axis {a} of size {} in {shape:?}",
                        shape[a]
                    ));
                }
            }
            Ok(shape
                .iter()
                .enumerate()
                .filter(|(i, _)| !norm.contains(i))
                .map(|(_, &d)| d)
                .collect())
        }
    }
}

/// ONNX `Reshape` target resolution: 0 copies (unless `allowzero`), -1 is inferred.
pub(crate) fn reshape_shape(
    shape: &[usize],
    target: &[i64],
    allowzero: bool,
) -> Result<Vec<usize>, String> {
    let total: usize = shape.iter().product();
    let mut out = Vec::with_capacity(target.len());
    let mut infer = None;
    for (i, &d) in target.iter().enumerate() {
        match d {
            -1 if infer.is_none() => {
                infer = Some(i);
                out.push(1);
            }
            0 if !allowzero => {
                out.push(*shape.get(i).ok_or_else(|| {
                    format!("0 at position {i} copies a dimension {shape:?} lacks")
                })?)
            }
            d if d >= 0 => out.push(d as usize),
            _ => return Err(format!("bad target shape {target:?}")),
        }
    }
    let known = checked_numel(&out).ok_or_else(|| format!("target shape {target:?} overflows"))?;
    match infer {
        Some(i) if known != 0 && total.is_multiple_of(known) => out[i] = total / known,
        None if known == total => {}
        _ => return Err(format!("cannot reshape {shape:?} to {target:?}")),
    }
    Ok(out)
}

/// Element count, or `None` if it overflows.
fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

fn concat(parts: &[&Tensor], axis: i64) -> Result<Tensor, String> {
    let Some(first) = parts.first() else {
        return Err("no inputs".into());
    };
    let a = norm_axis(axis, first.shape.len())?;
    let mut shape = first.shape.clone();
    shape[a] = 0;
    for p in parts {
        let same = p.shape.len() == first.shape.len()
            && (0..shape.len()).all(|i| i == a || p.shape[i] == first.shape[i]);
        if !same {
            return Err(format!(
                "{:?} and {:?} differ outside axis {a}",
                first.shape, p.shape
            ));
        }
        shape[a] += p.shape[a];
    }
    // Interleave blocks: for each outer index, each part's slab along the axis.
    let outer: usize = shape[..a].iter().product();
    let mut floats = Vec::new();
    let mut ints = Vec::new();
    let float = first.elem.is_float();
    for o in 0..outer {
        for p in parts {
            let block = p.shape[a..].iter().product::<usize>();
            let range = o * block..(o + 1) * block;
            if float {
                floats.extend_from_slice(&p.as_f64()[range]);
            } else {
                ints.extend_from_slice(&p.as_i64()[range]);
            }
        }
    }
    let data = if float {
        Data::Float(floats)
    } else {
        Data::Int(ints)
    };
    Ok(Tensor {
        elem: first.elem,
        shape,
        data,
    })
}

fn slice(
    x: &Tensor,
    starts: &[i64],
    ends: &[i64],
    axes: Option<Vec<i64>>,
    steps: Option<Vec<i64>>,
) -> Result<Tensor, String> {
    let rank = x.shape.len();
    let axes = axes.unwrap_or_else(|| (0..starts.len() as i64).collect());
    let steps = steps.unwrap_or_else(|| vec![1; starts.len()]);
    if ends.len() != starts.len() || axes.len() != starts.len() || steps.len() != starts.len() {
        return Err("starts, ends, axes and steps differ in length".into());
    }
    // Per axis: the selected indices.
    let mut picks: Vec<Vec<usize>> = x.shape.iter().map(|&d| (0..d).collect()).collect();
    for i in 0..starts.len() {
        let a = norm_axis(axes[i], rank)?;
        let dim = x.shape[a] as i64;
        let step = steps[i];
        if step == 0 {
            return Err("step 0".into());
        }
        let fix = |v: i64| if v < 0 { v.saturating_add(dim) } else { v };
        let (mut s, mut e) = (fix(starts[i]), fix(ends[i]));
        let mut idx = Vec::new();
        if step > 0 {
            s = s.clamp(0, dim);
            e = e.clamp(0, dim);
            while s < e {
                idx.push(s as usize);
                s = s.saturating_add(step);
            }
        } else if dim > 0 {
            s = s.clamp(0, dim - 1);
            e = e.clamp(-1, dim - 1);
            while s > e {
                idx.push(s as usize);
                s = s.saturating_add(step);
            }
        }
        picks[a] = idx;
    }
    let shape: Vec<usize> = picks.iter().map(Vec::len).collect();
    let st = strides(&x.shape);
    let mut flat = vec![0usize];
    for (p, &s) in picks.iter().zip(&st) {
        flat = flat
            .iter()
            .flat_map(|&base| p.iter().map(move |&i| base + i * s))
            .collect();
    }
    Ok(x.pick(shape, &flat))
}

fn gather(data: &Tensor, indices: &Tensor, axis: i64) -> Result<Tensor, String> {
    let a = norm_axis(axis, data.shape.len())?;
    let dim = data.shape[a] as i64;
    let idx = indices
        .as_i64()
        .into_iter()
        .map(|i| {
            let j = if i < 0 { i + dim } else { i };
            if (0..dim).contains(&j) {
                Ok(j as usize)
            } else {
                Err(format!("index {i} out of range for dimension {dim}"))
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    let outer: usize = data.shape[..a].iter().product();
    let inner: usize = data.shape[a + 1..].iter().product();
    let n = checked_numel(&[outer, idx.len(), inner])
        .filter(|&n| n <= MAX_FOLDED_ELEMENTS)
        .ok_or("the result is too large to embed")?;
    let mut flat = Vec::with_capacity(n);
    for o in 0..outer {
        for &i in &idx {
            let base = (o * data.shape[a] + i) * inner;
            flat.extend(base..base + inner);
        }
    }
    let mut shape = data.shape[..a].to_vec();
    shape.extend(&indices.shape);
    shape.extend(&data.shape[a + 1..]);
    Ok(data.pick(shape, &flat))
}

fn transpose(x: &Tensor, perm: &[usize]) -> Result<Tensor, String> {
    let rank = x.shape.len();
    let mut seen = vec![false; rank];
    if perm.len() != rank || perm.iter().any(|&p| std::mem::replace(&mut seen[p], true)) {
        return Err(format!("perm {perm:?} is not a permutation of rank {rank}"));
    }
    let shape: Vec<usize> = perm.iter().map(|&p| x.shape[p]).collect();
    let in_st = strides(&x.shape);
    let out_st = strides(&shape);
    let flat = (0..x.numel())
        .map(|o| {
            perm.iter()
                .enumerate()
                .map(|(i, &p)| (o / out_st[i]) % shape[i] * in_st[p])
                .sum()
        })
        .collect::<Vec<usize>>();
    Ok(x.pick(shape, &flat))
}

pub(crate) fn broadcast_shapes(a: &[usize], b: &[usize]) -> Result<Vec<usize>, String> {
    let rank = a.len().max(b.len());
    (0..rank)
        .map(|i| {
            let da = (i + a.len()).checked_sub(rank).map_or(1, |j| a[j]);
            let db = (i + b.len()).checked_sub(rank).map_or(1, |j| b[j]);
            match (da, db) {
                (x, y) if x == y => Ok(x),
                (1, y) => Ok(y),
                (x, 1) => Ok(x),
                _ => Err(format!("cannot broadcast {a:?} with {b:?}")),
            }
        })
        .collect()
}

fn broadcast_to(x: &Tensor, shape: &[usize]) -> Result<Tensor, String> {
    if broadcast_shapes(&x.shape, shape)? != shape {
        return Err(format!("cannot broadcast {:?} to {shape:?}", x.shape));
    }
    let n = checked_numel(shape)
        .filter(|&n| n <= MAX_FOLDED_ELEMENTS)
        .ok_or_else(|| format!("folds to a constant of shape {shape:?}, too large to embed"))?;
    let off = shape.len() - x.shape.len();
    let in_st = strides(&x.shape);
    let out_st = strides(shape);
    let flat = (0..n)
        .map(|o| {
            (0..x.shape.len())
                .filter(|&i| x.shape[i] != 1)
                .map(|i| (o / out_st[i + off]) % shape[i + off] * in_st[i])
                .sum()
        })
        .collect::<Vec<usize>>();
    Ok(x.pick(shape.to_vec(), &flat))
}

fn range(start: &Tensor, limit: &Tensor, delta: &Tensor) -> Result<Tensor, String> {
    if start.len() != 1 || limit.len() != 1 || delta.len() != 1 {
        return Err("start, limit and delta must be scalars".into());
    }
    let elem = start.elem;
    if elem.is_float() {
        let (s, l, d) = (start.as_f64()[0], limit.as_f64()[0], delta.as_f64()[0]);
        if d == 0.0 {
            return Err("delta 0".into());
        }
        let n = ((l - s) / d).ceil().max(0.0) as usize;
        if n > MAX_FOLDED_ELEMENTS {
            return Err(format!("{n} elements, too large to embed"));
        }
        let v = (0..n).map(|i| elem.round(s + i as f64 * d)).collect();
        Ok(Tensor {
            elem,
            shape: vec![n],
            data: Data::Float(v),
        })
    } else {
        let (s, l, d) = (start.as_i64()[0], limit.as_i64()[0], delta.as_i64()[0]);
        if d == 0 {
            return Err("delta 0".into());
        }
        let n = ((l as f64 - s as f64) / d as f64).ceil().max(0.0) as usize;
        if n > MAX_FOLDED_ELEMENTS {
            return Err(format!("{n} elements, too large to embed"));
        }
        let v = (0..n as i64)
            .map(|i| s.wrapping_add(i.wrapping_mul(d)))
            .collect();
        Ok(Tensor {
            elem,
            shape: vec![n],
            data: Data::Int(v),
        })
    }
}

fn reduce(
    op: &str,
    x: &Tensor,
    axes: Option<&[i64]>,
    keep: bool,
    noop: bool,
) -> Result<Tensor, String> {
    let rank = x.shape.len();
    let axes: Vec<usize> = match axes {
        Some(a) if !a.is_empty() => a
            .iter()
            .map(|&a| norm_axis(a, rank))
            .collect::<Result<_, _>>()?,
        _ if noop => return Ok(x.clone()),
        _ => (0..rank).collect(),
    };
    let out_full: Vec<usize> = (0..rank)
        .map(|i| if axes.contains(&i) { 1 } else { x.shape[i] })
        .collect();
    let n: usize = out_full.iter().product();
    let in_st = strides(&x.shape);
    let out_st = strides(&out_full);
    let target = |flat_in: usize| -> usize {
        (0..rank)
            .filter(|i| !axes.contains(i))
            .map(|i| (flat_in / in_st[i]) % x.shape[i] * out_st[i])
            .sum()
    };
    let vals = x.as_f64();
    let init = match op {
        "ReduceProd" => 1.0,
        "ReduceSum" => 0.0,
        "ReduceMax" => f64::NEG_INFINITY,
        _ => f64::INFINITY,
    };
    let mut acc = vec![init; n];
    for (i, &v) in vals.iter().enumerate() {
        let t = &mut acc[target(i)];
        *t = match op {
            "ReduceProd" => *t * v,
            "ReduceSum" => *t + v,
            "ReduceMax" => t.max(v),
            _ => t.min(v),
        };
    }
    let shape = if keep {
        out_full
    } else {
        (0..rank)
            .filter(|i| !axes.contains(i))
            .map(|i| x.shape[i])
            .collect()
    };
    let data = if x.elem.is_float() {
        Data::Float(acc.into_iter().map(|v| x.elem.round(v)).collect())
    } else {
        Data::Int(acc.into_iter().map(|v| x.elem.wrap(v as i64)).collect())
    };
    Ok(Tensor {
        elem: x.elem,
        shape,
        data,
    })
}

#[derive(Clone, Copy)]
enum Binary {
    Add,
    Sub,
    Mul,
    Div,
    Mod,
    Pow,
    Min,
    Max,
    Equal,
    Less,
    Greater,
    LessOrEqual,
    GreaterOrEqual,
    And,
    Or,
    Xor,
}

fn binary_op(op: &str) -> Option<Binary> {
    Some(match op {
        "Add" => Binary::Add,
        "Sub" => Binary::Sub,
        "Mul" => Binary::Mul,
        "Div" => Binary::Div,
        "Mod" => Binary::Mod,
        "Pow" => Binary::Pow,
        "Min" => Binary::Min,
        "Max" => Binary::Max,
        "Equal" => Binary::Equal,
        "Less" => Binary::Less,
        "Greater" => Binary::Greater,
        "LessOrEqual" => Binary::LessOrEqual,
        "GreaterOrEqual" => Binary::GreaterOrEqual,
        "And" => Binary::And,
        "Or" => Binary::Or,
        "Xor" => Binary::Xor,
        _ => return None,
    })
}

fn binary(a: &Tensor, b: &Tensor, f: Binary, attrs: &Attrs) -> Result<Tensor, String> {
    let shape = broadcast_shapes(&a.shape, &b.shape)?;
    let (a2, b2) = (broadcast_to(a, &shape)?, broadcast_to(b, &shape)?);
    let compare = matches!(
        f,
        Binary::Equal
            | Binary::Less
            | Binary::Greater
            | Binary::LessOrEqual
            | Binary::GreaterOrEqual
    );
    let logic = matches!(f, Binary::And | Binary::Or | Binary::Xor);
    let float = a.elem.is_float() || b.elem.is_float();
    let elem = if compare || logic { Elem::Bool } else { a.elem };
    let data = if float && !logic {
        let (x, y) = (a2.as_f64(), b2.as_f64());
        let fmod = attrs.int("fmod").unwrap_or(0) != 0;
        let v: Vec<f64> = x
            .iter()
            .zip(&y)
            .map(|(&x, &y)| match f {
                Binary::Add => x + y,
                Binary::Sub => x - y,
                Binary::Mul => x * y,
                Binary::Div => x / y,
                Binary::Mod if fmod => x % y,
                // Python-style modulo: the result takes the divisor's sign.
                Binary::Mod => x - y * (x / y).floor(),
                Binary::Pow => x.powf(y),
                Binary::Min => x.min(y),
                Binary::Max => x.max(y),
                Binary::Equal => f64::from(u8::from(x == y)),
                Binary::Less => f64::from(u8::from(x < y)),
                Binary::Greater => f64::from(u8::from(x > y)),
                Binary::LessOrEqual => f64::from(u8::from(x <= y)),
                Binary::GreaterOrEqual => f64::from(u8::from(x >= y)),
                Binary::And | Binary::Or | Binary::Xor => 0.0,
            })
            .collect();
        if compare {
            Data::Int(v.into_iter().map(|x| x as i64).collect())
        } else {
            Data::Float(v.into_iter().map(|x| elem.round(x)).collect())
        }
    } else {
        let (x, y) = (a2.as_i64(), b2.as_i64());
        let fmod = attrs.int("fmod").unwrap_or(0) != 0;
        let v = x
            .iter()
            .zip(&y)
            .map(|(&x, &y)| {
                Ok(match f {
                    Binary::Add => x.wrapping_add(y),
                    Binary::Sub => x.wrapping_sub(y),
                    Binary::Mul => x.wrapping_mul(y),
                    Binary::Div | Binary::Mod if y == 0 => {
                        return Err("integer division by zero".to_string());
                    }
                    // ONNX integer Div truncates toward zero, as C does.
                    Binary::Div => x.wrapping_div(y),
                    Binary::Mod if fmod => x.wrapping_rem(y),
                    // Python-style modulo: the result takes the divisor's sign.
                    Binary::Mod => {
                        let r = x.wrapping_rem(y);
                        if r != 0 && (r < 0) != (y < 0) {
                            r + y
                        } else {
                            r
                        }
                    }
                    Binary::Pow => {
                        let e = u32::try_from(y).map_err(|_| format!("integer power {y}"))?;
                        x.wrapping_pow(e)
                    }
                    Binary::Min => x.min(y),
                    Binary::Max => x.max(y),
                    Binary::Equal => i64::from(x == y),
                    Binary::Less => i64::from(x < y),
                    Binary::Greater => i64::from(x > y),
                    Binary::LessOrEqual => i64::from(x <= y),
                    Binary::GreaterOrEqual => i64::from(x >= y),
                    Binary::And => i64::from(x != 0 && y != 0),
                    Binary::Or => i64::from(x != 0 || y != 0),
                    Binary::Xor => i64::from((x != 0) != (y != 0)),
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        Data::Int(v.into_iter().map(|x| elem.wrap(x)).collect())
    };
    Ok(Tensor { elem, shape, data })
}

#[derive(Clone, Copy)]
enum Unary {
    Neg,
    Abs,
    Sqrt,
    Reciprocal,
    Floor,
    Ceil,
    Not,
    Sign,
}

fn unary_op(op: &str) -> Option<Unary> {
    Some(match op {
        "Neg" => Unary::Neg,
        "Abs" => Unary::Abs,
        "Sqrt" => Unary::Sqrt,
        "Reciprocal" => Unary::Reciprocal,
        "Floor" => Unary::Floor,
        "Ceil" => Unary::Ceil,
        "Not" => Unary::Not,
        "Sign" => Unary::Sign,
        _ => return None,
    })
}

fn unary(x: &Tensor, f: Unary) -> Result<Tensor, String> {
    let data = match &x.data {
        Data::Float(v) => Data::Float(
            v.iter()
                .map(|&x0| {
                    x.elem.round(match f {
                        Unary::Neg => -x0,
                        Unary::Abs => x0.abs(),
                        Unary::Sqrt => x0.sqrt(),
                        Unary::Reciprocal => 1.0 / x0,
                        Unary::Floor => x0.floor(),
                        Unary::Ceil => x0.ceil(),
                        Unary::Not => f64::from(u8::from(x0 == 0.0)),
                        Unary::Sign => x0.signum() * f64::from(u8::from(x0 != 0.0)),
                    })
                })
                .collect(),
        ),
        Data::Int(v) => Data::Int(
            v.iter()
                .map(|&x0| match f {
                    Unary::Neg => Ok(x0.wrapping_neg()),
                    Unary::Abs => Ok(x0.wrapping_abs()),
                    Unary::Floor | Unary::Ceil => Ok(x0),
                    Unary::Not => Ok(i64::from(x0 == 0)),
                    Unary::Sign => Ok(x0.signum()),
                    Unary::Sqrt | Unary::Reciprocal => {
                        Err("is defined for floating-point tensors only".to_string())
                    }
                })
                .collect::<Result<Vec<_>, _>>()?,
        ),
    };
    Ok(Tensor {
        elem: x.elem,
        shape: x.shape.clone(),
        data,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "a panic is a test failure")]
mod tests {
    use super::*;

    fn ints(shape: &[usize], v: &[i64]) -> Tensor {
        Tensor::ints(shape.to_vec(), v.to_vec())
    }

    fn run(op: &str, ins: &[&Tensor]) -> Tensor {
        let ins: Vec<Option<&Tensor>> = ins.iter().map(|&t| Some(t)).collect();
        eval(op, &Attrs(&[]), &ins, 18).unwrap()
    }

    #[test]
    fn slice_with_negative_steps_and_clamped_bounds() {
        let x = ints(&[2, 3], &[0, 1, 2, 3, 4, 5]);
        // x[:, ::-1] with INT64_MIN as "to the start", as exporters write it.
        let t = run(
            "Slice",
            &[
                &x,
                &ints(&[1], &[-1]),
                &ints(&[1], &[i64::MIN]),
                &ints(&[1], &[1]),
                &ints(&[1], &[-1]),
            ],
        );
        assert_eq!(t, ints(&[2, 3], &[2, 1, 0, 5, 4, 3]));
        let t = run("Slice", &[&x, &ints(&[1], &[1]), &ints(&[1], &[i64::MAX])]);
        assert_eq!(t, ints(&[1, 3], &[3, 4, 5]));
    }

    #[test]
    fn integer_mod_follows_the_divisors_sign_and_div_truncates() {
        let a = ints(&[4], &[7, -7, 7, -7]);
        let b = ints(&[4], &[3, 3, -3, -3]);
        assert_eq!(run("Mod", &[&a, &b]), ints(&[4], &[1, 2, -2, -1]));
        assert_eq!(run("Div", &[&a, &b]), ints(&[4], &[2, -2, -2, 2]));
    }

    #[test]
    fn gather_transpose_expand_concat() {
        let x = ints(&[2, 3], &[0, 1, 2, 3, 4, 5]);
        let g = eval(
            "Gather",
            &Attrs(&[]),
            &[Some(&x), Some(&ints(&[2], &[-1, 0]))],
            18,
        )
        .unwrap();
        assert_eq!(g, ints(&[2, 3], &[3, 4, 5, 0, 1, 2]));
        assert_eq!(run("Transpose", &[&x]), ints(&[3, 2], &[0, 3, 1, 4, 2, 5]));
        let e = run("Expand", &[&ints(&[2, 1], &[7, 8]), &ints(&[2], &[2, 2])]);
        assert_eq!(e, ints(&[2, 2], &[7, 7, 8, 8]));
        let c = concat(&[&x, &ints(&[2, 1], &[9, 9])], 1).unwrap();
        assert_eq!(c, ints(&[2, 4], &[0, 1, 2, 9, 3, 4, 5, 9]));
    }

    #[test]
    fn f32_arithmetic_rounds_like_f32() {
        let third = Tensor {
            elem: Elem::F32,
            shape: vec![],
            data: Data::Float(vec![1.0]),
        };
        let three = Tensor {
            data: Data::Float(vec![3.0]),
            ..third.clone()
        };
        let t = run("Div", &[&third, &three]);
        assert_eq!(t.as_f64()[0], f64::from(1f32 / 3f32));
    }

    #[test]
    fn oversized_constants_are_refused() {
        let shape = ints(&[2], &[1 << 20, 1 << 20]);
        let err = eval("ConstantOfShape", &Attrs(&[]), &[Some(&shape)], 18).unwrap_err();
        assert!(err.contains("too large"), "{err}");
    }
}
