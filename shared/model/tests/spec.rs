//! Layer-spec import: PyTorch-style names, embedding models, and errors that name
//! the layer index and field.
// Helpers outside #[test] fns panic on purpose too: a panic is a test failure.
#![allow(clippy::unwrap_used)]

use rookery_model::{DType, ModelSpec, SpecError, from_toml};

#[test]
fn embedding_text_classifier() {
    let g = from_toml(
        r#"
input_shape = [12]
[[layers]]
type = "Embedding"
vocab_size = 50
embedding_dim = 8
[[layers]]
type = "LayerNormalization"
[[layers]]
type = "Flatten"
[[layers]]
type = "Dense"
units = 4
activation = "gelu"
[[layers]]
type = "BatchNormalization1D"
[[layers]]
type = "Activation"
name = "log_softmax"
"#,
    )
    .unwrap();
    assert_eq!(g.inputs[0].dtype, DType::I64);
    assert_eq!(g.inputs[0].shape, [1, 12]);
    let a = g.analyze().unwrap();
    let shapes: Vec<Vec<usize>> = a.nodes.iter().map(|n| n.output.shape.clone()).collect();
    assert_eq!(
        shapes,
        [
            vec![1, 12, 8],
            vec![1, 12, 8],
            vec![1, 96],
            vec![1, 4],
            vec![1, 4],
            vec![1, 4],
            vec![1, 4]
        ]
    );
    assert!(g.param("0.weight").is_some());
    assert!(g.param("1.weight").is_some());
    assert!(g.param("3.bias").is_some());
    assert!(g.param("5.running_mean").is_some());
}

fn err(text: &str) -> SpecError {
    from_toml(text).unwrap_err()
}

#[test]
fn errors_name_layer_and_field() {
    let e = err(
        "input_shape = [4]\n[[layers]]\ntype = \"Dense\"\nunits = 3\n[[layers]]\ntype = \"Nope\"\n",
    );
    assert!(matches!(e, SpecError::Layer { index: 1, .. }), "{e}");
    assert!(e.to_string().starts_with("layer 1:"), "{e}");

    let e = err("input_shape = [4]\n[[layers]]\ntype = \"Dense\"\n");
    assert!(e.to_string().contains("units"), "{e}");

    let e = err("input_shape = [4]\n[[layers]]\ntype = \"Dense\"\nunits = 0\n");
    assert_eq!(
        e,
        SpecError::Field {
            index: 0,
            layer: "Dense".into(),
            field: "units".into(),
            reason: "must be >= 1".into()
        }
    );

    let e = err("input_shape = [4]\n[[layers]]\ntype = \"Activation\"\nname = \"swish\"\n");
    assert!(
        e.to_string()
            .starts_with("layer 0 (Activation): field `name`"),
        "{e}"
    );

    let e = err("input_shape = [4]\n[[layers]]\ntype = \"Dropout\"\nrate = 1.5\n");
    assert!(e.to_string().contains("field `rate`"), "{e}");

    let e = err(
        "input_shape = [1, 4, 4]\n[[layers]]\ntype = \"Conv2D\"\nfilters = 2\nkernel_size = 5\n",
    );
    assert!(matches!(e, SpecError::Graph { index: 0, .. }), "{e}");
    assert!(e.to_string().contains("Conv2d"), "{e}");

    let e = err("input_shape = [4]\n[[layers]]\ntype = \"Conv2D\"\nfilters = 2\nkernel_size = 3\n");
    assert!(e.to_string().contains("field `input`"), "{e}");

    let e = err("input_shape = [4]\n[[layers]]\ntype = \"Dense\"\nunits = 2\nunit = 3\n");
    assert!(e.to_string().contains("unit"), "{e}");

    let e = err("input_shape = [4]\ncolour = 1\n[[layers]]\ntype = \"Flatten\"\n");
    assert!(matches!(e, SpecError::Top { .. }), "{e}");
}

#[test]
fn same_padding_and_spec_round_trip() {
    let text = "input_shape = [3, 9, 9]\n[[layers]]\ntype = \"Conv2D\"\nfilters = 4\nkernel_size = 3\npadding = \"same\"\ndilation = 2\n";
    let spec = ModelSpec::from_toml(text).unwrap();
    let g = spec.to_graph().unwrap();
    assert_eq!(g.analyze().unwrap().nodes[0].output.shape, [1, 4, 9, 9]);
}
