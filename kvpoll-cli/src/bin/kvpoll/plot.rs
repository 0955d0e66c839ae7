//! `kvpoll bench --svg FILE`: latency distributions (CDFs) of kvpoll and its
//! baselines, one panel per comparison, so a reader can look rather than read.

use std::path::Path;

use plotters::prelude::*;

use crate::report::Curves;

/// Points of the CDF of `samples`, at most about 400 of them.
fn cdf_points(samples: &[u64]) -> Vec<(f64, f64)> {
    let mut v = samples.to_vec();
    v.sort_unstable();
    let n = v.len();
    let stride = (n / 400).max(1);
    let mut pts: Vec<(f64, f64)> = (0..n)
        .step_by(stride)
        .map(|i| ((v[i].max(1)) as f64, (i + 1) as f64 / n as f64))
        .collect();
    if let Some(&last) = v.last() {
        pts.push((last.max(1) as f64, 1.0));
    }
    pts
}

/// Draws every panel into the SVG file at `path`.
pub fn cdf(path: &Path, panels: &[Curves<'_>]) -> Result<(), String> {
    draw(path, panels).map_err(|e| format!("{}: {e}", path.display()))
}

fn draw(path: &Path, panels: &[Curves<'_>]) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::new(path, (560 * panels.len().max(1) as u32, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let areas = root.split_evenly((1, panels.len().max(1)));
    let colors = [RGBColor(214, 39, 40), RGBColor(31, 119, 180)];
    for (area, panel) in areas.iter().zip(panels) {
        let all = panel.series.iter().flat_map(|(_, s)| s.iter().copied());
        let lo = all.clone().min().unwrap_or(1).max(1) as f64;
        let hi = (all.max().unwrap_or(10) as f64).max(lo * 10.0);
        let mut chart = ChartBuilder::on(area)
            .caption(panel.title, ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d((lo * 0.8..hi * 1.2).log_scale(), 0f64..1.0f64)?;
        chart
            .configure_mesh()
            .x_desc(format!("latency ({}, log scale)", panel.unit))
            .y_desc("fraction of samples <= x")
            .draw()?;
        for (i, (name, samples)) in panel.series.iter().enumerate() {
            let color = colors[i % colors.len()];
            chart
                .draw_series(LineSeries::new(cdf_points(samples), color.stroke_width(2)))?
                .label(format!("{name} ({} samples)", samples.len()))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}
