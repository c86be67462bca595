//! The SVG chart of the throughput and handoff figures.

use super::*;

/// One throughput bar.
pub(super) struct Bar {
    pub(super) name: String,
    pub(super) per_s: f64,
    pub(super) client_us: f64,
    pub(super) server_us: f64,
}

/// The two panels of `docs/bench/redis.svg`.
#[derive(Default)]
pub(super) struct Chart {
    /// Per concurrency: the contenders' bars.
    pub(super) throughput: Vec<(String, Vec<Bar>)>,
    /// (contender, ms per handoff).
    pub(super) handoff: Vec<(String, f64)>,
}

impl Chart {
    pub(super) fn svg(&self) -> String {
        const W: f64 = 900.0;
        const LABEL: f64 = 190.0;
        const BAR: f64 = 18.0;
        let plot = W - LABEL - 290.0;
        let colour = |name: &str| {
            if name.starts_with("dlock") && !name.contains("by hand") {
                "#2b6cb0"
            } else if name.starts_with("rslock") {
                "#c05621"
            } else {
                "#718096"
            }
        };
        let mut body = String::new();
        let mut y = 30.0;
        let title = |body: &mut String, y: &mut f64, text: &str| {
            let _ = writeln!(
                body,
                r#"<text x="10" y="{y}" font-size="15" font-weight="bold">{text}</text>"#
            );
            *y += 14.0;
        };
        title(
            &mut body,
            &mut y,
            "Uncontended acquire+release per second (higher is better); CPU µs per pair, client + server",
        );
        let max = self
            .throughput
            .iter()
            .flat_map(|(_, bars)| bars.iter().map(|b| b.per_s))
            .fold(1.0, f64::max);
        for (group, bars) in &self.throughput {
            let _ = writeln!(
                body,
                r#"<text x="10" y="{}" font-size="12" font-style="italic">{group}</text>"#,
                y + 12.0
            );
            y += 18.0;
            for bar in bars {
                let width = plot * bar.per_s / max;
                let _ = writeln!(
                    body,
                    r#"<text x="{}" y="{}" font-size="12" text-anchor="end">{}</text><rect x="{LABEL}" y="{y}" width="{width:.1}" height="{BAR}" fill="{}"/><text x="{:.1}" y="{}" font-size="12">{:.0}/s · CPU {:.1} + {:.1} µs</text>"#,
                    LABEL - 6.0,
                    y + 13.0,
                    bar.name,
                    colour(&bar.name),
                    LABEL + width + 4.0,
                    y + 13.0,
                    bar.per_s,
                    bar.client_us,
                    bar.server_us
                );
                y += BAR + 4.0;
            }
            y += 8.0;
        }
        y += 20.0;
        title(
            &mut body,
            &mut y,
            "Handoff on one hot key, ms per handoff (log scale, lower is better)",
        );
        // Log scale from 0.01 ms to 1000 ms.
        let scale = |ms: f64| plot * ((ms.max(0.01)).log10() + 2.0) / 5.0;
        for (name, ms) in &self.handoff {
            let width = scale(*ms);
            let _ = writeln!(
                body,
                r#"<text x="{}" y="{}" font-size="12" text-anchor="end">{name}</text><rect x="{LABEL}" y="{y}" width="{width:.1}" height="{BAR}" fill="{}"/><text x="{:.1}" y="{}" font-size="12">{ms:.2} ms</text>"#,
                LABEL - 6.0,
                y + 13.0,
                colour(name),
                LABEL + width + 4.0,
                y + 13.0
            );
            y += BAR + 4.0;
        }
        for (i, tick) in ["0.01", "0.1", "1", "10", "100", "1000"].iter().enumerate() {
            let x = LABEL + plot * i as f64 / 5.0;
            let _ = writeln!(
                body,
                r##"<line x1="{x:.1}" y1="{}" x2="{x:.1}" y2="{}" stroke="#a0aec0" stroke-dasharray="2,2"/><text x="{x:.1}" y="{}" font-size="11" text-anchor="middle">{tick}</text>"##,
                y - (BAR + 4.0) * self.handoff.len() as f64,
                y,
                y + 14.0
            );
        }
        y += 30.0;
        format!(
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{y}" font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>
{body}</svg>
"#
        )
    }
}
