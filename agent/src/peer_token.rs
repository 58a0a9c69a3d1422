//! The shared secret the agents of one fabric present to each other's peer API. That API hands
//! out the data-plane descriptor, region keys included, so without a token anyone who reaches
//! the peer port could read and write every worker's memory.

use std::fmt;
use std::str::FromStr;

use subtle::ConstantTimeEq;
use tonic::metadata::{AsciiMetadataValue, MetadataMap};
use tonic::{Request, Status};

use crate::incoming;

/// Shortest token accepted: 16 characters of printable ASCII.
pub const MIN_LEN: usize = 16;
const HEADER: &str = "authorization";
const SCHEME: &str = "Bearer ";

#[derive(Clone)]
pub struct PeerToken {
    /// `Bearer <token>`, checked and encoded once.
    header: AsciiMetadataValue,
}

/// Never printed: a token in a log line is a token anyone with the logs can use.
impl fmt::Debug for PeerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PeerToken(<redacted>)")
    }
}

impl FromStr for PeerToken {
    type Err = String;

    fn from_str(token: &str) -> Result<Self, String> {
        if token.len() < MIN_LEN {
            return Err(format!(
                "a peer token needs at least {MIN_LEN} characters, this one has {}",
                token.len()
            ));
        }
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err("a peer token is printable ASCII without spaces".into());
        }
        let header = format!("{SCHEME}{token}")
            .parse()
            .map_err(|e| format!("a peer token must fit a gRPC header: {e}"))?;
        Ok(PeerToken { header })
    }
}

impl PeerToken {
    /// Presents the token on an outgoing peer API call.
    pub fn attach<T>(&self, request: &mut Request<T>) {
        request.metadata_mut().insert(HEADER, self.header.clone());
    }

    /// A tonic interceptor admitting only calls that present `token` (all calls when None). It
    /// runs on the request's headers, before its body is read or decoded. The connection of a
    /// call it admits, or of any call over mTLS, is marked authenticated
    /// ([`crate::incoming::authenticated`]): from then on the peer port never sheds it.
    pub fn interceptor(
        token: Option<PeerToken>,
    ) -> impl FnMut(Request<()>) -> Result<Request<()>, Status> + Clone {
        move |request: Request<()>| {
            // The TLS handshake checked the client's certificate against the fabric's CA: the
            // connection is a fabric agent's even when this call's token is wrong.
            if incoming::client_certificate(request.extensions()) {
                incoming::authenticated(request.extensions());
            }
            if let Some(token) = &token {
                token.admit(request.metadata())?;
            }
            incoming::authenticated(request.extensions());
            Ok(request)
        }
    }

    /// Admits a call that presents this token, in time independent of where a wrong one
    /// differs.
    pub fn admit(&self, metadata: &MetadataMap) -> Result<(), Status> {
        let Some(presented) = metadata.get(HEADER) else {
            return Err(Status::unauthenticated(
                "this agent's peer API needs the fabric's peer token (authorization: Bearer …); \
                 the call presented none",
            ));
        };
        if bool::from(presented.as_bytes().ct_eq(self.header.as_bytes())) {
            Ok(())
        } else {
            Err(Status::unauthenticated(
                "the call presented a peer token that is not this fabric's",
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_or_unprintable_tokens_are_refused() {
        let e = "short".parse::<PeerToken>().unwrap_err();
        assert!(e.contains("16") && e.contains('5'), "{e}");
        let e = "sixteen chars with spaces"
            .parse::<PeerToken>()
            .unwrap_err();
        assert!(e.contains("printable"), "{e}");
        assert!("naïve-but-long-enough".parse::<PeerToken>().is_err());
        assert!("0123456789abcdef".parse::<PeerToken>().is_ok());
    }

    #[test]
    fn debug_output_hides_the_token() {
        let t: PeerToken = "s3cret-s3cret-s3cret".parse().unwrap();
        assert!(!format!("{t:?}").contains("s3cret"));
    }

    #[test]
    fn only_the_same_token_is_admitted() {
        let ours: PeerToken = "0123456789abcdef-ours".parse().unwrap();
        let theirs: PeerToken = "0123456789abcdef-other".parse().unwrap();
        let mut request = Request::new(());
        ours.attach(&mut request);
        ours.admit(request.metadata()).unwrap();
        let err = theirs.admit(request.metadata()).unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unauthenticated);
        assert!(
            err.message().contains("not this fabric's"),
            "{}",
            err.message()
        );
        let err = ours.admit(Request::new(()).metadata()).unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unauthenticated);
        assert!(
            err.message().contains("presented none"),
            "{}",
            err.message()
        );
    }
}
