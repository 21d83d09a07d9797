//! Checks of the data-movement kernels: transpose, concat and gather.

use super::{Builder, Check, shape_name, tol};
use crate::sample_matrix;
use crate::shape::{Concat, Gather, Transpose};
use crate::spec::numel;

/// A transpose and its backward (the inverse permutation).
pub fn transpose(shape: &[usize], perm: &[usize], seed: u64) -> Option<Check> {
    let t = Transpose::new(shape, perm)?;
    let len = numel(shape);
    let x = sample_matrix(len, seed);
    let dy = sample_matrix(len, seed ^ 1);
    let (want_y, want_dx) = (t.reference(&x), t.inverse().reference(&dy));
    let mut c = Builder::default();
    let (x, dy) = (c.f32(x), c.f32(dy));
    let (y, dx) = (c.zeros(len), c.zeros(len));
    c.step(t.forward(), [x, y]);
    c.step(t.inverse().forward(), [dy, dx]);
    c.expect("y", y, want_y, tol::EXACT);
    c.expect("dx", dx, want_dx, tol::EXACT);
    Some(c.build(format!("transpose({} by {perm:?})", shape_name(shape))))
}

/// Concat of `sizes.len()` inputs along the middle axis, and the backward
/// copying each input's slice of the gradient out.
pub fn concat(outer: usize, sizes: &[usize], inner: usize, seed: u64) -> Check {
    let cat = Concat {
        outer,
        sizes: sizes.to_vec(),
        inner,
    };
    let parts: Vec<Vec<f32>> = sizes
        .iter()
        .enumerate()
        .map(|(i, s)| sample_matrix(outer * s * inner, seed ^ i as u64))
        .collect();
    let refs: Vec<&[f32]> = parts.iter().map(Vec::as_slice).collect();
    let want_y = cat.reference(&refs);
    let mut c = Builder::default();
    let inputs: Vec<usize> = parts.iter().map(|p| c.f32(p.clone())).collect();
    let y = c.zeros(want_y.len());
    for (i, &part) in inputs.iter().enumerate() {
        c.step(cat.forward(i), [part, y]);
    }
    c.expect("y", y, want_y, tol::EXACT);
    // The backward of concatenation is the split: check it returns the parts.
    for (i, p) in parts.into_iter().enumerate() {
        let dx = c.zeros(p.len());
        c.step(cat.backward(i), [y, dx]);
        c.expect("dx part", dx, p, tol::EXACT);
    }
    c.build(format!("concat({outer}x{sizes:?}x{inner})"))
}

/// Gather / Embedding forward and backward with indices in `[-axis, axis)`.
pub fn gather(outer: usize, axis: usize, inner: usize, count: usize, seed: u64) -> Check {
    let g = Gather {
        outer,
        axis,
        inner,
        count,
    };
    let data = sample_matrix(outer * axis * inner, seed);
    let indices: Vec<i32> = sample_matrix(count, seed ^ 1)
        .iter()
        .map(|v| ((v * axis as f32).floor() as i32).clamp(-(axis as i32), axis as i32 - 1))
        .collect();
    let dy = sample_matrix(outer * count * inner, seed ^ 2);
    let (want_y, want_ddata) = g.reference(&data, &indices, &dy);
    let data_len = data.len();
    let mut c = Builder::default();
    let data = c.f32(data);
    let indices = c.u32(indices.iter().map(|&v| v as u32).collect());
    let dy = c.f32(dy);
    let (y, ddata) = (c.zeros(outer * count * inner), c.zeros(data_len));
    c.step(g.forward(), [data, indices, y]);
    c.step(g.backward(), [indices, dy, ddata]);
    c.expect("y", y, want_y, tol::EXACT);
    c.expect("ddata", ddata, want_ddata, tol::BROADCAST_SUM);
    c.build(format!("gather({outer}x{axis}x{inner}, {count} indices)"))
}
