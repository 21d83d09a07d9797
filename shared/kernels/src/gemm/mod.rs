//! Matrix products generated from one tiled template ([`Gemm`], cut up by a
//! [`Tiling`]; see [`template`]). On top of it: [`MatMul`] (numpy batch broadcast; backward as two GEMMs
//! with transposed loaders, reduced over broadcast batch dimensions) and
//! [`Linear`] (`y = x W^T + b`, backward for x, W and b).

use super::elementwise::{BinaryOp, Broadcast};
use super::spec::{Binding, KernelSpec, Tol, numel, strides};

pub mod precision;
pub mod template;
pub mod tensor;
use precision::{GRAD_SCALE, operand};
pub use precision::{Precision, Side};
pub use template::{
    AUTO_CANDIDATES, BUSY_BLOCKS, Gemm, MAX_GEMM_TILE, MAX_PER_THREAD, Tiling, WORKGROUP_BYTES,
    busy_blocks, set_busy_blocks, split_parts,
};
pub use tensor::{TENSOR_CANDIDATES, TensorTiling};

/// Tolerance of a GEMM with `k` terms per output in `[-1, 1]`: f32
/// accumulation in tile order against an f64 reference.
pub fn gemm_tol(k: usize) -> Tol {
    Tol::new(2e-6 * (k.max(1) as f32).sqrt() * 4.0, 1e-5)
}

/// WGSL statements computing `off` (a flat offset) from the batch index `z`
/// of the broadcast batch `out`, for an operand whose batch shape is
/// `shape`, with `mat` elements per matrix.
fn batch_offset_wgsl(out: &[usize], shape: &[usize], mat: usize, var: &str) -> String {
    let rank = out.len();
    let so = strides(out);
    let own = strides(shape);
    let mut s = format!("    var {var} = 0u;\n");
    for d in 0..rank {
        let Some(sd) = (d + shape.len()).checked_sub(rank) else {
            continue;
        };
        if shape[sd] == 1 || out[d] == 1 {
            continue;
        }
        s += &format!(
            "    {var} += ((z / {}u) % {}u) * {}u;\n",
            so[d],
            out[d],
            own[sd] * mat
        );
    }
    s
}

fn batch_offset(out: &[usize], shape: &[usize], mat: usize, z: usize) -> usize {
    let rank = out.len();
    let so = strides(out);
    let own = strides(shape);
    let mut off = 0;
    for d in 0..rank {
        let Some(sd) = (d + shape.len()).checked_sub(rank) else {
            continue;
        };
        if shape[sd] == 1 {
            continue;
        }
        off += ((z / so[d]) % out[d]) * own[sd] * mat;
    }
    off
}

/// Numpy matmul of `a [.., m, k]` by `b [.., k, n]` (rank >= 2 each), batch
/// dimensions broadcast.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MatMul {
    pub a: Vec<usize>,
    pub b: Vec<usize>,
    /// `None`: chosen for each product's shape ([`Tiling::auto`]).
    pub tiling: Option<Tiling>,
    /// How the operands enter the multiply-adds, on the GPU and in
    /// [`Self::reference_at`].
    pub precision: Precision,
}

impl MatMul {
    /// `None` if a rank is below 2, the inner sizes differ, or the batch
    /// dimensions do not broadcast.
    pub fn new(a: &[usize], b: &[usize]) -> Option<Self> {
        if a.len() < 2 || b.len() < 2 || a[a.len() - 1] != b[b.len() - 2] {
            return None;
        }
        Broadcast::new(&a[..a.len() - 2], &b[..b.len() - 2])?;
        Some(Self {
            a: a.to_vec(),
            b: b.to_vec(),
            tiling: None,
            precision: Precision::F32,
        })
    }

    fn mkn(&self) -> (usize, usize, usize) {
        let (ra, rb) = (self.a.len(), self.b.len());
        (self.a[ra - 2], self.a[ra - 1], self.b[rb - 1])
    }

    fn batch_shapes(&self) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
        let ba = self.a[..self.a.len() - 2].to_vec();
        let bb = self.b[..self.b.len() - 2].to_vec();
        let out = Broadcast::new(&ba, &bb).map(|s| s.out).unwrap_or_default();
        (ba, bb, out)
    }

    /// The output shape `[batch.., m, n]`.
    pub fn out_shape(&self) -> Vec<usize> {
        let (m, _, n) = self.mkn();
        let mut s = self.batch_shapes().2;
        s.extend([m, n]);
        s
    }

    /// Forward: bindings `a`, `b`, `c`.
    pub fn forward(&self) -> KernelSpec {
        self.forward_gemm().spec()
    }

    /// For people: the form and tiling [`Self::forward`] generates with.
    pub fn forward_form(&self) -> String {
        self.forward_gemm().form()
    }

    fn forward_gemm(&self) -> Gemm<'static> {
        let (m, k, n) = self.mkn();
        let (ba, bb, out) = self.batch_shapes();
        Gemm {
            label: "matmul_fwd".into(),
            precision: self.precision,
            gradient: None,
            tiling: self.tiling,
            split: 1,
            batch: numel(&out),
            m,
            n,
            k,
            bindings: &[
                ("a", Binding::Read, "f32"),
                ("b", Binding::Read, "f32"),
                ("c", Binding::ReadWrite, "f32"),
            ],
            a_along_k: true,
            b_along_k: false,
            load_a: format!(
                "{}    return a[off + row * {k}u + kk];",
                batch_offset_wgsl(&out, &ba, m * k, "off")
            ),
            load_b: format!(
                "{}    return b[off + kk * {n}u + col];",
                batch_offset_wgsl(&out, &bb, k * n, "off")
            ),
            store: format!("        c[(z * {m}u + row) * {n}u + col] = acc;"),
        }
    }

    /// The gradient of `a` before any reduction over broadcast batch
    /// dimensions, shaped `[out batch.., m, k]`: `dC B^T` with B read
    /// transposed. Bindings `dc`, `b`, `da`.
    pub fn backward_a(&self) -> KernelSpec {
        let (m, k, n) = self.mkn();
        let (_, bb, out) = self.batch_shapes();
        Gemm {
            label: "matmul_bwd_a".into(),
            precision: self.precision,
            gradient: Some(Side::A),
            tiling: self.tiling,
            split: 1,
            batch: numel(&out),
            m,
            n: k,
            k: n,
            bindings: &[
                ("dc", Binding::Read, "f32"),
                ("b", Binding::Read, "f32"),
                ("da", Binding::ReadWrite, "f32"),
            ],
            a_along_k: true,
            b_along_k: true,
            load_a: format!("    return dc[(z * {m}u + row) * {n}u + kk];"),
            load_b: format!(
                "{}    return b[off + col * {n}u + kk];",
                batch_offset_wgsl(&out, &bb, k * n, "off")
            ),
            store: format!("        da[(z * {m}u + row) * {k}u + col] = acc;"),
        }
        .spec()
    }

    /// The gradient of `b` before reduction, `[out batch.., k, n]`: `A^T dC`.
    /// Bindings `a`, `dc`, `db`.
    pub fn backward_b(&self) -> KernelSpec {
        let (m, k, n) = self.mkn();
        let (ba, _, out) = self.batch_shapes();
        Gemm {
            label: "matmul_bwd_b".into(),
            precision: self.precision,
            gradient: Some(Side::B),
            tiling: self.tiling,
            split: 1,
            batch: numel(&out),
            m: k,
            n,
            k: m,
            bindings: &[
                ("a", Binding::Read, "f32"),
                ("dc", Binding::Read, "f32"),
                ("db", Binding::ReadWrite, "f32"),
            ],
            a_along_k: false,
            b_along_k: false,
            load_a: format!(
                "{}    return a[off + kk * {k}u + row];",
                batch_offset_wgsl(&out, &ba, m * k, "off")
            ),
            load_b: format!("    return dc[(z * {m}u + kk) * {n}u + col];"),
            store: format!("        db[(z * {k}u + row) * {n}u + col] = acc;"),
        }
        .spec()
    }

    /// Sums the unreduced gradient of `a` (from [`Self::backward_a`]) over the
    /// batch dimensions `a` was broadcast along; `None` when it was not.
    /// Bindings `dy` (unreduced), `d` (shaped like `a`).
    pub fn reduce_a(&self) -> Option<KernelSpec> {
        let (m, k, _) = self.mkn();
        let mut full = self.batch_shapes().2;
        full.extend([m, k]);
        (numel(&full) != numel(&self.a)).then(|| sum_to_shape(&full, &self.a))
    }

    /// Like [`Self::reduce_a`] for `b`.
    pub fn reduce_b(&self) -> Option<KernelSpec> {
        let (_, k, n) = self.mkn();
        let mut full = self.batch_shapes().2;
        full.extend([k, n]);
        (numel(&full) != numel(&self.b)).then(|| sum_to_shape(&full, &self.b))
    }

    /// Elements of the unreduced gradients of `a` and `b`.
    pub fn unreduced_lens(&self) -> (usize, usize) {
        let (m, k, n) = self.mkn();
        let z = numel(&self.batch_shapes().2);
        (z * m * k, z * k * n)
    }

    /// CPU reference: `(c, da, db)` for upstream gradient `dc`, in f64.
    pub fn reference(&self, a: &[f32], b: &[f32], dc: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (a, b, dc) = (
            operand(self.precision, a, 1.0),
            operand(self.precision, b, 1.0),
            operand(self.precision, dc, GRAD_SCALE),
        );
        let (m, k, n) = self.mkn();
        let (ba, bb, out) = self.batch_shapes();
        let z_count = numel(&out);
        let mut c = vec![0.0f64; z_count * m * n];
        let mut da = vec![0.0f64; a.len()];
        let mut db = vec![0.0f64; b.len()];
        for z in 0..z_count {
            let ao = batch_offset(&out, &ba, m * k, z);
            let bo = batch_offset(&out, &bb, k * n, z);
            for i in 0..m {
                for j in 0..n {
                    let g = f64::from(dc[(z * m + i) * n + j]);
                    let mut sum = 0.0;
                    for p in 0..k {
                        let (av, bv) = (f64::from(a[ao + i * k + p]), f64::from(b[bo + p * n + j]));
                        sum += av * bv;
                        da[ao + i * k + p] += g * bv;
                        db[bo + p * n + j] += g * av;
                    }
                    c[(z * m + i) * n + j] = sum;
                }
            }
        }
        let f = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect();
        (f(c), f(da), f(db))
    }
}

/// Sums a tensor shaped `from` into `to`, which broadcasts to `from`: the
/// reduction a broadcast op's backward needs. Bindings `dy`, `d`.
pub fn sum_to_shape(from: &[usize], to: &[usize]) -> KernelSpec {
    let mut spec = BinaryOp::Add.backward(
        &Broadcast {
            a: to.to_vec(),
            b: from.to_vec(),
            out: from.to_vec(),
        },
        super::elementwise::Operand::A,
    );
    // Add's backward reads neither operand, so only dy and d stay bound.
    spec.wgsl = spec
        .wgsl
        .replace(
            "@group(0) @binding(0) var<storage, read> a: array<f32>;\n",
            "",
        )
        .replace(
            "@group(0) @binding(1) var<storage, read> b: array<f32>;\n",
            "",
        )
        .replace(
            "@binding(2) var<storage, read> dy",
            "@binding(0) var<storage, read> dy",
        )
        .replace(
            "@binding(3) var<storage, read_write> d:",
            "@binding(1) var<storage, read_write> d:",
        );
    spec.label = "sum_to_shape".into();
    spec.bindings = vec![Binding::Read, Binding::ReadWrite];
    spec
}

/// `nn.Linear`: `x [rows, in]` (leading dimensions flattened), `weight
/// [out, in]`, optional `bias [out]`; `y [rows, out]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Linear {
    pub rows: usize,
    pub inputs: usize,
    pub outputs: usize,
    pub bias: bool,
    /// `None`: chosen for each product's shape ([`Tiling::auto`]).
    pub tiling: Option<Tiling>,
    /// How the operands enter the multiply-adds, on the GPU and in
    /// [`Self::reference_at`].
    pub precision: Precision,
}

impl Linear {
    pub fn new(rows: usize, inputs: usize, outputs: usize, bias: bool) -> Self {
        Self {
            rows,
            inputs,
            outputs,
            bias,
            tiling: None,
            precision: Precision::F32,
        }
    }

    /// Forward: bindings `x`, `w`, `bias` (when present), `y`. The bias add
    /// is fused into the store.
    pub fn forward(&self) -> KernelSpec {
        let (r, i, o) = (self.rows, self.inputs, self.outputs);
        let with_bias = [
            ("x", Binding::Read, "f32"),
            ("w", Binding::Read, "f32"),
            ("bias", Binding::Read, "f32"),
            ("y", Binding::ReadWrite, "f32"),
        ];
        let without = [
            ("x", Binding::Read, "f32"),
            ("w", Binding::Read, "f32"),
            ("y", Binding::ReadWrite, "f32"),
        ];
        Gemm {
            label: "linear_fwd".into(),
            precision: self.precision,
            gradient: None,
            tiling: self.tiling,
            split: 1,
            batch: 1,
            m: r,
            n: o,
            k: i,
            bindings: if self.bias { &with_bias } else { &without },
            a_along_k: true,
            b_along_k: true,
            load_a: format!("    return x[row * {i}u + kk];"),
            load_b: format!("    return w[col * {i}u + kk];"),
            store: if self.bias {
                format!("        y[row * {o}u + col] = acc + bias[col];")
            } else {
                format!("        y[row * {o}u + col] = acc;")
            },
        }
        .spec()
    }

    /// `dx = dy W`: bindings `dy`, `w`, `dx`.
    pub fn backward_x(&self) -> KernelSpec {
        let (r, i, o) = (self.rows, self.inputs, self.outputs);
        Gemm {
            label: "linear_bwd_x".into(),
            precision: self.precision,
            gradient: Some(Side::A),
            tiling: self.tiling,
            split: 1,
            batch: 1,
            m: r,
            n: i,
            k: o,
            bindings: &[
                ("dy", Binding::Read, "f32"),
                ("w", Binding::Read, "f32"),
                ("dx", Binding::ReadWrite, "f32"),
            ],
            a_along_k: true,
            b_along_k: false,
            load_a: format!("    return dy[row * {o}u + kk];"),
            load_b: format!("    return w[kk * {i}u + col];"),
            store: format!("        dx[row * {i}u + col] = acc;"),
        }
        .spec()
    }

    /// `dW = dy^T x`: bindings `dy`, `x`, `dw`.
    pub fn backward_w(&self) -> KernelSpec {
        let (r, i, o) = (self.rows, self.inputs, self.outputs);
        Gemm {
            label: "linear_bwd_w".into(),
            precision: self.precision,
            gradient: Some(Side::A),
            tiling: self.tiling,
            split: 1,
            batch: 1,
            m: o,
            n: i,
            k: r,
            bindings: &[
                ("dy", Binding::Read, "f32"),
                ("x", Binding::Read, "f32"),
                ("dw", Binding::ReadWrite, "f32"),
            ],
            a_along_k: false,
            b_along_k: false,
            load_a: format!("    return dy[kk * {o}u + row];"),
            load_b: format!("    return x[kk * {i}u + col];"),
            store: format!("        dw[row * {i}u + col] = acc;"),
        }
        .spec()
    }

    /// `db = sum over rows of dy`: bindings `dy`, `db`.
    pub fn backward_bias(&self) -> KernelSpec {
        sum_to_shape(&[self.rows, self.outputs], &[self.outputs])
    }

    /// CPU reference: `(y, dx, dw, db)`.
    pub fn reference(
        &self,
        x: &[f32],
        w: &[f32],
        bias: Option<&[f32]>,
        dy: &[f32],
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let (x, w, dy) = (
            operand(self.precision, x, 1.0),
            operand(self.precision, w, 1.0),
            operand(self.precision, dy, GRAD_SCALE),
        );
        let (r, i, o) = (self.rows, self.inputs, self.outputs);
        let mm = MatMul::new(&[r, i], &[i, o]).unwrap_or_else(|| MatMul {
            a: vec![r, i],
            b: vec![i, o],
            tiling: None,
            precision: Precision::F32,
        });
        // W^T as a plain [in, out] matrix for the matmul reference.
        let wt: Vec<f32> = (0..i * o).map(|idx| w[(idx % o) * i + idx / o]).collect();
        let (mut y, dx, dwt, _) = {
            let (c, da, db) = mm.reference(&x, &wt, &dy);
            (c, da, db, ())
        };
        if let Some(bias) = bias {
            for (idx, v) in y.iter_mut().enumerate() {
                *v += bias[idx % o];
            }
        }
        let dw: Vec<f32> = (0..o * i).map(|idx| dwt[(idx % i) * o + idx / i]).collect();
        let db: Vec<f32> = (0..o)
            .map(|c| (0..r).map(|row| f64::from(dy[row * o + c])).sum::<f64>() as f32)
            .collect();
        (y, dx, dw, db)
    }
}

#[cfg(test)]
mod tests {
    use super::super::spec::validate;
    use super::*;

    #[test]
    fn gemm_shaders_validate_and_use_workgroup_memory() {
        let tilings = [
            Tiling::square(1, 1),
            Tiling::square(4, 3),
            Tiling::square(8, 2),
            Tiling::CLASSIC,
            Tiling::square(16, 1),
        ];
        for tiling in tilings.into_iter().chain(AUTO_CANDIDATES) {
            for (a, b) in [
                (vec![3, 5], vec![5, 7]),
                (vec![2, 1, 4, 3], vec![5, 3, 2]),
                (vec![17, 1], vec![1, 9]),
            ] {
                let mut mm = MatMul::new(&a, &b).unwrap();
                mm.tiling = Some(tiling);
                for spec in [mm.forward(), mm.backward_a(), mm.backward_b()]
                    .into_iter()
                    .chain(mm.reduce_a())
                    .chain(mm.reduce_b())
                {
                    validate::spec(&spec);
                }
                assert!(mm.forward().wgsl.contains("var<workgroup> tile_a"));
            }
        }
        for bias in [false, true] {
            let l = Linear::new(9, 13, 5, bias);
            for spec in [
                l.forward(),
                l.backward_x(),
                l.backward_w(),
                l.backward_bias(),
            ] {
                validate::spec(&spec);
            }
        }
    }

    #[test]
    fn matmul_shapes_broadcast_like_numpy() {
        assert_eq!(
            MatMul::new(&[2, 1, 4, 3], &[5, 3, 2]).unwrap().out_shape(),
            vec![2, 5, 4, 2]
        );
        assert!(MatMul::new(&[4, 3], &[4, 3]).is_none());
        assert!(MatMul::new(&[3], &[3, 1]).is_none());
    }

    #[test]
    fn linear_reference_matches_hand_values() {
        let l = Linear::new(1, 2, 2, true);
        let (y, dx, dw, db) = l.reference(
            &[1.0, 2.0],
            &[1.0, 0.0, 3.0, -1.0],
            Some(&[0.5, 0.25]),
            &[1.0, 2.0],
        );
        assert_eq!(y, vec![1.5, 1.25]);
        assert_eq!(dx, vec![7.0, -2.0]);
        assert_eq!(dw, vec![1.0, 2.0, 2.0, 4.0]);
        assert_eq!(db, vec![1.0, 2.0]);
    }
}
