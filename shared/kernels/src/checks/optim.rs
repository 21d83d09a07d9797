//! Checks of the optimizer steps: several steps against the reference's
//! parameters and state.

use super::{Builder, Check};
use crate::OptimizerConfig;
use crate::accuracy::Tracked;
use crate::sample_matrix;

/// Three steps of an optimizer over `len` parameters, each with its own
/// gradient and uniform, against the reference's parameters and state.
pub fn optimizer(o: OptimizerConfig, len: usize, seed: u64) -> Check {
    const STEPS: u64 = 3;
    let mut want_param = sample_matrix(len, seed);
    let states = o.state_names();
    let mut want_state = vec![vec![0.0f32; len]; states.len()];
    let mut tracked_param: Vec<Tracked> = want_param.iter().map(|&p| Tracked::exact(p)).collect();
    let mut tracked_state = vec![vec![Tracked::exact(0.0); len]; states.len()];
    let mut c = Builder::default();
    let param = c.f32(want_param.clone());
    let state: Vec<usize> = states.iter().map(|_| c.zeros(len)).collect();
    let spec = o.step(len);
    for s in 0..STEPS {
        let step = s + 1;
        let g = sample_matrix(len, seed ^ (10 + s));
        o.reference_step(step, &mut want_param, &g, &mut want_state);
        o.tracked_step(step, &mut tracked_param, &g, &mut tracked_state);
        let uniform = c.u32(o.uniform(step));
        let grad = c.f32(g);
        let mut bound = vec![uniform, param, grad];
        bound.extend(&state);
        c.step(spec.clone(), bound);
    }
    let bounds = |values: &[Tracked]| values.iter().map(|t| t.between_two()).collect();
    c.expect_within("param", param, want_param, bounds(&tracked_param));
    for (((name, want), &buffer), tracked) in states
        .iter()
        .zip(want_state)
        .zip(&state)
        .zip(&tracked_state)
    {
        c.expect_within(name, buffer, want, bounds(tracked));
    }
    c.build(format!("{}[{len}] {o:?}", spec.label))
}
