//! Folding elementwise arithmetic, comparisons and logic (broadcast binary
//! and unary ops) and the `Reduce*` family.

use super::movement::broadcast_to;
use crate::onnx::attrs::Attrs;
use crate::onnx::shapes::{broadcast_shapes, norm_axis, strides};
use crate::onnx::tensor::{Data, Elem, Tensor};

pub(super) fn reduce(
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
pub(super) enum Binary {
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

pub(super) fn binary_op(op: &str) -> Option<Binary> {
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

pub(super) fn binary(a: &Tensor, b: &Tensor, f: Binary, attrs: &Attrs) -> Result<Tensor, String> {
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
pub(super) enum Unary {
    Neg,
    Abs,
    Sqrt,
    Reciprocal,
    Floor,
    Ceil,
    Not,
    Sign,
}

pub(super) fn unary_op(op: &str) -> Option<Unary> {
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

pub(super) fn unary(x: &Tensor, f: Unary) -> Result<Tensor, String> {
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
