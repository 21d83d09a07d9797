//! Plain functions that turn API data into the words and numbers the pages
//! show. Kept free of Leptos and the browser so they are unit-tested natively.

use rookery_proto::api::{LogEntry, ProviderInfo, ProviderStatus};
use rookery_web_provider::DonateStatus;

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// `memory_bytes` as GiB with one decimal, e.g. "15.6 GiB".
pub fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / GIB)
}

/// Measured throughput with one decimal. Non-finite values come from a broken
/// benchmark; show a dash rather than "NaN".
/// A measured link in the unit that keeps it short; the probe runs right
/// after a provider joins.
pub fn bandwidth(mbps: Option<f64>) -> String {
    match mbps {
        Some(m) if m.is_finite() && m >= 1000.0 => format!("{:.1} Gbit/s", m / 1000.0),
        Some(m) if m.is_finite() => format!("{m:.0} Mbit/s"),
        _ => "measuring".into(),
    }
}

pub fn gflops(value: f64) -> String {
    if value.is_finite() {
        format!("{value:.1}")
    } else {
        "–".into()
    }
}

/// How long ago `then_ms` was, seen from `now_ms` (both Unix milliseconds).
/// Timestamps come from the server's clock and `now_ms` from the browser's, so
/// a small skew can put `then_ms` in the future: that reads as "just now".
pub fn relative(now_ms: f64, then_ms: u64) -> String {
    let seconds = ((now_ms - then_ms as f64) / 1000.0).floor();
    if !seconds.is_finite() || seconds < 1.0 {
        return "just now".into();
    }
    // Truncation is intended: whole units read better than "1.7 min".
    let seconds = seconds as u64;
    match seconds {
        0..60 => format!("{seconds} s ago"),
        60..3_600 => format!("{} min ago", seconds / 60),
        3_600..86_400 => format!("{} h ago", seconds / 3_600),
        _ => format!("{} d ago", seconds / 86_400),
    }
}

/// A length of time in its two largest units, e.g. "1 h 02 min", "3 min 05 s".
pub fn duration(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0..60 => format!("{s} s"),
        60..3_600 => format!("{} min {:02} s", s / 60, s % 60),
        3_600..86_400 => format!("{} h {:02} min", s / 3_600, (s % 3_600) / 60),
        _ => format!("{} d {:02} h", s / 86_400, (s % 86_400) / 3_600),
    }
}

/// How long a provider has been connected; for a gone one, how long it was.
pub fn uptime(info: &ProviderInfo, now_ms: f64) -> String {
    let end = info.gone_since_ms.map_or(now_ms, |gone| gone as f64);
    duration((end - info.connected_since_ms as f64).max(0.0) as u64)
}

/// A whole number with thousands separators, e.g. "206,954".
pub fn count(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A size in bytes in the largest unit that keeps it at or above one.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// An estimated or measured time in seconds, in ms below one second.
pub fn seconds(s: f64) -> String {
    if !s.is_finite() {
        "–".into()
    } else if s < 1.0 {
        format!("{:.1} ms", s * 1000.0)
    } else {
        format!("{s:.2} s")
    }
}

/// A loss or other float metric; a dash when there is none yet.
pub fn metric(value: Option<f64>, decimals: usize) -> String {
    match value {
        Some(v) if v.is_finite() => format!("{v:.decimals$}"),
        _ => "–".into(),
    }
}

/// The header line of the Providers page.
pub fn connected_count(count: usize) -> String {
    match count {
        1 => "1 connected provider".into(),
        n => format!("{n} connected providers"),
    }
}

/// The detail under "gone" in the status cell: the server's reason and when,
/// e.g. "heartbeat timeout, 2 min ago". `None` for connected providers.
pub fn gone_detail(info: &ProviderInfo, now_ms: f64) -> Option<String> {
    if info.status != ProviderStatus::Gone {
        return None;
    }
    let reason = info
        .paused_reason
        .as_deref()
        .or(info.gone_reason.as_deref())
        .filter(|r| !r.trim().is_empty());
    let when = info.gone_since_ms.map(|since| relative(now_ms, since));
    match (reason, when) {
        (Some(reason), Some(when)) => Some(format!("{reason}, {when}")),
        (Some(reason), None) => Some(reason.to_string()),
        (None, Some(when)) => Some(when),
        (None, None) => None,
    }
}

/// The value of `data-status` on a provider row (part of the e2e DOM contract).
pub fn status_attr(status: ProviderStatus) -> &'static str {
    match status {
        ProviderStatus::Connected => "connected",
        ProviderStatus::Gone => "gone",
    }
}

/// Connected providers first, oldest connection first, so rows do not jump
/// around as heartbeats arrive; then gone ones, most recently gone first.
pub fn sort_for_display(providers: &mut [ProviderInfo]) {
    providers.sort_by(|a, b| {
        let rank = |p: &ProviderInfo| match p.status {
            ProviderStatus::Connected => 0,
            ProviderStatus::Gone => 1,
        };
        rank(a).cmp(&rank(b)).then_with(|| match a.status {
            ProviderStatus::Connected => a
                .connected_since_ms
                .cmp(&b.connected_since_ms)
                .then(a.id.cmp(&b.id)),
            ProviderStatus::Gone => b.gone_since_ms.cmp(&a.gone_since_ms).then(a.id.cmp(&b.id)),
        })
    });
}

/// The value of `data-state` on `#donate-status`; `None` means not started.
pub fn donate_state(status: Option<&DonateStatus>) -> &'static str {
    match status {
        None => "idle",
        Some(DonateStatus::Probing) => "probing",
        Some(DonateStatus::NoWebGpu { .. }) => "no-webgpu",
        Some(DonateStatus::Benchmarking { .. }) => "benchmarking",
        Some(DonateStatus::Connecting { .. }) => "connecting",
        Some(DonateStatus::Connected { .. }) => "connected",
        Some(DonateStatus::Training { .. }) => "training",
        Some(DonateStatus::Reconnecting { .. }) => "reconnecting",
        Some(DonateStatus::Failed { .. }) => "failed",
        Some(DonateStatus::Paused { .. }) => "paused",
        // Never kept as the state (`Donation` files them apart).
        Some(
            DonateStatus::Credited { .. }
            | DonateStatus::DeviceBusy(_)
            | DonateStatus::KernelSpeeds { .. },
        ) => "connected",
    }
}

/// What the Donate page says of the job a tab trains: its name where its
/// Requester made it public, else only that it is private.
pub fn donate_job(public_name: Option<&str>) -> String {
    match public_name {
        Some(name) => format!("This tab is training \u{201c}{name}\u{201d}."),
        None => "This tab is training a private job (its Requester keeps the name private).".into(),
    }
}

/// A provider's GPU cap as the Providers page shows it ("GPU cap 50%"),
/// if it has one.
pub fn gpu_cap(duty_cycle: Option<f64>) -> Option<String> {
    duty_cycle
        .filter(|d| d.is_finite() && *d < 1.0)
        .map(|d| format!("GPU cap {:.0}%", d * 100.0))
}

/// The status word of a provider row: `paused` for a tab its donor paused
/// (the reason is its detail), else [`status_attr`]'s word.
pub fn status_word(info: &ProviderInfo) -> &'static str {
    if info.status == ProviderStatus::Gone && info.paused_reason.is_some() {
        "paused"
    } else {
        status_attr(info.status)
    }
}

/// A tab's throughput over time from `(ms since it joined, micro-batches
/// done)` samples: micro-batches a minute in each `window_ms`, dated by the
/// window's end (minutes), from the first window with a sample.
pub fn throughput(samples: &[(f64, u64)], window_ms: f64) -> Vec<(f64, f64)> {
    let Some(&(last_ms, _)) = samples.last() else {
        return Vec::new();
    };
    let windows = (last_ms / window_ms).floor() as usize + 1;
    let mut done = vec![None::<u64>; windows];
    for &(at, count) in samples {
        let w = ((at / window_ms).floor() as usize).min(windows - 1);
        done[w] = Some(done[w].map_or(count, |c: u64| c.max(count)));
    }
    let per_minute = 60_000.0 / window_ms;
    let mut before = 0u64;
    let mut points = Vec::new();
    let mut started = false;
    for (w, count) in done.into_iter().enumerate() {
        let now = count.unwrap_or(before).max(before);
        started |= count.is_some();
        if started {
            let end_min = (w as f64 + 1.0) * window_ms / 60_000.0;
            points.push((end_min, (now - before) as f64 * per_minute));
        }
        before = now;
    }
    points
}

/// What the Donate page says about the donation, in plain words: a headline
/// and, where there is one, a detail line (the adapter, or the reason).
pub fn donate_text(status: Option<&DonateStatus>) -> (String, Option<String>) {
    let adapter_line = |adapter: &str, g: f64| format!("{adapter}, {} GFLOP/s", gflops(g));
    match status {
        None => ("Not donating. Press the button to start.".into(), None),
        Some(DonateStatus::Probing) => {
            ("Looking for a WebGPU adapter in this browser…".into(), None)
        }
        Some(DonateStatus::NoWebGpu { reason }) => (
            "This browser cannot donate its GPU.".into(),
            Some(reason.clone()),
        ),
        Some(DonateStatus::Benchmarking { adapter }) => {
            (format!("Measuring the speed of {adapter}…"), None)
        }
        Some(DonateStatus::Connecting { adapter, gflops: g }) => (
            "Connecting to the server…".into(),
            Some(adapter_line(adapter, *g)),
        ),
        Some(DonateStatus::Connected {
            provider_id,
            adapter,
            gflops: g,
        }) => (
            format!("Donating as provider #{provider_id}. Keep this tab open."),
            Some(adapter_line(adapter, *g)),
        ),
        Some(DonateStatus::Training {
            provider_id,
            adapter,
            gflops: g,
            job_id,
            stage,
            stages,
            micro_batches,
            ..
        }) => (
            format!(
                "Provider #{provider_id} is training stage {} of {stages} of job #{job_id}: \
                 {micro_batches} micro-batches done. Keep this tab open.",
                stage + 1
            ),
            Some(adapter_line(adapter, *g)),
        ),
        Some(DonateStatus::Reconnecting { reason }) => (
            "Lost the connection; trying again shortly…".into(),
            Some(reason.clone()),
        ),
        Some(DonateStatus::Failed { reason }) => ("Donation stopped.".into(), Some(reason.clone())),
        Some(DonateStatus::Paused { reason }) => (
            "Paused: this tab computes nothing until you resume.".into(),
            Some(reason.clone()),
        ),
        Some(DonateStatus::Credited { gflop }) => (
            format!(
                "Credited with {} of accepted work.",
                rookery_proto::api::flop_text(*gflop)
            ),
            None,
        ),
        Some(DonateStatus::KernelSpeeds { lines }) => (
            format!("Measured {} kernels on this GPU.", lines.len()),
            None,
        ),
        Some(DonateStatus::DeviceBusy(busy)) => (
            "Pausing: the GPU is busy with something else.".into(),
            Some(format!(
                "micro-batches took {:.0} ms instead of {:.0} ms",
                busy.latest_ms, busy.typical_ms
            )),
        ),
    }
}

/// A kernel line of the Donate page: its name and shape, and its speed.
pub fn kernel_speed(line: &rookery_web_provider::KernelSpeed) -> String {
    format!("{}: {} GFLOP/s", line.name, gflops(line.gflops))
}

/// One line of a job's event log as the page shows it: a run of
/// consecutive checkpoint lines (a job that syncs every step writes one
/// every two seconds, each counting the syncs since the last) is one line,
/// counting them all and dated by the latest, so it updates in place.
#[derive(Debug, Clone, PartialEq)]
pub struct LogLine {
    pub at_ms: u64,
    pub kind: String,
    pub message: String,
    /// Log entries the line stands for.
    pub entries: usize,
}

/// `entries` as the page's lines, oldest first.
pub fn group_log(entries: &[LogEntry]) -> Vec<LogLine> {
    let mut lines: Vec<LogLine> = Vec::new();
    let mut syncs = 0u64;
    for entry in entries {
        if entry.kind != "checkpoint" {
            syncs = 0;
            lines.push(LogLine {
                at_ms: entry.at_ms,
                kind: entry.kind.clone(),
                message: entry.message.clone(),
                entries: 1,
            });
            continue;
        }
        // "N syncs averaged ..." counts N; "parameters averaged ..." one.
        let n: u64 = entry
            .message
            .split_once(" syncs ")
            .and_then(|(n, _)| n.parse().ok())
            .unwrap_or(1);
        let grouped = lines.last().is_some_and(|l| l.kind == "checkpoint");
        syncs = if grouped { syncs + n } else { n };
        let message = match syncs {
            1 => entry.message.clone(),
            _ => format!(
                "{} syncs averaged parameters across clusters; checkpoint taken",
                count(syncs)
            ),
        };
        match lines.last_mut() {
            Some(line) if grouped => {
                line.at_ms = entry.at_ms;
                line.message = message;
                line.entries += 1;
            }
            _ => lines.push(LogLine {
                at_ms: entry.at_ms,
                kind: entry.kind.clone(),
                message,
                entries: 1,
            }),
        }
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use rookery_proto::ProviderKind;

    #[test]
    fn a_tabs_throughput_is_micro_batches_a_minute_per_window() {
        // 10 s windows: 5 micro-batches in the first, none in the second,
        // 10 in the third.
        let samples = [(1_000.0, 2), (9_000.0, 5), (21_000.0, 9), (29_999.0, 15)];
        assert_eq!(
            throughput(&samples, 10_000.0),
            [(1.0 / 6.0, 30.0), (2.0 / 6.0, 0.0), (0.5, 60.0)]
        );
        assert!(throughput(&[], 10_000.0).is_empty());
    }

    #[test]
    fn repeated_checkpoint_lines_read_as_one_that_counts_every_sync() {
        let entry = |at_ms: u64, kind: &str, message: &str| LogEntry {
            at_ms,
            kind: kind.into(),
            message: message.into(),
        };
        let sync = "parameters averaged across clusters; checkpoint taken";
        let entries = [
            entry(1, "running", "started"),
            entry(2, "checkpoint", sync),
            entry(
                3,
                "checkpoint",
                "6 syncs averaged parameters across clusters; checkpoint taken",
            ),
            entry(
                4,
                "checkpoint",
                "1200 syncs averaged parameters across clusters; checkpoint taken",
            ),
            entry(5, "epoch", "epoch 1"),
            entry(6, "checkpoint", sync),
        ];
        let lines = group_log(&entries);
        let seen: Vec<(u64, &str, usize)> = lines
            .iter()
            .map(|l| (l.at_ms, l.kind.as_str(), l.entries))
            .collect();
        assert_eq!(
            seen,
            [
                (1, "running", 1),
                (4, "checkpoint", 3),
                (5, "epoch", 1),
                (6, "checkpoint", 1)
            ]
        );
        assert_eq!(
            lines[1].message,
            "1,207 syncs averaged parameters across clusters; checkpoint taken"
        );
        assert_eq!(lines[3].message, sync);
    }

    fn provider(id: u64, status: ProviderStatus, since: u64, gone: Option<u64>) -> ProviderInfo {
        ProviderInfo {
            id,
            name: format!("p{id}"),
            kind: ProviderKind::Native,
            device: "cpu".into(),
            memory_bytes: 0,
            gflops: 1.0,
            bandwidth_mbps: None,
            status,
            connected_since_ms: since,
            last_heartbeat_ms: since,
            gone_since_ms: gone,
            gone_reason: gone.map(|_| "heartbeat timeout".into()),
            work: None,
            duty_cycle: None,
            paused_reason: None,
        }
    }

    #[test]
    fn links_read_in_mbit_or_gbit() {
        assert_eq!(bandwidth(Some(94.4)), "94 Mbit/s");
        assert_eq!(bandwidth(Some(12_345.0)), "12.3 Gbit/s");
        assert_eq!(bandwidth(None), "measuring");
    }

    #[test]
    fn numbers_have_one_decimal() {
        assert_eq!(gib(16 * 1024 * 1024 * 1024), "16.0 GiB");
        assert_eq!(gib(1_610_612_736), "1.5 GiB");
        assert_eq!(gflops(123.456), "123.5");
        assert_eq!(gflops(f64::NAN), "–");
    }

    #[test]
    fn relative_times_read_naturally() {
        let now = 1_000_000_000.0;
        assert_eq!(relative(now, 1_000_000_000), "just now");
        assert_eq!(relative(now, 1_000_005_000), "just now");
        assert_eq!(relative(now, 999_988_000), "12 s ago");
        assert_eq!(relative(now, 999_880_000), "2 min ago");
        assert_eq!(relative(now, 1_000_000_000 - 7_200_000), "2 h ago");
        assert_eq!(relative(now, 0), "11 d ago");
    }

    #[test]
    fn durations_sizes_and_counts_read_naturally() {
        assert_eq!(duration(999), "0 s");
        assert_eq!(duration(65_000), "1 min 05 s");
        assert_eq!(duration(3_725_000), "1 h 02 min");
        assert_eq!(duration(90_000_000), "1 d 01 h");
        assert_eq!(count(0), "0");
        assert_eq!(count(999), "999");
        assert_eq!(count(206_954), "206,954");
        assert_eq!(count(1_234_567), "1,234,567");
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(3 << 20), "3.0 MiB");
        assert_eq!(seconds(0.0123), "12.3 ms");
        assert_eq!(seconds(2.5), "2.50 s");
        assert_eq!(metric(Some(0.123456), 4), "0.1235");
        assert_eq!(metric(None, 4), "–");
        assert_eq!(metric(Some(f64::NAN), 2), "–");
    }

    #[test]
    fn uptime_stops_when_a_provider_is_gone() {
        let connected = provider(1, ProviderStatus::Connected, 1_000, None);
        assert_eq!(uptime(&connected, 66_000.0), "1 min 05 s");
        let gone = provider(2, ProviderStatus::Gone, 1_000, Some(11_000));
        assert_eq!(uptime(&gone, 1e12), "10 s");
    }

    #[test]
    fn header_counts_connected() {
        assert_eq!(connected_count(0), "0 connected providers");
        assert_eq!(connected_count(1), "1 connected provider");
        assert_eq!(connected_count(3), "3 connected providers");
    }

    #[test]
    fn connected_rows_come_before_gone_rows() {
        let mut list = vec![
            provider(1, ProviderStatus::Gone, 10, Some(100)),
            provider(2, ProviderStatus::Connected, 50, None),
            provider(3, ProviderStatus::Gone, 10, Some(200)),
            provider(4, ProviderStatus::Connected, 20, None),
        ];
        sort_for_display(&mut list);
        let ids: Vec<u64> = list.iter().map(|p| p.id).collect();
        assert_eq!(ids, [4, 2, 3, 1]);
    }

    #[test]
    fn gone_status_names_the_reason() {
        let p = provider(1, ProviderStatus::Gone, 0, Some(0));
        assert_eq!(
            gone_detail(&p, 3_000.0).as_deref(),
            Some("heartbeat timeout, 3 s ago")
        );
        let p = provider(2, ProviderStatus::Connected, 0, None);
        assert_eq!(gone_detail(&p, 3_000.0), None);
    }

    #[test]
    fn donate_states_match_the_dom_contract() {
        assert_eq!(donate_state(None), "idle");
        let reason = "no adapter".to_string();
        let s = DonateStatus::NoWebGpu {
            reason: reason.clone(),
        };
        assert_eq!(donate_state(Some(&s)), "no-webgpu");
        assert_eq!(donate_text(Some(&s)).1, Some(reason));
        let s = DonateStatus::Connected {
            provider_id: 7,
            adapter: "SwiftShader".into(),
            gflops: 12.34,
        };
        assert_eq!(donate_state(Some(&s)), "connected");
        let (headline, detail) = donate_text(Some(&s));
        assert!(headline.contains("#7"));
        assert_eq!(detail.as_deref(), Some("SwiftShader, 12.3 GFLOP/s"));
        let s = DonateStatus::Training {
            provider_id: 7,
            adapter: "SwiftShader".into(),
            gflops: 12.34,
            job_id: 3,
            stage: 1,
            stages: 3,
            micro_batches: 40,
            public_name: None,
        };
        assert_eq!(donate_state(Some(&s)), "training");
        let (headline, _) = donate_text(Some(&s));
        assert!(
            headline.contains("stage 2 of 3 of job #3") && headline.contains("40 micro-batches"),
            "{headline}"
        );
    }

    #[test]
    fn a_jobs_public_name_shows_and_a_private_job_says_only_that() {
        assert_eq!(
            donate_job(Some("Handwritten digits for the Lab")),
            "This tab is training \u{201c}Handwritten digits for the Lab\u{201d}."
        );
        let private = donate_job(None);
        assert!(private.contains("a private job"), "{private}");
    }

    #[test]
    fn a_capped_provider_shows_its_cap_and_a_paused_one_its_reason() {
        assert_eq!(gpu_cap(Some(0.5)).as_deref(), Some("GPU cap 50%"));
        assert_eq!(gpu_cap(Some(0.1)).as_deref(), Some("GPU cap 10%"));
        assert_eq!(gpu_cap(Some(1.0)), None);
        assert_eq!(gpu_cap(None), None);
        let mut p = provider(1, ProviderStatus::Gone, 0, Some(1_000));
        assert_eq!(status_word(&p), "gone");
        p.gone_reason = Some("closed: paused by the donor: the tab is hidden".into());
        p.paused_reason = Some("the tab is hidden".into());
        assert_eq!(status_word(&p), "paused");
        assert_eq!(
            gone_detail(&p, 4_000.0).as_deref(),
            Some("the tab is hidden, 3 s ago")
        );
        let p = provider(2, ProviderStatus::Connected, 0, None);
        assert_eq!(status_word(&p), "connected");
    }
}
