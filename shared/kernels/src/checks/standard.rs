//! The fixed spread of checks both harnesses run.

use super::{
    Check, batch_norm, binary, concat, conv_cases, conv2d, cross_entropy, dropout, gather,
    global_avg_pool, int8, layer_norm, layer_norm_around, linear, matmul, mse, optimizer, pool2d,
    softmax, transpose, unary, unary_kinks,
};
use crate::elementwise::{BINARY_OPS, UNARIES};
use crate::gemm::{AUTO_CANDIDATES, Precision, Tiling};
use crate::optim::optimizer_cases;
use crate::pool::Pool2d;

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
        checks.extend(unary_kinks(op, i as u64));
    }
    for (i, op) in BINARY_OPS.into_iter().enumerate() {
        for (j, (a, b)) in BROADCAST_CASES.iter().enumerate() {
            checks.extend(binary(op, a, b, (i * 10 + j) as u64));
        }
    }
    for (p, len) in [(0.0, 10), (0.5, 1001), (0.1, 77), (1.0, 5)] {
        checks.push(dropout(p, len, len as u64));
    }
    // The last shape is over a 128-wide block with ragged edges on every
    // side, for the largest register blocks.
    let matmuls: [(&[usize], &[usize]); 7] = [
        (&[1, 1], &[1, 1]),
        (&[17, 31], &[31, 5]),
        (&[64, 64], &[64, 64]),
        (&[3, 7, 9], &[9, 4]),
        (&[2, 1, 5, 3], &[4, 3, 6]),
        (&[33, 1], &[1, 47]),
        (&[150, 37], &[37, 133]),
    ];
    let tilings = [Tiling::CLASSIC, Tiling::square(5, 3), Tiling::square(16, 1)];
    for (i, (a, b)) in matmuls.iter().enumerate() {
        for tiling in tilings.into_iter().chain(AUTO_CANDIDATES) {
            checks.extend(matmul(a, b, tiling, Precision::F32, i as u64));
        }
        // Mixed precision: the tensor-core form where the adapter has
        // tensor cores (its tiling is its own), else the plain one.
        checks.extend(matmul(a, b, Tiling::CLASSIC, Precision::Mixed, i as u64));
    }
    for (i, (rows, inputs, outputs)) in [(1, 1, 1), (32, 784, 10), (7, 13, 29), (150, 200, 300)]
        .into_iter()
        .enumerate()
    {
        for precision in [Precision::F32, Precision::Mixed] {
            checks.push(linear(rows, inputs, outputs, true, precision, i as u64));
            checks.push(linear(rows, inputs, outputs, false, precision, i as u64));
        }
    }
    for (n, c, inner) in [(1, 1, 1), (32, 10, 1), (5, 3, 7), (300, 17, 1)] {
        checks.push(cross_entropy(n, c, inner, false, n as u64));
    }
    // Language-model layouts with ignored targets: `[N, V, T]` and `[N * T, V]`.
    for (n, c, inner) in [(2, 37, 9), (18, 37, 1)] {
        checks.push(cross_entropy(n, c, inner, true, c as u64));
    }
    for len in [1, 255, 1000] {
        checks.push(mse(len, len as u64));
    }
    for (i, o) in optimizer_cases().into_iter().enumerate() {
        checks.push(optimizer(o, 1 + 97 * i, i as u64));
    }
    for log in [false, true] {
        for (outer, axis, inner) in [(1, 1, 1), (32, 10, 1), (3, 17, 5), (1, 1000, 1)] {
            checks.push(softmax(outer, axis, inner, log, axis as u64));
        }
    }
    for (rows, cols) in [(1, 1), (7, 33), (64, 128)] {
        checks.push(layer_norm(rows, cols, cols as u64));
    }
    // Nearly equal values over few columns: the ill-conditioned rows.
    for (rows, cols, centre, spread) in
        [(24, 2, 3.0, 1e-2), (24, 2, -40.0, 1e-3), (9, 3, 7.0, 1e-3)]
    {
        checks.push(layer_norm_around(rows, cols, centre, spread, rows as u64));
    }
    for (n, c, sp) in [(2, 1, 1), (4, 3, 25), (32, 8, 49), (1, 5, 2)] {
        checks.push(batch_norm(n, c, sp, sp as u64));
    }
    let transposes: [(&[usize], &[usize]); 4] = [
        (&[5, 7], &[1, 0]),
        (&[2, 3, 4], &[2, 0, 1]),
        (&[3, 1, 4, 2], &[0, 3, 1, 2]),
        (&[9], &[0]),
    ];
    for (i, (shape, perm)) in transposes.iter().enumerate() {
        checks.extend(transpose(shape, perm, i as u64));
    }
    checks.push(concat(3, &[1, 4, 2], 5, 1));
    checks.push(concat(1, &[7], 1, 2));
    checks.push(gather(1, 10, 16, 33, 1));
    checks.push(gather(3, 5, 2, 4, 2));
    for (i, conv) in conv_cases().into_iter().enumerate() {
        checks.push(conv2d(conv, i as u64));
        let mut mixed = conv;
        mixed.precision = Precision::Mixed;
        checks.push(conv2d(mixed, i as u64));
    }
    for (i, (planes, h, w, k, s, p)) in [
        (1, 1, 1, [1, 1], [1, 1], [0, 0]),
        (16, 28, 28, [2, 2], [2, 2], [0, 0]),
        (3, 7, 5, [3, 2], [2, 1], [1, 1]),
        (2, 9, 9, [3, 3], [1, 1], [1, 0]),
    ]
    .into_iter()
    .enumerate()
    {
        checks.extend(Pool2d::new(planes, h, w, k, s, p).map(|pool| pool2d(pool, i as u64)));
    }
    // torch's options: dilated taps, ceil mode, padding left out of the mean.
    for (i, (d, ceil, include)) in [
        ([2, 1], false, true),
        ([1, 1], true, true),
        ([1, 2], true, false),
    ]
    .into_iter()
    .enumerate()
    {
        let pool = Pool2d::new(2, 9, 8, [3, 2], [2, 2], [1, 1])
            .and_then(|p| p.with_options(d, ceil, include));
        checks.extend(pool.map(|pool| pool2d(pool, 10 + i as u64)));
    }
    for (planes, spatial) in [(1, 1), (64, 49), (3, 1000)] {
        checks.push(global_avg_pool(planes, spatial, spatial as u64));
    }
    // Blockwise int8: ragged last words and blocks, several workgroups.
    for len in [1, 5, 63, 64, 65, 1000, 4097] {
        checks.push(int8(len, len as u64));
    }
    checks
}
