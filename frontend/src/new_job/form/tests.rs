use super::*;
use serde_json::json;

fn filled() -> FormValues {
    FormValues {
        text: defaults(),
        files: [
            ("model-file", "mlp.onnx"),
            ("train-inputs", "train-images.gz"),
            ("train-labels", "train-labels.gz"),
        ]
        .into_iter()
        .map(|(k, v)| (k, v.to_string()))
        .collect(),
    }
}

/// A GPT's form: token files, classes last, cosine with warm-up, clipping.
fn filled_tokens() -> FormValues {
    let mut values = filled();
    values.files.insert("model-file", "gpt.onnx".into());
    values.files.insert("train-inputs", "train.u16".into());
    values.files.insert("test-inputs", "test.u16".into());
    // Left by an earlier choice of format: tokens must ignore them.
    values.files.insert("test-labels", "test-labels.gz".into());
    for (id, value) in [
        ("data-format", "tokens"),
        ("input-shape", "64"),
        ("seq-len", "64"),
        ("token-dtype", "u16"),
        ("class-axis", "-1"),
        ("ignore-index", "-100"),
        ("lr-schedule", "cosine"),
        ("warmup-steps", "10"),
        ("min-lr", "0.0001"),
        // Another kind's field, which a cosine schedule must not send.
        ("step-size", "5"),
        ("clip-grad-norm", "1.0"),
        ("val-every", "50"),
    ] {
        values.text.insert(id, value.into());
    }
    values
}

fn error_ids(errors: &FieldErrors) -> Vec<&str> {
    errors.keys().map(String::as_str).collect()
}

/// The job file read back by the server's own parser, with every file
/// it names present as an empty file in a fresh folder (natively only:
/// a browser has no folders).
#[cfg(not(target_arch = "wasm32"))]
fn parse_on_server(job: &JobFile) -> Result<rookery_job::JobSpec, rookery_job::JobError> {
    let dir = tempfile::tempdir().unwrap();
    for name in [
        Some(&job.data.train_inputs),
        job.data.train_labels.as_ref(),
        job.data.test_inputs.as_ref(),
        job.data.test_labels.as_ref(),
        job.model.onnx.as_ref(),
        job.model.spec.as_ref(),
    ]
    .into_iter()
    .flatten()
    {
        std::fs::write(dir.path().join(name), b"").unwrap();
    }
    rookery_job::JobSpec::from_upload(&serde_json::to_string(job).unwrap(), dir.path())
}

#[test]
fn a_filled_form_becomes_a_job_file() {
    let job = serde_json::to_value(build_job(&filled()).unwrap()).unwrap();
    assert_eq!(job["model"]["onnx"], "mlp.onnx");
    assert_eq!(job["model"]["input_shape"], json!([1, 28, 28]));
    assert_eq!(job["data"]["train_labels"], "train-labels.gz");
    assert!(job["data"].get("test_inputs").is_none());
    assert_eq!(
        job["training"]["optimizer"],
        json!({ "name": "adam", "lr": 0.001 })
    );
    assert_eq!(job["training"]["clusters"], 1);
    assert!(job["training"].get("stages").is_none(), "auto stages");
    // Torch's defaults stay out of the file: the plain loss name, no
    // schedule, no clipping.
    assert_eq!(job["training"]["loss"], "cross_entropy");
    assert!(job["training"].get("lr_schedule").is_none());
    assert!(
        job["training"].get("val_every").is_none(),
        "evaluated per epoch"
    );
    assert!(job["training"].get("clip_grad_norm").is_none());
    assert!(job.get("public_name").is_none(), "private unless named");
    let mut named = filled();
    named
        .text
        .insert("public-name", " Digits for the Lab ".into());
    let job = build_job(&named).unwrap();
    assert_eq!(job.public_name.as_deref(), Some("Digits for the Lab"));
    let mut spec = filled();
    spec.files.insert("model-file", "cnn.toml".into());
    spec.text.insert("stages", "3".into());
    let job = serde_json::to_value(build_job(&spec).unwrap()).unwrap();
    assert_eq!(job["model"]["spec"], "cnn.toml");
    assert_eq!(job["training"]["stages"], 3);
    assert_eq!(job_file_name(&spec), "cnn.json");
    assert_eq!(job_file_name(&FormValues::default()), "job.json");
}

#[cfg(not(target_arch = "wasm32"))]
#[test]
fn a_public_name_the_server_refuses_is_shown_at_its_input() {
    let mut long = filled();
    long.text.insert("public-name", "x".repeat(81));
    let refused = parse_on_server(&build_job(&long).unwrap()).unwrap_err();
    let rookery_job::JobError::Field { field, .. } = refused else {
        panic!("{refused:?}")
    };
    assert_eq!(input_for(&field, &long), Some("public-name"));
}

#[test]
fn a_filled_token_form_becomes_a_token_job_with_its_loss_schedule_and_clipping() {
    let job = serde_json::to_value(build_job(&filled_tokens()).unwrap()).unwrap();
    assert_eq!(
        job["data"],
        json!({
            "format": "tokens",
            "train_inputs": "train.u16",
            "test_inputs": "test.u16",
            "seq_len": 64,
            "token_dtype": "u16",
        }),
        "no labels files and no scaling for token ids"
    );
    assert_eq!(
        job["training"]["loss"],
        json!({ "name": "cross_entropy", "class_axis": -1, "ignore_index": -100 })
    );
    assert_eq!(
        job["training"]["lr_schedule"],
        json!({ "kind": "cosine", "warmup_steps": 10, "min_lr": 0.0001 }),
        "only the cosine schedule's fields"
    );
    assert_eq!(job["training"]["clip_grad_norm"], 1.0);
    assert_eq!(job["training"]["val_every"], 50);
}

#[test]
fn the_sync_options_become_ravnests_and_dilocos_fields_and_stay_out_by_default() {
    let job = serde_json::to_value(build_job(&filled()).unwrap()).unwrap();
    assert!(job["training"].get("sync").is_none(), "plain averaging");
    assert!(job["training"].get("average_optimizer").is_none());
    let mut values = filled();
    for (id, value) in [
        ("average-optimizer", "yes"),
        ("outer-optimizer", "nesterov"),
        ("outer-lr", "0.7"),
        ("outer-momentum", "0.9"),
        ("sync-compress", "int8"),
        ("sync-every", "50"),
        ("schedule", "1f1b"),
    ] {
        values.text.insert(id, value.into());
    }
    let job = serde_json::to_value(build_job(&values).unwrap()).unwrap();
    assert_eq!(job["training"]["average_optimizer"], true);
    assert_eq!(job["training"]["schedule"], "1f1b");
    assert_eq!(job["training"]["sync_every"], 50);
    assert_eq!(
        job["training"]["sync"],
        json!({
            "outer_optimizer": { "name": "nesterov", "lr": 0.7, "momentum": 0.9 },
            "compress": "int8",
        })
    );
    #[cfg(not(target_arch = "wasm32"))]
    {
        let spec = parse_on_server(&build_job(&values).unwrap()).unwrap();
        assert!(spec.training.sync_int8 && spec.training.average_optimizer);
        assert_eq!(spec.training.sync_every, 50);
    }
    values.text.insert("outer-lr", String::new());
    let errors = build_job(&values).unwrap_err();
    assert_eq!(error_ids(&errors), ["outer-lr"]);
}

#[test]
fn an_empty_token_dtype_leaves_the_width_to_the_file_name() {
    let mut values = filled_tokens();
    values.text.insert("token-dtype", String::new());
    let job = build_job(&values).unwrap();
    assert_eq!(job.data.token_dtype, None);
    values.text.insert("token-dtype", "u32".into());
    assert_eq!(
        build_job(&values).unwrap().data.token_dtype,
        Some(TokenDType::U32)
    );
}

#[cfg(not(target_arch = "wasm32"))]
#[test]
fn the_forms_job_files_pass_the_servers_own_parser() {
    let spec = parse_on_server(&build_job(&filled()).unwrap()).unwrap();
    assert_eq!(spec.data.format, DataFormat::Idx);
    assert_eq!(spec.training.clip_grad_norm, None);

    let spec = parse_on_server(&build_job(&filled_tokens()).unwrap()).unwrap();
    assert_eq!(spec.data.format, DataFormat::Tokens);
    assert_eq!(spec.data.seq_len, Some(64));
    assert!(spec.data.train_labels.is_none() && spec.data.test_labels.is_none());
    assert_eq!(
        spec.training.loss,
        rookery_model::Loss::CrossEntropy {
            class_axis: rookery_model::ClassAxis::Last,
            ignore_index: -100,
        }
    );
    assert_eq!(
        spec.training.lr_schedule,
        rookery_model::LrSchedule::Cosine {
            warmup_steps: 10,
            total_steps: None,
            min_lr: 0.0001,
        }
    );
    assert_eq!(spec.training.clip_grad_norm, Some(1.0));

    // Every other schedule kind, with its fields, as the server reads it.
    for (kind, fields, expected) in [
        (
            "constant",
            &[("warmup-steps", "5")][..],
            rookery_model::LrSchedule::Constant { warmup_steps: 5 },
        ),
        (
            "linear",
            &[("warmup-steps", "2"), ("total-steps", "100")][..],
            rookery_model::LrSchedule::Linear {
                warmup_steps: 2,
                total_steps: Some(100),
            },
        ),
        (
            "step",
            &[("step-size", "30"), ("gamma", "0.5")][..],
            rookery_model::LrSchedule::Step {
                step_size: 30,
                gamma: 0.5,
            },
        ),
    ] {
        let mut values = filled();
        values.text.insert("lr-schedule", kind.into());
        for (id, value) in fields {
            values.text.insert(*id, (*value).into());
        }
        let spec = parse_on_server(&build_job(&values).unwrap()).unwrap();
        assert_eq!(spec.training.lr_schedule, expected, "{kind}");
    }
}

#[test]
fn each_mistake_is_reported_at_its_own_field() {
    let mut values = filled();
    values.files.remove("train-labels");
    values.files.insert("test-inputs", "t.gz".into());
    values.files.insert("model-file", "model.pt".into());
    for (id, bad) in [
        ("batch-size", "0"),
        ("lr", "fast"),
        ("input-shape", "1, a"),
        ("clusters", "many"),
        ("mean", "zero"),
    ] {
        values.text.insert(id, bad.into());
    }
    let errors = build_job(&values).unwrap_err();
    assert_eq!(
        error_ids(&errors),
        [
            "batch-size",
            "clusters",
            "input-shape",
            "lr",
            "mean",
            "model-file",
            "test-labels",
            "train-labels"
        ]
    );
}

#[test]
fn each_token_loss_schedule_and_clipping_mistake_is_reported_at_its_own_field() {
    let mut values = filled_tokens();
    for (id, bad) in [
        ("seq-len", ""),
        ("token-dtype", "u8"),
        ("ignore-index", "-1.5"),
        ("min-lr", "-0.1"),
        ("warmup-steps", "ten"),
        ("clip-grad-norm", "0"),
        ("val-every", "0"),
    ] {
        values.text.insert(id, bad.into());
    }
    let errors = build_job(&values).unwrap_err();
    assert_eq!(
        error_ids(&errors),
        [
            "clip-grad-norm",
            "ignore-index",
            "min-lr",
            "seq-len",
            "token-dtype",
            "val-every",
            "warmup-steps"
        ]
    );
    assert!(errors["seq-len"].contains("at least 1"), "{errors:?}");

    // A zero window and an unknown class axis; a floor above the
    // learning rate does not count where the kind (linear) has no floor.
    let mut values = filled_tokens();
    for (id, bad) in [
        ("seq-len", "0"),
        ("class-axis", "2"),
        ("min-lr", "0.5"),
        ("lr-schedule", "linear"),
    ] {
        values.text.insert(id, bad.into());
    }
    let errors = build_job(&values).unwrap_err();
    assert_eq!(error_ids(&errors), ["class-axis", "seq-len"]);

    // A shape that is not the window, a floor above the learning rate,
    // a negative norm.
    let mut values = filled_tokens();
    values.text.insert("seq-len", "32".into());
    values.text.insert("min-lr", "0.5".into());
    values.text.insert("clip-grad-norm", "-1".into());
    let errors = build_job(&values).unwrap_err();
    assert_eq!(
        error_ids(&errors),
        ["clip-grad-norm", "input-shape", "min-lr"]
    );
    assert!(errors["input-shape"].contains("`32`"), "{errors:?}");
    assert!(errors["min-lr"].contains("0.001"), "{errors:?}");

    // A warm-up longer than the schedule, then a schedule of no steps.
    let mut values = filled_tokens();
    for (id, value) in [
        ("lr-schedule", "linear"),
        ("warmup-steps", "50"),
        ("total-steps", "20"),
    ] {
        values.text.insert(id, value.into());
    }
    assert_eq!(
        error_ids(&build_job(&values).unwrap_err()),
        ["warmup-steps"]
    );
    values.text.insert("total-steps", "0".into());
    assert_eq!(error_ids(&build_job(&values).unwrap_err()), ["total-steps"]);
}

#[test]
fn a_step_schedule_needs_its_step_size_and_a_positive_gamma() {
    let mut values = filled();
    values.text.insert("lr-schedule", "step".into());
    values.text.insert("gamma", "0".into());
    let errors = build_job(&values).unwrap_err();
    assert_eq!(error_ids(&errors), ["gamma", "step-size"]);
    values.text.insert("step-size", "0".into());
    values.text.insert("gamma", String::new());
    assert_eq!(error_ids(&build_job(&values).unwrap_err()), ["step-size"]);
    values.text.insert("step-size", "10".into());
    let job = build_job(&values).unwrap();
    assert_eq!(
        job.training.lr_schedule,
        Some(LrScheduleFile {
            kind: "step".into(),
            step_size: Some(10),
            ..LrScheduleFile::default()
        }),
        "an empty gamma leaves StepLR's default to the server"
    );
}

#[test]
fn other_formats_still_need_labels_and_ignore_the_token_fields() {
    let mut values = filled();
    values.files.remove("train-labels");
    values.text.insert("seq-len", "0".into());
    values.text.insert("token-dtype", "u8".into());
    assert_eq!(
        error_ids(&build_job(&values).unwrap_err()),
        ["train-labels"]
    );
    values
        .files
        .insert("train-labels", "train-labels.gz".into());
    let job = build_job(&values).unwrap();
    assert_eq!((job.data.seq_len, job.data.token_dtype), (None, None));
}

#[test]
fn mse_sends_the_plain_name_without_cross_entropys_options() {
    let mut values = filled();
    values.text.insert("loss", "mse".into());
    values.text.insert("class-axis", "-1".into());
    values.text.insert("ignore-index", "oops".into());
    let job = build_job(&values).unwrap();
    assert_eq!(job.training.loss, Some(LossFile::named("mse")));
}

#[test]
fn only_the_chosen_formats_loss_and_schedules_inputs_are_shown() {
    let mut text = defaults();
    let shown_of = |text: &BTreeMap<&'static str, String>| -> Vec<&str> {
        [
            "train-labels",
            "test-labels",
            "scale",
            "seq-len",
            "token-dtype",
            "class-axis",
            "ignore-index",
            "warmup-steps",
            "total-steps",
            "min-lr",
            "step-size",
            "gamma",
        ]
        .into_iter()
        .filter(|id| shown(text, id))
        .collect()
    };
    assert_eq!(
        shown_of(&text),
        [
            "train-labels",
            "test-labels",
            "scale",
            "class-axis",
            "ignore-index"
        ]
    );
    text.insert("data-format", "tokens".into());
    text.insert("loss", "mse".into());
    text.insert("lr-schedule", "cosine".into());
    assert_eq!(
        shown_of(&text),
        [
            "seq-len",
            "token-dtype",
            "warmup-steps",
            "total-steps",
            "min-lr"
        ]
    );
    text.insert("lr-schedule", "step".into());
    assert_eq!(
        shown_of(&text),
        ["seq-len", "token-dtype", "step-size", "gamma"]
    );
}

#[test]
fn server_dataset_files_are_matched_to_inputs_by_their_usual_names() {
    let mnist: Vec<String> = [
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz",
        "train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte.gz",
    ]
    .map(String::from)
    .to_vec();
    let guesses: Vec<Option<String>> = DATA_INPUTS
        .iter()
        .map(|id| guess_file(&mnist, id))
        .collect();
    assert_eq!(
        guesses,
        [
            Some(mnist[2].clone()),
            Some(mnist[3].clone()),
            Some(mnist[0].clone()),
            Some(mnist[1].clone())
        ]
    );
    let npy: Vec<String> = ["x_train.npy", "y_train.npy"].map(String::from).to_vec();
    assert_eq!(
        guess_file(&npy, "train-inputs").as_deref(),
        Some("x_train.npy")
    );
    assert_eq!(
        guess_file(&npy, "train-labels").as_deref(),
        Some("y_train.npy")
    );
    assert_eq!(guess_file(&npy, "test-inputs"), None);
}

#[test]
fn server_fields_map_to_the_most_specific_input() {
    let values = filled();
    assert_eq!(
        input_for("training.batch_size", &values),
        Some("batch-size")
    );
    assert_eq!(input_for("training.optimizer.lr", &values), Some("lr"));
    assert_eq!(
        input_for("training.optimizer.betas", &values),
        Some("optimizer")
    );
    assert_eq!(input_for("train-labels.gz", &values), Some("train-labels"));
    assert_eq!(input_for("model", &values), Some("model-file"));
    assert_eq!(input_for("somewhere.else", &values), None);
}

#[test]
fn the_new_server_fields_map_to_their_own_inputs() {
    let values = filled_tokens();
    for (server, input) in [
        ("data.seq_len", "seq-len"),
        ("data.token_dtype", "token-dtype"),
        ("data.train_inputs", "train-inputs"),
        ("train.u16", "train-inputs"),
        ("training.loss", "loss"),
        ("training.loss.class_axis", "class-axis"),
        ("training.loss.ignore_index", "ignore-index"),
        ("training.lr_schedule", "lr-schedule"),
        ("training.lr_schedule.kind", "lr-schedule"),
        ("training.lr_schedule.warmup_steps", "warmup-steps"),
        ("training.lr_schedule.total_steps", "total-steps"),
        ("training.lr_schedule.min_lr", "min-lr"),
        ("training.lr_schedule.step_size", "step-size"),
        ("training.lr_schedule.gamma", "gamma"),
        ("training.clip_grad_norm", "clip-grad-norm"),
    ] {
        assert_eq!(input_for(server, &values), Some(input), "{server}");
    }
}

#[test]
fn every_input_has_a_default_and_one_server_field() {
    let defaults = defaults();
    let ids: Vec<&str> = FIELDS.iter().map(|(id, _)| *id).collect();
    assert_eq!(ids.len(), defaults.len());
    assert!(ids.iter().all(|id| defaults.contains_key(id)));
    let mut fields: Vec<&str> = FIELDS.iter().map(|(_, f)| *f).collect();
    fields.sort_unstable();
    fields.dedup();
    assert_eq!(fields.len(), FIELDS.len());
}
