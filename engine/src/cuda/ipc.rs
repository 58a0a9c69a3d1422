//! CUDA IPC handles as they travel in a segment descriptor. Holding one lets a process on the same
//! node map the allocation, so it is a capability: never logged, only compared and carried.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The bytes of a `CUipcMemHandle` (64, opaque to us).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IpcHandle(pub [u8; 64]);

impl fmt::Debug for IpcHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("IpcHandle(..)")
    }
}

impl IpcHandle {
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses exactly 128 hex digits; the error says what was wrong with the text.
    pub fn from_hex(text: &str) -> Result<IpcHandle, String> {
        if text.len() != 128 {
            return Err(format!("expected 128 hex digits, got {}", text.len()));
        }
        let mut out = [0u8; 64];
        for (i, pair) in text.as_bytes().chunks_exact(2).enumerate() {
            let digits = std::str::from_utf8(pair).map_err(|_| "not ASCII".to_string())?;
            out[i] = u8::from_str_radix(digits, 16)
                .map_err(|_| format!("{digits:?} at byte {i} is not hex"))?;
        }
        Ok(IpcHandle(out))
    }
}

impl Serialize for IpcHandle {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for IpcHandle {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        IpcHandle::from_hex(&text).map_err(|e| serde::de::Error::custom(format!("ipc handle: {e}")))
    }
}

/// What a same-node peer needs to map a GPU region: the handle of the allocation that holds it
/// and where the region starts inside that allocation (regions registered from caller memory
/// need not start at an allocation's base).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaExport {
    pub handle: IpcHandle,
    pub offset: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_as_hex_and_garbage_is_refused_with_reason() {
        let mut raw = [0u8; 64];
        raw.iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = i as u8 * 3);
        let e = CudaExport {
            handle: IpcHandle(raw),
            offset: 4096,
        };
        let json = serde_json::to_string(&e).unwrap();
        assert!(json.contains("\"offset\":4096"), "{json}");
        assert_eq!(serde_json::from_str::<CudaExport>(&json).unwrap(), e);
        assert_eq!(format!("{:?}", e.handle), "IpcHandle(..)");

        let short = json.replace(&e.handle.to_hex(), "abcd");
        let err = serde_json::from_str::<CudaExport>(&short).unwrap_err();
        assert!(
            err.to_string().contains("expected 128 hex digits, got 4"),
            "{err}"
        );
        let bad = json.replacen("\"handle\":\"00", "\"handle\":\"zz", 1);
        let err = serde_json::from_str::<CudaExport>(&bad).unwrap_err();
        assert!(err.to_string().contains("\"zz\" at byte 0"), "{err}");
    }
}
