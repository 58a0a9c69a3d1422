//! How etcd's answers map to the agent's errors: "did not answer" (retry) against "said no".

use std::time::Duration;

use crate::error::Error;

// gRPC status codes (tonic's `Code` as i32).
const CANCELLED: i32 = 1;
const UNKNOWN: i32 = 2;
const INVALID_ARGUMENT: i32 = 3;
const DEADLINE_EXCEEDED: i32 = 4;
const ABORTED: i32 = 10;
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
