//! The kernel checks every harness runs, natively on lavapipe
//! (`shared/tests/gpu_kernels.rs`) and in headless Chromium
//! (`web-provider/tests/browser.rs`): each [`Check`] names its buffers'
//! initial contents, the kernels to dispatch in order, and which buffers must
//! then equal the CPU reference within the tolerance stated for that op.
//! Building a check runs the reference; [`run`] runs the GPU side.
//!
//! The case builders take shapes and a seed, so property tests call them
//! with random shapes and [`standard_checks`] is a fixed spread of odd and
//! even sizes.

use super::elementwise::{BINARY_OPS, BinaryOp, Broadcast, Dropout, Operand, UNARIES, Unary};
use super::sample_matrix;
use super::spec::{KernelSpec, Tol, numel};

/// A buffer's initial contents.
#[derive(Debug, Clone, PartialEq)]
pub enum Init {
    F32(Vec<f32>),
    U32(Vec<u32>),
    Zeros(usize),
}

/// One kernel check: buffers, the dispatches over them (indices into
/// `buffers`), and the expected contents of some buffers afterwards.
#[derive(Debug, Clone)]
pub struct Check {
    pub name: String,
    pub buffers: Vec<Init>,
    pub steps: Vec<(KernelSpec, Vec<usize>)>,
    pub expect: Vec<Expect>,
}

/// Buffer `buffer` must equal `want` within `tol` after the steps.
#[derive(Debug, Clone)]
pub struct Expect {
    pub what: &'static str,
    pub buffer: usize,
    pub want: Vec<f32>,
    pub tol: Tol,
}

/// Why a check failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CheckError {
    #[error("{check}: {what}[{index}] is {got} but the reference says {want} (tolerance {tol:?})")]
    Mismatch {
        check: String,
        what: &'static str,
        index: usize,
        got: f32,
        want: f32,
        tol: Tol,
    },
    #[error("{check}: {what} has {got} elements, the reference {want}")]
    Length {
        check: String,
        what: &'static str,
        got: usize,
        want: usize,
    },
    #[cfg(feature = "gpu")]
    #[error("{check}: {error}")]
    Gpu {
        check: String,
        error: super::GpuError,
    },
}

impl Check {
    /// Compares read-back buffers with the expectations.
    pub fn compare(&self, read: &[Vec<f32>]) -> Result<(), CheckError> {
        for (e, got) in self.expect.iter().zip(read) {
            if got.len() != e.want.len() {
                return Err(CheckError::Length {
                    check: self.name.clone(),
                    what: e.what,
                    got: got.len(),
                    want: e.want.len(),
                });
            }
            if let Some((index, got, want)) = e.tol.first_violation(got, &e.want) {
                return Err(CheckError::Mismatch {
                    check: self.name.clone(),
                    what: e.what,
                    index,
                    got,
                    want,
                    tol: e.tol,
                });
            }
        }
        Ok(())
    }
}

/// Uploads the buffers, runs the steps in one submission, reads back the
/// expected buffers and compares them.
#[cfg(feature = "gpu")]
pub async fn run(gpu: &super::GpuContext, check: &Check) -> Result<(), CheckError> {
    let gpu_err = |error| CheckError::Gpu {
        check: check.name.clone(),
        error,
    };
    let mut buffers = Vec::with_capacity(check.buffers.len());
    for init in &check.buffers {
        buffers.push(
            match init {
                Init::F32(v) => gpu.upload_f32(v),
                Init::U32(v) => gpu.upload_u32(v),
                Init::Zeros(n) => gpu.create_buffer(*n),
            }
            .map_err(gpu_err)?,
        );
    }
    let bound: Vec<Vec<&super::GpuBuffer>> = check
        .steps
        .iter()
        .map(|(_, idx)| idx.iter().map(|&i| &buffers[i]).collect())
        .collect();
    let steps: Vec<(&KernelSpec, &[&super::GpuBuffer])> = check
        .steps
        .iter()
        .zip(&bound)
        .map(|((spec, _), b)| (spec, b.as_slice()))
        .collect();
    gpu.dispatch_all(&steps).await.map_err(gpu_err)?;
    let mut read = Vec::with_capacity(check.expect.len());
    for e in &check.expect {
        read.push(gpu.read_f32(&buffers[e.buffer]).await.map_err(gpu_err)?);
    }
    check.compare(&read)
}

/// Tolerances, stated per op. The GPU computes in f32 with its own `exp`
/// and `erf` (A&S 7.1.26, error 1.5e-7); the references compute in f64.
pub mod tol {
    use super::Tol;

    /// Relu, Identity, Add/Sub forward, Dropout: exact operations in f32.
    pub const EXACT: Tol = Tol::EXACT;
    /// Sigmoid/Tanh/Gelu: a few ulps of `exp` plus the erf approximation.
    pub const ACTIVATION: Tol = Tol::new(2e-6, 2e-5);
    /// Mul/Div forward: one rounding; Div by values near zero is avoided by
    /// the case builders.
    pub const ARITH: Tol = Tol::new(1e-6, 1e-6);
    /// Broadcast backward sums up to a few hundred terms in f32.
    pub const BROADCAST_SUM: Tol = Tol::new(1e-5, 1e-5);
}

fn shape_name(shape: &[usize]) -> String {
    shape
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join("x")
}

/// Forward and backward of an activation over `len` elements in `[-4, 4)`.
pub fn unary(op: Unary, len: usize, seed: u64) -> Check {
    let x: Vec<f32> = sample_matrix(len, seed).iter().map(|v| v * 4.0).collect();
    let dy = sample_matrix(len, seed ^ 0x55);
    let tol = match op {
        Unary::Relu | Unary::Identity => tol::EXACT,
        _ => tol::ACTIVATION,
    };
    Check {
        name: format!("{}[{len}]", op.name()),
        expect: vec![
            Expect {
                what: "y",
                buffer: 2,
                want: op.reference(&x),
                tol,
            },
            Expect {
                what: "dx",
                buffer: 3,
                want: op.reference_backward(&x, &dy),
                tol,
            },
        ],
        buffers: vec![
            Init::F32(x),
            Init::F32(dy),
            Init::Zeros(len),
            Init::Zeros(len),
        ],
        steps: vec![
            (op.forward(len), vec![0, 2]),
            (op.backward(len), vec![0, 1, 3]),
        ],
    }
}

/// Forward and both backwards of a broadcast binary op.
pub fn binary(op: BinaryOp, a_shape: &[usize], b_shape: &[usize], seed: u64) -> Option<Check> {
    let s = Broadcast::new(a_shape, b_shape)?;
    let a = sample_matrix(numel(a_shape), seed);
    let mut b = sample_matrix(numel(b_shape), seed ^ 1);
    if op == BinaryOp::Div {
        // Keeps divisors away from zero, where any rounding is amplified.
        for v in &mut b {
            *v = v.signum() * (0.5 + v.abs());
        }
    }
    let dy = sample_matrix(numel(&s.out), seed ^ 2);
    let (fwd_tol, bwd_tol) = match op {
        BinaryOp::Add | BinaryOp::Sub => (tol::EXACT, tol::BROADCAST_SUM),
        _ => (tol::ARITH, tol::BROADCAST_SUM),
    };
    let out_len = numel(&s.out);
    Some(Check {
        name: format!(
            "{}({},{})",
            op.name(),
            shape_name(a_shape),
            shape_name(b_shape)
        ),
        expect: vec![
            Expect {
                what: "y",
                buffer: 3,
                want: op.reference(&s, &a, &b),
                tol: fwd_tol,
            },
            Expect {
                what: "da",
                buffer: 4,
                want: op.reference_backward(&s, &a, &b, &dy, Operand::A),
                tol: bwd_tol,
            },
            Expect {
                what: "db",
                buffer: 5,
                want: op.reference_backward(&s, &a, &b, &dy, Operand::B),
                tol: bwd_tol,
            },
        ],
        steps: vec![
            (op.forward(&s), vec![0, 1, 3]),
            (op.backward(&s, Operand::A), vec![0, 1, 2, 4]),
            (op.backward(&s, Operand::B), vec![0, 1, 2, 5]),
        ],
        buffers: vec![
            Init::F32(a.clone()),
            Init::F32(b.clone()),
            Init::F32(dy),
            Init::Zeros(out_len),
            Init::Zeros(a.len()),
            Init::Zeros(b.len()),
        ],
    })
}

/// Dropout forward and backward with drop probability `p`.
pub fn dropout(p: f32, len: usize, seed: u64) -> Check {
    let d = Dropout { p, len };
    let x = sample_matrix(len, seed);
    let dy = sample_matrix(len, seed ^ 3);
    let uniform = Dropout::seed_uniform(seed);
    Check {
        name: format!("dropout(p={p})[{len}]"),
        expect: vec![
            Expect {
                what: "y",
                buffer: 3,
                want: d.reference(seed, &x),
                tol: tol::EXACT,
            },
            Expect {
                what: "dx",
                buffer: 4,
                want: d.reference(seed, &dy),
                tol: tol::EXACT,
            },
        ],
        buffers: vec![
            Init::U32(uniform),
            Init::F32(x),
            Init::F32(dy),
            Init::Zeros(len),
            Init::Zeros(len),
        ],
        steps: vec![(d.forward(), vec![0, 1, 3]), (d.backward(), vec![0, 2, 4])],
    }
}

/// Broadcast shape pairs every harness runs: equal shapes, scalars, leading
/// and inner broadcasts on both sides, odd sizes.
pub const BROADCAST_CASES: [(&[usize], &[usize]); 6] = [
    (&[5, 7], &[5, 7]),
    (&[3, 1, 5], &[4, 1]),
    (&[1], &[9, 2]),
    (&[13], &[3, 13]),
    (&[2, 3, 1], &[1, 3, 4]),
    (&[33, 17], &[17]),
];

/// The fixed spread of checks both harnesses run.
pub fn standard_checks() -> Vec<Check> {
    let mut checks = Vec::new();
    for (i, op) in UNARIES.into_iter().enumerate() {
        for len in [1, 63, 1000, 4097] {
            checks.push(unary(op, len, i as u64 * 10 + len as u64));
        }
    }
    for (i, op) in BINARY_OPS.into_iter().enumerate() {
        for (j, (a, b)) in BROADCAST_CASES.iter().enumerate() {
            checks.extend(binary(op, a, b, (i * 10 + j) as u64));
        }
    }
    for (p, len) in [(0.0, 10), (0.5, 1001), (0.1, 77), (1.0, 5)] {
        checks.push(dropout(p, len, len as u64));
    }
    checks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_accept_their_own_reference_and_catch_a_wrong_result() {
        let check = unary(Unary::Gelu, 10, 1);
        let want: Vec<Vec<f32>> = check.expect.iter().map(|e| e.want.clone()).collect();
        check.compare(&want).unwrap();
        let mut wrong = want.clone();
        wrong[1][3] += 1e-3;
        assert!(matches!(
            check.compare(&wrong),
            Err(CheckError::Mismatch {
                index: 3,
                what: "dx",
                ..
            })
        ));
        wrong[1].pop();
        assert!(matches!(
            check.compare(&wrong),
            Err(CheckError::Length { .. })
        ));
    }

    #[test]
    fn every_standard_check_is_well_formed_and_its_shaders_validate() {
        let checks = standard_checks();
        assert!(checks.len() > 40);
        for c in &checks {
            for (spec, idx) in &c.steps {
                assert_eq!(spec.bindings.len(), idx.len(), "{}", c.name);
                assert!(idx.iter().all(|&i| i < c.buffers.len()));
                super::super::spec::validate::spec(spec);
            }
            for e in &c.expect {
                assert!(e.buffer < c.buffers.len());
            }
        }
    }
}
