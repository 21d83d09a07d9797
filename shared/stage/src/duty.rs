//! A donor's cap on how hard the device works, kept as a duty cycle: after
//! each piece of work the provider idles long enough that busy / (busy +
//! idle) is the cap. The browser tab (`rookery-web-provider`) and the
//! native `rookery-provider --gpu-cap` keep it the same way, and the server
//! plans the provider at its claimed speed times the cap.

use rookery_proto::MIN_DUTY_CYCLE;

/// The least cap a donor may set, in percent ([`MIN_DUTY_CYCLE`]).
pub const MIN_CAP_PERCENT: u32 = 10;

/// The duty cycle of a cap in percent, clamped to what the protocol allows.
pub fn duty_cycle_of_percent(percent: u32) -> f64 {
    f64::from(percent.clamp(MIN_CAP_PERCENT, 100)) / 100.0
}

/// Milliseconds to idle after `busy_ms` of GPU work so that the GPU works
/// `duty_cycle` of the time: `busy * (1 - d) / d` (no idling uncapped).
/// A duty cycle below [`MIN_DUTY_CYCLE`] counts as that; nonsense in
/// (negative or not finite) idles not at all.
pub fn idle_ms(busy_ms: f64, duty_cycle: f64) -> f64 {
    if !(busy_ms.is_finite() && busy_ms > 0.0) || duty_cycle.is_nan() {
        return 0.0;
    }
    let duty = duty_cycle.clamp(MIN_DUTY_CYCLE, 1.0);
    busy_ms * (1.0 - duty) / duty
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_idle_after_work_makes_busy_over_busy_plus_idle_the_cap() {
        // (busy ms, duty cycle, idle ms)
        let cases = [
            (100.0, 1.0, 0.0),
            (100.0, 0.5, 100.0),
            (100.0, 0.25, 300.0),
            (30.0, 0.1, 270.0),
            (40.0, 0.8, 10.0),
            // Below the least cap: as the least cap.
            (10.0, 0.01, 90.0),
            // Above 1: uncapped.
            (10.0, 1.5, 0.0),
            (0.0, 0.5, 0.0),
            (-5.0, 0.5, 0.0),
            (f64::NAN, 0.5, 0.0),
            (f64::INFINITY, 0.5, 0.0),
            (10.0, f64::NAN, 0.0),
        ];
        for (busy, duty, want) in cases {
            let idle = idle_ms(busy, duty);
            assert!((idle - want).abs() < 1e-9, "{busy} ms at {duty}: {idle}");
            if idle > 0.0 {
                let kept = busy / (busy + idle);
                assert!((kept - duty.clamp(MIN_DUTY_CYCLE, 1.0)).abs() < 1e-12);
            }
        }
    }

    #[test]
    fn the_cap_in_percent_is_a_duty_cycle_the_protocol_accepts() {
        assert_eq!(duty_cycle_of_percent(100), 1.0);
        assert_eq!(duty_cycle_of_percent(50), 0.5);
        assert_eq!(duty_cycle_of_percent(10), 0.1);
        assert_eq!(duty_cycle_of_percent(0), 0.1);
        assert_eq!(duty_cycle_of_percent(250), 1.0);
        for percent in 0..=300 {
            assert!(rookery_proto::valid_duty_cycle(duty_cycle_of_percent(
                percent
            )));
        }
    }
}
