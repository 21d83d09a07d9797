//! The kernel checks every harness runs, natively on lavapipe
//! (`shared/kernels/tests/gpu_kernels.rs`) and in headless Chromium
//! (`web-provider/tests/browser.rs`): each [`Check`] names its buffers'
//! initial contents, the kernels to dispatch in order, and which buffers must
//! then equal the CPU reference within the tolerance stated for that op.
//! Building a check runs the reference; [`run`] runs the GPU side.
//!
//! The case builders take shapes and a seed, so property tests call them
//! with random shapes and [`standard_checks`] is a fixed spread of odd and
//! even sizes. One file of case builders per kernel family, as in the crate.

mod conv;
mod elementwise;
mod gemm;
mod int8;
mod loss;
mod norm;
mod optim;
mod pool;
mod shape;
mod standard;

pub use conv::{conv_cases, conv2d};
pub use elementwise::{binary, dropout, unary, unary_kinks};
pub use gemm::{accumulation_bound, linear, matmul};
pub use int8::{int8, int8_values};
pub use loss::{cross_entropy, mse, softmax};
pub use norm::{BatchNormInputs, batch_norm, batch_norm_inputs, layer_norm, layer_norm_around};
pub use optim::optimizer;
pub use pool::{global_avg_pool, pool2d};
pub use shape::{concat, gather, transpose};
pub use standard::{BROADCAST_CASES, standard_checks};

use crate::spec::{KernelSpec, Tol};

/// A buffer's initial contents.
#[derive(Debug, Clone, PartialEq)]
pub enum Fill {
    F32(Vec<f32>),
    U32(Vec<u32>),
    Zeros(usize),
}

/// One kernel check: buffers, the dispatches over them (indices into
/// `buffers`), and the expected contents of some buffers afterwards.
#[derive(Debug, Clone)]
pub struct Check {
    pub name: String,
    pub buffers: Vec<Fill>,
    pub steps: Vec<(KernelSpec, Vec<usize>)>,
    pub expect: Vec<Expect>,
}

/// Buffer `buffer` must equal `want` within `tol` after the steps, and
/// element `i` may be off by a further `bound[i]` where a bound is given.
#[derive(Debug, Clone)]
pub struct Expect {
    pub what: &'static str,
    pub buffer: usize,
    pub want: Vec<f32>,
    pub tol: Tol,
    /// Per-element error bounds from a kernel's error model (see
    /// [`crate::accuracy`]), for outputs whose conditioning depends on the
    /// data, so no single relative tolerance fits them.
    pub bound: Option<Vec<f32>>,
}

impl Expect {
    /// Buffer `buffer` must hold `want` within `tol`; `what` names it in failures.
    pub fn new(what: &'static str, buffer: usize, want: Vec<f32>, tol: Tol) -> Self {
        Self {
            what,
            buffer,
            want,
            tol,
            bound: None,
        }
    }

    /// The same expectation, with element `i` allowed a further `bound[i]`.
    pub fn with_bound(mut self, bound: Vec<f32>) -> Self {
        self.bound = Some(bound);
        self
    }

    /// The first element outside the tolerance (and bound), as `(index,
    /// got, want, error allowed there)`.
    fn first_violation(&self, got: &[f32]) -> Option<(usize, f32, f32, f64)> {
        match &self.bound {
            None => self.tol.first_violation(got, &self.want).map(|(i, g, w)| {
                let allowed =
                    f64::from(self.tol.abs) + f64::from(self.tol.rel) * f64::from(w).abs();
                (i, g, w, allowed)
            }),
            Some(bound) => {
                got.iter()
                    .zip(&self.want)
                    .zip(bound)
                    .enumerate()
                    .find_map(|(i, ((&g, &w), &b))| {
                        let allowed = f64::from(self.tol.abs)
                            + f64::from(self.tol.rel) * f64::from(w).abs()
                            + f64::from(b);
                        let err = (f64::from(g) - f64::from(w)).abs();
                        // A NaN error is never within bounds.
                        let ok = err.partial_cmp(&allowed).is_some_and(|o| o.is_le());
                        (!ok).then_some((i, g, w, allowed))
                    })
            }
        }
    }
}

/// Why a check failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CheckError {
    #[error(
        "{check}: {what}[{index}] is {got} but the reference says {want} (error allowed there {allowed:e})"
    )]
    Mismatch {
        check: String,
        what: &'static str,
        index: usize,
        got: f32,
        want: f32,
        allowed: f64,
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
        error: crate::GpuError,
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
            if let Some((index, got, want, allowed)) = e.first_violation(got) {
                return Err(CheckError::Mismatch {
                    check: self.name.clone(),
                    what: e.what,
                    index,
                    got,
                    want,
                    allowed,
                });
            }
        }
        Ok(())
    }
}

/// Uploads the buffers, runs the steps in one submission, reads back the
/// expected buffers and compares them.
#[cfg(feature = "gpu")]
pub async fn run(gpu: &crate::GpuContext, check: &Check) -> Result<(), CheckError> {
    let gpu_err = |error| CheckError::Gpu {
        check: check.name.clone(),
        error,
    };
    let mut buffers = Vec::with_capacity(check.buffers.len());
    for init in &check.buffers {
        buffers.push(
            match init {
                Fill::F32(v) => gpu.upload_f32(v),
                Fill::U32(v) => gpu.upload_u32(v),
                Fill::Zeros(n) => gpu.create_buffer(*n),
            }
            .map_err(gpu_err)?,
        );
    }
    let bound: Vec<Vec<&crate::GpuBuffer>> = check
        .steps
        .iter()
        .map(|(_, idx)| idx.iter().map(|&i| &buffers[i]).collect())
        .collect();
    let steps: Vec<(&KernelSpec, &[&crate::GpuBuffer])> = check
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

/// Fixed tolerances of the kernels without an error model yet. The
/// activations, normalisations and optimizers are bounded element by
/// element from their error models instead ([`crate::accuracy`]).
pub mod tol {
    use super::Tol;

    /// Relu, Identity, Add/Sub forward, Dropout: exact operations in f32.
    pub const EXACT: Tol = Tol::EXACT;
    /// Mul/Div forward: one rounding; Div by values near zero is avoided by
    /// the case builders.
    pub const ARITH: Tol = Tol::new(1e-6, 1e-6);
    /// Broadcast backward sums up to a few hundred terms in f32.
    pub const BROADCAST_SUM: Tol = Tol::new(1e-5, 1e-5);
    /// Losses: `exp`/`log` per element plus a sum over rows in f32.
    pub const LOSS: Tol = Tol::new(2e-6, 2e-5);
}

/// Assembles a [`Check`]: each buffer is added once and named by the index
/// it gets, so the dispatches and expectations say which buffer they mean.
#[derive(Default)]
struct Builder {
    buffers: Vec<Fill>,
    steps: Vec<(KernelSpec, Vec<usize>)>,
    expect: Vec<Expect>,
}

impl Builder {
    fn add(&mut self, fill: Fill) -> usize {
        self.buffers.push(fill);
        self.buffers.len() - 1
    }

    /// A buffer holding `values`.
    fn f32(&mut self, values: Vec<f32>) -> usize {
        self.add(Fill::F32(values))
    }

    /// A buffer holding `values` as `u32` words (labels, indices, uniforms).
    fn u32(&mut self, values: Vec<u32>) -> usize {
        self.add(Fill::U32(values))
    }

    /// A zeroed buffer of `len` elements, for a kernel to write.
    fn zeros(&mut self, len: usize) -> usize {
        self.add(Fill::Zeros(len))
    }

    /// Dispatches `spec` over the given buffers, in its bindings' order.
    fn step(&mut self, spec: KernelSpec, buffers: impl Into<Vec<usize>>) {
        self.steps.push((spec, buffers.into()));
    }

    /// After the steps, `buffer` must hold `want` within `tol`.
    fn expect(&mut self, what: &'static str, buffer: usize, want: Vec<f32>, tol: Tol) {
        self.expect.push(Expect::new(what, buffer, want, tol));
    }

    /// After the steps, a GEMM output of `k` terms per element must hold
    /// `want` within [`crate::gemm::gemm_tol`] and `bound[i]` more.
    fn expect_gemm(
        &mut self,
        what: &'static str,
        buffer: usize,
        want: Vec<f32>,
        k: usize,
        bound: Vec<f32>,
    ) {
        self.expect
            .push(Expect::new(what, buffer, want, crate::gemm::gemm_tol(k)).with_bound(bound));
    }

    /// After the steps, element `i` of `buffer` must be within `bound[i]`
    /// of `want[i]`.
    fn expect_within(
        &mut self,
        what: &'static str,
        buffer: usize,
        want: Vec<f32>,
        bound: Vec<f32>,
    ) {
        self.expect
            .push(Expect::new(what, buffer, want, Tol::EXACT).with_bound(bound));
    }

    fn build(self, name: String) -> Check {
        Check {
            name,
            buffers: self.buffers,
            steps: self.steps,
            expect: self.expect,
        }
    }
}

/// `2x3x4` for the shape `[2, 3, 4]`, in check names.
fn shape_name(shape: &[usize]) -> String {
    shape
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join("x")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::elementwise::Unary;

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
                crate::spec::validate::spec(spec);
                // Chromium's WGSL compiler refuses const infinities (naga accepts them).
                assert!(!spec.wgsl.contains("bitcast<f32>(0x"), "{}", c.name);
            }
            for e in &c.expect {
                assert!(e.buffer < c.buffers.len());
            }
        }
    }
}
