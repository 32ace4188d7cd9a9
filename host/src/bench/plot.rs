//! `specula bench --plot FILE.svg`: the verify cost curve and each drafter's speedup against
//! the ideal one, drawn with `plotters`.
//!
//! Left: cost(k) / cost(1), the price of verifying k rows in one pass, against k. Right: the
//! ideal speedup k ÷ cost(k) of a pass whose k rows are all accepted, and each drafter's
//! measured speedup placed at the tokens it emitted per target pass (its points sit under
//! the curve by what drafting and rejected rows cost).

use std::path::Path;

use anyhow::Context;
use plotters::prelude::*;

use super::concurrency::ConcurrencyReport;
use super::BenchReport;

const WIDTH: u32 = 1100;
const HEIGHT: u32 = 460;
const PALETTE: [RGBColor; 6] = [
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
    RGBColor(140, 86, 75),
];
const CURVE: RGBColor = RGBColor(31, 119, 180);

/// Writes the two charts of `report` to `path` as SVG.
pub fn write_svg(report: &BenchReport, path: &Path) -> anyhow::Result<()> {
    draw(report, path).with_context(|| format!("cannot draw the plot {}", path.display()))
}

fn draw(report: &BenchReport, path: &Path) -> anyhow::Result<()> {
    anyhow::ensure!(!report.verify.is_empty(), "no verify costs were measured");
    let root = SVGBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(
        &format!(
            "{} ({}), {} threads: decode {:.1} t/s, {:.0}% of the memory roofline",
            report.model,
            report.architecture,
            report.threads,
            report.decode_tokens_per_second,
            100.0 * report.roofline_fraction
        ),
        ("sans-serif", 18),
    )?;
    let (left, right) = root.split_horizontally(WIDTH / 2);
    let k_max = report.verify.iter().map(|v| v.k).max().unwrap_or(1) as f64;

    // Verify cost against k.
    let ratio_max = report.verify.iter().map(|v| v.ratio).fold(1.0, f64::max);
    let mut cost = ChartBuilder::on(&left)
        .caption("verify cost of one pass of k rows", ("sans-serif", 16))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.5..k_max + 0.5, 0.0..ratio_max * 1.2)?;
    cost.configure_mesh()
        .x_desc("k (rows in the pass)")
        .y_desc("cost(k) / cost(1)")
        .draw()?;
    let points: Vec<(f64, f64)> = report
        .verify
        .iter()
        .map(|v| (f64::from(v.k), v.ratio))
        .collect();
    cost.draw_series(LineSeries::new(
        points.iter().copied(),
        CURVE.stroke_width(2),
    ))?
    .label("measured")
    .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], CURVE));
    cost.draw_series(points.iter().map(|&p| Circle::new(p, 3, CURVE.filled())))?;
    cost.draw_series(points.iter().map(|&(k, r)| {
        Text::new(
            format!("{r:.2}"),
            (k, r + ratio_max * 0.03),
            ("sans-serif", 11),
        )
    }))?;
    cost.configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()?;

    // Speedups: the ideal curve and each drafter.
    let ideal: Vec<(f64, f64)> = points.iter().map(|&(k, r)| (k, k / r)).collect();
    let tokens_per_pass = |passes_per_token: f64| {
        if passes_per_token > 0.0 {
            1.0 / passes_per_token
        } else {
            1.0
        }
    };
    let x_max = report
        .drafters
        .iter()
        .map(|d| tokens_per_pass(d.passes_per_token))
        .fold(k_max, f64::max);
    let y_max = ideal
        .iter()
        .map(|p| p.1)
        .chain(report.drafters.iter().map(|d| d.speedup))
        .fold(1.0, f64::max);
    let mut speed = ChartBuilder::on(&right)
        .caption("speedup over plain decoding", ("sans-serif", 16))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.5..x_max + 0.5, 0.0..y_max * 1.2)?;
    speed
        .configure_mesh()
        .x_desc("tokens per target pass (k for the ideal)")
        .y_desc("speedup")
        .draw()?;
    speed
        .draw_series(LineSeries::new(
            ideal.iter().copied(),
            CURVE.stroke_width(2),
        ))?
        .label("ideal: k / cost(k)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], CURVE));
    speed.draw_series(ideal.iter().map(|&p| Circle::new(p, 3, CURVE.filled())))?;
    for (i, d) in report.drafters.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let at = (tokens_per_pass(d.passes_per_token), d.speedup);
        speed
            .draw_series(std::iter::once(Circle::new(at, 6, color.filled())))?
            .label(format!(
                "{}: {:.2}x, {:.0}% accepted",
                d.drafter,
                d.speedup,
                100.0 * d.acceptance
            ))
            .legend(move |(x, y)| Circle::new((x + 9, y), 5, color.filled()));
        speed.draw_series(std::iter::once(Text::new(
            format!("{} {:.2}x", d.drafter, d.speedup),
            (at.0, at.1 + y_max * 0.04),
            ("sans-serif", 12),
        )))?;
    }
    speed
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()?;
    root.present()?;
    Ok(())
}

/// Writes the two charts of a `--concurrency` report to `path` as SVG: aggregate decode t/s
/// against the sequences decoding together (with N × one sequence, the ideal), and the cost of
/// one pass against its rows.
pub fn write_concurrency_svg(report: &ConcurrencyReport, path: &Path) -> anyhow::Result<()> {
    draw_concurrency(report, path)
        .with_context(|| format!("cannot draw the plot {}", path.display()))
}

fn draw_concurrency(report: &ConcurrencyReport, path: &Path) -> anyhow::Result<()> {
    anyhow::ensure!(
        !report.decode.is_empty() && !report.pass_cost.is_empty(),
        "nothing was measured"
    );
    let root = SVGBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(
        &format!(
            "{} ({}), {} threads: many sequences in one instance",
            report.model, report.architecture, report.threads
        ),
        ("sans-serif", 18),
    )?;
    let (left, right) = root.split_horizontally(WIDTH / 2);

    let one = report.decode[0].tokens_per_second / report.decode[0].sequences as f64;
    let measured: Vec<(f64, f64)> = report
        .decode
        .iter()
        .map(|d| (d.sequences as f64, d.tokens_per_second))
        .collect();
    let ideal: Vec<(f64, f64)> = measured.iter().map(|&(n, _)| (n, n * one)).collect();
    let n_max = measured.iter().map(|p| p.0).fold(1.0, f64::max);
    let y_max = ideal
        .iter()
        .chain(&measured)
        .map(|p| p.1)
        .fold(1.0, f64::max);
    let mut decode = ChartBuilder::on(&left)
        .caption("aggregate greedy decode", ("sans-serif", 16))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.5..n_max + 0.5, 0.0..y_max * 1.15)?;
    decode
        .configure_mesh()
        .x_desc("sequences decoding together")
        .y_desc("tokens per second")
        .draw()?;
    let gray = RGBColor(150, 150, 150);
    decode
        .draw_series(LineSeries::new(ideal.iter().copied(), gray.stroke_width(1)))?
        .label("N × one sequence")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], gray));
    decode
        .draw_series(LineSeries::new(
            measured.iter().copied(),
            CURVE.stroke_width(2),
        ))?
        .label("measured")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], CURVE));
    decode.draw_series(measured.iter().map(|&p| Circle::new(p, 3, CURVE.filled())))?;
    decode.draw_series(report.decode.iter().map(|d| {
        Text::new(
            format!("{:.1} ({:.2}x)", d.tokens_per_second, d.scaling),
            (d.sequences as f64, d.tokens_per_second + y_max * 0.03),
            ("sans-serif", 11),
        )
    }))?;
    decode
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()?;

    let points: Vec<(f64, f64)> = report
        .pass_cost
        .iter()
        .map(|c| (c.rows as f64, c.ratio))
        .collect();
    let r_max = points.iter().map(|p| p.0).fold(1.0, f64::max);
    let ratio_max = points.iter().map(|p| p.1).fold(1.0, f64::max);
    let mut cost = ChartBuilder::on(&right)
        .caption("cost of one pass of r rows", ("sans-serif", 16))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.5..r_max + 0.5, 0.0..ratio_max * 1.2)?;
    cost.configure_mesh()
        .x_desc("rows in the pass")
        .y_desc("cost(r) / cost(1)")
        .draw()?;
    cost.draw_series(LineSeries::new(
        points.iter().copied(),
        CURVE.stroke_width(2),
    ))?;
    cost.draw_series(points.iter().map(|&p| Circle::new(p, 3, CURVE.filled())))?;
    root.present()?;
    Ok(())
}
