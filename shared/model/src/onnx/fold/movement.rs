//! Folding the ops that move elements without computing on them: `Concat`,
//! `Slice`, `Gather`, `Transpose`, broadcasting (`Expand`) and `Range`.

use crate::onnx::shapes::{broadcast_shapes, checked_numel, norm_axis, strides};
use crate::onnx::tensor::{Data, Tensor};

/// Largest constant the folder will build; larger ones mean something other
/// than shape arithmetic is being folded, which would bloat the graph.
pub(super) const MAX_FOLDED_ELEMENTS: usize = 1 << 24;

pub(super) fn concat(parts: &[&Tensor], axis: i64) -> Result<Tensor, String> {
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

pub(super) fn slice(
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

pub(super) fn gather(data: &Tensor, indices: &Tensor, axis: i64) -> Result<Tensor, String> {
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

pub(super) fn transpose(x: &Tensor, perm: &[usize]) -> Result<Tensor, String> {
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

pub(super) fn broadcast_to(x: &Tensor, shape: &[usize]) -> Result<Tensor, String> {
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

pub(super) fn range(start: &Tensor, limit: &Tensor, delta: &Tensor) -> Result<Tensor, String> {
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
