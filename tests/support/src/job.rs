//! Job folders on disk (a model spec, `.npy` data and a job file naming
//! them), and the batches a single-process reference run of a job trains on.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use rookery_job::{JobSpec, Labels, Schedule, Split, epoch_permutation, load_split};
use rookery_model::{ClusterCount, Graph, Loss};

use crate::data::Classes;

/// The workspace's root folder (where `examples/` and `datasets/` are).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("tests/support lives two folders below the workspace root")
        .to_path_buf()
}

/// `.npy` writing is the job crate's (what `rookery predict` writes).
pub use rookery_job::data::{NpyData, write_npy};

/// Writes `data` as `{prefix}x.npy` and `{prefix}y.npy` in `dir`.
pub fn write_classes(dir: &Path, prefix: &str, data: &Classes) -> std::io::Result<()> {
    write_npy(
        &dir.join(format!("{prefix}x.npy")),
        &data.shape(),
        NpyData::F32(&data.x),
    )?;
    write_npy(
        &dir.join(format!("{prefix}y.npy")),
        &[data.len()],
        NpyData::I64(&data.y),
    )
}

/// The text of a job file: the model spec at `spec` (a path, relative to the
/// job file or absolute), training data in `{train}x.npy`/`{train}y.npy`,
/// test data in `{test}x.npy`/`{test}y.npy` if given, and the `[training]`
/// table's body.
pub fn job_text(
    spec: &Path,
    input_shape: &[usize],
    train: &str,
    test: Option<&str>,
    training: &str,
) -> String {
    let test = test
        .map(|t| format!("test_inputs = \"{t}x.npy\"\ntest_labels = \"{t}y.npy\"\n"))
        .unwrap_or_default();
    format!(
        "[model]\nspec = \"{}\"\ninput_shape = {input_shape:?}\n\
         [data]\nformat = \"npy\"\ntrain_inputs = \"{train}x.npy\"\ntrain_labels = \"{train}y.npy\"\n\
         {test}[training]\n{training}\n",
        spec.display()
    )
}

/// The demo's job text: its CNN (examples/mnist-cnn.toml) on
/// datasets/mnist-10k with the test set and the demo's normalisation, and
/// `training` as the `[training]` table's body.
pub fn mnist_10k_job_text(training: &str) -> String {
    let root = workspace_root();
    let d = root.join("datasets/mnist-10k");
    let d = d.display();
    format!(
        "[model]\nspec = \"{}\"\ninput_shape = [1, 28, 28]\n\
         [data]\nformat = \"idx\"\n\
         train_inputs = \"{d}/train-images-idx3-ubyte.gz\"\ntrain_labels = \"{d}/train-labels-idx1-ubyte.gz\"\n\
         test_inputs = \"{d}/t10k-images-idx3-ubyte.gz\"\ntest_labels = \"{d}/t10k-labels-idx1-ubyte.gz\"\n\
         scale = 0.00392156862745098\nmean = 0.1307\nstd = 0.3081\n\
         [training]\n{training}\n",
        root.join("examples/mnist-cnn.toml").display(),
    )
}

/// The usual job folder: `model` (a spec's text) as `model.toml`, `data` as
/// `x.npy` and `y.npy`, and `job.toml` with `training` as its `[training]`
/// table; returns the job file.
pub fn write_job(
    dir: &Path,
    model: &str,
    data: &Classes,
    training: &str,
) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("model.toml"), model)?;
    write_classes(dir, "", data)?;
    let path = dir.join("job.toml");
    std::fs::write(
        &path,
        job_text(Path::new("model.toml"), &data.sample, "", None, training),
    )?;
    Ok(path)
}

/// The first `n` MNIST training digits (the demo job's data) as `x.npy` and
/// `y.npy` in `dir`, for benchmarks on real data.
pub fn write_mnist_digits(dir: &Path, n: usize) -> anyhow::Result<()> {
    let demo = JobSpec::from_file(&workspace_root().join("examples/mnist-job.toml"))?;
    let data = load_split(&demo.data, Split::Train, demo.training.loss)?.context("train split")?;
    if data.len() < n {
        bail!("MNIST has {} training digits, {n} are needed", data.len());
    }
    let idx: Vec<usize> = (0..n).collect();
    let Labels::Classes(y) = data.gather_labels(&idx) else {
        bail!("MNIST labels are classes")
    };
    write_classes(
        dir,
        "",
        &Classes {
            sample: data.sample_shape.clone(),
            x: data.gather_inputs(&idx),
            y,
        },
    )?;
    Ok(())
}

/// One step's batch of a reference run: every cluster's samples at once.
#[derive(Debug, Clone, PartialEq)]
pub struct StepBatch {
    /// The step's number in the job (epochs run on).
    pub step: u64,
    /// The inputs' shape: the batch, then one sample's.
    pub shape: Vec<usize>,
    pub x: Vec<f32>,
    pub y: Vec<i64>,
    /// The labels' shape: the batch, then one sample's labels (`[B]` for
    /// one class a sample, `[B, T]` for a language model's tokens).
    pub y_shape: Vec<usize>,
}

/// The batches of a job, step by step, as a single process trains on them:
/// the job's schedule and shuffling, with the whole step batch of every
/// cluster at once. A batch is gathered when asked for, so timing the
/// reference includes reading its data as the providers do.
pub struct JobBatches {
    pub spec: JobSpec,
    /// The model's graph.
    pub graph: Graph,
    pub loss: Loss,
    data: rookery_job::Dataset,
    schedule: Schedule,
    perm: Vec<usize>,
    epoch: u64,
    step_in_epoch: usize,
}

impl JobBatches {
    /// The job file's model and training data, checked against each other.
    /// Jobs must fix their cluster count (`clusters = N`).
    pub fn open(job_file: &Path) -> anyhow::Result<Self> {
        let spec = JobSpec::from_file(job_file)?;
        let t = &spec.training;
        let graph = spec.load_model()?.graph;
        let mut data = load_split(&spec.data, Split::Train, t.loss)?.context("train split")?;
        rookery_job::validate_against_model(&graph, &spec.model.input_shape, &mut data, t.loss)?;
        let ClusterCount::Fixed(clusters) = t.clusters else {
            bail!("a reference run needs a fixed cluster count");
        };
        let schedule = Schedule::new(data.len(), clusters, t.batch_size)?;
        let perm = epoch_permutation(data.len(), t.seed, 0, t.shuffle);
        Ok(Self {
            loss: t.loss,
            spec,
            graph,
            data,
            schedule,
            perm,
            epoch: 0,
            step_in_epoch: 0,
        })
    }
}

impl JobBatches {
    /// Optimizer steps in the whole job (epochs * steps per epoch), which
    /// a learning-rate schedule is resolved against.
    pub fn total_steps(&self) -> u64 {
        self.schedule.steps_per_epoch as u64 * self.spec.training.epochs
    }
}

impl Iterator for JobBatches {
    type Item = StepBatch;

    fn next(&mut self) -> Option<StepBatch> {
        let t = &self.spec.training;
        if self.step_in_epoch == self.schedule.steps_per_epoch {
            self.epoch += 1;
            self.step_in_epoch = 0;
            if self.epoch < t.epochs {
                self.perm = epoch_permutation(self.data.len(), t.seed, self.epoch, t.shuffle);
            }
        }
        if self.epoch >= t.epochs {
            return None;
        }
        let idx = self.schedule.step_samples(&self.perm, self.step_in_epoch);
        let step = self.epoch * self.schedule.steps_per_epoch as u64 + self.step_in_epoch as u64;
        self.step_in_epoch += 1;
        let mut shape = vec![idx.len()];
        shape.extend_from_slice(&self.data.sample_shape);
        let Labels::Classes(y) = self.data.gather_labels(idx) else {
            // Reference runs compare classifiers; regression labels have no classes.
            return None;
        };
        let mut y_shape = vec![idx.len()];
        y_shape.extend_from_slice(&self.data.label_shape);
        Some(StepBatch {
            step,
            shape,
            x: self.data.gather_inputs(idx),
            y,
            y_shape,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_folder_yields_its_steps_in_order() {
        let dir = std::env::temp_dir().join(format!("rookery-support-{}", std::process::id()));
        let data = Classes::learnable(40, &[6], 3);
        let job = write_job(
            &dir,
            &crate::dense_mlp(6, &[(4, None)]),
            &data,
            "epochs = 2\nbatch_size = 8\nclusters = 1\nstages = 1\nseed = 1\n\
             optimizer = { name = \"sgd\", lr = 0.1 }",
        )
        .unwrap();
        let steps: Vec<StepBatch> = JobBatches::open(&job).unwrap().collect();
        assert_eq!(steps.len(), 10);
        assert_eq!(
            steps.iter().map(|s| s.step).collect::<Vec<_>>(),
            (0..10).collect::<Vec<_>>()
        );
        assert!(steps.iter().all(|s| s.shape == [8, 6] && s.y.len() == 8));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
