//! Line charts drawn as SVG by the app. A series of any length is cut into
//! at most [`BUCKETS`] buckets along x, each drawn by its lowest and highest
//! point, so a hundred thousand steps draw as a few hundred segments that
//! still show every spike.
//!
//! DOM contract (end-to-end tests rely on it): `<svg id=… class="chart-svg"
//! data-points=N>` where N is the number of points in the series (before
//! downsampling).

use leptos::prelude::*;

/// Buckets a series is reduced to; each keeps two points at most.
pub const BUCKETS: usize = 400;

// The drawing's own units are about the pixels it gets in the page (a
// chart column is 20rem or more, the drawing 292 pixels or more inside
// it), so text of `TICK_FONT` units reads at about that many pixels: a
// 600-unit drawing showed 11-unit ticks at 7 pixels.
/// The drawing's width, in its own units.
pub const WIDTH: f64 = 320.0;
const HEIGHT: f64 = 124.0;
const LEFT: f64 = 46.0;
const RIGHT: f64 = 6.0;
const TOP: f64 = 8.0;
const BOTTOM: f64 = 20.0;
/// Tick and axis text size, in the drawing's units.
pub const TICK_FONT: f64 = 12.0;

/// At most `2 * buckets` points of `points` (sorted by x): per bucket of
/// consecutive points, the lowest and highest in their own order, plus the
/// very first and last point. Non-finite values are dropped.
pub fn downsample(points: &[(f64, f64)], buckets: usize) -> Vec<(f64, f64)> {
    let finite: Vec<(f64, f64)> = points
        .iter()
        .copied()
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect();
    let buckets = buckets.max(1);
    if finite.len() <= 2 * buckets {
        return finite;
    }
    let mut out = Vec::with_capacity(2 * buckets + 2);
    let size = finite.len().div_ceil(buckets);
    for chunk in finite.chunks(size) {
        let (mut lo, mut hi) = (0, 0);
        for (i, p) in chunk.iter().enumerate() {
            if p.1 < chunk[lo].1 {
                lo = i;
            }
            if p.1 > chunk[hi].1 {
                hi = i;
            }
        }
        let (a, b) = if lo <= hi { (lo, hi) } else { (hi, lo) };
        out.push(chunk[a]);
        if b != a {
            out.push(chunk[b]);
        }
    }
    if let (Some(first), Some(last)) = (finite.first(), finite.last()) {
        if out.first() != Some(first) {
            out.insert(0, *first);
        }
        if out.last() != Some(last) {
            out.push(*last);
        }
    }
    out
}

/// The x and y ranges a chart shows; a flat or single-point series gets a
/// range around its value so it draws as a line in the middle.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bounds {
    pub x: (f64, f64),
    pub y: (f64, f64),
}

pub fn bounds(points: &[(f64, f64)]) -> Option<Bounds> {
    let first = points.first()?;
    let mut b = Bounds {
        x: (first.0, first.0),
        y: (first.1, first.1),
    };
    for &(x, y) in points {
        b.x = (b.x.0.min(x), b.x.1.max(x));
        b.y = (b.y.0.min(y), b.y.1.max(y));
    }
    if b.x.0 == b.x.1 {
        b.x = (b.x.0 - 1.0, b.x.1 + 1.0);
    }
    if b.y.0 == b.y.1 {
        let pad = if b.y.0 == 0.0 { 1.0 } else { b.y.0.abs() * 0.1 };
        b.y = (b.y.0 - pad, b.y.1 + pad);
    }
    Some(b)
}

/// The SVG path of `points` in a `WIDTH` x `HEIGHT` view box.
pub fn path(points: &[(f64, f64)], b: Bounds) -> String {
    let sx = (WIDTH - LEFT - RIGHT) / (b.x.1 - b.x.0);
    let sy = (HEIGHT - TOP - BOTTOM) / (b.y.1 - b.y.0);
    let mut d = String::with_capacity(points.len() * 16);
    for (i, &(x, y)) in points.iter().enumerate() {
        let px = LEFT + (x - b.x.0) * sx;
        let py = HEIGHT - BOTTOM - (y - b.y.0) * sy;
        d.push_str(if i == 0 { "M" } else { " L" });
        d.push_str(&format!("{px:.1} {py:.1}"));
    }
    d
}

/// A short label for an axis value.
pub fn tick(value: f64) -> String {
    let a = value.abs();
    if a == 0.0 {
        "0".into()
    } else if a >= 10_000.0 {
        format!("{:.0}k", value / 1000.0)
    } else if a >= 100.0 {
        format!("{value:.0}")
    } else if a >= 1.0 {
        format!("{value:.2}")
    } else {
        format!("{value:.3}")
    }
}

/// A line chart of `points` (x ascending), redrawn when they change.
#[component]
pub fn LineChart(
    id: &'static str,
    title: &'static str,
    x_label: &'static str,
    #[prop(into)] points: Signal<Vec<(f64, f64)>>,
    /// Draws each point as a dot too (few points, e.g. one per epoch).
    #[prop(optional)]
    dots: bool,
) -> impl IntoView {
    let drawn = Memo::new(move |_| {
        points.with(|all| {
            let shown = downsample(all, BUCKETS);
            let b = bounds(&shown);
            (all.len(), shown, b)
        })
    });
    view! {
        <figure class="chart">
            <figcaption>{title}</figcaption>
            <svg
                id=id
                class="chart-svg"
                viewBox=format!("0 0 {WIDTH} {HEIGHT}")
                role="img"
                aria-label=title
                data-points=move || drawn.with(|d| d.0.to_string())
            >
                {move || {
                    drawn
                        .with(|(count, shown, b)| match b {
                            None => {
                                view! {
                                    <text x=WIDTH / 2.0 y=HEIGHT / 2.0 class="chart-empty" font-size=TICK_FONT text-anchor="middle">
                                        "No data yet"
                                    </text>
                                }
                                    .into_any()
                            }
                            Some(b) => {
                                let b = *b;
                                let d = path(shown, b);
                                let marks = if dots && *count <= 200 {
                                    let sx = (WIDTH - LEFT - RIGHT) / (b.x.1 - b.x.0);
                                    let sy = (HEIGHT - TOP - BOTTOM) / (b.y.1 - b.y.0);
                                    shown
                                        .iter()
                                        .map(|&(x, y)| {
                                            let cx = LEFT + (x - b.x.0) * sx;
                                            let cy = HEIGHT - BOTTOM - (y - b.y.0) * sy;
                                            view! { <circle cx=cx cy=cy r="3" class="chart-dot"></circle> }
                                        })
                                        .collect_view()
                                        .into_any()
                                } else {
                                    ().into_any()
                                };
                                view! {
                                    <line x1=LEFT y1=TOP x2=LEFT y2=HEIGHT - BOTTOM class="chart-axis"></line>
                                    <line
                                        x1=LEFT
                                        y1=HEIGHT - BOTTOM
                                        x2=WIDTH - RIGHT
                                        y2=HEIGHT - BOTTOM
                                        class="chart-axis"
                                    ></line>
                                    <text x=LEFT - 4.0 y=TOP + TICK_FONT * 0.75 text-anchor="end" class="chart-tick" font-size=TICK_FONT>
                                        {tick(b.y.1)}
                                    </text>
                                    <text x=LEFT - 4.0 y=HEIGHT - BOTTOM text-anchor="end" class="chart-tick" font-size=TICK_FONT>
                                        {tick(b.y.0)}
                                    </text>
                                    <text x=LEFT y=HEIGHT - 4.0 class="chart-tick" font-size=TICK_FONT>
                                        {tick(b.x.0)}
                                    </text>
                                    <text x=WIDTH - RIGHT y=HEIGHT - 4.0 text-anchor="end" class="chart-tick" font-size=TICK_FONT>
                                        {format!("{} {x_label}", tick(b.x.1))}
                                    </text>
                                    <path d=d class="chart-line"></path>
                                    {marks}
                                }
                                    .into_any()
                            }
                        })
                }}
            </svg>
        </figure>
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_series_are_drawn_as_they_are() {
        let points: Vec<(f64, f64)> = (0..10).map(|i| (i as f64, (i * i) as f64)).collect();
        assert_eq!(downsample(&points, 5), points);
    }

    #[test]
    fn long_series_keep_every_extreme_within_the_budget() {
        // A slow curve with one spike up and one down, far from bucket edges.
        let mut points: Vec<(f64, f64)> = (0..100_000)
            .map(|i| (i as f64, 2.0 - i as f64 / 100_000.0))
            .collect();
        points[31_337].1 = 50.0;
        points[77_777].1 = -5.0;
        let shown = downsample(&points, BUCKETS);
        assert!(shown.len() <= 2 * BUCKETS + 2, "{}", shown.len());
        assert!(shown.contains(&(31_337.0, 50.0)));
        assert!(shown.contains(&(77_777.0, -5.0)));
        assert_eq!(shown.first(), points.first());
        assert_eq!(shown.last(), points.last());
        assert!(shown.windows(2).all(|w| w[0].0 < w[1].0), "x stays ordered");
    }

    #[test]
    fn non_finite_points_are_dropped() {
        let points = [
            (0.0, 1.0),
            (1.0, f64::NAN),
            (2.0, f64::INFINITY),
            (3.0, 2.0),
        ];
        assert_eq!(downsample(&points, 10), [(0.0, 1.0), (3.0, 2.0)]);
    }

    #[test]
    fn the_path_spans_the_plot_area() {
        let points = [(0.0, 0.0), (10.0, 1.0)];
        let b = bounds(&points).unwrap();
        let want = format!(
            "M{:.1} {:.1} L{:.1} {:.1}",
            LEFT,
            HEIGHT - BOTTOM,
            WIDTH - RIGHT,
            TOP
        );
        assert_eq!(path(&points, b), want);
        // A single point still has a drawable range.
        let one = bounds(&[(3.0, 0.5)]).unwrap();
        assert!(one.x.0 < one.x.1 && one.y.0 < one.y.1);
        assert_eq!(bounds(&[]), None);
    }
}
