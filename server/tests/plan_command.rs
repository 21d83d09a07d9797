//! `rookery plan` as a person runs it: the real binary on the example files.

#![allow(clippy::unwrap_used)] // Test helpers fail loudly by design.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

fn rookery_plan(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rookery"))
        .arg("plan")
        .args(args)
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn the_example_model_plans_as_a_table_and_as_json() {
    let model = examples().join("mnist-cnn.toml");
    let providers = examples().join("providers.json");
    let common = [
        "--model",
        model.to_str().unwrap(),
        "--providers",
        providers.to_str().unwrap(),
    ];

    let table = rookery_plan(&common);
    assert!(table.status.success(), "{}", text(&table.stderr));
    let table = text(&table.stdout);
    assert!(table.starts_with("Plan: "), "{table}");
    assert!(table.contains("Cluster 0"), "{table}");

    let mut args = common.to_vec();
    args.extend(["--clusters", "2", "--micro-batch", "8", "--json"]);
    let json = rookery_plan(&args);
    assert!(json.status.success(), "{}", text(&json.stderr));
    let plan: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    let clusters = plan["clusters"].as_array().unwrap();
    assert_eq!(clusters.len(), 2);
    assert_eq!(plan["options"]["micro_batch"], 8);
    // Every provider is used once: in a cluster's stages or as a standby.
    let mut used: Vec<String> = clusters
        .iter()
        .flat_map(|c| c["stages"].as_array().unwrap())
        .map(|s| s["provider"].as_str().unwrap().to_owned())
        .chain(
            plan["standbys"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s.as_str().unwrap().to_owned()),
        )
        .collect();
    used.sort();
    assert_eq!(
        used,
        [
            "laptop",
            "office-tab",
            "old-desktop",
            "phone-tab",
            "workstation"
        ]
    );
}

#[test]
fn impossible_plans_and_bad_files_fail_with_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = dir.path().join("tiny.json");
    std::fs::write(
        &tiny,
        r#"[{"id":"watch","kind":"browser","memory_gb":0.0001,"gflops":1,"bandwidth_mbps":1}]"#,
    )
    .unwrap();
    // Plenty of memory, but it binds 1 KiB at most: the CNN's first conv weight is larger.
    let narrow = dir.path().join("narrow.json");
    std::fs::write(
        &narrow,
        r#"[{"id":"tab","kind":"browser","memory_gb":4,"gflops":10,"bandwidth_mbps":100,"max_buffer_mb":0.001}]"#,
    )
    .unwrap();
    let negative = dir.path().join("negative.json");
    std::fs::write(
        &negative,
        r#"[{"id":"tab","kind":"browser","memory_gb":4,"gflops":10,"bandwidth_mbps":100,"max_buffer_mb":-1}]"#,
    )
    .unwrap();
    let model = examples().join("mnist-cnn.toml");
    let cases: [(Vec<&str>, &str); 6] = [
        (
            vec![
                "--model",
                model.to_str().unwrap(),
                "--providers",
                narrow.to_str().unwrap(),
            ],
            "the largest buffer any provider can bind is 1048 bytes (`tab`)",
        ),
        (
            vec![
                "--model",
                model.to_str().unwrap(),
                "--providers",
                negative.to_str().unwrap(),
            ],
            "max_buffer_mb must be a positive number",
        ),
        (
            vec![
                "--model",
                model.to_str().unwrap(),
                "--providers",
                tiny.to_str().unwrap(),
            ],
            "no plan fits",
        ),
        (
            vec![
                "--model",
                "missing.toml",
                "--providers",
                tiny.to_str().unwrap(),
            ],
            "missing.toml: cannot read the file",
        ),
        (
            vec![
                "--model",
                model.to_str().unwrap(),
                "--providers",
                tiny.to_str().unwrap(),
                "--input-shape",
                "1,x",
            ],
            "positive whole numbers",
        ),
        (
            vec![
                "--model",
                model.to_str().unwrap(),
                "--providers",
                tiny.to_str().unwrap(),
                "--clusters",
                "0",
            ],
            "positive number",
        ),
    ];
    for (args, expected) in cases {
        let output = rookery_plan(&args);
        assert!(!output.status.success(), "{args:?} succeeded");
        let stderr = text(&output.stderr);
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        assert!(!stderr.contains("backtrace"), "{stderr}");
    }
}
