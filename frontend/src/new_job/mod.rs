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
//! `select#data-source` picks a dataset kept on the server; no labels
//! inputs when `#data-format` is `tokens`); the other inputs by the ids in
//! [`FIELDS`], each present only while it applies ([`form::shown`]: the
//! token inputs for token data, cross entropy's options, the chosen
//! schedule's fields); `#error-<id>` next to a field in error; `button#preview-plan`,
//! `#plan-preview` (with `.cluster` and `tr.plan-stage` rows), `#form-error`,
//! and `button#submit-job`, which opens the new job's page.

pub mod form;

use std::collections::BTreeMap;

use leptos::html::Input;
use leptos::prelude::*;
use leptos_router::hooks::use_navigate;
use rookery_proto::api::{DatasetInfo, JobCreated, PlanPreview};
use wasm_bindgen::JsCast;

pub use form::{
    DATA_INPUTS, FIELDS, FILE_FIELDS, FieldErrors, FormValues, LABEL_INPUTS, build_job, defaults,
    guess_file, input_for, job_file_name,
};

use crate::api::{self, use_auth};
use crate::format;
use crate::job_detail::plan_diagram;

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
    let tokens = Memo::new(move |_| text.with(form::is_tokens));
    // Whether an input applies to the current choices; read inside its own
    // closure so only that input mounts and unmounts.
    let shown = move |id: &str| text.with(|t| form::shown(t, id));
    // The uploaded labels inputs unmount for token data, dropping their
    // files: forget the names too, so a return to another format asks again.
    Effect::new(move |_| {
        if tokens.get() && source.with_untracked(String::is_empty) {
            files.update(|f| {
                for id in LABEL_INPUTS {
                    f.remove(id);
                }
            });
        }
    });
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
            .filter(|(id, _)| !(values.is_tokens() && LABEL_INPUTS.contains(id)))
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
    // A token file's inputs are its tokens.
    let data_label = move |id: &'static str, label: &'static str| {
        if tokens.get() {
            form::tokens_label(id).unwrap_or(label)
        } else {
            label
        }
    };
    let file_input = move |id: &'static str,
                           label: &'static str,
                           accept: &'static str,
                           node: NodeRef<Input>,
                           multiple: bool| {
        view! {
            <div class="field" class:invalid=move || errors.with(|e| e.contains_key(id))>
                <label for=id>{move || data_label(id, label)}</label>
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
                <label for=id>{move || data_label(id, label)}</label>
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
                {text_input(
                    "public-name",
                    "Public name (optional)",
                    "shown to donors whose tabs train this job; empty keeps the job private",
                )}
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
                        ("tokens", "Token ids (language model): raw .u16/.u32, maybe gzipped, or .npy"),
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
                                {move || shown("train-labels").then(|| file_input("train-labels", "Training labels", "", train_labels, false))}
                                {file_input("test-inputs", "Test inputs (optional)", "", test_inputs, false)}
                                {move || shown("test-labels").then(|| file_input("test-labels", "Test labels (optional)", "", test_labels, false))}
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
                                .map(|(id, label)| {
                                    let names = names.clone();
                                    move || shown(id).then(|| dataset_file(id, label, names.clone()))
                                })
                                .collect_view()
                                .into_any()
                        }
                    }}
                    {move || {
                        shown("seq-len")
                            .then(|| {
                                view! {
                                    {text_input("seq-len", "Sequence length", "tokens one sample feeds the model; the input shape is this number alone")}
                                    {select("token-dtype", "Token width", &[
                                        ("", "from the file: a .u16/.u32 name or the .npy header"),
                                        ("u16", "u16"),
                                        ("u32", "u32"),
                                    ])}
                                }
                            })
                    }}
                    {move || {
                        shown("scale")
                            .then(|| {
                                view! {
                                    {text_input("scale", "Scale", "inputs become (x × scale − mean) / std; 1/255 for bytes")}
                                    {text_input("mean", "Mean", "empty: 0")}
                                    {text_input("std", "Std", "empty: 1")}
                                }
                            })
                    }}
                </fieldset>
                <fieldset>
                    <legend>"Training"</legend>
                    {select("loss", "Loss", &[("cross_entropy", "cross entropy"), ("mse", "mean squared error")])}
                    {move || {
                        shown("class-axis")
                            .then(|| {
                                view! {
                                    {select("class-axis", "Class axis of the logits", &[
                                        ("1", "1 (torch's [N, C, ...])"),
                                        ("-1", "last ([N, ..., C], logits.view(-1, V))"),
                                    ])}
                                    {text_input("ignore-index", "Ignore index", "labels equal to this add no loss; empty: -100")}
                                }
                            })
                    }}
                    {select("optimizer", "Optimizer", &[
                        ("adam", "Adam"),
                        ("adamw", "AdamW"),
                        ("sgd", "SGD"),
                        ("rmsprop", "RMSprop"),
                    ])}
                    {text_input("lr", "Learning rate", "")}
                    {text_input("momentum", "Momentum", "SGD and RMSprop; empty: 0")}
                    {text_input("weight-decay", "Weight decay", "empty: 0")}
                    {select("lr-schedule", "Learning-rate schedule", &[
                        ("none", "none (the learning rate throughout)"),
                        ("constant", "constant, after a warm-up"),
                        ("linear", "linear decay to 0"),
                        ("cosine", "cosine decay"),
                        ("step", "step decay (StepLR)"),
                    ])}
                    {move || shown("warmup-steps").then(|| text_input("warmup-steps", "Warm-up steps", "the rate rises linearly from 0 over these; empty: 0"))}
                    {move || shown("total-steps").then(|| text_input("total-steps", "Total steps", "where the decay ends; empty: the whole job"))}
                    {move || shown("min-lr").then(|| text_input("min-lr", "Minimum learning rate", "the cosine's floor, at most the learning rate; empty: 0"))}
                    {move || shown("step-size").then(|| text_input("step-size", "Step size", "steps between multiplications by gamma"))}
                    {move || shown("gamma").then(|| text_input("gamma", "Gamma", "the factor every step size; empty: 0.1"))}
                    {text_input("clip-grad-norm", "Clip gradient norm", "clip_grad_norm_'s max_norm over the whole model; empty: no clipping")}
                    {text_input("epochs", "Epochs", "")}
                    {text_input("batch-size", "Batch size", "samples per cluster per step")}
                    {text_input("micro-batches", "Micro-batches", "a step's batch is cut into this many for the pipeline")}
                    {text_input("clusters", "Clusters", "`auto` or a number; each trains on its own share of the data")}
                    {text_input("stages", "Stages per cluster", "`auto` lets the planner choose")}
                    {text_input("sync-every", "Sync period (steps)", "steps between parameter averages")}
                    {text_input("val-every", "Evaluate every (steps)", "empty: on the test set after each epoch only (Ravnest's val_freq)")}
                    {select("wire-dtype", "Wire dtype", &[("f32", "f32"), ("f16", "f16"), ("bf16", "bf16"), ("int8", "int8")])}
                    {select("precision", "Precision", &[("f32", "f32"), ("mixed", "Mixed: matrix products on f16 operands (tensor cores), f32 sums")])}
                    {select("schedule", "Pipeline schedule", &[("gpipe", "GPipe: all micro-batches at once"), ("1f1b", "1F1B: the same result, less memory per stage"), ("async", "Async (PipeDream-2BW): no flush between syncs, a one-step weight delay, predicted")])}
                    {select("average-optimizer", "Average optimizer state at syncs", &[("no", "no: each cluster keeps its own"), ("yes", "yes (Ravnest's average_optim)")])}
                    {select("outer-optimizer", "Outer optimizer at syncs", &[("none", "none: plain averaging"), ("nesterov", "Nesterov (DiLoCo)"), ("sgd", "SGD")])}
                    {text_input("outer-lr", "Outer learning rate", "DiLoCo uses 0.7")}
                    {text_input("outer-momentum", "Outer momentum", "empty: 0.9 for Nesterov, 0 for SGD")}
                    {select("sync-compress", "Sync uploads", &[("none", "f32 parameters"), ("int8", "int8 changes since the last sync")])}
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
