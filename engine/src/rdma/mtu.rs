//! The path MTU of an RDMA connection: one of the five InfiniBand sizes.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// An InfiniBand path MTU. The discriminants are the values of `enum ibv_mtu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mtu {
    M256 = 1,
    M512 = 2,
    M1024 = 3,
    M2048 = 4,
    M4096 = 5,
}

/// Bytes of headers that RoCE puts inside an Ethernet frame besides the payload: GRH 40, UDP 8,
/// BTH 12, XRC 4, AtomicETH 28, ICRC 4 (the kernel's `iboe_get_mtu`).
const ROCE_HEADERS: u32 = 40 + 8 + 12 + 4 + 28 + 4;

impl Mtu {
    pub const ALL: [Mtu; 5] = [Mtu::M256, Mtu::M512, Mtu::M1024, Mtu::M2048, Mtu::M4096];

    pub fn bytes(self) -> u32 {
        256 << (self as u32 - 1)
    }

    pub fn from_bytes(bytes: u32) -> Option<Mtu> {
        Mtu::ALL.into_iter().find(|m| m.bytes() == bytes)
    }

    /// The `enum ibv_mtu` value.
    pub fn ibv(self) -> u32 {
        self as u32
    }

    pub fn from_ibv(value: u32) -> Option<Mtu> {
        Mtu::ALL.into_iter().find(|m| m.ibv() == value)
    }

    /// The active MTU of a RoCE port whose net device has MTU `netdev_mtu`: the largest IB MTU
    /// that fits in a frame once the RoCE headers are taken off (1500 gives 1024, 9000 gives
    /// 4096), or None when not even 256 fits.
    pub fn for_roce_netdev(netdev_mtu: u32) -> Option<Mtu> {
        let payload = netdev_mtu.checked_sub(ROCE_HEADERS)?;
        Mtu::ALL.into_iter().rev().find(|m| m.bytes() <= payload)
    }
}

impl std::fmt::Display for Mtu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.bytes())
    }
}

/// On the wire an MTU is its size in bytes (`"mtu": 4096`), never the enum's ordinal.
impl Serialize for Mtu {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u32(self.bytes())
    }
}

impl<'de> Deserialize<'de> for Mtu {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let bytes = u32::deserialize(d)?;
        Mtu::from_bytes(bytes).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "mtu {bytes} is not one of 256, 512, 1024, 2048, 4096"
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_ibv_values_round_trip() {
        for m in Mtu::ALL {
            assert_eq!(Mtu::from_bytes(m.bytes()), Some(m));
            assert_eq!(Mtu::from_ibv(m.ibv()), Some(m));
        }
        assert_eq!(Mtu::M4096.bytes(), 4096);
        assert_eq!(Mtu::M256.ibv(), 1);
        assert_eq!(Mtu::from_bytes(1500), None);
        assert_eq!(Mtu::from_ibv(0), None);
        assert_eq!(Mtu::from_ibv(6), None);
    }

    #[test]
    fn roce_mtu_follows_the_netdev_mtu_minus_headers() {
        assert_eq!(Mtu::for_roce_netdev(1500), Some(Mtu::M1024));
        assert_eq!(Mtu::for_roce_netdev(9000), Some(Mtu::M4096));
        assert_eq!(Mtu::for_roce_netdev(4200), Some(Mtu::M4096));
        assert_eq!(Mtu::for_roce_netdev(4191), Some(Mtu::M2048));
        assert_eq!(Mtu::for_roce_netdev(352), Some(Mtu::M256));
        assert_eq!(Mtu::for_roce_netdev(300), None);
        assert_eq!(Mtu::for_roce_netdev(0), None);
    }

    #[test]
    fn serializes_as_bytes_and_refuses_other_sizes() {
        assert_eq!(serde_json::to_string(&Mtu::M2048).unwrap(), "2048");
        assert_eq!(serde_json::from_str::<Mtu>("4096").unwrap(), Mtu::M4096);
        let err = serde_json::from_str::<Mtu>("1500").unwrap_err();
        assert!(err.to_string().contains("1500"), "{err}");
        assert!(serde_json::from_str::<Mtu>("5").is_err());
    }
}
