//! Starting a run: the plan's stages become slots with their providers,
//! the parameters their initial (or resumed) values, and every stage gets an
//! `Assign`. A cluster is also rebuilt from here after it lost a provider.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Instant;

use rookery_job::{Dataset, JobError, JobSpec, Schedule};
use rookery_model::{Analysis, DType, Graph, Init};
use rookery_plan::Plan;
use rookery_proto::{Assignment, ToProvider, WireDType};

use super::{
    ClusterRun, ClusterState, Effect, JobRun, ParamValue, ResumePoint, StageSlot, State, on_wire,
    param_bytes,
};

/// Why a job cannot start on the plan it was given (the job fails with it).
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The training data does not fill a step of the plan's clusters.
    #[error(transparent)]
    Schedule(#[from] JobError),
    /// The schedule is longer than the job (it names its field).
    #[error(transparent)]
    LrSchedule(#[from] rookery_model::ScheduleError),
    #[error("the model has no input")]
    NoInput,
    #[error("the checkpoint has {checkpoint} clusters, the plan {plan}")]
    Clusters { checkpoint: usize, plan: usize },
    #[error("the checkpoint is at step {step}, past the job's {total_steps} steps")]
    PastTheEnd { step: u64, total_steps: u64 },
    #[error("the checkpoint holds unknown parameter `{0}`")]
    UnknownParam(String),
    #[error("the checkpoint's `{name}` has shape {checkpoint:?}, the model's {model:?}")]
    Shape {
        name: String,
        checkpoint: Vec<usize>,
        model: Vec<usize>,
    },
    /// The graph providers get cannot be written as JSON.
    #[error(transparent)]
    Graph(#[from] serde_json::Error),
    #[error("the checkpoint's values cannot be read: {0}")]
    Value(String),
    #[error("the plan names unknown provider {0}")]
    UnknownProvider(String),
}

impl JobRun {
    /// Builds the run and the `Assign` frames for every stage of `plan`.
    /// `graph` is the model as imported (with its initial values, which
    /// become the run's parameters without a copy), `analysis` its analysis
    /// at the micro-batch size. Initialising a large model takes seconds:
    /// the server calls this off its coordinator task. With `resume`, the run starts
    /// from that sync point instead of step 0 (it must have as many clusters
    /// as the plan: the data's sharding depends on the count).
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        job_id: u64,
        spec: JobSpec,
        mut graph: Graph,
        analysis: &Analysis,
        plan: &Plan,
        provider_ids: &HashMap<String, u64>,
        train: Dataset,
        test: Option<Dataset>,
        resume: Option<ResumePoint>,
    ) -> Result<(Self, Vec<Effect>), StartError> {
        let t = &spec.training;
        let schedule = Schedule::new(train.len(), plan.clusters.len(), t.batch_size)?;
        // The job file's epochs are bounded (`MAX_EPOCHS`); saturating all
        // the same, so no job file can overflow the count.
        let total_steps = (schedule.steps_per_epoch as u64).saturating_mul(t.epochs);
        let lr_schedule = t.lr_schedule.resolve(t.optimizer.lr(), total_steps)?;
        let input = graph.inputs.first().ok_or(StartError::NoInput)?.clone();
        let (synced, mut optimizer, mut resumed, outer_momentum) = match resume {
            None => (0, None, HashMap::new(), BTreeMap::new()),
            Some(resume) => {
                if resume.optimizer.len() != plan.clusters.len() {
                    return Err(StartError::Clusters {
                        checkpoint: resume.optimizer.len(),
                        plan: plan.clusters.len(),
                    });
                }
                if resume.step > total_steps {
                    return Err(StartError::PastTheEnd {
                        step: resume.step,
                        total_steps,
                    });
                }
                let mut resumed = HashMap::with_capacity(resume.params.len());
                for w in resume.params {
                    let Some(p) = graph.params.iter().find(|p| p.name == w.name) else {
                        return Err(StartError::UnknownParam(w.name.clone()));
                    };
                    let shape = w.shape_usize();
                    if p.shape != shape {
                        return Err(StartError::Shape {
                            name: w.name.clone(),
                            checkpoint: shape,
                            model: p.shape.clone(),
                        });
                    }
                    // The file's buffer is kept as it is when it already
                    // holds the value as it travels.
                    let data = if w.dtype == on_wire(p.dtype, WireDType::F32)
                        && w.check_size().is_ok()
                    {
                        w.data
                    } else {
                        let values = w.to_f32().map_err(|e| StartError::Value(e.to_string()))?;
                        param_bytes(p.dtype, values)
                    };
                    resumed.insert(w.name, data);
                }
                let mut outer_momentum = BTreeMap::new();
                for m in resume.outer_momentum {
                    let shape = graph
                        .params
                        .iter()
                        .find(|p| p.name == m.name)
                        .map(|p| &p.shape);
                    if shape != Some(&m.shape_usize()) || m.dtype != WireDType::F32 {
                        return Err(StartError::UnknownParam(format!(
                            "{} (an outer momentum buffer)",
                            m.name
                        )));
                    }
                    m.check().map_err(|e| StartError::Value(e.to_string()))?;
                    outer_momentum.insert(m.name.clone(), m);
                }
                (resume.step, Some(resume.optimizer), resumed, outer_momentum)
            }
        };
        // Each parameter's value moves out of the graph (imported values are
        // not copied) or is drawn from its initialiser, one at a time; the
        // graph is left without values, which is how providers get it (the
        // values travel as tensors).
        let mut params = BTreeMap::new();
        for p in &mut graph.params {
            let init = std::mem::replace(&mut p.init, Init::Zeros);
            let data = match resumed.remove(&p.name) {
                Some(data) => data,
                None => {
                    let values = match init {
                        Init::Values { data } if data.len() == p.numel() => data,
                        init => init.materialize(&p.name, p.numel(), t.seed),
                    };
                    param_bytes(p.dtype, values)
                }
            };
            params.insert(
                p.name.clone(),
                ParamValue {
                    shape: p.shape.clone(),
                    dtype: p.dtype,
                    kind: p.kind,
                    data,
                },
            );
        }
        let graph_json = graph.to_json()?;
        drop(graph);
        let per_sample = |name: &str| -> (String, Vec<usize>, DType) {
            let info = analysis.tensors.get(name);
            let shape = info.map(|i| i.shape[1.min(i.shape.len())..].to_vec());
            (
                name.to_string(),
                shape.unwrap_or_default(),
                info.map_or(DType::F32, |i| i.dtype),
            )
        };
        let micro_batches = t.micro_batches.max(1) as f64;
        let mut clusters = Vec::with_capacity(plan.clusters.len());
        for (ci, cluster) in plan.clusters.iter().enumerate() {
            let mut stages = Vec::with_capacity(cluster.stages.len());
            for stage in &cluster.stages {
                let provider = *provider_ids
                    .get(&stage.provider)
                    .ok_or_else(|| StartError::UnknownProvider(stage.provider.clone()))?;
                let mut names: Vec<String> = analysis.nodes[stage.first..stage.end]
                    .iter()
                    .flat_map(|n| n.params.iter().cloned())
                    .collect();
                names.sort();
                names.dedup();
                let outputs: Vec<String> = stage.outputs.iter().map(|b| b.name.clone()).collect();
                stages.push(StageSlot {
                    provider,
                    vacant: false,
                    first: stage.first,
                    end: stage.end,
                    inputs: stage.inputs.iter().map(|b| per_sample(&b.name)).collect(),
                    outputs: outputs.iter().map(|n| per_sample(n)).collect(),
                    output_names: outputs,
                    params: names,
                    memory_bytes: stage.memory_bytes,
                    planned_ms: stage.compute_s * 1e3 * micro_batches,
                    peak_held: 0,
                    slowness: None,
                    slow_steps: 0,
                    ready: false,
                    grad_sum_of_squares: None,
                    step_done: false,
                    compute_ms: 0.0,
                    uploaded: false,
                    work_gflop: stage.compute_s * micro_batches * stage.provider_gflops,
                    busy: Default::default(),
                });
            }
            let state = optimizer
                .as_mut()
                .map(|o| std::mem::take(&mut o[ci]))
                .unwrap_or_default();
            clusters.push(ClusterRun {
                stages,
                state: ClusterState::Assigning,
                finished: BTreeMap::new(),
                optimizer: state.into_iter().map(|s| (s.name.clone(), s)).collect(),
                pending_optimizer: BTreeMap::new(),
                labels: HashMap::new(),
                micro_samples: HashMap::new(),
                relayed: HashSet::new(),
                micro_targets: HashMap::new(),
                reported: Default::default(),
                totals: Default::default(),
                ahead: None,
            });
        }
        let mut run = JobRun {
            job_id,
            graph_input: (input.name.clone(), input.dtype),
            graph_json,
            spec,
            train,
            test,
            schedule,
            total_steps,
            lr_schedule,
            perm: Vec::new(),
            perm_epoch: None,
            clusters,
            params,
            uploads: BTreeMap::new(),
            sync_round: 0,
            aggregating: None,
            cluster_weights: Vec::new(),
            outer_momentum,
            state: State::Assigning,
            synced,
            background_sync: None,
            recorded: synced,
            step_started: Instant::now(),
            bytes_relayed: 0,
            bytes_synced: 0,
            stage_failures: HashMap::new(),
            checks: Default::default(),
            next_check: 0,
        };
        let effects = (0..run.clusters.len())
            .flat_map(|c| run.rebuild(c))
            .collect();
        Ok((run, effects))
    }
}

impl JobRun {
    /// The `Assign` of stage `s` of cluster `c`, from the last checkpoint.
    pub(super) fn assignment(&self, c: usize, s: usize) -> Assignment {
        let t = &self.spec.training;
        let run = &self.clusters[c];
        let stage = &run.stages[s];
        Assignment {
            job_id: self.job_id,
            cluster: c as u32,
            stage: s as u32,
            stages: run.stages.len() as u32,
            graph_json: self.graph_json.clone(),
            first: stage.first as u32,
            end: stage.end as u32,
            outputs: stage.output_names.clone(),
            params: stage
                .params
                .iter()
                .filter_map(|n| self.params.get(n).map(|v| v.tensor(n)))
                .collect(),
            optimizer: t.optimizer,
            loss: t.loss,
            batch_size: t.batch_size as u32,
            micro_batches: t.micro_batches as u32,
            wire_dtype: t.wire_dtype,
            seed: t.seed,
            start_step: self.synced,
            optimizer_state: stage
                .params
                .iter()
                .filter_map(|n| run.optimizer.get(n).cloned())
                .collect(),
            lr_schedule: self.lr_schedule,
            clip_grad_norm: t.clip_grad_norm,
            public_name: self.spec.public_name.clone(),
            schedule: self.spec.training.schedule,
            sync_int8: self.syncs_int8(),
            precision: t.precision,
        }
    }

    /// Puts cluster `c` back to the last checkpoint: every stage is assigned
    /// afresh (the survivors too, which drops whatever they were doing), or,
    /// while a stage has no provider, the cluster waits for one.
    pub(super) fn rebuild(&mut self, c: usize) -> Vec<Effect> {
        let run = &mut self.clusters[c];
        run.reset();
        run.finished.clear();
        for stage in &mut run.stages {
            stage.ready = false;
            stage.grad_sum_of_squares = None;
            stage.step_done = false;
            stage.uploaded = false;
            stage.compute_ms = 0.0;
            stage.slow_steps = 0;
            stage.busy = Default::default();
        }
        if run.stages.iter().any(|s| s.vacant) {
            run.state = ClusterState::Waiting;
            return Vec::new();
        }
        run.state = ClusterState::Assigning;
        (0..self.clusters[c].stages.len())
            .map(|s| {
                Effect::Send(
                    self.clusters[c].stages[s].provider,
                    ToProvider::Assign(Box::new(self.assignment(c, s))),
                )
            })
            .collect()
    }
}
