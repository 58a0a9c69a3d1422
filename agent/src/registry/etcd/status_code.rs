//! How etcd's answers map to the agent's errors: "did not answer" (retry) against "said no".

use std::time::Duration;

use crate::error::Error;

// gRPC status codes (tonic's `Code` as i32).
const CANCELLED: i32 = 1;
const UNKNOWN: i32 = 2;
const INVALID_ARGUMENT: i32 = 3;
const DEADLINE_EXCEEDED: i32 = 4;
const ABORTED: i32 = 10;
const OUT_OF_RANGE: i32 = 11;
const UNAVAILABLE: i32 = 14;
const UNAUTHENTICATED: i32 = 16;

/// Sorts an etcd client error into "etcd did not answer" (worth retrying) and "etcd said no".
pub(super) fn classify(op: &str, endpoints: &str, e: etcd_client::Error) -> Error {
    use etcd_client::Error as E;
    let op = op.to_string();
    let endpoints = endpoints.to_string();
    match e {
        E::GRpcStatus(status) => {
            let code = i32::from(status.code());
            let reason = format!("{} ({:?})", status.message(), status.code());
            match code {
                CANCELLED | UNKNOWN | DEADLINE_EXCEEDED | ABORTED | UNAVAILABLE => {
                    Error::RegistryUnavailable {
                        op,
                        endpoints,
                        reason,
                    }
                }
                // A read at a revision compaction dropped ("mvcc: required revision has been
                // compacted"): typed, so a reader knows to start over at the current revision.
                OUT_OF_RANGE if status.message().contains("compacted") => {
                    Error::RegistryCompacted {
                        op,
                        endpoints,
                        reason,
                    }
                }
                UNAUTHENTICATED => Error::RegistryAuth {
                    user: String::new(),
                    endpoints,
                    reason,
                },
                INVALID_ARGUMENT if status.message().contains("authentication failed") => {
                    Error::RegistryAuth {
                        user: String::new(),
                        endpoints,
                        reason,
                    }
                }
                _ => Error::Registry {
                    op,
                    endpoints,
                    reason,
                },
            }
        }
        E::TransportError(_) | E::IoError(_) | E::LeaseKeepAliveError(_) | E::WatchError(_) => {
            Error::RegistryUnavailable {
                op,
                endpoints,
                reason: e.to_string(),
            }
        }
        other => Error::Registry {
            op,
            endpoints,
            reason: other.to_string(),
        },
    }
}

pub(super) fn is_lease_not_found(e: &Error) -> bool {
    matches!(e, Error::Registry { reason, .. } if reason.contains("lease not found"))
}

pub(super) fn timed_out(op: &str, endpoints: &str, after: Duration) -> Error {
    Error::RegistryUnavailable {
        op: op.into(),
        endpoints: endpoints.into(),
        reason: format!("no answer within {after:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: tonic::Code, message: &str) -> etcd_client::Error {
        etcd_client::Error::GRpcStatus(tonic::Status::new(code, message))
    }

    #[test]
    fn a_read_of_compacted_history_is_its_own_kind() {
        let e = classify(
            "read fabric at revision 7",
            "http://e:2379",
            status(
                tonic::Code::OutOfRange,
                "etcdserver: mvcc: required revision has been compacted",
            ),
        );
        assert!(matches!(e, Error::RegistryCompacted { .. }), "{e}");
        assert_eq!(e.label(), "registry_compacted");
        // Any other out-of-range answer is etcd saying no.
        let e = classify(
            "read",
            "http://e:2379",
            status(tonic::Code::OutOfRange, "something else"),
        );
        assert!(matches!(e, Error::Registry { .. }), "{e}");
        // A member without a leader (asked to require one) did not answer: retry elsewhere.
        let e = classify(
            "watch",
            "http://e:2379",
            status(tonic::Code::Unavailable, "etcdserver: no leader"),
        );
        assert!(matches!(e, Error::RegistryUnavailable { .. }), "{e}");
    }
}
