//! Import-time evaluation of the ops exporters use for shape arithmetic
//! (`Constant`, `Concat`, `Slice`, `Gather`, `Range`, `Div`, `Cast`, ...). The
//! graph's shapes are all known from the example input, so every such chain ends
//! in a constant, which the importer folds into an op attribute (a `Reshape`
//! target, a `Dropout` ratio) or keeps as a constant tensor. Errors are plain
//! strings; the caller adds the node, op and file.

mod arith;
mod movement;

use super::attrs::Attrs;
use super::shapes::{
    broadcast_shapes, dims, norm_axis, reshape_shape, squeeze_shape, unsqueeze_shape,
};
use super::tensor::{Data, Elem, Tensor};
use arith::{binary, binary_op, reduce, unary, unary_op};
use movement::{MAX_FOLDED_ELEMENTS, broadcast_to, concat, gather, range, slice, transpose};

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
