//! TLS 1.3 records, sealed and opened by the transport's own threads in the buffers they
//! already use — the split kernel TLS makes: rustls shakes hands (certificates, the per-fabric
//! name) and hands over the traffic secrets; this module frames, encrypts and authenticates
//! the records (RFC 8446 §5) with aws-lc's AEAD (its AES-GCM uses VAES/AVX-512 where the CPU
//! has them; ring's, which rustls' handshake runs on, does not). rustls'
//! `KernelConnection` stays behind to derive the next secrets at a KeyUpdate.
//!
//! A record that fails authentication (tampered, replayed, reordered, cut) breaks the
//! connection: its plaintext is never handed out, and nothing read after it is trusted.

use std::io::{self, IoSlice, IoSliceMut};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use aws_lc_rs::aead::{self, Aad, LessSafeKey, Nonce, UnboundKey};
use rustls::ConnectionTrafficSecrets;
use rustls::client::ClientConnectionData;
use rustls::kernel::KernelConnection;
use rustls::server::ServerConnectionData;

pub(crate) const HEADER: usize = 5;
const TAG: usize = 16;
/// The largest plaintext of one record (2^14).
pub(crate) const MAX_PLAIN: usize = 1 << 14;
/// The largest ciphertext a TLS 1.3 record may carry (2^14 + 256).
const MAX_CIPHER: usize = MAX_PLAIN + 256;
/// Raw bytes taken from the socket at once: a few records per system call.
const RAW_AHEAD: usize = 64 << 10;

pub(crate) const ALERT: u8 = 21;
pub(crate) const HANDSHAKE: u8 = 22;
pub(crate) const APPLICATION_DATA: u8 = 23;
const NEW_SESSION_TICKET: u8 = 4;
const KEY_UPDATE: u8 = 24;
pub(crate) const CLOSE_NOTIFY: u8 = 0;
/// The handshake message KeyUpdate(update_not_requested).
pub(crate) const KEY_UPDATE_NOT_REQUESTED: [u8; 5] = [KEY_UPDATE, 0, 0, 1, 0];

/// Why a record could not be sealed or opened. Each one ends the connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    #[error("tls record header: {field} is {value}, expected {expected}")]
    Header {
        field: &'static str,
        value: u32,
        expected: &'static str,
    },
    #[error(
        "tls record {seq} failed authentication (tampered, replayed, reordered or sealed with \
         another key)"
    )]
    Authentication { seq: u64 },
    #[error(
        "tls record {seq}: content type {found} (expected application data, alert or handshake)"
    )]
    ContentType { seq: u64, found: u8 },
    #[error(
        "tls handshake message {kind} after the handshake (only KeyUpdate and NewSessionTicket may come)"
    )]
    Handshake { kind: u8 },
    #[error("tls KeyUpdate not at the end of its record, or malformed")]
    KeyUpdateMessage,
    #[error("tls peer sent alert {description}")]
    Alert { description: u8 },
    #[error("tls record sequence exhausted")]
    Sequence,
    #[error("tls key update: {0}")]
    KeyUpdate(String),
    #[error("tls cipher suite {0} is not one the data port seals itself")]
    Suite(String),
    #[error("tls connection broken by an earlier error")]
    Broken,
    #[error(
        "tls record failed authentication in the kernel (tampered, replayed, reordered or sealed \
         with another key)"
    )]
    KernelAuthentication,
    #[error("tls record refused by the kernel (errno {errno}: a malformed header or length)")]
    KernelRecord { errno: i32 },
}

impl From<RecordError> for io::Error {
    fn from(e: RecordError) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, e)
    }
}

/// rustls' side of a connection after the handshake: it derives the next traffic secrets.
pub(crate) enum Kernel {
    Client(KernelConnection<ClientConnectionData>),
    Server(KernelConnection<ServerConnectionData>),
}

/// What both directions of one connection share.
pub(crate) struct Keys {
    kernel: Mutex<Kernel>,
    /// The peer asked us to update our sending key (KeyUpdate with `update_requested`).
    pub(crate) peer_asked: AtomicBool,
}

impl Keys {
    pub(crate) fn new(kernel: Kernel) -> Arc<Keys> {
        Arc::new(Keys {
            kernel: Mutex::new(kernel),
            peer_asked: AtomicBool::new(false),
        })
    }

    /// Records a suite may seal under one key (RFC 8446 §5.5), with a margin: the sender
    /// updates its key after three quarters of them.
    pub(crate) fn update_after(&self) -> u64 {
        let k = self.kernel.lock().unwrap_or_else(PoisonError::into_inner);
        let suite = match &*k {
            Kernel::Client(c) => c.negotiated_cipher_suite(),
            Kernel::Server(s) => s.negotiated_cipher_suite(),
        };
        suite
            .tls13()
            .map_or(u64::MAX, |s| s.common.confidentiality_limit / 4 * 3)
    }

    /// The next secret of one direction (sending when `tx`), from sequence 0.
    pub(crate) fn next_secrets(
        &self,
        tx: bool,
    ) -> Result<(u64, ConnectionTrafficSecrets), RecordError> {
        let mut k = self.kernel.lock().unwrap_or_else(PoisonError::into_inner);
        let next = match (&mut *k, tx) {
            (Kernel::Client(c), true) => c.update_tx_secret(),
            (Kernel::Client(c), false) => c.update_rx_secret(),
            (Kernel::Server(s), true) => s.update_tx_secret(),
            (Kernel::Server(s), false) => s.update_rx_secret(),
        };
        next.map_err(|e| RecordError::KeyUpdate(e.to_string()))
    }

    fn next(&self, tx: bool) -> Result<Key, RecordError> {
        let (seq, secrets) = self.next_secrets(tx)?;
        Key::new(seq, &secrets)
    }
}

/// One direction's key and record sequence.
pub(crate) struct Key {
    aead: LessSafeKey,
    iv: [u8; 12],
    seq: u64,
}

impl Key {
    pub(crate) fn new(seq: u64, secrets: &ConnectionTrafficSecrets) -> Result<Key, RecordError> {
        let (alg, key, iv) = match secrets {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (&aead::AES_128_GCM, key, iv),
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (&aead::AES_256_GCM, key, iv),
            ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => {
                (&aead::CHACHA20_POLY1305, key, iv)
            }
            _ => return Err(RecordError::Suite("a newer AEAD".into())),
        };
        let unbound = UnboundKey::new(alg, key.as_ref())
            .map_err(|_| RecordError::Suite(format!("{alg:?} key length")))?;
        let iv: [u8; 12] = iv
            .as_ref()
            .try_into()
            .map_err(|_| RecordError::Suite(format!("{alg:?} iv length")))?;
        Ok(Key {
            aead: LessSafeKey::new(unbound),
            iv,
            seq,
        })
    }

    /// The per-record nonce (§5.3), and the sequence moves on.
    fn nonce(&mut self) -> Result<Nonce, RecordError> {
        let mut n = self.iv;
        for (b, s) in n[4..].iter_mut().zip(self.seq.to_be_bytes()) {
            *b ^= s;
        }
        self.seq = self.seq.checked_add(1).ok_or(RecordError::Sequence)?;
        Ok(Nonce::assume_unique_for_key(n))
    }
}

/// One core sealing 16 KiB records with the suite the data port prefers (AES-128-GCM, see
/// [`DataTls`](crate::DataTls)) for `window`, in GB/s: what a bound on encrypted throughput
/// counts for each seal and each open.
pub fn seal_gbps(window: Duration) -> f64 {
    let key = LessSafeKey::new(UnboundKey::new(&aead::AES_128_GCM, &[7; 16]).expect("16 bytes"));
    let mut record = vec![0x5au8; MAX_PLAIN];
    let start = Instant::now();
    let (mut sealed, mut seq) = (0u64, 0u64);
    while start.elapsed() < window {
        let mut nonce = [0u8; 12];
        nonce[4..].copy_from_slice(&seq.to_be_bytes());
        seq += 1;
        let tag = key
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::empty(),
                &mut record,
            )
            .expect("a record is far below the suite's limit");
        let _ = std::hint::black_box(tag);
        sealed += record.len() as u64;
    }
    sealed as f64 / start.elapsed().as_secs_f64() / 1e9
}

fn header(cipher_len: usize) -> [u8; HEADER] {
    let [hi, lo] = (cipher_len as u16).to_be_bytes();
    [APPLICATION_DATA, 3, 3, hi, lo]
}

/// The sending direction.
pub(crate) struct Sealer {
    key: Key,
    keys: Arc<Keys>,
    /// Records under one key before we update it.
    pub(crate) update_after: u64,
    /// Key updates so far.
    pub(crate) updates: u64,
    broken: bool,
}

impl Sealer {
    pub(crate) fn new(key: Key, keys: Arc<Keys>) -> Sealer {
        let update_after = keys.update_after();
        Sealer {
            key,
            keys,
            update_after,
            updates: 0,
            broken: false,
        }
    }

    #[cfg(test)]
    pub(crate) fn algorithm(&self) -> &'static aead::Algorithm {
        self.key.aead.algorithm()
    }

    /// Marks the direction unusable (a record was cut short on the wire).
    pub(crate) fn break_off(&mut self) {
        self.broken = true;
    }

    /// Appends to `out` the records carrying up to `limit` bytes of `plain` (taken from the
    /// slices in order); returns how many plaintext bytes they carry.
    pub(crate) fn seal(
        &mut self,
        plain: &[IoSlice<'_>],
        limit: usize,
        out: &mut Vec<u8>,
    ) -> Result<usize, RecordError> {
        let mut taken = 0;
        let (mut i, mut off) = (0, 0);
        while taken < limit {
            while i < plain.len() && off == plain[i].len() {
                i += 1;
                off = 0;
            }
            if i == plain.len() {
                break;
            }
            let record = (limit - taken).min(MAX_PLAIN);
            let mut filled = 0;
            self.record(APPLICATION_DATA, out, |out| {
                while filled < record && i < plain.len() {
                    let n = (plain[i].len() - off).min(record - filled);
                    out.extend_from_slice(&plain[i][off..off + n]);
                    filled += n;
                    off += n;
                    if off == plain[i].len() {
                        i += 1;
                        off = 0;
                    }
                }
            })?;
            taken += filled;
        }
        Ok(taken)
    }

    /// Appends a close_notify alert.
    pub(crate) fn close_notify(&mut self, out: &mut Vec<u8>) -> Result<(), RecordError> {
        self.record(ALERT, out, |out| out.extend_from_slice(&[1, CLOSE_NOTIFY]))
    }

    /// Appends one record of `content_type` whose plaintext `fill` writes; updates the key
    /// first when it has sealed its share or the peer asked.
    fn record(
        &mut self,
        content_type: u8,
        out: &mut Vec<u8>,
        fill: impl FnOnce(&mut Vec<u8>),
    ) -> Result<(), RecordError> {
        if self.broken {
            return Err(RecordError::Broken);
        }
        if self.key.seq >= self.update_after || self.keys.peer_asked.swap(false, Ordering::AcqRel) {
            // KeyUpdate(update_not_requested) under the old key, then the new key from 0.
            self.seal_one(HANDSHAKE, out, |out| {
                out.extend_from_slice(&KEY_UPDATE_NOT_REQUESTED)
            })?;
            self.key = self.keys.next(true).inspect_err(|_| self.broken = true)?;
            self.updates += 1;
        }
        self.seal_one(content_type, out, fill)
    }

    fn seal_one(
        &mut self,
        content_type: u8,
        out: &mut Vec<u8>,
        fill: impl FnOnce(&mut Vec<u8>),
    ) -> Result<(), RecordError> {
        let start = out.len();
        out.extend_from_slice(&[0; HEADER]);
        fill(out);
        out.push(content_type);
        let cipher_len = out.len() - start - HEADER + TAG;
        let head = header(cipher_len);
        out[start..start + HEADER].copy_from_slice(&head);
        let nonce = self.key.nonce().inspect_err(|_| self.broken = true)?;
        let tag = self
            .key
            .aead
            .seal_in_place_separate_tag(nonce, Aad::from(head), &mut out[start + HEADER..])
            .map_err(|_| {
                self.broken = true;
                RecordError::Sequence
            })?;
        out.extend_from_slice(tag.as_ref());
        Ok(())
    }
}

/// The receiving direction: raw bytes from the socket, opened record by record in place.
pub(crate) struct Opener {
    key: Key,
    keys: Arc<Keys>,
    raw: Vec<u8>,
    /// Unconsumed raw bytes: `raw[start..end]`.
    start: usize,
    end: usize,
    /// Opened plaintext not yet handed out (inside `raw`), and where its record ends.
    plain: Range<usize>,
    record_end: usize,
    /// Key updates so far.
    pub(crate) updates: u64,
    closed: bool,
    broken: bool,
}

impl Opener {
    /// `plain`: what rustls opened already, behind the handshake; `raw`: the bytes after it.
    pub(crate) fn new(key: Key, keys: Arc<Keys>, plain: &[u8], raw: &[u8]) -> Opener {
        let held = plain.len() + raw.len();
        let mut buf = vec![0u8; (RAW_AHEAD + HEADER + MAX_CIPHER).max(held)];
        buf[..plain.len()].copy_from_slice(plain);
        buf[plain.len()..held].copy_from_slice(raw);
        Opener {
            key,
            keys,
            raw: buf,
            // Plaintext first: when it is taken, `start` moves to the raw bytes behind it.
            start: 0,
            end: held,
            plain: 0..plain.len(),
            record_end: plain.len(),
            updates: 0,
            closed: false,
            broken: false,
        }
    }

    /// Plaintext (or the peer's close) can be handed out without reading the socket.
    pub(crate) fn ready(&self) -> bool {
        !self.plain.is_empty() || self.closed || self.complete_record().is_some()
    }

    /// Copies plaintext into `dst`, reading records through `recv` only when none is held;
    /// Ok(0) once the peer sent close_notify (or closed between records).
    pub(crate) fn read(
        &mut self,
        dst: &mut [IoSliceMut<'_>],
        mut recv: impl FnMut(&mut [u8]) -> io::Result<usize>,
    ) -> io::Result<usize> {
        if dst.iter().all(|d| d.is_empty()) {
            return Ok(0);
        }
        loop {
            if self.broken {
                return Err(RecordError::Broken.into());
            }
            let n = self.copy_out(dst)?;
            if n > 0 {
                return Ok(n);
            }
            if self.closed {
                return Ok(0);
            }
            // Room for a whole record behind what is held.
            if self.raw.len() - self.start < HEADER + MAX_CIPHER {
                self.raw.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            }
            let got = recv(&mut self.raw[self.end..])?;
            if got == 0 {
                if self.start == self.end {
                    return Ok(0);
                }
                self.broken = true;
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            self.end += got;
        }
    }

    /// Hands out opened plaintext, opening the records already held while `dst` has room.
    fn copy_out(&mut self, dst: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        let mut copied = 0;
        for d in dst.iter_mut() {
            let mut at = 0;
            while at < d.len() {
                if self.plain.is_empty() {
                    if self.closed {
                        return Ok(copied);
                    }
                    match self.open_next() {
                        Ok(true) => continue,
                        Ok(false) => return Ok(copied),
                        Err(e) => {
                            self.broken = true;
                            return Err(e.into());
                        }
                    }
                }
                let n = self.plain.len().min(d.len() - at);
                d[at..at + n].copy_from_slice(&self.raw[self.plain.start..self.plain.start + n]);
                self.plain.start += n;
                if self.plain.is_empty() {
                    self.start = self.record_end;
                }
                at += n;
                copied += n;
            }
        }
        Ok(copied)
    }

    /// The ciphertext length of a whole record at `start`, if one is held.
    fn complete_record(&self) -> Option<usize> {
        let held = &self.raw[self.start..self.end];
        if held.len() < HEADER {
            return None;
        }
        let len = u16::from_be_bytes([held[3], held[4]]) as usize;
        (held.len() >= HEADER + len).then_some(len)
    }

    /// Opens the record at `start`: true when it gave plaintext or a control message was
    /// handled, false when no whole record is held.
    fn open_next(&mut self) -> Result<bool, RecordError> {
        let held = &self.raw[self.start..self.end];
        if held.len() < HEADER {
            return Ok(false);
        }
        let head: [u8; HEADER] = held[..HEADER].try_into().expect("length checked");
        if head[0] != APPLICATION_DATA {
            return Err(RecordError::Header {
                field: "type",
                value: head[0].into(),
                expected: "23 (application data)",
            });
        }
        if head[1..3] != [3, 3] {
            return Err(RecordError::Header {
                field: "legacy_record_version",
                value: u16::from_be_bytes([head[1], head[2]]).into(),
                expected: "0x0303",
            });
        }
        let len = u16::from_be_bytes([head[3], head[4]]) as usize;
        if !(TAG + 1..=MAX_CIPHER).contains(&len) {
            return Err(RecordError::Header {
                field: "length",
                value: len as u32,
                expected: "17..=16640",
            });
        }
        if held.len() < HEADER + len {
            return Ok(false);
        }
        let seq = self.key.seq;
        let body = self.start + HEADER..self.start + HEADER + len;
        let nonce = self.key.nonce()?;
        let opened = self
            .key
            .aead
            .open_in_place(nonce, Aad::from(head), &mut self.raw[body.clone()])
            .map_err(|_| RecordError::Authentication { seq })?;
        // The inner plaintext ends with its content type, then zero padding (§5.4).
        let inner = opened
            .iter()
            .rposition(|&b| b != 0)
            .ok_or(RecordError::ContentType { seq, found: 0 })?;
        let content_type = opened[inner];
        let plain = body.start..body.start + inner;
        self.record_end = body.end;
        match content_type {
            APPLICATION_DATA => {
                self.plain = plain;
                if self.plain.is_empty() {
                    self.start = self.record_end;
                }
            }
            HANDSHAKE => {
                let msgs = self.raw[plain].to_vec();
                self.start = self.record_end;
                self.handshake(&msgs)?;
            }
            ALERT => {
                let alert = &self.raw[plain];
                self.start = self.record_end;
                match alert {
                    [_, CLOSE_NOTIFY] => self.closed = true,
                    [_, description] => {
                        return Err(RecordError::Alert {
                            description: *description,
                        });
                    }
                    _ => return Err(RecordError::ContentType { seq, found: ALERT }),
                }
            }
            found => return Err(RecordError::ContentType { seq, found }),
        }
        Ok(true)
    }

    /// Post-handshake messages: KeyUpdate moves to the next key (and, when asked, makes our
    /// sealer update too).
    fn handshake(&mut self, msgs: &[u8]) -> Result<(), RecordError> {
        post_handshake(msgs, |requested| {
            self.key = self.keys.next(false)?;
            self.updates += 1;
            if requested {
                self.keys.peer_asked.store(true, Ordering::Release);
            }
            Ok(())
        })
    }

    /// Opens every record held (reading the rest of one cut short through `recv_exact`) and
    /// takes the plaintext: what came behind the handshake, before the kernel opens the rest.
    /// Returns it and the next record's sequence; a KeyUpdate or close among them is refused.
    pub(crate) fn drain(
        &mut self,
        mut recv_exact: impl FnMut(&mut [u8]) -> io::Result<()>,
    ) -> io::Result<(Vec<u8>, u64)> {
        let mut plain = Vec::new();
        loop {
            plain.extend_from_slice(&self.raw[self.plain.clone()]);
            if !self.plain.is_empty() {
                self.plain = 0..0;
                self.start = self.record_end;
            }
            if self.start == self.end {
                break;
            }
            let updates = self.updates;
            if self.open_next()? {
                if self.updates != updates || self.closed {
                    return Err(RecordError::KeyUpdate(
                        "a KeyUpdate or close right behind the handshake, before the kernel \
                         took the records"
                            .into(),
                    )
                    .into());
                }
                continue;
            }
            // A record cut short: exactly its missing bytes, nothing of the next one.
            let held = self.end - self.start;
            let need = if held < HEADER {
                HEADER - held
            } else {
                let len = u16::from_be_bytes([self.raw[self.start + 3], self.raw[self.start + 4]]);
                HEADER + usize::from(len) - held
            };
            if self.raw.len() < self.end + need {
                self.raw.resize(self.end + need, 0);
            }
            recv_exact(&mut self.raw[self.end..self.end + need])?;
            self.end += need;
        }
        Ok((plain, self.key.seq))
    }
}

/// Post-handshake messages of one record: `key_update(update_requested)` for each KeyUpdate;
/// session tickets are not kept (the data port never resumes); any other message is refused.
pub(crate) fn post_handshake(
    mut msgs: &[u8],
    mut key_update: impl FnMut(bool) -> Result<(), RecordError>,
) -> Result<(), RecordError> {
    while !msgs.is_empty() {
        let [kind, a, b, c, rest @ ..] = msgs else {
            return Err(RecordError::KeyUpdateMessage);
        };
        let len = u32::from_be_bytes([0, *a, *b, *c]) as usize;
        if rest.len() < len {
            return Err(RecordError::KeyUpdateMessage);
        }
        let (body, tail) = rest.split_at(len);
        match *kind {
            KEY_UPDATE => {
                // The next record is under the new key: nothing may follow in this one.
                if !tail.is_empty() || body.len() != 1 || body[0] > 1 {
                    return Err(RecordError::KeyUpdateMessage);
                }
                key_update(body[0] == 1)?;
            }
            NEW_SESSION_TICKET => {}
            kind => return Err(RecordError::Handshake { kind }),
        }
        msgs = tail;
    }
    Ok(())
}
