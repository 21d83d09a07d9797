//! Job preparation: a job whose model and data fit is read in full; one
//! whose files do not fit says which field or file is wrong, and a test set
//! that does not fit the model says it is the test set.
// Helpers outside #[test] fns panic on purpose too: a panic is a test failure.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;

use common::{f32_le, i64_le, npy, write};
use rookery_job::{JobSpec, prepare};

const MODEL: &str = r#"
input_shape = [4]
[[layers]]
type = "Dense"
units = 3
"#;

/// A job over `model.toml` and `.npy` files in `dir`: 8 training samples of
/// 4 features, and a test set of 2 samples of `test_width` features.
fn job(dir: &Path, test_width: usize) -> JobSpec {
    write(dir, "model.toml", MODEL.as_bytes());
    let inputs = |n: usize, width: usize| {
        let values: Vec<f32> = (0..n * width).map(|i| i as f32 / 10.0).collect();
        npy("<f4", &format!("({n}, {width})"), &f32_le(&values))
    };
    let labels = |n: usize| npy("<i8", &format!("({n},)"), &i64_le(&vec![1; n]));
    write(dir, "x.npy", &inputs(8, 4));
    write(dir, "y.npy", &labels(8));
    write(dir, "tx.npy", &inputs(2, test_width));
    write(dir, "ty.npy", &labels(2));
    let text = r#"
[model]
spec = "model.toml"
input_shape = [4]
[data]
format = "npy"
train_inputs = "x.npy"
train_labels = "y.npy"
test_inputs = "tx.npy"
test_labels = "ty.npy"
[training]
epochs = 1
batch_size = 4
micro_batches = 2
optimizer = { name = "sgd", lr = 0.1 }
"#;
    JobSpec::from_toml(text, dir).unwrap()
}

#[test]
fn a_job_whose_model_and_data_fit_is_read_in_full() {
    let dir = tempfile::tempdir().unwrap();
    let prepared = prepare(job(dir.path(), 4)).unwrap();
    assert_eq!(prepared.train.len(), 8);
    assert_eq!(prepared.test.as_ref().map(|t| t.len()), Some(2));
    assert_eq!(prepared.graph.inputs.len(), 1);
    assert!(!prepared.analysis.nodes.is_empty());
}

#[test]
fn a_test_set_that_does_not_fit_the_model_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let error = prepare(job(dir.path(), 5)).unwrap_err();
    assert!(error.message.starts_with("test set: "), "{error}");
}

#[test]
fn a_missing_file_is_named_as_the_field_it_concerns() {
    let dir = tempfile::tempdir().unwrap();
    let spec = job(dir.path(), 4);
    std::fs::remove_file(dir.path().join("y.npy")).unwrap();
    let error = prepare(spec).unwrap_err();
    let field = error.field.clone().unwrap_or_default();
    assert!(field.contains("y.npy"), "{error}: {field}");
}

#[test]
fn a_class_out_of_range_is_refused_naming_the_labels_file() {
    let dir = tempfile::tempdir().unwrap();
    let spec = job(dir.path(), 4);
    // -100 is the ignore_index, so it passes; 3 is not a class of [batch, 3].
    let labels = [0, 1, -100, 2, 0, 3, 1, 1];
    write(dir.path(), "y.npy", &npy("<i8", "(8,)", &i64_le(&labels)));
    let error = prepare(spec).unwrap_err();
    let field = error.field.clone().unwrap_or_default();
    assert!(field.ends_with("y.npy"), "{error}: {field}");
    assert!(
        error.message.contains("label 3 at sample 5") && error.message.contains("0..=2"),
        "{error}"
    );
}

#[test]
fn per_token_labels_that_do_not_fit_the_logits_name_the_labels_file() {
    let dir = tempfile::tempdir().unwrap();
    let spec = job(dir.path(), 4);
    write(
        dir.path(),
        "ty.npy",
        &npy("<i8", "(2, 3)", &i64_le(&[0; 6])),
    );
    let error = prepare(spec).unwrap_err();
    assert!(
        error.message.starts_with("test set: ")
            && error.message.contains("ty.npy")
            && error.message.contains("[3]")
            && error.message.contains("needs []"),
        "{error}"
    );
}
