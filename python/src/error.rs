//! The binding's errors, and how each becomes the Python exception `kvfabric.errors` defines.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The agent answered a call with a gRPC error status.
    #[error("{call}: {} ({}): {message}", code_name(*.code), *.code as i32)]
    Agent {
        call: &'static str,
        code: tonic::Code,
        message: String,
    },

    /// The agent's sockets could not be reached (not running, wrong directory).
    #[error("agent at {path}: {reason}")]
    Unreachable { path: String, reason: String },

    /// A caller's argument: the field, the value (truncated) and why it was refused.
    #[error("invalid {field}: {value} ({reason})")]
    Invalid {
        field: String,
        value: String,
        reason: String,
    },

    /// What the Rust client reported (memory allocation, the fd socket).
    #[error(transparent)]
    Client(#[from] kvfabric_client::Error),
}

impl Error {
    pub fn invalid(
        field: impl Into<String>,
        value: impl ToString,
        reason: impl Into<String>,
    ) -> Self {
        let mut value = value.to_string();
        if value.len() > 64 {
            let cut = (0..=64)
                .rev()
                .find(|&i| value.is_char_boundary(i))
                .unwrap_or(0);
            value.truncate(cut);
            value.push('…');
        }
        Error::Invalid {
            field: field.into(),
            value,
            reason: reason.into(),
        }
    }

    /// A client error; the agent's own answers keep their code and message.
    pub fn from_client(call: &'static str, e: kvfabric_client::Error) -> Self {
        match e {
            kvfabric_client::Error::Rpc { code, message, .. } => Error::Agent {
                call,
                code,
                message,
            },
            kvfabric_client::Error::Connect { path, reason }
            | kvfabric_client::Error::FdSocket { path, reason } => {
                Error::Unreachable { path, reason }
            }
            other => Error::Client(other),
        }
    }

    pub fn agent(call: &'static str, status: tonic::Status) -> Self {
        Error::Agent {
            call,
            code: status.code(),
            message: status.message().to_string(),
        }
    }
}

/// The canonical gRPC name of a status code, as Python callers compare it.
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        Python::attach(|py| match raise(py, &e) {
            Ok(err) => err,
            // kvfabric.errors could not be imported: still say what failed.
            Err(import) => PyRuntimeError::new_err(format!("{e} (and kvfabric.errors: {import})")),
        })
    }
}

fn raise(py: Python<'_>, e: &Error) -> PyResult<PyErr> {
    let errors = py.import("kvfabric.errors")?;
    let text = e.to_string();
    let exc = match e {
        Error::Agent {
            call,
            code,
            message,
        } => errors.getattr("AgentError")?.call1((
            text,
            *call,
            code_name(*code),
            *code as i32,
            message.as_str(),
        ))?,
        Error::Unreachable { reason, .. } => errors.getattr("AgentError")?.call1((
            text.as_str(),
            "connect",
            code_name(tonic::Code::Unavailable),
            tonic::Code::Unavailable as i32,
            reason.as_str(),
        ))?,
        Error::Invalid { field, value, .. } => errors.getattr("InvalidArgument")?.call1((
            text.as_str(),
            field.as_str(),
            value.as_str(),
        ))?,
        Error::Client(_) => errors.getattr("KvfabricError")?.call1((text,))?,
    };
    Ok(PyErr::from_value(exc))
}
