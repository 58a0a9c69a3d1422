//! The fd socket's protocol. gRPC cannot carry file descriptors, so a worker sends each memfd on
//! the agent's fd socket first (SCM_RIGHTS) and names the token it gets back in
//! `RegisterSegment`.
//!
//! Request: the 8 bytes [`MAGIC`] with one fd attached. Reply: u64 LE status (0 ok), then the
//! u64 LE token when ok, else a u32 LE length and that many bytes of UTF-8 reason (at most
//! [`MAX_REASON_LEN`]).

use std::io::{self, Read};

pub const MAGIC: &[u8; 8] = b"KVFDREG1";

/// Longest refusal reason sent or read.
pub const MAX_REASON_LEN: usize = 1024;

/// The reply to one request.
pub fn encode_reply(answer: Result<u64, &str>) -> Vec<u8> {
    let mut out = Vec::with_capacity(16);
    match answer {
        Ok(token) => {
            out.extend_from_slice(&0u64.to_le_bytes());
            out.extend_from_slice(&token.to_le_bytes());
        }
        Err(reason) => {
            let reason = &reason.as_bytes()[..reason.len().min(MAX_REASON_LEN)];
            out.extend_from_slice(&1u64.to_le_bytes());
            out.extend_from_slice(&(reason.len() as u32).to_le_bytes());
            out.extend_from_slice(reason);
        }
    }
    out
}

/// Reads one reply: the token, or the agent's reason for refusing the fd.
pub fn read_reply(r: &mut impl Read) -> io::Result<Result<u64, String>> {
    let mut word = [0u8; 8];
    r.read_exact(&mut word)?;
    if u64::from_le_bytes(word) == 0 {
        r.read_exact(&mut word)?;
        return Ok(Ok(u64::from_le_bytes(word)));
    }
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_REASON_LEN {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("fd socket reply: a reason of {len} bytes (at most {MAX_REASON_LEN})"),
        ));
    }
    let mut reason = vec![0u8; len];
    r.read_exact(&mut reason)?;
    Ok(Err(String::from_utf8_lossy(&reason).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_round_trip() {
        let ok = encode_reply(Ok(42));
        assert_eq!(read_reply(&mut ok.as_slice()).unwrap(), Ok(42));
        let refused = encode_reply(Err("no file descriptor attached"));
        assert_eq!(
            read_reply(&mut refused.as_slice()).unwrap(),
            Err("no file descriptor attached".to_string())
        );
    }

    #[test]
    fn long_reasons_are_cut_and_oversized_lengths_refused() {
        let long = "x".repeat(10_000);
        let cut = encode_reply(Err(&long));
        assert_eq!(
            read_reply(&mut cut.as_slice()).unwrap().unwrap_err().len(),
            MAX_REASON_LEN
        );
        let mut forged = 1u64.to_le_bytes().to_vec();
        forged.extend_from_slice(&u32::MAX.to_le_bytes());
        let e = read_reply(&mut forged.as_slice()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
    }
}
