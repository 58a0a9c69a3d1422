//! What this backend puts in NIXL's metadata, which travels between NIXL agents by whatever
//! side channel the engine uses (vLLM: unauthenticated ZMQ), so it carries names, never a key:
//! a peer reaches the memory only through an agent of the same fabric, which proves its
//! membership to the memory's agent (peer token, mTLS) — see `Registration::fabric_access`.

use serde::{Deserialize, Serialize};

use crate::moved::MAX_PIECES;
use crate::status::{Error, Result};

/// The format's version; a peer speaking another is refused by name.
const VERSION: u32 = 1;
/// Longest document accepted from a peer.
const MAX_DOCUMENT: usize = 1024;
/// Longest segment name (the agent's limit).
const MAX_SEGMENT: usize = 253;

/// `getConnInfo`: where to send this NIXL agent notifications.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnInfo {
    pub kvfabric: u32,
    pub inbox: String,
}

/// `getPublicData` of a registered range: its segment, and the pieces it is made of, in order
/// (see `moved.rs`): `len` bytes at `offset` of the segment's region `region`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PublicData {
    pub kvfabric: u32,
    pub segment: String,
    pub pieces: Vec<Span>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Span {
    pub len: u64,
    pub region: u32,
    pub offset: u64,
}

impl ConnInfo {
    pub fn new(inbox: &str) -> ConnInfo {
        ConnInfo {
            kvfabric: VERSION,
            inbox: inbox.into(),
        }
    }
    pub fn parse(bytes: &[u8]) -> Result<ConnInfo> {
        let c: ConnInfo = parse("connection info", bytes)?;
        check(c.kvfabric, "connection info", &c.inbox)?;
        Ok(c)
    }
}

impl PublicData {
    pub fn new(segment: &str, pieces: Vec<Span>) -> PublicData {
        PublicData {
            kvfabric: VERSION,
            segment: segment.into(),
            pieces,
        }
    }
    /// A peer's public data for a registered range of `len` bytes: its pieces must cover it
    /// exactly, each within the limits of a segment.
    pub fn parse(bytes: &[u8], len: u64) -> Result<PublicData> {
        let p: PublicData = parse("public data", bytes)?;
        check(p.kvfabric, "public data", &p.segment)?;
        let total = p.pieces.iter().try_fold(0u64, |sum, s| {
            (s.len > 0 && (s.region as usize) < MAX_PIECES && s.offset.checked_add(s.len).is_some())
                .then(|| sum.checked_add(s.len))
                .flatten()
        });
        if p.pieces.is_empty() || p.pieces.len() > MAX_PIECES || total != Some(len) {
            return Err(Error::Invalid {
                field: "public data",
                reason: format!(
                    "{} pieces (1..={MAX_PIECES}, each of 1 byte or more in a region below \
                     {MAX_PIECES}) that do not add up to the registered {len} bytes",
                    p.pieces.len()
                ),
            });
        }
        Ok(p)
    }
}

pub fn to_string<T: Serialize>(doc: &T) -> String {
    // A struct of strings and numbers always serializes.
    serde_json::to_string(doc).unwrap_or_default()
}

fn parse<'a, T: Deserialize<'a>>(field: &'static str, bytes: &'a [u8]) -> Result<T> {
    if bytes.len() > MAX_DOCUMENT {
        return Err(Error::Invalid {
            field,
            reason: format!("{} bytes, more than {MAX_DOCUMENT}", bytes.len()),
        });
    }
    serde_json::from_slice(bytes).map_err(|e| Error::Invalid {
        field,
        reason: format!("not a KVFABRIC document: {e}"),
    })
}

fn check(version: u32, field: &'static str, segment: &str) -> Result<()> {
    if version != VERSION {
        return Err(Error::Invalid {
            field,
            reason: format!("format {version}; this plugin reads {VERSION}"),
        });
    }
    let ok = !segment.is_empty()
        && segment.len() <= MAX_SEGMENT
        && segment
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'));
    if !ok {
        return Err(Error::Invalid {
            field,
            reason: "the segment is not 1..=253 characters of [A-Za-z0-9-_.:]".into(),
        });
    }
    Ok(())
}

/// The segment-name prefix of NIXL agent `agent`: its name as the agent's segment names
/// allow, and a hash of the exact name (so "A" and "a" differ).
pub fn segment_prefix(agent: &str) -> String {
    let clean: String = agent
        .chars()
        .take(160)
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_') {
                c
            } else {
                '-'
            }
        })
        .collect();
    // FNV-1a: a stable, dependency-free 64-bit hash; collisions only rename, never grant.
    let hash = agent.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("nixl.{clean}.{hash:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_round_trip_and_carry_no_key() {
        let c = ConnInfo::new("nixl.a.0123.inbox");
        assert_eq!(ConnInfo::parse(to_string(&c).as_bytes()).unwrap(), c);
        let span = |len, region, offset| Span {
            len,
            region,
            offset,
        };
        let p = PublicData::new("nixl.a.0123.7", vec![span(100, 0, 4000), span(28, 1, 0)]);
        let text = to_string(&p);
        assert_eq!(PublicData::parse(text.as_bytes(), 128).unwrap(), p);
        let e = PublicData::parse(text.as_bytes(), 129).unwrap_err();
        assert!(e.to_string().contains("add up"), "{e}");
        assert!(!text.contains("key"), "{text}");
    }

    #[test]
    fn a_peer_s_bad_document_is_refused_naming_what() {
        let one = r#"[{"len":8,"region":0,"offset":0}]"#;
        let bad = [
            String::new(),
            format!(r#"{{"kvfabric":2,"segment":"s","pieces":{one}}}"#),
            format!(r#"{{"kvfabric":1,"segment":"a b","pieces":{one}}}"#),
            format!(r#"{{"kvfabric":1,"segment":"","pieces":{one}}}"#),
            format!(r#"{{"kvfabric":1,"segment":"s","pieces":{one},"key":7}}"#),
            r#"{"kvfabric":1,"segment":"s","pieces":[]}"#.into(),
            r#"{"kvfabric":1,"segment":"s","pieces":[{"len":8,"region":16,"offset":0}]}"#.into(),
            r#"{"kvfabric":1,"segment":"s","pieces":[{"len":0,"region":0,"offset":0},{"len":8,"region":0,"offset":0}]}"#.into(),
            r#"{"kvfabric":1,"segment":"s","pieces":[{"len":8,"region":0,"offset":18446744073709551615}]}"#.into(),
            r#"{"kvfabric":1,"segment":"s","pieces":[{"len":8,"region":0,"offset":-1}]}"#.into(),
        ];
        for doc in bad {
            let e = PublicData::parse(doc.as_bytes(), 8).unwrap_err();
            assert!(e.to_string().contains("public data"), "{e}");
        }
        let long = format!("{{\"kvfabric\":1,\"inbox\":\"{}\"}}", "a".repeat(2000));
        let e = ConnInfo::parse(long.as_bytes()).unwrap_err();
        assert!(e.to_string().contains("more than"), "{e}");
    }

    #[test]
    fn prefixes_are_segment_names_and_tell_names_apart() {
        let (a, b) = (segment_prefix("A"), segment_prefix("a"));
        assert_ne!(a, b);
        for p in [
            a,
            b,
            segment_prefix("ü ber/agent#1"),
            segment_prefix(&"x".repeat(400)),
        ] {
            assert!(check(VERSION, "t", &format!("{p}.inbox")).is_ok(), "{p}");
        }
    }
}
