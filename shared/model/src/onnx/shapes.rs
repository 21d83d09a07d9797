//! Shape arithmetic as ONNX defines it (negative axes, `Reshape`'s 0 and -1,
//! `Squeeze`/`Unsqueeze`, broadcasting), on dimensions alone: the folder
//! applies it to constants and the importer to run-time tensors' shapes.
//! Errors are plain strings; the caller adds the node, op and file.

/// Resolves a possibly negative axis against `rank`.
pub(crate) fn norm_axis(axis: i64, rank: usize) -> Result<usize, String> {
    let a = if axis < 0 { axis + rank as i64 } else { axis };
    if a < 0 || a >= rank as i64 {
        return Err(format!("axis {axis} out of range for rank {}", rank));
    }
    Ok(a as usize)
}

/// Non-negative dimensions from an i64 shape tensor.
pub(crate) fn dims(v: &[i64]) -> Result<Vec<usize>, String> {
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
pub(crate) fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

pub(crate) fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
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
