//! How hard a donating tab works: the donor's cap on GPU use, kept as a
//! duty cycle (after each piece of GPU work the tab idles long enough that
//! busy / (busy + idle) is the cap), and the busy-device detector (a
//! micro-batch far slower than the tab's recent ones, several in a row,
//! means something else is using the GPU: the tab pauses and tries again
//! later). Plain arithmetic, so it is tested natively.

use std::collections::VecDeque;
use std::time::Duration;

pub use rookery_stage::duty::{MIN_CAP_PERCENT, duty_cycle_of_percent, idle_ms};

/// Why a tab pauses itself when its GPU is busy with other work.
pub const BUSY_REASON: &str = "the GPU is busy with something else";

/// Notices a device that something else is using: a micro-batch taking
/// more than [`Self::SLOW_FACTOR`] times the median of the recent ones (and
/// at least [`Self::MIN_EXCESS_MS`] more), [`Self::SLOW_IN_A_ROW`] times in
/// a row, once [`Self::MIN_SAMPLES`] are known. One detector per stage: a
/// new stage's micro-batches take their own time.
#[derive(Debug, Clone, Default)]
pub struct BusyDetector {
    /// The newest micro-batches' times, ms, oldest first.
    recent: VecDeque<f64>,
    slow_in_a_row: u32,
}

/// What the detector made of a slow run: the recent median and the time of
/// the micro-batch that completed it, for the donor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Busy {
    pub typical_ms: f64,
    pub latest_ms: f64,
}

impl Busy {
    /// The pause reason, saying how much slower and when the tab tries
    /// again (well within a close frame's 123 bytes, with its prefix).
    pub fn reason(&self, retry: Duration) -> String {
        let times = self.latest_ms / self.typical_ms.max(f64::MIN_POSITIVE);
        format!(
            "{BUSY_REASON} (micro-batches took {times:.0}x as long); trying again in {} s",
            retry.as_secs()
        )
    }
}

impl BusyDetector {
    /// Micro-batches whose median is the yardstick.
    pub const WINDOW: usize = 20;
    /// Micro-batches timed before any is called slow.
    pub const MIN_SAMPLES: usize = 8;
    pub const SLOW_FACTOR: f64 = 3.0;
    /// A slow micro-batch is also this much slower than the median, so a
    /// tiny stage's jitter (2 ms against 0.5) is not a busy device.
    pub const MIN_EXCESS_MS: f64 = 50.0;
    pub const SLOW_IN_A_ROW: u32 = 5;

    pub fn new() -> Self {
        Self::default()
    }

    /// Forgets every time (a new stage).
    pub fn reset(&mut self) {
        *self = Self::default();
    }

    /// Counts a micro-batch that took `ms`; `Some` when it completes a
    /// slow run (then the count starts over).
    pub fn observe(&mut self, ms: f64) -> Option<Busy> {
        if !ms.is_finite() || ms < 0.0 {
            return None;
        }
        let typical = (self.recent.len() >= Self::MIN_SAMPLES).then(|| median(&self.recent));
        let slow = typical.is_some_and(|median| {
            ms > Self::SLOW_FACTOR * median && ms - median >= Self::MIN_EXCESS_MS
        });
        self.slow_in_a_row = if slow { self.slow_in_a_row + 1 } else { 0 };
        if self.recent.len() == Self::WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(ms);
        match typical {
            Some(typical_ms) if self.slow_in_a_row >= Self::SLOW_IN_A_ROW => {
                self.slow_in_a_row = 0;
                Some(Busy {
                    typical_ms,
                    latest_ms: ms,
                })
            }
            _ => None,
        }
    }
}

fn median(values: &VecDeque<f64>) -> f64 {
    let mut sorted: Vec<f64> = values.iter().copied().collect();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    if sorted.len() % 2 == 1 {
        sorted[mid]
    } else {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    }
}

/// The first wait before a tab that paused for a busy GPU tries again.
pub const BUSY_BACKOFF_FIRST: Duration = Duration::from_secs(60);
/// The longest such wait.
pub const BUSY_BACKOFF_MAX: Duration = Duration::from_secs(15 * 60);
/// A tab that trained this long since its last busy pause starts over at
/// [`BUSY_BACKOFF_FIRST`].
pub const BUSY_FORGOTTEN_AFTER: Duration = Duration::from_secs(10 * 60);

/// How long to pause for a busy GPU: [`BUSY_BACKOFF_FIRST`], doubling (to
/// [`BUSY_BACKOFF_MAX`]) each time the GPU is found busy again within
/// [`BUSY_FORGOTTEN_AFTER`] of the last retry. `last` is the previous wait
/// and the time since the tab resumed after it, if it ever paused so.
pub fn busy_backoff(last: Option<(Duration, Duration)>) -> Duration {
    match last {
        Some((wait, since_resumed)) if since_resumed < BUSY_FORGOTTEN_AFTER => {
            (wait * 2).clamp(BUSY_BACKOFF_FIRST, BUSY_BACKOFF_MAX)
        }
        _ => BUSY_BACKOFF_FIRST,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A detector that has seen `n` micro-batches of `ms` each.
    fn steady(n: usize, ms: f64) -> BusyDetector {
        let mut d = BusyDetector::new();
        for _ in 0..n {
            assert_eq!(d.observe(ms), None);
        }
        d
    }

    #[test]
    fn five_micro_batches_in_a_row_over_three_times_the_median_mean_a_busy_gpu() {
        let mut d = steady(20, 40.0);
        for _ in 0..4 {
            assert_eq!(d.observe(130.0), None);
        }
        assert_eq!(
            d.observe(200.0),
            Some(Busy {
                typical_ms: 40.0,
                latest_ms: 200.0
            })
        );
        // The count starts over.
        assert_eq!(d.observe(200.0), None);
    }

    #[test]
    fn a_fast_micro_batch_breaks_the_run() {
        let mut d = steady(20, 40.0);
        for _ in 0..4 {
            assert_eq!(d.observe(200.0), None);
        }
        assert_eq!(d.observe(45.0), None);
        for _ in 0..4 {
            assert_eq!(d.observe(200.0), None);
        }
        assert!(d.observe(200.0).is_some());
    }

    #[test]
    fn slow_micro_batches_are_not_judged_before_enough_are_known() {
        // The first micro-batches of a stage compile its kernels.
        let mut d = steady(BusyDetector::MIN_SAMPLES - 1, 40.0);
        for _ in 0..BusyDetector::SLOW_IN_A_ROW {
            assert_eq!(d.observe(500.0), None);
        }
    }

    #[test]
    fn under_three_times_or_a_few_ms_over_is_not_busy() {
        let mut d = steady(20, 40.0);
        for _ in 0..20 {
            assert_eq!(d.observe(119.0), None);
        }
        // A tiny stage: 10 times slower, but only 9 ms more.
        let mut d = steady(20, 1.0);
        for _ in 0..20 {
            assert_eq!(d.observe(10.0), None);
        }
    }

    #[test]
    fn a_reset_forgets_the_times_of_the_last_stage() {
        let mut d = steady(20, 40.0);
        d.reset();
        for _ in 0..10 {
            assert_eq!(d.observe(400.0), None);
        }
    }

    #[test]
    fn the_reason_says_how_much_slower_and_when_it_retries_within_a_close_frame() {
        let busy = Busy {
            typical_ms: 40.0,
            latest_ms: 200.0,
        };
        let reason = busy.reason(Duration::from_secs(60));
        assert_eq!(
            reason,
            "the GPU is busy with something else (micro-batches took 5x as long); \
             trying again in 60 s"
        );
        let close = format!("{}{reason}", rookery_proto::api::PAUSED_BY_DONOR);
        assert!(close.len() <= 123, "{} bytes", close.len());
        let long = busy.reason(BUSY_BACKOFF_MAX);
        assert!(rookery_proto::api::PAUSED_BY_DONOR.len() + long.len() <= 123);
    }

    #[test]
    fn the_busy_backoff_doubles_while_the_gpu_stays_busy_and_starts_over_after_a_quiet_while() {
        let min = Duration::from_secs(60);
        assert_eq!(busy_backoff(None), BUSY_BACKOFF_FIRST);
        let soon = Duration::from_secs(30);
        assert_eq!(busy_backoff(Some((BUSY_BACKOFF_FIRST, soon))), 2 * min);
        assert_eq!(busy_backoff(Some((2 * min, soon))), 4 * min);
        assert_eq!(busy_backoff(Some((8 * min, soon))), BUSY_BACKOFF_MAX);
        assert_eq!(
            busy_backoff(Some((BUSY_BACKOFF_MAX, soon))),
            BUSY_BACKOFF_MAX
        );
        assert_eq!(
            busy_backoff(Some((8 * min, BUSY_FORGOTTEN_AFTER))),
            BUSY_BACKOFF_FIRST
        );
    }
}
