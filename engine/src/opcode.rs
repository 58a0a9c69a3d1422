//! Which way a batch moves bytes: a leaf noun, below the error type.

use serde::{Deserialize, Serialize};

use crate::parse_error::ParseError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Opcode {
    /// Pull: remote → local.
    Read,
    /// Push: local → remote.
    Write,
}

impl std::fmt::Display for Opcode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Opcode::Read => "read",
            Opcode::Write => "write",
        })
    }
}

impl std::str::FromStr for Opcode {
    type Err = ParseError;
    fn from_str(s: &str) -> Result<Self, ParseError> {
        match s {
            "read" => Ok(Opcode::Read),
            "write" => Ok(Opcode::Write),
            other => Err(ParseError {
                field: "op",
                value: other.into(),
                expected: "expected read or write",
            }),
        }
    }
}
