//! The Prometheus / OpenMetrics text exposition, read and written the same way by every kvmesh
//! crate: [`parse_exposition`] turns a `/metrics` page into [`Sample`]s (the router's scraper and
//! the bench's evidence both read engines with it), and [`FloatGauge`] is the one float gauge type
//! the servers export. No I/O: fetching the page is the caller's business.

use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::gauge::Gauge;

/// A gauge holding an `f64` (prometheus-client's default gauge is `i64`).
pub type FloatGauge = Gauge<f64, AtomicU64>;

/// One sample of a Prometheus text exposition.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

/// Parses the Prometheus / OpenMetrics text format (comments skipped; bad lines ignored).
pub fn parse_exposition(text: &str) -> Vec<Sample> {
    text.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (name_labels, rest) = match line.find('{') {
        Some(_) => {
            let close = line.rfind('}')?;
            (&line[..=close], line[close + 1..].trim())
        }
        None => {
            let sp = line.find(char::is_whitespace)?;
            (&line[..sp], line[sp..].trim())
        }
    };
    let value_str = rest.split_whitespace().next()?;
    let value = match value_str {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    let (name, labels) = match name_labels.find('{') {
        Some(open) => (
            &name_labels[..open],
            parse_labels(&name_labels[open + 1..name_labels.len() - 1]),
        ),
        None => (name_labels, Vec::new()),
    };
    Some(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

fn parse_labels(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = s;
    while let Some(eq) = rest.find('=') {
        let key = rest[..eq].trim().trim_start_matches(',').trim().to_owned();
        let after = &rest[eq + 1..];
        let Some(after) = after.strip_prefix('"') else {
            break;
        };
        let mut val = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, n)) = chars.next() {
                        val.push(match n {
                            'n' => '\n',
                            other => other,
                        });
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => val.push(c),
            }
        }
        out.push((key, val));
        rest = &after[end..];
    }
    out
}

impl Sample {
    /// The value of label `key` (exact key: `block_size` does not match `mamba_block_size`).
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_names_labels_and_values() {
        let s = parse_exposition(
            "# HELP a An a.\n# TYPE a counter\na{engine=\"0\",source=\"local_compute\"} 50\nb 0.25\n\
             c{le=\"+Inf\"} +Inf\nweird line without value\n",
        );
        assert_eq!(s.len(), 3);
        assert_eq!((s[0].name.as_str(), s[0].value), ("a", 50.0));
        assert_eq!(s[0].label("source"), Some("local_compute"));
        assert_eq!(s[0].label("sourc"), None);
        assert_eq!(
            (s[1].name.as_str(), s[1].labels.len(), s[1].value),
            ("b", 0, 0.25)
        );
        assert_eq!(s[2].value, f64::INFINITY);
    }

    #[test]
    fn quoted_label_values_keep_escapes_commas_and_spaces() {
        let e = parse_exposition(r#"a{x="q\"uo,te",y="2 3"} 3"#);
        assert_eq!(
            e[0].labels,
            vec![("x".into(), "q\"uo,te".into()), ("y".into(), "2 3".into())]
        );
        assert_eq!(e[0].value, 3.0);
    }
}
