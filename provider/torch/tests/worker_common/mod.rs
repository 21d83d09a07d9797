//! A stand-in for the server in the `worker_*` tests: builds assignments and
//! relays messages between `StageWorker`s in one process the way the server
//! does (Forward to the Root per micro-batch, Activations on to the next stage
//! with labels for the Leaf, Gradients back as Backward, until every stage
//! reports StepDone).
#![allow(dead_code)]

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;

use rookery_model::{Graph, Loss, LrSchedule, OptimizerConfig};
use rookery_proto::{
    Assignment, Backward, Forward, ParamOptimState, ParamSet, Phase, ToProvider, ToServer,
    WireDType, WireTensor,
};
use rookery_stage::{Device as StageDevice, OwnFactory, StageWorker};
use rookery_torch::exec::{loss_targets, stage_boundary};
use rookery_torch::{TorchWorker, tensor_to_wire};
use tch::{Device, Kind, Tensor};

/// A worker the stand-in server relays to, synchronously: libtorch's or
/// our own executor's.
pub trait Worker {
    fn handle(&mut self, message: ToProvider) -> Vec<ToServer>;
}

impl Worker for TorchWorker {
    fn handle(&mut self, message: ToProvider) -> Vec<ToServer> {
        TorchWorker::handle(self, message)
    }
}

/// The generic stage worker over our own executor on `D`.
pub struct OwnWorker<D: StageDevice>(StageWorker<OwnFactory<D>>);

impl<D: StageDevice> OwnWorker<D> {
    pub fn new(device: D) -> Self {
        Self(StageWorker::new(OwnFactory::new(device)))
    }
}

impl<D: StageDevice> Worker for OwnWorker<D> {
    fn handle(&mut self, message: ToProvider) -> Vec<ToServer> {
        pollster::block_on(self.0.handle(message))
    }
}

/// What a job's assignments share.
#[derive(Debug, Clone, Copy)]
pub struct JobConfig {
    pub job_id: u64,
    pub optimizer: OptimizerConfig,
    pub loss: Loss,
    pub micro_batches: u32,
    pub batch_size: u32,
    pub wire_dtype: WireDType,
    pub seed: u64,
    pub lr_schedule: LrSchedule,
    pub clip_grad_norm: Option<f64>,
}

impl JobConfig {
    pub fn new(optimizer: OptimizerConfig, loss: Loss) -> Self {
        Self {
            job_id: 7,
            optimizer,
            loss,
            micro_batches: 4,
            batch_size: 16,
            wire_dtype: WireDType::F32,
            seed: 1234,
            lr_schedule: LrSchedule::default(),
            clip_grad_norm: None,
        }
    }
}

/// Every parameter and buffer as it travels in `Assign` and `SetParams`.
pub fn wire_params(params: &BTreeMap<String, Tensor>) -> Vec<WireTensor> {
    params
        .iter()
        .map(|(name, t)| tensor_to_wire(name, t, WireDType::F32).unwrap())
        .collect()
}

/// The assignment of stage `k` of a chain cut at `cuts` (outputs from the
/// planner's boundary rule). It carries every parameter of the model; the
/// stage takes the ones it uses.
pub fn assignment(
    g: &Graph,
    cuts: &[Range<usize>],
    k: usize,
    cluster: u32,
    params: &BTreeMap<String, Tensor>,
    job: &JobConfig,
) -> Assignment {
    Assignment {
        job_id: job.job_id,
        cluster,
        stage: k as u32,
        stages: cuts.len() as u32,
        graph_json: g.to_json().unwrap(),
        first: cuts[k].start as u32,
        end: cuts[k].end as u32,
        outputs: stage_boundary(g, cuts[k].end).unwrap(),
        params: wire_params(params),
        optimizer: job.optimizer,
        loss: job.loss,
        batch_size: job.batch_size,
        micro_batches: job.micro_batches,
        wire_dtype: job.wire_dtype,
        seed: job.seed,
        start_step: 0,
        optimizer_state: Vec::new(),
        lr_schedule: job.lr_schedule,
        clip_grad_norm: job.clip_grad_norm,
        public_name: None,
        schedule: rookery_proto::PipelineSchedule::Gpipe,
        sync_int8: false,
        precision: Default::default(),
    }
}

pub fn labels_wire(y: &Tensor) -> WireTensor {
    tensor_to_wire("labels", y, WireDType::F32).unwrap()
}

/// What the server saw of one step (or one evaluation) of one chain.
#[derive(Debug, Default)]
pub struct StepReport {
    pub loss_sum: f64,
    pub correct: u64,
    pub samples: u64,
    /// What the step's mean divides by (`Forward::step_targets`); in
    /// evaluation, summed over the micro-batches (each carries its own).
    pub targets: u64,
    /// StepDone per stage, in the order they came.
    pub step_done: Vec<usize>,
    /// Encoded sizes of every Activations frame.
    pub activation_frames: Vec<usize>,
    /// Payload bytes of every Activations frame's tensors.
    pub activation_bytes: Vec<usize>,
    pub leaf_losses: usize,
    /// The clipping multiplier sent back, in a job that clips.
    pub grad_scale: Option<f64>,
}

/// Makes the worker of stage `k` of a chain.
pub type MakeWorker<'a> = &'a dyn Fn(usize) -> Box<dyn Worker>;

/// libtorch on the CPU for every stage.
pub fn torch_worker(_stage: usize) -> Box<dyn Worker> {
    Box::new(TorchWorker::new(Device::Cpu))
}

/// One cluster: a chain of workers, one per stage.
pub struct Chain {
    pub workers: Vec<Box<dyn Worker>>,
    pub job: JobConfig,
    pub input: String,
}

impl Chain {
    /// Assigns every stage (libtorch workers) and checks each answers Ready.
    pub fn new(
        g: &Graph,
        cuts: &[Range<usize>],
        cluster: u32,
        params: &BTreeMap<String, Tensor>,
        job: JobConfig,
    ) -> Self {
        Self::with_workers(g, cuts, cluster, params, job, &torch_worker)
    }

    /// [`Chain::new`] with stage `k` run by `make(k)`.
    pub fn with_workers(
        g: &Graph,
        cuts: &[Range<usize>],
        cluster: u32,
        params: &BTreeMap<String, Tensor>,
        job: JobConfig,
        make: MakeWorker<'_>,
    ) -> Self {
        let workers = (0..cuts.len())
            .map(|k| {
                let mut w = make(k);
                let replies = w.handle(ToProvider::Assign(Box::new(assignment(
                    g, cuts, k, cluster, params, &job,
                ))));
                assert_eq!(
                    replies,
                    [ToServer::Ready { job_id: job.job_id }],
                    "stage {k}"
                );
                w
            })
            .collect();
        Self {
            workers,
            job,
            input: g.inputs[0].name.clone(),
        }
    }

    fn last(&self) -> usize {
        self.workers.len() - 1
    }

    /// One training step on batch (`x`, `y`), relayed as the server would.
    pub fn train_step(&mut self, step: u64, x: &Tensor, y: &Tensor) -> StepReport {
        let report = self.run(Phase::Train { step }, x, y);
        let mut done = report.step_done.clone();
        done.sort();
        assert_eq!(
            done,
            (0..self.workers.len()).collect::<Vec<_>>(),
            "every stage reports StepDone once"
        );
        report
    }

    /// Forward-only evaluation of a batch.
    pub fn eval(&mut self, epoch: u32, x: &Tensor, y: &Tensor) -> StepReport {
        let report = self.run(Phase::Eval { epoch }, x, y);
        assert!(report.step_done.is_empty());
        report
    }

    fn run(&mut self, phase: Phase, x: &Tensor, y: &Tensor) -> StepReport {
        let b = x.size()[0] as u32;
        let chunk = b.div_ceil(self.job.micro_batches);
        let count = b.div_ceil(chunk);
        let part = |t: &Tensor, m: u32| {
            let start = m * chunk;
            t.narrow(0, i64::from(start), i64::from(chunk.min(b - start)))
        };
        let last = self.last();
        let labels_for = |k: usize, m: u32| (k == last).then(|| labels_wire(&part(y, m)));
        // As the server: a training step's targets are the whole batch's, an
        // evaluation micro-batch's its own.
        let loss = self.job.loss;
        let targets_of = |m: u32| match phase {
            Phase::Train { .. } => loss_targets(loss, y).unwrap(),
            Phase::Eval { .. } => loss_targets(loss, &part(y, m)).unwrap(),
        };
        let mut queue: VecDeque<(usize, ToProvider)> = (0..count)
            .map(|m| {
                (
                    0,
                    ToProvider::Forward(Forward {
                        job_id: self.job.job_id,
                        phase,
                        micro: m,
                        step_samples: b,
                        step_targets: targets_of(m),
                        inputs: vec![
                            tensor_to_wire(&self.input, &part(x, m), WireDType::F32).unwrap(),
                        ],
                        labels: labels_for(0, m),
                    }),
                )
            })
            .collect();
        let mut report = StepReport::default();
        let mut norms: Vec<Option<f64>> = vec![None; self.workers.len()];
        while let Some((k, message)) = queue.pop_front() {
            for reply in self.workers[k].handle(message) {
                match reply {
                    ToServer::Activations(a) => {
                        assert_eq!(a.phase, phase);
                        report.activation_frames.push(
                            rookery_proto::encode(&ToServer::Activations(a.clone()))
                                .unwrap()
                                .len(),
                        );
                        report
                            .activation_bytes
                            .push(a.outputs.iter().map(|t| t.data.len()).sum());
                        queue.push_back((
                            k + 1,
                            ToProvider::Forward(Forward {
                                job_id: a.job_id,
                                phase: a.phase,
                                micro: a.micro,
                                step_samples: b,
                                step_targets: targets_of(a.micro),
                                inputs: a.outputs,
                                labels: labels_for(k + 1, a.micro),
                            }),
                        ));
                    }
                    ToServer::Gradients(g) => {
                        assert!(k > 0, "the Root sends no gradients");
                        queue.push_back((
                            k - 1,
                            ToProvider::Backward(Backward {
                                job_id: g.job_id,
                                step: g.step,
                                micro: g.micro,
                                grads: g.grads,
                            }),
                        ));
                    }
                    ToServer::LeafLoss(l) => {
                        assert_eq!(k, last, "only the Leaf reports a loss");
                        assert_eq!(l.phase, phase);
                        report.loss_sum += l.loss_sum;
                        report.correct += l.correct;
                        report.samples += u64::from(l.samples);
                        report.leaf_losses += 1;
                    }
                    ToServer::StepDone(d) => {
                        assert_eq!(Phase::Train { step: d.step }, phase);
                        assert!(d.compute_ms >= 0.0);
                        report.step_done.push(k);
                    }
                    ToServer::GradNorm(n) => {
                        assert_eq!(Phase::Train { step: n.step }, phase);
                        assert!(norms[k].replace(n.sum_of_squares).is_none());
                        // As the server: the stages' sums, added in stage order.
                        if let Some(total) = norms.iter().copied().sum::<Option<f64>>() {
                            let max_norm = self.job.clip_grad_norm.expect("the job clips");
                            let scale = rookery_model::clip_scale(total, max_norm);
                            report.grad_scale = Some(scale);
                            for s in 0..self.workers.len() {
                                queue.push_back((
                                    s,
                                    ToProvider::GradScale(rookery_proto::GradScale {
                                        job_id: n.job_id,
                                        step: n.step,
                                        scale,
                                    }),
                                ));
                            }
                        }
                    }
                    ToServer::JobFailed { message, .. } => panic!("stage {k} failed: {message}"),
                    other => panic!("stage {k} sent {other:?}"),
                }
            }
        }
        report.targets = match phase {
            Phase::Train { .. } => targets_of(0),
            Phase::Eval { .. } => (0..count).map(targets_of).sum(),
        };
        assert_eq!(report.leaf_losses, count as usize);
        assert_eq!(report.samples, u64::from(b));
        report
    }

    /// Each stage's parameters, from `UploadParams`.
    pub fn upload(&mut self, step: u64) -> Vec<Vec<WireTensor>> {
        self.upload_with_state(step)
            .into_iter()
            .map(|(_, params)| params)
            .collect()
    }

    /// Each stage's optimizer state and parameters, from `UploadParams`
    /// (which answers with both, the state first).
    pub fn upload_with_state(&mut self, step: u64) -> Vec<(Vec<ParamOptimState>, Vec<WireTensor>)> {
        let job_id = self.job.job_id;
        self.workers
            .iter_mut()
            .map(
                |w| match &w.handle(ToProvider::UploadParams { job_id, step })[..] {
                    [ToServer::OptimizerState(o), ToServer::Params(p)] => {
                        assert_eq!((p.job_id, p.step), (job_id, step));
                        assert_eq!((o.job_id, o.step), (job_id, step));
                        (o.params.clone(), p.params.clone())
                    }
                    other => panic!("UploadParams answered {other:?}"),
                },
            )
            .collect()
    }

    /// A chain whose stages are assigned afresh, each from its own uploaded
    /// parameters and optimizer state, `start_step` steps into the job: how
    /// the server rebuilds a cluster from its checkpoint.
    pub fn rebuilt(
        g: &Graph,
        cuts: &[Range<usize>],
        job: JobConfig,
        uploaded: &[(Vec<ParamOptimState>, Vec<WireTensor>)],
        start_step: u64,
    ) -> Self {
        let workers = uploaded
            .iter()
            .enumerate()
            .map(|(k, (state, params))| {
                let mut w = torch_worker(k);
                let a = Assignment {
                    params: params.clone(),
                    optimizer_state: state.clone(),
                    start_step,
                    ..assignment(g, cuts, k, 0, &BTreeMap::new(), &job)
                };
                let replies = w.handle(ToProvider::Assign(Box::new(a)));
                assert_eq!(
                    replies,
                    [ToServer::Ready { job_id: job.job_id }],
                    "stage {k}"
                );
                w
            })
            .collect();
        Self {
            workers,
            job,
            input: g.inputs[0].name.clone(),
        }
    }

    /// Sends each stage the values of its own parameters from `values`.
    pub fn set(&mut self, step: u64, values: &BTreeMap<String, WireTensor>, own: &[Vec<String>]) {
        let job_id = self.job.job_id;
        for (w, names) in self.workers.iter_mut().zip(own) {
            let params = names.iter().map(|n| values[n].clone()).collect();
            let replies = w.handle(ToProvider::SetParams(ParamSet {
                job_id,
                step,
                params,
            }));
            assert!(replies.is_empty(), "SetParams answered {replies:?}");
        }
    }
}

/// Parameters by name as f64 tensors (for comparisons).
pub fn by_name(stages: &[Vec<WireTensor>]) -> BTreeMap<String, Tensor> {
    stages
        .iter()
        .flatten()
        .map(|t| {
            let v = rookery_torch::tensor_from_wire(t).unwrap();
            (t.name.clone(), v.to_kind(Kind::Double))
        })
        .collect()
}

/// Largest absolute difference between parameters of the same name.
pub fn max_param_diff(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> f64 {
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "the same parameters"
    );
    a.iter()
        .map(|(n, t)| {
            (t - b[n].to_kind(Kind::Double))
                .abs()
                .max()
                .double_value(&[])
        })
        .fold(0.0, f64::max)
}

/// Row `step` onwards first: a different slice order each step, as a loader gives.
pub fn rolled(x: &Tensor, step: u64) -> Tensor {
    let b = x.size()[0];
    let rows = Tensor::arange(b, (Kind::Int64, Device::Cpu)).roll([step as i64], [0]);
    x.index_select(0, &rows)
}

pub fn relative(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-12)
}
