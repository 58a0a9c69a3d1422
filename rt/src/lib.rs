//! Process plumbing the agent, the engine's listeners and the operator share, so each exists once:
//! the shutdown signal ([`shutdown`]), exponential back-off ([`backoff`]), logging at most once
//! per interval what a peer can provoke ([`throttle`]), and who keeps a slot when a listener is
//! full ([`admission`]); with the `args` feature, how the binaries parse their command line
//! ([`args`]).

#![forbid(unsafe_code)]

pub mod admission;
#[cfg(feature = "args")]
pub mod args;
pub mod backoff;
pub mod shutdown;
pub mod throttle;

pub use backoff::{AcceptBackoff, Backoff, KeyedBackoff};
pub use throttle::Throttle;
