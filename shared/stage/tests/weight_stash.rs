//! PipeDream-2BW weight stashing with weight prediction on our executor
//! (`StageSpec::stash_weights`, the `async` schedule), through `OwnFactory`
//! and the `Backend` calls the worker makes: a step's micro-batches run
//! forward on the weights before the previous step's update, extrapolated
//! by the update before that, and backward on the same ones after it, and
//! the result is, bit for bit, what executors keeping one version compute
//! when handed those weights. On the CPU references always; on the GPU
//! (lavapipe natively) with the `gpu` feature.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::{Case, block, pseudo};

use rookery_model::{DType, Graph, OptimizerConfig, ParamKind};
use rookery_proto::{WireDType, WireTensor};
use rookery_stage::worker::StageSpec;
use rookery_stage::{
    Backend, BackendFactory, CpuDevice, Device, HostTensor, MicroBatch, OwnFactory, StageError,
    StageExecutor, WeightVersion, extrapolate,
};

type Exec<D> = StageExecutor<Arc<D>>;
type Named = Vec<(String, HostTensor)>;

const LR: f64 = 0.05;

impl Case {
    /// Dense 4 -> 5 (ReLU) | 6 (tanh) -> 3: the stage is the last two layers.
    fn mlp() -> Self {
        Self::new(
            "MLP",
            "input_shape = [4]\n\
             [[layers]]\ntype = \"Dense\"\nunits = 5\nactivation = \"relu\"\n\
             [[layers]]\ntype = \"Dense\"\nunits = 6\nactivation = \"tanh\"\n\
             [[layers]]\ntype = \"Dense\"\nunits = 3\n",
            2,
        )
    }

    /// Dense 4 -> 5 (ReLU) | 6, BatchNorm1d, ReLU -> 3: running statistics
    /// and the batch counter are kept once, whatever the version.
    fn batch_norm() -> Self {
        Self::new(
            "MLP with BatchNorm",
            "input_shape = [4]\n\
             [[layers]]\ntype = \"Dense\"\nunits = 5\nactivation = \"relu\"\n\
             [[layers]]\ntype = \"Dense\"\nunits = 6\n\
             [[layers]]\ntype = \"BatchNormalization1D\"\n\
             [[layers]]\ntype = \"Activation\"\nname = \"relu\"\n\
             [[layers]]\ntype = \"Dense\"\nunits = 3\n",
            2,
        )
    }

    /// A micro-batch of `batch` samples: its input and its output gradient.
    fn micro_batch(&self, batch: usize, seed: u64) -> (HostTensor, HostTensor) {
        let tensor = |width: usize, seed: u64| HostTensor {
            shape: vec![batch, width],
            data: pseudo(batch * width, seed, 1),
        };
        (
            tensor(self.in_width, seed),
            tensor(self.out_width, seed + 1000),
        )
    }

    fn trainable(&self, values: &Named) -> Named {
        values
            .iter()
            .filter(|(name, _)| {
                self.graph
                    .params
                    .iter()
                    .any(|p| p.name == *name && p.kind == ParamKind::Trainable)
            })
            .cloned()
            .collect()
    }
}

/// The parameter values given as they cross the wire.
fn wire(graph: &Graph, values: &BTreeMap<String, Vec<f32>>) -> Vec<WireTensor> {
    graph
        .params
        .iter()
        .filter(|p| values.contains_key(&p.name))
        .map(|p| {
            let v = &values[&p.name];
            if p.dtype == DType::F32 {
                WireTensor::from_f32(&p.name, &p.shape, v, WireDType::F32)
            } else {
                let v: Vec<i64> = v.iter().map(|&x| x as i64).collect();
                WireTensor::from_i64(&p.name, &p.shape, &v)
            }
        })
        .collect()
}

/// The forward weights a step extrapolates from `before` and `latest`
/// (buffers are kept once: `latest`'s), computed on the host.
fn predicted(case: &Case, latest: &Named, before: &Named) -> Named {
    let trainable = case.trainable(latest);
    latest
        .iter()
        .map(|(name, t)| {
            let Some((_, b)) = before.iter().find(|(n, _)| n == name) else {
                return (name.clone(), t.clone());
            };
            if !trainable.iter().any(|(n, _)| n == name) {
                return (name.clone(), t.clone());
            }
            let data = t
                .data
                .iter()
                .zip(&b.data)
                .map(|(&l, &b)| extrapolate(l, b))
                .collect();
            let shape = t.shape.clone();
            (name.clone(), HostTensor { shape, data })
        })
        .collect()
}

fn as_map(values: &Named) -> BTreeMap<String, Vec<f32>> {
    values
        .iter()
        .map(|(n, t)| (n.clone(), t.data.clone()))
        .collect()
}

fn build<D: Device>(
    factory: &mut OwnFactory<D>,
    case: &Case,
    values: &BTreeMap<String, Vec<f32>>,
    optimizer: OptimizerConfig,
    stash_weights: bool,
) -> Exec<D> {
    let params = wire(&case.graph, values);
    let outputs = vec![case.output.clone()];
    factory
        .build(StageSpec {
            graph: &case.graph,
            range: case.range.clone(),
            outputs: &outputs,
            params: &params,
            optimizer,
            optimizer_state: &[],
            stash_weights,
            wire: rookery_stage::StageWire::F32,
            precision: Default::default(),
        })
        .unwrap()
}

fn forward<D: Device>(
    e: &mut Exec<D>,
    case: &Case,
    x: &HostTensor,
    offset: u64,
    version: WeightVersion,
) -> (MicroBatch, Named) {
    block(Backend::forward(
        e,
        &[(case.input.clone(), x.clone())],
        offset,
        version,
    ))
    .unwrap()
}

fn backward<D: Device>(e: &mut Exec<D>, case: &Case, mb: MicroBatch, dy: &HostTensor) -> Named {
    block(Backend::backward(
        e,
        mb,
        &[(case.output.clone(), dy.clone())],
    ))
    .unwrap()
}

fn step<D: Device>(e: &mut Exec<D>) -> Result<(), StageError> {
    block(Backend::step(e, LR, 1.0))
}

fn params<D: Device>(e: &Exec<D>) -> Named {
    block(StageExecutor::parameters(e)).unwrap()
}

fn grads<D: Device>(e: &Exec<D>) -> Named {
    block(e.gradients()).unwrap()
}

/// Tensors as bits, so equality is bitwise.
fn bits(tensors: &[(String, HostTensor)]) -> Vec<(String, Vec<usize>, Vec<u32>)> {
    tensors
        .iter()
        .map(|(n, t)| {
            (
                n.clone(),
                t.shape.clone(),
                t.data.iter().map(|v| v.to_bits()).collect(),
            )
        })
        .collect()
}

fn same(a: &[(String, HostTensor)], b: &[(String, HostTensor)], what: &str) {
    assert!(!a.is_empty(), "{what}: nothing to compare");
    assert_eq!(bits(a), bits(b), "{what}");
}

/// A barrier's step and three steps of 2BW on a stage keeping two versions
/// (`s`), against one keeping one (`r`) handed the weights each
/// micro-batch ran with.
fn two_bw_matches_one_version<D: Device>(
    make: &dyn Fn() -> OwnFactory<D>,
    case: &Case,
    optimizer: OptimizerConfig,
) {
    let what = |s: &str| format!("{} with {optimizer:?}: {s}", case.name);
    let mut factory = make();
    let init = case.graph.initial_values(3);
    let mut s = build(&mut factory, case, &init, optimizer, true);
    let mut r = build(&mut factory, case, &init, optimizer, false);
    // Two micro-batches a step, of 3 and 2 samples.
    let barriers = [case.micro_batch(3, 7), case.micro_batch(2, 8)];
    let step0 = [case.micro_batch(3, 1), case.micro_batch(2, 2)];
    let step1 = [case.micro_batch(3, 3), case.micro_batch(2, 4)];
    let offsets = [0, 3];

    // The barrier's step alike on both, and its update with nothing in
    // flight (the step after it waits for it).
    let passes = |e: &mut Exec<D>, batches: &[(HostTensor, HostTensor)], version| {
        let mbs: Vec<_> = batches
            .iter()
            .zip(offsets)
            .map(|((x, _), o)| forward(e, case, x, o, version).0)
            .collect();
        for (mb, (_, dy)) in mbs.into_iter().zip(batches) {
            backward(e, case, mb, dy);
        }
    };
    for e in [&mut s, &mut r] {
        passes(e, &barriers, WeightVersion::Current);
    }
    step(&mut s).unwrap();
    step(&mut r).unwrap();
    let w_init = named(&case.graph, &init, &r.param_names());
    let w0 = params(&r);

    // Step 0 (the one after the barrier's) on what that update made: its
    // Previous on `s`.
    passes(&mut s, &step0, WeightVersion::Previous);
    passes(&mut r, &step0, WeightVersion::Current);
    // `s` runs step 1's forwards before step 0's update, then steps with
    // them in flight.
    let s_fwd: Vec<_> = step1
        .iter()
        .zip(offsets)
        .map(|((x, _), o)| forward(&mut s, case, x, o, WeightVersion::Current))
        .collect();
    // Clipping measures the gradients with those in flight.
    assert_eq!(
        block(s.grad_sum_of_squares()).unwrap().to_bits(),
        block(r.grad_sum_of_squares()).unwrap().to_bits(),
        "{}",
        what("step 0's gradient norm")
    );
    step(&mut s).unwrap();
    step(&mut r).unwrap();
    let w1 = params(&r);
    // (Its running statistics have seen step 1's forwards already.)
    same(
        &case.trainable(&params(&s)),
        &case.trainable(&w1),
        &what("Current after step 0"),
    );
    let s_dx: Vec<Named> = s_fwd
        .iter()
        .zip(&step1)
        .map(|((mb, _), (_, dy))| backward(&mut s, case, *mb, dy))
        .collect();

    // `r` runs step 1's micro-batches on W0 extrapolated by the barrier
    // step's update, keeping the optimizer state and running statistics
    // step 0 left.
    r.set_parameters(&case.trainable(&predicted(case, &w0, &w_init)))
        .unwrap();
    let mut r_dx = Vec::new();
    for (((x, dy), o), (_, s_y)) in step1.iter().zip(offsets).zip(&s_fwd) {
        let (mb, y) = forward(&mut r, case, x, o, WeightVersion::Current);
        same(&y, s_y, &what("step 1's outputs on W0"));
        r_dx.push(backward(&mut r, case, mb, dy));
    }
    for (a, b) in s_dx.iter().zip(&r_dx) {
        same(a, b, &what("step 1's input gradients on W0"));
    }
    same(
        &grads(&s),
        &grads(&r),
        &what("step 1's parameter gradients"),
    );
    // Those gradients update W1.
    r.set_parameters(&case.trainable(&w1)).unwrap();
    step(&mut s).unwrap();
    step(&mut r).unwrap();
    let w2 = params(&r);
    same(&params(&s), &w2, &what("Current after step 1"));

    // Previous is W1 extrapolated by step 0's update now, Current W2 by
    // step 1's: each matches a stage holding it alone, forward and backward.
    let (x, dy) = case.micro_batch(4, 5);
    let mut y_w2 = Vec::new();
    for (version, values, exact) in [
        (WeightVersion::Previous, predicted(case, &w1, &w0), &w1),
        (WeightVersion::Current, predicted(case, &w2, &w1), &w2),
    ] {
        assert_ne!(
            bits(&values),
            bits(exact),
            "{}",
            what("a prediction that moves nothing")
        );
        let values = &values;
        let versioned = |s: &str| what(&format!("{s} with {version:?}"));
        let mut one = build(&mut factory, case, &as_map(values), optimizer, false);
        let (mb, y) = forward(&mut s, case, &x, 0, version);
        let (one_mb, one_y) = forward(&mut one, case, &x, 0, WeightVersion::Current);
        same(&y, &one_y, &versioned("outputs"));
        same(
            &backward(&mut s, case, mb, &dy),
            &backward(&mut one, case, one_mb, &dy),
            &versioned("input gradients"),
        );
        same(&grads(&s), &grads(&one), &versioned("parameter gradients"));
        s.zero_grad().unwrap();
        // What W2 itself gives, for the merge below.
        let mut one = build(&mut factory, case, &as_map(exact), optimizer, false);
        y_w2 = forward(&mut one, case, &x, 0, WeightVersion::Current).1;
    }

    // A step would overwrite the weights of a micro-batch run with Previous.
    let (mb, _) = forward(&mut s, case, &x, 0, WeightVersion::Previous);
    let e = step(&mut s).unwrap_err();
    assert!(
        matches!(e, StageError::InFlight { in_flight: 1, .. }),
        "{}",
        what(&e.to_string())
    );
    same(
        &case.trainable(&params(&s)),
        &case.trainable(&w2),
        &what("Current after a refused step"),
    );
    backward(&mut s, case, mb, &dy);
    s.zero_grad().unwrap();

    // After a merge both versions are the master weights, unextrapolated;
    // the first step after it waits for both to come back.
    Backend::merge_versions(&mut s).unwrap();
    let (mb_prev, y_prev) = forward(&mut s, case, &x, 0, WeightVersion::Previous);
    let (mb_cur, y_cur) = forward(&mut s, case, &x, 0, WeightVersion::Current);
    same(&y_prev, &y_w2, &what("Previous after merging"));
    same(&y_cur, &y_w2, &what("Current after merging"));
    let e = step(&mut s).unwrap_err();
    assert!(
        matches!(e, StageError::InFlight { in_flight: 2, .. }),
        "{}",
        what(&e.to_string())
    );
    let dx_prev = backward(&mut s, case, mb_prev, &dy);
    let dx_cur = backward(&mut s, case, mb_cur, &dy);
    same(&dx_prev, &dx_cur, &what("input gradients after merging"));
    step(&mut s).unwrap();
    // Previous is now the master weights that step made: what the step
    // after the barrier's runs with.
    let made = params(&s);
    let mut one = build(&mut factory, case, &as_map(&made), optimizer, false);
    let (_, y) = forward(&mut s, case, &x, 0, WeightVersion::Previous);
    let (_, want) = forward(&mut one, case, &x, 0, WeightVersion::Current);
    same(
        &y,
        &want,
        &what("Previous after the step that followed the merge"),
    );
    let (_, y) = forward(&mut s, case, &x, 0, WeightVersion::Current);
    let mut one = build(
        &mut factory,
        case,
        &as_map(&predicted(case, &made, &w2)),
        optimizer,
        false,
    );
    let (_, want) = forward(&mut one, case, &x, 0, WeightVersion::Current);
    same(
        &y,
        &want,
        &what("Current after the step that followed the merge"),
    );
}

/// The values of the parameters named `keep` as tensors shaped as the
/// graph's parameters.
fn named(graph: &Graph, values: &BTreeMap<String, Vec<f32>>, keep: &[String]) -> Named {
    graph
        .params
        .iter()
        .filter(|p| keep.contains(&p.name))
        .map(|p| {
            (
                p.name.clone(),
                HostTensor {
                    shape: p.shape.clone(),
                    data: values[&p.name].clone(),
                },
            )
        })
        .collect()
}

fn optimizers() -> [OptimizerConfig; 2] {
    [
        OptimizerConfig::Sgd {
            lr: LR,
            momentum: 0.9,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.01,
        },
        OptimizerConfig::adamw(LR),
    ]
}

/// Until the first step Previous is Current; a stage keeping one version
/// refuses Previous and, as before, a step with micro-batches in flight.
fn versions_before_a_step_and_without_stashing<D: Device>(make: &dyn Fn() -> OwnFactory<D>) {
    let case = Case::mlp();
    let mut factory = make();
    let w0 = case.graph.initial_values(7);
    let optimizer = OptimizerConfig::adam(LR);
    let mut s = build(&mut factory, &case, &w0, optimizer, true);
    let (x, dy) = case.micro_batch(3, 9);
    let (a, ya) = forward(&mut s, &case, &x, 0, WeightVersion::Previous);
    let (b, yb) = forward(&mut s, &case, &x, 0, WeightVersion::Current);
    same(&ya, &yb, "Previous before any step");
    same(
        &backward(&mut s, &case, a, &dy),
        &backward(&mut s, &case, b, &dy),
        "input gradients",
    );
    // A merge with nothing stepped changes nothing.
    Backend::merge_versions(&mut s).unwrap();
    same(
        &params(&s),
        &named(&case.graph, &w0, &s.param_names()),
        "values after a merge",
    );

    let mut one = build(&mut factory, &case, &w0, optimizer, false);
    let e = block(Backend::forward(
        &mut one,
        &[(case.input.clone(), x.clone())],
        0,
        WeightVersion::Previous,
    ))
    .unwrap_err();
    assert!(e.to_string().contains("one version"), "{e}");
    assert_eq!(one.in_flight(), 0);
    Backend::merge_versions(&mut one).unwrap();
    let (mb, _) = forward(&mut one, &case, &x, 0, WeightVersion::Current);
    let e = step(&mut one).unwrap_err();
    assert!(matches!(e, StageError::InFlight { .. }), "{e}");
    let e = block(one.grad_sum_of_squares()).unwrap_err();
    assert!(matches!(e, StageError::InFlight { .. }), "{e}");
    backward(&mut one, &case, mb, &dy);
    step(&mut one).unwrap();
}

fn cpu() -> OwnFactory<CpuDevice> {
    OwnFactory::new(CpuDevice)
}

#[test]
fn two_bw_steps_match_one_version_stages_bitwise_on_the_cpu() {
    for case in [Case::mlp(), Case::batch_norm()] {
        for optimizer in optimizers() {
            two_bw_matches_one_version(&cpu, &case, optimizer);
        }
    }
}

#[test]
fn previous_is_current_until_a_step_and_one_version_refuses_it_on_the_cpu() {
    versions_before_a_step_and_without_stashing(&cpu);
}

#[cfg(feature = "gpu")]
mod gpu {
    use rookery_stage::GpuDevice;

    use super::*;

    fn gpu() -> OwnFactory<GpuDevice> {
        OwnFactory::new(block(GpuDevice::open()).unwrap_or_else(|e| {
            panic!("no usable GPU adapter ({e}); install mesa-vulkan-drivers (lavapipe)")
        }))
    }

    #[test]
    fn two_bw_steps_match_one_version_stages_bitwise_on_the_gpu() {
        for case in [Case::mlp(), Case::batch_norm()] {
            for optimizer in optimizers() {
                two_bw_matches_one_version(&gpu, &case, optimizer);
            }
        }
    }

    #[test]
    fn previous_is_current_until_a_step_and_one_version_refuses_it_on_the_gpu() {
        versions_before_a_step_and_without_stashing(&gpu);
    }
}
