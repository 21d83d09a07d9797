//! The New job form's values and what they become: the job file
//! ([`build_job`]), the mistakes found before asking the server (each at
//! its own input), and which input a server error is about ([`input_for`]).
//! Pure, so it is unit-tested natively.

use std::collections::BTreeMap;

use rookery_job::{
    Clusters, DataFile, DataFormat, JobFile, LossFile, LrScheduleFile, ModelFile, OptimizerFile,
    OuterOptimizerFile, SyncFile, TokenDType, TrainingFile,
};
use rookery_model::ClusterCount;
use serde_json::Value;

/// Every non-file input: its element id and the job-file field the server
/// names it by.
pub const FIELDS: &[(&str, &str)] = &[
    ("public-name", "public_name"),
    ("input-shape", "model.input_shape"),
    ("data-format", "data.format"),
    ("seq-len", "data.seq_len"),
    ("token-dtype", "data.token_dtype"),
    ("scale", "data.scale"),
    ("mean", "data.mean"),
    ("std", "data.std"),
    ("loss", "training.loss"),
    ("class-axis", "training.loss.class_axis"),
    ("ignore-index", "training.loss.ignore_index"),
    ("optimizer", "training.optimizer"),
    ("lr", "training.optimizer.lr"),
    ("momentum", "training.optimizer.momentum"),
    ("weight-decay", "training.optimizer.weight_decay"),
    ("lr-schedule", "training.lr_schedule"),
    ("warmup-steps", "training.lr_schedule.warmup_steps"),
    ("total-steps", "training.lr_schedule.total_steps"),
    ("min-lr", "training.lr_schedule.min_lr"),
    ("step-size", "training.lr_schedule.step_size"),
    ("gamma", "training.lr_schedule.gamma"),
    ("clip-grad-norm", "training.clip_grad_norm"),
    ("epochs", "training.epochs"),
    ("batch-size", "training.batch_size"),
    ("micro-batches", "training.micro_batches"),
    ("clusters", "training.clusters"),
    ("stages", "training.stages"),
    ("sync-every", "training.sync_every"),
    ("val-every", "training.val_every"),
    ("wire-dtype", "training.wire_dtype"),
    ("schedule", "training.schedule"),
    ("average-optimizer", "training.average_optimizer"),
    ("outer-optimizer", "training.sync.outer_optimizer"),
    ("outer-lr", "training.sync.outer_optimizer.lr"),
    ("outer-momentum", "training.sync.outer_optimizer.momentum"),
    ("sync-compress", "training.sync.compress"),
    ("seed", "training.seed"),
];

/// File inputs and the job-file field each fills.
pub const FILE_FIELDS: &[(&str, &str)] = &[
    ("model-file", "model"),
    ("train-inputs", "data.train_inputs"),
    ("train-labels", "data.train_labels"),
    ("test-inputs", "data.test_inputs"),
    ("test-labels", "data.test_labels"),
];

/// The data inputs, filled from a server dataset when one is picked.
pub const DATA_INPUTS: [&str; 4] = ["train-inputs", "train-labels", "test-inputs", "test-labels"];

/// The labels inputs, which a token file does without (its labels are its
/// next tokens).
pub const LABEL_INPUTS: [&str; 2] = ["train-labels", "test-labels"];

/// Each learning-rate schedule kind and the inputs it takes, in the order
/// shown; "none" sends no schedule (the server's default, constant).
pub const SCHEDULE_INPUTS: &[(&str, &[&str])] = &[
    ("none", &[]),
    ("constant", &["warmup-steps"]),
    ("linear", &["warmup-steps", "total-steps"]),
    ("cosine", &["warmup-steps", "total-steps", "min-lr"]),
    ("step", &["step-size", "gamma"]),
];

/// What the form holds, as text, plus the names of the chosen files.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FormValues {
    pub text: BTreeMap<&'static str, String>,
    /// Chosen file name per file input id.
    pub files: BTreeMap<&'static str, String>,
}

impl FormValues {
    fn get(&self, id: &str) -> &str {
        self.text.get(id).map(|s| s.trim()).unwrap_or("")
    }

    /// Whether the data is a token file, which changes which inputs apply.
    pub fn is_tokens(&self) -> bool {
        is_tokens(&self.text)
    }
}

/// Whether the form's text picks the `tokens` data format.
pub fn is_tokens(text: &BTreeMap<&'static str, String>) -> bool {
    text.get("data-format").map(|s| s.trim()) == Some("tokens")
}

/// Whether an input applies to the form's current choices: labels not for
/// token files, scale and normalisation not for token ids, cross entropy's
/// options not for mse, and only the chosen schedule's fields.
pub fn shown(text: &BTreeMap<&'static str, String>, id: &str) -> bool {
    let get = |id: &str| text.get(id).map(|s| s.trim()).unwrap_or("");
    match id {
        "train-labels" | "test-labels" | "scale" | "mean" | "std" => !is_tokens(text),
        "seq-len" | "token-dtype" => is_tokens(text),
        "class-axis" | "ignore-index" => get("loss") == "cross_entropy",
        "warmup-steps" | "total-steps" | "min-lr" | "step-size" | "gamma" => SCHEDULE_INPUTS
            .iter()
            .any(|(kind, ids)| *kind == get("lr-schedule") && ids.contains(&id)),
        _ => true,
    }
}

/// The label a data input takes when the data is a token file.
pub fn tokens_label(id: &str) -> Option<&'static str> {
    match id {
        "train-inputs" => Some("Training tokens"),
        "test-inputs" => Some("Test tokens (optional)"),
        _ => None,
    }
}

/// Defaults that train the MNIST example well.
pub fn defaults() -> BTreeMap<&'static str, String> {
    [
        ("public-name", ""),
        ("input-shape", "1, 28, 28"),
        ("data-format", "idx"),
        ("seq-len", ""),
        ("token-dtype", ""),
        ("scale", "0.00392156862745098"),
        ("mean", ""),
        ("std", ""),
        ("loss", "cross_entropy"),
        ("class-axis", "1"),
        ("ignore-index", ""),
        ("optimizer", "adam"),
        ("lr", "0.001"),
        ("momentum", ""),
        ("weight-decay", ""),
        ("lr-schedule", "none"),
        ("warmup-steps", ""),
        ("total-steps", ""),
        ("min-lr", ""),
        ("step-size", ""),
        ("gamma", ""),
        ("clip-grad-norm", ""),
        ("epochs", "1"),
        ("batch-size", "32"),
        ("micro-batches", "2"),
        ("clusters", "1"),
        ("stages", "auto"),
        ("sync-every", "1"),
        ("val-every", ""),
        ("wire-dtype", "f32"),
        ("schedule", "gpipe"),
        ("average-optimizer", "no"),
        ("outer-optimizer", "none"),
        ("outer-lr", "0.7"),
        ("outer-momentum", ""),
        ("sync-compress", "none"),
        ("seed", "42"),
    ]
    .into_iter()
    .map(|(k, v)| (k, v.to_string()))
    .collect()
}

/// Field errors: input id -> message.
pub type FieldErrors = BTreeMap<String, String>;

fn positive(values: &FormValues, id: &str, errors: &mut FieldErrors) -> Option<u64> {
    match values.get(id).parse::<u64>() {
        Ok(n) if n > 0 => Some(n),
        _ => {
            errors.insert(id.into(), "a whole number of at least 1".into());
            None
        }
    }
}

/// Empty, or what `parse` makes of the text; `message` says what it must be.
fn optional<T>(
    values: &FormValues,
    id: &str,
    message: &str,
    errors: &mut FieldErrors,
    parse: impl FnOnce(&str) -> Option<T>,
) -> Option<T> {
    let text = values.get(id);
    if text.is_empty() {
        return None;
    }
    let parsed = parse(text);
    if parsed.is_none() {
        errors.insert(id.into(), message.into());
    }
    parsed
}

fn optional_float(values: &FormValues, id: &str, errors: &mut FieldErrors) -> Option<f64> {
    optional(values, id, "a number, or empty", errors, |t| {
        t.parse::<f64>().ok().filter(|v| v.is_finite())
    })
}

/// `[training.sync]`: DiLoCo's outer optimizer and compressed uploads, or
/// `None` for plain averaging of f32 parameters (the period stays
/// `sync_every`).
fn sync(values: &FormValues, errors: &mut FieldErrors) -> Option<SyncFile> {
    let outer_optimizer = match values.get("outer-optimizer") {
        "none" => None,
        name => {
            let lr = optional(
                values,
                "outer-lr",
                "an outer learning rate above 0",
                errors,
                |t| t.parse::<f64>().ok().filter(|v| v.is_finite() && *v > 0.0),
            );
            if lr.is_none() && !errors.contains_key("outer-lr") {
                errors.insert("outer-lr".into(), "an outer learning rate above 0".into());
            }
            Some(OuterOptimizerFile {
                name: name.to_string(),
                lr: lr.unwrap_or(0.0),
                momentum: optional_float(values, "outer-momentum", errors),
            })
        }
    };
    let compress = match values.get("sync-compress") {
        "none" => None,
        other => Some(other.to_string()),
    };
    (outer_optimizer.is_some() || compress.is_some()).then_some(SyncFile {
        every: None,
        outer_optimizer,
        compress,
    })
}

/// `auto` or a whole number of at least 1.
fn auto_or_count(values: &FormValues, id: &str, errors: &mut FieldErrors) -> Option<ClusterCount> {
    let text = values.get(id);
    if text.is_empty() || text.eq_ignore_ascii_case("auto") {
        return Some(ClusterCount::Auto);
    }
    match text.parse::<usize>() {
        Ok(n) if n > 0 => Some(ClusterCount::Fixed(n)),
        _ => {
            errors.insert(id.into(), "`auto` or a whole number of at least 1".into());
            None
        }
    }
}

/// A select's value as the job file's type for it (the type's own serde
/// spelling, so the options and the server cannot disagree).
fn choice<T: serde::de::DeserializeOwned>(
    values: &FormValues,
    id: &str,
    errors: &mut FieldErrors,
) -> Option<T> {
    let text = values.get(id);
    match serde_json::from_value(Value::String(text.to_string())) {
        Ok(v) => Some(v),
        Err(_) => {
            errors.insert(id.into(), format!("`{text}` is not one of the choices"));
            None
        }
    }
}

/// The loss by name, with cross entropy's options. Class axis 1 is torch's
/// default, so it is left out and the job file keeps the plain name.
fn loss(values: &FormValues, errors: &mut FieldErrors) -> Option<LossFile> {
    let name = values.get("loss");
    match name {
        "cross_entropy" => {
            let class_axis = match values.get("class-axis") {
                "1" | "" => None,
                "-1" => Some(-1),
                other => {
                    errors.insert(
                        "class-axis".into(),
                        format!("`{other}` is not one of the choices"),
                    );
                    None
                }
            };
            let ignore_index = optional(
                values,
                "ignore-index",
                "a whole number (e.g. -100), or empty",
                errors,
                |t| t.parse::<i64>().ok(),
            );
            Some(LossFile {
                name: name.into(),
                class_axis,
                ignore_index,
            })
        }
        "mse" => Some(LossFile::named(name)),
        other => {
            errors.insert(
                "loss".into(),
                format!("`{other}` is not one of the choices"),
            );
            None
        }
    }
}

/// The chosen learning-rate schedule with only its own fields (the server
/// refuses a field the kind does not take). `lr` is the optimizer's, when
/// valid: cosine's floor must not exceed it.
fn lr_schedule(
    values: &FormValues,
    lr: Option<f64>,
    errors: &mut FieldErrors,
) -> Option<LrScheduleFile> {
    let kind = values.get("lr-schedule");
    let Some((_, takes)) = SCHEDULE_INPUTS.iter().find(|(k, _)| *k == kind) else {
        errors.insert(
            "lr-schedule".into(),
            format!("`{kind}` is not one of the choices"),
        );
        return None;
    };
    if kind == "none" {
        return None;
    }
    let kind_takes = *takes;
    let takes = |id: &str| kind_takes.contains(&id);
    let mut schedule = LrScheduleFile {
        kind: kind.into(),
        ..LrScheduleFile::default()
    };
    if takes("warmup-steps") {
        schedule.warmup_steps = optional(
            values,
            "warmup-steps",
            "a whole number of steps (0 or more), or empty for none",
            errors,
            |t| t.parse::<u64>().ok(),
        );
    }
    if takes("total-steps") {
        schedule.total_steps = optional(
            values,
            "total-steps",
            "a whole number of at least 1, or empty for the whole job",
            errors,
            |t| t.parse::<u64>().ok().filter(|&n| n > 0),
        );
        if let (Some(warmup), Some(total)) = (schedule.warmup_steps, schedule.total_steps)
            && warmup > total
        {
            errors.insert(
                "warmup-steps".into(),
                format!("longer than the schedule's {total} total steps"),
            );
        }
    }
    if takes("min-lr") {
        schedule.min_lr = optional(
            values,
            "min-lr",
            "a learning rate of 0 or more, or empty for 0",
            errors,
            |t| t.parse::<f64>().ok().filter(|v| v.is_finite() && *v >= 0.0),
        );
        if let (Some(min_lr), Some(lr)) = (schedule.min_lr, lr)
            && min_lr > lr
        {
            errors.insert("min-lr".into(), format!("at most the learning rate ({lr})"));
        }
    }
    if takes("step-size") {
        schedule.step_size = positive(values, "step-size", errors);
    }
    if takes("gamma") {
        schedule.gamma = optional(
            values,
            "gamma",
            "a factor above 0, or empty for 0.1",
            errors,
            |t| t.parse::<f64>().ok().filter(|v| v.is_finite() && *v > 0.0),
        );
    }
    Some(schedule)
}

/// The job file for the form's values, or every error found before asking
/// the server. File parts are named by their file names.
pub fn build_job(values: &FormValues) -> Result<JobFile, FieldErrors> {
    let mut errors = FieldErrors::new();
    let tokens = values.is_tokens();
    let file = |id: &str| values.files.get(id).cloned();
    let (mut onnx, mut spec) = (None, None);
    match file("model-file") {
        Some(name) if name.ends_with(".onnx") => onnx = Some(name),
        Some(name) if name.ends_with(".toml") => spec = Some(name),
        Some(_) => {
            errors.insert(
                "model-file".into(),
                "an ONNX export (.onnx) or a layer-spec file (.toml)".into(),
            );
        }
        None => {
            errors.insert("model-file".into(), "choose the model file".into());
        }
    }
    let shape: Result<Vec<usize>, _> = values
        .get("input-shape")
        .split([',', 'x', ' '])
        .filter(|s| !s.is_empty())
        .map(str::parse::<usize>)
        .collect();
    let input_shape = match shape {
        Ok(shape) if !shape.is_empty() && shape.iter().all(|&d| d > 0) => shape,
        _ => {
            errors.insert(
                "input-shape".into(),
                "one sample's shape, e.g. `1, 28, 28`".into(),
            );
            Vec::new()
        }
    };

    let mut required = |id: &str| {
        file(id).unwrap_or_else(|| {
            errors.insert(id.into(), "choose the file".into());
            String::new()
        })
    };
    let train_inputs = required("train-inputs");
    // A token file's labels are its own next tokens: labels files are
    // neither asked for nor sent, whatever a dataset's guess left in them.
    let train_labels = (!tokens).then(|| required("train-labels"));
    let (test_inputs, test_labels) = match (file("test-inputs"), file("test-labels")) {
        (inputs, _) if tokens => (inputs, None),
        (Some(inputs), Some(labels)) => (Some(inputs), Some(labels)),
        (None, None) => (None, None),
        (Some(_), None) => {
            errors.insert("test-labels".into(), "test inputs need their labels".into());
            (None, None)
        }
        (None, Some(_)) => {
            errors.insert("test-inputs".into(), "test labels need their inputs".into());
            (None, None)
        }
    };
    let format = choice(values, "data-format", &mut errors);
    let (mut scale, mut mean, mut std) = (None, None, None);
    let (mut seq_len, mut token_dtype) = (None, None);
    if tokens {
        seq_len = match values.get("seq-len").parse::<usize>() {
            Ok(n) if n > 0 => Some(n),
            _ => {
                errors.insert(
                    "seq-len".into(),
                    "the tokens one sample feeds the model: a whole number of at least 1".into(),
                );
                None
            }
        };
        // The server requires it; saying so here names the fix.
        if let Some(n) = seq_len
            && !input_shape.is_empty()
            && input_shape != [n]
        {
            errors.insert(
                "input-shape".into(),
                format!("for token data, the sequence length alone: `{n}`"),
            );
        }
        // Empty: the file's name (`.u16`, `.u32`) or `.npy` header says.
        if !values.get("token-dtype").is_empty() {
            token_dtype = choice::<TokenDType>(values, "token-dtype", &mut errors);
        }
    } else {
        scale = optional_float(values, "scale", &mut errors);
        mean = optional_float(values, "mean", &mut errors);
        std = optional_float(values, "std", &mut errors);
    }

    let lr = match values.get("lr").parse::<f64>() {
        Ok(lr) if lr.is_finite() && lr > 0.0 => Some(lr),
        _ => {
            errors.insert("lr".into(), "a learning rate above 0".into());
            None
        }
    };
    let optimizer = OptimizerFile {
        name: values.get("optimizer").to_string(),
        lr,
        momentum: optional_float(values, "momentum", &mut errors),
        weight_decay: optional_float(values, "weight-decay", &mut errors),
        ..OptimizerFile::default()
    };
    let lr_schedule = lr_schedule(values, lr, &mut errors);
    let clip_grad_norm = optional(
        values,
        "clip-grad-norm",
        "a gradient norm above 0, or empty for no clipping",
        &mut errors,
        |t| t.parse::<f64>().ok().filter(|v| v.is_finite() && *v > 0.0),
    );

    let val_every = optional(
        values,
        "val-every",
        "a number of steps above 0, or empty to evaluate after each epoch only",
        &mut errors,
        |t| t.parse::<u64>().ok().filter(|v| *v > 0),
    );
    let mut count = |id: &str| positive(values, id, &mut errors);
    let (epochs, batch_size, micro_batches, sync_every) = (
        count("epochs"),
        count("batch-size"),
        count("micro-batches"),
        count("sync-every"),
    );
    let clusters = auto_or_count(values, "clusters", &mut errors);
    // No `stages` key lets the planner choose.
    let stages = match auto_or_count(values, "stages", &mut errors) {
        Some(ClusterCount::Fixed(n)) => Some(n),
        _ => None,
    };
    let seed = match values.get("seed").parse::<u64>() {
        Ok(seed) => Some(seed),
        Err(_) => {
            errors.insert("seed".into(), "a whole number".into());
            None
        }
    };
    let loss = loss(values, &mut errors);
    let wire_dtype = choice(values, "wire-dtype", &mut errors);
    let schedule = choice(values, "schedule", &mut errors);
    let average_optimizer = (values.get("average-optimizer") == "yes").then_some(true);
    let sync = sync(values, &mut errors);

    if !errors.is_empty() {
        return Err(errors);
    }
    Ok(JobFile {
        // Empty: private. The server checks its length and characters.
        public_name: Some(values.get("public-name").to_string()).filter(|n| !n.is_empty()),
        model: ModelFile {
            onnx,
            spec,
            input_shape,
        },
        data: DataFile {
            format: format.unwrap_or(DataFormat::Idx),
            train_inputs,
            train_labels,
            test_inputs,
            test_labels,
            scale,
            mean,
            std,
            seq_len,
            token_dtype,
        },
        training: TrainingFile {
            epochs,
            batch_size: batch_size.unwrap_or(1) as usize,
            micro_batches: micro_batches.map(|n| n as usize),
            loss,
            optimizer: Some(optimizer),
            clusters: clusters.map(Clusters),
            sync_every,
            stages,
            shuffle: None,
            seed,
            wire_dtype,
            aggregation: None,
            schedule,
            lr_schedule,
            clip_grad_norm,
            verify: None,
            val_every,
            average_optimizer,
            sync,
        },
    })
}

/// The job file's name, after the model file (`mnist.onnx` -> `mnist.json`),
/// since the server names a job after its job file.
pub fn job_file_name(values: &FormValues) -> String {
    let stem = values
        .files
        .get("model-file")
        .and_then(|name| name.rsplit_once('.').map(|(stem, _)| stem.to_string()))
        .filter(|stem| !stem.is_empty())
        .unwrap_or_else(|| "job".into());
    format!("{stem}.json")
}

/// The file of a server dataset that most likely fills a data input, by
/// the usual names (`train-images...`, `t10k-labels...`, `x_test.npy`).
pub fn guess_file(files: &[String], id: &str) -> Option<String> {
    let (split, kind): (&[&str], &[&str]) = match id {
        "train-inputs" => (&["train"], &["image", "input", "x"]),
        "train-labels" => (&["train"], &["label", "target", "y"]),
        "test-inputs" => (&["test", "t10k"], &["image", "input", "x"]),
        "test-labels" => (&["test", "t10k"], &["label", "target", "y"]),
        _ => return None,
    };
    // Whole words of the name: `x_train.npy` is x, train, npy.
    let words = |f: &str| -> Vec<String> {
        f.to_lowercase()
            .split(|c: char| !c.is_ascii_alphanumeric())
            .map(str::to_string)
            .collect()
    };
    // One-letter kinds (x, y) must be a whole word; longer ones may be a
    // word's start (`images`, `labels`).
    let is_kind = |w: &str, kind: &str| w == kind || (kind.len() > 1 && w.starts_with(kind));
    kind.iter().find_map(|k| {
        files
            .iter()
            .find(|f| {
                let words = words(f);
                words.iter().any(|w| split.contains(&w.as_str()))
                    && words.iter().any(|w| is_kind(w, k))
            })
            .cloned()
    })
}

/// The input a server error is about: a job-file field (the most specific
/// known prefix) or an uploaded file's name.
pub fn input_for(server_field: &str, values: &FormValues) -> Option<&'static str> {
    if let Some((id, _)) = values.files.iter().find(|(_, name)| {
        server_field == name.as_str() || server_field.starts_with(&format!("{name}:"))
    }) {
        return Some(id);
    }
    FIELDS
        .iter()
        .chain(FILE_FIELDS)
        .filter(|(_, field)| {
            server_field == *field || server_field.starts_with(&format!("{field}."))
        })
        .max_by_key(|(_, field)| field.len())
        .map(|(id, _)| *id)
}

#[cfg(test)]
mod tests {
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
}
