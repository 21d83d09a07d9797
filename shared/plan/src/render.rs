//! The plan as a text table, one per cluster, for the CLI and logs.

use std::fmt::Write as _;

use crate::types::{BoundaryTensor, Plan};

/// Human-readable units.
fn bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

fn ms(s: f64) -> String {
    format!("{:.3}", s * 1e3)
}

fn names(ts: &[BoundaryTensor]) -> String {
    if ts.is_empty() {
        return "-".into();
    }
    ts.iter()
        .map(|t| t.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A table per cluster: one row per stage.
pub fn render(plan: &Plan) -> String {
    let mut out = String::new();
    let o = &plan.options;
    let _ = writeln!(
        out,
        "Plan: {} cluster(s), {} nodes, {} of parameters, micro-batch {}, {} in flight, optimizer copies {}; bottleneck {} ms/micro-batch",
        plan.clusters.len(),
        plan.node_count,
        bytes(plan.param_bytes),
        o.micro_batch,
        o.in_flight_micro_batches,
        o.optimizer_copies,
        ms(plan.bottleneck_s()),
    );
    let header = [
        "#",
        "role",
        "provider",
        "kind",
        "nodes",
        "params",
        "memory used/avail",
        "compute ms",
        "transfer ms",
        "total ms",
        "in",
        "out",
    ];
    for (ci, cl) in plan.clusters.iter().enumerate() {
        let _ = writeln!(
            out,
            "\nCluster {ci}: {} stage(s), bottleneck {} ms",
            cl.stages.len(),
            ms(cl.bottleneck_s)
        );
        let rows: Vec<Vec<String>> = cl
            .stages
            .iter()
            .enumerate()
            .map(|(si, s)| {
                let span = match s.nodes.as_slice() {
                    [one] => format!("{one} [{}]", s.first),
                    [first, .., last] => format!("{first}..{last} [{}..{}]", s.first, s.end - 1),
                    [] => "-".into(),
                };
                vec![
                    si.to_string(),
                    format!("{:?}", s.role),
                    s.provider.clone(),
                    format!("{:?}", s.provider_kind).to_lowercase(),
                    span,
                    s.params.len().to_string(),
                    format!(
                        "{} / {}",
                        bytes(s.memory_bytes),
                        bytes(s.provider_memory_bytes)
                    ),
                    ms(s.compute_s),
                    ms(s.transfer_s),
                    ms(s.time_s),
                    names(&s.inputs),
                    names(&s.outputs),
                ]
            })
            .collect();
        let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
        for r in &rows {
            for (w, cell) in widths.iter_mut().zip(r) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let line = |cells: Vec<&str>| {
            let mut l = String::from(" ");
            for (w, cell) in widths.iter().zip(cells) {
                let _ = write!(l, " {cell:<w$} |");
            }
            l.pop();
            l.trim_end().to_string()
        };
        let _ = writeln!(out, "{}", line(header.to_vec()));
        let _ = writeln!(
            out,
            "{}",
            line(
                widths
                    .iter()
                    .map(|&w| "-".repeat(w))
                    .collect::<Vec<_>>()
                    .iter()
                    .map(String::as_str)
                    .collect()
            )
        );
        for r in &rows {
            let _ = writeln!(out, "{}", line(r.iter().map(String::as_str).collect()));
        }
    }
    let _ = writeln!(
        out,
        "\nStandbys ({}): {}",
        plan.standbys.len(),
        if plan.standbys.is_empty() {
            "-".to_string()
        } else {
            plan.standbys.join(", ")
        }
    );
    out
}
