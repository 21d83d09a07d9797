//! The CPU references of the parametrised activations against what PyTorch
//! computed (tests/fixtures/activations/kinks.json, made by `make.py`
//! there): for every parameter set of `ACTIVATIONS`, torch.nn.functional's
//! values and autograd's input gradients at the kinks, each with its f32
//! neighbours, and across the range. The GPU kernels are held to these
//! references, kinks included, by the standard checks.
#![allow(clippy::unwrap_used)]

use rookery_kernels::elementwise::{ACTIVATIONS, Unary};
use serde_json::Value;

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

#[test]
fn references_give_pytorchs_values_and_gradients_at_the_kinks_and_beyond() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/activations/kinks.json"
    );
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    assert_eq!(cases.len(), ACTIVATIONS.len());
    for (case, a) in cases.iter().zip(ACTIVATIONS) {
        assert_eq!(case["name"].as_str().unwrap(), a.name());
        assert_eq!(floats(&case["params"]), a.params(), "{}", a.label());
        let op = Unary::Activation(a);
        let (x, dy) = (floats(&case["x"]), floats(&case["dy"]));
        // The fixture's kinks are this crate's.
        assert_eq!(x[..op.kinks().len()], op.kinks(), "{}", a.label());
        for (what, got, want) in [
            ("y", op.reference(&x), floats(&case["y"])),
            ("dx", op.reference_backward(&x, &dy), floats(&case["dx"])),
        ] {
            for i in 0..x.len() {
                let (g, w) = (f64::from(got[i]), f64::from(want[i]));
                // One f32 rounding of a few operations (torch's), relative
                // to max(1, |value|); exact where torch's is exactly 0.
                let ok = if w == 0.0 {
                    g == 0.0
                } else {
                    (g - w).abs() <= 2e-6 * w.abs().max(1.0)
                };
                assert!(ok, "{} {what} at {}: {g}, PyTorch {w}", a.label(), x[i]);
            }
        }
    }
}
