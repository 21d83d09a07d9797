//! A token job through the run with real stages: a layer-spec bigram model
//! (Embedding -> Flatten -> Dense) whose input is i64 token ids, fed
//! windows of a token file, trained by two workers on our own kernels (CPU)
//! as Root -> Leaf. The Root gets the windows as i64, the Leaf the next
//! tokens as labels, and the loss falls.

use std::path::Path;

use super::*;
use rookery_job::{JobSpec, prepare};
use rookery_stage::{CpuDevice, OwnFactory, StageWorker};

const VOCAB: u16 = 16;

const BIGRAM: &str = r#"
input_shape = [1]
[[layers]]
type = "Embedding"
num_embeddings = 16
embedding_dim = 8
[[layers]]
type = "Flatten"
[[layers]]
type = "Dense"
units = 16
"#;

/// Each token's successor in the synthetic language.
fn next(t: u16) -> u16 {
    (5 * t + 3) % VOCAB
}

/// A job over a token file of `tokens` ids following [`next`], in windows of one.
fn token_job(dir: &Path, tokens: usize) -> JobSpec {
    let mut ids = vec![0u16];
    while ids.len() < tokens {
        ids.push(next(*ids.last().unwrap()));
    }
    let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
    std::fs::write(dir.join("train.u16"), bytes).unwrap();
    std::fs::write(dir.join("bigram.toml"), BIGRAM).unwrap();
    let text = r#"
[model]
spec = "bigram.toml"
input_shape = [1]
[data]
format = "tokens"
train_inputs = "train.u16"
seq_len = 1
[training]
batch_size = 8
micro_batches = 4
optimizer = { name = "adam", lr = 0.05 }
seed = 3
"#;
    JobSpec::from_toml(text, dir).unwrap()
}

#[test]
fn a_token_job_with_an_integer_input_model_trains_on_real_stages() {
    let dir = tempfile::tempdir().unwrap();
    let prepared = prepare(token_job(dir.path(), 321)).unwrap();
    assert_eq!(prepared.graph.inputs[0].dtype, DType::I64);
    let plan = two_stage_plan(&prepared.graph, 10..12, 1);
    let ids = (10..12).map(|i| (i.to_string(), i)).collect();
    let (mut run, effects) = JobRun::start(
        1,
        prepared.spec,
        prepared.graph.clone(),
        &prepared.analysis,
        &plan,
        &ids,
        prepared.train,
        None,
        None,
    )
    .unwrap();
    assert_eq!(run.total_steps(), 40);
    let mut workers: BTreeMap<u64, StageWorker<OwnFactory<CpuDevice>>> = (10..12)
        .map(|p| (p, StageWorker::new(OwnFactory::new(CpuDevice))))
        .collect();
    let mut queue: std::collections::VecDeque<Effect> = effects.into();
    let (mut losses, mut fed, mut completed) = (Vec::new(), 0, false);
    let mut windows = HashMap::new();
    while let Some(effect) = queue.pop_front() {
        match effect {
            Effect::Send(p, message) => {
                if let ToProvider::Forward(f) = &message {
                    fed += check_forward(f, &mut windows);
                }
                let replies = pollster::block_on(workers.get_mut(&p).unwrap().handle(message));
                for reply in replies {
                    queue.extend(run.on_message(p, reply));
                }
            }
            Effect::Step(record) => losses.push(record.loss),
            Effect::Completed(_) => completed = true,
            Effect::Failed(reason) => panic!("the job failed: {reason}"),
            Effect::Fault { reason, .. } => panic!("a stage was faulted: {reason}"),
            _ => {}
        }
    }
    assert!(completed, "the run never completed");
    assert_eq!(losses.len(), 40);
    assert!(fed > 0, "no window reached the Root");
    let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len() as f64;
    // Uniform guessing over 16 tokens costs ln 16 = 2.77; the successor is
    // certain, so a trained bigram model gets far below it.
    assert!(mean(&losses[..5]) > 2.0, "{losses:?}");
    assert!(mean(&losses[35..]) < 0.5, "{losses:?}");
}

/// The Root's windows are i64 token ids `[n, 1]`; the Leaf's labels are
/// each of those windows' next token, `[n]` (the model's output is
/// `[n, 16]`). Returns the windows the Root got.
fn check_forward(
    f: &rookery_proto::Forward,
    windows: &mut HashMap<(Phase, u32), Vec<i64>>,
) -> usize {
    if let Some(labels) = &f.labels {
        assert_eq!(labels.dtype, WireDType::I64);
        assert_eq!(labels.shape.len(), 1, "{:?}", labels.shape);
        let inputs = windows
            .remove(&(f.phase, f.micro))
            .expect("the Root was fed first");
        let want: Vec<i64> = inputs.iter().map(|&t| i64::from(next(t as u16))).collect();
        assert_eq!(labels.to_i64().unwrap(), want);
    }
    match f.inputs.first() {
        Some(x) if x.name == "input" => {
            assert_eq!(x.dtype, WireDType::I64);
            assert_eq!(x.shape[1..], [1]);
            windows.insert((f.phase, f.micro), x.to_i64().unwrap());
            x.shape[0] as usize
        }
        _ => 0,
    }
}
