//! ONNX's backend node test cases on Rookery's executors: what `cargo xtask
//! conformance` runs over the cases `xtask/python/onnx_node_cases.py`
//! wrote.
//!
//! `onnx_conformance CASES [--backend cpu,torch,wgpu] [--filter TEXT]`
//!
//! Every case whose ops the importer knows runs through `rookery predict`'s
//! code (import with the inputs fed, one forward pass) on each backend, and
//! its outputs are compared with the expected ones at the case's
//! tolerances (ONNX's runner: rtol 1e-3, atol 1e-7). A case is skipped only
//! where the import refuses it, naming what it does not support; a wrong
//! answer, or a failure to run what was imported, is a failure. Prints a
//! per-op table, the failures, the skip reasons with their counts, and per
//! backend `N passed, M failed, K skipped`; exits 1 if anything failed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use rookery_model::OnnxError;
use rookery_proto::tensor::WireTensor;
use rookery_server::cli::predict::{Engine, PredictBackend, PreparedModel, prepare, read_feed};
use serde::Deserialize;

#[derive(Deserialize)]
struct Case {
    name: String,
    rtol: f64,
    atol: f64,
    ops: Vec<String>,
    data_sets: Vec<DataSet>,
}

#[derive(Deserialize)]
struct DataSet {
    inputs: Vec<Named>,
    outputs: Vec<Named>,
    unreadable: Option<String>,
}

#[derive(Deserialize)]
struct Named {
    name: String,
    file: String,
}

#[derive(Debug, Clone)]
enum Outcome {
    Pass,
    Fail(String),
    Skip(String),
}

#[derive(Default, Clone, Copy)]
struct Counts {
    pass: usize,
    fail: usize,
    skip: usize,
}

impl Counts {
    fn add(&mut self, o: &Outcome) {
        match o {
            Outcome::Pass => self.pass += 1,
            Outcome::Fail(_) => self.fail += 1,
            Outcome::Skip(_) => self.skip += 1,
        }
    }
}

struct Args {
    cases: PathBuf,
    backends: Vec<PredictBackend>,
    filter: Option<String>,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut args = std::env::args().skip(1);
    let mut cases = None;
    let mut backends = vec![PredictBackend::Cpu];
    let mut filter = None;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--backend" => {
                let list = args.next().context("--backend needs a list")?;
                backends = list
                    .split(',')
                    .map(|b| match b {
                        "cpu" => Ok(PredictBackend::Cpu),
                        "torch" => Ok(PredictBackend::Torch),
                        "wgpu" => Ok(PredictBackend::Wgpu),
                        other => bail!("unknown backend `{other}` (cpu, torch, wgpu)"),
                    })
                    .collect::<anyhow::Result<_>>()?;
            }
            "--filter" => filter = Some(args.next().context("--filter needs a text")?),
            _ if cases.is_none() => cases = Some(PathBuf::from(arg)),
            other => bail!("unexpected argument `{other}`"),
        }
    }
    Ok(Args {
        cases: cases.context("usage: onnx_conformance CASES [--backend cpu,torch,wgpu]")?,
        backends,
        filter,
    })
}

fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut engines = Vec::new();
    for &b in &args.backends {
        let engine = runtime.block_on(Engine::open(b))?;
        println!("{}: {}", b.name(), engine.describe());
        engines.push((b, engine));
    }
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&args.cases)
        .with_context(|| format!("cannot read {}", args.cases.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("case.json").is_file())
        .collect();
    dirs.sort();
    let mut not_run: BTreeMap<String, usize> = BTreeMap::new();
    let mut per_op: BTreeMap<String, Vec<Counts>> = BTreeMap::new();
    let mut totals = vec![Counts::default(); engines.len()];
    let mut failures = Vec::new();
    let mut skips: BTreeMap<String, usize> = BTreeMap::new();
    let mut run = 0;
    for dir in &dirs {
        let case: Case = serde_json::from_slice(&std::fs::read(dir.join("case.json"))?)
            .with_context(|| format!("{}", dir.display()))?;
        if args
            .filter
            .as_ref()
            .is_some_and(|f| !case.name.contains(f.as_str()))
        {
            continue;
        }
        if let Some(op) = case
            .ops
            .iter()
            .find(|op| !rookery_model::onnx::imports_op(op))
        {
            *not_run.entry(op.clone()).or_default() += 1;
            continue;
        }
        run += 1;
        let outcomes = run_case(&runtime, &engines, dir, &case);
        // A skip is an import refusal, the same on every backend: counted once.
        if let Some(Outcome::Skip(why)) = outcomes.first() {
            *skips.entry(why.clone()).or_default() += 1;
        }
        for (i, outcome) in outcomes.iter().enumerate() {
            totals[i].add(outcome);
            for op in &case.ops {
                let row = per_op
                    .entry(op.clone())
                    .or_insert_with(|| vec![Counts::default(); engines.len()]);
                row[i].add(outcome);
            }
            if let Outcome::Fail(why) = outcome {
                failures.push(format!("{} [{}]: {why}", case.name, engines[i].0.name()));
            }
        }
    }
    print_report(&engines, &per_op, &failures, &skips, &not_run, run);
    for (i, (b, _)) in engines.iter().enumerate() {
        let t = totals[i];
        println!(
            "{}: {} passed, {} failed, {} skipped",
            b.name(),
            t.pass,
            t.fail,
            t.skip
        );
    }
    if !failures.is_empty() {
        std::process::exit(1);
    }
    Ok(())
}

fn print_report(
    engines: &[(PredictBackend, Engine)],
    per_op: &BTreeMap<String, Vec<Counts>>,
    failures: &[String],
    skips: &BTreeMap<String, usize>,
    not_run: &BTreeMap<String, usize>,
    run: usize,
) {
    println!();
    let mut header = format!("{:<22}", "op (pass/fail/skip)");
    for (b, _) in engines {
        header.push_str(&format!("{:>14}", b.name()));
    }
    println!("{header}");
    for (op, row) in per_op {
        let mut line = format!("{op:<22}");
        for c in row {
            line.push_str(&format!(
                "{:>14}",
                format!("{}/{}/{}", c.pass, c.fail, c.skip)
            ));
        }
        println!("{line}");
    }
    println!();
    if !failures.is_empty() {
        println!("failures:");
        for f in failures {
            println!("  {f}");
        }
        println!();
    }
    if !skips.is_empty() {
        println!("skipped (the import refuses them), by reason:");
        let mut by_count: Vec<_> = skips.iter().collect();
        by_count.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        for (why, n) in by_count {
            println!("  {n:>4}  {why}");
        }
        println!();
    }
    let outside: usize = not_run.values().sum();
    let mut ops: Vec<_> = not_run.iter().collect();
    ops.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    let shown: Vec<String> = ops
        .iter()
        .take(12)
        .map(|(op, n)| format!("{op} {n}"))
        .collect();
    println!(
        "{run} cases use only ops the importer knows and ran; {outside} use others and did not \
         (first op outside: {}{})",
        shown.join(", "),
        if ops.len() > 12 { ", ..." } else { "" }
    );
}

/// The case on every engine, one outcome each. Its inputs are read and its
/// model imported once: an import refusal is the same skip on every backend.
fn run_case(
    runtime: &tokio::runtime::Runtime,
    engines: &[(PredictBackend, Engine)],
    dir: &Path,
    case: &Case,
) -> Vec<Outcome> {
    let mut outcomes = vec![Outcome::Pass; engines.len()];
    for (d, set) in case.data_sets.iter().enumerate() {
        let model = match prepare_data_set(dir, set) {
            Ok(model) => model,
            Err(outcome) => return vec![outcome; engines.len()],
        };
        for (outcome, (_, engine)) in outcomes.iter_mut().zip(engines) {
            if !matches!(outcome, Outcome::Pass) {
                continue;
            }
            *outcome = match caught(|| run_data_set(runtime, engine, dir, case, set, &model)) {
                Outcome::Fail(why) if case.data_sets.len() > 1 => {
                    Outcome::Fail(format!("data set {d}: {why}"))
                }
                other => other,
            };
        }
    }
    outcomes
}

/// `f`'s outcome, a panic being a failure.
fn caught(f: impl FnOnce() -> Outcome) -> Outcome {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        Outcome::Fail(format!(
            "panicked: {}",
            panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or(panic.downcast_ref::<&str>().copied())
                .unwrap_or("?")
        ))
    })
}

/// A data set's inputs read and its model imported with them, or the
/// outcome of every backend where that cannot be done.
fn prepare_data_set(dir: &Path, set: &DataSet) -> Result<PreparedModel, Outcome> {
    if let Some(why) = &set.unreadable {
        return Err(Outcome::Skip(format!("the case's {why}")));
    }
    let feeds = set
        .inputs
        .iter()
        .map(|i| read_feed(&i.name, &dir.join(&i.file)))
        .collect::<anyhow::Result<Vec<_>>>()
        .map_err(|e| Outcome::Fail(format!("cannot read the inputs: {e:#}")))?;
    match std::panic::catch_unwind(|| prepare(&dir.join("model.onnx"), None, &feeds)) {
        Ok(Ok(model)) => Ok(model),
        Ok(Err(e)) => Err(refusal(&e)),
        Err(_) => Err(Outcome::Fail("the import panicked".into())),
    }
}

fn run_data_set(
    runtime: &tokio::runtime::Runtime,
    engine: &Engine,
    dir: &Path,
    case: &Case,
    set: &DataSet,
    model: &PreparedModel,
) -> Outcome {
    match runtime.block_on(engine.forward(model)) {
        Ok(outputs) => compare(case, dir, set, model, &outputs),
        Err(e) => Outcome::Fail(format!("{e:#}")),
    }
}

/// An import error: a skip where the importer refuses what it does not
/// support, naming it; any other error is a failure.
fn refusal(e: &anyhow::Error) -> Outcome {
    let Some(onnx) = e.downcast_ref::<OnnxError>() else {
        return Outcome::Fail(format!("{e:#}"));
    };
    let reason = match onnx {
        OnnxError::Unsupported { op, reason, .. } => format!("{op}: {}", unquote(reason)),
        OnnxError::DynamicShape { op, reason, .. } => {
            format!("{op}: dynamic shape: {}", unquote(reason))
        }
        OnnxError::UnsupportedOp { op, domain, .. } => format!("op {domain}{op}"),
        OnnxError::Input { reason, .. } if reason.starts_with("element type") => {
            format!("graph input: {reason}")
        }
        OnnxError::Model { reason, .. } if reason.contains("no inputs") => {
            "a graph without inputs (prediction feeds one)".into()
        }
        _ => return Outcome::Fail(format!("the import failed: {onnx}")),
    };
    Outcome::Skip(reason)
}

/// The reason without the case's own tensor names (`x`, `W`), so equal
/// reasons group.
fn unquote(reason: &str) -> String {
    let mut out = String::new();
    let mut inside = false;
    for c in reason.chars() {
        if c == '`' {
            if !inside {
                out.push('…');
            }
            inside = !inside;
        } else if !inside {
            out.push(c);
        }
    }
    out
}

fn compare(
    case: &Case,
    dir: &Path,
    set: &DataSet,
    model: &PreparedModel,
    outputs: &[WireTensor],
) -> Outcome {
    for want in &set.outputs {
        let Some(got) = outputs.iter().find(|o| o.name == want.name) else {
            let produced: Vec<&str> = model.graph.outputs.iter().map(String::as_str).collect();
            return Outcome::Skip(format!(
                "output not produced by Rookery's op (the import keeps {produced:?}): {}",
                model.warnings.join("; ")
            ));
        };
        let expected = match rookery_job::data::read_npy(&dir.join(&want.file)) {
            Ok(a) => a,
            Err(e) => return Outcome::Fail(format!("cannot read the expected output: {e}")),
        };
        if got.shape_usize() != expected.shape() {
            return Outcome::Fail(format!(
                "output `{}` has shape {:?}, expected {:?}",
                want.name,
                got.shape_usize(),
                expected.shape()
            ));
        }
        let values: Vec<f64> = match got.dtype.is_float() {
            true => got
                .to_f32()
                .map(|v| v.iter().map(|&x| f64::from(x)).collect()),
            false => got.to_i64().map(|v| v.iter().map(|&x| x as f64).collect()),
        }
        .unwrap_or_default();
        let mut worst: Option<(usize, f64, f64)> = None;
        let mut wrong = 0;
        for (i, (&g, &e)) in values.iter().zip(&expected.to_f64()).enumerate() {
            let ok = if e.is_nan() {
                g.is_nan()
            } else {
                (g - e).abs() <= case.atol + case.rtol * e.abs() || g == e
            };
            if !ok {
                wrong += 1;
                let err = (g - e).abs();
                if worst.is_none_or(|(_, wg, we)| err > (wg - we).abs() || err.is_nan()) {
                    worst = Some((i, g, e));
                }
            }
        }
        if let Some((i, g, e)) = worst {
            return Outcome::Fail(format!(
                "output `{}`: {wrong} of {} elements off; element {i} is {g}, expected {e} \
                 (rtol {}, atol {})",
                want.name,
                values.len(),
                case.rtol,
                case.atol
            ));
        }
    }
    Outcome::Pass
}
