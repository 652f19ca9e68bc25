//! Byte sizes written as `4096`, `512K`, `64M`, `1G`, `2GiB`.

/// A byte size that is not a number with an optional K/M/G/T suffix, or that overflows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad size {text:?}: expected e.g. 512K, 64M, 1G")]
pub struct ParseSizeError {
    /// The size as given.
    pub text: String,
}

/// Parses `64M`-style sizes: decimal digits, then an optional suffix `B`, `K`/`KB`/`KiB`,
/// `M`/`MB`/`MiB`, `G`/`GB`/`GiB` or `T`/`TB`/`TiB` (any case; all binary multiples).
/// Surrounding white space is ignored. Bounded: at most 32 characters.
pub fn parse_size(text: &str) -> Result<u64, ParseSizeError> {
    let bad = || ParseSizeError { text: text.to_string() };
    let t = text.trim();
    if t.is_empty() || t.len() > 32 {
        return Err(bad());
    }
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, suffix) = t.split_at(digits_end);
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(bad()),
    };
    n.checked_mul(1u64 << shift).ok_or_else(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        for (text, want) in [
            ("0", 0),
            ("8", 8),
            ("4096", 4096),
            ("4K", 4 << 10),
            ("512K", 512 << 10),
            ("64K", 64 << 10),
            ("64M", 64 << 20),
            ("64m", 64 << 20),
            ("1G", 1 << 30),
            ("2GiB", 2 << 30),
            ("1T", 1 << 40),
            (" 8k ", 8 << 10),
        ] {
            assert_eq!(parse_size(text), Ok(want), "{text}");
        }
        for text in ["", "x", "M", "-1", "1.5G", "12X", "1GG", "99999999999999999999", "16777216T"]
        {
            assert_eq!(parse_size(text), Err(ParseSizeError { text: text.into() }), "{text}");
        }
    }
}
