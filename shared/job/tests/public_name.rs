//! A job's `public_name`, the name donors may see while their tab trains
//! it: optional (a job without one is private), kept through the JSON
//! form, and refused, naming the field, when blank, longer than
//! `MAX_PUBLIC_NAME_CHARS` characters or holding control characters.
#![allow(clippy::unwrap_used)]

use rookery_job::{JobError, JobSpec, MAX_PUBLIC_NAME_CHARS};

mod common;

use common::example::base;

const JOB: &str = r#"
[model]
spec = "model.toml"
input_shape = [4]
[data]
format = "npy"
train_inputs = "x.npy"
train_labels = "y.npy"
[training]
batch_size = 8
"#;

/// The job with `public_name` set to `name` (a TOML string), above the
/// first table as TOML wants a top-level key.
fn named(name: &str) -> String {
    format!("public_name = {name}\n{JOB}")
}

#[test]
fn a_job_without_a_public_name_is_private() {
    let dir = base();
    let spec = JobSpec::from_toml(JOB, dir.path()).unwrap();
    assert_eq!(spec.public_name, None);
    assert!(!spec.to_json().unwrap().contains("public_name"));
}

#[test]
fn a_public_name_is_kept_through_toml_and_json() {
    let dir = base();
    let spec =
        JobSpec::from_toml(&named("\"Handwritten digits for the Lab\""), dir.path()).unwrap();
    assert_eq!(
        spec.public_name.as_deref(),
        Some("Handwritten digits for the Lab")
    );
    let back = JobSpec::from_json(&spec.to_json().unwrap(), dir.path()).unwrap();
    assert_eq!(back, spec);
    // Exactly the longest allowed, in characters (not bytes).
    let longest = "é".repeat(MAX_PUBLIC_NAME_CHARS);
    let spec = JobSpec::from_toml(&named(&format!("\"{longest}\"")), dir.path()).unwrap();
    assert_eq!(spec.public_name.as_deref(), Some(longest.as_str()));
}

#[test]
fn a_public_name_too_long_blank_or_with_control_characters_is_refused_naming_the_field() {
    let dir = base();
    let too_long = format!("\"{}\"", "a".repeat(MAX_PUBLIC_NAME_CHARS + 1));
    for (name, says) in [
        (too_long.as_str(), "at most 80"),
        ("\"  \"", "blank"),
        ("\"\"", "blank"),
        ("\"digits\\nfor the Lab\"", "control characters"),
        ("\"digits\\u0007\"", "control characters"),
        ("\"tab\\there\"", "control characters"),
    ] {
        match JobSpec::from_toml(&named(name), dir.path()) {
            Err(JobError::Field { field, reason }) => {
                assert_eq!(field, "public_name", "{name}: {reason}");
                assert!(reason.contains(says), "{name}: {reason}");
            }
            other => panic!("{name} was not refused as public_name: {other:?}"),
        }
    }
    // The JSON form is checked the same way.
    let json = JobSpec::from_toml(JOB, dir.path())
        .unwrap()
        .to_json()
        .unwrap()
        .replacen('{', "{\"public_name\": \"a\\u0000b\",", 1);
    assert!(matches!(
        JobSpec::from_json(&json, dir.path()),
        Err(JobError::Field { field, .. }) if field == "public_name"
    ));
}
