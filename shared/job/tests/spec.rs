//! The job file: the documented example parses to the expected spec, the JSON
//! form equals the TOML form, defaults match the documentation and
//! `torch.optim`, serialization round-trips, every invalid field is an error
//! naming that field, and the model loads at the micro-batch size.
// Helpers outside #[test] fns panic on purpose too: a panic is a test failure.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use rookery_job::{Aggregation, DataFormat, DataRef, JobError, JobSpec, ModelSource, WireDType};
use rookery_model::{ClassAxis, ClusterCount, Loss, LrSchedule, OptimizerConfig, Precision};

mod common;

use common::example::{EXAMPLE, base, example_with};

const EXAMPLE_JSON: &str = r#"{
  "model": { "onnx": "cnn.onnx", "input_shape": [1, 28, 28] },
  "data": {
    "format": "idx",
    "train_inputs": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_inputs": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
    "scale": 0.00392156862745098, "mean": 0.1307, "std": 0.3081
  },
  "training": {
    "epochs": 2, "batch_size": 64, "micro_batches": 4, "loss": "cross_entropy",
    "optimizer": { "name": "adam", "lr": 0.001 },
    "clusters": "auto", "sync_every": 1, "shuffle": true, "seed": 42, "wire_dtype": "f32"
  }
}"#;

#[test]
fn documented_example_parses_to_the_expected_spec() {
    let dir = base();
    let b = dir.path();
    let job = JobSpec::from_toml(EXAMPLE, b).unwrap();
    assert_eq!(job.model.source, ModelSource::Onnx(b.join("cnn.onnx")));
    assert_eq!(job.model.input_shape, [1, 28, 28]);
    let d = &job.data;
    assert_eq!(d.format, DataFormat::Idx);
    assert_eq!(
        d.train_inputs,
        DataRef::file(b.join("train-images-idx3-ubyte.gz"))
    );
    assert_eq!(
        d.test_labels,
        Some(DataRef::file(b.join("t10k-labels-idx1-ubyte.gz")))
    );
    assert_eq!(
        (d.scale, d.mean, d.std),
        (Some(1.0 / 255.0), Some(0.1307), Some(0.3081))
    );
    let t = &job.training;
    assert_eq!((t.epochs, t.batch_size, t.micro_batches), (2, 64, 4));
    assert_eq!(t.loss, Loss::cross_entropy());
    assert_eq!(t.optimizer, OptimizerConfig::adam(0.001));
    assert_eq!(t.clusters, ClusterCount::Auto);
    assert_eq!((t.sync_every, t.shuffle, t.seed), (1, true, 42));
    assert_eq!(t.wire_dtype, WireDType::F32);
    assert_eq!(job.micro_batch_size(), 16);
}

#[test]
fn lr_schedules_and_clipping_parse_with_step_lr_defaults_and_survive_json() {
    let dir = base();
    for (table, want) in [
        (
            "kind = \"cosine\"\nwarmup_steps = 10\nmin_lr = 1e-5",
            LrSchedule::Cosine {
                warmup_steps: 10,
                total_steps: None,
                min_lr: 1e-5,
            },
        ),
        (
            "kind = \"linear\"\ntotal_steps = 500",
            LrSchedule::Linear {
                warmup_steps: 0,
                total_steps: Some(500),
            },
        ),
        (
            "kind = \"constant\"\nwarmup_steps = 3",
            LrSchedule::Constant { warmup_steps: 3 },
        ),
        (
            "kind = \"step\"\nstep_size = 30",
            LrSchedule::Step {
                step_size: 30,
                gamma: 0.1,
            },
        ),
    ] {
        let text = format!("{EXAMPLE}clip_grad_norm = 1.0\n[training.lr_schedule]\n{table}\n");
        let job = JobSpec::from_toml(&text, dir.path()).unwrap();
        assert_eq!(job.training.lr_schedule, want, "{table}");
        assert_eq!(job.training.clip_grad_norm, Some(1.0));
        let again = JobSpec::from_json(&serde_json::to_string(&job).unwrap(), dir.path()).unwrap();
        assert_eq!(again, job, "{table}");
    }
    let plain = JobSpec::from_toml(EXAMPLE, dir.path()).unwrap();
    assert_eq!(
        plain.training.lr_schedule,
        LrSchedule::Constant { warmup_steps: 0 }
    );
    assert_eq!(plain.training.clip_grad_norm, None);
}

#[test]
fn json_form_equals_toml_form() {
    let dir = base();
    assert_eq!(
        JobSpec::from_json(EXAMPLE_JSON, dir.path()).unwrap(),
        JobSpec::from_toml(EXAMPLE, dir.path()).unwrap()
    );
}

#[test]
fn defaults_fill_every_optional_field() {
    let dir = base();
    let job = JobSpec::from_toml(
        r#"
[model]
spec = "model.toml"
input_shape = [4]
[data]
format = "npy"
train_inputs = "x.npy"
train_labels = "y.npy"
[training]
batch_size = 10
"#,
        dir.path(),
    )
    .unwrap();
    assert_eq!(
        job.model.source,
        ModelSource::Spec(dir.path().join("model.toml"))
    );
    assert_eq!(
        (job.data.test_inputs.as_ref(), job.data.scale, job.data.std),
        (None, None, None)
    );
    assert_eq!(job.data.normalisation(), (1.0, 0.0, 1.0));
    let t = &job.training;
    assert_eq!(
        (t.epochs, t.micro_batches, t.sync_every, t.seed),
        (1, 1, 1, 0)
    );
    assert_eq!(t.loss, Loss::cross_entropy());
    assert_eq!(t.optimizer, OptimizerConfig::sgd(0.01));
    assert_eq!(t.clusters, ClusterCount::Auto);
    assert!(t.shuffle);
    assert_eq!(t.wire_dtype, WireDType::F32);
    assert_eq!(t.aggregation, Aggregation::Mean);
    assert_eq!(job.micro_batch_size(), 10);
}

#[test]
fn optimizer_tables_take_torch_defaults_and_names() {
    let dir = base();
    let cases: Vec<(&str, OptimizerConfig)> = vec![
        (r#"{ name = "sgd" }"#, OptimizerConfig::sgd(1e-3)),
        (r#"{ name = "rmsprop" }"#, OptimizerConfig::rmsprop(1e-2)),
        (r#"{ name = "adam" }"#, OptimizerConfig::adam(1e-3)),
        (r#"{ name = "AdamW", lr = 1 }"#, OptimizerConfig::adamw(1.0)),
        (
            r#"{ name = "sgd", lr = 0.1, momentum = 0.9, nesterov = true, weight_decay = 5e-4 }"#,
            OptimizerConfig::Sgd {
                lr: 0.1,
                momentum: 0.9,
                dampening: 0.0,
                nesterov: true,
                weight_decay: 5e-4,
            },
        ),
        (
            r#"{ name = "adamw", betas = [0.8, 0.99], eps = 1e-6, weight_decay = 0.1, amsgrad = true }"#,
            OptimizerConfig::AdamW {
                lr: 1e-3,
                beta1: 0.8,
                beta2: 0.99,
                eps: 1e-6,
                weight_decay: 0.1,
                amsgrad: true,
            },
        ),
        (
            r#"{ name = "rmsprop", lr = 0.01, alpha = 0.9, momentum = 0.5, centered = true }"#,
            OptimizerConfig::RmsProp {
                lr: 0.01,
                alpha: 0.9,
                eps: 1e-8,
                weight_decay: 0.0,
                momentum: 0.5,
                centered: true,
            },
        ),
    ];
    for (table, want) in cases {
        let text = example_with(
            r#"optimizer = { name = "adam", lr = 0.001 }"#,
            &format!("optimizer = {table}"),
        );
        let job = JobSpec::from_toml(&text, dir.path()).unwrap();
        assert_eq!(job.training.optimizer, want, "{table}");
    }
}

#[test]
fn clusters_wire_dtype_and_loss_take_every_documented_value() {
    let dir = base();
    let cases = [
        ("clusters = \"auto\"", "clusters = 3"),
        ("wire_dtype = \"f32\"", "wire_dtype = \"bf16\""),
        ("loss = \"cross_entropy\"", "loss = \"mse\""),
    ];
    let job = JobSpec::from_toml(
        &cases
            .iter()
            .fold(EXAMPLE.to_string(), |t, (a, b)| t.replacen(a, b, 1)),
        dir.path(),
    )
    .unwrap();
    assert_eq!(job.training.clusters, ClusterCount::Fixed(3));
    assert_eq!(job.training.wire_dtype, WireDType::Bf16);
    assert_eq!(job.training.loss, Loss::Mse);
    let f16 = example_with("wire_dtype = \"f32\"", "wire_dtype = \"f16\"");
    assert_eq!(
        JobSpec::from_toml(&f16, dir.path())
            .unwrap()
            .training
            .wire_dtype,
        WireDType::F16
    );
    assert_eq!(
        (
            WireDType::F32.size(),
            WireDType::F16.size(),
            WireDType::Bf16.size()
        ),
        (4, 2, 2)
    );
}

#[test]
fn an_int8_wire_dtype_parses_and_round_trips_through_the_job_file_form() {
    let dir = base();
    let text = example_with("wire_dtype = \"f32\"", "wire_dtype = \"int8\"");
    let job = JobSpec::from_toml(&text, dir.path()).unwrap();
    assert_eq!(job.training.wire_dtype, WireDType::I8Block);
    let json = job.to_json().unwrap();
    assert!(json.contains(r#""wire_dtype": "int8""#), "{json}");
    let back = JobSpec::from_json(&json, Path::new("/nonexistent-base")).unwrap();
    assert_eq!(back, job);
}

#[test]
fn loss_tables_set_the_class_axis_and_ignore_index_with_torch_defaults() {
    let dir = base();
    let loss = |with: &str| {
        JobSpec::from_toml(&example_with("loss = \"cross_entropy\"", with), dir.path())
            .unwrap()
            .training
            .loss
    };
    let torch = Loss::CrossEntropy {
        class_axis: ClassAxis::Second,
        ignore_index: -100,
    };
    assert_eq!(loss("loss = \"cross_entropy\""), torch);
    assert_eq!(loss("loss = { name = \"cross_entropy\" }"), torch);
    assert_eq!(
        loss("loss = { name = \"cross_entropy\", class_axis = 1 }"),
        torch
    );
    assert_eq!(
        loss("loss = { name = \"cross_entropy\", class_axis = -1, ignore_index = -100 }"),
        Loss::CrossEntropy {
            class_axis: ClassAxis::Last,
            ignore_index: -100,
        }
    );
    assert_eq!(
        loss("loss = { name = \"cross_entropy\", ignore_index = 0 }"),
        Loss::CrossEntropy {
            class_axis: ClassAxis::Second,
            ignore_index: 0,
        }
    );
    assert_eq!(loss("loss = { name = \"mse\" }"), Loss::Mse);
    // The dashboard's form and the JSON API write the same keys.
    let json = r#"{"model": {"spec": "model.toml", "input_shape": [4]},
        "data": {"format": "npy", "train_inputs": "x.npy", "train_labels": "y.npy"},
        "training": {"batch_size": 4, "loss": {"name": "cross_entropy", "class_axis": -1}}}"#;
    let job = JobSpec::from_json(json, dir.path()).unwrap();
    assert_eq!(
        job.training.loss,
        Loss::CrossEntropy {
            class_axis: ClassAxis::Last,
            ignore_index: -100,
        }
    );
}

#[test]
fn mixed_precision_parses_round_trips_and_an_unknown_one_is_refused() {
    let dir = base();
    let plain = JobSpec::from_toml(EXAMPLE, dir.path()).unwrap();
    assert_eq!(plain.training.precision, Precision::F32);
    let text = example_with(
        "wire_dtype = \"f32\"",
        "wire_dtype = \"f32\"\nprecision = \"mixed\"",
    );
    let job = JobSpec::from_toml(&text, dir.path()).unwrap();
    assert_eq!(job.training.precision, Precision::Mixed);
    let json = job.to_json().unwrap();
    assert!(json.contains(r#""precision": "mixed""#), "{json}");
    let back = JobSpec::from_json(&json, Path::new("/nonexistent-base")).unwrap();
    assert_eq!(back, job);
    let text = example_with(
        "wire_dtype = \"f32\"",
        "wire_dtype = \"f32\"\nprecision = \"fp16\"",
    );
    let error = JobSpec::from_toml(&text, dir.path())
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("precision") && error.contains("mixed"),
        "{error}"
    );
}

#[test]
fn an_integer_wire_dtype_is_refused_naming_the_field() {
    let dir = base();
    let text = example_with("wire_dtype = \"f32\"", "wire_dtype = \"i64\"");
    let error = JobSpec::from_toml(&text, dir.path()).unwrap_err();
    assert!(
        matches!(&error, JobError::Field { field, .. } if field == "training.wire_dtype"),
        "{error}"
    );
    assert!(error.to_string().contains("not i64"), "{error}");
}

#[test]
fn aggregation_takes_every_documented_value_and_survives_json() {
    let dir = base();
    for (text, want) in [
        ("mean", Aggregation::Mean),
        ("median", Aggregation::Median),
        ("centered_clip", Aggregation::CenteredClip),
    ] {
        let toml = example_with("seed = 42", &format!("seed = 42\naggregation = \"{text}\""));
        let job = JobSpec::from_toml(&toml, dir.path()).unwrap();
        assert_eq!(job.training.aggregation, want, "{text}");
        let back = JobSpec::from_json(&job.to_json().unwrap(), dir.path()).unwrap();
        assert_eq!(back.training.aggregation, want, "{text} through JSON");
    }
}

#[test]
fn member_references_split_for_npz_and_safetensors_only() {
    let dir = base();
    let text = r#"
[model]
onnx = "cnn.onnx"
input_shape = [1, 28, 28]
[data]
format = "npz"
train_inputs = "data.npz:x_train"
train_labels = "data.npz:y_train"
test_inputs = "data.npz"
test_labels = "data.npz:y.test"
[training]
batch_size = 8
"#;
    let job = JobSpec::from_toml(text, dir.path()).unwrap();
    let npz = dir.path().join("data.npz");
    assert_eq!(job.data.train_inputs, DataRef::member(&npz, "x_train"));
    assert_eq!(
        job.data.train_labels,
        Some(DataRef::member(&npz, "y_train"))
    );
    assert_eq!(job.data.test_inputs, Some(DataRef::file(&npz)));
    assert_eq!(job.data.test_labels, Some(DataRef::member(&npz, "y.test")));
    assert_eq!(
        job.data.train_inputs.to_string(),
        format!("{}:x_train", npz.display())
    );
}

#[test]
fn to_json_round_trips_through_from_json() {
    let dir = base();
    let variants = [
        EXAMPLE.to_string(),
        example_with(
            r#"optimizer = { name = "adam", lr = 0.001 }"#,
            r#"optimizer = { name = "sgd", lr = 0.1, momentum = 0.9, dampening = 0.1 }"#,
        ),
        example_with(
            r#"optimizer = { name = "adam", lr = 0.001 }"#,
            r#"optimizer = { name = "rmsprop", centered = true }"#,
        )
        .replacen("clusters = \"auto\"", "clusters = 2", 1),
        example_with(
            r#"optimizer = { name = "adam", lr = 0.001 }"#,
            r#"optimizer = { name = "adamw" }"#,
        )
        .replacen("onnx = \"cnn.onnx\"", "spec = \"model.toml\"", 1)
        .replacen("format = \"idx\"", "format = \"safetensors\"", 1)
        .replacen("\"train-images-idx3-ubyte.gz\"", "\"data.npz:images\"", 1),
        example_with(
            "loss = \"cross_entropy\"",
            "loss = { name = \"cross_entropy\", class_axis = -1, ignore_index = 0 }",
        ),
    ];
    for text in variants {
        let job = JobSpec::from_toml(&text, dir.path()).unwrap();
        let json = job.to_json().unwrap();
        // Paths are absolute, so the base no longer matters.
        let back = JobSpec::from_json(&json, Path::new("/nonexistent-base")).unwrap();
        assert_eq!(back, job, "{json}");
    }
}

#[test]
fn from_file_reads_toml_and_json_relative_to_the_file() {
    let dir = base();
    let toml_path = dir.path().join("job.toml");
    std::fs::write(&toml_path, EXAMPLE).unwrap();
    let json_path = dir.path().join("job.json");
    std::fs::write(&json_path, EXAMPLE_JSON).unwrap();
    let a = JobSpec::from_file(&toml_path).unwrap();
    let b = JobSpec::from_file(&json_path).unwrap();
    assert_eq!(a, b);
    assert!(a.model.source.path().is_absolute());
    assert_eq!(a.model.source.path(), dir.path().join("cnn.onnx"));
    let other = dir.path().join("job.yaml");
    std::fs::write(&other, "").unwrap();
    let e = JobSpec::from_file(&other).unwrap_err().to_string();
    assert!(e.contains("job.yaml") && e.contains(".toml"), "{e}");
    let e = JobSpec::from_file(&dir.path().join("absent.toml"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("absent.toml"), "{e}");
}

/// `(what, replace, with, words the error must contain)`; `{base}` is the folder.
const INVALID: &[(&str, &str, &str, &[&str])] = &[
    (
        "both model files",
        "onnx = \"cnn.onnx\"",
        "onnx = \"cnn.onnx\"\nspec = \"model.toml\"",
        &["model", "not both"],
    ),
    (
        "no model file",
        "onnx = \"cnn.onnx\"",
        "",
        &["model", "onnx", "spec"],
    ),
    (
        "model file missing",
        "onnx = \"cnn.onnx\"",
        "onnx = \"gone.onnx\"",
        &["model.onnx", "{base}", "gone.onnx"],
    ),
    (
        "spec file missing",
        "onnx = \"cnn.onnx\"",
        "spec = \"gone.toml\"",
        &["model.spec", "gone.toml"],
    ),
    (
        "empty model path",
        "onnx = \"cnn.onnx\"",
        "onnx = \"\"",
        &["model.onnx", "empty"],
    ),
    (
        "empty input shape",
        "input_shape = [1, 28, 28]",
        "input_shape = []",
        &["model.input_shape"],
    ),
    (
        "zero dimension",
        "input_shape = [1, 28, 28]",
        "input_shape = [1, 0, 28]",
        &["model.input_shape"],
    ),
    (
        "negative dimension",
        "input_shape = [1, 28, 28]",
        "input_shape = [1, -28, 28]",
        &["model.input_shape"],
    ),
    (
        "input shape missing",
        "input_shape = [1, 28, 28]",
        "",
        &["model.input_shape", "missing"],
    ),
    (
        "unknown model field",
        "input_shape = [1, 28, 28]",
        "input_shape = [1, 28, 28]\nbatch = 3",
        &["model", "batch"],
    ),
    (
        "unknown format",
        "format = \"idx\"",
        "format = \"parquet\"",
        &[
            "data.format",
            "parquet",
            "idx",
            "npy",
            "npz",
            "safetensors",
            "csv",
        ],
    ),
    (
        "train inputs missing",
        "train_inputs = \"train-images-idx3-ubyte.gz\"",
        "train_inputs = \"nope.gz\"",
        &["data.train_inputs", "{base}", "nope.gz"],
    ),
    (
        "train labels missing",
        "train_labels = \"train-labels-idx1-ubyte.gz\"",
        "train_labels = \"nope.gz\"",
        &["data.train_labels", "nope.gz"],
    ),
    (
        "test inputs missing",
        "test_inputs  = \"t10k-images-idx3-ubyte.gz\"",
        "test_inputs = \"nope.gz\"",
        &["data.test_inputs", "nope.gz"],
    ),
    (
        "test labels missing",
        "test_labels  = \"t10k-labels-idx1-ubyte.gz\"",
        "test_labels = \"nope.gz\"",
        &["data.test_labels", "nope.gz"],
    ),
    (
        "test inputs without labels",
        "test_labels  = \"t10k-labels-idx1-ubyte.gz\"",
        "",
        &["data.test_labels"],
    ),
    (
        "test labels without inputs",
        "test_inputs  = \"t10k-images-idx3-ubyte.gz\"",
        "",
        &["data.test_inputs"],
    ),
    (
        "member on an idx file",
        "train_inputs = \"train-images-idx3-ubyte.gz\"",
        "train_inputs = \"data.npz:x\"",
        &["data.train_inputs", "data.npz:x", "npz"],
    ),
    (
        "train inputs absent",
        "train_inputs = \"train-images-idx3-ubyte.gz\"",
        "",
        &["data.train_inputs", "missing"],
    ),
    ("zero std", "std = 0.3081", "std = 0.0", &["data.std"]),
    ("negative std", "std = 0.3081", "std = -1.0", &["data.std"]),
    ("nan std", "std = 0.3081", "std = nan", &["data.std"]),
    (
        "infinite scale",
        "scale = 0.00392156862745098",
        "scale = inf",
        &["data.scale"],
    ),
    ("nan mean", "mean = 0.1307", "mean = nan", &["data.mean"]),
    (
        "mean as text",
        "mean = 0.1307",
        "mean = \"0.13\"",
        &["data.mean"],
    ),
    (
        "unknown data field",
        "std = 0.3081",
        "std = 0.3081\nshuffle = true",
        &["data", "shuffle"],
    ),
    (
        "zero epochs",
        "epochs = 2",
        "epochs = 0",
        &["training.epochs"],
    ),
    (
        "negative epochs",
        "epochs = 2",
        "epochs = -1",
        &["training.epochs"],
    ),
    (
        "epochs as text",
        "epochs = 2",
        "epochs = \"two\"",
        &["training.epochs"],
    ),
    (
        "epochs that would overflow a step counter",
        "epochs = 2",
        "epochs = 9223372036854775807",
        &["training.epochs", "at most 1000000"],
    ),
    (
        "zero batch size",
        "batch_size = 64",
        "batch_size = 0",
        &["training.batch_size"],
    ),
    (
        "batch size missing",
        "batch_size = 64",
        "",
        &["training.batch_size", "missing"],
    ),
    (
        "zero micro-batches",
        "micro_batches = 4",
        "micro_batches = 0",
        &["training.micro_batches"],
    ),
    (
        "more micro-batches than samples",
        "micro_batches = 4",
        "micro_batches = 65",
        &["training.micro_batches", "64", "65"],
    ),
    (
        "zero sync interval",
        "sync_every = 1",
        "sync_every = 0",
        &["training.sync_every"],
    ),
    (
        "class axis neither 1 nor -1",
        "loss = \"cross_entropy\"",
        "loss = { name = \"cross_entropy\", class_axis = 2 }",
        &["training.loss.class_axis", "must be 1", "-1", "got 2"],
    ),
    (
        "mse with an ignore_index",
        "loss = \"cross_entropy\"",
        "loss = { name = \"mse\", ignore_index = -100 }",
        &["training.loss.ignore_index", "mse"],
    ),
    (
        "unknown loss option",
        "loss = \"cross_entropy\"",
        "loss = { name = \"cross_entropy\", label_smoothing = 0.1 }",
        &["training.loss", "label_smoothing"],
    ),
    (
        "unknown loss in a table",
        "loss = \"cross_entropy\"",
        "loss = { name = \"hinge\" }",
        &["training.loss", "hinge", "cross_entropy", "mse"],
    ),
    (
        "unknown loss",
        "loss = \"cross_entropy\"",
        "loss = \"hinge\"",
        &["training.loss", "hinge", "cross_entropy", "mse"],
    ),
    (
        "unknown optimizer",
        "name = \"adam\"",
        "name = \"adagrad\"",
        &[
            "training.optimizer.name",
            "adagrad",
            "sgd",
            "adam",
            "adamw",
            "rmsprop",
        ],
    ),
    (
        "optimizer without name",
        "name = \"adam\", ",
        "",
        &["training.optimizer.name"],
    ),
    (
        "negative lr",
        "lr = 0.001",
        "lr = -0.1",
        &["training.optimizer.lr", "Invalid learning rate"],
    ),
    (
        "beta out of range",
        "lr = 0.001",
        "betas = [1.5, 0.9]",
        &["training.optimizer.betas"],
    ),
    (
        "three betas",
        "lr = 0.001",
        "betas = [0.9, 0.9, 0.9]",
        &["training.optimizer.betas"],
    ),
    (
        "negative eps",
        "lr = 0.001",
        "eps = -1.0",
        &["training.optimizer.eps"],
    ),
    (
        "negative weight decay",
        "lr = 0.001",
        "weight_decay = -1.0",
        &["training.optimizer.weight_decay"],
    ),
    (
        "momentum on adam",
        "lr = 0.001",
        "momentum = 0.9",
        &["training.optimizer.momentum", "adam", "betas"],
    ),
    (
        "betas on sgd",
        "name = \"adam\", lr = 0.001",
        "name = \"sgd\", betas = [0.9, 0.99]",
        &["training.optimizer.betas", "sgd"],
    ),
    (
        "nesterov without momentum",
        "name = \"adam\", lr = 0.001",
        "name = \"sgd\", nesterov = true",
        &["training.optimizer.nesterov"],
    ),
    (
        "negative momentum",
        "name = \"adam\", lr = 0.001",
        "name = \"sgd\", momentum = -0.5",
        &["training.optimizer.momentum"],
    ),
    (
        "negative alpha",
        "name = \"adam\", lr = 0.001",
        "name = \"rmsprop\", alpha = -0.5",
        &["training.optimizer.alpha"],
    ),
    (
        "unknown optimizer field",
        "lr = 0.001",
        "lr = 0.001, gamma = 0.1",
        &["training.optimizer", "gamma"],
    ),
    (
        "lr as text",
        "lr = 0.001",
        "lr = \"fast\"",
        &["training.optimizer.lr"],
    ),
    (
        "zero clusters",
        "clusters = \"auto\"",
        "clusters = 0",
        &["training.clusters"],
    ),
    (
        "negative clusters",
        "clusters = \"auto\"",
        "clusters = -2",
        &["training.clusters"],
    ),
    (
        "clusters as a word",
        "clusters = \"auto\"",
        "clusters = \"many\"",
        &["training.clusters", "auto"],
    ),
    (
        "shuffle as text",
        "shuffle = true",
        "shuffle = \"yes\"",
        &["training.shuffle"],
    ),
    (
        "negative seed",
        "seed = 42",
        "seed = -1",
        &["training.seed"],
    ),
    (
        "unknown wire dtype",
        "wire_dtype = \"f32\"",
        "wire_dtype = \"f8\"",
        &["training.wire_dtype", "f32", "f16", "bf16"],
    ),
    (
        "unknown aggregation",
        "seed = 42",
        "seed = 42\naggregation = \"trimmed_mean\"",
        &["training.aggregation", "mean", "median", "centered_clip"],
    ),
    (
        "unknown schedule",
        "wire_dtype = \"f32\"",
        "wire_dtype = \"f32\"\n[training.lr_schedule]\nkind = \"onecycle\"",
        &["training.lr_schedule.kind", "onecycle", "cosine", "step"],
    ),
    (
        "schedule field of another kind",
        "wire_dtype = \"f32\"",
        "wire_dtype = \"f32\"\n[training.lr_schedule]\nkind = \"step\"\nstep_size = 3\nmin_lr = 0.1",
        &["training.lr_schedule.min_lr", "step_size, gamma"],
    ),
    (
        "step schedule without step_size",
        "wire_dtype = \"f32\"",
        "wire_dtype = \"f32\"\n[training.lr_schedule]\nkind = \"step\"",
        &["training.lr_schedule.step_size"],
    ),
    (
        "warm-up longer than the schedule",
        "wire_dtype = \"f32\"",
        "wire_dtype = \"f32\"\n[training.lr_schedule]\nkind = \"linear\"\nwarmup_steps = 20\ntotal_steps = 10",
        &["training.lr_schedule.warmup_steps", "20", "10"],
    ),
    (
        "min_lr above lr",
        "wire_dtype = \"f32\"",
        "wire_dtype = \"f32\"\n[training.lr_schedule]\nkind = \"cosine\"\nmin_lr = 0.5",
        &["training.lr_schedule.min_lr", "0.001"],
    ),
    (
        "negative gamma",
        "wire_dtype = \"f32\"",
        "wire_dtype = \"f32\"\n[training.lr_schedule]\nkind = \"step\"\nstep_size = 3\ngamma = -0.5",
        &["training.lr_schedule.gamma"],
    ),
    (
        "zero clip norm",
        "seed = 42",
        "seed = 42\nclip_grad_norm = 0.0",
        &["training.clip_grad_norm"],
    ),
    (
        "unknown training field",
        "seed = 42",
        "seed = 42\nlr = 0.1",
        &["training", "lr"],
    ),
    (
        "unknown section",
        "[training]",
        "[extra]\nx = 1\n[training]",
        &["extra"],
    ),
    (
        "training section missing",
        "[training]",
        "[ignored]",
        &["ignored"],
    ),
    (
        "TOML syntax",
        "epochs = 2",
        "epochs = = 2",
        &["TOML", "line 15"],
    ),
];

#[test]
fn every_invalid_field_is_an_error_naming_it() {
    let dir = base();
    let shown_base = dir.path().display().to_string();
    for (what, replace, with, words) in INVALID {
        let text = example_with(replace, with);
        let err = match JobSpec::from_toml(&text, dir.path()) {
            Ok(_) => panic!("{what}: parsed"),
            Err(e) => e.to_string(),
        };
        for w in *words {
            let w = w.replace("{base}", &shown_base);
            assert!(err.contains(&w), "{what}: `{w}` not in: {err}");
        }
        assert!(!err.contains('\n'), "{what}: one line: {err}");
    }
}

#[test]
fn sizes_from_a_job_file_that_would_overflow_are_refused_by_field() {
    let dir = base();
    let huge = u64::MAX.to_string();
    let cases = [
        (
            "input_shape = [1, 28, 28]",
            format!("input_shape = [{huge}, {huge}]"),
            "model.input_shape",
        ),
        (
            "input_shape = [1, 28, 28]",
            "input_shape = [65536, 65536, 65536]".into(),
            "model.input_shape",
        ),
        (
            "batch_size = 64",
            format!("batch_size = {huge}"),
            "training.batch_size",
        ),
        (
            "batch_size = 64",
            "batch_size = 100000000".into(),
            "training.batch_size",
        ),
    ];
    for (replace, with, field) in cases {
        assert!(EXAMPLE.contains(replace), "{replace}");
        let text = EXAMPLE.replacen(replace, &with, 1);
        match JobSpec::from_toml(&text, dir.path()) {
            Err(JobError::Field { field: f, .. }) if f == field => {}
            other => panic!("{with}: {other:?}"),
        }
    }
}

#[test]
fn invalid_json_fields_name_the_field_too() {
    let dir = base();
    let cases: &[(&str, &str, &[&str])] = &[
        ("\"epochs\": 2", "\"epochs\": \"two\"", &["training.epochs"]),
        ("\"epochs\": 2", "\"epochs\": 0", &["training.epochs"]),
        (
            "\"format\": \"idx\"",
            "\"format\": \"hdf5\"",
            &["data.format", "npz"],
        ),
        (
            "\"lr\": 0.001",
            "\"lr\": \"fast\"",
            &["training.optimizer.lr"],
        ),
        (
            "\"lr\": 0.001",
            "\"lr\": 0.001, \"x\": 1",
            &["training.optimizer", "x"],
        ),
        (
            "\"seed\": 42",
            "\"seed\": 42, \"extra\": 1",
            &["training", "extra"],
        ),
        (
            "\"clusters\": \"auto\"",
            "\"clusters\": 2.5",
            &["training.clusters"],
        ),
        (
            "\"input_shape\": [1, 28, 28]",
            "\"input_shape\": \"1,28,28\"",
            &["model.input_shape"],
        ),
        ("\"seed\": 42", "\"seed\": 42,", &["JSON"]),
        ("\"epochs\": 2,", "\"epochs\": 2,,", &["JSON"]),
    ];
    for (replace, with, words) in cases {
        assert!(EXAMPLE_JSON.contains(replace), "{replace}");
        let text = EXAMPLE_JSON.replacen(replace, with, 1);
        let err = match JobSpec::from_json(&text, dir.path()) {
            Ok(_) => panic!("{with}: parsed"),
            Err(e) => e.to_string(),
        };
        for w in *words {
            assert!(err.contains(w), "{with}: `{w}` not in: {err}");
        }
    }
    let trailing = format!("{EXAMPLE_JSON} {{}}");
    assert!(matches!(
        JobSpec::from_json(&trailing, dir.path()),
        Err(JobError::Syntax { .. })
    ));
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn load_model_uses_input_shape_and_micro_batch_size() {
    let dir = base();
    let spec_model = repo().join("examples/mnist-cnn.toml");
    let text = example_with(
        "onnx = \"cnn.onnx\"",
        &format!("spec = {:?}", spec_model.display().to_string()),
    );
    let job = JobSpec::from_toml(&text, dir.path()).unwrap();
    let loaded = job.load_model().unwrap();
    // A layer spec is analysed at its own example batch; the sample shape is the job's.
    assert_eq!(loaded.graph.inputs[0].shape[1..], [1, 28, 28]);
    let a = loaded.graph.analyze().unwrap();
    assert_eq!(a.shape(&loaded.graph.outputs[0]).unwrap()[1..], [10]);

    let onnx = repo().join("shared/model/fixtures/cnn.legacy.onnx");
    let text = example_with(
        "onnx = \"cnn.onnx\"",
        &format!("onnx = {:?}", onnx.display().to_string()),
    )
    .replacen("input_shape = [1, 28, 28]", "input_shape = [3, 16, 16]", 1)
    .replacen("micro_batches = 4", "micro_batches = 8", 1);
    let job = JobSpec::from_toml(&text, dir.path()).unwrap();
    let loaded = job.load_model().unwrap();
    assert_eq!(loaded.graph.inputs[0].shape, [8, 3, 16, 16]);
    let a = loaded.graph.analyze().unwrap();
    assert_eq!(a.shape(&loaded.graph.outputs[0]).unwrap(), [8, 10]);

    // An unreadable model file is an error naming it.
    let text = example_with("onnx = \"cnn.onnx\"", "spec = \"model.toml\"");
    let job = JobSpec::from_toml(&text, dir.path()).unwrap();
    let e = job.load_model().unwrap_err().to_string();
    assert!(e.contains("model.toml"), "{e}");
}

#[test]
fn an_uploaded_job_file_names_only_files_inside_the_upload() {
    let dir = base();
    // Either form is read, and plain relative names resolve inside the upload.
    let toml = JobSpec::from_upload(EXAMPLE, dir.path()).unwrap();
    assert_eq!(
        toml,
        JobSpec::from_upload(EXAMPLE_JSON, dir.path()).unwrap()
    );
    assert_eq!(
        toml.model.source,
        ModelSource::Onnx(dir.path().join("cnn.onnx"))
    );
    let outside = dir.path().join("cnn.onnx").display().to_string();
    let cases = [
        ("\"cnn.onnx\"", format!("\"{outside}\""), "model.onnx"),
        ("\"cnn.onnx\"", "\"../cnn.onnx\"".into(), "model.onnx"),
        ("\"cnn.onnx\"", "\"./cnn.onnx\"".into(), "model.onnx"),
        (
            "\"train-images-idx3-ubyte.gz\"",
            "\"/etc/passwd\"".into(),
            "data.train_inputs",
        ),
        (
            "\"t10k-labels-idx1-ubyte.gz\"",
            "\"a/../../t10k-labels-idx1-ubyte.gz\"".into(),
            "data.test_labels",
        ),
    ];
    for (replace, with, field) in cases {
        let text = example_with(replace, &with);
        // The same file is fine on the Requester's own machine...
        if with.contains("cnn.onnx") && !with.contains("..") {
            JobSpec::from_toml(&text, dir.path()).unwrap();
        }
        // ...but not in an upload, and the check comes before any file is touched.
        let error = JobSpec::from_upload(&text, dir.path()).unwrap_err();
        assert!(
            matches!(&error, JobError::Field { field: f, .. } if f == field),
            "{with}: {error}"
        );
        assert!(error.to_string().contains("uploaded file"), "{error}");
    }
}
