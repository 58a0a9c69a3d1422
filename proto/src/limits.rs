//! How large a message each API takes. A server refuses anything larger before decoding it, so a
//! caller cannot make an agent hold more than these per call.

/// Most block ops one submitted batch may carry by default (the agent's `--max-batch-ops`).
pub const DEFAULT_MAX_BATCH_OPS: usize = 65_536;

/// Bytes of one encoded block op in a `SubmitRequest`, at most: five fields with tags and
/// varints of up to 10 bytes, plus the repeated field's tag and length.
pub const MAX_ENCODED_OP_BYTES: usize = 2 + 5 * 11;

/// Most planes one block table may have (the engine's `MAX_PLANES`).
pub const MAX_TABLE_PLANES: usize = 4096;

/// Bytes of one encoded block-table plane, at most: two sides of three fields, the block bytes,
/// with tags, lengths and varints of up to 10 bytes. (A block-id pair takes at most 10 bytes of
/// packed varints, less than an op: a table's ids fit in the ops' allowance.)
pub const MAX_ENCODED_PLANE_BYTES: usize = 80;

/// Room in a local API request beside its ops: names, keys, options, registration specs.
pub const LOCAL_REQUEST_OVERHEAD_BYTES: usize = 64 << 10;

/// Largest `Submit` the local API accepts from an agent that takes `max_batch_ops` ops per
/// batch: every op at its worst encoding, or a block table of as many ids and its most planes,
/// plus the rest of the request (65 536 ops: 3.9 MiB).
pub fn max_submit_bytes(max_batch_ops: usize) -> usize {
    let planes = max_batch_ops.min(MAX_TABLE_PLANES);
    max_batch_ops
        .saturating_mul(MAX_ENCODED_OP_BYTES)
        .saturating_add(planes * MAX_ENCODED_PLANE_BYTES)
        .saturating_add(LOCAL_REQUEST_OVERHEAD_BYTES)
}

/// Most planes one hold may grant (as many as a block table may have).
pub const MAX_HOLD_PLANES: usize = MAX_TABLE_PLANES;

/// Most block ids one hold may grant.
pub const MAX_HOLD_BLOCK_IDS: usize = 1 << 20;

/// Longest a hold lives without being extended (ms): one hour.
pub const MAX_HOLD_TTL_MS: u64 = 3_600_000;

/// Bytes of one encoded hold plane, at most: four fields with tags and varints of up to 10
/// bytes, plus the repeated field's tag and length.
pub const MAX_ENCODED_HOLD_PLANE_BYTES: usize = 2 + 4 * 11;

/// Largest `CreateHold` the local API accepts: its most planes and block ids (packed varints
/// of up to 10 bytes) at their worst encoding, plus names and keys (10.2 MiB). The grant an
/// agent then hands to a reader's agent fits in [`MAX_PEER_RESPONSE_BYTES`].
pub const MAX_CREATE_HOLD_BYTES: usize = MAX_HOLD_PLANES * MAX_ENCODED_HOLD_PLANE_BYTES
    + MAX_HOLD_BLOCK_IDS * 10
    + LOCAL_REQUEST_OVERHEAD_BYTES;

/// Largest answer a worker accepts from its own agent (a status document of a large fabric).
pub const MAX_LOCAL_RESPONSE_BYTES: usize = 16 << 20;

/// Largest message the peer API accepts from an authenticated agent: a handshake or an RDMA
/// offer is a few KiB.
pub const MAX_PEER_REQUEST_BYTES: usize = 64 << 10;

/// Largest answer a peer API client accepts: a descriptor of many regions with their RDMA keys.
pub const MAX_PEER_RESPONSE_BYTES: usize = 16 << 20;

/// Longest segment or agent name (a DNS subdomain).
pub const MAX_NAME_LEN: usize = 253;

/// Longest notification message (NIXL's are a request id or two).
pub const MAX_NOTIFICATION_BYTES: usize = 16 << 10;

/// Most notifications queued for one segment, and the most bytes they take: a receiver that
/// does not take its messages stops its senders (RESOURCE_EXHAUSTED), not the agent.
pub const MAX_QUEUED_NOTIFICATIONS: usize = 65_536;
pub const MAX_QUEUED_NOTIFICATION_BYTES: usize = 64 << 20;

/// Longest a TakeNotifications call waits for a first message.
pub const MAX_NOTIFICATION_WAIT_MS: u32 = 10_000;

/// Longest prefix of an untrusted value echoed in an error message.
pub const MAX_ECHO_LEN: usize = 64;

/// `value` as an error message may quote it: at most [`MAX_ECHO_LEN`] characters, with a note of
/// how long it was when cut.
pub fn echo(value: &str) -> String {
    match value.char_indices().nth(MAX_ECHO_LEN) {
        None => value.to_owned(),
        Some((cut, _)) => format!("{}… ({} bytes)", &value[..cut], value.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "engine")]
    #[test]
    fn the_plane_limit_is_the_engines() {
        assert_eq!(MAX_TABLE_PLANES, kvfabric_engine::MAX_PLANES);
    }

    #[test]
    fn a_largest_grant_fits_a_peer_answer() {
        // The grant: the same planes (region ids as varints) and ids, and the regions' JSON.
        const { assert!(MAX_CREATE_HOLD_BYTES + (1 << 20) < MAX_PEER_RESPONSE_BYTES) };
    }

    #[test]
    fn echo_keeps_short_values_and_cuts_long_ones() {
        assert_eq!(echo("decode-0"), "decode-0");
        let long = "x".repeat(65_536);
        let e = echo(&long);
        assert!(e.len() < 100, "{e}");
        assert!(e.ends_with("(65536 bytes)"), "{e}");
        // Cut on a character boundary.
        let wide = "é".repeat(100);
        assert!(echo(&wide).starts_with(&"é".repeat(MAX_ECHO_LEN)));
    }
}
