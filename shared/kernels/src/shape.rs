//! Data movement: Transpose (any permutation; its backward is the inverse
//! permutation), Concat along an axis (forward copies each input into its
//! slice, backward copies the slice out), and Gather / Embedding along an
//! axis with i32 indices (negative ones counted from the end, as ONNX), whose
//! backward sums the gradient rows that picked each source row, each
//! invocation owning one source element so no float atomics are needed.
//! Flatten and Reshape are views and need no kernel.

use super::spec::{Binding, DEFAULT_WORKGROUP, KernelSpec, numel, one_d, strides};

/// Permutes dimensions: output dimension `d` is input dimension `perm[d]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transpose {
    pub shape: Vec<usize>,
    pub perm: Vec<usize>,
}

impl Transpose {
    /// `None` unless `perm` is a permutation of `0..shape.len()`.
    pub fn new(shape: &[usize], perm: &[usize]) -> Option<Self> {
        let mut seen = vec![false; shape.len()];
        if perm.len() != shape.len() {
            return None;
        }
        for &p in perm {
            if p >= shape.len() || std::mem::replace(&mut seen[p], true) {
                return None;
            }
        }
        Some(Self {
            shape: shape.to_vec(),
            perm: perm.to_vec(),
        })
    }

    pub fn out_shape(&self) -> Vec<usize> {
        self.perm.iter().map(|&p| self.shape[p]).collect()
    }

    /// The transpose the backward runs: the output's shape, inverse perm.
    pub fn inverse(&self) -> Self {
        let mut inv = vec![0; self.perm.len()];
        for (d, &p) in self.perm.iter().enumerate() {
            inv[p] = d;
        }
        Self {
            shape: self.out_shape(),
            perm: inv,
        }
    }

    /// Bindings `x`, `y`.
    pub fn forward(&self) -> KernelSpec {
        let out = self.out_shape();
        let so = strides(&out);
        let si = strides(&self.shape);
        let mut body = String::from("    var src = 0u;\n");
        for d in 0..out.len() {
            if out[d] > 1 {
                body += &format!(
                    "    src += ((i / {}u) % {}u) * {}u;\n",
                    so[d], out[d], si[self.perm[d]]
                );
            }
        }
        body += "    y[i] = x[src];";
        one_d(
            "transpose",
            &[
                ("x", Binding::Read, "f32"),
                ("y", Binding::ReadWrite, "f32"),
            ],
            "",
            numel(&out),
            DEFAULT_WORKGROUP,
            &body,
        )
    }

    pub fn reference(&self, x: &[f32]) -> Vec<f32> {
        let out = self.out_shape();
        let so = strides(&out);
        let si = strides(&self.shape);
        (0..numel(&out))
            .map(|i| {
                let src: usize = (0..out.len())
                    .map(|d| ((i / so[d]) % out[d]) * si[self.perm[d]])
                    .sum();
                x[src]
            })
            .collect()
    }
}

/// Concatenation along the middle of `[outer, sizes[i], inner]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Concat {
    pub outer: usize,
    pub sizes: Vec<usize>,
    pub inner: usize,
}

impl Concat {
    fn total(&self) -> usize {
        self.sizes.iter().sum()
    }

    fn copy(&self, part: usize, backward: bool) -> KernelSpec {
        let (inner, total, size) = (self.inner, self.total(), self.sizes[part]);
        let offset: usize = self.sizes[..part].iter().sum();
        let index = format!(
            "    let o = i / ({size}u * {inner}u);\n    let rest = i % ({size}u * {inner}u);\n    let k = o * {total}u * {inner}u + {offset}u * {inner}u + rest;\n"
        );
        let (label, names, body) = if backward {
            (
                "concat_bwd",
                [
                    ("dy", Binding::Read, "f32"),
                    ("dx", Binding::ReadWrite, "f32"),
                ],
                "    dx[i] = dy[k];",
            )
        } else {
            (
                "concat_fwd",
                [
                    ("x", Binding::Read, "f32"),
                    ("y", Binding::ReadWrite, "f32"),
                ],
                "    y[k] = x[i];",
            )
        };
        one_d(
            label,
            &names,
            "",
            self.outer * size * inner,
            DEFAULT_WORKGROUP,
            &(index + body),
        )
    }

    /// Copies input `part` into its slice of the output: bindings `x`, `y`.
    pub fn forward(&self, part: usize) -> KernelSpec {
        self.copy(part, false)
    }

    /// Copies input `part`'s slice of the output gradient out: bindings `dy`, `dx`.
    pub fn backward(&self, part: usize) -> KernelSpec {
        self.copy(part, true)
    }

    pub fn reference(&self, parts: &[&[f32]]) -> Vec<f32> {
        let mut y = Vec::with_capacity(self.outer * self.total() * self.inner);
        for o in 0..self.outer {
            for (p, size) in parts.iter().zip(&self.sizes) {
                y.extend_from_slice(&p[o * size * self.inner..(o + 1) * size * self.inner]);
            }
        }
        y
    }
}

/// Gather along the middle of `data [outer, axis, inner]` with `indices`
/// (flattened, `count` of them): `y [outer, count, inner]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gather {
    pub outer: usize,
    pub axis: usize,
    pub inner: usize,
    pub count: usize,
}

impl Gather {
    fn wrap_wgsl(&self) -> String {
        format!(
            "fn wrap(v: i32) -> u32 {{ return u32(select(v, v + {a}i, v < 0i)); }}\n",
            a = self.axis
        )
    }

    /// Bindings `data`, `indices` (i32), `y`. Indices are checked to lie in
    /// `[-axis, axis)` by the caller, as the provider checks i64 indices.
    pub fn forward(&self) -> KernelSpec {
        let (a, inner, count) = (self.axis, self.inner, self.count);
        one_d(
            "gather_fwd",
            &[
                ("data", Binding::Read, "f32"),
                ("indices", Binding::Read, "i32"),
                ("y", Binding::ReadWrite, "f32"),
            ],
            &self.wrap_wgsl(),
            self.outer * count * inner,
            DEFAULT_WORKGROUP,
            &format!(
                "    let o = i / ({count}u * {inner}u);\n    let j = (i / {inner}u) % {count}u;\n    let q = i % {inner}u;\n\
                 \x20   y[i] = data[(o * {a}u + wrap(indices[j])) * {inner}u + q];"
            ),
        )
    }

    /// Bindings `indices`, `dy`, `ddata`: one invocation per source element,
    /// summing over the indices that picked its row.
    pub fn backward(&self) -> KernelSpec {
        let (a, inner, count) = (self.axis, self.inner, self.count);
        one_d(
            "gather_bwd",
            &[
                ("indices", Binding::Read, "i32"),
                ("dy", Binding::Read, "f32"),
                ("ddata", Binding::ReadWrite, "f32"),
            ],
            &self.wrap_wgsl(),
            self.outer * a * inner,
            DEFAULT_WORKGROUP,
            &format!(
                "    let o = i / ({a}u * {inner}u);\n    let v = (i / {inner}u) % {a}u;\n    let q = i % {inner}u;\n    var acc = 0.0;\n\
                 \x20   for (var j = 0u; j < {count}u; j += 1u) {{\n        if (wrap(indices[j]) == v) {{ acc += dy[(o * {count}u + j) * {inner}u + q]; }}\n    }}\n\
                 \x20   ddata[i] = acc;"
            ),
        )
    }

    /// CPU reference: `(y, ddata)`.
    pub fn reference(&self, data: &[f32], indices: &[i32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let (a, inner, count) = (self.axis, self.inner, self.count);
        let wrap = |v: i32| {
            if v < 0 {
                (v + a as i32) as usize
            } else {
                v as usize
            }
        };
        let mut y = vec![0.0; self.outer * count * inner];
        let mut dd = vec![0.0f64; data.len()];
        for o in 0..self.outer {
            for (j, &idx) in indices.iter().enumerate() {
                for q in 0..inner {
                    let src = (o * a + wrap(idx)) * inner + q;
                    let dst = (o * count + j) * inner + q;
                    y[dst] = data[src];
                    dd[src] += f64::from(dy[dst]);
                }
            }
        }
        (y, dd.into_iter().map(|v| v as f32).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::super::spec::validate;
    use super::*;

    #[test]
    fn shape_shaders_validate() {
        let t = Transpose::new(&[2, 3, 4], &[2, 0, 1]).unwrap();
        validate::spec(&t.forward());
        validate::spec(&t.inverse().forward());
        let c = Concat {
            outer: 2,
            sizes: vec![3, 1, 4],
            inner: 5,
        };
        for p in 0..3 {
            validate::spec(&c.forward(p));
            validate::spec(&c.backward(p));
        }
        let g = Gather {
            outer: 1,
            axis: 10,
            inner: 4,
            count: 7,
        };
        validate::spec(&g.forward());
        validate::spec(&g.backward());
    }

    #[test]
    fn transpose_inverse_round_trips_and_bad_perms_are_refused() {
        let t = Transpose::new(&[2, 3, 4], &[1, 2, 0]).unwrap();
        let x: Vec<f32> = (0..24).map(|v| v as f32).collect();
        assert_eq!(t.inverse().reference(&t.reference(&x)), x);
        assert_eq!(
            Transpose::new(&[2, 3], &[1, 0])
                .unwrap()
                .reference(&[1., 2., 3., 4., 5., 6.]),
            vec![1., 4., 2., 5., 3., 6.]
        );
        assert!(Transpose::new(&[2, 3], &[0, 0]).is_none());
        assert!(Transpose::new(&[2, 3], &[0]).is_none());
    }

    #[test]
    fn gather_counts_negative_indices_from_the_end() {
        let g = Gather {
            outer: 1,
            axis: 3,
            inner: 1,
            count: 3,
        };
        let (y, dd) = g.reference(&[10.0, 20.0, 30.0], &[2, -1, 0], &[1.0, 2.0, 4.0]);
        assert_eq!(y, vec![30.0, 30.0, 10.0]);
        assert_eq!(dd, vec![4.0, 0.0, 3.0]);
    }
}
