//! Byte counts as flags, environment variables and chart values write them: `1GiB`, `64KiB`,
//! `4096`, `2M` (binary units), and back for tables.

pub fn parse(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a byte count (e.g. 4096, 64KiB, 1GiB)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => return Err(format!("unknown unit {other:?} in {s:?}")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// `auto`, `kernel`, or a byte count as [`parse`] reads it: a tcp data connection's buffers
/// (`kvfabric_engine::TcpBuffer`), as the agent's and the bench's flags take them.
#[cfg(feature = "engine")]
pub fn parse_tcp_buffer(s: &str) -> Result<kvfabric_engine::TcpBuffer, String> {
    use kvfabric_engine::TcpBuffer;
    s.parse::<TcpBuffer>().or_else(|_| {
        let n = parse(s).map_err(|e| format!("{e}; or auto, or kernel"))?;
        u32::try_from(n)
            .map(TcpBuffer::Bytes)
            .map_err(|_| format!("{s:?} is too large for a socket buffer"))
    })
}

/// 32768 → "32 KiB"; exact powers read better in tables than raw numbers.
pub fn human(n: u64) -> String {
    const UNITS: [(&str, u64); 4] = [
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
        ("B", 1),
    ];
    for (unit, size) in UNITS {
        if n >= size && n.is_multiple_of(size) {
            return format!("{} {unit}", n / size);
        }
    }
    format!("{n} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units_and_refuses_nonsense() {
        assert_eq!(parse("4096"), Ok(4096));
        assert_eq!(parse("64KiB"), Ok(65536));
        assert_eq!(parse("1GiB"), Ok(1 << 30));
        assert_eq!(parse("2m"), Ok(2 << 20));
        assert!(parse("lots").is_err());
        assert!(parse("1ZiB").is_err());
        assert!(parse("99999999999999999999").is_err());
        assert_eq!(human(32768), "32 KiB");
        assert_eq!(human(1000), "1000 B");
    }

    #[cfg(feature = "engine")]
    #[test]
    fn tcp_buffers_are_words_or_sizes() {
        use kvfabric_engine::TcpBuffer;
        assert_eq!(parse_tcp_buffer("auto"), Ok(TcpBuffer::Auto));
        assert_eq!(parse_tcp_buffer("kernel"), Ok(TcpBuffer::Kernel));
        assert_eq!(parse_tcp_buffer("256KiB"), Ok(TcpBuffer::Bytes(256 << 10)));
        assert!(parse_tcp_buffer("4GiB").is_err());
        assert!(parse_tcp_buffer("big").is_err());
    }
}
