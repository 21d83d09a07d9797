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
    ("precision", "training.precision"),
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
        ("precision", "f32"),
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

/// A finite number above 0 (a learning rate); `message` says what it must be.
fn positive_float(
    values: &FormValues,
    id: &str,
    message: &str,
    errors: &mut FieldErrors,
) -> Option<f64> {
    match values.get(id).parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Some(v),
        _ => {
            errors.insert(id.into(), message.into());
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
            let lr = positive_float(values, "outer-lr", "an outer learning rate above 0", errors);
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

    let lr = positive_float(values, "lr", "a learning rate above 0", &mut errors);
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
    let precision = choice(values, "precision", &mut errors);
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
            precision,
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
mod tests;
