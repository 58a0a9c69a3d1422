//! Errors of the `kvfabric-crds` crate.

/// Everything that can go wrong while validating a `TransferFabric` or writing its CRD.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A spec field holds a value the operator cannot act on.
    #[error("invalid {field}: {value:?} ({reason})")]
    InvalidField {
        /// JSON path of the field, e.g. `spec.pools[1].name`.
        field: String,
        /// The offending value as written by the user.
        value: String,
        /// Why the value is rejected.
        reason: String,
    },

    /// The CRD could not be rendered as YAML.
    #[error("rendering the CRD as YAML failed: {0}")]
    Yaml(#[from] serde_yaml_ng::Error),

    /// The CRD file could not be read or written.
    #[error("CRD file {path}: {source}")]
    Io {
        /// The file that was read or written.
        path: String,
        /// The underlying I/O error.
        source: std::io::Error,
    },
}

/// Longest value echoed in an error; longer ones are cut, since a spec field can be large.
pub const MAX_ECHOED: usize = 80;

impl Error {
    /// An invalid field, its value cut to [`MAX_ECHOED`] characters.
    pub fn invalid(
        field: impl Into<String>,
        value: impl std::fmt::Display,
        reason: impl Into<String>,
    ) -> Self {
        let mut value = value.to_string();
        if let Some((cut, _)) = value.char_indices().nth(MAX_ECHOED) {
            value.truncate(cut);
            value.push('…');
        }
        Self::InvalidField {
            field: field.into(),
            value,
            reason: reason.into(),
        }
    }
}

/// Result with this crate's [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
