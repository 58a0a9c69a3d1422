//! A name that parses to no leaf noun (transport, op): below the error type, which turns it
//! into `Error::InvalidConfig`. And how values a peer sent are cut before they are echoed.

/// `value` is no `field`; `expected` says what would be ("expected …").
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {field}: {value:?} ({expected})")]
pub struct ParseError {
    pub field: &'static str,
    pub value: String,
    pub expected: &'static str,
}

/// `s` cut to at most `max` bytes (on a character boundary), marked when cut: values a peer
/// sent are echoed in errors and logs no longer than this.
pub(crate) fn truncated(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}
