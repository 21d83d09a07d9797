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

/// A `[C, H, W]` input, then `layer`'s TOML lines as one layer.
fn conv_input_then(layer: &str) -> String {
    format!("input_shape = [3, 8, 8]\n[[layers]]\n{layer}\n")
}

#[test]
fn ravdl_argument_names_build_the_same_graph_as_ours() {
    // (RavDL's or PyTorch's way, Rookery's way)
    let cases = [
        (
            conv_input_then(
                "type = \"Conv2D\"\nin_channels = 3\nout_channels = 4\nkernel_size = 3\npadding_mode = \"zeros\"",
            ),
            conv_input_then("type = \"Conv2D\"\nfilters = 4\nkernel_size = 3"),
        ),
        (
            conv_input_then("type = \"MaxPooling2D\"\nkernel_size = 2"),
            conv_input_then("type = \"MaxPooling2D\"\npool_size = 2"),
        ),
        (
            conv_input_then("type = \"AveragePooling2D\"\nkernel_size = 2"),
            conv_input_then("type = \"AveragePooling2D\"\npool_size = 2"),
        ),
        (
            "input_shape = [4]\n[[layers]]\ntype = \"Dense\"\nunits = 2\nuse_bias = false\n".into(),
            "input_shape = [4]\n[[layers]]\ntype = \"Dense\"\nunits = 2\nbias = false\n".into(),
        ),
        (
            "input_shape = [5]\n[[layers]]\ntype = \"Embedding\"\nvocab_size = 9\nembed_dim = 3\n"
                .into(),
            "input_shape = [5]\n[[layers]]\ntype = \"Embedding\"\nvocab_size = 9\nembedding_dim = 3\n"
                .into(),
        ),
        (
            conv_input_then("type = \"Flatten\"\nstart_dim = 1\nend_dim = -1"),
            conv_input_then("type = \"Flatten\""),
        ),
        (
            conv_input_then("type = \"Flatten\"\nend_dim = 3"),
            conv_input_then("type = \"Flatten\""),
        ),
        (
            conv_input_then("type = \"BatchNormalization2D\"\naffine = true"),
            conv_input_then("type = \"BatchNormalization2D\""),
        ),
    ];
    for (theirs, ours) in cases {
        let (a, b) = (from_toml(&theirs), from_toml(&ours));
        assert_eq!(a, b, "{theirs}");
        assert!(a.is_ok(), "{theirs}: {a:?}");
    }
}

#[test]
fn ravdl_arguments_we_cannot_honour_are_refused_naming_what_to_write() {
    // (layer, field, words the message must hold)
    let cases = [
        (
            "type = \"Conv2D\"\nin_channels = 1\nfilters = 4\nkernel_size = 3",
            "in_channels",
            "input's 3 channels",
        ),
        (
            "type = \"Conv2D\"\nfilters = 4\nkernel_size = 3\npadding_mode = \"reflect\"",
            "padding_mode",
            "only `zeros`",
        ),
        (
            "type = \"BatchNormalization2D\"\naffine = false",
            "affine",
            "leave affine out",
        ),
        (
            "type = \"Flatten\"\nstart_dim = 2",
            "start_dim",
            "start_dim = 1",
        ),
        ("type = \"Flatten\"\nend_dim = 2", "end_dim", "end_dim = -1"),
    ];
    for (layer, field, words) in cases {
        let e = err(&conv_input_then(layer)).to_string();
        assert!(e.contains(&format!("field `{field}`")), "{layer}: {e}");
        assert!(e.contains(words), "{layer}: {e}");
    }
}

#[test]
fn a_keras_style_batchnorm_momentum_is_warned_about_with_its_pytorch_equivalent() {
    let spec = |momentum: f32| {
        ModelSpec::from_toml(&conv_input_then(&format!(
            "type = \"BatchNormalization2D\"\nmomentum = {momentum}"
        )))
        .unwrap()
    };
    let warnings = spec(0.99).warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("Keras") && warnings[0].contains("0.010"),
        "{warnings:?}"
    );
    assert!(spec(0.1).warnings().is_empty());
}
