//! The caller's trace context, carried to the agent as W3C `traceparent` gRPC metadata, so a
//! worker that exports traces sees the whole transfer under its own span.

/// `traceparent` of the current `tracing` span, when it belongs to an OpenTelemetry trace
/// (feature `otel`; without it, never).
#[cfg(not(feature = "otel"))]
pub fn current_traceparent() -> Option<String> {
    None
}

/// `traceparent` of the current `tracing` span, when it belongs to an OpenTelemetry trace.
#[cfg(feature = "otel")]
pub fn current_traceparent() -> Option<String> {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let cx = tracing::Span::current().context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| {
        format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        )
    })
}

/// Whether `value` is a W3C `traceparent` a caller may hand in (version 00, lowercase hex, not
/// all-zero ids).
pub fn is_traceparent(value: &str) -> bool {
    let parts: Vec<&str> = value.split('-').collect();
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    matches!(parts.as_slice(), [v, t, s, f]
        if *v == "00" && hex(t, 32) && hex(s, 16) && hex(f, 2)
            && t.bytes().any(|b| b != b'0') && s.bytes().any(|b| b != b'0'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_are_checked() {
        assert!(is_traceparent(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        ));
        assert!(!is_traceparent(
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01"
        ));
        assert!(!is_traceparent(
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"
        ));
        assert!(!is_traceparent("junk"));
    }

    #[test]
    fn no_span_means_no_traceparent() {
        assert_eq!(current_traceparent(), None);
    }
}
