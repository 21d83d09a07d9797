//! A simulated set of providers, and the runs the recovery tests drive with it.

use super::*;

/// A stand-in for the providers: each answers the server's frames as a
/// stage would, with values that depend on the data it is fed (the loss
/// of a micro-batch is the sum of its inputs' first features) and on the
/// steps trained since its `Assign` (each step adds 1 to every parameter,
/// and the optimizer's `momentum_buffer` counts updates), so a replay on
/// other batches or from other values would show.
#[derive(Default)]
pub(super) struct Sim {
    /// Provider id -> its stage; providers not in it are gone.
    pub(super) stages: BTreeMap<u64, FakeStage>,
    pub(super) alive: std::collections::BTreeSet<u64>,
    pub(super) queue: std::collections::VecDeque<(u64, ToProvider)>,
    /// Every effect that is not a frame, in order.
    pub(super) out: Vec<Effect>,
    /// Every Assign sent, to whom.
    pub(super) assigns: Vec<(u64, Assignment)>,
    /// Each stage's compute per step, times its `slow`.
    pub(super) step_ms: f64,
    /// Every SetParams a live stage got, as (provider, step).
    pub(super) set_params: Vec<(u64, u64)>,
}

pub(super) struct FakeStage {
    pub(super) stage: u32,
    pub(super) stages: u32,
    pub(super) params: Vec<(String, Vec<usize>, Vec<f32>)>,
    pub(super) optimizer: BTreeMap<String, u64>,
    pub(super) outputs: Vec<String>,
    pub(super) micro_batches: u32,
    /// Backward passes done in the current step.
    pub(super) done: u32,
    pub(super) slow: f64,
}

impl Sim {
    pub(super) fn new(providers: impl IntoIterator<Item = u64>) -> Self {
        Sim {
            alive: providers.into_iter().collect(),
            step_ms: 10.0,
            ..Sim::default()
        }
    }

    pub(super) fn push(&mut self, effects: Vec<Effect>) {
        for e in effects {
            match e {
                Effect::Send(p, m) => self.queue.push_back((p, m)),
                other => self.out.push(other),
            }
        }
    }

    /// Delivers frames until `stop` holds or nothing is left to deliver.
    pub(super) fn run_until(&mut self, run: &mut JobRun, stop: impl Fn(&JobRun) -> bool) {
        while !stop(run) {
            let Some((p, m)) = self.queue.pop_front() else {
                return;
            };
            if !self.alive.contains(&p) {
                continue;
            }
            for reply in self.answer(p, m) {
                let effects = run.on_message(p, reply);
                let effects = settle(run, effects);
                self.push(effects);
            }
        }
    }

    pub(super) fn kill(&mut self, run: &mut JobRun, p: u64) {
        self.alive.remove(&p);
        self.stages.remove(&p);
        let effects = run.stage_lost(p, "killed").expect("a provider of the job");
        self.push(effects);
    }

    pub(super) fn steps(&self) -> Vec<(u64, f64)> {
        self.out
            .iter()
            .filter_map(|e| match e {
                Effect::Step(r) => Some((r.step, r.loss)),
                _ => None,
            })
            .collect()
    }

    /// The steps of every resume point (one a sync), in order.
    pub(super) fn resume_steps(&self) -> Vec<u64> {
        self.out
            .iter()
            .filter_map(|e| match e {
                Effect::ResumePoint(r) => Some(r.step),
                _ => None,
            })
            .collect()
    }

    pub(super) fn completed(&self) -> Option<&Vec<WireTensor>> {
        self.trained().map(|w| &w.combined)
    }

    pub(super) fn trained(&self) -> Option<&TrainedWeights> {
        super::trained(&self.out)
    }

    pub(super) fn answer(&mut self, p: u64, m: ToProvider) -> Vec<ToServer> {
        let job_id = 1;
        if let ToProvider::SetParams(set) = &m
            && self.stages.contains_key(&p)
        {
            self.set_params.push((p, set.step));
        }
        if let ToProvider::Assign(a) = m {
            self.assigns.push((p, (*a).clone()));
            let params = a
                .params
                .iter()
                .map(|t| (t.name.clone(), t.shape_usize(), t.to_f32().unwrap()))
                .collect();
            let optimizer = a
                .optimizer_state
                .iter()
                .map(|o| (o.name.clone(), o.steps))
                .collect();
            let slow = self.stages.get(&p).map_or(1.0, |s| s.slow);
            self.stages.insert(
                p,
                FakeStage {
                    stage: a.stage,
                    stages: a.stages,
                    params,
                    optimizer,
                    outputs: a.outputs.clone(),
                    micro_batches: a.micro_batches,
                    done: 0,
                    slow,
                },
            );
            return vec![ToServer::Ready { job_id }];
        }
        let Some(st) = self.stages.get_mut(&p) else {
            return Vec::new();
        };
        let leaf = st.stage + 1 == st.stages;
        let step_ms = self.step_ms;
        let mut out = Vec::new();
        let step_over = |st: &mut FakeStage, step: u64, out: &mut Vec<ToServer>| {
            st.done += 1;
            if st.done == st.micro_batches {
                st.done = 0;
                for (name, _, values) in &mut st.params {
                    values.iter_mut().for_each(|v| *v += 1.0);
                    *st.optimizer.entry(name.clone()).or_default() += 1;
                }
                out.push(ToServer::StepDone(StepDone {
                    job_id,
                    step,
                    compute_ms: step_ms * st.slow,
                    peak_held: 1,
                }));
            }
        };
        match m {
            ToProvider::Forward(f) => {
                let x = f.inputs[0].to_f32().unwrap();
                let n = f.inputs[0].shape[0] as usize;
                let width = x.len() / n.max(1);
                let first: Vec<f32> = (0..n).map(|i| x[i * width]).collect();
                if !leaf {
                    let values: Vec<f32> = first
                        .iter()
                        .flat_map(|v| std::iter::repeat_n(*v, 8))
                        .collect();
                    out.push(ToServer::Activations(Activations {
                        job_id,
                        phase: f.phase,
                        micro: f.micro,
                        outputs: vec![WireTensor::from_f32(
                            st.outputs[0].clone(),
                            &[n, 8],
                            &values,
                            WireDType::F32,
                        )],
                        compute_ms: 1.0,
                    }));
                    return out;
                }
                out.push(ToServer::LeafLoss(LeafLoss {
                    job_id,
                    phase: f.phase,
                    micro: f.micro,
                    loss_sum: first.iter().map(|v| f64::from(*v)).sum(),
                    correct: 0,
                    samples: n as u32,
                }));
                if let Phase::Train { step } = f.phase {
                    if st.stage > 0 {
                        out.push(ToServer::Gradients(Gradients {
                            job_id,
                            step,
                            micro: f.micro,
                            grads: vec![WireTensor::from_f32(
                                f.inputs[0].name.clone(),
                                &[n, 8],
                                &vec![0.0; n * 8],
                                WireDType::F32,
                            )],
                            compute_ms: 1.0,
                        }));
                    }
                    step_over(st, step, &mut out);
                }
            }
            ToProvider::Backward(b) => step_over(st, b.step, &mut out),
            ToProvider::UploadParams { step, .. } => {
                out.push(ToServer::OptimizerState(OptimizerState {
                    job_id,
                    step,
                    params: st
                        .optimizer
                        .iter()
                        .map(|(name, &steps)| {
                            let shape = &st.params.iter().find(|p| &p.0 == name).unwrap().1;
                            let len = shape.iter().product();
                            ParamOptimState {
                                name: name.clone(),
                                steps,
                                slots: vec![WireTensor::from_f32(
                                    "momentum_buffer",
                                    shape,
                                    &vec![steps as f32; len],
                                    WireDType::F32,
                                )],
                            }
                        })
                        .collect(),
                }));
                out.push(ToServer::Params(ParamSet {
                    job_id,
                    step,
                    params: st
                        .params
                        .iter()
                        .map(|(n, shape, v)| WireTensor::from_f32(n, shape, v, WireDType::F32))
                        .collect(),
                }));
            }
            ToProvider::SetParams(set) => {
                for t in set.params {
                    if let Some(p) = st.params.iter_mut().find(|p| p.0 == t.name) {
                        p.2 = t.to_f32().unwrap();
                    }
                }
            }
            _ => {}
        }
        out
    }
}

/// 2 clusters of Root -> Leaf on providers 10..14, 32 samples in batches
/// of 4: 4 steps per epoch, 2 epochs, a sync every 2 steps, and a test set.
pub(super) fn recovery_run(resume: Option<ResumePoint>) -> (JobRun, Vec<Effect>) {
    recovery_run_with(2, resume)
}

/// As [`recovery_run`], with `clusters` clusters on providers 10.. (one
/// cluster: 8 steps per epoch).
pub(super) fn recovery_run_with(
    clusters: usize,
    resume: Option<ResumePoint>,
) -> (JobRun, Vec<Effect>) {
    let providers_end = 10 + 2 * clusters as u64;
    let graph = rookery_model::from_toml(MLP).unwrap();
    let mut spec = spec();
    spec.training.epochs = 2;
    spec.training.sync_every = 2;
    spec.training.optimizer = OptimizerConfig::Sgd {
        lr: 0.1,
        momentum: 0.9,
        dampening: 0.0,
        nesterov: false,
        weight_decay: 0.0,
    };
    let plan = two_stage_plan(&graph, 10..providers_end, clusters);
    let ids = (10..providers_end).map(|i| (i.to_string(), i)).collect();
    let analysis = graph.analyze().unwrap();
    let test = Some(data(6));
    JobRun::start(
        1,
        spec,
        graph,
        &analysis,
        &plan,
        &ids,
        data(32),
        test,
        resume,
    )
    .unwrap()
}

pub(super) fn undisturbed() -> Sim {
    let (mut run, effects) = recovery_run(None);
    let mut sim = Sim::new(10..14);
    sim.push(effects);
    sim.run_until(&mut run, JobRun::is_over);
    sim
}

pub(super) fn cluster_step(run: &JobRun, c: usize) -> Option<u64> {
    match run.clusters[c].state {
        ClusterState::Training { step } => Some(step),
        _ => None,
    }
}
