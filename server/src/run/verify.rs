//! Spot checks, as BOINC does with redundancy: a seeded share
//! (`[training.verify] rate`) of each stage's training micro-batches is
//! re-run on another provider and the two results compared, forward and
//! backward: a Root's activations; a Stem's activations and, given the
//! same output gradients, its input gradients; a Leaf's loss and input
//! gradients. (A Root's backward sends nothing: it shows in its
//! parameters, which syncs compare across clusters.)
//!
//! A re-run must start from the parameters the stage used, which the server
//! knows only right after a sync: the first step after one (and the step a
//! sync in the background is taken at) is checkable. The run keeps the
//! micro-batch's input (the `Forward` the stage got, and a Stem's
//! `Backward`) and its results (its activations, or a Leaf's loss, and the
//! gradients it sent back); tensors that stream through the
//! coordinator come back tapped ([`Effect::Tap`], [`JobRun::on_tapped`]).
//! Once the checkpoint of that step is taken the check is handed to the
//! coordinator ([`Effect::Verify`]), which assigns the stage to an idle
//! native provider, sends it the same `Forward` and compares
//! ([`disagreement`]). Dropout masks depend on the step's seed and the
//! samples' positions only, so an honest re-run computes the same maths.

use std::collections::BTreeMap;

use rookery_proto::{Assignment, Backward, Forward, Phase, ToProvider, WireTensor};

use super::{Effect, JobRun};

/// Two honest results differ by far less than this (relative to the
/// result's size: backends and thread counts change only rounding, which
/// the kernels bound near 1e-5), and a result changed by a useful amount
/// differs by more.
pub const VERIFY_TOLERANCE: f64 = 1e-3;

/// What a checked micro-batch produced.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// A Root's or Stem's activations.
    Activations(Vec<WireTensor>),
    /// A Leaf's summed loss.
    Loss(f64),
}

/// Which part of a check a tapped message completes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TapSide {
    /// The activations the checked stage was sent.
    Input,
    /// The activations it answered with.
    Output,
    /// The gradients of its outputs it was sent (a Stem's `Backward`).
    BackwardInput,
    /// The gradients of its inputs it answered with.
    BackwardOutput,
}

/// A check ready to run, for the coordinator.
#[derive(Debug)]
pub struct Verification {
    pub cluster: usize,
    pub stage: usize,
    pub step: u64,
    pub micro: u32,
    /// The provider whose result is checked.
    pub provider: u64,
    /// The stage as of the checkpoint the micro-batch started from.
    pub assignment: Assignment,
    /// The memory the stage needs.
    pub memory_bytes: u64,
    /// What the stage was sent.
    pub forward: Forward,
    /// What it answered.
    pub expected: Outcome,
    /// The gradients of its outputs it was sent (a Stem's only).
    pub backward: Option<Backward>,
    /// The gradients of its inputs it sent back (a Stem's or a Leaf's).
    pub expected_grads: Option<Vec<WireTensor>>,
}

/// A check waiting for its halves, or for its step's checkpoint.
#[derive(Debug)]
pub(super) struct Pending {
    cluster: usize,
    stage: usize,
    step: u64,
    micro: u32,
    provider: u64,
    forward: Forward,
    input_ready: bool,
    expected: Option<Outcome>,
    /// Whether the stage runs a backward the check repeats, and what of
    /// it is in: a Stem is sent a `Backward`, a Leaf computes its own.
    role: Role,
    backward: Option<Backward>,
    backward_ready: bool,
    expected_grads: Option<Vec<WireTensor>>,
}

/// What of a stage's backward a check repeats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// A Root sends no gradients.
    Root,
    /// Sent output gradients, sends input gradients.
    Stem,
    /// Sends input gradients right after its loss.
    Leaf,
}

impl Pending {
    fn ready(&self) -> bool {
        let backward_in = self.role != Role::Stem || self.backward_ready;
        let grads_out = self.role == Role::Root || self.expected_grads.is_some();
        self.input_ready && self.expected.is_some() && backward_in && grads_out
    }
}

/// Checks by key, in the order they were chosen.
pub(super) type Checks = BTreeMap<u64, Pending>;

/// Whether micro-batch `micro` of stage `stage` of cluster `cluster` at
/// `step` is checked: a pure function of the job's seed, so a replay checks
/// the same ones.
pub fn sampled(seed: u64, step: u64, cluster: usize, stage: usize, micro: u32, rate: f64) -> bool {
    if rate <= 0.0 {
        return false;
    }
    let mut z = seed
        ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (cluster as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9)
        ^ (stage as u64).wrapping_mul(0x94D0_49BB_1331_11EB)
        ^ u64::from(micro).wrapping_mul(0xD6E8_FEB8_6659_FD93);
    // splitmix64's finaliser: every input bit moves every output bit.
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    ((z >> 11) as f64 / (1u64 << 53) as f64) < rate
}

/// How far `got` is from `expected`, relative to `expected`'s size (the
/// root mean square of the difference over that of the values, per
/// tensor, the worst of them); an error when they are not comparable.
pub fn disagreement(expected: &Outcome, got: &Outcome) -> Result<f64, String> {
    match (expected, got) {
        (Outcome::Loss(a), Outcome::Loss(b)) => Ok((a - b).abs() / a.abs().max(1e-12)),
        (Outcome::Activations(a), Outcome::Activations(b)) => tensors_disagreement(a, b),
        _ => Err("results of different kinds".into()),
    }
}

/// [`disagreement`] of two lists of tensors (activations or gradients),
/// matched by position, name and shape.
pub fn tensors_disagreement(a: &[WireTensor], b: &[WireTensor]) -> Result<f64, String> {
    if a.len() != b.len() {
        return Err(format!("{} tensors against {}", b.len(), a.len()));
    }
    let mut worst = 0.0f64;
    for (x, y) in a.iter().zip(b) {
        if x.name != y.name || x.shape != y.shape {
            return Err(format!(
                "tensor {} {:?} against {} {:?}",
                y.name, y.shape, x.name, x.shape
            ));
        }
        let (x, y) = (
            x.to_f32().map_err(|e| e.to_string())?,
            y.to_f32().map_err(|e| e.to_string())?,
        );
        let diff: f64 = x
            .iter()
            .zip(&y)
            .map(|(p, q)| (f64::from(*p) - f64::from(*q)).powi(2))
            .sum();
        let size: f64 = x.iter().map(|p| f64::from(*p).powi(2)).sum();
        worst = worst.max((diff / size.max(1e-24)).sqrt());
    }
    Ok(worst)
}

impl JobRun {
    fn verify_rate(&self) -> f64 {
        self.spec.training.verify_rate
    }

    /// Whether the job spot-checks its providers.
    pub fn verifies(&self) -> bool {
        self.verify_rate() > 0.0
    }

    /// Whether cluster `c`'s step `step` starts from the checkpoint (or the
    /// one a background sync takes at it), so a re-run can start there too.
    pub(super) fn checkable(&self, step: u64) -> bool {
        self.verify_rate() > 0.0 && (step == self.synced || self.background_sync == Some(step))
    }

    /// Chooses `forward`, sent to stage `s` of cluster `c`, for a check if
    /// the seeded draw says so. `Some(key)` when its inputs are still to be
    /// tapped off the message they stream with.
    pub(super) fn maybe_check(
        &mut self,
        c: usize,
        s: usize,
        forward: &Forward,
    ) -> Option<(u64, bool)> {
        let Phase::Train { step } = forward.phase else {
            return None;
        };
        if !self.checkable(step)
            || !sampled(
                self.spec.training.seed,
                step,
                c,
                s,
                forward.micro,
                self.verify_rate(),
            )
        {
            return None;
        }
        let key = self.next_check;
        self.next_check += 1;
        let input_ready = !forward.inputs.iter().any(WireTensor::follows);
        let last = self.clusters[c].stages.len() - 1;
        let role = match s {
            // A lone stage is its cluster's Root: it sends no gradients.
            0 => Role::Root,
            s if s == last => Role::Leaf,
            _ => Role::Stem,
        };
        self.checks.insert(
            key,
            Pending {
                cluster: c,
                stage: s,
                step,
                micro: forward.micro,
                provider: self.clusters[c].stages[s].provider,
                forward: forward.clone(),
                input_ready,
                expected: None,
                role,
                backward: None,
                backward_ready: false,
                expected_grads: None,
            },
        );
        Some((key, input_ready))
    }

    /// The check of stage `s`'s micro-batch `micro` at `step`, if there is one.
    pub(super) fn check_of(&self, c: usize, s: usize, step: u64, micro: u32) -> Option<u64> {
        self.checks
            .iter()
            .find(|(_, p)| (p.cluster, p.stage, p.step, p.micro) == (c, s, step, micro))
            .map(|(key, _)| *key)
    }

    /// Stage `s` answered micro-batch `micro` of `step` with `tensors`
    /// (its activations, `TapSide::Output`, or its input gradients,
    /// `TapSide::BackwardOutput`): kept if it is checked, or tapped when
    /// their bytes stream on.
    pub(super) fn checked_answer_tensors(
        &mut self,
        (c, s, step, micro): (usize, usize, u64, u32),
        tensors: &[WireTensor],
        side: TapSide,
    ) -> Vec<Effect> {
        let Some(key) = self.check_of(c, s, step, micro) else {
            return Vec::new();
        };
        if tensors.iter().any(WireTensor::follows) {
            return vec![Effect::Tap { key, side }];
        }
        self.on_tapped(key, side, tensors.to_vec())
    }

    /// The Leaf reported `loss_sum` for micro-batch `micro` of `step`.
    pub(super) fn checked_loss(
        &mut self,
        c: usize,
        s: usize,
        step: u64,
        micro: u32,
        loss_sum: f64,
    ) -> Vec<Effect> {
        let Some(key) = self.check_of(c, s, step, micro) else {
            return Vec::new();
        };
        if let Some(check) = self.checks.get_mut(&key) {
            check.expected = Some(Outcome::Loss(loss_sum));
        }
        self.launch_checks()
    }

    /// A tapped message is whole: its tensors complete check `key`.
    pub fn on_tapped(&mut self, key: u64, side: TapSide, outputs: Vec<WireTensor>) -> Vec<Effect> {
        let Some(check) = self.checks.get_mut(&key) else {
            return Vec::new();
        };
        match side {
            TapSide::Input => {
                check.forward.inputs = outputs;
                check.input_ready = true;
            }
            TapSide::Output => check.expected = Some(Outcome::Activations(outputs)),
            TapSide::BackwardInput => {
                if let Some(backward) = check.backward.as_mut() {
                    backward.grads = outputs;
                    check.backward_ready = true;
                }
            }
            TapSide::BackwardOutput => check.expected_grads = Some(outputs),
        }
        self.launch_checks()
    }

    /// Hands over every check whose halves are in and whose step is the
    /// checkpoint's; drops those whose checkpoint has passed.
    pub(super) fn launch_checks(&mut self) -> Vec<Effect> {
        let synced = self.synced;
        self.checks.retain(|_, p| p.step >= synced);
        let ready: Vec<u64> = self
            .checks
            .iter()
            .filter(|(_, p)| p.step == synced && p.ready())
            .map(|(key, _)| *key)
            .collect();
        let mut effects = Vec::new();
        for key in ready {
            let Some(p) = self.checks.remove(&key) else {
                continue;
            };
            let Some(expected) = p.expected else {
                continue;
            };
            let mut assignment = self.assignment(p.cluster, p.stage);
            // A forward needs no optimizer state.
            assignment.optimizer_state.clear();
            effects.push(Effect::Verify(Box::new(Verification {
                cluster: p.cluster,
                stage: p.stage,
                step: p.step,
                micro: p.micro,
                provider: p.provider,
                assignment,
                memory_bytes: self.clusters[p.cluster].stages[p.stage].memory_bytes,
                forward: p.forward,
                expected,
                backward: p.backward,
                expected_grads: p.expected_grads,
            })));
        }
        effects
    }

    /// Notes checks for the forwards among `effects` (sent to a stage), and
    /// the backwards sent to checked stages.
    pub(super) fn choose_checks(&mut self, effects: &[Effect]) -> Vec<Effect> {
        let mut taps = Vec::new();
        for effect in effects {
            match effect {
                Effect::Send(to, ToProvider::Forward(forward)) => {
                    if let Some((c, s)) = self.locate(*to)
                        && let Some((key, false)) = self.maybe_check(c, s, forward)
                    {
                        taps.push(Effect::Tap {
                            key,
                            side: TapSide::Input,
                        });
                    }
                }
                Effect::Send(to, ToProvider::Backward(backward)) => {
                    taps.extend(self.checked_backward(*to, backward));
                }
                _ => {}
            }
        }
        taps
    }

    /// `backward` is sent to `to`: kept if it completes a check, tapped
    /// when its gradients stream on.
    fn checked_backward(&mut self, to: u64, backward: &Backward) -> Option<Effect> {
        let (c, s) = self.locate(to)?;
        let key = self.check_of(c, s, backward.step, backward.micro)?;
        let check = self.checks.get_mut(&key)?;
        check.backward = Some(backward.clone());
        if backward.grads.iter().any(WireTensor::follows) {
            return Some(Effect::Tap {
                key,
                side: TapSide::BackwardInput,
            });
        }
        check.backward_ready = true;
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rookery_proto::WireDType;

    #[test]
    fn the_seeded_draw_checks_about_the_rate_and_the_same_ones_on_a_replay() {
        let draws: Vec<bool> = (0..20_000)
            .map(|i| sampled(7, i / 8, 0, 1, (i % 8) as u32, 0.02))
            .collect();
        let share = draws.iter().filter(|d| **d).count() as f64 / draws.len() as f64;
        assert!((0.015..0.025).contains(&share), "{share}");
        let again: Vec<bool> = (0..20_000)
            .map(|i| sampled(7, i / 8, 0, 1, (i % 8) as u32, 0.02))
            .collect();
        assert_eq!(draws, again);
        assert!(!sampled(7, 0, 0, 0, 0, 0.0));
        assert!(sampled(7, 0, 0, 0, 0, 1.0));
    }

    #[test]
    fn a_one_percent_change_disagrees_and_rounding_does_not() {
        let t = |values: &[f32]| {
            Outcome::Activations(vec![WireTensor::from_f32(
                "h",
                &[values.len()],
                values,
                WireDType::F32,
            )])
        };
        let honest: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
        let rounded: Vec<f32> = honest.iter().map(|v| v * (1.0 + 1e-6)).collect();
        let scaled: Vec<f32> = honest.iter().map(|v| v * 1.01).collect();
        // (result, disagrees)
        let cases = [
            (t(&rounded), false),
            (t(&scaled), true),
            (t(&honest), false),
        ];
        for (got, disagrees) in cases {
            let d = disagreement(&t(&honest), &got).unwrap();
            assert_eq!(d > VERIFY_TOLERANCE, disagrees, "{d}");
        }
        let loss = disagreement(&Outcome::Loss(2.0), &Outcome::Loss(2.02)).unwrap();
        assert!(loss > VERIFY_TOLERANCE);
        assert!(disagreement(&Outcome::Loss(2.0), &t(&honest)).is_err());
        let other = Outcome::Activations(vec![WireTensor::from_f32(
            "g",
            &[64],
            &honest,
            WireDType::F32,
        )]);
        assert!(disagreement(&t(&honest), &other).is_err());
    }
}
