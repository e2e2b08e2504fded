//! Shared plotting setup (plotters with an embedded font: no system fonts needed).

use anyhow::{anyhow, Result};
use plotters::style::FontStyle;

/// Register the embedded DejaVu Sans as plotters' `sans-serif` font.
pub fn register_font() -> Result<()> {
    plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| anyhow!("cannot load the embedded DejaVu Sans font"))
}
