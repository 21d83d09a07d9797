//! The Job detail page: each cluster drawn as its chain of stages (Root ->
//! Stem -> Leaf) with the provider on each, live charts of training loss,
//! throughput and test metrics, per-stage busy and idle time, the event log,
//! and downloads of the weights and metrics.
//!
//! DOM contract (end-to-end tests rely on it): `#job[data-status]`,
//! `.cluster[data-cluster]` holding `.stage-node[data-role][data-kind]`,
//! charts `svg#loss-chart`, `#throughput-chart`, `#test-loss-chart`,
//! `#accuracy-chart` (see `chart`), `ol#job-log > li[data-kind]`, and the
//! buttons `#download-weights`, `#download-metrics-json`,
//! `#download-metrics-csv`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use leptos::prelude::*;
use leptos_router::hooks::use_params_map;
use rookery_proto::api::{
    EpochMetric, JobEvent, JobEventBody, JobInfo, JobMetrics, LogEntry, PlanView, StepMetric,
};

use crate::api::{self, use_auth};
use crate::chart::LineChart;
use crate::format;
use crate::jobs::{apply_to_job, is_finished, progress};

/// Busy and idle time of one stage over the steps seen, and the plan's
/// estimate of the busy time.
#[derive(Debug, Clone, PartialEq)]
pub struct StageTimes {
    pub cluster: u32,
    pub stage: u32,
    pub provider: u64,
    pub busy_ms: f64,
    pub idle_ms: f64,
    pub planned_ms: f64,
    /// The most micro-batches whose activations it held at once in any step.
    pub peak_held: u32,
}

impl StageTimes {
    pub fn busy_fraction(&self) -> f64 {
        let total = self.busy_ms + self.idle_ms;
        if total > 0.0 {
            self.busy_ms / total
        } else {
            0.0
        }
    }
}

/// Sums each stage's compute and idle time over `steps`, in cluster and
/// stage order.
pub fn stage_times(steps: &[StepMetric]) -> Vec<StageTimes> {
    let mut by_stage: BTreeMap<(u32, u32), StageTimes> = BTreeMap::new();
    for step in steps {
        for s in &step.stages {
            let entry = by_stage
                .entry((s.cluster, s.stage))
                .or_insert_with(|| StageTimes {
                    cluster: s.cluster,
                    stage: s.stage,
                    provider: s.provider,
                    busy_ms: 0.0,
                    idle_ms: 0.0,
                    planned_ms: 0.0,
                    peak_held: 0,
                });
            entry.peak_held = entry.peak_held.max(s.peak_held);
            entry.busy_ms += s.compute_ms;
            entry.idle_ms += s.idle_ms;
            entry.planned_ms += s.planned_ms;
        }
    }
    by_stage.into_values().collect()
}

/// Adds a live step or epoch to the metrics, ignoring repeats (the stream
/// and a reload may both carry one).
pub fn merge_metric(metrics: &mut JobMetrics, body: &JobEventBody) {
    match body {
        JobEventBody::Step { step }
            if metrics
                .steps
                .last()
                .is_none_or(|last| last.step < step.step) =>
        {
            metrics.steps.push(step.clone());
        }
        JobEventBody::Epoch { epoch }
            if metrics
                .epochs
                .last()
                .is_none_or(|last| last.step < epoch.step) =>
        {
            metrics.epochs.push(epoch.clone());
        }
        _ => {}
    }
}

#[component]
pub fn JobDetailPage() -> impl IntoView {
    let auth = use_auth();
    let params = use_params_map();
    let id = params.with_untracked(|p| p.get("id").and_then(|id| id.parse::<u64>().ok()));
    let Some(id) = id else {
        return view! {
            <section class="page">
                <h1>"No such job"</h1>
                <p>"The address does not name a job. See " <a href="/jobs">"all jobs"</a> "."</p>
            </section>
        }
        .into_any();
    };
    let token = auth.token.get_untracked().unwrap_or_default();
    let job = RwSignal::new(None::<JobInfo>);
    let metrics = RwSignal::new(JobMetrics::default());
    let log = RwSignal::new(Vec::<LogEntry>::new());
    let error = RwSignal::new(None::<String>);
    let now_ms = RwSignal::new(js_sys::Date::now());
    let alive = Arc::new(AtomicBool::new(true));
    on_cleanup({
        let alive = alive.clone();
        move || alive.store(false, Ordering::Relaxed)
    });

    let reload = {
        let alive = alive.clone();
        let token = token.clone();
        move || {
            let alive = alive.clone();
            let token = token.clone();
            wasm_bindgen_futures::spawn_local(async move {
                let info = api::get_json::<JobInfo>(&token, &format!("/api/jobs/{id}")).await;
                let m =
                    api::get_json::<JobMetrics>(&token, &format!("/api/jobs/{id}/metrics")).await;
                let l =
                    api::get_json::<Vec<LogEntry>>(&token, &format!("/api/jobs/{id}/log")).await;
                if !alive.load(Ordering::Relaxed) {
                    return;
                }
                match (info, m, l) {
                    (Ok(info), Ok(m), Ok(l)) => {
                        job.set(Some(info));
                        metrics.set(m);
                        log.set(l);
                        error.set(None);
                    }
                    (Err(failure), _, _) | (_, Err(failure), _) | (_, _, Err(failure)) => {
                        auth.check(&failure);
                        error.set(Some(failure.message));
                    }
                }
            });
        }
    };
    let update_job = move |event: &JobEvent| {
        job.update(|j| {
            if let Some(j) = j.as_mut() {
                apply_to_job(j, event);
            }
        })
    };
    api::watch_live(
        auth,
        token.clone(),
        Some(id),
        alive.clone(),
        now_ms,
        error,
        reload,
        move |event| match &event.body {
            JobEventBody::Log { entry } => log.update(|l| l.push(entry.clone())),
            JobEventBody::Job { .. } => update_job(event),
            body => {
                metrics.update(|m| merge_metric(m, body));
                update_job(event);
            }
        },
    );

    let loss_points = Signal::derive(move || {
        metrics.with(|m| m.steps.iter().map(|s| (s.step as f64, s.loss)).collect())
    });
    let speed_points = Signal::derive(move || {
        metrics.with(|m| {
            m.steps
                .iter()
                .map(|s| (s.step as f64, s.samples_per_s))
                .collect()
        })
    });
    let epoch_points = move |pick: fn(&EpochMetric) -> f64| {
        Signal::derive(move || {
            metrics.with(|m| m.epochs.iter().map(|e| (e.step as f64, pick(e))).collect())
        })
    };
    let test_loss = epoch_points(|e| e.test_loss);
    let accuracy = epoch_points(|e| e.test_accuracy * 100.0);

    let download = move |path: String, name: String| {
        let token = auth.token.get_untracked().unwrap_or_default();
        wasm_bindgen_futures::spawn_local(async move {
            if let Err(failure) = api::download(&token, &path, &name).await {
                auth.check(&failure);
                error.set(Some(failure.message));
            }
        });
    };
    let cancel = move |_| {
        let token = auth.token.get_untracked().unwrap_or_default();
        wasm_bindgen_futures::spawn_local(async move {
            match api::post_empty::<JobInfo>(&token, &format!("/api/jobs/{id}/cancel")).await {
                Ok(info) => job.set(Some(info)),
                Err(failure) => {
                    auth.check(&failure);
                    error.set(Some(failure.message));
                }
            }
        });
    };

    let header = move || {
        job.get().map(|j| {
            let now = now_ms.get();
            let elapsed = j.started_ms.map(|start| {
                let end = j.finished_ms.map_or(now, |f| f as f64);
                format::duration((end - start as f64).max(0.0) as u64)
            });
            let percent = progress(&j) * 100.0;
            let running = !is_finished(&j.status);
            view! {
                <div class="page-head">
                    <h1>{format!("Job #{} {}", j.id, j.name)}</h1>
                    <span id="job-status" class=format!("badge status-{}", j.status)>
                        {j.status.clone()}
                    </span>
                    {running.then(|| view! { <button class="cancel" on:click=cancel>"Cancel"</button> })}
                </div>
                {j.detail.clone().map(|d| view! { <p class="note">{d}</p> })}
                <dl class="facts">
                    <div>
                        <dt>"Progress"</dt>
                        <dd>
                            <div class="progress">
                                <div class="progress-bar" style=format!("width: {percent:.1}%")></div>
                            </div>
                            {format!(
                                "{} / {} steps, epoch {}",
                                format::count(j.step),
                                format::count(j.total_steps),
                                j.epoch + 1,
                            )}
                        </dd>
                    </div>
                    <div>
                        <dt>"Loss"</dt>
                        <dd id="job-loss">{format::metric(j.last_loss, 4)}</dd>
                    </div>
                    <div>
                        <dt>"Samples/s"</dt>
                        <dd>{format::metric(j.samples_per_s, 0)}</dd>
                    </div>
                    <div>
                        <dt>"Elapsed"</dt>
                        <dd>{elapsed.unwrap_or_else(|| "–".into())}</dd>
                    </div>
                </dl>
            }
        })
    };

    view! {
        <section
            class="page"
            id="job"
            data-job-id=id.to_string()
            data-status=move || job.with(|j| j.as_ref().map(|j| j.status.clone()).unwrap_or_default())
        >
            <p class="crumbs">
                <a href="/jobs">"Jobs"</a>
                " / "
                {format!("#{id}")}
            </p>
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
            {header}
            <h2>"Clusters"</h2>
            {move || match job.with(|j| j.as_ref().and_then(|j| j.plan.clone())) {
                Some(plan) => plan_diagram(&plan).into_any(),
                None => view! { <p class="note">"Not planned yet: the job waits for providers."</p> }.into_any(),
            }}
            <h2>"Training"</h2>
            <div class="charts">
                <LineChart id="loss-chart" title="Training loss per step" x_label="steps" points=loss_points />
                <LineChart id="throughput-chart" title="Samples per second" x_label="steps" points=speed_points />
                <LineChart id="test-loss-chart" title="Test loss" x_label="steps" points=test_loss dots=true />
                <LineChart id="accuracy-chart" title="Test accuracy (%)" x_label="steps" points=accuracy dots=true />
            </div>
            <h2>"Stages: busy and idle"</h2>
            {move || {
                let times = metrics.with(|m| stage_times(&m.steps));
                if times.is_empty() {
                    view! { <p class="note">"No step measured yet."</p> }.into_any()
                } else {
                    view! {
                        <div class="table-scroll">
                            <table id="stage-times">
                                <thead>
                                    <tr>
                                        <th scope="col">"Cluster"</th>
                                        <th scope="col">"Stage"</th>
                                        <th scope="col">"Provider"</th>
                                        <th scope="col" class="num">"Busy"</th>
                                        <th scope="col" class="num" title="The plan's estimate of the busy time">"Planned"</th>
                                        <th scope="col" class="num">"Idle"</th>
                                        <th scope="col" class="num" title="The most micro-batches whose activations the stage held at once">"Held"</th>
                                        <th scope="col">"Busy share"</th>
                                    </tr>
                                </thead>
                                <tbody>
                                    {times
                                        .into_iter()
                                        .map(|t| {
                                            let share = t.busy_fraction() * 100.0;
                                            view! {
                                                <tr>
                                                    <td>{t.cluster}</td>
                                                    <td>{t.stage}</td>
                                                    <td>{format!("#{}", t.provider)}</td>
                                                    <td class="num">{format::duration(t.busy_ms as u64)}</td>
                                                    <td class="num planned">{format::duration(t.planned_ms as u64)}</td>
                                                    <td class="num">{format::duration(t.idle_ms as u64)}</td>
                                                    <td class="num held">{t.peak_held}</td>
                                                    <td>
                                                        <div class="progress">
                                                            <div class="progress-bar" style=format!("width: {share:.1}%")></div>
                                                        </div>
                                                        {format!("{share:.0}%")}
                                                    </td>
                                                </tr>
                                            }
                                        })
                                        .collect_view()}
                                </tbody>
                            </table>
                        </div>
                    }
                        .into_any()
                }
            }}
            <h2>"Downloads"</h2>
            <div class="downloads">
                <button
                    id="download-weights"
                    on:click=move |_| download(format!("/api/jobs/{id}/weights"), format!("job-{id}-weights.safetensors"))
                >
                    "Weights (safetensors)"
                </button>
                {move || {
                    // Each cluster's own weights, kept once a job of several completes.
                    let clusters = job.with(|j| {
                        j.as_ref()
                            .filter(|j| j.status == "completed")
                            .and_then(|j| j.plan.as_ref())
                            .map_or(0, |p| p.clusters.len())
                    });
                    (clusters > 1)
                        .then(|| {
                            (0..clusters)
                                .map(|c| {
                                    view! {
                                        <button
                                            class="download-cluster"
                                            on:click=move |_| download(
                                                format!("/api/jobs/{id}/weights?cluster={c}"),
                                                format!("job-{id}-weights-cluster-{c}.safetensors"),
                                            )
                                        >
                                            {format!("Cluster {c}'s weights")}
                                        </button>
                                    }
                                })
                                .collect_view()
                        })
                }}
                <button
                    id="download-metrics-json"
                    on:click=move |_| download(format!("/api/jobs/{id}/metrics"), format!("job-{id}-metrics.json"))
                >
                    "Metrics (JSON)"
                </button>
                <button
                    id="download-metrics-csv"
                    on:click=move |_| download(format!("/api/jobs/{id}/metrics.csv"), format!("job-{id}-metrics.csv"))
                >
                    "Metrics (CSV)"
                </button>
            </div>
            <h2>"Event log"</h2>
            <ol id="job-log" class="log">
                {move || {
                    let now = now_ms.get();
                    log.with(|entries| format::group_log(entries))
                        .into_iter()
                        .rev()
                        .map(|line| {
                            view! {
                                <li data-kind=line.kind.clone() data-entries=line.entries.to_string()>
                                    <time>{format::relative(now, line.at_ms)}</time>
                                    <span class="log-kind">{line.kind.replace('_', " ")}</span>
                                    <span class="log-message">{line.message}</span>
                                </li>
                            }
                        })
                        .collect_view()
                }}
            </ol>
        </section>
    }
    .into_any()
}

/// Each cluster as a chain of stage nodes.
pub fn plan_diagram(plan: &PlanView) -> impl IntoView + use<> {
    let clusters = plan
        .clusters
        .iter()
        .enumerate()
        .map(|(c, cluster)| {
            let count = cluster.stages.len();
            let nodes = cluster
                .stages
                .iter()
                .enumerate()
                .map(|(s, stage)| {
                    let kind = stage.provider_kind.as_str();
                    view! {
                        <li class="stage-node" data-role=stage.role.clone() data-kind=kind>
                            <span class="stage-role">{stage.role.clone()}</span>
                            <span class="stage-provider">
                                {format!("#{} {}", stage.provider, stage.provider_name)}
                            </span>
                            <span class=format!("badge kind-{kind}")>{kind}</span>
                            <span class="stage-device">{stage.device.clone()}</span>
                            <span class="stage-size">
                                {format!(
                                    "{} params, {} nodes, {}",
                                    format::count(stage.param_count),
                                    stage.nodes,
                                    format::bytes(stage.memory_bytes),
                                )}
                            </span>
                            <span class="stage-time">
                                {format!("{} per micro-batch", format::seconds(stage.time_s))}
                            </span>
                        </li>
                        {(s + 1 < count).then(|| view! { <li class="stage-arrow" aria-hidden="true">"→"</li> })}
                    }
                })
                .collect_view();
            view! {
                <div class="cluster" data-cluster=c.to_string()>
                    <h3>
                        {format!(
                            "Cluster {c}: bottleneck {} per micro-batch",
                            format::seconds(cluster.bottleneck_s),
                        )}
                    </h3>
                    <ol class="chain">{nodes}</ol>
                </div>
            }
        })
        .collect_view();
    view! {
        <div class="plan">
            <p class="note">
                {format!(
                    "{} parameters ({}) over {} cluster(s); micro-batches of {} samples.",
                    format::count(plan.param_count),
                    format::bytes(plan.param_bytes),
                    plan.clusters.len(),
                    plan.micro_batch,
                )}
            </p>
            {clusters}
        </div>
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rookery_proto::api::StageMetric;

    fn step(step: u64, stages: &[(u32, u32, f64, f64)]) -> StepMetric {
        StepMetric {
            step,
            epoch: 0,
            loss: 1.0,
            samples_per_s: 1.0,
            elapsed_ms: 1.0,
            bytes_relayed: 0,
            bytes_synced: 0,
            stages: stages
                .iter()
                .map(|&(cluster, stage, compute_ms, idle_ms)| StageMetric {
                    cluster,
                    stage,
                    provider: u64::from(cluster * 10 + stage),
                    compute_ms,
                    idle_ms,
                    planned_ms: compute_ms / 2.0,
                    peak_held: 2,
                })
                .collect(),
        }
    }

    #[test]
    fn stage_times_sum_over_steps_in_cluster_and_stage_order() {
        let steps = [
            step(0, &[(1, 0, 5.0, 5.0), (0, 1, 1.0, 3.0), (0, 0, 2.0, 0.0)]),
            step(1, &[(0, 0, 2.0, 4.0), (0, 1, 3.0, 1.0), (1, 0, 5.0, 5.0)]),
        ];
        let times = stage_times(&steps);
        let summary: Vec<(u32, u32, u64, f64, f64, f64)> = times
            .iter()
            .map(|t| {
                (
                    t.cluster,
                    t.stage,
                    t.provider,
                    t.busy_ms,
                    t.idle_ms,
                    t.planned_ms,
                )
            })
            .collect();
        assert_eq!(
            summary,
            [
                (0, 0, 0, 4.0, 4.0, 2.0),
                (0, 1, 1, 4.0, 4.0, 2.0),
                (1, 0, 10, 10.0, 10.0, 5.0)
            ]
        );
        assert_eq!(times[0].busy_fraction(), 0.5);
    }

    #[test]
    fn repeated_live_metrics_are_kept_once() {
        let mut metrics = JobMetrics::default();
        for s in [0, 1, 1, 0, 2] {
            merge_metric(&mut metrics, &JobEventBody::Step { step: step(s, &[]) });
        }
        let steps: Vec<u64> = metrics.steps.iter().map(|s| s.step).collect();
        assert_eq!(steps, [0, 1, 2]);
    }
}
