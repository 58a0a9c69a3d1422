//! `TransferFabric`: the custom resource that describes one kvfabric deployment (agent pools, the
//! registry, the transports), and the code that renders its CustomResourceDefinition.
#![forbid(unsafe_code)]

mod error;
mod fabric;
mod manifest;
mod transport;
mod validate;

pub use error::{Error, Result};
pub use fabric::*;
pub use manifest::{CRD_FILE, crd_yaml, crd_yaml_path};
pub use transport::Transport;
pub use validate::{FABRIC_NAME_RULE, MAX_FABRIC_NAME, fabric_name_problem};
