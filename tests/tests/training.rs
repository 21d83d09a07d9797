//! Training across real processes equals training in one: `rookery train`
//! (an embedded server and local `rookery-provider`s over loopback
//! WebSockets) against the single-process libtorch reference on the same
//! batches, step by step.
#![cfg(feature = "torch")]
#![allow(clippy::unwrap_used)] // Test helpers fail loudly by design.

use std::path::Path;

use rookery_e2e::reference::{two_bw_losses, whole_batch_losses};
use rookery_e2e::rookery_train;
use rookery_test_support::{Classes, JobBatches, dense_mlp, write_job};
use rookery_torch::exec::reference::train_step_clipped;
use rookery_torch::step_seed;
use rookery_torch::{TorchOptimizer, tensors_from_values};
use tch::Tensor;

fn mlp() -> String {
    dense_mlp(12, &[(24, Some("relu")), (16, Some("tanh")), (4, None)])
}

/// A CNN without BatchNorm (whose batch statistics would differ per micro-batch).
const CNN: &str = r#"
input_shape = [1, 8, 8]
[[layers]]
type = "Conv2D"
filters = 4
kernel_size = 3
padding = 1
activation = "relu"
[[layers]]
type = "MaxPooling2D"
pool_size = 2
[[layers]]
type = "Flatten"
[[layers]]
type = "Dense"
units = 16
activation = "relu"
[[layers]]
type = "Dense"
units = 4
"#;

/// Writes a model, a seeded synthetic 4-class dataset of `samples` samples
/// and a job file into `dir`; returns the job file.
fn job(
    dir: &Path,
    model: &str,
    sample: &[usize],
    samples: usize,
    training: &str,
) -> std::path::PathBuf {
    let data = Classes::learnable(samples, sample, 0x2545_f491_4f6c_dd1d);
    write_job(dir, model, &data, training).unwrap()
}

/// The per-step losses of training the job in one process, with its whole
/// step batch (every cluster's samples) at once, its learning-rate schedule,
/// its gradient clipping and its precision.
fn reference_losses(job_file: &Path) -> Vec<f64> {
    whole_batch_losses(job_file)
        .unwrap()
        .map(|step| step.unwrap().1)
        .collect()
}

/// One parameter's optimizer state, owned: name, steps, slots.
type OwnedState = (String, u64, Vec<(String, Tensor)>);

/// The per-step losses of a job's clusters trained in one process: each
/// cluster its own share of the step's batch, from the same parameters,
/// with its own optimizer; then the sync the job takes every step, which
/// averages the parameters (in f64, rounded once, as the server does) and,
/// with `average_optimizer`, every optimizer state slot. A step's loss is
/// the clusters' mean, as the server records it.
fn reference_cluster_losses(job_file: &Path, average_optimizer: bool) -> Vec<f64> {
    let batches = JobBatches::open(job_file).unwrap();
    let t = batches.spec.training.clone();
    assert_eq!(t.sync_every, 1, "the reference syncs every step");
    let rookery_model::ClusterCount::Fixed(clusters) = t.clusters else {
        panic!("a fixed cluster count")
    };
    let graph = batches.graph.clone();
    let mut params = tensors_from_values(&graph, &graph.initial_values(t.seed)).unwrap();
    let mut optimizers: Vec<TorchOptimizer> = (0..clusters)
        .map(|_| TorchOptimizer::new(t.optimizer).unwrap())
        .collect();
    let mean = |copies: &[&Tensor]| {
        let sum = copies
            .iter()
            .map(|c| c.to_kind(tch::Kind::Double))
            .reduce(|a, b| a + b)
            .unwrap();
        (sum / copies.len() as f64).to_kind(tch::Kind::Float)
    };
    batches
        .map(|batch| {
            let per = t.batch_size;
            let width = batch.x.len() / batch.y.len();
            let mut copies = Vec::new();
            let mut loss = 0.0;
            for (c, optimizer) in optimizers.iter_mut().enumerate() {
                let mut own: std::collections::BTreeMap<String, Tensor> =
                    params.iter().map(|(k, v)| (k.clone(), v.copy())).collect();
                let mut shape: Vec<i64> = batch.shape.iter().map(|&d| d as i64).collect();
                shape[0] = per as i64;
                let x = Tensor::from_slice(&batch.x[c * per * width..(c + 1) * per * width])
                    .reshape(shape.as_slice());
                let y = Tensor::from_slice(&batch.y[c * per..(c + 1) * per]);
                let inputs = [(graph.inputs[0].name.clone(), x)];
                loss += train_step_clipped(
                    &graph,
                    &mut own,
                    &inputs,
                    &y,
                    t.loss,
                    optimizer,
                    step_seed(t.seed, batch.step),
                    None,
                )
                .unwrap();
                copies.push(own);
            }
            for (name, value) in params.iter_mut() {
                let each: Vec<&Tensor> = copies.iter().map(|c| &c[name]).collect();
                *value = mean(&each);
            }
            if average_optimizer {
                let exported: Vec<_> = optimizers.iter().map(|o| o.export()).collect();
                let combined: Vec<OwnedState> = exported[0]
                    .iter()
                    .map(|(name, steps, slots)| {
                        let slots = slots
                            .iter()
                            .enumerate()
                            .map(|(i, (slot, _))| {
                                let each: Vec<&Tensor> = exported
                                    .iter()
                                    .map(|e| e.iter().find(|p| &p.0 == name).unwrap().2[i].1)
                                    .collect();
                                (slot.to_string(), mean(&each))
                            })
                            .collect();
                        (name.clone(), *steps, slots)
                    })
                    .collect();
                drop(exported);
                for optimizer in &mut optimizers {
                    for (name, steps, slots) in &combined {
                        let slots = slots.iter().map(|(s, v)| (s.clone(), v.copy())).collect();
                        optimizer.import(name, *steps, slots).unwrap();
                    }
                }
            }
            loss / clusters as f64
        })
        .collect()
}

/// `got` is the single-process reference's losses of `job_file` within
/// `tolerance` (relative) on every step; `what` names the setup in failures.
fn assert_matches_reference(job_file: &Path, got: &[f64], tolerance: f64, what: &str) {
    assert_near(got, &reference_losses(job_file), tolerance, what);
}

/// `got` is `want` within `tolerance` (relative) on every step.
fn assert_near(got: &[f64], want: &[f64], tolerance: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: step counts differ");
    for (step, (g, w)) in got.iter().zip(want).enumerate() {
        let rel = (g - w).abs() / w.abs().max(1e-12);
        assert!(
            rel < tolerance,
            "{what}: step {step}: {g}, reference {w} (relative {rel:e})"
        );
    }
}

fn assert_same_losses(
    job_file: &Path,
    providers: usize,
    steps: usize,
    tolerance: f64,
    must_learn: bool,
) {
    let out = job_file.parent().unwrap().join("out");
    let metrics = rookery_train(job_file, providers, &out).unwrap();
    let got: Vec<f64> = metrics.steps.iter().map(|s| s.loss).collect();
    assert_eq!(got.len(), steps);
    assert_matches_reference(job_file, &got, tolerance, "pipeline");
    if must_learn {
        let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len() as f64;
        assert!(mean(&got[steps - 5..]) < mean(&got[..5]), "{got:?}");
    }
    assert!(out.join("weights.safetensors").is_file());
}

/// `rookery train`'s providers share this machine's cores, so each runs as
/// a batch process (`--batch-scheduling`): read from the kernel's own view
/// of the running children, within a minute of the start.
#[cfg(target_os = "linux")]
#[test]
fn rookery_trains_local_providers_run_as_batch_processes() {
    use rookery_e2e::{ProcessGroup, binary};
    const SCHED_BATCH: &str = "3";
    let dir = tempfile::tempdir().unwrap();
    let job_file = job(
        dir.path(),
        &mlp(),
        &[12],
        64,
        "epochs = 50\nbatch_size = 8\nstages = 2\n",
    );
    // Killed as a group: a provider outlives a `rookery train` killed alone.
    let train = ProcessGroup::spawn(
        std::process::Command::new(binary("rookery").unwrap())
            .arg("train")
            .arg(&job_file)
            .args(["--local-providers", "2", "--out"])
            .arg(dir.path().join("out"))
            .env("ROOKERY_PROVIDER_BIN", binary("rookery-provider").unwrap())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null()),
    )
    .unwrap();
    let parent = train.id().to_string();
    // Fields after the command name's closing parenthesis: state, ppid, ...
    // and the policy is field 41 of stat(5), the 39th of these.
    let children = || -> Vec<(String, String)> {
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
            .filter_map(|stat| {
                let (head, rest) = stat.rsplit_once(')')?;
                let fields: Vec<&str> = rest.split_whitespace().collect();
                (fields.get(1) == Some(&parent.as_str())).then(|| {
                    let name = head.split_once('(').map_or("", |(_, n)| n).to_string();
                    (name, fields.get(38).unwrap_or(&"").to_string())
                })
            })
            .collect()
    };
    // Both must have started within a minute, and a provider sets its
    // policy first thing: a few seconds after both are seen is plenty.
    let started = std::time::Instant::now();
    let mut both_seen: Option<std::time::Instant> = None;
    let mut seen = Vec::new();
    while started.elapsed() < std::time::Duration::from_secs(60)
        && both_seen.is_none_or(|t| t.elapsed() < std::time::Duration::from_secs(5))
    {
        let now = children();
        if now.len() == 2 {
            both_seen.get_or_insert_with(std::time::Instant::now);
            let done = now.iter().all(|(_, policy)| policy == SCHED_BATCH);
            seen = now;
            if done {
                break;
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    drop(train);
    assert_eq!(seen.len(), 2, "rookery train's children: {seen:?}");
    for (name, policy) in &seen {
        assert!(
            name.starts_with("rookery-provide"),
            "{name} is not a provider"
        );
        assert_eq!(
            policy, SCHED_BATCH,
            "{name} runs with policy {policy}, not SCHED_BATCH"
        );
    }
}

#[test]
fn one_cluster_of_three_stages_matches_the_reference_mlp_sgd_and_adam() {
    for optimizer in [
        "{ name = \"sgd\", lr = 0.1, momentum = 0.9 }",
        "{ name = \"adam\", lr = 0.01 }",
    ] {
        let dir = tempfile::tempdir().unwrap();
        let training = format!(
            "epochs = 1\nbatch_size = 16\nmicro_batches = 4\noptimizer = {optimizer}\n\
             clusters = 1\nstages = 3\nseed = 5"
        );
        let job = job(dir.path(), &mlp(), &[12], 30 * 16, &training);
        assert_same_losses(&job, 3, 30, 1e-5, true);
    }
}

#[test]
fn one_cluster_of_three_stages_matches_the_reference_cnn_sgd_and_adam() {
    for optimizer in [
        "{ name = \"sgd\", lr = 0.05 }",
        "{ name = \"adam\", lr = 0.01 }",
    ] {
        let dir = tempfile::tempdir().unwrap();
        let training = format!(
            "epochs = 1\nbatch_size = 8\nmicro_batches = 4\noptimizer = {optimizer}\n\
             clusters = 1\nstages = 3\nseed = 9"
        );
        let job = job(dir.path(), CNN, &[1, 8, 8], 30 * 8, &training);
        // 30 small steps move a CNN on noise too little to promise progress.
        assert_same_losses(&job, 3, 30, 1e-5, false);
    }
}

/// A cosine schedule with warm-up plus clipping by the global norm across
/// three stages (each stage's squared norm summed by the server) trains as
/// one process clipping its whole model's gradients does. `max_norm` is
/// small enough that most steps clip.
#[test]
fn three_stages_with_a_cosine_schedule_and_clipping_match_the_reference() {
    for optimizer in [
        "{ name = \"adamw\", lr = 0.01 }",
        "{ name = \"sgd\", lr = 0.2, momentum = 0.9 }",
    ] {
        let dir = tempfile::tempdir().unwrap();
        let training = format!(
            "epochs = 1\nbatch_size = 16\nmicro_batches = 4\noptimizer = {optimizer}\n\
             clusters = 1\nstages = 3\nseed = 5\nclip_grad_norm = 0.5\n\
             [training.lr_schedule]\nkind = \"cosine\"\nwarmup_steps = 5\nmin_lr = 1e-4\n"
        );
        let job = job(dir.path(), &mlp(), &[12], 30 * 16, &training);
        assert_same_losses(&job, 3, 30, 1e-5, true);
    }
}

#[test]
fn two_clusters_with_sgd_match_the_reference_with_the_doubled_batch() {
    let dir = tempfile::tempdir().unwrap();
    let training = "epochs = 1\nbatch_size = 8\nmicro_batches = 2\n\
        optimizer = { name = \"sgd\", lr = 0.1 }\nclusters = 2\nstages = 2\nsync_every = 1\nseed = 11";
    let job = job(dir.path(), &mlp(), &[12], 20 * 16, training);
    assert_same_losses(&job, 4, 20, 1e-5, true);
}

/// Ravnest's `average_optim`: two clusters of Adam that average their
/// moments at each sync train as the one-process reference that does, which
/// differs from one that keeps each cluster's own; and Ravnest's
/// `model_fusion(cluster_id)`: each cluster's own weights come back beside
/// the combined ones, which are their mean.
#[test]
fn two_adam_clusters_averaging_their_state_match_the_reference_and_each_clusters_weights_come_back()
{
    let dir = tempfile::tempdir().unwrap();
    let training = "epochs = 1\nbatch_size = 8\nmicro_batches = 2\n\
        optimizer = { name = \"adam\", lr = 0.01 }\nclusters = 2\nstages = 2\nsync_every = 1\n\
        seed = 11\naverage_optimizer = true";
    let job = job(dir.path(), &mlp(), &[12], 20 * 16, training);
    let averaged = reference_cluster_losses(&job, true);
    let separate = reference_cluster_losses(&job, false);
    let apart = averaged
        .iter()
        .zip(&separate)
        .map(|(a, s)| ((a - s) / s).abs())
        .fold(0.0, f64::max);
    assert!(
        apart > 1e-4,
        "averaging the state changes nothing here ({apart:e})"
    );

    let out = dir.path().join("out");
    let metrics = rookery_train(&job, 4, &out).unwrap();
    let got: Vec<f64> = metrics.steps.iter().map(|s| s.loss).collect();
    assert_eq!(got.len(), averaged.len());
    for (step, (g, w)) in got.iter().zip(&averaged).enumerate() {
        let rel = (g - w).abs() / w.abs();
        assert!(
            rel < 1e-5,
            "step {step}: {g}, reference {w} (relative {rel:e})"
        );
    }

    let read = |name: &str| rookery_job::weights::read_wire_safetensors(&out.join(name)).unwrap();
    let combined = read("weights.safetensors");
    let own = [
        read("weights-cluster-0.safetensors"),
        read("weights-cluster-1.safetensors"),
    ];
    assert!(!out.join("weights-cluster-2.safetensors").exists());
    for (i, t) in combined.iter().enumerate() {
        let (a, b) = (own[0][i].to_f32().unwrap(), own[1][i].to_f32().unwrap());
        assert_eq!((&own[0][i].name, &own[1][i].name), (&t.name, &t.name));
        assert_ne!(
            a, b,
            "{}: the clusters trained on different samples",
            t.name
        );
        let mean: Vec<f32> = a
            .iter()
            .zip(&b)
            .map(|(x, y)| ((f64::from(*x) + f64::from(*y)) / 2.0) as f32)
            .collect();
        assert_eq!(t.to_f32().unwrap(), mean, "{}", t.name);
    }
}

/// A browser tab on the Donate page trains one of three stages (our own
/// kernels on WebGPU, SwiftShader in headless Chromium) beside two libtorch
/// providers under the `async` schedule, to the single-process 2BW
/// reference's losses step for step: the tab stashes its weight versions
/// as libtorch does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_browser_tab_trains_a_stage_beside_libtorch_ones_like_one_process() -> anyhow::Result<()>
{
    browser_stage_matches_the_reference(true).await
}

/// A browser without WebGPU says so and donates its CPU instead: the
/// kernels' references compiled to wasm train the stage just as well.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_browser_without_webgpu_trains_a_stage_on_its_cpu_like_one_process() -> anyhow::Result<()>
{
    browser_stage_matches_the_reference(false).await
}

async fn browser_stage_matches_the_reference(webgpu: bool) -> anyhow::Result<()> {
    use std::time::{Duration, Instant};

    use fantoccini::Locator;
    use rookery_e2e::{Browser, Server, start_native_provider};
    use rookery_proto::ProviderKind;
    use rookery_server::cli::client::Client;

    let dir = tempfile::tempdir()?;
    let training = "epochs = 1\nbatch_size = 16\nmicro_batches = 4\n\
        optimizer = { name = \"adam\", lr = 0.01 }\nclusters = 1\nstages = 3\nseed = 5";
    // The WebGPU tab runs `async` (steps overlap between syncs), the CPU one
    // the default `gpipe`.
    let training = match webgpu {
        true => format!("{training}\nsync_every = 5\nschedule = \"async\""),
        false => training.to_string(),
    };
    let job_file = job(dir.path(), &mlp(), &[12], 20 * 16, &training);
    // Evaluated after the epoch too (on the training samples: the test is
    // that the tab's stage scores as libtorch's would).
    let text = std::fs::read_to_string(&job_file)?.replace(
        "train_labels = \"y.npy\"\n",
        "train_labels = \"y.npy\"\ntest_inputs = \"x.npy\"\ntest_labels = \"y.npy\"\n",
    );
    // The WebGPU tab's job is public, the CPU tab's private: the Donate
    // page names the one and says only "a private job" of the other.
    let public_name = webgpu.then_some("Handwritten digits for the Lab");
    let text = match public_name {
        Some(name) => format!("public_name = \"{name}\"\n{text}"),
        None => text,
    };
    std::fs::write(&job_file, text)?;
    let server = Server::start(10_000)?;
    let _root = start_native_provider(&server, "native-a")?;
    let _leaf = start_native_provider(&server, "native-b")?;
    let browser = if webgpu {
        Browser::start().await?
    } else {
        Browser::start_without_webgpu().await?
    };
    browser.start_donating(&server).await?;
    let providers = server
        .wait_for_providers(
            "two native and one browser provider, links measured",
            Duration::from_secs(60),
            |all| all.len() == 3 && all.iter().all(|p| p.bandwidth_mbps.is_some()),
        )
        .await?;
    let tab = providers
        .iter()
        .find(|p| p.kind == ProviderKind::Browser)
        .expect("the tab joined");
    // Without WebGPU the tab says it donates its CPU, here and on its page.
    assert_eq!(tab.device.contains("CPU"), !webgpu, "{tab:?}");
    let client = Client::new(&server.http_url(""), &server.api_token()?);
    let id = client.submit(&job_file).await?.id;
    let started = Instant::now();
    let mut seen_training = false;
    // The page is looked at before the job's status each time round, and
    // often until it shows the stage training: a job this small can be
    // over in about a second.
    let job = loop {
        if !seen_training
            && let Ok(status) = browser.client.find(Locator::Css("#donate-status")).await
            && status.attr("data-state").await?.as_deref() == Some("training")
            && let Ok(shown) = browser.client.find(Locator::Css("#donate-job")).await
        {
            seen_training = true;
            let text = shown.text().await?;
            let public = shown.attr("data-public").await?;
            match public_name {
                Some(name) => assert!(
                    text.contains(name) && public.as_deref() == Some("true"),
                    "{text:?} {public:?}"
                ),
                None => assert!(
                    text.contains("a private job") && public.as_deref() == Some("false"),
                    "{text:?} {public:?}"
                ),
            }
            let name = if webgpu {
                "donate-training"
            } else {
                "donate-training-cpu"
            };
            browser.screenshot(name).await?;
        }
        let job = client.job(id).await?;
        if matches!(job.status.as_str(), "completed" | "failed" | "cancelled") {
            break job;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(300),
            "the job did not finish in 5 minutes: {job:?}"
        );
        let pause = if seen_training { 200 } else { 10 };
        tokio::time::sleep(Duration::from_millis(pause)).await;
    };
    assert_eq!(job.status, "completed", "{job:?}");
    let plan = job.plan.as_ref().expect("a running job has a plan");
    let browser_stages: Vec<_> = plan.clusters[0]
        .stages
        .iter()
        .filter(|s| s.provider_kind == ProviderKind::Browser)
        .collect();
    assert_eq!(browser_stages.len(), 1, "{plan:?}");
    assert!(
        seen_training,
        "the Donate page never showed the stage training"
    );
    // The page shows what the tab gave: time, the work credited (sent at
    // checkpoints and at the end) and its own throughput.
    let started = Instant::now();
    loop {
        let credit = browser
            .client
            .find(Locator::Css("#donate-credit"))
            .await?
            .text()
            .await?;
        let points = browser
            .client
            .find(Locator::Css("svg#donate-throughput"))
            .await?
            .attr("data-points")
            .await?;
        let time = browser
            .client
            .find(Locator::Css("#donate-time"))
            .await?
            .text()
            .await?;
        let credited = credit.contains("FLOP") && !credit.starts_with("0.00 ");
        if credited && points.as_deref().is_some_and(|p| p != "0") {
            println!("the tab donated {time} and was credited {credit}");
            break;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(30),
            "the Donate page shows credit {credit:?}, {points:?} throughput points, time {time:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let metrics = client.metrics(id).await?;
    let got: Vec<f64> = metrics.steps.iter().map(|s| s.loss).collect();
    let what = format!("with a browser {} stage", browser_stages[0].role);
    if webgpu {
        assert_near(&got, &two_bw_losses(&job_file), 1e-4, &what);
    } else {
        assert_matches_reference(&job_file, &got, 1e-4, &what);
    }
    // The same accuracy band as the job on three libtorch providers.
    let native = rookery_train(&job_file, 3, &dir.path().join("native"))?;
    let accuracy = |m: &rookery_proto::api::JobMetrics| m.epochs.last().map(|e| e.test_accuracy);
    let (with_tab, all_native) = (accuracy(&metrics), accuracy(&native));
    assert!(
        matches!((with_tab, all_native), (Some(t), Some(n)) if (t - n).abs() <= 0.01),
        "test accuracy with the tab {with_tab:?}, all native {all_native:?}"
    );
    Ok(())
}

/// `rookery-provider --backend wgpu` (our own kernels on the GPU wgpu finds:
/// lavapipe here) trains a stage beside two libtorch providers, to the
/// single-process reference's losses step for step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wgpu_provider_trains_a_stage_beside_libtorch_ones_like_one_process() -> anyhow::Result<()>
{
    let (got, want) = wgpu_stage_losses("").await?;
    assert_near(&got, &want, 1e-4, "with a wgpu stage");
    Ok(())
}

/// The same with int8 activations and gradients, which the wgpu stage packs
/// and unpacks on its GPU: every step's loss stays near the f32
/// reference's, and differs from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wgpu_provider_on_an_int8_wire_trains_a_stage_near_the_f32_reference()
-> anyhow::Result<()> {
    let (got, want) = wgpu_stage_losses("wire_dtype = \"int8\"").await?;
    let worst = got
        .iter()
        .zip(&want)
        .map(|(g, w)| (g - w).abs() / w)
        .fold(0.0, f64::max);
    // Each value moves by at most its block's absmax / 254 (0.4%); a
    // loss, averaging many, moves far less (2.2e-4 at most, measured
    // here). Garbage values would move it by whole percents.
    assert_near(&got, &want, 5e-3, "int8 with a wgpu stage");
    // And int8 did travel: f32 matches the reference within 1e-6 here.
    assert!(worst > 1e-6, "int8 losses equal f32's within {worst:e}");
    Ok(())
}

/// Mixed precision: the wgpu stage rounds its matrix products' operands to
/// f16 in our kernels, the libtorch stages in theirs, and the job follows
/// the single-process mixed reference step for step, much closer than that
/// is to f32's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_precision_job_with_a_wgpu_stage_matches_the_mixed_reference() -> anyhow::Result<()>
{
    let (got, want) = wgpu_stage_losses("precision = \"mixed\"").await?;
    let (_dir, f32_losses) = wgpu_stage_losses_reference("")?;
    let worst = |a: &[f64], b: &[f64]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs() / y)
            .fold(0.0, f64::max)
    };
    // Only f32 sums differ between backends, and one flips an f16 rounding
    // only now and then: the run is far closer to the mixed reference than
    // mixed precision is to f32.
    let (close, apart) = (worst(&got, &want), worst(&want, &f32_losses));
    assert!(
        apart > 0.0 && close < apart / 5.0,
        "mixed losses are {close:e} from the mixed reference, which is {apart:e} from f32's"
    );
    Ok(())
}

/// The job file of [`wgpu_stage_losses`] with `extra` training lines, and
/// its single-process reference losses.
fn wgpu_stage_losses_reference(extra: &str) -> anyhow::Result<(tempfile::TempDir, Vec<f64>)> {
    let dir = tempfile::tempdir()?;
    let losses = reference_losses(&wgpu_stage_job(dir.path(), extra));
    Ok((dir, losses))
}

/// [`wgpu_stage_losses`]'s job in `dir`, with `extra` training lines.
fn wgpu_stage_job(dir: &Path, extra: &str) -> std::path::PathBuf {
    let training = format!(
        "epochs = 1\nbatch_size = 16\nmicro_batches = 4\n\
         optimizer = {{ name = \"sgd\", lr = 0.1, momentum = 0.9 }}\nclusters = 1\nstages = 3\nseed = 7\n{extra}"
    );
    job(dir, &mlp(), &[12], 20 * 16, &training)
}

/// The per-step losses of a job one of whose three stages runs on a
/// `--backend wgpu` provider, with `extra` training lines (a wire dtype, a
/// precision), and the single-process reference's.
async fn wgpu_stage_losses(extra: &str) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    use std::time::Duration;

    use rookery_e2e::{Process, Server, provider_command, start_native_provider};
    use rookery_server::cli::client::Client;

    let dir = tempfile::tempdir()?;
    let job_file = wgpu_stage_job(dir.path(), extra);
    let server = Server::start(10_000)?;
    let _a = start_native_provider(&server, "torch-a")?;
    let _b = start_native_provider(&server, "torch-b")?;
    let _gpu = Process::from(provider_command(&server, "wgpu", &["--backend", "wgpu"])?.spawn()?);
    server
        .wait_for_providers(
            "three providers, links measured",
            Duration::from_secs(60),
            |all| all.len() == 3 && all.iter().all(|p| p.bandwidth_mbps.is_some()),
        )
        .await?;
    let client = Client::new(&server.http_url(""), &server.api_token()?);
    let id = client.submit(&job_file).await?.id;
    let job = tokio::time::timeout(Duration::from_secs(300), client.watch(id)).await??;
    assert_eq!(job.status, "completed", "{job:?}");
    let plan = job.plan.as_ref().expect("a finished job keeps its plan");
    assert!(
        plan.clusters[0]
            .stages
            .iter()
            .any(|s| s.provider_name == "wgpu"),
        "{plan:?}"
    );
    let got: Vec<f64> = client
        .metrics(id)
        .await?
        .steps
        .iter()
        .map(|s| s.loss)
        .collect();
    Ok((got, reference_losses(&job_file)))
}

/// A browser tab closed while it runs a stage is a provider that leaves: its
/// stage goes to a standby, the cluster replays from the last checkpoint, and
/// the job ends with the single-process losses still (recovery is exact).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_browser_tab_closed_mid_job_hands_its_stage_to_a_standby_and_training_stays_exact()
-> anyhow::Result<()> {
    use std::time::{Duration, Instant};

    use rookery_e2e::{Browser, start_native_provider};
    use rookery_proto::ProviderKind;
    use rookery_proto::api::LogEntry;
    use rookery_server::cli::client::Client;

    let dir = tempfile::tempdir()?;
    let training = "epochs = 1\nbatch_size = 16\nmicro_batches = 4\n\
        optimizer = { name = \"adam\", lr = 0.01 }\nclusters = 1\nstages = 3\nsync_every = 4\nseed = 13";
    let job_file = job(dir.path(), &mlp(), &[12], 40 * 16, training);
    let browser = Browser::start().await?;
    let (server, _natives) = browser.beside_two_natives().await?;
    let client = Client::new(&server.http_url(""), &server.api_token()?);
    let id = client.submit(&job_file).await?.id;
    // The standby joins once the tab has its stage, so the plan cannot skip the tab.
    browser
        .wait_for_attr(
            "#donate-status",
            "data-state",
            "training",
            Duration::from_secs(120),
        )
        .await?;
    let _standby = start_native_provider(&server, "standby")?;
    server
        .wait_for_providers("the standby", Duration::from_secs(60), |all| {
            all.iter()
                .any(|p| p.name == "standby" && p.bandwidth_mbps.is_some())
        })
        .await?;
    let started = Instant::now();
    while client.job(id).await?.step < 6 {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(120),
            "the job stalled"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Close the donating tab, keeping the browser up with a second one.
    let other = browser.client.new_window(true).await?;
    browser.client.close_window().await?;
    browser.client.switch_to_window(other.handle).await?;
    let job = tokio::time::timeout(Duration::from_secs(300), client.watch(id)).await??;
    assert_eq!(job.status, "completed", "{job:?}");
    let log: Vec<LogEntry> = reqwest::Client::new()
        .get(server.http_url(&format!("/api/jobs/{id}/log")))
        .bearer_auth(server.api_token()?)
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    let has = |kind: &str| log.iter().any(|e| e.kind == kind);
    assert!(has("stage_lost") && has("stage_reassigned"), "{log:#?}");
    let providers = server.providers().await?;
    assert!(
        providers
            .iter()
            .any(|p| p.kind == ProviderKind::Browser && p.gone_since_ms.is_some()),
        "{providers:#?}"
    );
    let got: Vec<f64> = client
        .metrics(id)
        .await?
        .steps
        .iter()
        .map(|s| s.loss)
        .collect();
    assert_matches_reference(&job_file, &got, 1e-4, "after the tab closed");
    Ok(())
}
