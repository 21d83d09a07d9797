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

/// The graph of one `Activation` layer (`lines`) over a `[4]` input: its op.
fn activation_op(lines: &str) -> Result<rookery_model::Op, SpecError> {
    let g = from_toml(&format!(
        "input_shape = [4]\n[[layers]]\ntype = \"Activation\"\n{lines}\n"
    ))?;
    assert_eq!(g.nodes.len(), 1);
    Ok(g.nodes[0].op.clone())
}

#[test]
fn every_activation_name_builds_its_op_with_torchs_defaults_or_the_arguments_given() {
    use rookery_model::Op;
    let cases = [
        (
            "name = \"relu6\"",
            Op::Hardtanh {
                min_val: 0.0,
                max_val: 6.0,
            },
        ),
        (
            "name = \"leaky_relu\"",
            Op::LeakyRelu {
                negative_slope: 0.01,
            },
        ),
        (
            "name = \"LeakyReLU\"\nnegative_slope = 0.2",
            Op::LeakyRelu {
                negative_slope: 0.2,
            },
        ),
        // Keras's name for the slope.
        (
            "name = \"leakyrelu\"\nalpha = 0.3",
            Op::LeakyRelu {
                negative_slope: 0.3,
            },
        ),
        ("name = \"elu\"", Op::Elu { alpha: 1.0 }),
        ("name = \"ELU\"\nalpha = 0.5", Op::Elu { alpha: 0.5 }),
        ("name = \"selu\"", Op::Selu),
        (
            "name = \"softplus\"",
            Op::Softplus {
                beta: 1.0,
                threshold: 20.0,
            },
        ),
        (
            "name = \"softplus\"\nbeta = 2\nthreshold = 5",
            Op::Softplus {
                beta: 2.0,
                threshold: 5.0,
            },
        ),
        ("name = \"softsign\"", Op::Softsign),
        ("name = \"tanhshrink\"", Op::Tanhshrink),
        ("name = \"tanh_shrink\"", Op::Tanhshrink),
        ("name = \"logsigmoid\"", Op::LogSigmoid),
        ("name = \"log_sigmoid\"", Op::LogSigmoid),
        ("name = \"hardshrink\"", Op::Hardshrink { lambd: 0.5 }),
        (
            "name = \"hard_shrink\"\nlambd = 0.3",
            Op::Hardshrink { lambd: 0.3 },
        ),
        (
            "name = \"hardtanh\"",
            Op::Hardtanh {
                min_val: -1.0,
                max_val: 1.0,
            },
        ),
        (
            "name = \"hard_tanh\"\nmin_val = -2\nmax_val = 3",
            Op::Hardtanh {
                min_val: -2.0,
                max_val: 3.0,
            },
        ),
        ("name = \"softmin\"", Op::Softmin { axis: -1 }),
        ("name = \"softmin\"\ndim = 1", Op::Softmin { axis: 1 }),
        ("name = \"softshrink\"", Op::Softshrink { lambd: 0.5 }),
        (
            "name = \"soft_shrink\"\nlambda = 1.25",
            Op::Softshrink { lambd: 1.25 },
        ),
        (
            "name = \"threshold\"\nthreshold = 0.1\nvalue = 20",
            Op::Threshold {
                threshold: 0.1,
                value: 20.0,
            },
        ),
        // Keras's name for the value.
        (
            "name = \"threshold\"\nthreshold = 0.1\ndefault_value = -1",
            Op::Threshold {
                threshold: 0.1,
                value: -1.0,
            },
        ),
        ("name = \"softmax\"\naxis = 1", Op::Softmax { axis: 1 }),
    ];
    for (lines, want) in cases {
        assert_eq!(
            activation_op(lines).unwrap_or_else(|e| panic!("{lines}: {e}")),
            want,
            "{lines}"
        );
    }
    // Inside a Dense layer, by name with torch's defaults.
    let g = from_toml(
        "input_shape = [4]\n[[layers]]\ntype = \"Dense\"\nunits = 3\nactivation = \"elu\"\n",
    )
    .unwrap();
    assert_eq!(g.nodes[1].op, Op::Elu { alpha: 1.0 });
}

#[test]
fn an_activation_argument_it_does_not_take_is_refused_naming_it() {
    // (lines, field, words the message must hold)
    let cases = [
        (
            "name = \"relu\"\nbeta = 2",
            "beta",
            "not an argument of relu (it takes: none)",
        ),
        (
            "name = \"elu\"\nnegative_slope = 0.2",
            "negative_slope",
            "not an argument of elu (it takes: alpha)",
        ),
        (
            "name = \"gelu\"\naxis = 1",
            "axis",
            "not an argument of gelu",
        ),
        (
            "name = \"softplus\"\nlambd = 1",
            "lambd",
            "it takes: beta, threshold",
        ),
        (
            "name = \"hardshrink\"\nvalue = 1",
            "value",
            "it takes: lambd",
        ),
        (
            "name = \"leaky_relu\"\nnegative_slope = 0.2\nalpha = 0.2",
            "alpha",
            "not both",
        ),
        (
            "name = \"threshold\"\nthreshold = 0.5",
            "value",
            "threshold needs `threshold` and `value`",
        ),
        (
            "name = \"threshold\"\nvalue = 0.5",
            "threshold",
            "has no defaults",
        ),
    ];
    for (lines, field, words) in cases {
        let e = activation_op(lines).unwrap_err();
        assert!(
            matches!(&e, SpecError::Field { index: 0, field: f, .. } if f == field),
            "{lines}: {e}"
        );
        assert!(e.to_string().contains(words), "{lines}: {e}");
    }
    // A name no activation takes, by serde, naming it.
    let e = activation_op("name = \"leaky_relu\"\nslope = 0.2").unwrap_err();
    assert!(e.to_string().contains("unknown field `slope`"), "{e}");
    // threshold has no defaults, so not as a Dense layer's activation either.
    let e = err(
        "input_shape = [4]\n[[layers]]\ntype = \"Dense\"\nunits = 3\nactivation = \"threshold\"\n",
    );
    assert!(e.to_string().contains("has no defaults"), "{e}");
    let e = activation_op("name = \"swishy\"").unwrap_err();
    assert!(e.to_string().contains("softshrink, threshold"), "{e}");
}

#[test]
fn activation_parameters_torch_refuses_are_refused() {
    // (lines, words)
    let cases = [
        (
            "name = \"softshrink\"\nlambd = -0.5",
            "lambd = -0.5 must be >= 0",
        ),
        (
            "name = \"hardtanh\"\nmin_val = 2\nmax_val = 1",
            "must not exceed max_val",
        ),
        ("name = \"softplus\"\nbeta = 0", "beta must not be 0"),
        ("name = \"elu\"\nalpha = inf", "must be finite"),
        (
            "name = \"threshold\"\nthreshold = nan\nvalue = 0",
            "must be finite",
        ),
    ];
    for (lines, words) in cases {
        let e = activation_op(lines).unwrap_err();
        assert!(
            matches!(e, SpecError::Graph { index: 0, .. }),
            "{lines}: {e}"
        );
        assert!(e.to_string().contains(words), "{lines}: {e}");
    }
}
