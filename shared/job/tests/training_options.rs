//! The training options that reach past one cluster's steps: Ravnest's
//! `val_every` (`val_freq`) and `average_optimizer` (`average_optim`), and
//! `[training.sync]`, the sync period and DiLoCo's outer optimizer. Each
//! parses under its names with its defaults, survives the JSON form, and is
//! refused naming its field when it contradicts itself or the job.
#![allow(clippy::unwrap_used)]

use rookery_job::JobSpec;

mod common;

use common::example::{base, example_with};

#[test]
fn ravnests_val_every_and_average_optimizer_parse_under_both_names_and_survive_json() {
    let dir = base();
    let default = JobSpec::from_toml(&example_with("", ""), dir.path()).unwrap();
    assert_eq!(default.training.val_every, None);
    assert!(!default.training.average_optimizer);
    for extra in [
        "val_every = 50\naverage_optimizer = true",
        "val_freq = 50\naverage_optim = true",
    ] {
        let toml = example_with("seed = 42", &format!("seed = 42\n{extra}"));
        let job = JobSpec::from_toml(&toml, dir.path()).unwrap();
        assert_eq!(job.training.val_every, Some(50), "{extra}");
        assert!(job.training.average_optimizer, "{extra}");
        let back = JobSpec::from_json(&job.to_json().unwrap(), dir.path()).unwrap();
        assert_eq!(back.training, job.training, "{extra} through JSON");
    }
}

#[test]
fn a_sync_table_sets_the_period_and_diloco_outer_optimizer_with_torch_defaults() {
    use rookery_job::OuterOptimizer;
    let dir = base();
    let cases = [
        ("", None, 1, false),
        (
            "[training.sync]\nevery = 50\nouter_optimizer = { name = \"nesterov\", lr = 0.7 }",
            Some(OuterOptimizer {
                lr: 0.7,
                momentum: 0.9,
                nesterov: true,
            }),
            50,
            false,
        ),
        (
            "[training.sync]\nouter_optimizer = { name = \"sgd\", lr = 1.0 }\ncompress = \"none\"",
            Some(OuterOptimizer {
                lr: 1.0,
                momentum: 0.0,
                nesterov: false,
            }),
            1,
            false,
        ),
        (
            "[training.sync]\nevery = 5\ncompress = \"int8\"",
            None,
            5,
            true,
        ),
    ];
    for (table, want, every, int8) in cases {
        let toml = example_with("sync_every = 1\n", "").replace(
            "wire_dtype = \"f32\"           # f32 | f16 | bf16\n",
            &format!("wire_dtype = \"f32\"\n{table}\n"),
        );
        let job = JobSpec::from_toml(&toml, dir.path()).unwrap();
        assert_eq!(job.training.outer_optimizer, want, "{table}");
        assert_eq!(job.training.sync_every, every, "{table}");
        assert_eq!(job.training.sync_int8, int8, "{table}");
        let back = JobSpec::from_json(&job.to_json().unwrap(), dir.path()).unwrap();
        assert_eq!(back.training, job.training, "{table} through JSON");
    }
    assert!(
        OuterOptimizer {
            lr: 1.0,
            momentum: 0.0,
            nesterov: false
        }
        .is_plain_average()
    );
}

#[test]
fn a_sync_table_that_contradicts_itself_or_names_the_unknown_is_refused_naming_the_field() {
    let dir = base();
    for (table, words) in [
        ("every = 5", &["training.sync.every", "sync_every"][..]),
        (
            "outer_optimizer = { name = \"adam\", lr = 0.7 }",
            &["training.sync.outer_optimizer.name", "adam"],
        ),
        (
            "outer_optimizer = { name = \"sgd\", lr = 0.0 }",
            &["training.sync.outer_optimizer.lr"],
        ),
        (
            "outer_optimizer = { name = \"nesterov\", lr = 0.7, momentum = 0.0 }",
            &["training.sync.outer_optimizer.momentum"],
        ),
        ("compress = \"int4\"", &["training.sync.compress", "int4"]),
    ] {
        let toml = format!("{}\n[training.sync]\n{table}\n", example_with("", ""));
        let err = JobSpec::from_toml(&toml, dir.path())
            .unwrap_err()
            .to_string();
        for word in words {
            assert!(err.contains(word), "{table}: {err}");
        }
    }
}

#[test]
fn val_every_without_test_data_or_of_zero_is_refused_naming_the_field() {
    let dir = base();
    let zero = example_with("seed = 42", "seed = 42\nval_every = 0");
    let err = JobSpec::from_toml(&zero, dir.path())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("training.val_every") && err.contains("at least 1"),
        "{err}"
    );
    let no_test = example_with("seed = 42", "seed = 42\nval_every = 10")
        .lines()
        .filter(|l| !l.starts_with("test_"))
        .collect::<Vec<_>>()
        .join("\n");
    let err = JobSpec::from_toml(&no_test, dir.path())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("training.val_every") && err.contains("test"),
        "{err}"
    );
}

#[test]
fn the_pipeline_schedule_defaults_to_gpipe_takes_1f1b_and_async_and_refuses_the_unknown_by_name() {
    use rookery_job::PipelineSchedule;
    let dir = base();
    let default = JobSpec::from_toml(&example_with("", ""), dir.path()).unwrap();
    assert_eq!(default.training.schedule, PipelineSchedule::Gpipe);
    for (line, want) in [
        ("schedule = \"gpipe\"", PipelineSchedule::Gpipe),
        (
            "schedule = \"1f1b\"",
            PipelineSchedule::OneForwardOneBackward,
        ),
        ("schedule = \"async\"", PipelineSchedule::Async),
    ] {
        let toml = example_with("seed = 42", &format!("seed = 42\n{line}"));
        let job = JobSpec::from_toml(&toml, dir.path()).unwrap();
        assert_eq!(job.training.schedule, want, "{line}");
        let back = JobSpec::from_json(&job.to_json().unwrap(), dir.path()).unwrap();
        assert_eq!(back.training, job.training, "{line} through JSON");
    }
    let toml = example_with("seed = 42", "seed = 42\nschedule = \"pipedream\"");
    let err = JobSpec::from_toml(&toml, dir.path())
        .unwrap_err()
        .to_string();
    for word in ["schedule", "pipedream", "gpipe", "1f1b", "async"] {
        assert!(err.contains(word), "{err}");
    }
}

#[test]
fn the_async_schedule_refuses_clipping_and_spot_checks_by_name() {
    let dir = base();
    for (extra, field) in [
        ("clip_grad_norm = 1.0", "training.clip_grad_norm"),
        ("[training.verify]\nrate = 0.1", "training.verify"),
    ] {
        let toml = example_with(
            "wire_dtype = \"f32\"",
            &format!("wire_dtype = \"f32\"\nschedule = \"async\"\n{extra}"),
        );
        let err = JobSpec::from_toml(&toml, dir.path())
            .unwrap_err()
            .to_string();
        assert!(err.contains(field) && err.contains("async"), "{err}");
        let gpipe = toml.replace("\"async\"", "\"gpipe\"");
        JobSpec::from_toml(&gpipe, dir.path()).unwrap();
    }
}

#[test]
fn an_async_job_syncs_every_ten_steps_unless_told_and_others_every_step() {
    let dir = base();
    let with = |extra: &str| {
        let toml = example_with("sync_every = 1\n", extra);
        JobSpec::from_toml(&toml, dir.path())
            .unwrap()
            .training
            .sync_every
    };
    assert_eq!(
        with("schedule = \"async\"\n"),
        rookery_job::ASYNC_SYNC_EVERY
    );
    assert_eq!(with("schedule = \"async\"\nsync_every = 3\n"), 3);
    assert_eq!(with("schedule = \"1f1b\"\n"), 1);
    assert_eq!(with(""), 1);
}
