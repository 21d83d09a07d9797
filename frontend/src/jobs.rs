//! The Jobs page: every job with its status, progress, loss, throughput,
//! providers and times, kept live by the event stream; running jobs can be
//! cancelled.
//!
//! DOM contract (end-to-end tests rely on it): `<table id="jobs">`, one
//! `<tr class="job" data-job-id data-status>` per job, a `button.cancel`
//! in rows that can be cancelled.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use leptos::prelude::*;
use rookery_proto::api::{JobEvent, JobEventBody, JobInfo, PlanView};

use crate::api::{self, use_auth};
use crate::format;

/// Whether a job can still change.
pub fn is_finished(status: &str) -> bool {
    matches!(status, "completed" | "failed" | "cancelled")
}

/// Folds one live event into a job: its whole row, or a step's progress.
pub fn apply_to_job(job: &mut JobInfo, event: &JobEvent) {
    match &event.body {
        JobEventBody::Job { job: fresh } => *job = fresh.clone(),
        // A late step must not move progress backwards.
        JobEventBody::Step { step } if step.step + 1 >= job.step => {
            job.step = step.step + 1;
            job.epoch = step.epoch;
            job.last_loss = Some(step.loss);
            job.samples_per_s = Some(step.samples_per_s);
        }
        _ => {}
    }
}

/// Folds one live event into the list (newest job first).
pub fn apply_to_list(jobs: &mut Vec<JobInfo>, event: &JobEvent) {
    match jobs.iter_mut().find(|j| j.id == event.job_id) {
        Some(job) => apply_to_job(job, event),
        None => {
            if let JobEventBody::Job { job } = &event.body {
                jobs.push(job.clone());
                jobs.sort_by_key(|j| std::cmp::Reverse(j.id));
            }
        }
    }
}

/// Distinct providers a plan uses.
pub fn providers_in_use(plan: &PlanView) -> usize {
    let mut ids: Vec<u64> = plan
        .clusters
        .iter()
        .flat_map(|c| c.stages.iter().map(|s| s.provider))
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids.len()
}

/// Progress as a fraction, 0 until planned.
pub fn progress(job: &JobInfo) -> f64 {
    if job.status == "completed" {
        1.0
    } else if job.total_steps == 0 {
        0.0
    } else {
        (job.step as f64 / job.total_steps as f64).clamp(0.0, 1.0)
    }
}

#[component]
pub fn JobsPage() -> impl IntoView {
    let auth = use_auth();
    let jobs = RwSignal::new(None::<Vec<JobInfo>>);
    let error = RwSignal::new(None::<String>);
    let now_ms = RwSignal::new(js_sys::Date::now());
    let alive = Arc::new(AtomicBool::new(true));
    on_cleanup({
        let alive = alive.clone();
        move || alive.store(false, Ordering::Relaxed)
    });
    let token = auth.token.get_untracked().unwrap_or_default();

    let reload = {
        let alive = alive.clone();
        let token = token.clone();
        move || {
            let alive = alive.clone();
            let token = token.clone();
            wasm_bindgen_futures::spawn_local(async move {
                let result = api::get_json::<Vec<JobInfo>>(&token, "/api/jobs").await;
                if !alive.load(Ordering::Relaxed) {
                    return;
                }
                match result {
                    Ok(list) => {
                        jobs.set(Some(list));
                        error.set(None);
                    }
                    Err(failure) => {
                        auth.check(&failure);
                        error.set(Some(failure.message));
                    }
                }
            });
        }
    };
    api::watch_live(
        auth,
        token.clone(),
        None,
        alive.clone(),
        now_ms,
        error,
        reload,
        move |event| {
            jobs.update(|list| {
                if let Some(list) = list.as_mut() {
                    apply_to_list(list, event);
                }
            })
        },
    );

    let cancel = move |id: u64| {
        let token = auth.token.get_untracked().unwrap_or_default();
        wasm_bindgen_futures::spawn_local(async move {
            let path = format!("/api/jobs/{id}/cancel");
            match api::post_empty::<JobInfo>(&token, &path).await {
                Ok(job) => jobs.update(|list| {
                    if let Some(list) = list.as_mut() {
                        apply_to_list(
                            list,
                            &JobEvent {
                                job_id: id,
                                body: JobEventBody::Job { job },
                            },
                        );
                    }
                }),
                Err(failure) => {
                    auth.check(&failure);
                    error.set(Some(failure.message));
                }
            }
        });
    };

    let rows = move || {
        let now = now_ms.get();
        jobs.get()
            .unwrap_or_default()
            .into_iter()
            .map(|job| job_row(job, now, cancel))
            .collect_view()
    };

    view! {
        <section class="page">
            <div class="page-head">
                <h1>"Jobs"</h1>
                <a class="button primary" href="/jobs/new" id="new-job-link">
                    "New job"
                </a>
            </div>
            {move || {
                error
                    .get()
                    .map(|message| {
                        view! {
                            <div id="api-error" class="banner banner-error" role="alert">
                                {message}
                            </div>
                        }
                    })
            }}
            <div class="table-scroll">
                <table id="jobs">
                    <thead>
                        <tr>
                            <th scope="col">"Job"</th>
                            <th scope="col">"Status"</th>
                            <th scope="col">"Progress"</th>
                            <th scope="col" class="num">"Loss"</th>
                            <th scope="col" class="num">"Samples/s"</th>
                            <th scope="col" class="num">"Providers"</th>
                            <th scope="col">"Started"</th>
                            <th scope="col">"Elapsed"</th>
                            <th scope="col"></th>
                        </tr>
                    </thead>
                    <tbody>{rows}</tbody>
                </table>
            </div>
            {move || {
                jobs.with(|list| match list {
                    None => Some(view! { <p class="note">"Loading jobs…"</p> }.into_any()),
                    Some(list) if list.is_empty() => {
                        Some(
                            view! {
                                <p id="jobs-empty" class="empty">
                                    "No jobs yet. " <a href="/jobs/new">"Create one"</a>
                                    " from an ONNX export or a layer-spec file and your data."
                                </p>
                            }
                                .into_any(),
                        )
                    }
                    _ => None,
                })
            }}
        </section>
    }
}

fn job_row(job: JobInfo, now_ms: f64, cancel: impl Fn(u64) + Copy + 'static) -> impl IntoView {
    let id = job.id;
    let percent = progress(&job) * 100.0;
    let elapsed = job.started_ms.map(|start| {
        let end = job.finished_ms.map_or(now_ms, |f| f as f64);
        format::duration((end - start as f64).max(0.0) as u64)
    });
    let steps = if job.total_steps > 0 {
        format!(
            "{} / {} steps",
            format::count(job.step),
            format::count(job.total_steps)
        )
    } else {
        String::new()
    };
    let can_cancel = !is_finished(&job.status);
    let status = job.status.clone();
    view! {
        <tr class="job" data-job-id=id.to_string() data-status=status.clone()>
            <td class="name">
                <a href=format!("/jobs/{id}")>{format!("#{id} {}", job.name)}</a>
            </td>
            <td class="status">
                <span class=format!("badge status-{status}")>{status.clone()}</span>
                {job.detail.map(|d| view! { <span class="detail">{d}</span> })}
            </td>
            <td class="progress-cell">
                <div class="progress" role="progressbar" aria-valuenow=format!("{percent:.0}")>
                    <div class="progress-bar" style=format!("width: {percent:.1}%")></div>
                </div>
                <span class="detail">{steps}</span>
            </td>
            <td class="num">{format::metric(job.last_loss, 4)}</td>
            <td class="num">{format::metric(job.samples_per_s, 0)}</td>
            <td class="num">
                {job.plan.as_ref().map_or_else(|| "–".into(), |p| providers_in_use(p).to_string())}
            </td>
            <td>{job.started_ms.map(|s| format::relative(now_ms, s)).unwrap_or_else(|| "–".into())}</td>
            <td>{elapsed.unwrap_or_else(|| "–".into())}</td>
            <td>
                {can_cancel
                    .then(|| {
                        view! {
                            <button class="cancel" on:click=move |_| cancel(id)>
                                "Cancel"
                            </button>
                        }
                    })}
            </td>
        </tr>
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rookery_proto::api::StepMetric;

    fn job(id: u64, status: &str) -> JobInfo {
        JobInfo {
            id,
            name: format!("j{id}"),
            status: status.into(),
            detail: None,
            created_ms: 0,
            started_ms: None,
            finished_ms: None,
            step: 0,
            total_steps: 10,
            epoch: 0,
            last_loss: None,
            samples_per_s: None,
            plan: None,
        }
    }

    fn step(job_id: u64, step: u64, loss: f64) -> JobEvent {
        JobEvent {
            job_id,
            body: JobEventBody::Step {
                step: StepMetric {
                    step,
                    epoch: 0,
                    loss,
                    samples_per_s: 50.0,
                    elapsed_ms: 1.0,
                    bytes_relayed: 0,
                    bytes_synced: 0,
                    stages: vec![],
                },
            },
        }
    }

    #[test]
    fn events_update_rows_add_new_jobs_on_top_and_never_go_backwards() {
        let mut list = vec![job(2, "running"), job(1, "completed")];
        apply_to_list(&mut list, &step(2, 4, 0.5));
        assert_eq!((list[0].step, list[0].last_loss), (5, Some(0.5)));
        apply_to_list(&mut list, &step(2, 2, 9.0));
        assert_eq!((list[0].step, list[0].last_loss), (5, Some(0.5)));
        // Steps of an unknown job wait for its row.
        apply_to_list(&mut list, &step(3, 0, 1.0));
        assert_eq!(list.len(), 2);
        apply_to_list(
            &mut list,
            &JobEvent {
                job_id: 3,
                body: JobEventBody::Job {
                    job: job(3, "queued"),
                },
            },
        );
        let ids: Vec<u64> = list.iter().map(|j| j.id).collect();
        assert_eq!(ids, [3, 2, 1]);
        assert!((progress(&list[1]) - 0.5).abs() < 1e-12);
        assert_eq!(progress(&list[2]), 1.0);
        assert!(is_finished("cancelled") && !is_finished("running"));
    }
}
