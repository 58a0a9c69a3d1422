//! How regions are named and guarded: leaf nouns, below the error type.

use std::fmt;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RegionId(pub u64);

impl fmt::Display for RegionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The secret a peer must present to touch a region (the role an rkey plays in RDMA).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct AccessKey(pub u64);

impl AccessKey {
    /// Never 0: agents take a key of 0 to mean "by fabric membership" (kvfabric-agent).
    pub fn random() -> Self {
        AccessKey(rand::random::<std::num::NonZeroU64>().get())
    }
}

impl fmt::Debug for AccessKey {
    // Keys end up in logs through Debug; never print the secret itself.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AccessKey(..)")
    }
}
