//! The plot of `benches/routing.sh`: one page, four panels, from its `results.json` (`table`:
//! one entry per router at the table's rate; `runs`: every run of the rate sweep).
//!
//! 1. the prefix-cache hit rate, as the client saw it and as the engines counted it;
//! 2. TTFT p50 / p90 / p99 at the table's rate;
//! 3. p90 TTFT against the offered rate, one line per router, and the SLO;
//! 4. the router's CPU time per request.
//!
//! Written as SVG (plotters), then rendered to PNG with resvg (system fonts; without any font
//! the PNG has no text but is still written).

use std::path::Path;

use anyhow::{Context as _, anyhow};
use plotters::prelude::*;
use serde_json::Value;

use crate::{DrawResult, PALETTE, bars, canvas};

pub(crate) fn plot(results: &Path, out: &Path) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(results)
        .with_context(|| format!("reading {}", results.display()))?;
    let doc: Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", results.display()))?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let svg = out.join("routing.svg");
    draw(&doc, &svg).map_err(|e| anyhow!("routing.svg: {e}"))?;
    eprintln!("written: {}", svg.display());
    let png = out.join("routing.png");
    to_png(&svg, &png)?;
    eprintln!("written: {}", png.display());
    Ok(())
}

fn caption(doc: &Value) -> String {
    let meta = &doc["meta"];
    let s = |k: &str| match &meta[k] {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        v => v.to_string(),
    };
    format!(
        "benches/routing.sh {} commit {}, {} engines, {} CPUs, load {} at start{}",
        s("date"),
        s("commit"),
        s("engines"),
        s("nproc"),
        s("load_start"),
        if meta["plain_engines"] == true {
            " (PLAIN ENGINES: no cache model)"
        } else {
            ""
        }
    )
}

fn draw(doc: &Value, path: &Path) -> DrawResult {
    let table: Vec<&Value> = doc["table"].as_array().into_iter().flatten().collect();
    let names: Vec<String> = table
        .iter()
        .filter_map(|t| t["row"].as_str().map(str::to_owned))
        .collect();
    let get = |row: &str, key: &str| {
        table
            .iter()
            .find(|t| t["row"] == row)
            .and_then(|t| t[key].as_f64())
    };
    let rate = doc["rate"].as_f64().unwrap_or(0.0);
    let slo = doc["slo_ms"].as_f64().unwrap_or(0.0);
    let (root, body) = canvas(path, (900, 1240), &caption(doc))?;
    let panels = body.split_evenly((4, 1));
    bars(
        &panels[0],
        &format!("prefix-cache hit rate at {rate} req/s, %"),
        &names,
        &[
            ("client (usage)", PALETTE[0], 0),
            ("engines (/metrics)", PALETTE[4], 1),
        ],
        |row, s| {
            let key = if s == 0 {
                "hit_rate"
            } else {
                "engine_hit_rate"
            };
            get(row, key).map(|v| 100.0 * v)
        },
    )?;
    bars(
        &panels[1],
        &format!("time to first token at {rate} req/s, ms"),
        &names,
        &[
            ("p50", PALETTE[2], 0),
            ("p90", PALETTE[1], 1),
            ("p99", PALETTE[3], 2),
        ],
        |row, s| {
            get(
                row,
                ["ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms"][s as usize],
            )
        },
    )?;
    sweep(doc, &panels[2], &names, slo)?;
    let routers: Vec<String> = names
        .iter()
        .filter(|n| get(n, "cpu_us_per_req").is_some())
        .cloned()
        .collect();
    bars(
        &panels[3],
        &format!("router CPU time per request at {rate} req/s, µs (user + system)"),
        &routers,
        &[("CPU", PALETTE[5], 0)],
        |row, _| get(row, "cpu_us_per_req"),
    )?;
    root.present()?;
    Ok(())
}

/// p90 TTFT against the offered rate, one line per row, log scale, and the SLO as a dashed line.
fn sweep(doc: &Value, area: &crate::Area<'_>, names: &[String], slo: f64) -> DrawResult {
    let runs: Vec<&Value> = doc["runs"].as_array().into_iter().flatten().collect();
    let point = |r: &Value| Some((r["rate"].as_f64()?, r["ttft_p90_ms"].as_f64()?));
    let curves: Vec<(&String, Vec<(f64, f64)>)> = names
        .iter()
        .map(|n| {
            let mut pts: Vec<(f64, f64)> = runs
                .iter()
                .filter(|r| r["row"] == n.as_str())
                .filter_map(|r| point(r))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            (n, pts)
        })
        .collect();
    let all = curves.iter().flat_map(|(_, p)| p.iter());
    let (x_max, y_lo, y_hi) = all.fold((1.0_f64, f64::INFINITY, slo.max(1.0)), |acc, p| {
        (acc.0.max(p.0), acc.1.min(p.1), acc.2.max(p.1))
    });
    let y_lo = if y_lo.is_finite() {
        10f64.powf(y_lo.min(slo).max(0.1).log10().floor())
    } else {
        1.0
    };
    let y_hi = 10f64.powf(y_hi.log10().ceil()).max(y_lo * 10.0);
    let mut chart = ChartBuilder::on(area)
        .caption(
            format!("p90 time to first token against the offered load (SLO {slo} ms dashed)"),
            ("sans-serif", 15),
        )
        .margin(8)
        .x_label_area_size(30)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..x_max * 1.05, (y_lo..y_hi).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("offered requests per second")
        .y_desc("ms (log)")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()?;
    if slo > 0.0 {
        chart.draw_series(DashedLineSeries::new(
            vec![(0.0, slo), (x_max * 1.05, slo)],
            6,
            4,
            BLACK.stroke_width(1),
        ))?;
    }
    for (i, (name, pts)) in curves.iter().enumerate() {
        if pts.is_empty() {
            continue;
        }
        let color = PALETTE[i % PALETTE.len()];
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
            .label(name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 14, y)], color.stroke_width(2))
            });
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

/// Renders an SVG file to PNG at its own size.
fn to_png(svg: &Path, png: &Path) -> anyhow::Result<()> {
    use resvg::{tiny_skia, usvg};
    let data = std::fs::read(svg).with_context(|| format!("reading {}", svg.display()))?;
    let mut options = usvg::Options::default();
    let fonts = options.fontdb_mut();
    fonts.load_system_fonts();
    // plotters asks for "sans-serif", which fontdb maps to Arial: use a sans face that is here.
    let family = ["DejaVu Sans", "Liberation Sans", "Noto Sans", "Arial"]
        .into_iter()
        .find(|f| {
            fonts
                .faces()
                .any(|face| face.families.iter().any(|(name, _)| name == f))
        })
        .or_else(|| {
            fonts
                .faces()
                .find_map(|face| face.families.first().map(|(name, _)| name.as_str()))
        })
        .map(str::to_owned);
    if let Some(family) = family {
        fonts.set_sans_serif_family(family);
    }
    let tree = usvg::Tree::from_data(&data, &options)
        .with_context(|| format!("parsing {}", svg.display()))?;
    let size = tree.size().to_int_size();
    let mut pixmap =
        tiny_skia::Pixmap::new(size.width(), size.height()).context("the SVG has no size")?;
    pixmap.fill(tiny_skia::Color::WHITE);
    resvg::render(&tree, tiny_skia::Transform::default(), &mut pixmap.as_mut());
    pixmap
        .save_png(png)
        .with_context(|| format!("writing {}", png.display()))
}
