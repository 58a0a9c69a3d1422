//! kvfabric operator: reconciles `TransferFabric` objects into per-pool agent DaemonSets, a
//! ConfigMap, a headless Service, a NetworkPolicy and a ServiceAccount, and reports their state
//! (and why agents are not ready) in the status.
#![forbid(unsafe_code)]

pub mod config;
pub mod configmap;
pub mod contract;
pub mod daemonset;
pub mod diagnosis;
mod error;
pub mod finalizer;
pub mod leader;
pub mod meta;
pub mod metrics;
pub mod network_policy;
pub mod pod_security;
pub mod reconcile;
pub mod render;
pub mod server;
pub mod service;
pub mod service_account;
pub mod socket_dir;
pub mod spec_checks;
pub mod status;
pub mod uninstall;

pub use error::{Error, Result};

#[cfg(test)]
mod apiserver_tests;
#[cfg(test)]
mod fixtures;
