//! kvfabric operator: reconciles `TransferFabric` objects into per-pool agent DaemonSets, a
//! ConfigMap, a headless Service and a ServiceAccount, and reports their state in the status.
#![forbid(unsafe_code)]

pub mod backoff;
pub mod config;
pub mod configmap;
pub mod daemonset;
mod error;
pub mod finalizer;
pub mod leader;
pub mod meta;
pub mod metrics;
pub mod reconcile;
pub mod server;
pub mod service;
pub mod service_account;
pub mod status;

pub use error::{Error, Result};

#[cfg(test)]
mod apiserver_tests;
#[cfg(test)]
mod fixtures;
