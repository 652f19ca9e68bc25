//! The load average every result file and table carries (two cores are shared by everything).

/// `/proc/loadavg`'s first three fields (1, 5 and 15 minutes), space-separated; empty when
/// it cannot be read.
pub fn loadavg() -> String {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    text.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    #[test]
    fn three_numbers() {
        let l = super::loadavg();
        let fields: Vec<f64> = l.split(' ').map(|f| f.parse().unwrap()).collect();
        assert_eq!(fields.len(), 3, "{l:?}");
    }
}
