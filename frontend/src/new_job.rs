//! The New job page: the model (ONNX export with its `.data` side file, or
//! a layer-spec file), the data files, and every training setting, turned
//! into a job file and uploaded with the files in one multipart request.
//! Before submitting, the Requester sees the plan the server's planner makes
//! with the providers connected now (`POST /api/plan`, the same upload).
//! Errors appear next to the field they concern, whether this page or the
//! server found them.
//!
//! DOM contract (end-to-end tests rely on it): `form#new-job`; file inputs
//! `#model-file`, `#model-data-file`, `#train-inputs`, `#train-labels`,
//! `#test-inputs`, `#test-labels` (selects of the dataset's files when
//! `select#data-source` picks a dataset kept on the server); the other
//! inputs by the ids in
//! [`FIELDS`]; `#error-<id>` next to a field in error; `button#preview-plan`,
//! `#plan-preview` (with `.cluster` and `tr.plan-stage` rows), `#form-error`,
//! and `button#submit-job`, which opens the new job's page.

use std::collections::BTreeMap;

use leptos::html::Input;
use leptos::prelude::*;
use leptos_router::hooks::use_navigate;
use rookery_job::{
    Clusters, DataFile, DataFormat, JobFile, ModelFile, OptimizerFile, TrainingFile,
};
use rookery_model::ClusterCount;
use rookery_proto::api::{DatasetInfo, JobCreated, PlanPreview};
use serde_json::Value;
use wasm_bindgen::JsCast;

use crate::api::{self, use_auth};
use crate::format;
use crate::job_detail::plan_diagram;

/// Every non-file input: its element id, label and the job-file field the
/// server names it by.
pub const FIELDS: &[(&str, &str)] = &[
    ("input-shape", "model.input_shape"),
    ("data-format", "data.format"),
    ("scale", "data.scale"),
    ("mean", "data.mean"),
    ("std", "data.std"),
    ("loss", "training.loss"),
    ("optimizer", "training.optimizer"),
    ("lr", "training.optimizer.lr"),
    ("momentum", "training.optimizer.momentum"),
    ("weight-decay", "training.optimizer.weight_decay"),
    ("epochs", "training.epochs"),
    ("batch-size", "training.batch_size"),
    ("micro-batches", "training.micro_batches"),
    ("clusters", "training.clusters"),
    ("stages", "training.stages"),
    ("sync-every", "training.sync_every"),
    ("wire-dtype", "training.wire_dtype"),
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
}

/// Defaults that train the MNIST example well.
pub fn defaults() -> BTreeMap<&'static str, String> {
    [
        ("input-shape", "1, 28, 28"),
        ("data-format", "idx"),
        ("scale", "0.00392156862745098"),
        ("mean", ""),
        ("std", ""),
        ("loss", "cross_entropy"),
        ("optimizer", "adam"),
        ("lr", "0.001"),
        ("momentum", ""),
        ("weight-decay", ""),
        ("epochs", "1"),
        ("batch-size", "32"),
        ("micro-batches", "2"),
        ("clusters", "1"),
        ("stages", "auto"),
        ("sync-every", "1"),
        ("wire-dtype", "f32"),
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

fn optional_float(values: &FormValues, id: &str, errors: &mut FieldErrors) -> Option<f64> {
    let text = values.get(id);
    if text.is_empty() {
        return None;
    }
    match text.parse::<f64>() {
        Ok(v) if v.is_finite() => Some(v),
        _ => {
            errors.insert(id.into(), "a number, or empty".into());
            None
        }
    }
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

/// The job file for the form's values, or every error found before asking
/// the server. File parts are named by their file names.
pub fn build_job(values: &FormValues) -> Result<JobFile, FieldErrors> {
    let mut errors = FieldErrors::new();
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
    let (train_inputs, train_labels) = (required("train-inputs"), required("train-labels"));
    let (test_inputs, test_labels) = match (file("test-inputs"), file("test-labels")) {
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
    let scale = optional_float(values, "scale", &mut errors);
    let mean = optional_float(values, "mean", &mut errors);
    let std = optional_float(values, "std", &mut errors);

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
    let loss = choice(values, "loss", &mut errors);
    let wire_dtype = choice(values, "wire-dtype", &mut errors);

    if !errors.is_empty() {
        return Err(errors);
    }
    Ok(JobFile {
        model: ModelFile {
            onnx,
            spec,
            input_shape,
        },
        data: DataFile {
            format: format.unwrap_or(DataFormat::Idx),
            train_inputs,
            // The form has no token-file fields yet: its formats all have labels files.
            train_labels: Some(train_labels),
            test_inputs,
            test_labels,
            scale,
            mean,
            std,
            seq_len: None,
            token_dtype: None,
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
            lr_schedule: None,
            clip_grad_norm: None,
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

/// The data inputs, filled from a server dataset when one is picked.
pub const DATA_INPUTS: [&str; 4] = ["train-inputs", "train-labels", "test-inputs", "test-labels"];

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

#[component]
pub fn NewJobPage() -> impl IntoView {
    let auth = use_auth();
    let navigate = use_navigate();
    let text = RwSignal::new(defaults());
    let files = RwSignal::new(BTreeMap::<&'static str, String>::new());
    let errors = RwSignal::new(FieldErrors::new());
    let form_error = RwSignal::new(None::<String>);
    let preview = RwSignal::new(None::<PlanPreview>);
    let plan_error = RwSignal::new(None::<String>);
    let busy = RwSignal::new(false);
    // Datasets on the server, and the one picked ("" = upload the files).
    let datasets = RwSignal::new(Vec::<DatasetInfo>::new());
    let source = RwSignal::new(String::new());
    {
        let token = auth.token.get_untracked().unwrap_or_default();
        wasm_bindgen_futures::spawn_local(async move {
            // Without the list the form still uploads; no need to alarm.
            if let Ok(list) = api::get_json::<Vec<DatasetInfo>>(&token, "/api/datasets").await {
                datasets.set(list);
            }
        });
    }
    let pick_source = move |name: String| {
        let files_of: Vec<String> = datasets.with_untracked(|all| {
            all.iter()
                .find(|d| d.name == name)
                .map(|d| d.files.iter().map(|f| f.name.clone()).collect())
                .unwrap_or_default()
        });
        files.update(|f| {
            for id in DATA_INPUTS {
                match guess_file(&files_of, id).filter(|_| !name.is_empty()) {
                    Some(file) => f.insert(id, file),
                    None => f.remove(id),
                };
            }
        });
        preview.set(None);
        source.set(name);
    };

    let model_file = NodeRef::<Input>::new();
    let model_data = NodeRef::<Input>::new();
    let train_inputs = NodeRef::<Input>::new();
    let train_labels = NodeRef::<Input>::new();
    let test_inputs = NodeRef::<Input>::new();
    let test_labels = NodeRef::<Input>::new();
    let file_inputs = [
        ("model-file", model_file),
        ("train-inputs", train_inputs),
        ("train-labels", train_labels),
        ("test-inputs", test_inputs),
        ("test-labels", test_labels),
    ];

    // The form as a multipart body: the job file, then every chosen file
    // under its own name (the ONNX side file must keep the name the export
    // recorded).
    let form_data = move || -> Result<(web_sys::FormData, FormValues), FieldErrors> {
        let values = FormValues {
            text: text.get_untracked(),
            files: files.get_untracked(),
        };
        let job = build_job(&values)?;
        let mut failed = FieldErrors::new();
        let form = web_sys::FormData::new().map_err(|_| {
            FieldErrors::from([(
                "form".to_string(),
                "this browser cannot build uploads".to_string(),
            )])
        })?;
        let job = serde_json::to_string(&job)
            .map_err(|e| FieldErrors::from([("form".to_string(), format!("the job file: {e}"))]))?;
        let parts = js_sys::Array::of1(&job.into());
        let options = web_sys::BlobPropertyBag::new();
        options.set_type("application/json");
        match web_sys::Blob::new_with_str_sequence_and_options(&parts, &options) {
            Ok(blob) => {
                // The server names the job after this file's stem: the model's.
                let _ = form.append_with_blob_and_filename("job", &blob, &job_file_name(&values));
            }
            Err(_) => {
                failed.insert("form".into(), "cannot build the job file".into());
            }
        }
        let dataset = source.get_untracked();
        let mut inputs: Vec<(&str, NodeRef<Input>)> = file_inputs
            .iter()
            .filter(|(id, _)| dataset.is_empty() || !DATA_INPUTS.contains(id))
            .copied()
            .collect();
        inputs.push(("model-data-file", model_data));
        if !dataset.is_empty() && form.append_with_str("dataset", &dataset).is_err() {
            failed.insert("data-source".into(), "cannot name the dataset".into());
        }
        for (id, node) in inputs {
            let Some(list) = node.get_untracked().and_then(|input| input.files()) else {
                continue;
            };
            for i in 0..list.length() {
                if let Some(file) = list.item(i) {
                    let name = file.name();
                    let blob: &web_sys::Blob = file.unchecked_ref();
                    if form
                        .append_with_blob_and_filename(&name, blob, &name)
                        .is_err()
                    {
                        failed.insert(id.into(), format!("cannot attach {name}"));
                    }
                }
            }
        }
        if failed.is_empty() {
            Ok((form, values))
        } else {
            Err(failed)
        }
    };

    let show_failure = move |failure: api::Failure, values: &FormValues| {
        auth.check(&failure);
        match failure
            .field
            .as_deref()
            .and_then(|field| input_for(field, values))
        {
            Some(id) => {
                errors.set(FieldErrors::from([(id.to_string(), failure.message)]));
                form_error.set(Some(
                    "The server found a problem; see the marked field.".into(),
                ));
            }
            None => form_error.set(Some(failure.message)),
        }
    };

    let preview_plan = move |_| {
        errors.set(FieldErrors::new());
        form_error.set(None);
        plan_error.set(None);
        let (form, values) = match form_data() {
            Ok(ok) => ok,
            Err(found) => {
                errors.set(found);
                return;
            }
        };
        busy.set(true);
        let token = auth.token.get_untracked().unwrap_or_default();
        wasm_bindgen_futures::spawn_local(async move {
            let result = api::post_form::<PlanPreview>(&token, "/api/plan", &form).await;
            busy.set(false);
            match result {
                Ok(plan) => preview.set(Some(plan)),
                // 409: the upload is fine but providers cannot take it now.
                Err(failure) if failure.status == 409 => {
                    preview.set(None);
                    plan_error.set(Some(failure.message));
                }
                Err(failure) => {
                    preview.set(None);
                    show_failure(failure, &values);
                }
            }
        });
    };

    let submit = move |ev: leptos::ev::SubmitEvent| {
        ev.prevent_default();
        errors.set(FieldErrors::new());
        form_error.set(None);
        let (form, values) = match form_data() {
            Ok(ok) => ok,
            Err(found) => {
                errors.set(found);
                return;
            }
        };
        busy.set(true);
        let token = auth.token.get_untracked().unwrap_or_default();
        let navigate = navigate.clone();
        wasm_bindgen_futures::spawn_local(async move {
            let result = api::post_form::<JobCreated>(&token, "/api/jobs", &form).await;
            busy.set(false);
            match result {
                Ok(created) => navigate(&format!("/jobs/{}", created.id), Default::default()),
                Err(failure) => show_failure(failure, &values),
            }
        });
    };

    let error_for = move |id: &'static str| {
        move || {
            errors.with(|e| {
                e.get(id).cloned().map(|message| {
                    view! {
                        <p id=format!("error-{id}") class="field-error" role="alert">
                            {message}
                        </p>
                    }
                })
            })
        }
    };
    let text_input = move |id: &'static str, label: &'static str, hint: &'static str| {
        view! {
            <div class="field" class:invalid=move || errors.with(|e| e.contains_key(id))>
                <label for=id>{label}</label>
                <input
                    id=id
                    type="text"
                    prop:value=move || text.with(|t| t.get(id).cloned().unwrap_or_default())
                    on:input=move |ev| {
                        let value = event_target_value(&ev);
                        text.update(|t| {
                            t.insert(id, value);
                        });
                    }
                />
                <small class="hint">{hint}</small>
                {error_for(id)}
            </div>
        }
    };
    let select = move |id: &'static str,
                       label: &'static str,
                       options: &'static [(&'static str, &'static str)]| {
        view! {
            <div class="field" class:invalid=move || errors.with(|e| e.contains_key(id))>
                <label for=id>{label}</label>
                <select
                    id=id
                    prop:value=move || text.with(|t| t.get(id).cloned().unwrap_or_default())
                    on:change=move |ev| {
                        let value = event_target_value(&ev);
                        text.update(|t| {
                            t.insert(id, value);
                        });
                    }
                >
                    {options
                        .iter()
                        .map(|(value, name)| {
                            let selected = text.with_untracked(|t| t.get(id).map(String::as_str) == Some(*value));
                            view! { <option value=*value selected=selected>{*name}</option> }
                        })
                        .collect_view()}
                </select>
                {error_for(id)}
            </div>
        }
    };
    let file_input = move |id: &'static str,
                           label: &'static str,
                           accept: &'static str,
                           node: NodeRef<Input>,
                           multiple: bool| {
        view! {
            <div class="field" class:invalid=move || errors.with(|e| e.contains_key(id))>
                <label for=id>{label}</label>
                <input
                    id=id
                    type="file"
                    accept=accept
                    multiple=multiple
                    node_ref=node
                    on:change=move |_| {
                        let name = node
                            .get_untracked()
                            .and_then(|input| input.files())
                            .and_then(|list| list.item(0))
                            .map(|file| file.name());
                        files.update(|f| match name {
                            Some(name) => {
                                f.insert(id, name);
                            }
                            None => {
                                f.remove(id);
                            }
                        });
                        preview.set(None);
                    }
                />
                {error_for(id)}
            </div>
        }
    };

    // A data input filled from the picked server dataset.
    let dataset_file = move |id: &'static str, label: &'static str, names: Vec<String>| {
        view! {
            <div class="field" class:invalid=move || errors.with(|e| e.contains_key(id))>
                <label for=id>{label}</label>
                <select
                    id=id
                    prop:value=move || files.with(|f| f.get(id).cloned().unwrap_or_default())
                    on:change=move |ev| {
                        let value = event_target_value(&ev);
                        files.update(|f| {
                            if value.is_empty() {
                                f.remove(id);
                            } else {
                                f.insert(id, value);
                            }
                        });
                        preview.set(None);
                    }
                >
                    <option value="">"(none)"</option>
                    {names
                        .into_iter()
                        .map(|name| view! { <option value=name.clone()>{name.clone()}</option> })
                        .collect_view()}
                </select>
                {error_for(id)}
            </div>
        }
    };

    view! {
        <section class="page">
            <p class="crumbs">
                <a href="/jobs">"Jobs"</a>
                " / new"
            </p>
            <h1>"New job"</h1>
            <form id="new-job" class="form wide" on:submit=submit novalidate=true>
                <fieldset>
                    <legend>"Model"</legend>
                    {file_input("model-file", "ONNX export or layer-spec file", ".onnx,.toml", model_file, false)}
                    {file_input("model-data-file", "ONNX external data (.data), if the export has one", ".data", model_data, true)}
                    {text_input("input-shape", "Input shape (one sample)", "channels, height, width, e.g. 1, 28, 28")}
                </fieldset>
                <fieldset>
                    <legend>"Data"</legend>
                    {select("data-format", "Format", &[
                        ("idx", "IDX (MNIST), optionally gzipped"),
                        ("npy", "NumPy .npy"),
                        ("npz", "NumPy .npz"),
                        ("safetensors", "safetensors"),
                        ("csv", "CSV"),
                    ])}
                    <div class="field" class:invalid=move || errors.with(|e| e.contains_key("data-source"))>
                        <label for="data-source">"Data files"</label>
                        <select
                            id="data-source"
                            prop:value=move || source.get()
                            on:change=move |ev| pick_source(event_target_value(&ev))
                        >
                            <option value="">"Upload from this computer"</option>
                            {move || {
                                datasets
                                    .get()
                                    .into_iter()
                                    .map(|d| {
                                        let label = format!("On the server: {} ({} files)", d.name, d.files.len());
                                        view! { <option value=d.name>{label}</option> }
                                    })
                                    .collect_view()
                            }}
                        </select>
                        {error_for("data-source")}
                    </div>
                    {move || {
                        if source.with(String::is_empty) {
                            view! {
                                {file_input("train-inputs", "Training inputs", "", train_inputs, false)}
                                {file_input("train-labels", "Training labels", "", train_labels, false)}
                                {file_input("test-inputs", "Test inputs (optional)", "", test_inputs, false)}
                                {file_input("test-labels", "Test labels (optional)", "", test_labels, false)}
                            }
                                .into_any()
                        } else {
                            let names: Vec<String> = datasets.with(|all| {
                                all.iter()
                                    .find(|d| source.with(|s| &d.name == s))
                                    .map(|d| d.files.iter().map(|f| f.name.clone()).collect())
                                    .unwrap_or_default()
                            });
                            [
                                ("train-inputs", "Training inputs"),
                                ("train-labels", "Training labels"),
                                ("test-inputs", "Test inputs (optional)"),
                                ("test-labels", "Test labels (optional)"),
                            ]
                                .into_iter()
                                .map(|(id, label)| dataset_file(id, label, names.clone()))
                                .collect_view()
                                .into_any()
                        }
                    }}
                    {text_input("scale", "Scale", "inputs become (x × scale − mean) / std; 1/255 for bytes")}
                    {text_input("mean", "Mean", "empty: 0")}
                    {text_input("std", "Std", "empty: 1")}
                </fieldset>
                <fieldset>
                    <legend>"Training"</legend>
                    {select("loss", "Loss", &[("cross_entropy", "cross entropy"), ("mse", "mean squared error")])}
                    {select("optimizer", "Optimizer", &[
                        ("adam", "Adam"),
                        ("adamw", "AdamW"),
                        ("sgd", "SGD"),
                        ("rmsprop", "RMSprop"),
                    ])}
                    {text_input("lr", "Learning rate", "")}
                    {text_input("momentum", "Momentum", "SGD and RMSprop; empty: 0")}
                    {text_input("weight-decay", "Weight decay", "empty: 0")}
                    {text_input("epochs", "Epochs", "")}
                    {text_input("batch-size", "Batch size", "samples per cluster per step")}
                    {text_input("micro-batches", "Micro-batches", "a step's batch is cut into this many for the pipeline")}
                    {text_input("clusters", "Clusters", "`auto` or a number; each trains on its own share of the data")}
                    {text_input("stages", "Stages per cluster", "`auto` lets the planner choose")}
                    {text_input("sync-every", "Sync period (steps)", "steps between parameter averages")}
                    {select("wire-dtype", "Wire dtype", &[("f32", "f32"), ("f16", "f16"), ("bf16", "bf16")])}
                    {text_input("seed", "Seed", "")}
                </fieldset>
                {move || {
                    form_error
                        .get()
                        .map(|message| {
                            view! {
                                <div id="form-error" class="banner banner-error" role="alert">
                                    {message}
                                </div>
                            }
                        })
                }}
                <div class="actions">
                    <button type="button" id="preview-plan" on:click=preview_plan disabled=move || busy.get()>
                        "Preview plan"
                    </button>
                    <button type="submit" id="submit-job" class="primary" disabled=move || busy.get()>
                        "Submit job"
                    </button>
                </div>
            </form>
            {move || {
                plan_error
                    .get()
                    .map(|message| {
                        view! {
                            <div id="plan-error" class="banner banner-warn" role="status">
                                {message}
                            </div>
                        }
                    })
            }}
            {move || preview.get().map(|p| view! { <PlanTable preview=p /> })}
        </section>
    }
}

/// The previewed plan: the cluster chains, then one row per stage.
#[component]
fn PlanTable(preview: PlanPreview) -> impl IntoView {
    let rows = preview
        .plan
        .clusters
        .iter()
        .enumerate()
        .flat_map(|(c, cluster)| {
            cluster.stages.iter().map(move |stage| {
                view! {
                    <tr class="plan-stage" data-role=stage.role.clone()>
                        <td>{c}</td>
                        <td>{stage.role.clone()}</td>
                        <td>{format!("#{} {} ({})", stage.provider, stage.provider_name, stage.device)}</td>
                        <td class="num">{format::count(stage.param_count)}</td>
                        <td class="num">{format::bytes(stage.memory_bytes)}</td>
                        <td class="num">{format::seconds(stage.time_s)}</td>
                    </tr>
                }
            })
        })
        .collect_view();
    view! {
        <section id="plan-preview" class="plan-preview">
            <h2>"Plan with the providers connected now"</h2>
            <p class="note">
                {format!(
                    "{} training and {} test samples.",
                    format::count(preview.train_samples),
                    format::count(preview.test_samples),
                )}
            </p>
            {preview
                .warnings
                .iter()
                .map(|w| view! { <div class="banner banner-warn">{w.clone()}</div> })
                .collect_view()}
            {plan_diagram(&preview.plan)}
            <div class="table-scroll">
                <table>
                    <thead>
                        <tr>
                            <th scope="col">"Cluster"</th>
                            <th scope="col">"Stage"</th>
                            <th scope="col">"Provider"</th>
                            <th scope="col" class="num">"Parameters"</th>
                            <th scope="col" class="num">"Memory"</th>
                            <th scope="col" class="num">"Est. time / micro-batch"</th>
                        </tr>
                    </thead>
                    <tbody>{rows}</tbody>
                </table>
            </div>
        </section>
    }
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
        let mut spec = filled();
        spec.files.insert("model-file", "cnn.toml".into());
        spec.text.insert("stages", "3".into());
        let job = serde_json::to_value(build_job(&spec).unwrap()).unwrap();
        assert_eq!(job["model"]["spec"], "cnn.toml");
        assert_eq!(job["training"]["stages"], 3);
        assert_eq!(job_file_name(&spec), "cnn.json");
        assert_eq!(job_file_name(&FormValues::default()), "job.json");
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
        let ids: Vec<&str> = errors.keys().map(String::as_str).collect();
        assert_eq!(
            ids,
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
}
