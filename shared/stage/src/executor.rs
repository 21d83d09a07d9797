//! [`StageExecutor`]: one pipeline stage on one [`Device`], the same calls
//! and the same rules as the libtorch executor in `rookery-provider`
//! (forward keeps what backward needs; backward takes the gradients of the
//! stage's outputs and returns those of its inputs; parameter gradients
//! accumulate over a step's micro-batches until [`StageExecutor::step`]).
//!
//! Buffers are allocated once per batch size and reused: each micro-batch in
//! flight holds one set of activation buffers, returned to a pool by its
//! backward; gradients and scratch space are one set per batch size, since
//! backward passes run one at a time. In steady state nothing is allocated,
//! and each boundary tensor is read back once.
//!
//! With an int8 wire ([`StageExecutor::set_wire`]) outputs and input
//! gradients are packed into the wire's payload on the device and only that
//! is read back, and int8 inputs and output gradients are uploaded as their
//! payload and unpacked there (`boundary`, `crate::packed`);
//! [`StageExecutor::transfers`] counts the bytes either way.
//!
//! With [`StageExecutor::keep_previous_weights`] (the `async` schedule,
//! PipeDream-2BW with weight prediction) each trainable parameter has three
//! value buffers: the master weights (what the optimizer updates, what
//! [`StageExecutor::parameters`] reads), the Current forward weights and the
//! Previous ones, and a micro-batch's backward binds the set its forward
//! bound. A step applies the optimizer to the master weights and makes the
//! new Current their extrapolation by the update just made
//! ([`Kernel::Extrapolate`]) in the buffer no micro-batch in flight uses;
//! the old Current becomes Previous. After a barrier
//! ([`StageExecutor::merge_versions`]) both forward versions are the master
//! buffer itself, so the first step writes the new master weights elsewhere
//! and, run with nothing in flight, makes them Previous: the step after a
//! barrier's waits for its update.
//! Gradients, optimizer state and buffers (BatchNorm's running statistics)
//! stay single. Without it nothing of this is allocated or run.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use rookery_kernels::OptimizerConfig;
use rookery_kernels::gemm::Precision;
use rookery_kernels::spec::numel;
use rookery_model::{DType, Graph, ParamKind, Source, StageLayout, sum_of_squares};

use crate::device::{BoundCall, Device};
use crate::kernel::Kernel;
use crate::packed::{PackedIo, Transfers};
use crate::program::{Buf, Program, lower};
use crate::worker::WeightVersion;
use crate::{HostTensor, StageError};

mod boundary;

/// One parameter's optimizer state, as [`StageExecutor::optimizer_state`]
/// gives it.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamOptimizerState {
    pub name: String,
    /// Updates applied (torch's per-parameter `step`).
    pub steps: u64,
    /// State slots by torch's names.
    pub slots: Vec<(String, HostTensor)>,
}

/// Handle of one micro-batch between its forward and its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MicroBatch(u64);

impl MicroBatch {
    pub fn id(self) -> u64 {
        self.0
    }
}

/// The calls of a pass with their buffers bound.
type BoundCalls<'a, D> = Vec<BoundCall<'a, <D as Device>::Prepared, <D as Device>::Buffer>>;

struct ParamState<B> {
    /// The value: weight set 0 (see [`Versions`]).
    value: B,
    /// A trainable parameter's weight sets 1 and 2, kept only with
    /// [`StageExecutor::keep_previous_weights`].
    stashed: Vec<B>,
    /// The gradient accumulated since the last step; meaningful only while
    /// `has_grad` (PyTorch's `.grad is not None`).
    grad: B,
    has_grad: bool,
    /// Optimizer state buffers, in the optimizer's order; made on first step.
    state: Vec<B>,
    uniform: Option<B>,
    /// Updates applied so far (torch's per-parameter `step`).
    steps: u64,
    len: usize,
    /// An integer parameter's value (BatchNorm's `num_batches_tracked`):
    /// a count kept on the host, as no kernel reads it.
    count: Option<i64>,
}

impl<B> ParamState<B> {
    /// The value in weight set `set` (parameters kept once have one).
    fn value_in(&self, set: usize) -> &B {
        match set.checked_sub(1) {
            Some(i) if i < self.stashed.len() => &self.stashed[i],
            _ => &self.value,
        }
    }
}

/// Which weight set (0: [`ParamState::value`], 1 and 2:
/// [`ParamState::stashed`]) holds the master weights and each forward
/// version; all the same one after [`StageExecutor::merge_versions`] (and
/// before the first step).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Versions {
    master: usize,
    current: usize,
    previous: usize,
}

/// A micro-batch between forward and backward: its batch size, the weight
/// set its forward bound and its activations.
type InFlight<B> = (usize, usize, Activations<B>);

/// Programs, activations and micro-batches are per batch size and mode
/// (`true`: training).
type Key = (usize, bool);

struct Activations<B> {
    inputs: Vec<B>,
    locals: Vec<B>,
    saved: Vec<B>,
}

struct Scratch<B> {
    input_grads: Vec<B>,
    local_grads: Vec<B>,
    param_grads: Vec<B>,
}

/// One pipeline stage on one device. See the module docs.
pub struct StageExecutor<D: Device> {
    device: D,
    graph: Graph,
    layout: StageLayout,
    local_dtypes: Vec<DType>,
    params: Vec<ParamState<D::Buffer>>,
    optimizer: OptimizerConfig,
    programs: HashMap<Key, Program<D::Prepared>>,
    free: HashMap<Key, Vec<Activations<D::Buffer>>>,
    scratch: HashMap<usize, Scratch<D::Buffer>>,
    /// Each program's scratch buffers (Winograd's transforms, gradients
    /// added up), used by one call at a time.
    temps: HashMap<Key, Vec<D::Buffer>>,
    in_flight: BTreeMap<MicroBatch, InFlight<D::Buffer>>,
    /// Two weight versions (PipeDream-2BW), or `None`: one set, set 0.
    versions: Option<Versions>,
    /// The step's seed, steering dropout masks.
    seed: u64,
    next_micro_batch: u64,
    /// Prepared optimizer kernels by parameter length.
    optimizer_kernels: HashMap<usize, D::Prepared>,
    /// The kernels that fold a micro-batch's parameter gradient into the
    /// step's, by (whether the step has one yet, length), prepared once.
    accumulate: HashMap<(bool, usize), (Kernel, D::Prepared)>,
    /// [`Kernel::Extrapolate`] by parameter length, prepared by
    /// [`StageExecutor::keep_previous_weights`].
    extrapolate: HashMap<usize, (Kernel, D::Prepared)>,
    /// Boundary tensors packed as int8 on the device (`None`: f32).
    int8: Option<PackedIo<D>>,
    transfers: Transfers,
    /// How the matrix products compute; programs are lowered with it.
    precision: Precision,
}

impl<D: Device> StageExecutor<D> {
    /// A stage running nodes `range` of `graph`'s topological order and
    /// sending `outputs`, with its parameters taken by name from `params`
    /// (names it does not use are ignored), stepped by `optimizer`.
    pub fn new(
        device: D,
        graph: &Graph,
        range: Range<usize>,
        outputs: &[String],
        params: &BTreeMap<String, Vec<f32>>,
        optimizer: OptimizerConfig,
    ) -> Result<Self, StageError> {
        let analysis = graph
            .analyze()
            .map_err(|e| StageError::Graph(e.to_string()))?;
        let layout = StageLayout::new(graph, &analysis, range.clone(), outputs)?;
        let local_dtypes = analysis.nodes[range]
            .iter()
            .map(|n| n.output.dtype)
            .collect();
        let mut states = Vec::with_capacity(layout.params.len());
        for p in &layout.params {
            let err = |reason: String| StageError::Param {
                name: p.name.clone(),
                reason,
            };
            let values = params
                .get(&p.name)
                .ok_or_else(|| err("missing from the values given to the stage".into()))?;
            let len = numel(&p.shape);
            if values.len() != len {
                return Err(err(format!(
                    "{} values for shape {:?}",
                    values.len(),
                    p.shape
                )));
            }
            // Integer constants (Gather indices, shapes) compute as f32, as
            // integer inputs do; an integer buffer is a counter.
            let count = (p.dtype != DType::F32 && p.kind != ParamKind::Constant)
                .then(|| values.first().copied().unwrap_or(0.0) as i64);
            if count.is_some() && (len != 1 || p.kind == ParamKind::Trainable) {
                return Err(err(
                    "integer parameters other than a counter buffer are not supported by this backend yet".into(),
                ));
            }
            let value = device.alloc(if count.is_some() { 1 } else { len })?;
            if count.is_none() {
                device.write_f32(&value, values)?;
            }
            let grad = device.alloc(if p.kind == ParamKind::Trainable {
                len
            } else {
                0
            })?;
            states.push(ParamState {
                value,
                stashed: Vec::new(),
                grad,
                has_grad: false,
                state: Vec::new(),
                uniform: None,
                steps: 0,
                len,
                count,
            });
        }
        let mut accumulate = HashMap::new();
        for (p, state) in layout.params.iter().zip(&states) {
            if p.kind != ParamKind::Trainable {
                continue;
            }
            let len = state.len;
            for (has_grad, kernel) in [
                (false, Kernel::Copy { len }),
                (true, Kernel::AddInto { len }),
            ] {
                accumulate
                    .entry((has_grad, len))
                    .or_insert_with(|| (kernel.clone(), device.prepare(&kernel)));
            }
        }
        Ok(Self {
            accumulate,
            extrapolate: HashMap::new(),
            device,
            graph: graph.clone(),
            layout,
            local_dtypes,
            params: states,
            optimizer,
            programs: HashMap::new(),
            free: HashMap::new(),
            scratch: HashMap::new(),
            temps: HashMap::new(),
            in_flight: BTreeMap::new(),
            versions: None,
            seed: 0,
            next_micro_batch: 0,
            optimizer_kernels: HashMap::new(),
            int8: None,
            transfers: Transfers::default(),
            precision: Precision::F32,
        })
    }

    pub fn device(&self) -> &D {
        &self.device
    }

    /// Computes the stage's matrix products in `precision` from now on
    /// (programs already lowered are lowered again).
    pub fn set_precision(&mut self, precision: Precision) -> Result<(), StageError> {
        self.idle("changing the precision")?;
        if precision != self.precision {
            self.precision = precision;
            self.programs.clear();
            self.temps.clear();
        }
        Ok(())
    }

    /// Keeps two forward versions of the trainable weights from now on, and
    /// the master weights apart from them (the `async` schedule, see the
    /// module docs): forwards may ask for [`WeightVersion::Previous`], and
    /// [`Self::step`] may run while micro-batches of the `Current` ones
    /// await their backward. Allocates two more value buffers per trainable
    /// parameter; until the first step every version is the master weights.
    pub fn keep_previous_weights(&mut self) -> Result<(), StageError> {
        if self.versions.is_some() {
            return Ok(());
        }
        self.idle("keeping two weight versions")?;
        for (p, state) in self.layout.params.iter().zip(&mut self.params) {
            if p.kind == ParamKind::Trainable {
                state.stashed = (0..2)
                    .map(|_| self.device.alloc(state.len))
                    .collect::<Result<_, _>>()?;
                let kernel = Kernel::Extrapolate { len: state.len };
                self.extrapolate
                    .entry(state.len)
                    .or_insert_with(|| (kernel.clone(), self.device.prepare(&kernel)));
            }
        }
        self.versions = Some(Versions {
            master: 0,
            current: 0,
            previous: 0,
        });
        Ok(())
    }

    /// Makes both forward versions the master weights (a barrier: the next
    /// step runs with them, unextrapolated). Micro-batches in flight keep
    /// the weights their forward used. Nothing to do with one version.
    pub fn merge_versions(&mut self) {
        if let Some(v) = &mut self.versions {
            v.current = v.master;
            v.previous = v.master;
        }
    }

    /// The weight set holding `version`.
    fn weight_set(&self, version: WeightVersion) -> Result<usize, StageError> {
        match (self.versions, version) {
            (None, WeightVersion::Current) => Ok(0),
            (Some(v), WeightVersion::Current) => Ok(v.current),
            (Some(v), WeightVersion::Previous) => Ok(v.previous),
            (None, WeightVersion::Previous) => Err(StageError::Internal(
                "a forward with the previous weights on a stage that keeps one version".into(),
            )),
        }
    }

    /// The set of the master weights.
    fn master_set(&self) -> usize {
        self.versions.map_or(0, |v| v.master)
    }

    /// Names this stage expects in [`forward`](Self::forward), in order.
    pub fn input_names(&self) -> Vec<String> {
        self.layout.inputs.iter().map(|i| i.name.clone()).collect()
    }

    /// Inputs whose gradient [`backward`](Self::backward) returns.
    pub fn grad_input_names(&self) -> Vec<String> {
        self.layout
            .inputs
            .iter()
            .filter(|i| i.requires_grad)
            .map(|i| i.name.clone())
            .collect()
    }

    /// Whether each parameter (in [`Self::param_names`] order) is an integer
    /// buffer, which travels as i64.
    pub fn param_is_integer(&self) -> Vec<bool> {
        self.layout
            .params
            .iter()
            .map(|p| p.dtype != DType::F32)
            .collect()
    }

    /// Every parameter and buffer of the stage, by name.
    pub fn param_names(&self) -> Vec<String> {
        self.layout.params.iter().map(|p| p.name.clone()).collect()
    }

    pub fn output_names(&self) -> Vec<String> {
        self.layout.outputs.iter().map(|(n, _)| n.clone()).collect()
    }

    /// Runs the training forward and backward kernels of a `batch`-sample
    /// micro-batch `times` times on whatever its buffers hold, with no
    /// uploads and no readbacks but one at the end to wait for the device:
    /// what a micro-batch costs the device alone, which benchmarks subtract
    /// from a whole micro-batch's time. Parameter gradients are not touched.
    pub async fn replay_kernels(&mut self, batch: usize, times: usize) -> Result<(), StageError> {
        let key = (batch, true);
        self.ensure_program(key)?;
        self.ensure_scratch(batch)?;
        let acts = self.take_activations(key)?;
        let set = self.master_set();
        let result = async {
            let program = &self.programs[&key];
            for _ in 0..times {
                for calls in [&program.forward, &program.backward] {
                    let bound = self.bind(calls, key, set, Some(&acts))?;
                    self.device.run(&bound).await?;
                }
            }
            // Reading anything back waits for the work queued before it.
            if let Some(state) = self.params.first() {
                self.device.read_f32(&state.value).await?;
            }
            Ok(())
        }
        .await;
        self.free.entry(key).or_default().push(acts);
        result
    }

    /// Micro-batches forwarded but not yet backpropagated.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Sets the seed of the coming step's dropout masks (the worker's
    /// [`step_seed`](crate::step_seed)).
    pub fn set_step_seed(&mut self, seed: u64) {
        self.seed = seed;
    }

    /// Runs one training micro-batch forward and keeps what backward needs,
    /// as [`Self::forward_at`] with the micro-batch first in its step.
    pub async fn forward(
        &mut self,
        inputs: &[(String, HostTensor)],
    ) -> Result<(MicroBatch, Vec<(String, HostTensor)>), StageError> {
        self.forward_at(inputs, 0).await
    }

    /// Runs one training micro-batch whose first sample is `offset` in the
    /// step's batch (which selects its share of the dropout masks) forward,
    /// and keeps what backward needs.
    pub async fn forward_at(
        &mut self,
        inputs: &[(String, HostTensor)],
        offset: u64,
    ) -> Result<(MicroBatch, Vec<(String, HostTensor)>), StageError> {
        self.forward_with_weights(inputs, offset, WeightVersion::Current)
            .await
    }

    /// [`Self::forward_at`] with the weights of `version` (`Previous` only
    /// after [`Self::keep_previous_weights`]); the micro-batch's backward
    /// uses the same, whatever steps come between.
    pub async fn forward_with_weights(
        &mut self,
        inputs: &[(String, HostTensor)],
        offset: u64,
        version: WeightVersion,
    ) -> Result<(MicroBatch, Vec<(String, HostTensor)>), StageError> {
        let set = self.weight_set(version)?;
        let (batch, acts, outputs) = self.run_forward(inputs, offset, true, set).await?;
        let id = MicroBatch(self.next_micro_batch);
        self.next_micro_batch += 1;
        self.in_flight.insert(id, (batch, set, acts));
        Ok((id, outputs))
    }

    async fn run_forward(
        &mut self,
        inputs: &[(String, HostTensor)],
        offset: u64,
        train: bool,
        set: usize,
    ) -> Result<(usize, Activations<D::Buffer>, Vec<(String, HostTensor)>), StageError> {
        let result = self.forward_batch(inputs, offset, train, set).await;
        // Packed inputs held for this call are gone, whatever happened.
        self.end_call();
        result
    }

    async fn forward_batch(
        &mut self,
        inputs: &[(String, HostTensor)],
        offset: u64,
        train: bool,
        set: usize,
    ) -> Result<(usize, Activations<D::Buffer>, Vec<(String, HostTensor)>), StageError> {
        let batch = self.batch_of(inputs)?;
        let key = (batch, train);
        self.ensure_program(key)?;
        self.ensure_temps(key)?;
        let acts = self.take_activations(key)?;
        let result = self.run_forward_with(inputs, offset, key, set, &acts).await;
        match result {
            Ok(outputs) => Ok((batch, acts, outputs)),
            Err(e) => {
                self.free.entry(key).or_default().push(acts);
                Err(e)
            }
        }
    }

    /// Backpropagates one micro-batch from the gradients of the stage's
    /// outputs (an output left out counts as zero) and returns the gradients
    /// of [`grad_input_names`](Self::grad_input_names). Parameter gradients
    /// accumulate until [`step`](Self::step).
    pub async fn backward(
        &mut self,
        micro_batch: MicroBatch,
        output_grads: &[(String, HostTensor)],
    ) -> Result<Vec<(String, HostTensor)>, StageError> {
        let Some((batch, set, acts)) = self.in_flight.remove(&micro_batch) else {
            self.end_call();
            return Err(StageError::UnknownMicroBatch(micro_batch.0));
        };
        let result = self.backward_with(batch, set, &acts, output_grads).await;
        self.end_call();
        self.free.entry((batch, true)).or_default().push(acts);
        result
    }

    /// A forward pass in evaluation mode (no dropout, BatchNorm on its
    /// running statistics) that keeps nothing, for validation.
    pub async fn evaluate(
        &mut self,
        inputs: &[(String, HostTensor)],
    ) -> Result<Vec<(String, HostTensor)>, StageError> {
        let set = self.master_set();
        let (batch, acts, outputs) = self.run_forward(inputs, 0, false, set).await?;
        self.free.entry((batch, false)).or_default().push(acts);
        Ok(outputs)
    }

    /// Drops a micro-batch's saved state without backpropagating it.
    pub fn discard(&mut self, micro_batch: MicroBatch) -> Result<(), StageError> {
        let (batch, _, acts) = self
            .in_flight
            .remove(&micro_batch)
            .ok_or(StageError::UnknownMicroBatch(micro_batch.0))?;
        self.free.entry((batch, true)).or_default().push(acts);
        Ok(())
    }

    /// Applies the optimizer to every trainable parameter that received a
    /// gradient since the last step (as PyTorch skips those whose `.grad` is
    /// None), then clears the gradients.
    pub async fn step(&mut self) -> Result<(), StageError> {
        self.step_at_lr(self.optimizer.lr()).await
    }

    /// The sum of the squares of every accumulated parameter gradient, in
    /// f64, parameter by parameter in the stage's order (read back from the
    /// device: WGSL has no f64, and the sum must be the same everywhere).
    pub async fn grad_sum_of_squares(&self) -> Result<f64, StageError> {
        self.idle_unless_versioned("measuring gradients")?;
        let mut acc = 0.0;
        for state in self.params.iter().filter(|s| s.has_grad) {
            acc = sum_of_squares(acc, &self.device.read_f32(&state.grad).await?);
        }
        Ok(acc)
    }

    /// The parameter gradients accumulated since the last step, by name;
    /// parameters without one are left out.
    pub async fn gradients(&self) -> Result<Vec<(String, HostTensor)>, StageError> {
        let mut out = Vec::new();
        for (p, state) in self.layout.params.iter().zip(&self.params) {
            if state.has_grad {
                let data = self.device.read_f32(&state.grad).await?;
                out.push((
                    p.name.clone(),
                    HostTensor {
                        shape: p.shape.clone(),
                        data,
                    },
                ));
            }
        }
        Ok(out)
    }

    /// Multiplies every accumulated parameter gradient by `scale` in f32, as
    /// `clip_grad_norm_`'s `grad.mul_(clip_coef)`; 1 changes nothing.
    pub async fn scale_grads(&mut self, scale: f32) -> Result<(), StageError> {
        self.idle_unless_versioned("scaling gradients")?;
        if scale == 1.0 {
            return Ok(());
        }
        for state in self.params.iter().filter(|s| s.has_grad) {
            let scaled: Vec<f32> = self
                .device
                .read_f32(&state.grad)
                .await?
                .into_iter()
                .map(|g| g * scale)
                .collect();
            self.device.write_f32(&state.grad, &scaled)?;
        }
        Ok(())
    }

    /// [`Self::step`] with learning rate `lr` (a schedule's value at this
    /// step) in place of the optimizer's: only the uniform changes.
    ///
    /// With two weight versions the optimizer updates the master weights
    /// (a copy of them when forwards use their set), the new `Current` is
    /// their extrapolation by this update, written over the old
    /// `Previous`, which must have no micro-batch in flight, and the old
    /// `Current` becomes `Previous` (micro-batches in flight keep it). The
    /// first step after a merge runs with nothing in flight and makes
    /// `Previous` the new master weights.
    pub async fn step_at_lr(&mut self, lr: f64) -> Result<(), StageError> {
        let target = self.step_target()?;
        let optimizer = self.optimizer.with_lr(lr);
        let state_count = self.optimizer.state_names().len();
        let mut kernels = Vec::new();
        for (p, state) in self.params.iter_mut().enumerate() {
            if !state.has_grad {
                continue;
            }
            if state.state.len() != state_count {
                state.state = (0..state_count)
                    .map(|_| self.device.alloc(state.len))
                    .collect::<Result<_, _>>()?;
            }
            let uniform = match &state.uniform {
                Some(u) => u,
                None => state.uniform.insert(self.device.alloc(8)?),
            };
            state.steps += 1;
            self.device
                .write_u32(uniform, &optimizer.uniform(state.steps))?;
            if !self.optimizer_kernels.contains_key(&state.len) {
                let kernel = Kernel::OptimizerStep {
                    optimizer: self.optimizer,
                    len: state.len,
                    step: 1,
                };
                self.optimizer_kernels
                    .insert(state.len, self.device.prepare(&kernel));
            }
            // The CPU device reads the settings from the call (the GPU the
            // uniform, written above): both get this step's lr.
            kernels.push((
                p,
                Kernel::OptimizerStep {
                    optimizer,
                    len: state.len,
                    step: state.steps,
                },
            ));
            state.has_grad = false;
        }
        let mut calls: BoundCalls<'_, D> = Vec::new();
        let stashed = || self.params.iter().filter(|s| !s.stashed.is_empty());
        if let Some(v) = self.versions {
            // Both new sets start as the old master weights, parameters
            // without a gradient included (their extrapolation is
            // themselves).
            for s in stashed() {
                let (kernel, prepared) = &self.accumulate[&(false, s.len)];
                for set in [target.master, target.current] {
                    if set != v.master {
                        calls.push((
                            kernel,
                            prepared,
                            vec![s.value_in(v.master), s.value_in(set)],
                        ));
                    }
                }
            }
        }
        calls.extend(kernels.iter().map(|(p, kernel)| {
            let s = &self.params[*p];
            let mut buffers = vec![
                s.uniform.as_ref().expect("allocated above"),
                s.value_in(target.master),
                &s.grad,
            ];
            buffers.extend(s.state.iter());
            (kernel, &self.optimizer_kernels[&s.len], buffers)
        }));
        if self.versions.is_some() {
            for s in stashed() {
                let (kernel, prepared) = &self.extrapolate[&s.len];
                calls.push((
                    kernel,
                    prepared,
                    vec![s.value_in(target.master), s.value_in(target.current)],
                ));
            }
        }
        self.device.run(&calls).await?;
        drop(calls);
        if let Some(v) = &mut self.versions {
            *v = target;
        }
        Ok(())
    }

    /// The weight sets after a step: it writes the new master weights and
    /// the new Current, refusing a step that would corrupt a micro-batch in
    /// flight: any with one version, those of `Previous` (whose set the
    /// step overwrites) with two.
    pub(crate) fn step_target(&self) -> Result<Versions, StageError> {
        let Some(v) = self.versions else {
            self.idle("stepping")?;
            return Ok(Versions {
                master: 0,
                current: 0,
                previous: 0,
            });
        };
        let mut free = (0..3).filter(|&set| set != v.master && set != v.current);
        let target = if v.current == v.master {
            // After a barrier forwards run on the master set itself, and the
            // next step waits for this update and runs with the master
            // weights it makes (as Previous).
            self.idle("the first step after a barrier (the next step runs with its update)")?;
            let master = free.next().unwrap_or(v.master);
            Versions {
                master,
                current: free.next().unwrap_or(v.master),
                previous: master,
            }
        } else {
            // The old Current has micro-batches in flight; the master
            // weights are updated in place.
            Versions {
                master: v.master,
                current: free.next().unwrap_or(v.master),
                previous: v.current,
            }
        };
        let stale = self
            .in_flight
            .values()
            .filter(|(_, set, _)| *set == target.current || *set == target.master)
            .count();
        if stale > 0 {
            return Err(StageError::InFlight {
                in_flight: stale,
                action: "a step over the previous weights their forward used".into(),
            });
        }
        Ok(target)
    }

    /// Drops accumulated gradients (PyTorch's `zero_grad(set_to_none=True)`).
    pub fn zero_grad(&mut self) -> Result<(), StageError> {
        self.idle("clearing gradients")?;
        for p in &mut self.params {
            p.has_grad = false;
        }
        Ok(())
    }

    /// Copies of every parameter and buffer, by name.
    pub async fn parameters(&self) -> Result<Vec<(String, HostTensor)>, StageError> {
        let mut out = Vec::with_capacity(self.params.len());
        let set = self.master_set();
        for (p, state) in self.layout.params.iter().zip(&self.params) {
            let data = match state.count {
                Some(c) => vec![c as f32],
                None => self.device.read_f32(state.value_in(set)).await?,
            };
            out.push((
                p.name.clone(),
                HostTensor {
                    shape: p.shape.clone(),
                    data,
                },
            ));
        }
        Ok(out)
    }

    /// Loads values into some or all parameters, keeping gradients and
    /// optimizer state; with two weight versions, into both.
    pub fn set_parameters(&mut self, values: &[(String, HostTensor)]) -> Result<(), StageError> {
        self.idle("loading parameters")?;
        for (name, v) in values {
            let err = |reason: String| StageError::Param {
                name: name.clone(),
                reason,
            };
            let Some(at) = self.layout.params.iter().position(|p| p.name == *name) else {
                return Err(err("not a parameter of this stage".into()));
            };
            if v.shape != self.layout.params[at].shape {
                return Err(err(format!(
                    "shape {:?} differs from the parameter's {:?}",
                    v.shape, self.layout.params[at].shape
                )));
            }
            let state = &mut self.params[at];
            match &mut state.count {
                Some(c) => *c = v.data.first().copied().unwrap_or(0.0) as i64,
                None => {
                    self.device.write_f32(&state.value, &v.data)?;
                    for stashed in &state.stashed {
                        self.device.write_f32(stashed, &v.data)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Each updated parameter's optimizer state: its name, the updates it
    /// has had, and its state slots by torch's names (`exp_avg`, ...).
    pub async fn optimizer_state(&self) -> Result<Vec<ParamOptimizerState>, StageError> {
        let names = self.optimizer.state_names();
        let mut out = Vec::new();
        for (p, state) in self.layout.params.iter().zip(&self.params) {
            if state.steps == 0 {
                continue;
            }
            let mut slots = Vec::with_capacity(names.len());
            for (name, buffer) in names.iter().zip(&state.state) {
                let data = self.device.read_f32(buffer).await?;
                slots.push((
                    (*name).to_string(),
                    HostTensor {
                        shape: p.shape.clone(),
                        data,
                    },
                ));
            }
            out.push(ParamOptimizerState {
                name: p.name.clone(),
                steps: state.steps,
                slots,
            });
        }
        Ok(out)
    }

    /// Restores what [`Self::optimizer_state`] gave (possibly on another
    /// provider), so the next step continues exactly where it left off.
    pub fn restore_optimizer_state(
        &mut self,
        states: &[ParamOptimizerState],
    ) -> Result<(), StageError> {
        self.idle("restoring optimizer state")?;
        let names = self.optimizer.state_names();
        for s in states {
            let err = |reason: String| StageError::Param {
                name: s.name.clone(),
                reason,
            };
            let Some(at) = self.layout.params.iter().position(|p| p.name == s.name) else {
                return Err(err(
                    "optimizer state for a parameter this stage does not have".into(),
                ));
            };
            let shape = self.layout.params[at].shape.clone();
            let mut buffers = Vec::with_capacity(names.len());
            for name in &names {
                let (_, t) = s
                    .slots
                    .iter()
                    .find(|(slot, _)| slot == name)
                    .ok_or_else(|| err(format!("optimizer state lacks `{name}`")))?;
                if t.shape != shape || t.data.len() != numel(&shape) {
                    return Err(err(format!(
                        "optimizer state `{name}` has shape {:?}, the parameter {shape:?}",
                        t.shape
                    )));
                }
                let buffer = self.device.alloc(t.data.len())?;
                self.device.write_f32(&buffer, &t.data)?;
                buffers.push(buffer);
            }
            if let Some((extra, _)) = s
                .slots
                .iter()
                .find(|(slot, _)| !names.contains(&slot.as_str()))
            {
                return Err(err(format!(
                    "`{extra}` is not a state slot of this optimizer (it keeps {names:?})"
                )));
            }
            let state = &mut self.params[at];
            state.state = buffers;
            state.steps = s.steps;
        }
        Ok(())
    }

    /// [`Self::idle`], but with two weight versions gradients may be
    /// measured and scaled while micro-batches await backward (theirs are
    /// not in them yet).
    fn idle_unless_versioned(&self, action: &str) -> Result<(), StageError> {
        match self.versions {
            Some(_) => Ok(()),
            None => self.idle(action),
        }
    }

    fn idle(&self, action: &str) -> Result<(), StageError> {
        if self.in_flight.is_empty() {
            Ok(())
        } else {
            Err(StageError::InFlight {
                in_flight: self.in_flight.len(),
                action: action.into(),
            })
        }
    }

    fn batch_of(&self, inputs: &[(String, HostTensor)]) -> Result<usize, StageError> {
        for (name, t) in inputs {
            if !self.layout.inputs.iter().any(|i| i.name == *name) {
                return Err(StageError::Input {
                    name: name.clone(),
                    reason: format!(
                        "not an input of this stage (expects {:?})",
                        self.input_names()
                    ),
                });
            }
            if !t.is_packed() && t.data.len() != numel(&t.shape) {
                return Err(StageError::Input {
                    name: name.clone(),
                    reason: format!("{} values for shape {:?}", t.data.len(), t.shape),
                });
            }
        }
        let batch = inputs
            .first()
            .and_then(|(_, t)| t.shape.first().copied())
            .ok_or_else(|| StageError::Input {
                name: self.input_names().join(", "),
                reason: "missing".into(),
            })?;
        if batch == 0 {
            return Err(StageError::Input {
                name: inputs[0].0.clone(),
                reason: "an empty batch".into(),
            });
        }
        Ok(batch)
    }

    fn ensure_program(&mut self, key: Key) -> Result<(), StageError> {
        if !self.programs.contains_key(&key) {
            let device = &self.device;
            let (batch, train) = key;
            let program = lower(
                &self.graph,
                &self.layout,
                batch,
                train,
                &self.local_dtypes,
                self.precision,
                |k| device.prepare(k),
            )?;
            self.programs.insert(key, program);
        }
        Ok(())
    }

    fn take_activations(&mut self, key: Key) -> Result<Activations<D::Buffer>, StageError> {
        if let Some(acts) = self.free.get_mut(&key).and_then(Vec::pop) {
            return Ok(acts);
        }
        let program = &self.programs[&key];
        let alloc = |shapes: &[Vec<usize>]| {
            shapes
                .iter()
                .map(|s| self.device.alloc(numel(s)))
                .collect::<Result<Vec<_>, _>>()
        };
        Ok(Activations {
            inputs: alloc(&program.input_shapes)?,
            locals: alloc(&program.local_shapes)?,
            saved: program
                .saved_lens
                .iter()
                .map(|&n| self.device.alloc(n))
                .collect::<Result<Vec<_>, _>>()?,
        })
    }

    fn ensure_scratch(&mut self, batch: usize) -> Result<(), StageError> {
        if self.scratch.contains_key(&batch) {
            return Ok(());
        }
        let program = &self.programs[&(batch, true)];
        let alloc = |lens: &mut dyn Iterator<Item = usize>| {
            lens.map(|n| self.device.alloc(n))
                .collect::<Result<Vec<_>, _>>()
        };
        let scratch = Scratch {
            input_grads: alloc(&mut program.input_shapes.iter().map(|s| numel(s)))?,
            local_grads: alloc(&mut program.local_shapes.iter().map(|s| numel(s)))?,
            param_grads: alloc(&mut self.layout.params.iter().map(|p| {
                if p.kind == ParamKind::Trainable {
                    numel(&p.shape)
                } else {
                    0
                }
            }))?,
        };
        self.scratch.insert(batch, scratch);
        self.ensure_temps((batch, true))
    }

    fn ensure_temps(&mut self, key: Key) -> Result<(), StageError> {
        if self.temps.contains_key(&key) {
            return Ok(());
        }
        let temps = self.programs[&key]
            .temp_lens
            .iter()
            .map(|&n| self.device.alloc(n))
            .collect::<Result<Vec<_>, _>>()?;
        self.temps.insert(key, temps);
        Ok(())
    }

    /// The real buffers of `calls`.
    fn bind<'a>(
        &'a self,
        calls: &'a [crate::program::Call<D::Prepared>],
        key: Key,
        set: usize,
        acts: Option<&'a Activations<D::Buffer>>,
    ) -> Result<BoundCalls<'a, D>, StageError> {
        let scratch = self.scratch.get(&key.0);
        let temps = self.temps.get(&key);
        let missing = || StageError::Internal("a buffer was bound before it was made".into());
        calls
            .iter()
            .map(|call| {
                let buffers = call
                    .args
                    .iter()
                    .map(|b| -> Result<&D::Buffer, StageError> {
                        Ok(match *b {
                            Buf::Value(Source::Param(p)) => self.params[p].value_in(set),
                            Buf::Value(Source::Input(i)) => &acts.ok_or_else(missing)?.inputs[i],
                            Buf::Value(Source::Local(j)) => &acts.ok_or_else(missing)?.locals[j],
                            Buf::Grad(Source::Param(p)) => {
                                &scratch.ok_or_else(missing)?.param_grads[p]
                            }
                            Buf::Grad(Source::Input(i)) => {
                                &scratch.ok_or_else(missing)?.input_grads[i]
                            }
                            Buf::Grad(Source::Local(j)) => {
                                &scratch.ok_or_else(missing)?.local_grads[j]
                            }
                            Buf::Temp(t) => &temps.ok_or_else(missing)?[t],
                            Buf::Saved(s) => &acts.ok_or_else(missing)?.saved[s],
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Ok((&call.kernel, &call.prepared, buffers))
            })
            .collect()
    }
}
