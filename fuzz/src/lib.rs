//! Structured fuzzing of every parser that reads bytes from strangers: the
//! provider protocol decoder (both directions), the ONNX importer, layer
//! specs, job files (TOML and JSON) and dataset files. Valid seeds are mutated
//! ([`mutate`]) and run through each target ([`targets`]) under
//! `catch_unwind`; the one acceptable outcome for any input is a value or a
//! typed error, never a panic.
//!
//! `cargo xtask bench fuzz [--inputs N]` runs a million inputs per target in a
//! release build with overflow checks on; this crate's proptests run a few
//! thousand per target in every test run.

pub mod mutate;
pub mod targets;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};

use crate::mutate::Rng;
use crate::targets::Target;

/// An input that panicked, and the panic's message and place.
#[derive(Debug, Clone)]
pub struct Panic {
    pub seed: usize,
    pub input: Vec<u8>,
    pub message: String,
}

#[derive(Debug)]
pub struct Report {
    pub inputs: u64,
    /// Inputs the target parsed: a fuzzer that only ever reaches the first
    /// syntax check proves little, so this shows how deep it got.
    pub accepted: u64,
    /// Every panic counted; the first few kept.
    pub panics: u64,
    pub examples: Vec<Panic>,
    pub elapsed: Duration,
}

static LAST_PANIC: Mutex<Option<String>> = Mutex::new(None);

/// Keeps panic messages off stderr (a million inputs would flood it) and
/// records the last one for the report.
pub fn quiet_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        std::panic::set_hook(Box::new(|info| {
            let place = info
                .location()
                .map(|l| format!(" at {}:{}", l.file(), l.line()))
                .unwrap_or_default();
            let text = info
                .payload()
                .downcast_ref::<&str>()
                .map(|s| (*s).to_string())
                .or_else(|| info.payload().downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(no message)".into());
            *LAST_PANIC.lock().unwrap_or_else(|p| p.into_inner()) = Some(format!("{text}{place}"));
        }));
    });
}

/// A target's name as a file-name prefix: letters and digits kept, the rest `_`.
pub fn slug(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// Runs one input; `Err` carries the panic's message.
pub fn run_one(target: &Target, seed: usize, input: &[u8]) -> Result<bool, String> {
    quiet_panics();
    catch_unwind(AssertUnwindSafe(|| (target.check)(seed, input))).map_err(|_| {
        LAST_PANIC
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .unwrap_or_default()
    })
}

/// Runs `inputs` generated inputs through `target` on `threads` threads,
/// deterministically for a given `seed`.
pub fn fuzz(target: &Target, inputs: u64, seed: u64, threads: usize) -> Report {
    let threads = threads.max(1) as u64;
    let started = Instant::now();
    let parts: Vec<Report> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let share = inputs / threads + u64::from(t < inputs % threads);
                scope.spawn(move || fuzz_part(target, share, seed ^ (t << 32)))
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().ok()).collect()
    });
    let mut report = Report {
        inputs: 0,
        accepted: 0,
        panics: 0,
        examples: Vec::new(),
        elapsed: started.elapsed(),
    };
    for part in parts {
        report.inputs += part.inputs;
        report.accepted += part.accepted;
        report.panics += part.panics;
        report.examples.extend(part.examples);
    }
    report.examples.truncate(5);
    report
}

fn fuzz_part(target: &Target, inputs: u64, seed: u64) -> Report {
    let mut rng = Rng::new(seed);
    let mut report = Report {
        inputs,
        accepted: 0,
        panics: 0,
        examples: Vec::new(),
        elapsed: Duration::ZERO,
    };
    for _ in 0..inputs {
        let (seed, input) = rng.input(&target.seeds, target.text);
        match run_one(target, seed, &input) {
            Ok(accepted) => report.accepted += u64::from(accepted),
            Err(message) => {
                report.panics += 1;
                if report.examples.len() < 5 {
                    report.examples.push(Panic {
                        seed,
                        input,
                        message,
                    });
                }
            }
        }
    }
    report
}
