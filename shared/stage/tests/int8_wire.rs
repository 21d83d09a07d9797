//! A stage whose activations and gradients travel as the wire's blockwise
//! int8 (`StageWire`), through `OwnFactory` and the `Backend` calls the
//! worker makes: its outputs and input gradients are packed on the device
//! and read back as the payload, and int8 inputs and output gradients are
//! uploaded as the payload and unpacked there. Each is compared with a twin
//! stage on an f32 wire fed the same values.
//!
//! On the CPU references the payloads are the wire encoder's bit for bit.
//! On the GPU (lavapipe natively, feature `gpu`) they are payloads the
//! quantize kernel may make of the twin's f32 values (`Int8Block::
//! check_payload`: scales exact, levels within WGSL's division error of a
//! half), decoded values are within the bounds derived from WGSL's stated
//! accuracy, and fewer bytes cross: the read-back of a packed tensor is
//! its payload's words.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use common::{Case, block, pseudo};

use rookery_kernels::int8::{BLOCK, Int8Block};
use rookery_model::{DType, OptimizerConfig};
use rookery_proto::{INT8_BLOCK, WireDType, WireTensor};
use rookery_stage::worker::StageSpec;
use rookery_stage::{
    Backend, BackendFactory, CpuDevice, Device, HostTensor, OwnFactory, StageExecutor, StageWire,
    WeightVersion,
};

type Exec<D> = StageExecutor<Arc<D>>;
type Named = Vec<(String, HostTensor)>;

impl Case {
    /// Dense 70 -> 130 (ReLU) | 67 (tanh): a Stem of the second layer,
    /// whose tensors end in ragged blocks and words.
    fn stem() -> Self {
        Self::new(
            "stem",
            "input_shape = [70]\n\
             [[layers]]\ntype = \"Dense\"\nunits = 130\nactivation = \"relu\"\n\
             [[layers]]\ntype = \"Dense\"\nunits = 67\nactivation = \"tanh\"\n",
            2,
        )
    }

    /// Dense 9 -> 150 | ReLU: a stage of the ReLU alone, which computes
    /// nothing that rounds (forward or backward).
    fn relu() -> Self {
        Self::new(
            "relu",
            "input_shape = [9]\n\
             [[layers]]\ntype = \"Dense\"\nunits = 150\n\
             [[layers]]\ntype = \"Activation\"\nname = \"relu\"\n",
            1,
        )
    }

    fn input(&self, batch: usize, seed: u64) -> HostTensor {
        HostTensor {
            shape: vec![batch, self.in_width],
            data: pseudo(batch * self.in_width, seed, 20),
        }
    }

    fn output_grad(&self, batch: usize, seed: u64) -> HostTensor {
        HostTensor {
            shape: vec![batch, self.out_width],
            data: pseudo(batch * self.out_width, seed, 20),
        }
    }

    fn build<D: Device>(&self, factory: &mut OwnFactory<D>, wire: StageWire) -> Exec<D> {
        let values = self.graph.initial_values(5);
        let params: Vec<WireTensor> = self
            .graph
            .params
            .iter()
            .filter(|p| p.dtype == DType::F32)
            .map(|p| WireTensor::from_f32(&p.name, &p.shape, &values[&p.name], WireDType::F32))
            .collect();
        let outputs = vec![self.output.clone()];
        factory
            .build(StageSpec {
                graph: &self.graph,
                range: self.range.clone(),
                outputs: &outputs,
                params: &params,
                optimizer: OptimizerConfig::sgd(0.1),
                optimizer_state: &[],
                stash_weights: false,
                precision: Default::default(),
                wire,
            })
            .unwrap()
    }
}

const INT8: StageWire = StageWire {
    dtype: WireDType::I8Block,
    sends_outputs: true,
};

/// The Leaf's: its output stays f32 for the loss.
const INT8_LEAF: StageWire = StageWire {
    dtype: WireDType::I8Block,
    sends_outputs: false,
};

fn forward<D: Device>(
    e: &mut Exec<D>,
    name: &str,
    x: HostTensor,
) -> (rookery_stage::MicroBatch, Named) {
    block(Backend::forward(
        e,
        &[(name.to_string(), x)],
        0,
        WeightVersion::Current,
    ))
    .unwrap()
}

fn encode<D: Device>(e: &Exec<D>, tensors: &Named) -> Vec<WireTensor> {
    tensors
        .iter()
        .map(|(n, t)| Backend::encode(e, n, t, WireDType::I8Block).unwrap())
        .collect()
}

fn only(tensors: &Named) -> &HostTensor {
    assert_eq!(tensors.len(), 1);
    &tensors[0].1
}

#[test]
fn the_kernels_references_are_the_wire_encoder_and_decoder_bit_for_bit() {
    assert_eq!(BLOCK, INT8_BLOCK);
    for (len, seed) in [(1, 1), (63, 2), (64, 3), (65, 4), (300, 5), (4097, 6)] {
        let mut x = rookery_kernels::checks::int8_values(len, seed);
        let q = Int8Block::new(len);
        let wire = WireTensor::from_f32("x", &[len], &x, WireDType::I8Block);
        assert_eq!(q.quantize_reference(&x), wire.data, "[{len}]");
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        assert_eq!(
            bits(q.dequantize_reference(&wire.data)),
            bits(wire.to_f32().unwrap())
        );
        x[len / 2] = f32::NAN;
        assert_eq!(
            q.quantize_reference(&x),
            WireTensor::from_f32("x", &[len], &x, WireDType::I8Block).data
        );
    }
}

/// A Stem on an int8 wire and its f32 twin on `device`, fed the same
/// micro-batch, forward, backward and in evaluation: the int8 stage's
/// outputs and input gradients are stand-ins whose payloads the twin's
/// values, packed on the device, give; `same` compares each payload with
/// the twin's values. Returns both stages' transfers.
fn packs_what_its_twin_computes<D: Device>(
    device: D,
    same: impl Fn(&[f32], &WireTensor, &str),
) -> [rookery_stage::Transfers; 2] {
    let case = Case::stem();
    let mut factory = OwnFactory::new(device);
    let mut s = case.build(&mut factory, INT8);
    let mut r = case.build(&mut factory, StageWire::F32);
    for (batch, seed) in [(5, 1), (3, 2), (5, 3)] {
        let x = case.input(batch, seed);
        let (s_mb, s_y) = forward(&mut s, &case.input, x.clone());
        let (r_mb, r_y) = forward(&mut r, &case.input, x.clone());
        assert!(only(&s_y).is_packed() && !only(&r_y).is_packed());
        let sent = encode(&s, &s_y);
        same(&only(&r_y).data, &sent[0], "output");
        sent[0].check().unwrap();
        // Asked for f32, a stand-in gives the values its payload decodes to.
        let as_f32 = Backend::encode(&s, &case.output, only(&s_y), WireDType::F32).unwrap();
        assert_eq!(as_f32.to_f32().unwrap(), sent[0].to_f32().unwrap());

        let dy = case.output_grad(batch, seed + 100);
        let grads = |e: &mut Exec<D>, mb| {
            block(Backend::backward(
                e,
                mb,
                &[(case.output.clone(), dy.clone())],
            ))
            .unwrap()
        };
        let (s_dx, r_dx) = (grads(&mut s, s_mb), grads(&mut r, r_mb));
        assert!(only(&s_dx).is_packed());
        let sent = encode(&s, &s_dx);
        same(&only(&r_dx).data, &sent[0], "input gradient");
        sent[0].check().unwrap();

        let inputs = [(case.input.clone(), x)];
        let s_e = block(Backend::evaluate(&mut s, &inputs)).unwrap();
        let r_e = block(Backend::evaluate(&mut r, &inputs)).unwrap();
        same(&only(&r_e).data, &encode(&s, &s_e)[0], "evaluation output");
    }
    block(Backend::step(&mut s, 0.1, 1.0)).unwrap();
    [s.transfers(), r.transfers()]
}

#[test]
fn a_cpu_stage_on_an_int8_wire_sends_the_wire_encoders_payloads() {
    packs_what_its_twin_computes(CpuDevice, |want, got, what| {
        let encoded = WireTensor::from_f32(&got.name, &got.shape_usize(), want, WireDType::I8Block);
        assert_eq!(*got, encoded, "{what}");
    });
}

/// A stage on an int8 wire and its f32 twin: the int8 stage decodes int8
/// inputs and output gradients to stand-ins and unpacks them itself; the
/// twin decodes them on the host. `compare(int8 stage's, twin's, payload
/// the values came from, what)` for the outputs (f32, on the Leaf's wire)
/// and the input gradients' payloads.
fn unpacks_what_arrives_packed<D: Device>(
    device: D,
    outputs: impl Fn(&[f32], &[f32], &WireTensor),
    input_grads: impl Fn(&WireTensor, &[f32], &WireTensor),
) {
    let case = Case::relu();
    let mut factory = OwnFactory::new(device);
    let mut s = case.build(&mut factory, INT8_LEAF);
    let mut r = case.build(&mut factory, StageWire::F32);
    for (batch, seed) in [(4, 11), (7, 12)] {
        let wire = |t: &HostTensor, name: &str| {
            WireTensor::from_f32(name, &t.shape, &t.data, WireDType::I8Block)
        };
        let x = wire(&case.input(batch, seed), &case.input);
        let held = Backend::decode(&s, &x).unwrap();
        assert!(held.is_packed());
        let (s_mb, s_y) = forward(&mut s, &case.input, held);
        let on_host = Backend::decode(&r, &x).unwrap();
        let (r_mb, r_y) = forward(&mut r, &case.input, on_host);
        assert!(
            !only(&s_y).is_packed(),
            "the Leaf's output is read back as f32"
        );
        outputs(&only(&s_y).data, &only(&r_y).data, &x);

        let dy = wire(&case.output_grad(batch, seed + 100), &case.output);
        let grads = |e: &mut Exec<D>, mb| {
            let g = Backend::decode(e, &dy).unwrap();
            block(Backend::backward(e, mb, &[(case.output.clone(), g)])).unwrap()
        };
        let (s_dx, r_dx) = (grads(&mut s, s_mb), grads(&mut r, r_mb));
        input_grads(&encode(&s, &s_dx)[0], &only(&r_dx).data, &dy);
    }
    // A stand-in the stage holds no payload for is refused, not read.
    let x = wire_stand_in(&case);
    let e = block(Backend::evaluate(&mut s, &[(case.input.clone(), x)])).unwrap_err();
    assert!(e.to_string().contains("does not hold"), "{e}");
}

fn wire_stand_in(case: &Case) -> HostTensor {
    HostTensor {
        shape: vec![2, case.in_width],
        data: Vec::new(),
    }
}

#[test]
fn a_cpu_stage_on_an_int8_wire_unpacks_as_the_wire_decoder_does() {
    unpacks_what_arrives_packed(
        CpuDevice,
        |s_y, r_y, _| assert_eq!(s_y, r_y),
        |got, r_dx, _| {
            let want =
                WireTensor::from_f32(&got.name, &got.shape_usize(), r_dx, WireDType::I8Block);
            assert_eq!(*got, want);
        },
    );
}

#[cfg(feature = "gpu")]
mod gpu {
    use rookery_kernels::accuracy::U;
    use rookery_kernels::int8::{FLUSH, level_window};
    use rookery_stage::GpuDevice;

    use super::*;

    fn device() -> GpuDevice {
        block(GpuDevice::open()).unwrap_or_else(|e| {
            panic!("no usable GPU adapter ({e}); install mesa-vulkan-drivers (lavapipe)")
        })
    }

    #[test]
    fn a_gpu_stage_packs_outputs_and_input_gradients_on_the_device_and_reads_back_their_payloads() {
        let [int8, f32] = packs_what_its_twin_computes(device(), |want, got, what| {
            let q = Int8Block::new(want.len());
            q.check_payload(want, &got.data)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let decoded = got.to_f32().unwrap();
            let bounds = q.wire_bounds(want);
            for i in 0..want.len() {
                assert!((decoded[i] - want[i]).abs() <= bounds[i], "{what} {i}");
            }
        });
        // Per micro-batch of 5: the input goes up as f32 either way; the
        // output (5 x 67) and input gradient (5 x 130) come back packed.
        let words = |n: usize| 4 * Int8Block::new(n).payload_words() as u64;
        let (out, grad) = ((5 * 67, 3 * 67), (5 * 130, 3 * 130));
        let want = 2 * (2 * words(out.0) + words(grad.0)) + 2 * words(out.1) + words(grad.1);
        assert_eq!(int8.read_back, want);
        assert_eq!(
            f32.read_back,
            4 * (2 * (2 * out.0 + grad.0) + 2 * out.1 + grad.1) as u64
        );
        assert_eq!(int8.uploaded, f32.uploaded);
        let ratio = int8.read_back as f64 / f32.read_back as f64;
        println!(
            "read back over 3 micro-batches (train and eval): int8 {} bytes, f32 {} bytes ({ratio:.4})",
            int8.read_back, f32.read_back
        );
        assert!(ratio < 0.28, "{ratio}");
    }

    #[test]
    fn a_gpu_stage_unpacks_int8_inputs_and_gradients_on_the_device_within_the_decoding_bound() {
        unpacks_what_arrives_packed(
            device(),
            |s_y, r_y, x| {
                // ReLU of the unpacked input: exact, so within the
                // unpacking's bound of the twin's.
                let bounds = Int8Block::new(r_y.len()).dequantize_bounds(&x.data);
                for i in 0..r_y.len() {
                    assert!((s_y[i] - r_y[i]).abs() <= bounds[i], "output {i}");
                }
            },
            |got, r_dx, dy| {
                // The gradient unpacked on the device is within its bound
                // of the twin's; packed again, a block's absmax moves by at
                // most the block's largest such error.
                let n = r_dx.len();
                let unpacked = Int8Block::new(n).dequantize_bounds(&dy.data);
                let decoded = got.to_f32().unwrap();
                for (b, want) in r_dx.chunks(BLOCK).enumerate() {
                    let at = b * BLOCK;
                    let e = &unpacked[at..at + want.len()];
                    let worst = e.iter().fold(0f32, |m, &v| m.max(v));
                    let scale = f64::from(want.iter().fold(0f32, |m, v| m.max(v.abs())) + worst);
                    for (i, w) in want.iter().enumerate() {
                        let bound = f64::from(e[i])
                            + scale / 254.0
                            + scale / 127.0 * level_window(127.0)
                            + 4.0 * U * scale
                            + FLUSH;
                        let err = f64::from((decoded[at + i] - w).abs());
                        assert!(
                            err <= bound,
                            "input gradient {}: {err:e} > {bound:e}",
                            at + i
                        );
                    }
                }
            },
        );
    }
}

/// The payloads held for one call are gone after it: a stand-in decoded for
/// a forward that failed is not picked up later, and stages on an f32 wire
/// decode int8 on the host as before.
#[test]
fn stand_ins_last_one_call_and_an_f32_stage_decodes_int8_on_the_host() {
    let case = Case::stem();
    let mut factory = OwnFactory::new(CpuDevice);
    let mut s = case.build(&mut factory, INT8);
    let x = WireTensor::from_f32(
        &case.input,
        &[2, case.in_width],
        &pseudo(2 * case.in_width, 3, 4),
        WireDType::I8Block,
    );
    let held = Backend::decode(&s, &x).unwrap();
    let wrong = [("not an input".to_string(), held.clone())];
    assert!(block(Backend::evaluate(&mut s, &wrong)).is_err());
    let e = block(Backend::evaluate(&mut s, &[(case.input.clone(), held)])).unwrap_err();
    assert!(e.to_string().contains("does not hold"), "{e}");

    let r = case.build(&mut factory, StageWire::F32);
    let host = Backend::decode(&r, &x).unwrap();
    assert_eq!(host.data, x.to_f32().unwrap());
}

/// What a two-stage chain's workers sent for one training micro-batch.
struct ChainStep {
    activations: WireTensor,
    loss_sum: f64,
    gradients: WireTensor,
}

/// [`Case::stem`]'s model cut after its first layer into a Root and a
/// Leaf (MSE), each a `StageWorker` on `factory`, the Root's wire `root`
/// and the Leaf's `leaf`: one micro-batch of 4 relayed as the server
/// relays it, the Leaf fed the Root's activations as they were sent.
fn chain_step<D: Device>(factory: &OwnFactory<D>, root: WireDType, leaf: WireDType) -> ChainStep {
    use rookery_proto::{Assignment, Backward, Forward, Phase, ToProvider, ToServer};
    use rookery_stage::StageWorker;

    let case = Case::stem();
    let values = case.graph.initial_values(5);
    let params: Vec<WireTensor> = case
        .graph
        .params
        .iter()
        .map(|p| WireTensor::from_f32(&p.name, &p.shape, &values[&p.name], WireDType::F32))
        .collect();
    let assign = |stage: u32, wire_dtype| {
        let (first, end, outputs) = if stage == 0 {
            (0, 2, vec![case.input.clone()])
        } else {
            (2, 4, vec![case.output.clone()])
        };
        ToProvider::Assign(Box::new(Assignment {
            job_id: 1,
            cluster: 0,
            stage,
            stages: 2,
            graph_json: case.graph.to_json().unwrap(),
            first,
            end,
            outputs,
            params: params.clone(),
            optimizer: OptimizerConfig::sgd(0.1),
            loss: rookery_model::Loss::Mse,
            batch_size: 4,
            micro_batches: 1,
            wire_dtype,
            seed: 3,
            start_step: 0,
            optimizer_state: Vec::new(),
            lr_schedule: Default::default(),
            clip_grad_norm: None,
            public_name: None,
            schedule: rookery_proto::PipelineSchedule::Gpipe,
            sync_int8: false,
            precision: Default::default(),
        }))
    };
    let mut workers = [root, leaf].map(|_| StageWorker::new(factory.clone()));
    for (k, (w, dtype)) in workers.iter_mut().zip([root, leaf]).enumerate() {
        assert_eq!(
            block(w.handle(assign(k as u32, dtype))),
            [ToServer::Ready { job_id: 1 }]
        );
    }
    let forward = |inputs, labels| {
        ToProvider::Forward(Forward {
            job_id: 1,
            phase: Phase::Train { step: 0 },
            micro: 0,
            step_samples: 4,
            step_targets: 4,
            inputs,
            labels,
        })
    };
    let x = WireTensor::from_f32("input", &[4, 70], &pseudo(280, 1, 8), WireDType::F32);
    let replies = block(workers[0].handle(forward(vec![x], None)));
    let [ToServer::Activations(a)] = &replies[..] else {
        panic!("{replies:?}")
    };
    let y = WireTensor::from_f32("labels", &[4, 67], &pseudo(268, 2, 1), WireDType::F32);
    let replies = block(workers[1].handle(forward(a.outputs.clone(), Some(y))));
    let [
        ToServer::LeafLoss(l),
        ToServer::Gradients(g),
        ToServer::StepDone(_),
    ] = &replies[..]
    else {
        panic!("{replies:?}")
    };
    let backward = ToProvider::Backward(Backward {
        job_id: 1,
        step: 0,
        micro: 0,
        grads: g.grads.clone(),
    });
    let replies = block(workers[0].handle(backward));
    assert!(
        matches!(replies[..], [ToServer::StepDone(_)]),
        "{replies:?}"
    );
    ChainStep {
        activations: a.outputs[0].clone(),
        loss_sum: l.loss_sum,
        gradients: g.grads[0].clone(),
    }
}

#[test]
fn workers_on_an_int8_wire_send_packed_tensors_and_the_leaf_computes_its_loss_unquantized() {
    let factory = OwnFactory::new(CpuDevice);
    let int8 = chain_step(&factory, WireDType::I8Block, WireDType::I8Block);
    assert_eq!(int8.activations.dtype, WireDType::I8Block);
    assert_eq!(int8.gradients.dtype, WireDType::I8Block);
    // An f32 Leaf fed the same int8 activations (decoding them on the
    // host) computes the same loss and gradients: the int8 Leaf's output
    // was not quantized for its loss, and its gradients are the wire
    // encoder's of the same values.
    let f32_leaf = chain_step(&factory, WireDType::I8Block, WireDType::F32);
    assert_eq!(f32_leaf.activations, int8.activations);
    assert_eq!(f32_leaf.loss_sum.to_bits(), int8.loss_sum.to_bits());
    let values = f32_leaf.gradients.to_f32().unwrap();
    let shape = f32_leaf.gradients.shape_usize();
    let encoded = WireTensor::from_f32(&int8.gradients.name, &shape, &values, WireDType::I8Block);
    assert_eq!(int8.gradients, encoded);
}

#[cfg(feature = "gpu")]
#[test]
fn gpu_workers_on_an_int8_wire_send_payloads_their_f32_twins_values_give() {
    let factory = OwnFactory::new(block(rookery_stage::GpuDevice::open()).unwrap());
    let int8 = chain_step(&factory, WireDType::I8Block, WireDType::I8Block);
    let f32_root = chain_step(&factory, WireDType::F32, WireDType::I8Block);
    let want = f32_root.activations.to_f32().unwrap();
    Int8Block::new(want.len())
        .check_payload(&want, &int8.activations.data)
        .unwrap();
    assert_eq!(int8.gradients.dtype, WireDType::I8Block);
    int8.gradients.check().unwrap();
    assert!(int8.loss_sum.is_finite());
}
