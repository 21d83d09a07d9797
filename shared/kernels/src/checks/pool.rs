//! Checks of the pooling kernels: max and average over windows, and global
//! average pooling.

use super::{Builder, Check, tol};
use crate::pool::{GlobalAvgPool, Pool2d};
use crate::sample_matrix;
use crate::spec::Tol;

/// Max and average pooling, forward and backward, on the same geometry.
pub fn pool2d(pool: Pool2d, seed: u64) -> Check {
    let x = sample_matrix(pool.planes * pool.h * pool.w, seed);
    let dy = sample_matrix(pool.out_len(), seed ^ 1);
    let (want_max_y, want_argmax, want_max_dx) = pool.max_reference(&x, &dy);
    let (want_avg_y, want_avg_dx) = pool.avg_reference(&x, &dy);
    let window = (pool.kernel[0] * pool.kernel[1]) as f32;
    let avg_tol = Tol::new(1e-6 * window, 1e-5);
    let x_len = x.len();
    let mut c = Builder::default();
    let (x, dy) = (c.f32(x), c.f32(dy));
    let (max_y, argmax) = (c.zeros(pool.out_len()), c.zeros(pool.out_len()));
    let max_dx = c.zeros(x_len);
    let avg_y = c.zeros(pool.out_len());
    let avg_dx = c.zeros(x_len);
    c.step(pool.max_forward(), [x, max_y, argmax]);
    c.step(pool.max_backward(), [argmax, dy, max_dx]);
    c.step(pool.avg_forward(), [x, avg_y]);
    c.step(pool.avg_backward(), [dy, avg_dx]);
    c.expect("max y", max_y, want_max_y, tol::EXACT);
    // The argmax buffer holds u32 indices; compared bit for bit as f32.
    let want_argmax = want_argmax.iter().map(|&v| f32::from_bits(v)).collect();
    c.expect("argmax", argmax, want_argmax, tol::EXACT);
    c.expect("max dx", max_dx, want_max_dx, tol::BROADCAST_SUM);
    c.expect("avg y", avg_y, want_avg_y, avg_tol);
    c.expect("avg dx", avg_dx, want_avg_dx, avg_tol);
    c.build(format!("{pool:?}"))
}

/// GlobalAveragePool forward and backward.
pub fn global_avg_pool(planes: usize, spatial: usize, seed: u64) -> Check {
    let g = GlobalAvgPool { planes, spatial };
    let x = sample_matrix(planes * spatial, seed);
    let dy = sample_matrix(planes, seed ^ 1);
    let (want_y, want_dx) = g.reference(&x, &dy);
    let mut c = Builder::default();
    let (x, dy) = (c.f32(x), c.f32(dy));
    let (y, dx) = (c.zeros(planes), c.zeros(planes * spatial));
    c.step(g.forward(), [x, y]);
    c.step(g.backward(), [dy, dx]);
    c.expect("y", y, want_y, tol::BROADCAST_SUM);
    c.expect("dx", dx, want_dx, tol::ARITH);
    c.build(format!("global_avg_pool({planes}x{spatial})"))
}
