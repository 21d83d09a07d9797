//! Syncs: at each barrier (every `sync_every` steps, each epoch's end and
//! the last step) every stage uploads its parameters and optimizer state,
//! the clusters' copies are aggregated, everyone gets the result back, and
//! the result is the checkpoint a rebuild or a restarted server starts from.

use std::collections::BTreeMap;

use rookery_job::Aggregation;
use rookery_model::{DType, ParamKind};
use rookery_proto::{
    OptimizerState, ParamOptimState, ParamSet, ToProvider, WireDType, WireTensor,
    train::OPTIMIZER_SLOTS,
};

use super::measure::wire_bytes;
use super::{
    AggregateWork, Aggregated, ClusterState, Effect, JobRun, OuterWork, Rejected, ResumePoint,
    State, TrainedWeights, aggregate,
};

impl JobRun {
    /// The first step once every stage is ready, or after a resume: a
    /// checkpoint taken where the job evaluates may still owe that
    /// evaluation (running it again records the same figures).
    pub(super) fn begin(&mut self) -> Vec<Effect> {
        if let Some(eval) = self.start_eval(self.synced) {
            return eval;
        }
        self.next_or_finish(self.synced)
    }

    /// The steps done at the next sync: a multiple of `sync_every` or of
    /// `val_every`, an epoch's end or the last step, whichever comes first.
    pub(super) fn barrier(&self) -> u64 {
        let spe = self.schedule.steps_per_epoch as u64;
        let every = self.spec.training.sync_every.max(1);
        let last = self.background_sync.unwrap_or(self.synced);
        let next = |m: u64| (last / m + 1) * m;
        let val = self
            .spec
            .training
            .val_every
            .map_or(u64::MAX, |v| next(v.max(1)));
        next(every)
            .min(next(spe))
            .min(val)
            .min(self.total_steps.max(last + 1))
    }

    /// Starts the sync once every cluster waits at the barrier (and the one
    /// before it is complete).
    pub(super) fn at_barrier(&mut self) -> Vec<Effect> {
        if self.state != State::Training
            || self.background_sync.is_some()
            || !self.clusters.iter().all(|r| r.state == ClusterState::Idle)
        {
            return Vec::new();
        }
        let step_done = self.barrier();
        if self.syncs_in_background(step_done) {
            self.background_sync = Some(step_done);
            let mut effects = self.request_uploads(step_done);
            effects.extend(self.start_step(step_done));
            effects
        } else {
            self.state = State::Syncing { step_done };
            self.request_uploads(step_done)
        }
    }

    /// Whether the sync at `step_done` may run while training goes on. With
    /// one cluster there is nothing to average, so the next step needs no
    /// new parameters: the sync only takes the checkpoint. Each stage
    /// handles its messages in order, so `UploadParams` sent before the next
    /// step's micro-batches uploads exactly the values after `step_done`
    /// steps, and the pipeline does not drain and wait for a round trip of
    /// uploads every step. Not where the job evaluates (the evaluation must
    /// see the checkpoint) nor at the last step (the job's weights are the
    /// checkpoint's).
    pub(super) fn syncs_in_background(&self, step_done: u64) -> bool {
        self.clusters.len() == 1
            && self.outer_step().is_none()
            && !self.evaluates_at(step_done)
            && step_done < self.total_steps
    }

    /// Whether stages upload their float parameters as int8 changes since
    /// the last sync: the job asks for it and has clusters to sync between
    /// (one cluster's sync is its checkpoint, which keeps full values).
    pub(super) fn syncs_int8(&self) -> bool {
        self.spec.training.sync_int8 && self.clusters.len() > 1
    }

    /// The job's DiLoCo outer optimizer, unless it is plain averaging.
    fn outer_step(&self) -> Option<rookery_job::OuterOptimizer> {
        self.spec
            .training
            .outer_optimizer
            .filter(|o| !o.is_plain_average())
    }

    /// Asks every stage for its parameters (and optimizer state) after
    /// `step_done` steps.
    pub(super) fn request_uploads(&mut self, step_done: u64) -> Vec<Effect> {
        self.uploads.clear();
        self.sync_round += 1;
        self.aggregating = None;
        let mut effects = Vec::new();
        for run in &mut self.clusters {
            run.pending_optimizer.clear();
            for stage in &mut run.stages {
                stage.uploaded = false;
                effects.push(Effect::Send(
                    stage.provider,
                    ToProvider::UploadParams {
                        job_id: self.job_id,
                        step: step_done,
                    },
                ));
            }
        }
        effects
    }

    /// The sync in progress, if an upload of `what` stamped `step` belongs
    /// to it.
    pub(super) fn sync_step_of(&self, what: &str, step: u64) -> Result<u64, Rejected> {
        let step_done = match (self.state, self.background_sync) {
            (State::Syncing { step_done }, _) | (State::Training, Some(step_done)) => step_done,
            _ => return Err(format!("{what} arrived outside a sync").into()),
        };
        if step != step_done {
            return Err(
                format!("{what} of step {step} during the sync of step {step_done}").into(),
            );
        }
        Ok(step_done)
    }

    /// A stage's optimizer state, which it sends just before its parameters
    /// at a sync; kept per cluster for the checkpoint.
    pub(super) fn on_optimizer_state(
        &mut self,
        c: usize,
        s: usize,
        o: OptimizerState,
    ) -> Result<Vec<Effect>, Rejected> {
        self.sync_step_of("optimizer state", o.step)?;
        let stage = &self.clusters[c].stages[s];
        if stage.uploaded {
            return Err("optimizer state after the stage's parameters".into());
        }
        for p in &o.params {
            if !stage.params.contains(&p.name) {
                return Err(Rejected::Fault(format!(
                    "parameter `{}` is not one of the stage's",
                    p.name
                )));
            }
            let shape = self
                .params
                .get(&p.name)
                .map(|v| v.shape.clone())
                .unwrap_or_default();
            for t in &p.slots {
                if !OPTIMIZER_SLOTS.contains(&t.name.as_str()) {
                    return Err(Rejected::Fault(format!(
                        "`{}` is not an optimizer state slot",
                        t.name
                    )));
                }
                if t.shape_usize() != shape || t.dtype != WireDType::F32 {
                    return Err(Rejected::Fault(format!(
                        "optimizer state `{}` of `{}` is {:?} {}, expected {shape:?} f32",
                        t.name,
                        p.name,
                        t.shape,
                        t.dtype.as_str()
                    )));
                }
                t.check().map_err(|e| Rejected::Fault(e.to_string()))?;
            }
        }
        self.bytes_synced += wire_bytes(o.params.iter().flat_map(|p| &p.slots));
        let pending = &mut self.clusters[c].pending_optimizer;
        for p in o.params {
            pending.insert(p.name.clone(), p);
        }
        Ok(Vec::new())
    }

    /// The sync of `step_done` is complete: its optimizer state becomes the
    /// checkpoint's, and a restarted server can resume from here.
    pub(super) fn commit_sync(&mut self, step_done: u64) -> Effect {
        self.synced = step_done;
        for run in &mut self.clusters {
            run.optimizer = std::mem::take(&mut run.pending_optimizer);
        }
        Effect::ResumePoint(Box::new(ResumePoint {
            step: step_done,
            params: self.params.iter().map(|(n, v)| v.tensor(n)).collect(),
            optimizer: self
                .clusters
                .iter()
                .map(|r| r.optimizer.values().cloned().collect())
                .collect(),
            outer_momentum: self.outer_momentum.values().cloned().collect(),
        }))
    }

    pub(super) fn on_params(
        &mut self,
        c: usize,
        s: usize,
        p: ParamSet,
    ) -> Result<Vec<Effect>, Rejected> {
        let step_done = self.sync_step_of("parameters", p.step)?;
        let stage = &self.clusters[c].stages[s];
        if stage.uploaded {
            return Err("parameters were already uploaded for this sync".into());
        }
        for t in &p.params {
            let fault = |reason: String| Rejected::Fault(reason);
            if !stage.params.contains(&t.name) {
                return Err(fault(format!(
                    "parameter `{}` is not one of the stage's",
                    t.name
                )));
            }
            let Some(current) = self.params.get(&t.name) else {
                return Err(fault(format!("unknown parameter `{}`", t.name)));
            };
            if t.shape_usize() != current.shape {
                return Err(fault(format!(
                    "parameter `{}` has shape {:?}, expected {:?}",
                    t.name, t.shape, current.shape
                )));
            }
            if t.dtype.is_quantized() && !(self.syncs_int8() && current.dtype == DType::F32) {
                return Err(fault(format!(
                    "parameter `{}` is int8, which is for activations and gradients{}",
                    t.name,
                    if self.syncs_int8() {
                        " and float parameters' changes"
                    } else {
                        " (this job's syncs are not compressed)"
                    }
                )));
            }
            t.check().map_err(|e| fault(e.to_string()))?;
        }
        let clusters = self.clusters.len();
        self.bytes_synced += wire_bytes(&p.params);
        // Kept as they arrived: the aggregation reads them where they lie.
        for t in p.params {
            self.uploads
                .entry(t.name.clone())
                .or_insert_with(|| Vec::with_capacity(clusters))
                .push((c, t));
        }
        self.clusters[c].stages[s].uploaded = true;
        let all = self
            .clusters
            .iter()
            .all(|r| r.stages.iter().all(|s| s.uploaded));
        if !all {
            return Ok(Vec::new());
        }
        Ok(self.aggregate(step_done))
    }

    /// Every upload of the sync of `step_done` is in: the clusters' copies
    /// are combined. One cluster's copy is the result as it stands (no
    /// arithmetic, no copy), so that happens here; several are combined off
    /// the coordinator ([`Effect::Aggregate`]), the sync waiting meanwhile.
    fn aggregate(&mut self, step_done: u64) -> Vec<Effect> {
        let several = self.clusters.len() > 1;
        // The job's last sync keeps each cluster's own weights.
        let keep_copies = (several && step_done >= self.total_steps).then(|| {
            self.params
                .iter()
                .filter(|(_, v)| v.kind != ParamKind::Constant)
                .map(|(name, _)| name.clone())
                .collect()
        });
        let optimizer = if several && self.spec.training.average_optimizer {
            self.clusters
                .iter()
                .map(|r| r.pending_optimizer.clone())
                .collect()
        } else {
            Vec::new()
        };
        let work = AggregateWork {
            round: self.sync_round,
            step_done,
            rule: self.spec.training.aggregation,
            clusters: self.clusters.len(),
            uploads: std::mem::take(&mut self.uploads),
            dtypes: self
                .params
                .iter()
                .map(|(name, v)| (name.clone(), v.dtype))
                .collect(),
            optimizer,
            outer: self.outer_step().map(|optimizer| OuterWork {
                optimizer,
                previous: self
                    .params
                    .iter()
                    .filter(|(_, v)| v.kind == ParamKind::Trainable)
                    .map(|(name, v)| (name.clone(), v.tensor(name)))
                    .collect(),
                momentum: self.outer_momentum.clone(),
            }),
            bases: if self.syncs_int8() {
                self.params
                    .iter()
                    .filter(|(_, v)| v.dtype == DType::F32)
                    .map(|(name, v)| (name.clone(), v.tensor(name)))
                    .collect()
            } else {
                BTreeMap::new()
            },
            keep_copies,
        };
        // One cluster's copy is combined here (no arithmetic, no copy),
        // unless an outer step computes with it.
        if self.clusters.len() == 1 && work.outer.is_none() {
            return self.finish_sync(work.run());
        }
        self.aggregating = Some(self.sync_round);
        vec![Effect::Aggregate(Box::new(work))]
    }

    /// The result of an [`Effect::Aggregate`]: the sync it belongs to
    /// completes. A result for a sync abandoned meanwhile (a stage was lost)
    /// is dropped.
    pub fn on_aggregated(&mut self, done: Aggregated) -> Vec<Effect> {
        if self.aggregating != Some(done.round) || self.state == State::Over {
            return Vec::new();
        }
        self.aggregating = None;
        self.finish_sync(done)
    }

    fn finish_sync(&mut self, done: Aggregated) -> Vec<Effect> {
        let Aggregated {
            step_done,
            params,
            squared_distances,
            squared_norm,
            optimizer,
            outer_momentum,
            cluster_copies,
            ..
        } = done;
        if !cluster_copies.is_empty() {
            self.cluster_weights = cluster_copies;
        }
        if self.outer_step().is_some() {
            self.outer_momentum = outer_momentum;
        }
        let rule = self.spec.training.aggregation;
        for (name, data) in params {
            if let Some(target) = self.params.get_mut(&name) {
                target.data = data;
            }
        }
        let mut effects = Vec::new();
        // Counted after the sync's own effects: the sync completes either way.
        let mut faults = Vec::new();
        if rule != Aggregation::Mean {
            for c in aggregate::far_off(&squared_distances, squared_norm) {
                let typical = squared_distances
                    .iter()
                    .map(|d| d.sqrt())
                    .fold(f64::INFINITY, f64::min);
                for stage in &self.clusters[c].stages {
                    faults.push(Effect::Fault {
                        provider: stage.provider,
                        reason: format!(
                            "cluster {c}'s parameters at the sync of step {step_done} are {:.3e} away from the {} of the clusters' (the closest cluster: {typical:.3e})",
                            squared_distances[c].sqrt(),
                            match rule {
                                Aggregation::Median => "median",
                                _ => "centered clip",
                            },
                        ),
                        frame_dropped: false,
                    });
                }
            }
        }
        if !optimizer.is_empty() {
            for run in &mut self.clusters {
                run.pending_optimizer.clone_from(&optimizer);
                for stage in &run.stages {
                    let params: Vec<ParamOptimState> = stage
                        .params
                        .iter()
                        .filter_map(|n| optimizer.get(n).cloned())
                        .collect();
                    if params.is_empty() {
                        continue;
                    }
                    // Before SetParams: the stage's next step uses both.
                    self.bytes_synced += wire_bytes(params.iter().flat_map(|p| &p.slots));
                    effects.push(Effect::Send(
                        stage.provider,
                        ToProvider::SetOptimizerState(OptimizerState {
                            job_id: self.job_id,
                            step: step_done,
                            params,
                        }),
                    ));
                }
            }
        }
        // An outer step moves even a single cluster's parameters.
        if self.clusters.len() > 1 || self.outer_step().is_some() {
            for run in &self.clusters {
                for stage in &run.stages {
                    // Every frame shares the one buffer of each parameter.
                    let params: Vec<WireTensor> = stage
                        .params
                        .iter()
                        .filter_map(|n| self.params.get(n).map(|v| v.tensor(n)))
                        .collect();
                    self.bytes_synced += wire_bytes(&params);
                    effects.push(Effect::Send(
                        stage.provider,
                        ToProvider::SetParams(ParamSet {
                            job_id: self.job_id,
                            step: step_done,
                            params,
                        }),
                    ));
                }
            }
        }
        effects.push(Effect::Checkpoint(self.weights()));
        effects.push(self.commit_sync(step_done));
        effects.extend(self.launch_checks());
        if self.background_sync.take().is_some() {
            // Training went on; the cluster may already wait at the next barrier.
            effects.extend(self.at_barrier());
            effects.extend(faults);
            return effects;
        }
        if let Some(eval) = self.start_eval(step_done) {
            effects.extend(eval);
            effects.extend(faults);
            return effects;
        }
        effects.extend(self.next_or_finish(step_done));
        effects.extend(faults);
        effects
    }

    pub(super) fn next_or_finish(&mut self, step_done: u64) -> Vec<Effect> {
        if step_done >= self.total_steps {
            let mut effects = self.release();
            effects.push(Effect::Completed(TrainedWeights {
                combined: self.weights(),
                clusters: std::mem::take(&mut self.cluster_weights),
            }));
            effects
        } else {
            self.start_step(step_done)
        }
    }
}
