//! Who may talk to this engine's data ports: a challenge–response on the engine's data secret.
//!
//! The target speaks first with a fresh nonce; the initiator answers with its own nonce and an
//! HMAC-SHA256 over a domain-separation string, both nonces and its name; the target answers with
//! its own proof (another domain string over the same inputs), so the initiator knows it reached
//! the engine whose secret it was given. Nothing about the target (descriptor, keys, error detail)
//! is said before the initiator's proof checks out, and a proof is good for one connection only
//! (the target's nonce is new each time). The segment key, when one is presented, travels as a
//! MAC too, never in the clear.

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::error::{Error, Result};

/// Bytes of a nonce, a proof and a secret.
pub const LEN: usize = 32;

pub type Nonce = [u8; LEN];
pub type Proof = [u8; LEN];

/// The secret a data connection proves it holds. An engine generates one when none is
/// configured, so authentication is never off; its owner hands it to the engine's peers over a
/// channel that is itself authenticated (the agent's peer API, the bench's control channel).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataSecret(#[serde(with = "hex::serde")] [u8; LEN]);

impl std::fmt::Debug for DataSecret {
    // Secrets end up in logs through Debug; never print one.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DataSecret(..)")
    }
}

impl DataSecret {
    /// A fresh secret from the operating system's CSPRNG (through `rand`'s thread generator).
    pub fn random() -> DataSecret {
        DataSecret(rand::random())
    }

    /// A secret received as bytes (exactly 32).
    pub fn from_bytes(bytes: &[u8]) -> Result<DataSecret> {
        let b: [u8; LEN] = bytes.try_into().map_err(|_| Error::InvalidConfig {
            field: "data_secret",
            value: format!("{} bytes", bytes.len()),
            reason: "must be exactly 32 bytes",
        })?;
        Ok(DataSecret(b))
    }

    pub fn as_bytes(&self) -> &[u8; LEN] {
        &self.0
    }

    fn mac(&self, domain: &[u8], target: &Nonce, initiator: &Nonce, tail: &[u8]) -> Hmac<Sha256> {
        let mut m = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length");
        m.update(domain);
        m.update(target);
        m.update(initiator);
        // Length-prefixed: no two (name, rest) inputs share their bytes.
        m.update(&(tail.len() as u64).to_le_bytes());
        m.update(tail);
        m
    }
}

/// The domain strings: a proof made for one role or purpose is worth nothing in another.
const INITIATOR: &[u8] = b"kvfabric data connection v2: initiator proof";
const TARGET: &[u8] = b"kvfabric data connection v2: target proof";
const SEGMENT_KEY: &[u8] = b"kvfabric data connection v2: segment key";

/// A fresh nonce.
pub fn nonce() -> Nonce {
    rand::random()
}

/// The two nonces of one connection and the initiator's name: what every proof covers.
#[derive(Debug, Clone, Copy)]
pub struct Exchange<'a> {
    pub target: &'a Nonce,
    pub initiator: &'a Nonce,
    pub from: &'a str,
}

impl Exchange<'_> {
    pub fn initiator_proof(&self, secret: &DataSecret) -> Proof {
        self.proof(secret, INITIATOR, self.from.as_bytes())
    }

    pub fn target_proof(&self, secret: &DataSecret) -> Proof {
        self.proof(secret, TARGET, self.from.as_bytes())
    }

    /// Proves knowledge of a segment key without sending it.
    pub fn key_proof(&self, secret: &DataSecret, key: u64) -> Proof {
        let mut tail = self.from.as_bytes().to_vec();
        tail.extend_from_slice(&key.to_le_bytes());
        self.proof(secret, SEGMENT_KEY, &tail)
    }

    fn proof(&self, secret: &DataSecret, domain: &[u8], tail: &[u8]) -> Proof {
        secret
            .mac(domain, self.target, self.initiator, tail)
            .finalize()
            .into_bytes()
            .into()
    }

    pub fn check_initiator(&self, secret: &DataSecret, proof: &Proof) -> bool {
        self.check(secret, INITIATOR, self.from.as_bytes(), proof)
    }

    pub fn check_target(&self, secret: &DataSecret, proof: &Proof) -> bool {
        self.check(secret, TARGET, self.from.as_bytes(), proof)
    }

    pub fn check_key(&self, secret: &DataSecret, key: u64, proof: &Proof) -> bool {
        let mut tail = self.from.as_bytes().to_vec();
        tail.extend_from_slice(&key.to_le_bytes());
        self.check(secret, SEGMENT_KEY, &tail, proof)
    }

    /// Constant time (`Mac::verify_slice`): how much of a guess matched stays unknown.
    fn check(&self, secret: &DataSecret, domain: &[u8], tail: &[u8], proof: &Proof) -> bool {
        secret
            .mac(domain, self.target, self.initiator, tail)
            .verify_slice(proof)
            .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_the_secret_both_nonces_the_name_and_the_role() {
        let (s, other) = (DataSecret::random(), DataSecret::random());
        let (t, i) = (nonce(), nonce());
        let x = Exchange {
            target: &t,
            initiator: &i,
            from: "prefill-0",
        };
        let p = x.initiator_proof(&s);
        assert!(x.check_initiator(&s, &p));
        assert!(!x.check_initiator(&other, &p));
        // The target's proof is no initiator proof, and neither is a key proof.
        assert!(!x.check_initiator(&s, &x.target_proof(&s)));
        assert!(x.check_target(&s, &x.target_proof(&s)));
        assert!(!x.check_initiator(&s, &x.key_proof(&s, 42)));
        assert!(x.check_key(&s, 42, &x.key_proof(&s, 42)));
        assert!(!x.check_key(&s, 43, &x.key_proof(&s, 42)));
        // Another connection (target nonce), another initiator nonce or name: worthless.
        let t2 = nonce();
        let replayed = Exchange { target: &t2, ..x };
        assert!(!replayed.check_initiator(&s, &p));
        let i2 = nonce();
        assert!(
            !Exchange {
                initiator: &i2,
                ..x
            }
            .check_initiator(&s, &p)
        );
        assert!(
            !Exchange {
                from: "prefill-1",
                ..x
            }
            .check_initiator(&s, &p)
        );
        let mut flipped = p;
        flipped[31] ^= 1;
        assert!(!x.check_initiator(&s, &flipped));
    }

    #[test]
    fn secrets_are_32_bytes_round_trip_as_hex_and_never_print() {
        let s = DataSecret::random();
        assert_eq!(DataSecret::from_bytes(s.as_bytes()).unwrap(), s);
        let err = DataSecret::from_bytes(&[1; 31]).unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidConfig {
                    field: "data_secret",
                    ..
                }
            ),
            "{err}"
        );
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(json.len(), 2 + 64);
        assert_eq!(serde_json::from_str::<DataSecret>(&json).unwrap(), s);
        assert_eq!(format!("{s:?}"), "DataSecret(..)");
        assert_ne!(DataSecret::random(), s);
    }
}
