//! The kernels' CPU references (`rookery_kernels`), which the GPU
//! kernels are checked against natively and in the browser, checked in turn
//! against libtorch: forward values and autograd gradients on random shapes
//! with odd sizes, and the optimizers against this crate's torch.optim port.
//! Together the two checks tie every WGSL kernel to torch.
//!
//! Tolerances: the references compute in f64, torch in f32, so each op is
//! allowed `TOL_ELEMENTWISE` (one f32 rounding of a few operations) or, for
//! sums over `k` terms, `gemm_tol`-style `sqrt(k)` growth (`tol_sum`).
//! Dropout is not compared: it uses its own counter-based RNG by design,
//! which torch does not have. The parametrised activations run through
//! `rookery_torch::exec::activation`, the libtorch executor's own mapping
//! (ATen ops where tch binds torch's defaults, torch's arithmetic in ATen
//! ops otherwise), every entry of `UNARIES` at its kinks as well as on
//! random inputs.
#![cfg(feature = "torch")]
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use rookery_kernels::conv::Conv2d;
use rookery_kernels::elementwise::{BINARY_OPS, BinaryOp, Broadcast, Operand, UNARIES, Unary};
use rookery_kernels::gemm::{Linear, MatMul};
use rookery_kernels::loss::{CrossEntropy, Mse, class_labels};
use rookery_kernels::norm::{BatchNorm, LayerNorm};
use rookery_kernels::optim::optimizer_cases;
use rookery_kernels::pool::{GlobalAvgPool, Pool2d};
use rookery_kernels::reduce::Softmax;
use rookery_kernels::sample_matrix;
use rookery_kernels::shape::{Concat, Gather, Transpose};
use rookery_torch::TorchOptimizer;
use tch::{Kind, Reduction, Tensor};

/// One f32 rounding of a handful of operations, relative to max(1, |want|).
const TOL_ELEMENTWISE: f64 = 2e-6;

/// Sums of `k` terms of magnitude up to 1.
fn tol_sum(k: usize) -> f64 {
    2e-6 * (k.max(1) as f64).sqrt() * 4.0
}

fn leaf(data: &[f32], shape: &[usize]) -> Tensor {
    let shape: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    Tensor::from_slice(data)
        .reshape(shape.as_slice())
        .set_requires_grad(true)
}

fn plain(data: &[f32], shape: &[usize]) -> Tensor {
    let shape: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    Tensor::from_slice(data).reshape(shape.as_slice())
}

fn vals(x: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(x.detach().to_kind(Kind::Float).flatten(0, -1).contiguous()).unwrap()
}

/// Runs autograd with upstream gradient `dy` from output `y`.
fn backward(y: &Tensor, dy: &[f32]) {
    let g = plain(
        dy,
        &y.size().iter().map(|&d| d as usize).collect::<Vec<_>>(),
    );
    (y * g).sum(Kind::Float).backward();
}

/// [`close`], or within `bounds[i]` of torch where the computation's own
/// error model allows more: over a few nearly equal values torch's f32
/// LayerNorm loses their spread in its mean, which no fixed tolerance fits.
fn close_or_within(
    got: &[f32],
    want: &[f32],
    tol: f64,
    bounds: &[f64],
    what: &str,
) -> Result<(), TestCaseError> {
    prop_assert_eq!(got.len(), bounds.len(), "{}: one bound each", what);
    for (i, ((&g, &w), &b)) in got.iter().zip(want).zip(bounds).enumerate() {
        let abs = (f64::from(g) - f64::from(w)).abs();
        let rel = abs / f64::from(w).abs().max(1.0);
        prop_assert!(
            rel <= tol || abs <= b,
            "{}[{}]: reference {} torch {} (error {:e} > {:e} and over the bound {:e})",
            what,
            i,
            g,
            w,
            rel,
            tol,
            b
        );
    }
    Ok(())
}

/// How far torch's f32 LayerNorm may be from the exact `(y, dx)`, element by
/// element: its operations (mean, centred values, biased variance, rstd;
/// backward `rstd (g - mean(g) - xhat mean(g xhat))` with `g = dy w`) in
/// running error analysis.
fn torch_layer_norm_bounds(
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    eps: f32,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    use rookery_kernels::accuracy::{SAFETY, Tracked, U};
    let t = Tracked::exact;
    let cols = w.len();
    let n = t(cols as f32);
    let sum = |v: &mut dyn Iterator<Item = Tracked>| v.fold(t(0.0), |a, b| a + b);
    let (mut by, mut bdx) = (Vec::with_capacity(x.len()), Vec::with_capacity(x.len()));
    // dw sums dy times the normalised input over rows: where a row's
    // variance is 0, 1/sqrt(eps) magnifies the rounding of its mean.
    let mut dw = vec![t(0.0); cols];
    for (row, dy) in x.chunks(cols).zip(dy.chunks(cols)) {
        let mean = sum(&mut row.iter().map(|&v| t(v))) / n;
        let xc: Vec<Tracked> = row.iter().map(|&v| t(v) - mean).collect();
        let var = sum(&mut xc.iter().map(|&c| c * c)) / n;
        let r = t(1.0) / (var + t(eps)).sqrt();
        let xh: Vec<Tracked> = xc.iter().map(|&c| c * r).collect();
        let g: Vec<Tracked> = dy.iter().zip(w).map(|(&d, &wc)| t(d) * t(wc)).collect();
        let m1 = sum(&mut g.iter().copied()) / n;
        let m2 = sum(&mut g.iter().zip(&xh).map(|(&a, &b)| a * b)) / n;
        for c in 0..cols {
            let y = xh[c] * t(w[c]);
            let dx = r * ((g[c] - m1) - xh[c] * m2);
            // The reference's own rounding to f32 on top.
            by.push(SAFETY * y.error + U * y.value.abs());
            bdx.push(SAFETY * dx.error + U * dx.value.abs());
            dw[c] = dw[c] + t(dy[c]) * xh[c];
        }
    }
    let bdw = dw
        .iter()
        .map(|d| SAFETY * d.error + U * d.value.abs())
        .collect();
    (by, bdx, bdw)
}

fn grad(x: &Tensor) -> Vec<f32> {
    vals(&x.grad())
}

fn close(got: &[f32], want: &[f32], tol: f64, what: &str) -> Result<(), TestCaseError> {
    prop_assert_eq!(got.len(), want.len(), "{}: lengths differ", what);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(g) - f64::from(w)).abs() / f64::from(w).abs().max(1.0);
        prop_assert!(
            err <= tol,
            "{}[{}]: reference {} torch {} (error {:e} > {:e})",
            what,
            i,
            g,
            w,
            err,
            tol
        );
    }
    Ok(())
}

fn scaled(len: usize, seed: u64, scale: f32) -> Vec<f32> {
    sample_matrix(len, seed).iter().map(|v| v * scale).collect()
}

fn shape(max_rank: usize, max_dim: usize) -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1..=max_dim, 1..=max_rank)
}

/// `op` on libtorch, forward; autograd gives the backward.
fn torch_unary(op: Unary, x: &Tensor) -> Tensor {
    match op {
        Unary::Relu => x.relu(),
        Unary::Gelu => x.gelu("none"),
        Unary::GeluTanh => x.gelu("tanh"),
        Unary::Sigmoid => x.sigmoid(),
        Unary::Tanh => x.tanh(),
        Unary::Identity => x.shallow_clone() * 1.0,
        Unary::Neg => x.neg(),
        Unary::Abs => x.abs(),
        Unary::Sqrt => x.sqrt(),
        Unary::Reciprocal => x.reciprocal(),
        Unary::Exp => x.exp(),
        Unary::Log => x.log(),
        Unary::Activation(a) => rookery_torch::exec::activation(x, a).unwrap(),
    }
}

/// The CPU reference of `op` against libtorch at `xs`, forward and backward.
fn unary_matches_torch(op: Unary, xs: &[f32], dy: &[f32]) -> Result<(), TestCaseError> {
    let x = leaf(xs, &[xs.len()]);
    let y = torch_unary(op, &x);
    backward(&y, dy);
    let what = op.label();
    close(
        &op.reference(xs),
        &vals(&y),
        TOL_ELEMENTWISE,
        &format!("{what} y"),
    )?;
    close(
        &op.reference_backward(xs, dy),
        &grad(&x),
        TOL_ELEMENTWISE,
        &format!("{what} dx"),
    )
}

/// Every unary op, each parameter set of each activation included, at its
/// kinks (with an upstream gradient of 0.75 there, so a wrong branch of the
/// gradient shows) and at spread values, large ones included.
#[test]
fn every_unary_op_matches_torch_at_its_kinks_and_across_its_range() {
    for (i, op) in UNARIES.into_iter().enumerate() {
        let kinks = op.kinks();
        let spread = scaled(64, i as u64, 4.0)
            .into_iter()
            .chain([-30.0, -9.5, 9.5, 30.0])
            .map(|v| op.domain(v));
        let xs: Vec<f32> = kinks.iter().copied().chain(spread).collect();
        let dy: Vec<f32> = kinks
            .iter()
            .map(|_| 0.75)
            .chain(sample_matrix(xs.len() - kinks.len(), i as u64 ^ 9))
            .collect();
        if let Err(e) = unary_matches_torch(op, &xs, &dy) {
            panic!("{e}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn activations_match_torch(op in 0..UNARIES.len(), len in 1usize..500, seed in any::<u64>()) {
        let op = UNARIES[op];
        let xs: Vec<f32> = scaled(len, seed, 4.0).into_iter().map(|v| op.domain(v)).collect();
        let dy = sample_matrix(len, seed ^ 1);
        unary_matches_torch(op, &xs, &dy)?;
    }

    #[test]
    fn broadcast_binary_ops_match_torch(
        op in 0..BINARY_OPS.len(), a in shape(4, 5), mask in prop::collection::vec(any::<bool>(), 4), seed in any::<u64>()
    ) {
        let op = BINARY_OPS[op];
        let b: Vec<usize> = a.iter().zip(&mask).map(|(&d, &m)| if m { 1 } else { d }).skip(1).collect();
        let b = if b.is_empty() { vec![1] } else { b };
        let s = Broadcast::new(&a, &b).unwrap();
        let av = sample_matrix(a.iter().product(), seed);
        let bv: Vec<f32> = sample_matrix(b.iter().product(), seed ^ 1).iter().map(|v| v.signum() * (0.5 + v.abs())).collect();
        let dy = sample_matrix(s.out.iter().product(), seed ^ 2);
        let (ta, tb) = (leaf(&av, &a), leaf(&bv, &b));
        let y = match op {
            BinaryOp::Add => &ta + &tb,
            BinaryOp::Sub => &ta - &tb,
            BinaryOp::Mul => &ta * &tb,
            BinaryOp::Div => &ta / &tb,
        };
        backward(&y, &dy);
        close(&op.reference(&s, &av, &bv), &vals(&y), TOL_ELEMENTWISE, "y")?;
        let reps = s.out.iter().product::<usize>();
        close(&op.reference_backward(&s, &av, &bv, &dy, Operand::A), &grad(&ta), tol_sum(reps), "da")?;
        close(&op.reference_backward(&s, &av, &bv, &dy, Operand::B), &grad(&tb), tol_sum(reps), "db")?;
    }

    #[test]
    fn matmul_and_linear_match_torch(
        m in 1usize..20, k in 1usize..30, n in 1usize..20, batch in prop::collection::vec(1usize..4, 0..3),
        bias in any::<bool>(), seed in any::<u64>()
    ) {
        let mut a = batch.clone();
        a.extend([m, k]);
        let mut b: Vec<usize> = batch.iter().skip(1).copied().collect();
        b.extend([k, n]);
        let mm = MatMul::new(&a, &b).unwrap();
        let av = sample_matrix(a.iter().product(), seed);
        let bv = sample_matrix(b.iter().product(), seed ^ 1);
        let dc = sample_matrix(mm.out_shape().iter().product(), seed ^ 2);
        let (ta, tb) = (leaf(&av, &a), leaf(&bv, &b));
        let c = ta.matmul(&tb);
        backward(&c, &dc);
        let (rc, rda, rdb) = mm.reference(&av, &bv, &dc);
        let z: usize = batch.iter().product();
        close(&rc, &vals(&c), tol_sum(k), "matmul c")?;
        close(&rda, &grad(&ta), tol_sum(n), "matmul da")?;
        close(&rdb, &grad(&tb), tol_sum(m * z), "matmul db")?;

        let l = Linear::new(m, k, n, bias);
        let xv = sample_matrix(m * k, seed ^ 3);
        let wv = sample_matrix(n * k, seed ^ 4);
        let bv = sample_matrix(n, seed ^ 5);
        let dy = sample_matrix(m * n, seed ^ 6);
        let (x, w, tb) = (leaf(&xv, &[m, k]), leaf(&wv, &[n, k]), leaf(&bv, &[n]));
        let y = x.linear(&w, bias.then_some(&tb));
        backward(&y, &dy);
        let (ry, rdx, rdw, rdb) = l.reference(&xv, &wv, bias.then_some(&bv[..]), &dy);
        close(&ry, &vals(&y), tol_sum(k), "linear y")?;
        close(&rdx, &grad(&x), tol_sum(n), "linear dx")?;
        close(&rdw, &grad(&w), tol_sum(m), "linear dw")?;
        if bias {
            close(&rdb, &grad(&tb), tol_sum(m), "linear db")?;
        }
    }

    #[test]
    fn softmax_layer_norm_and_losses_match_torch(
        outer in 1usize..8, axis in 1usize..20, inner in 1usize..4, log in any::<bool>(), seed in any::<u64>()
    ) {
        let shape = [outer, axis, inner];
        let len = outer * axis * inner;
        let xs = scaled(len, seed, 5.0);
        let dy = sample_matrix(len, seed ^ 1);
        let s = Softmax { outer, axis, inner, log };
        let x = leaf(&xs, &shape);
        let y = if log { x.log_softmax(1, Kind::Float) } else { x.softmax(1, Kind::Float) };
        backward(&y, &dy);
        let (ry, rdx) = s.reference(&xs, &dy);
        close(&ry, &vals(&y), tol_sum(axis), "softmax y")?;
        close(&rdx, &grad(&x), tol_sum(axis), "softmax dx")?;

        // LayerNorm over the last two dimensions.
        let ln = LayerNorm { rows: outer, cols: axis * inner, eps: 1e-5 };
        let wv = sample_matrix(axis * inner, seed ^ 2);
        let bv = sample_matrix(axis * inner, seed ^ 3);
        let (x, w, b) = (leaf(&xs, &shape), leaf(&wv, &[axis, inner]), leaf(&bv, &[axis, inner]));
        let y = x.layer_norm([axis as i64, inner as i64], Some(&w), Some(&b), 1e-5, true);
        backward(&y, &dy);
        let (ry, rdx, rdw, rdb) = ln.reference(&xs, &wv, &bv, &dy);
        let t = tol_sum(axis * inner) * 10.0;
        let (by, bdx, bdw) = torch_layer_norm_bounds(&xs, &wv, &dy, 1e-5);
        close_or_within(&ry, &vals(&y), t, &by, "layer_norm y")?;
        close_or_within(&rdx, &grad(&x), t, &bdx, "layer_norm dx")?;
        close_or_within(&rdw, &grad(&w), t, &bdw, "layer_norm dw")?;
        close(&rdb, &grad(&b), t, "layer_norm db")?;

        // Cross-entropy over [outer, axis, inner] logits, every third target
        // ignored (torch's ignore_index), then MSE.
        let l64: Vec<i64> = sample_matrix(outer * inner, seed ^ 4)
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let class = (((v + 1.0) / 2.0 * axis as f32) as i64).min(axis as i64 - 1);
                if i % 3 == 1 { -100 } else { class }
            })
            .collect();
        let labels = class_labels(&l64, axis, -100).expect("labels in range");
        let counted = l64.iter().filter(|&&l| l != -100).count();
        let ce = CrossEntropy { n: outer, classes: axis, inner };
        let x = leaf(&xs, &shape);
        let tl = Tensor::from_slice(&l64).reshape([outer as i64, inner as i64]);
        let loss = x.cross_entropy_loss::<Tensor>(&tl, None, Reduction::Mean, -100, 0.0);
        (&loss * 0.75).backward();
        let (rsum, rdx) = ce.reference(&xs, &labels, 0.75 / counted as f32);
        close(&[(rsum / counted as f64) as f32], &vals(&loss), tol_sum(len), "cross_entropy")?;
        close(&rdx, &grad(&x), tol_sum(axis), "cross_entropy dx")?;

        let mse = Mse { len };
        let target = sample_matrix(len, seed ^ 5);
        let x = leaf(&xs, &shape);
        let loss = x.mse_loss(&plain(&target, &shape), Reduction::Mean);
        (&loss * 1.5).backward();
        let (rl, rdx) = mse.reference(&xs, &target, 1.5);
        close(&[rl], &vals(&loss), tol_sum(len), "mse")?;
        close(&rdx, &grad(&x), TOL_ELEMENTWISE, "mse dx")?;
    }

    #[test]
    fn batch_norm_matches_torch_in_train_and_eval(
        n in 1usize..6, channels in 1usize..5, h in 1usize..6, w in 1usize..6, seed in any::<u64>()
    ) {
        prop_assume!(n * h * w > 1);
        let bn = BatchNorm { n, channels, spatial: h * w, eps: 1e-5, momentum: 0.1 };
        let shape = [n, channels, h, w];
        let len = n * channels * h * w;
        let xs: Vec<f32> = scaled(len, seed, 2.0);
        let (wv, bv) = (sample_matrix(channels, seed ^ 1), sample_matrix(channels, seed ^ 2));
        let rm = sample_matrix(channels, seed ^ 3);
        let rv: Vec<f32> = sample_matrix(channels, seed ^ 4).iter().map(|v| v.abs() + 0.5).collect();
        let dy = sample_matrix(len, seed ^ 5);
        let (x, tw, tb) = (leaf(&xs, &shape), leaf(&wv, &[channels]), leaf(&bv, &[channels]));
        let (trm, trv) = (plain(&rm, &[channels]), plain(&rv, &[channels]));
        let y = x.batch_norm(Some(&tw), Some(&tb), Some(&trm), Some(&trv), true, 0.1, 1e-5, true);
        backward(&y, &dy);
        let (ry, rrm, rrv, rdx, rdw, rdb) = bn.reference_train(&xs, &wv, &bv, (&rm, &rv), &dy);
        let t = tol_sum(n * h * w) * 10.0;
        close(&ry, &vals(&y), t, "batch_norm y")?;
        close(&rrm, &vals(&trm), t, "running_mean")?;
        close(&rrv, &vals(&trv), t, "running_var")?;
        close(&rdx, &grad(&x), t, "batch_norm dx")?;
        close(&rdw, &grad(&tw), t, "batch_norm dw")?;
        close(&rdb, &grad(&tb), t, "batch_norm db")?;
        let (trm, trv) = (plain(&rm, &[channels]), plain(&rv, &[channels]));
        let y = plain(&xs, &shape).batch_norm(Some(&tw), Some(&tb), Some(&trm), Some(&trv), false, 0.1, 1e-5, true);
        close(&bn.reference_eval(&xs, &wv, &bv, (&rm, &rv)), &vals(&y), t, "batch_norm eval")?;
    }

    #[test]
    fn conv2d_matches_torch(
        n in 1usize..3, cg in 1usize..4, og in 1usize..4, groups in 1usize..3,
        h in 1usize..10, w in 1usize..10, kh in 1usize..4, kw in 1usize..4,
        stride in (1usize..3, 1usize..3), padding in (0usize..2, 0usize..2), dilation in (1usize..3, 1usize..3),
        bias in any::<bool>(), seed in any::<u64>()
    ) {
        let conv = Conv2d::new([n, cg * groups, h, w], og * groups, [kh, kw], [stride.0, stride.1],
            [padding.0, padding.1], [dilation.0, dilation.1], groups, bias);
        prop_assume!(conv.is_some());
        let conv = conv.unwrap();
        let xs = sample_matrix(n * cg * groups * h * w, seed);
        let ws = sample_matrix(og * groups * cg * kh * kw, seed ^ 1);
        let bs = sample_matrix(og * groups, seed ^ 2);
        let dy = sample_matrix(conv.out_len(), seed ^ 3);
        let x = leaf(&xs, &[n, cg * groups, h, w]);
        let wt = leaf(&ws, &[og * groups, cg, kh, kw]);
        let bt = leaf(&bs, &[og * groups]);
        let i64s = |v: (usize, usize)| [v.0 as i64, v.1 as i64];
        let y = x.conv2d(&wt, bias.then_some(&bt), i64s(stride), i64s(padding), i64s(dilation), groups as i64);
        backward(&y, &dy);
        let (ry, rdx, rdw, rdb) = conv.reference(&xs, &ws, bias.then_some(&bs[..]), &dy);
        let (oh, ow) = conv.out_hw();
        close(&ry, &vals(&y), tol_sum(cg * kh * kw), "conv y")?;
        close(&rdx, &grad(&x), tol_sum(og * kh * kw), "conv dx")?;
        close(&rdw, &grad(&wt), tol_sum(n * oh * ow), "conv dw")?;
        if bias {
            close(&rdb, &grad(&bt), tol_sum(n * oh * ow), "conv db")?;
        }
    }

    #[test]
    fn pools_match_torch(
        planes in 1usize..4, h in 1usize..12, w in 1usize..12, k in (1usize..4, 1usize..4),
        s in (1usize..4, 1usize..4), p in (0usize..2, 0usize..2), d in (1usize..3, 1usize..3),
        ceil in any::<bool>(), include in any::<bool>(), seed in any::<u64>()
    ) {
        let pool = Pool2d::new(planes, h, w, [k.0, k.1], [s.0, s.1], [p.0, p.1])
            .and_then(|pool| pool.with_options([d.0, d.1], ceil, include));
        prop_assume!(pool.is_some());
        let pool = pool.unwrap();
        let xs = sample_matrix(planes * h * w, seed);
        let dy = sample_matrix(pool.out_len(), seed ^ 1);
        let shape = [1, planes, h, w];
        let i64s = |v: (usize, usize)| [v.0 as i64, v.1 as i64];
        let x = leaf(&xs, &shape);
        let y = x.max_pool2d(i64s(k), i64s(s), i64s(p), i64s(d), ceil);
        prop_assert_eq!(y.size(), [1, planes as i64, pool.out_hw().0 as i64, pool.out_hw().1 as i64]);
        backward(&y, &dy);
        let (ry, _, rdx) = pool.max_reference(&xs, &dy);
        close(&ry, &vals(&y), 0.0, "max_pool y")?;
        close(&rdx, &grad(&x), tol_sum(k.0 * k.1), "max_pool dx")?;
        // torch's average pooling has no dilation.
        if d == (1, 1) {
            let x = leaf(&xs, &shape);
            let y = x.avg_pool2d(i64s(k), i64s(s), i64s(p), ceil, include, None::<i64>);
            backward(&y, &dy);
            let (ry, rdx) = pool.avg_reference(&xs, &dy);
            close(&ry, &vals(&y), tol_sum(k.0 * k.1), "avg_pool y")?;
            close(&rdx, &grad(&x), tol_sum(k.0 * k.1), "avg_pool dx")?;
        }
        let g = GlobalAvgPool { planes, spatial: h * w };
        let x = leaf(&xs, &shape);
        let y = x.adaptive_avg_pool2d([1, 1]);
        let gdy = sample_matrix(planes, seed ^ 2);
        backward(&y, &gdy);
        let (ry, rdx) = g.reference(&xs, &gdy);
        close(&ry, &vals(&y), tol_sum(h * w), "global_avg_pool y")?;
        close(&rdx, &grad(&x), TOL_ELEMENTWISE, "global_avg_pool dx")?;
    }

    #[test]
    fn transpose_concat_gather_match_torch(
        shape in shape(4, 5), rot in 0usize..4, sizes in prop::collection::vec(1usize..5, 1..4),
        outer in 1usize..4, inner in 1usize..5, axis in 1usize..10, count in 1usize..12, seed in any::<u64>()
    ) {
        let rank = shape.len();
        let perm: Vec<usize> = (0..rank).map(|d| (d + rot) % rank).collect();
        let t = Transpose::new(&shape, &perm).unwrap();
        let xs = sample_matrix(shape.iter().product(), seed);
        let p64: Vec<i64> = perm.iter().map(|&p| p as i64).collect();
        close(&t.reference(&xs), &vals(&plain(&xs, &shape).permute(p64.as_slice())), 0.0, "transpose")?;

        let c = Concat { outer, sizes: sizes.clone(), inner };
        let parts: Vec<Vec<f32>> = sizes.iter().enumerate().map(|(i, s)| sample_matrix(outer * s * inner, seed ^ i as u64)).collect();
        let tensors: Vec<Tensor> = parts.iter().zip(&sizes).map(|(p, &s)| plain(p, &[outer, s, inner])).collect();
        let refs: Vec<&[f32]> = parts.iter().map(Vec::as_slice).collect();
        close(&c.reference(&refs), &vals(&Tensor::cat(&tensors, 1)), 0.0, "concat")?;

        // Embedding-style gather: ONNX Gather along the middle axis, negative
        // indices counted from the end (torch's index_select takes them
        // normalised).
        let g = Gather { outer, axis, inner, count };
        let data = sample_matrix(outer * axis * inner, seed ^ 7);
        let idx: Vec<i32> = sample_matrix(count, seed ^ 8)
            .iter()
            .map(|v| ((v * axis as f32).floor() as i32).clamp(-(axis as i32), axis as i32 - 1))
            .collect();
        let dy = sample_matrix(outer * count * inner, seed ^ 9);
        let norm: Vec<i64> = idx.iter().map(|&v| if v < 0 { i64::from(v) + axis as i64 } else { i64::from(v) }).collect();
        let x = leaf(&data, &[outer, axis, inner]);
        let y = x.index_select(1, &Tensor::from_slice(&norm));
        backward(&y, &dy);
        let (ry, rdd) = g.reference(&data, &idx, &dy);
        close(&ry, &vals(&y), 0.0, "gather y")?;
        close(&rdd, &grad(&x), tol_sum(count), "gather ddata")?;
    }

    #[test]
    fn optimizer_references_match_the_torch_optim_port(case in 0usize..12, len in 1usize..200, seed in any::<u64>()) {
        let o = optimizer_cases()[case];
        let config = o;
        let mut torch = TorchOptimizer::new(config).unwrap();
        let mut mine = sample_matrix(len, seed);
        let param = plain(&mine, &[len]);
        let mut state = vec![vec![0.0f32; len]; o.state_names().len()];
        for step in 1..=4u64 {
            let g = sample_matrix(len, seed ^ step);
            o.reference_step(step, &mut mine, &g, &mut state);
            torch.update("p", &param, &plain(&g, &[len])).unwrap();
        }
        // Same f32 operations in the same order; torch's fused CPU kernels
        // may still differ in the last bit.
        close(&mine, &vals(&param), 1e-6, &format!("{o:?}"))?;
    }
}
