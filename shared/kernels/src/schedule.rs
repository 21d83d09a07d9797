//! Learning-rate schedules and gradient clipping: data plus pure functions,
//! so every backend (our kernels, libtorch, the single-process reference)
//! and the server compute the same numbers from the same inputs.
//!
//! A schedule is a function of the global step alone (`step`: optimizer
//! steps done before this one, 0 for the first), which is what makes a
//! stage rebuilt after recovery, or a resumed job, use the very learning
//! rate the undisturbed run would. Each kind is written as the multiplier a
//! `torch.optim.lr_scheduler.LambdaLR` would be given, with the same f64
//! operations in the same order as the Python (so `base_lr * factor` is the
//! float torch produces), following the `transformers` schedules that
//! transformer training uses:
//!
//! - `Constant { warmup_steps }`: `get_constant_schedule_with_warmup`,
//!   `step / max(1, warmup_steps)` during warm-up, then 1.
//! - `Linear`: `get_linear_schedule_with_warmup`, then
//!   `max(0, (total - step) / max(1, total - warmup))`.
//! - `Cosine`: `get_cosine_with_min_lr_schedule_with_warmup` (half a cycle,
//!   `min_lr_rate = min_lr / base_lr`); without warm-up this is
//!   `CosineAnnealingLR(T_max=total_steps, eta_min=min_lr)` in closed form.
//!   Past `total_steps` it stays at `min_lr` (the lambda would climb again).
//! - `Step { step_size, gamma }`: `StepLR`'s closed form,
//!   `gamma ** (step // step_size)`.
//!
//! `tests/fixtures/lr_schedules.json` holds values torch computed for each
//! (made by `tests/fixtures/lr_schedules.py`); the unit tests compare.

use serde::{Deserialize, Serialize};

/// How the learning rate moves over the job; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum LrSchedule {
    /// The optimizer's lr throughout, after an optional linear warm-up from 0.
    Constant { warmup_steps: u64 },
    /// Linear warm-up from 0, then linear decay to 0 at `total_steps`.
    Linear {
        warmup_steps: u64,
        /// `None` until [`LrSchedule::resolve`] fills in the job's length.
        total_steps: Option<u64>,
    },
    /// Linear warm-up from 0, then half a cosine down to `min_lr` at `total_steps`.
    Cosine {
        warmup_steps: u64,
        total_steps: Option<u64>,
        min_lr: f64,
    },
    /// Multiplied by `gamma` every `step_size` steps.
    Step { step_size: u64, gamma: f64 },
}

impl Default for LrSchedule {
    fn default() -> Self {
        LrSchedule::Constant { warmup_steps: 0 }
    }
}

/// A schedule that does not fit its job: the job-file field (under
/// `training.lr_schedule.`) and why.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("training.lr_schedule.{field}: {message}")]
pub struct ScheduleError {
    pub field: &'static str,
    pub message: String,
}

fn error(field: &'static str, message: String) -> ScheduleError {
    ScheduleError { field, message }
}

impl LrSchedule {
    /// The schedule's own checks, before the job's length is known: counts
    /// and rates in range, `min_lr` at most `base_lr`.
    pub fn validate(&self, base_lr: f64) -> Result<(), ScheduleError> {
        match *self {
            LrSchedule::Constant { .. } => Ok(()),
            LrSchedule::Linear {
                warmup_steps,
                total_steps,
            } => check_warmup(warmup_steps, total_steps),
            LrSchedule::Cosine {
                warmup_steps,
                total_steps,
                min_lr,
            } => {
                if !(min_lr.is_finite() && min_lr >= 0.0 && min_lr <= base_lr) {
                    return Err(error(
                        "min_lr",
                        format!(
                            "must be between 0 and the optimizer's lr {base_lr} (got {min_lr})"
                        ),
                    ));
                }
                check_warmup(warmup_steps, total_steps)
            }
            LrSchedule::Step { step_size, gamma } => {
                if step_size == 0 {
                    return Err(error("step_size", "must be at least 1 (got 0)".into()));
                }
                if !(gamma.is_finite() && gamma > 0.0) {
                    return Err(error(
                        "gamma",
                        format!("must be a positive number (got {gamma})"),
                    ));
                }
                Ok(())
            }
        }
    }

    /// The schedule for a job of `job_steps` optimizer steps: `total_steps`
    /// filled in where it was left out, and refused where the schedule is
    /// longer than the job.
    pub fn resolve(self, base_lr: f64, job_steps: u64) -> Result<LrSchedule, ScheduleError> {
        self.validate(base_lr)?;
        let longer = |field: &'static str, what: &str, n: u64| {
            error(
                field,
                format!(
                    "{what} {n} is longer than the job's {job_steps} steps (epochs * steps per epoch)"
                ),
            )
        };
        let total = |given: Option<u64>| match given {
            Some(t) if t > job_steps => Err(longer("total_steps", "total_steps", t)),
            Some(t) => Ok(t),
            None => Ok(job_steps),
        };
        let resolved = match self {
            LrSchedule::Constant { warmup_steps } => LrSchedule::Constant { warmup_steps },
            LrSchedule::Linear {
                warmup_steps,
                total_steps,
            } => LrSchedule::Linear {
                warmup_steps,
                total_steps: Some(total(total_steps)?),
            },
            LrSchedule::Cosine {
                warmup_steps,
                total_steps,
                min_lr,
            } => LrSchedule::Cosine {
                warmup_steps,
                total_steps: Some(total(total_steps)?),
                min_lr,
            },
            LrSchedule::Step { step_size, gamma } => {
                if step_size > job_steps {
                    return Err(longer("step_size", "step_size", step_size));
                }
                LrSchedule::Step { step_size, gamma }
            }
        };
        let warmup = resolved.warmup_steps();
        if warmup > job_steps {
            return Err(longer("warmup_steps", "warmup_steps", warmup));
        }
        resolved.validate(base_lr)?;
        Ok(resolved)
    }

    /// Whether [`LrSchedule::resolve`] has filled in every length.
    pub fn is_resolved(&self) -> bool {
        !matches!(
            self,
            LrSchedule::Linear {
                total_steps: None,
                ..
            } | LrSchedule::Cosine {
                total_steps: None,
                ..
            }
        )
    }

    pub fn warmup_steps(&self) -> u64 {
        match *self {
            LrSchedule::Constant { warmup_steps }
            | LrSchedule::Linear { warmup_steps, .. }
            | LrSchedule::Cosine { warmup_steps, .. } => warmup_steps,
            LrSchedule::Step { .. } => 0,
        }
    }

    /// The `LambdaLR` multiplier of global step `step` (0-based). An
    /// unresolved length counts as the end of the warm-up.
    pub fn factor(&self, base_lr: f64, step: u64) -> f64 {
        let warmup = self.warmup_steps();
        if step < warmup {
            return step as f64 / warmup.max(1) as f64;
        }
        match *self {
            LrSchedule::Constant { .. } => 1.0,
            LrSchedule::Linear { total_steps, .. } => {
                let total = total_steps.unwrap_or(warmup);
                let left = total.saturating_sub(step) as f64;
                (left / (total - warmup).max(1) as f64).max(0.0)
            }
            LrSchedule::Cosine {
                total_steps,
                min_lr,
                ..
            } => {
                let total = total_steps.unwrap_or(warmup);
                let progress = (step.min(total) - warmup) as f64 / (total - warmup).max(1) as f64;
                let min_lr_rate = min_lr / base_lr;
                let factor = 0.5 * (1.0 + (std::f64::consts::PI * 0.5 * 2.0 * progress).cos());
                (factor * (1.0 - min_lr_rate) + min_lr_rate).max(0.0)
            }
            LrSchedule::Step { step_size, gamma } => gamma.powf((step / step_size.max(1)) as f64),
        }
    }

    /// The learning rate of global step `step`: `LambdaLR`'s
    /// `base_lr * lambda(step)`.
    pub fn lr(&self, base_lr: f64, step: u64) -> f64 {
        base_lr * self.factor(base_lr, step)
    }
}

fn check_warmup(warmup_steps: u64, total_steps: Option<u64>) -> Result<(), ScheduleError> {
    match total_steps {
        Some(0) => Err(error("total_steps", "must be at least 1 (got 0)".into())),
        Some(t) if warmup_steps > t => Err(error(
            "warmup_steps",
            format!("{warmup_steps} is longer than total_steps {t}"),
        )),
        _ => Ok(()),
    }
}

/// `torch.nn.utils.clip_grad_norm_`'s multiplier for gradients whose squares
/// sum to `sum_of_squares`: `max_norm / (total_norm + 1e-6)`, clamped to 1.
/// The sum is taken in f64 by the caller (each stage over its gradients in
/// parameter order, the server over the stages in order), so distributed
/// and single-process clipping agree to the last bit of the f32 multiplier.
pub fn clip_scale(sum_of_squares: f64, max_norm: f64) -> f64 {
    let total_norm = sum_of_squares.sqrt();
    (max_norm / (total_norm + 1e-6)).min(1.0)
}

/// The sum of the squares of `values` in f64, in order: a stage's share of
/// the global gradient norm (continue `acc` across a stage's parameters).
pub fn sum_of_squares(acc: f64, values: &[f32]) -> f64 {
    values.iter().fold(acc, |a, &v| {
        let v = f64::from(v);
        a + v * v
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    struct Case {
        name: String,
        base_lr: f64,
        job_steps: u64,
        schedule: LrSchedule,
        /// What torch's `LambdaLR` gave at steps 0, 1, ..., as f64 bits
        /// (JSON decimals need not parse back to the same float).
        lambda_lr_bits: Vec<u64>,
        /// What torch's own scheduler class (`LinearLR`, `CosineAnnealingLR`,
        /// `StepLR`, ...) gave, where one is the same schedule.
        native: Option<Vec<f64>>,
    }

    #[derive(Deserialize)]
    struct Fixture {
        cases: Vec<Case>,
    }

    fn cases() -> Vec<Case> {
        let f: Fixture = serde_json::from_str(include_str!("../tests/fixtures/lr_schedules.json"))
            .expect("the fixture parses");
        f.cases
    }

    #[test]
    fn every_schedule_gives_torch_lambda_lr_values_bit_for_bit() {
        let cases = cases();
        assert!(cases.len() >= 6);
        for c in cases {
            let s = c.schedule.resolve(c.base_lr, c.job_steps).unwrap();
            assert_eq!(c.lambda_lr_bits.len() as u64, c.job_steps);
            for (step, &want) in c.lambda_lr_bits.iter().enumerate() {
                let got = s.lr(c.base_lr, step as u64);
                let want = f64::from_bits(want);
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{}: step {step}: {got} vs torch {want}",
                    c.name
                );
            }
        }
    }

    #[test]
    fn schedules_match_torch_scheduler_classes_to_f64_rounding() {
        let mut compared = 0;
        for c in cases() {
            let Some(native) = c.native else { continue };
            let s = c.schedule.resolve(c.base_lr, c.job_steps).unwrap();
            for (step, &want) in native.iter().enumerate() {
                let got = s.lr(c.base_lr, step as u64);
                assert!(
                    (got - want).abs() <= 1e-12 * c.base_lr,
                    "{}: step {step}: {got} vs torch {want}",
                    c.name
                );
            }
            compared += 1;
        }
        assert!(compared >= 3, "only {compared} cases had a scheduler class");
    }

    #[test]
    fn a_schedule_longer_than_the_job_is_refused_naming_the_field() {
        let cosine = LrSchedule::Cosine {
            warmup_steps: 10,
            total_steps: None,
            min_lr: 1e-5,
        };
        assert_eq!(cosine.resolve(1e-3, 8).unwrap_err().field, "warmup_steps");
        let linear = LrSchedule::Linear {
            warmup_steps: 0,
            total_steps: Some(101),
        };
        let e = linear.resolve(1e-3, 100).unwrap_err();
        assert_eq!(e.field, "total_steps");
        assert!(
            e.to_string()
                .starts_with("training.lr_schedule.total_steps"),
            "{e}"
        );
        let step = LrSchedule::Step {
            step_size: 50,
            gamma: 0.5,
        };
        assert_eq!(step.resolve(1e-3, 49).unwrap_err().field, "step_size");
        let warm = LrSchedule::Constant { warmup_steps: 5 };
        assert_eq!(warm.resolve(1e-3, 4).unwrap_err().field, "warmup_steps");
        let high = LrSchedule::Cosine {
            warmup_steps: 0,
            total_steps: None,
            min_lr: 0.1,
        };
        assert_eq!(high.resolve(1e-3, 100).unwrap_err().field, "min_lr");
        assert_eq!(
            cosine.resolve(1e-3, 100).unwrap(),
            LrSchedule::Cosine {
                warmup_steps: 10,
                total_steps: Some(100),
                min_lr: 1e-5
            }
        );
    }

    #[test]
    fn clip_scale_is_clip_grad_norm_coefficient_clamped_to_one() {
        // Norm 5: max_norm 1 gives 1 / (5 + 1e-6); max_norm 10 leaves grads alone.
        assert_eq!(clip_scale(25.0, 1.0), 1.0 / (5.0 + 1e-6));
        assert_eq!(clip_scale(25.0, 10.0), 1.0);
        assert_eq!(sum_of_squares(1.0, &[3.0, 4.0]), 26.0);
    }
}
