//! A training step's frames: each cluster's Root is fed its micro-batches,
//! activations are relayed forward (the Leaf's with their labels), gradients
//! back, and every frame is checked against the stage and step it claims
//! before it is passed on. A cluster that has done its step goes on to the
//! next or waits at the barrier.

use std::time::Instant;

use rookery_job::{Dataset, Labels, epoch_permutation, micro_batch_ranges};
use rookery_model::{DType, Loss, clip_scale};
use rookery_proto::{
    Activations, Backward, Forward, GradNorm, GradScale, Gradients, LeafLoss, Phase, StepDone,
    ToProvider, ToServer, WireDType, WireTensor,
};

use super::measure::wire_bytes;
use super::{
    Ahead, ClusterRun, ClusterState, ClusterStep, Effect, FAIL_AFTER_PROVIDERS, JobRun, Rejected,
    StageTime, State, TapSide, on_wire,
};

/// A stage's answer to a spot-checked micro-batch: where, and what.
struct CheckedAnswer {
    at: (usize, usize, u64, u32),
    answer: Answer,
}

enum Answer {
    /// Its activations (`TapSide::Output`) or its input gradients
    /// (`TapSide::BackwardOutput`).
    Tensors(Vec<WireTensor>, TapSide),
    Loss(f64),
}

impl JobRun {
    /// A provider of this job sent `message`. Frames that break the protocol
    /// are dropped with a logged reason (and an [`Effect::Fault`] when the
    /// data was wrong rather than late); a provider's own failure loses it
    /// its stage ([`Self::on_stage_failed`]). Each connection counts as its
    /// own identity; see [`Self::on_message_from`].
    pub fn on_message(&mut self, provider: u64, message: ToServer) -> Vec<Effect> {
        self.on_message_from(provider, provider, message)
    }

    /// [`Self::on_message`] from a provider connected as `identity`: a
    /// stage's failures count distinct identities, so reconnecting does not
    /// make one provider count as several.
    pub fn on_message_from(
        &mut self,
        provider: u64,
        identity: u64,
        message: ToServer,
    ) -> Vec<Effect> {
        let now = Instant::now();
        let sent_bytes = match &message {
            ToServer::Activations(a) => Some(wire_bytes(&a.outputs)),
            ToServer::Gradients(g) => Some(wire_bytes(&g.grads)),
            ToServer::LeafLoss(_) | ToServer::StepDone(_) | ToServer::GradNorm(_) => Some(0),
            _ => None,
        };
        if let (Some((c, s)), Some(bytes)) = (self.locate(provider), sent_bytes) {
            self.clusters[c].stages[s].busy.output(now, bytes);
        }
        let answer = self.checked_answer(provider, &message);
        let mut effects = self.dispatch(provider, identity, message);
        let refused = effects
            .iter()
            .any(|e| matches!(e, Effect::Fault { provider: p, .. } if *p == provider));
        if let Some(CheckedAnswer {
            at: (c, s, step, micro),
            answer,
        }) = answer
            && !refused
        {
            effects.extend(match answer {
                Answer::Tensors(tensors, side) => {
                    self.checked_answer_tensors((c, s, step, micro), &tensors, side)
                }
                Answer::Loss(loss) => self.checked_loss(c, s, step, micro, loss),
            });
        }
        let taps = self.choose_checks(&effects);
        effects.extend(taps);
        self.note_inputs(&effects, now);
        effects
    }

    /// The answer `message` gives to a spot-checked micro-batch, if it is
    /// one (kept once the message is accepted).
    fn checked_answer(&self, provider: u64, message: &ToServer) -> Option<CheckedAnswer> {
        if self.checks.is_empty() {
            return None;
        }
        let (c, s) = self.locate(provider)?;
        let (step, micro) = match message {
            ToServer::Activations(Activations {
                phase: Phase::Train { step },
                micro,
                ..
            })
            | ToServer::LeafLoss(LeafLoss {
                phase: Phase::Train { step },
                micro,
                ..
            })
            | ToServer::Gradients(Gradients { step, micro, .. }) => (*step, *micro),
            _ => return None,
        };
        self.check_of(c, s, step, micro)?;
        let answer = match message {
            ToServer::Activations(a) => Answer::Tensors(a.outputs.clone(), TapSide::Output),
            ToServer::LeafLoss(l) => Answer::Loss(l.loss_sum),
            ToServer::Gradients(g) => Answer::Tensors(g.grads.clone(), TapSide::BackwardOutput),
            _ => return None,
        };
        Some(CheckedAnswer {
            at: (c, s, step, micro),
            answer,
        })
    }

    fn dispatch(&mut self, provider: u64, identity: u64, message: ToServer) -> Vec<Effect> {
        let Some((c, s)) = self.locate(provider) else {
            tracing::warn!(
                job = self.job_id,
                provider,
                "dropped a frame from a provider outside the job"
            );
            return Vec::new();
        };
        let rebuilding = matches!(
            self.clusters[c].state,
            ClusterState::Assigning | ClusterState::Waiting
        );
        let result = match message {
            ToServer::Ready { job_id } => self.check_job(job_id).map(|()| self.on_ready(c, s)),
            // Until its cluster is rebuilt, a stage's frames are left over from
            // the steps being rolled back.
            ToServer::Activations(_)
            | ToServer::Gradients(_)
            | ToServer::LeafLoss(_)
            | ToServer::StepDone(_)
            | ToServer::Params(_)
            | ToServer::OptimizerState(_)
            | ToServer::GradNorm(_)
                if rebuilding =>
            {
                Ok(Vec::new())
            }
            ToServer::Activations(a) => self
                .check_job(a.job_id)
                .and_then(|()| self.on_activations(c, s, a)),
            ToServer::Gradients(g) => self
                .check_job(g.job_id)
                .and_then(|()| self.on_gradients(c, s, g)),
            ToServer::LeafLoss(l) => self
                .check_job(l.job_id)
                .and_then(|()| self.on_leaf_loss(c, s, l)),
            ToServer::StepDone(d) => self
                .check_job(d.job_id)
                .and_then(|()| self.on_step_done(c, s, d)),
            ToServer::OptimizerState(o) => self
                .check_job(o.job_id)
                .and_then(|()| self.on_optimizer_state(c, s, o)),
            ToServer::Params(p) => self
                .check_job(p.job_id)
                .and_then(|()| self.on_params(c, s, p)),
            ToServer::GradNorm(g) => self
                .check_job(g.job_id)
                .and_then(|()| self.on_grad_norm(c, s, g)),
            ToServer::JobFailed { job_id, message } => self
                .check_job(job_id)
                .map(|()| self.on_stage_failed(provider, identity, c, s, message)),
            ToServer::Hello(_)
            | ToServer::Heartbeat { .. }
            | ToServer::Error(_)
            | ToServer::ProbeAck { .. }
            | ToServer::DutyCycle { .. } => Ok(Vec::new()),
        };
        match result {
            Ok(effects) => effects,
            Err(Rejected::Stale(reason)) => {
                tracing::warn!(job = self.job_id, provider, cluster = c, stage = s, %reason, "dropped a frame");
                Vec::new()
            }
            Err(Rejected::Fault(reason)) => {
                tracing::warn!(job = self.job_id, provider, cluster = c, stage = s, %reason, "dropped a faulty frame");
                vec![Effect::Fault {
                    provider,
                    reason: format!("cluster {c}, stage {s}: {reason}"),
                    frame_dropped: true,
                }]
            }
        }
    }
}

impl JobRun {
    /// A provider says its stage failed. It loses the stage (a fault that
    /// drops it, so the stage is reassigned); the job fails only once the
    /// stage has failed with the same cause on [`FAIL_AFTER_PROVIDERS`]
    /// providers, so no single provider can end a job, or blame its
    /// neighbour for doing so.
    fn on_stage_failed(
        &mut self,
        provider: u64,
        identity: u64,
        c: usize,
        s: usize,
        cause: String,
    ) -> Vec<Effect> {
        let who = self
            .stage_failures
            .entry((c, s, cause.clone()))
            .or_default();
        who.insert(identity);
        let count = who.len();
        if count >= FAIL_AFTER_PROVIDERS {
            self.state = State::Over;
            return vec![Effect::Failed(format!(
                "stage {s} of cluster {c} failed on {count} providers: {cause}"
            ))];
        }
        vec![
            Effect::Log {
                kind: "stage_failed",
                message: format!(
                    "provider {provider} (cluster {c}, stage {s}) failed ({count} of \
                     {FAIL_AFTER_PROVIDERS} before the job fails): {cause}"
                ),
            },
            Effect::Fault {
                provider,
                reason: format!("its stage failed: {cause}"),
                frame_dropped: true,
            },
        ]
    }
    pub(super) fn check_job(&self, job_id: u64) -> Result<(), Rejected> {
        if job_id == self.job_id {
            Ok(())
        } else {
            Err(Rejected::Fault(format!(
                "a frame for job {job_id}, not {}",
                self.job_id
            )))
        }
    }

    pub(super) fn on_ready(&mut self, c: usize, s: usize) -> Vec<Effect> {
        let run = &mut self.clusters[c];
        if run.state != ClusterState::Assigning {
            return Vec::new();
        }
        run.stages[s].ready = true;
        if !run.stages.iter().all(|s| s.ready) {
            return Vec::new();
        }
        run.state = ClusterState::Idle;
        match self.state {
            State::Assigning => {
                if !self.clusters.iter().all(|r| r.state == ClusterState::Idle) {
                    return Vec::new();
                }
                let mut effects = vec![Effect::Running];
                effects.extend(self.begin());
                effects
            }
            // A rebuilt cluster replays from the checkpoint.
            State::Training => {
                let step = self.synced;
                if step == self.barrier() {
                    self.at_barrier()
                } else {
                    self.start_cluster_step(c, step)
                }
            }
            // Its share of the test set again, from the start.
            State::Evaluating { epoch, .. } => self.feed_eval(c, epoch),
            State::Syncing { .. } | State::Over => Vec::new(),
        }
    }

    pub(super) fn current_phase_ok(&self, c: usize, phase: Phase) -> Result<(), String> {
        let cluster = self.clusters[c].state;
        match (self.state, cluster, phase) {
            (State::Training, ClusterState::Training { step }, Phase::Train { step: got })
                if step == got || (got == step + 1 && self.clusters[c].ahead.is_some()) =>
            {
                Ok(())
            }
            (State::Evaluating { epoch, .. }, ClusterState::Idle, Phase::Eval { epoch: got })
                if epoch == u64::from(got) =>
            {
                Ok(())
            }
            (state, cluster, phase) => Err(format!(
                "{phase:?} does not match the job's state {state:?} (cluster {c}: {cluster:?})"
            )),
        }
    }

    /// Every cluster starts `step` (after a sync or an evaluation).
    pub(super) fn start_step(&mut self, step: u64) -> Vec<Effect> {
        self.state = State::Training;
        let spe = self.schedule.steps_per_epoch as u64;
        if step.is_multiple_of(spe) {
            self.step_started = Instant::now();
        }
        let mut effects = Vec::new();
        for c in 0..self.clusters.len() {
            if self.clusters[c].state == ClusterState::Idle {
                effects.extend(self.start_cluster_step(c, step));
            }
        }
        effects
    }

    /// Cluster `c` starts `step` with nothing in flight. Under `async` the
    /// step after it waits for it here (a barrier's step: its successor
    /// runs with its update, since there is no update before it to
    /// extrapolate); [`Self::finish_cluster_step`] feeds ahead from then on.
    pub(super) fn start_cluster_step(&mut self, c: usize, step: u64) -> Vec<Effect> {
        let run = &mut self.clusters[c];
        run.state = ClusterState::Training { step };
        for stage in &mut run.stages {
            stage.step_done = false;
            stage.grad_sum_of_squares = None;
            stage.compute_ms = 0.0;
            // What an evaluation or a rollback kept it busy with is not
            // this step's.
            stage.busy.take();
        }
        run.reset();
        self.feed_step(c, step)
    }

    /// Under `async`, feeds the step after `step` while `step` runs (its
    /// stages use the weights from before `step`'s update, extrapolated,
    /// so nothing waits for it), unless a barrier comes first.
    fn feed_ahead(&mut self, c: usize, step: u64) -> Vec<Effect> {
        if !self.spec.training.schedule.is_async() || step + 1 >= self.barrier() {
            return Vec::new();
        }
        let run = &mut self.clusters[c];
        run.ahead = Some(Ahead {
            done: vec![None; run.stages.len()],
            ..Ahead::default()
        });
        self.feed_step(c, step + 1)
    }

    /// Cluster `c` is done with `step - 1` while `step` (fed early) runs:
    /// what `step` reported so far becomes the cluster's current totals.
    fn advance_cluster_step(&mut self, c: usize, step: u64, ahead: Ahead) -> Vec<Effect> {
        let run = &mut self.clusters[c];
        run.forget(Phase::Train { step: step - 1 });
        run.state = ClusterState::Training { step };
        run.totals = ahead.totals;
        for (stage, done) in run.stages.iter_mut().zip(ahead.done) {
            stage.grad_sum_of_squares = None;
            stage.step_done = done.is_some();
            (stage.compute_ms, stage.peak_held) = done.unwrap_or((0.0, 0));
        }
        let all_done = run.stages.iter().all(|s| s.step_done);
        let mut effects = self.feed_ahead(c, step);
        if all_done {
            effects.extend(self.finish_cluster_step(c, step));
        }
        effects
    }

    /// Sends cluster `c`'s micro-batches of `step` to its Root.
    fn feed_step(&mut self, c: usize, step: u64) -> Vec<Effect> {
        let spe = self.schedule.steps_per_epoch as u64;
        let epoch = step / spe;
        if self.perm_epoch != Some(epoch) {
            let t = &self.spec.training;
            self.perm = epoch_permutation(self.train.len(), t.seed, epoch, t.shuffle);
            self.perm_epoch = Some(epoch);
        }
        let phase = Phase::Train { step };
        let batch = self.spec.training.batch_size;
        let ranges = micro_batch_ranges(batch, self.spec.training.micro_batches);
        let idx = self
            .schedule
            .batch(&self.perm, (step % spe) as usize, c)
            .to_vec();
        let run = &mut self.clusters[c];
        let step_targets = self.train.targets(&idx, self.spec.training.loss);
        let mut effects = Vec::new();
        for (m, r) in ranges.iter().enumerate() {
            let chunk = &idx[r.clone()];
            effects.push(feed(
                &self.graph_input,
                &self.train,
                run,
                (self.job_id, self.spec.training.loss),
                phase,
                m as u32,
                (batch, Some(step_targets)),
                chunk,
            ));
        }
        self.note_inputs(&effects, Instant::now());
        // The Root's micro-batches are the server's own: whole, untapped.
        let taps = self.choose_checks(&effects);
        debug_assert!(taps.is_empty(), "a fed micro-batch needs no tap");
        effects
    }

    pub(super) fn on_activations(
        &mut self,
        c: usize,
        s: usize,
        a: Activations,
    ) -> Result<Vec<Effect>, Rejected> {
        self.current_phase_ok(c, a.phase)?;
        let run = &mut self.clusters[c];
        let last = run.stages.len() - 1;
        if s == last {
            return Err(Rejected::Fault(
                "the Leaf sends losses, not activations".into(),
            ));
        }
        let samples = *run
            .micro_samples
            .get(&(a.phase, a.micro))
            .ok_or_else(|| format!("micro-batch {} is not in flight", a.micro))?;
        check_tensors(
            &a.outputs,
            &run.stages[s].outputs,
            samples,
            self.spec.training.wire_dtype,
        )
        .map_err(Rejected::Fault)?;
        if !run.relayed.insert((a.phase, a.micro, s, false)) {
            return Err(Rejected::Fault(format!(
                "micro-batch {}'s activations were already relayed",
                a.micro
            )));
        }
        run.count_relayed(s, a.phase, a.compute_ms);
        self.bytes_relayed += wire_bytes(&a.outputs);
        let labels = if s + 1 == last {
            run.labels.remove(&(a.phase, a.micro))
        } else {
            None
        };
        let step_samples = match a.phase {
            Phase::Train { .. } => self.spec.training.batch_size,
            Phase::Eval { .. } => samples,
        };
        let step_targets = run.step_targets(a.phase, a.micro);
        let next = run.stages[s + 1].provider;
        Ok(vec![Effect::Send(
            next,
            ToProvider::Forward(Forward {
                job_id: self.job_id,
                phase: a.phase,
                micro: a.micro,
                step_samples: step_samples as u32,
                step_targets,
                inputs: a.outputs,
                labels,
            }),
        )])
    }

    pub(super) fn on_gradients(
        &mut self,
        c: usize,
        s: usize,
        g: Gradients,
    ) -> Result<Vec<Effect>, Rejected> {
        self.current_phase_ok(c, Phase::Train { step: g.step })?;
        if s == 0 {
            return Err(Rejected::Fault(
                "the Root has no one to send gradients to".into(),
            ));
        }
        let run = &mut self.clusters[c];
        let samples = *run
            .micro_samples
            .get(&(Phase::Train { step: g.step }, g.micro))
            .ok_or_else(|| format!("micro-batch {} is not in flight", g.micro))?;
        // Gradients come for the stage's float inputs, in any subset and any
        // order (an executor lists its inputs as its nodes first read them;
        // the receiving stage matches them by name), each at most once.
        let mut expected = Vec::with_capacity(g.grads.len());
        for (k, t) in g.grads.iter().enumerate() {
            if g.grads[..k].iter().any(|u| u.name == t.name) {
                return Err(Rejected::Fault(format!("tensor `{}` sent twice", t.name)));
            }
            let Some(input) = run.stages[s]
                .inputs
                .iter()
                .find(|(name, _, dtype)| *dtype == DType::F32 && *name == t.name)
            else {
                return Err(Rejected::Fault(format!(
                    "tensor `{}` is not a float input of this stage",
                    t.name
                )));
            };
            expected.push(input.clone());
        }
        check_tensors(&g.grads, &expected, samples, self.spec.training.wire_dtype)
            .map_err(Rejected::Fault)?;
        let phase = Phase::Train { step: g.step };
        if !run.relayed.insert((phase, g.micro, s, true)) {
            return Err(Rejected::Fault(format!(
                "micro-batch {}'s gradients were already relayed",
                g.micro
            )));
        }
        run.count_relayed(s, phase, g.compute_ms);
        self.bytes_relayed += wire_bytes(&g.grads);
        let prev = run.stages[s - 1].provider;
        Ok(vec![Effect::Send(
            prev,
            ToProvider::Backward(Backward {
                job_id: self.job_id,
                step: g.step,
                micro: g.micro,
                grads: g.grads,
            }),
        )])
    }

    pub(super) fn on_leaf_loss(
        &mut self,
        c: usize,
        s: usize,
        l: LeafLoss,
    ) -> Result<Vec<Effect>, Rejected> {
        self.current_phase_ok(c, l.phase)?;
        let run = &mut self.clusters[c];
        if s + 1 != run.stages.len() {
            return Err(Rejected::Fault("only the Leaf reports losses".into()));
        }
        let samples = *run
            .micro_samples
            .get(&(l.phase, l.micro))
            .ok_or_else(|| format!("micro-batch {} is not in flight", l.micro))?;
        let targets = run
            .micro_targets
            .get(&(l.phase, l.micro))
            .copied()
            .unwrap_or(0);
        if !run.reported.insert((l.phase, l.micro)) {
            return Err(format!("micro-batch {}'s loss was already reported", l.micro).into());
        }
        if samples != l.samples as usize || !l.loss_sum.is_finite() || l.correct > targets {
            return Err(Rejected::Fault(format!(
                "implausible loss report: {} samples (expected {samples}), loss {}, {} correct of {targets} targets",
                l.samples, l.loss_sum, l.correct
            )));
        }
        let totals = match (run.state, l.phase, &mut run.ahead) {
            (ClusterState::Training { step }, Phase::Train { step: got }, Some(ahead))
                if got == step + 1 =>
            {
                &mut ahead.totals
            }
            _ => &mut run.totals,
        };
        totals.add(&l, targets);
        if let State::Evaluating {
            epoch,
            step,
            expected,
        } = self.state
        {
            let got: u64 = self.clusters.iter().map(|r| r.totals.samples).sum();
            if got == expected {
                return Ok(self.finish_eval(epoch, step));
            }
        }
        Ok(Vec::new())
    }

    pub(super) fn on_step_done(
        &mut self,
        c: usize,
        s: usize,
        d: StepDone,
    ) -> Result<Vec<Effect>, Rejected> {
        self.current_phase_ok(c, Phase::Train { step: d.step })?;
        // Under `async` a stage may hold two steps' micro-batches.
        let t = &self.spec.training;
        let held = d
            .peak_held
            .min(t.schedule.steps_in_flight() * t.micro_batches as u32);
        let run = &mut self.clusters[c];
        if run.state != (ClusterState::Training { step: d.step }) {
            // Under `async`, the step fed ahead (`current_phase_ok` said so).
            if !run.stages[s].step_done {
                return Err(Rejected::Fault(format!(
                    "step {} reported done before step {}",
                    d.step,
                    d.step - 1
                )));
            }
            let ahead = run
                .ahead
                .as_mut()
                .ok_or_else(|| format!("step {} is not in flight", d.step))?;
            if ahead.done[s]
                .replace((d.compute_ms.max(0.0), held))
                .is_some()
            {
                return Err(format!("step {} was already reported done", d.step).into());
            }
            return Ok(Vec::new());
        }
        let stage = &mut run.stages[s];
        if stage.step_done {
            return Err(format!("step {} was already reported done", d.step).into());
        }
        stage.step_done = true;
        // The provider's total is authoritative; what the relays counted was partial.
        stage.compute_ms = d.compute_ms.max(0.0);
        stage.peak_held = held;
        if !self.clusters[c].stages.iter().all(|s| s.step_done) {
            return Ok(Vec::new());
        }
        Ok(self.finish_cluster_step(c, d.step))
    }

    /// A stage's share of the squared gradient norm: once every stage of the
    /// cluster has reported, each gets the `clip_grad_norm_` multiplier of
    /// their sum (taken in stage order, so it is the same every run).
    pub(super) fn on_grad_norm(
        &mut self,
        c: usize,
        s: usize,
        g: GradNorm,
    ) -> Result<Vec<Effect>, Rejected> {
        let Some(max_norm) = self.spec.training.clip_grad_norm else {
            return Err(Rejected::Fault(
                "a gradient norm for a job that does not clip".into(),
            ));
        };
        if !(g.sum_of_squares.is_finite() && g.sum_of_squares >= 0.0) {
            return Err(Rejected::Fault(format!(
                "a gradient norm's sum of squares of {} (must be finite and not negative)",
                g.sum_of_squares
            )));
        }
        self.current_phase_ok(c, Phase::Train { step: g.step })?;
        let run = &mut self.clusters[c];
        let stage = &mut run.stages[s];
        if stage.grad_sum_of_squares.is_some() || stage.step_done {
            return Err(format!("step {}'s gradient norm was already reported", g.step).into());
        }
        stage.grad_sum_of_squares = Some(g.sum_of_squares);
        let Some(total) = run
            .stages
            .iter()
            .map(|s| s.grad_sum_of_squares)
            .sum::<Option<f64>>()
        else {
            return Ok(Vec::new());
        };
        let scale = clip_scale(total, max_norm);
        Ok(run
            .stages
            .iter()
            .map(|s| {
                Effect::Send(
                    s.provider,
                    ToProvider::GradScale(GradScale {
                        job_id: self.job_id,
                        step: g.step,
                        scale,
                    }),
                )
            })
            .collect())
    }

    /// Cluster `c` has done `step`: its totals wait for the other clusters'
    /// (unless the step was recorded before a rollback), and it goes on to
    /// the next step or waits at the barrier.
    pub(super) fn finish_cluster_step(&mut self, c: usize, step: u64) -> Vec<Effect> {
        let run = &mut self.clusters[c];
        if step >= self.recorded {
            let totals = ClusterStep {
                loss_sum: run.totals.loss_sum,
                samples: run.totals.samples,
                targets: run.totals.targets,
                stages: run
                    .stages
                    .iter()
                    .enumerate()
                    .map(|(s, stage)| StageTime {
                        cluster: c as u32,
                        stage: s as u32,
                        provider: stage.provider,
                        compute_ms: stage.compute_ms,
                        idle_ms: 0.0,
                        planned_ms: stage.planned_ms,
                        peak_held: stage.peak_held,
                    })
                    .collect(),
            };
            run.finished.insert(step, totals);
        }
        let busy: Vec<(f64, u64)> = run.stages.iter_mut().map(|s| s.busy.take()).collect();
        // Slowness is the stage's own report: the server's busy time holds
        // every transfer and per-message cost, which swamp small stages.
        for stage in &mut run.stages {
            if stage.planned_ms > 0.0 {
                stage.slowness = Some(stage.compute_ms / stage.planned_ms);
            }
        }
        self.count_slow_steps(c);
        let mut effects = self.measured(c, &busy);
        effects.extend(
            self.clusters[c]
                .stages
                .iter()
                .filter(|stage| !stage.vacant)
                .map(|stage| Effect::Worked {
                    provider: stage.provider,
                    gflop: stage.work_gflop,
                }),
        );
        effects.extend(self.record_steps());
        let done = step + 1;
        if done == self.barrier() {
            self.clusters[c].state = ClusterState::Idle;
            effects.extend(self.at_barrier());
        } else if let Some(ahead) = self.clusters[c].ahead.take() {
            effects.extend(self.advance_cluster_step(c, done, ahead));
        } else {
            effects.extend(self.start_cluster_step(c, done));
            effects.extend(self.feed_ahead(c, done));
        }
        effects
    }
}

/// Sends one micro-batch of `data` to the cluster's Root and keeps its labels
/// for the Leaf (or sends them along when the Root is the Leaf). `step` is
/// the step's samples and the targets its mean loss divides by (`None` for
/// an evaluation micro-batch: its own).
#[allow(clippy::too_many_arguments)]
pub(super) fn feed(
    input: &(String, DType),
    data: &Dataset,
    run: &mut ClusterRun,
    (job_id, loss): (u64, Loss),
    phase: Phase,
    micro: u32,
    (step_samples, step_targets): (usize, Option<u64>),
    idx: &[usize],
) -> Effect {
    let mut shape = vec![idx.len()];
    shape.extend_from_slice(&data.sample_shape);
    // Integer inputs (token ids) go as i64 from the data, never through f32.
    let inputs = vec![match input.1 {
        DType::I64 => WireTensor::from_i64(input.0.clone(), &shape, &data.gather_input_ids(idx)),
        DType::F32 => WireTensor::from_f32(
            input.0.clone(),
            &shape,
            &data.gather_inputs(idx),
            on_wire(input.1, WireDType::F32),
        ),
    }];
    // Labels travel as `[samples, label_shape..]`: i64 classes or f32 targets.
    let mut label_shape = vec![idx.len()];
    label_shape.extend_from_slice(&data.label_shape);
    let gathered = data.gather_labels(idx);
    let targets = gathered.targets(loss, idx.len());
    let labels = match gathered {
        Labels::Classes(classes) => WireTensor::from_i64("labels", &label_shape, &classes),
        Labels::Targets(values) => {
            WireTensor::from_f32("labels", &label_shape, &values, WireDType::F32)
        }
    };
    run.micro_samples.insert((phase, micro), idx.len());
    run.micro_targets.insert((phase, micro), targets);
    let single = run.stages.len() == 1;
    let labels = if single {
        Some(labels)
    } else {
        run.labels.insert((phase, micro), labels);
        None
    };
    let root = run.stages[0].provider;
    Effect::Send(
        root,
        ToProvider::Forward(Forward {
            job_id,
            phase,
            micro,
            step_samples: step_samples as u32,
            step_targets: step_targets.unwrap_or(targets),
            inputs,
            labels,
        }),
    )
}

/// Checks that `tensors` are exactly `expected` (same names, in order), each
/// `[samples, per-sample shape...]`, floats in the job's wire dtype and finite.
pub(super) fn check_tensors(
    tensors: &[WireTensor],
    expected: &[(String, Vec<usize>, DType)],
    samples: usize,
    wire: WireDType,
) -> Result<(), String> {
    if tensors.len() != expected.len() {
        return Err(format!(
            "{} tensors, expected {} ({:?})",
            tensors.len(),
            expected.len(),
            expected.iter().map(|e| &e.0).collect::<Vec<_>>()
        ));
    }
    for (t, (name, per, dtype)) in tensors.iter().zip(expected) {
        if &t.name != name {
            return Err(format!("tensor `{}` where `{name}` was expected", t.name));
        }
        let mut shape = vec![samples];
        shape.extend_from_slice(per);
        if t.shape_usize() != shape {
            return Err(format!(
                "tensor `{name}` has shape {:?}, expected {shape:?}",
                t.shape
            ));
        }
        let want = on_wire(*dtype, wire);
        if t.dtype != want {
            return Err(format!(
                "tensor `{name}` is {}, expected {}",
                t.dtype.as_str(),
                want.as_str()
            ));
        }
        // Bytes that follow the message are checked as they arrive.
        if !t.follows() {
            t.check().map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}
