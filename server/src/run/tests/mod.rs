//! The run against scripted and simulated providers: frames relayed and
//! checked, syncs aggregated, stages lost and rebuilt, stragglers replaced.
// Helpers outside #[test] fns panic on purpose too: a panic is a test failure.
#![allow(clippy::unwrap_used)]

mod clip;
mod labels;
mod outer;
mod overlap;
mod recovery;
mod relay;
mod residual;
mod sim;
mod stragglers;
mod sync;
mod tokens;
mod verify;

use super::*;
use rookery_job::{
    Aggregation, DataFormat, DataRef, DataSpec, Labels, ModelSection, ModelSource, Samples,
    TrainingSpec,
};
use rookery_model::{ClusterCount, Graph, Loss, OptimizerConfig};
use rookery_plan::{Plan, PlanOptions, ProviderKind, ProviderSpec};
use rookery_proto::{
    Activations, Assignment, Gradients, LeafLoss, OptimizerState, ParamSet, StepDone, ToServer,
};

/// `clusters` chains of Root -> Leaf planned over identical native
/// providers with ids `ids`, at micro-batch 2.
fn two_stage_plan(graph: &Graph, ids: std::ops::Range<u64>, clusters: usize) -> Plan {
    plan_of(graph, ids, clusters, 2)
}

/// `clusters` clusters of `stages` stages on providers `ids`.
fn plan_of(graph: &Graph, ids: std::ops::Range<u64>, clusters: usize, stages: usize) -> Plan {
    let providers: Vec<ProviderSpec> = ids
        .map(|i| ProviderSpec {
            id: i.to_string(),
            kind: ProviderKind::Native,
            memory_bytes: 1 << 30,
            gflops: 10.0,
            bandwidth_mbps: 1000.0,
            max_buffer_bytes: None,
        })
        .collect();
    let options = PlanOptions {
        micro_batch: 2,
        clusters: ClusterCount::Fixed(clusters),
        stages_per_cluster: Some(stages),
        ..PlanOptions::default()
    };
    rookery_plan::clusterize(graph, &providers, &options).unwrap()
}

const MLP: &str = r#"
input_shape = [4]
[[layers]]
type = "Dense"
units = 8
activation = "relu"
[[layers]]
type = "Dense"
units = 3
"#;

fn spec() -> JobSpec {
    JobSpec {
        model: ModelSection {
            source: ModelSource::Spec("mlp.toml".into()),
            input_shape: vec![4],
        },
        data: DataSpec {
            format: DataFormat::Npy,
            train_inputs: DataRef::file("x.npy"),
            train_labels: Some(DataRef::file("y.npy")),
            test_inputs: None,
            test_labels: None,
            scale: None,
            mean: None,
            std: None,
            seq_len: None,
            token_dtype: None,
        },
        training: TrainingSpec {
            epochs: 1,
            batch_size: 4,
            micro_batches: 2,
            loss: Loss::cross_entropy(),
            optimizer: OptimizerConfig::sgd(0.1),
            clusters: ClusterCount::Fixed(2),
            sync_every: 1,
            stages: Some(2),
            shuffle: true,
            seed: 7,
            wire_dtype: WireDType::F32,
            aggregation: Aggregation::Mean,
            lr_schedule: rookery_model::LrSchedule::default(),
            clip_grad_norm: None,
            verify_rate: 0.0,
            val_every: None,
            average_optimizer: false,
            outer_optimizer: None,
            sync_int8: false,
            precision: Default::default(),
            schedule: rookery_proto::PipelineSchedule::Gpipe,
        },
        public_name: None,
    }
}

fn data(n: usize) -> Dataset {
    Dataset {
        sample_shape: vec![4],
        label_shape: vec![],
        samples: Samples::Arrays {
            inputs: (0..n * 4).map(|i| i as f32 / 10.0).collect(),
            labels: Labels::Classes((0..n as i64).map(|i| i % 3).collect()),
        },
    }
}

/// A run over 4 providers (ids 10..14): 2 clusters of Root -> Leaf, 16
/// samples, so 2 steps; and the `Assign` frames it starts with.
fn started() -> (JobRun, Vec<Effect>) {
    started_with(2, Aggregation::Mean)
}

/// `clusters` clusters of Root -> Leaf (providers 10, 11, ...) that sync
/// with `aggregation`.
fn started_with(clusters: usize, aggregation: Aggregation) -> (JobRun, Vec<Effect>) {
    let graph = rookery_model::from_toml(MLP).unwrap();
    let mut spec = spec();
    spec.training.clusters = ClusterCount::Fixed(clusters);
    spec.training.aggregation = aggregation;
    let ids = 10..10 + 2 * clusters as u64;
    let plan = two_stage_plan(&graph, ids.clone(), clusters);
    let ids = ids.map(|i| (i.to_string(), i)).collect();
    let analysis = graph.analyze().unwrap();
    JobRun::start(
        1,
        spec,
        graph,
        &analysis,
        &plan,
        &ids,
        data(8 * clusters),
        None,
        None,
    )
    .unwrap()
}

/// Puts `run` at the sync of step 1, every cluster at the barrier.
fn syncing(run: &mut JobRun) {
    run.state = State::Syncing { step_done: 1 };
    for cluster in &mut run.clusters {
        cluster.state = ClusterState::Idle;
    }
}

fn faults(effects: &[Effect]) -> Vec<(u64, &str, bool)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Fault {
                provider,
                reason,
                frame_dropped,
            } => Some((*provider, reason.as_str(), *frame_dropped)),
            _ => None,
        })
        .collect()
}

/// Every stage of `run` uploads its parameters for the sync of step 1,
/// cluster `c`'s all equal to `value(c)`; the effects of the last upload,
/// with the aggregation it asks for done.
fn upload_all(run: &mut JobRun, value: impl Fn(usize) -> f32) -> Vec<Effect> {
    let effects = upload_all_raw(run, value);
    settle(run, effects)
}

/// As [`upload_all`], the aggregation left to the caller.
fn upload_all_raw(run: &mut JobRun, value: impl Fn(usize) -> f32) -> Vec<Effect> {
    let mut answers = each_stage_sends(run, |c, params| {
        ToServer::Params(ParamSet {
            job_id: 1,
            step: 1,
            params: params
                .iter()
                .flat_map(|(name, shape)| filled(name, shape, value(c)))
                .collect(),
        })
    });
    answers.pop().unwrap_or_default()
}

/// Every stage of every cluster of `run` sends what `message` makes of its
/// cluster and its parameters' names and shapes; the effects of each.
fn each_stage_sends(
    run: &mut JobRun,
    message: impl Fn(usize, &[(String, Vec<usize>)]) -> ToServer,
) -> Vec<Vec<Effect>> {
    let mut answers = Vec::new();
    for c in 0..run.clusters.len() {
        for stage in 0..run.clusters[c].stages.len() {
            let params: Vec<(String, Vec<usize>)> = run.clusters[c].stages[stage]
                .params
                .iter()
                .map(|n| (n.clone(), run.params[n].shape.clone()))
                .collect();
            let provider = run.clusters[c].stages[stage].provider;
            answers.push(run.on_message(provider, message(c, &params)));
        }
    }
    answers
}

/// `effects` with each aggregation run, as the coordinator runs it off its
/// task, and the effects of its result in its place.
fn settle(run: &mut JobRun, effects: Vec<Effect>) -> Vec<Effect> {
    let mut out = Vec::new();
    for effect in effects {
        match effect {
            Effect::Aggregate(work) => {
                let done = run.on_aggregated(work.run());
                out.extend(settle(run, done));
            }
            other => out.push(other),
        }
    }
    out
}

/// The resume point among `effects`.
fn resume_point(effects: &[Effect]) -> Option<&ResumePoint> {
    effects.iter().find_map(|e| match e {
        Effect::ResumePoint(r) => Some(&**r),
        _ => None,
    })
}

/// The trained weights a completed run's `effects` hand over.
fn trained(effects: &[Effect]) -> Option<&TrainedWeights> {
    effects.iter().find_map(|e| match e {
        Effect::Completed(w) => Some(w),
        _ => None,
    })
}

fn sends(effects: &[Effect]) -> Vec<(u64, &ToProvider)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Send(p, m) => Some((*p, m)),
            _ => None,
        })
        .collect()
}

fn roles(run: &JobRun) -> [[u64; 2]; 2] {
    let p = |c: usize, s: usize| run.clusters[c].stages[s].provider;
    [[p(0, 0), p(0, 1)], [p(1, 0), p(1, 1)]]
}

/// One tensor `name` of `shape`, every value `value`.
fn filled(name: &str, shape: &[usize], value: f32) -> Vec<WireTensor> {
    let n: usize = shape.iter().product();
    vec![WireTensor::from_f32(
        name,
        shape,
        &vec![value; n],
        WireDType::F32,
    )]
}

/// A stage's input gradients: `name` of `shape`, all 0.25.
fn gradients(step: u64, micro: u32, shape: &[usize], name: &str) -> ToServer {
    ToServer::Gradients(Gradients {
        job_id: 1,
        step,
        micro,
        grads: filled(name, shape, 0.25),
        compute_ms: 1.0,
    })
}

fn activations(step: u64, micro: u32, shape: &[usize], name: &str) -> ToServer {
    ToServer::Activations(Activations {
        job_id: 1,
        phase: Phase::Train { step },
        micro,
        outputs: filled(name, shape, 0.5),
        compute_ms: 1.0,
    })
}
