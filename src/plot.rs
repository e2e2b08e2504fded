//! Shared plotting setup (plotters with an embedded font: no system fonts needed).

use anyhow::{anyhow, Result};
use plotters::style::FontStyle;

/// Register the embedded DejaVu Sans as plotters' `sans-serif` font.
pub fn register_font() -> Result<()> {
    plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| anyhow!("cannot load the embedded DejaVu Sans font"))
}

/// One line of a [`line_chart`].
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub color: plotters::style::RGBColor,
    pub width: u32,
    pub points: Vec<(f64, f64)>,
}

/// A PNG line chart with `x` in `[0, max x]`, `y` in `[0, 1]` and a legend.
pub fn line_chart(
    path: &std::path::Path,
    caption: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[Series],
) -> Result<()> {
    use plotters::prelude::*;
    register_font()?;
    let xmax = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .fold(1.0, f64::max);
    let root = BitMapBackend::new(path, (900, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(48)
        .build_cartesian_2d(0f64..xmax, 0f64..1.0)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .draw()?;
    for s in series {
        let style = s.color.stroke_width(s.width);
        chart
            .draw_series(LineSeries::new(s.points.clone(), style))?
            .label(s.name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
