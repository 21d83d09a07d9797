use super::*;
use crate::sample_matrix;
use crate::spec::validate;

fn conv(x: [usize; 4], o: usize, pad: usize) -> Conv2d {
    Conv2d::new(x, o, [3, 3], [1, 1], [pad, pad], [1, 1], 1, true).unwrap()
}

#[test]
fn only_wide_three_by_three_stride_one_convolutions_use_winograd() {
    assert!(Winograd::forward_of(&conv([2, 32, 8, 8], 32, 1)).is_some());
    assert!(Winograd::forward_of(&conv([2, 16, 8, 8], 32, 1)).is_none());
    assert!(Winograd::forward_of(&conv([2, 1, 28, 28], 16, 1)).is_none());
    let strided = Conv2d::new([2, 32, 8, 8], 32, [3, 3], [2, 2], [1, 1], [1, 1], 1, true).unwrap();
    assert!(Winograd::forward_of(&strided).is_none());
    let mut off = conv([2, 32, 8, 8], 32, 1);
    off.winograd = false;
    assert!(Winograd::forward_of(&off).is_none());
    let mut mixed = conv([2, 32, 8, 8], 32, 1);
    mixed.precision = Precision::Mixed;
    assert!(Winograd::forward_of(&mixed).is_none());
}

#[test]
fn a_large_batch_runs_in_even_chunks_under_the_binding_limit() {
    let w = Winograd::forward_of(&conv([256, 128, 28, 28], 128, 1)).unwrap();
    assert_eq!(w.tile, 4);
    let chunks = w.chunks();
    assert_eq!(chunks.len(), 2);
    assert!(chunks.iter().all(|c| c.count == 128));
    assert_eq!(chunks.iter().map(|c| c.count).sum::<usize>(), 256);
    assert!(w.v_len() * 4 <= MAX_TEMP_BYTES && w.m_len() * 4 <= MAX_TEMP_BYTES);
    let odd = Winograd::forward_of(&conv([7, 32, 5, 5], 32, 1)).unwrap();
    assert_eq!(odd.chunks(), vec![Chunk { start: 0, count: 7 }]);
}

/// The transforms in f64 give the direct convolution's forward, input
/// gradient and weight gradient, at both tile sizes, odd sizes (partial
/// tiles) and every padding.
#[test]
fn reference_transforms_equal_the_direct_convolution() {
    let cases = [
        (2, [2, 32, 7, 5], 33, 1),
        (2, [1, 32, 4, 6], 32, 0),
        (2, [1, 34, 3, 3], 32, 2),
        (4, [2, 32, 9, 7], 33, 1),
        (4, [1, 32, 6, 10], 32, 0),
        (4, [1, 32, 5, 3], 32, 2),
    ];
    for (tile, x, o, pad) in cases {
        let c = conv(x, o, pad);
        let xs = sample_matrix(c.n * c.c * c.h * c.w, 1);
        let ws = sample_matrix(c.weight_len(), 2);
        let dy = sample_matrix(c.out_len(), 3);
        let (y, dx, dw, _) = c.reference(&xs, &ws, None, &dy);
        force_tile(Some(tile));
        let fwd = Winograd::forward_of(&c).unwrap();
        let bwd = Winograd::backward_input(&c).unwrap();
        let grad = Winograd::weight_grad_of(&c).unwrap();
        force_tile(None);
        assert_eq!((fwd.tile, bwd.tile, grad.tile), (tile, tile, tile));
        let computed = [
            (fwd.reference(&xs, &ws, false), y),
            (bwd.reference(&dy, &ws, false), dx),
            (grad.weight_grad_reference(&xs, &dy, false), dw),
        ];
        for (got, want) in computed {
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(&want) {
                assert!((g - f64::from(*w)).abs() < 1e-4, "{g} vs {w}");
            }
        }
    }
}

#[test]
fn larger_tiles_magnify_rounding_more() {
    let c = conv([1, 32, 16, 16], 32, 1);
    force_tile(Some(2));
    let two = Winograd::forward_of(&c).unwrap().magnification();
    force_tile(Some(4));
    let four = Winograd::forward_of(&c).unwrap().magnification();
    force_tile(None);
    assert!((1.0..16.0).contains(&two), "{two}");
    assert!(four > two && four < 1000.0, "{four}");
    let g = |t| {
        force_tile(Some(t));
        let w = Winograd::weight_grad_of(&c)
            .unwrap()
            .weight_grad_magnification();
        force_tile(None);
        w
    };
    let (g2, g4) = (g(2), g(4));
    assert!(g2 >= 1.0 && g4 > g2, "{g2} {g4}");
}

#[test]
fn winograd_shaders_validate() {
    let c = conv([3, 32, 9, 7], 40, 1);
    let small = conv([3, 32, 5, 5], 40, 1);
    for w in [
        Winograd::forward_of(&c).unwrap(),
        Winograd::backward_input(&c).unwrap(),
        Winograd::forward_of(&small).unwrap(),
    ] {
        for chunk in w.chunks() {
            for spec in [
                w.transform_input(chunk),
                w.gemm(chunk),
                w.transform_output(chunk),
            ] {
                validate::spec(&spec);
            }
        }
        validate::spec(&w.transform_weight());
    }
    let w = Winograd::weight_grad_of(&c).unwrap();
    for chunk in w.chunks() {
        validate::spec(&w.transform_grad_output(chunk));
        validate::spec(&w.weight_grad_gemm(chunk));
        validate::spec(&w.finish_weight_grad(chunk, chunk.start == 0));
    }
}
