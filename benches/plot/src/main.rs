//! `faden-bench-plot RESULTS.json OUT_DIR`: SVG plots (plotters) from `benches/compare.sh`.
//! `faden-bench-plot routing RESULTS.json OUT_DIR`: `routing.svg` and `routing.png` from
//! `benches/routing.sh` (see [`routing`]).
//!
//! Writes `OUT_DIR/http.svg` (requests per second at 1 and 64 connections and the proxies' CPU
//! time per request), `OUT_DIR/relay.svg` (the same for the `relay` section, when present:
//! the tunnel alone beside rathole), `OUT_DIR/ttft_cdf.svg` (SSE time to first token, one CDF per target) and
//! `OUT_DIR/latency_cdf.svg` (whole SSE stream latency, one CDF per target). The CDFs are drawn
//! from the load generator's sampled distribution (`cdf`: `[quantile, ms]` pairs) on a log axis.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use plotters::prelude::*;
use serde_json::Value;

mod routing;

const PALETTE: [RGBColor; 8] = [
    RGBColor(0x4e, 0x79, 0xa7),
    RGBColor(0xf2, 0x8e, 0x2b),
    RGBColor(0x59, 0xa1, 0x4f),
    RGBColor(0xe1, 0x57, 0x59),
    RGBColor(0x76, 0xb7, 0xb2),
    RGBColor(0xb0, 0x7a, 0xa1),
    RGBColor(0x9c, 0x75, 0x5f),
    RGBColor(0xed, 0xc9, 0x48),
];

pub(crate) type DrawResult = Result<(), Box<dyn std::error::Error>>;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [cmd, results, out] = args.as_slice()
        && cmd == "routing"
    {
        return routing::plot(Path::new(results), Path::new(out));
    }
    let [results, out] = args.as_slice() else {
        bail!(
            "usage: faden-bench-plot RESULTS.json OUT_DIR | faden-bench-plot routing RESULTS.json OUT_DIR"
        );
    };
    let text = std::fs::read_to_string(results).with_context(|| format!("reading {results}"))?;
    let doc: Value = serde_json::from_str(&text).with_context(|| format!("parsing {results}"))?;
    let out = PathBuf::from(out);
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let caption = subtitle(&doc);
    let mut written = vec![
        (
            "http.svg",
            throughput(&doc, "http", &out.join("http.svg"), &caption),
        ),
        (
            "ttft_cdf.svg",
            cdf(
                &doc,
                "ttft",
                "SSE time to first token, c=1",
                &out.join("ttft_cdf.svg"),
                &caption,
            ),
        ),
        (
            "latency_cdf.svg",
            cdf(
                &doc,
                "latency",
                "SSE whole-stream latency (16 tokens), c=1",
                &out.join("latency_cdf.svg"),
                &caption,
            ),
        ),
    ];
    if rows(&doc, "relay").next().is_some() {
        let path = out.join("relay.svg");
        written.push(("relay.svg", throughput(&doc, "relay", &path, &caption)));
    }
    for (name, result) in written {
        result.map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
        eprintln!("written: {}", out.join(name).display());
    }
    Ok(())
}

fn subtitle(doc: &Value) -> String {
    let meta = &doc["meta"];
    let s = |k: &str| meta[k].as_str().unwrap_or("").to_owned();
    format!(
        "benches/compare.sh {} commit {}, load {}",
        s("date"),
        s("commit"),
        s("load_start")
    )
}

fn rows<'a>(doc: &'a Value, section: &str) -> impl Iterator<Item = &'a Value> {
    doc[section].as_array().into_iter().flatten()
}

pub(crate) type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

/// A white SVG page with `caption` in a footer line; returns the page and the area above it.
pub(crate) fn canvas<'a>(
    path: &'a Path,
    size: (u32, u32),
    caption: &str,
) -> Result<(Area<'a>, Area<'a>), Box<dyn std::error::Error>> {
    let root = SVGBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE)?;
    let (body, foot) = root.split_vertically(size.1 - 20);
    foot.draw(&Text::new(
        caption.to_owned(),
        (10, 4),
        ("sans-serif", 11)
            .into_font()
            .color(&RGBColor(0x66, 0x66, 0x66)),
    ))?;
    Ok((root, body))
}

/// Three bar panels of `section`'s rows: req/s at c=64, req/s at c=1, CPU µs per request (both
/// concurrencies).
fn throughput(doc: &Value, section: &str, path: &Path, caption: &str) -> DrawResult {
    let mut targets: Vec<String> = Vec::new();
    for row in rows(doc, section) {
        if let Some(t) = row["target"].as_str()
            && !targets.iter().any(|x| x == t)
        {
            targets.push(t.to_owned());
        }
    }
    let value = |target: &str, conns: u64, key: &str| {
        rows(doc, section)
            .find(|r| r["target"] == target && r["connections"] == conns)
            .and_then(|r| r[key].as_f64())
    };
    let (root, body) = canvas(path, (760, 860), caption)?;
    let panels = body.split_evenly((3, 1));
    let series_rps64 = [("c=64", PALETTE[0], 64)];
    let series_rps1 = [("c=1", PALETTE[1], 1)];
    let series_cpu = [("c=1", PALETTE[1], 1), ("c=64", PALETTE[0], 64)];
    let proxies: Vec<String> = targets.iter().filter(|t| *t != "direct").cloned().collect();
    bars(
        &panels[0],
        &format!("{section}: requests per second, 64 connections"),
        &targets,
        &series_rps64,
        |t, c| value(t, c, "rps"),
    )?;
    bars(
        &panels[1],
        &format!("{section}: requests per second, 1 connection"),
        &targets,
        &series_rps1,
        |t, c| value(t, c, "rps"),
    )?;
    bars(
        &panels[2],
        &format!("{section}: proxy CPU time per request, µs (user + system)"),
        &proxies,
        &series_cpu,
        |t, c| value(t, c, "cpu_us_per_req"),
    )?;
    root.present()?;
    Ok(())
}

pub(crate) fn bars<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    targets: &[String],
    series: &[(&str, RGBColor, u64)],
    value: impl Fn(&str, u64) -> Option<f64>,
) -> Result<(), Box<dyn std::error::Error>>
where
    DB::ErrorType: 'static,
{
    let max = targets
        .iter()
        .flat_map(|t| series.iter().filter_map(|s| value(t, s.2)))
        .fold(0.0_f64, f64::max)
        .max(1.0)
        * 1.15;
    let n = targets.len().max(1);
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 15))
        .margin(8)
        .x_label_area_size(24)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..n as f64, 0.0..max)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n * 2 + 1)
        .x_label_formatter(&|x| {
            let centre = x - x.floor();
            if (centre - 0.5).abs() < 1e-6 {
                targets.get(x.floor() as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()?;
    let width = 0.8 / series.len() as f64;
    for (si, (label, color, conns)) in series.iter().enumerate() {
        let mut rects = Vec::new();
        let mut labels = Vec::new();
        for (ti, t) in targets.iter().enumerate() {
            if let Some(v) = value(t, *conns) {
                let x0 = ti as f64 + 0.1 + si as f64 * width;
                rects.push(Rectangle::new(
                    [(x0, 0.0), (x0 + width * 0.92, v)],
                    color.filled(),
                ));
                labels.push(Text::new(
                    format!("{v:.0}"),
                    (x0 + width * 0.15, v + max * 0.05),
                    ("sans-serif", 10),
                ));
            }
        }
        chart
            .draw_series(rects)?
            .label(*label)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled()));
        chart.draw_series(labels)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

/// One step CDF per target of `sse[].<key>.cdf` (milliseconds), x in µs on a log axis.
fn cdf(doc: &Value, key: &str, title: &str, path: &Path, caption: &str) -> DrawResult {
    let curves: Vec<(String, Vec<(f64, f64)>)> = rows(doc, "sse")
        .filter_map(|r| {
            let target = r["target"].as_str()?.to_owned();
            let points: Vec<(f64, f64)> = r[key]["cdf"]
                .as_array()?
                .iter()
                .filter_map(|p| Some((p[1].as_f64()? * 1000.0, p[0].as_f64()?)))
                .collect();
            (!points.is_empty()).then_some((target, points))
        })
        .collect();
    let (root, body) = canvas(path, (760, 480), caption)?;
    if curves.is_empty() {
        body.draw(&Text::new(
            format!("{title}: no data (the results carry no `{key}.cdf`)"),
            (20, 20),
            ("sans-serif", 14),
        ))?;
        root.present()?;
        return Ok(());
    }
    let all = curves.iter().flat_map(|(_, p)| p.iter().map(|(x, _)| *x));
    let lo = all.clone().fold(f64::INFINITY, f64::min).max(1.0);
    let hi = all.fold(1.0_f64, f64::max);
    let lo = 10f64.powf(lo.log10().floor());
    let hi = 10f64.powf(hi.log10().ceil()).max(lo * 10.0);
    let mut chart = ChartBuilder::on(&body)
        .caption(title, ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(48)
        .build_cartesian_2d((lo..hi).log_scale(), 0.0..1.0)?;
    chart
        .configure_mesh()
        .x_desc("microseconds (log scale)")
        .y_desc("fraction of requests")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.1}"))
        .draw()?;
    for (i, (target, points)) in curves.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        // Step function: the fraction reaches q at the q-quantile's value.
        let mut steps = Vec::with_capacity(points.len() * 2);
        let mut last_q = 0.0;
        for &(x, q) in points {
            let x = x.clamp(lo, hi);
            steps.push((x, last_q));
            steps.push((x, q));
            last_q = q;
        }
        let p50 = quantile(points, 0.5);
        let p99 = quantile(points, 0.99);
        chart
            .draw_series(LineSeries::new(steps, color.stroke_width(2)))?
            .label(format!("{target}: p50 {p50:.0} µs, p99 {p99:.0} µs"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 14, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

fn quantile(points: &[(f64, f64)], q: f64) -> f64 {
    points
        .iter()
        .find(|(_, pq)| (*pq - q).abs() < 1e-9)
        .map_or(f64::NAN, |(x, _)| *x)
}
