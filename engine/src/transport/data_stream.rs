//! A tcp data connection, plaintext or TLS. With TLS, rustls shakes hands on the socket itself
//! (both certificates checked against the CA, within the caller's deadline) and hands the
//! traffic secrets over; from then on the transport's writer seals records in the buffer it
//! writes from and its reader opens them in the buffer it reads into (`tls_record`): no relay
//! thread, no loopback socket, no copy beyond the one encryption needs. The data secret's
//! challenge–response runs inside, as ever.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsFd;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rustls::client::UnbufferedClientConnection;
use rustls::server::UnbufferedServerConnection;
use rustls::unbuffered::{ConnectionState, EncodeError, UnbufferedStatus};

use super::io::{Socket, SpinReader, Until};
use super::kernel_tls::{CryptoInfo, KernelRx, KernelTx, RecordLayer, hand_over_rx, hand_over_tx};
use super::tls_record::{Kernel, Key, Keys, MAX_PLAIN, Opener, Sealer};
use crate::data_tls::DataTls;

/// Plaintext sealed per system call: a few records, so one write moves them all.
const SEAL_BATCH: usize = 16 * MAX_PLAIN;
/// Handshake bytes held at most (certificate chains are a few KiB).
const HANDSHAKE_MAX: usize = 256 << 10;

/// A data connection before it is split into the writer's and the reader's halves.
pub(crate) enum DataStream {
    Plain(TcpStream),
    /// TLS records sealed and opened by the transport's threads.
    Tls(Box<TlsStream>),
    /// TLS records sealed and opened by the kernel.
    Kernel(Box<KernelStream>),
}

/// Both directions of a TLS data connection, for the handshake and the server's control path.
pub(crate) struct TlsStream {
    sock: TcpStream,
    seal: Sealing,
    opener: Opener,
}

/// A TLS data connection whose records the kernel seals and opens.
pub(crate) struct KernelStream {
    sock: TcpStream,
    rx: KernelRx,
    tx: KernelTx,
}

struct Sealing {
    sealer: Sealer,
    /// Sealed records not yet written: reused, one batch at a time.
    out: Vec<u8>,
}

impl DataStream {
    /// The initiator's side: TLS over `sock` when `tls` is set, verifying the target.
    pub(crate) fn connect(
        sock: TcpStream,
        tls: Option<&DataTls>,
        deadline: Instant,
    ) -> io::Result<DataStream> {
        let Some(tls) = tls else {
            return Ok(DataStream::Plain(sock));
        };
        let now = tls.current();
        let mut conn = UnbufferedClientConnection::new(now.client.clone(), now.server_name.clone())
            .map_err(io::Error::other)?;
        let mut sock = sock;
        let early = handshake(&mut conn, &mut sock, deadline)?;
        let (secrets, kernel) = conn
            .dangerous_into_kernel_connection()
            .map_err(io::Error::other)?;
        let layer = tls.record_layer();
        TlsStream::stream(
            sock,
            secrets,
            Kernel::Client(kernel),
            early,
            layer,
            deadline,
        )
    }

    /// The target's side: TLS over `sock` when `tls` is set, requiring a client certificate.
    pub(crate) fn accept(
        sock: TcpStream,
        tls: Option<&DataTls>,
        deadline: Instant,
    ) -> io::Result<DataStream> {
        let Some(tls) = tls else {
            return Ok(DataStream::Plain(sock));
        };
        let mut conn = UnbufferedServerConnection::new(tls.current().server.clone())
            .map_err(io::Error::other)?;
        let mut sock = sock;
        let early = handshake(&mut conn, &mut sock, deadline)?;
        let (secrets, kernel) = conn
            .dangerous_into_kernel_connection()
            .map_err(io::Error::other)?;
        let layer = tls.record_layer();
        TlsStream::stream(
            sock,
            secrets,
            Kernel::Server(kernel),
            early,
            layer,
            deadline,
        )
    }

    /// From here on batches carry their own deadlines.
    pub(crate) fn clear_timeouts(&self) -> io::Result<()> {
        self.socket().set_read_timeout(None)?;
        self.socket().set_write_timeout(None)
    }

    fn socket(&self) -> &TcpStream {
        match self {
            DataStream::Plain(s) => s,
            DataStream::Tls(t) => &t.sock,
            DataStream::Kernel(k) => &k.sock,
        }
    }

    /// The writer's half and the reader's; whatever the reader already holds goes with it.
    pub(crate) fn split(self) -> io::Result<(DataWriter, SpinReader<TcpStream>)> {
        match self {
            DataStream::Plain(s) => {
                let reader = SpinReader::new(s.try_clone()?);
                Ok((
                    DataWriter {
                        sock: s,
                        seal: Seal::Plain,
                    },
                    reader,
                ))
            }
            DataStream::Tls(t) => {
                let TlsStream { sock, seal, opener } = *t;
                let reader = SpinReader::with_opener(sock.try_clone()?, opener);
                Ok((
                    DataWriter {
                        sock,
                        seal: Seal::User(Mutex::new(seal)),
                    },
                    reader,
                ))
            }
            DataStream::Kernel(k) => {
                let KernelStream { sock, rx, tx } = *k;
                let reader = SpinReader::with_kernel(sock.try_clone()?, rx);
                Ok((
                    DataWriter {
                        sock,
                        seal: Seal::Kernel(Mutex::new(tx)),
                    },
                    reader,
                ))
            }
        }
    }
}

impl TlsStream {
    /// The stream rustls' handshake left: its secrets, its kernel half, the bytes behind it;
    /// its records sealed by `layer` (by the kernel where it takes the keys).
    fn stream(
        sock: TcpStream,
        secrets: rustls::ExtractedSecrets,
        kernel: Kernel,
        early: Early,
        layer: RecordLayer,
        deadline: Instant,
    ) -> io::Result<DataStream> {
        let keys = Keys::new(kernel);
        let (tx, rx) = (secrets.tx, secrets.rx);
        let mut opener = Opener::new(
            Key::new(rx.0, &rx.1)?,
            keys.clone(),
            &early.plain,
            &early.raw,
        );
        if let RecordLayer::Kernel { .. } = layer {
            let tx_info = CryptoInfo::new(tx.0, &tx.1)?;
            match hand_over_tx(&sock, &tx_info) {
                Ok(()) => {
                    let mut rx_info = CryptoInfo::new(rx.0, &rx.1)?;
                    return KernelStream::start(sock, keys, &mut opener, &mut rx_info, deadline);
                }
                Err(e) => {
                    tracing::debug!(error = %e, "kernel TLS refused the key: records sealed in userspace");
                }
            }
        }
        Ok(DataStream::Tls(Box::new(TlsStream {
            sock,
            seal: Sealing {
                sealer: Sealer::new(Key::new(tx.0, &tx.1)?, keys),
                out: Vec::new(),
            },
            opener,
        })))
    }
}

impl KernelStream {
    /// The kernel seals already; the records that came behind the handshake are opened here,
    /// and the kernel opens from the next one on.
    fn start(
        mut sock: TcpStream,
        keys: std::sync::Arc<Keys>,
        opener: &mut Opener,
        rx: &mut CryptoInfo,
        deadline: Instant,
    ) -> io::Result<DataStream> {
        let (held, seq) = opener.drain(|b| {
            Until {
                s: &mut sock,
                deadline,
            }
            .read_exact(b)
        })?;
        rx.at_seq(seq);
        hand_over_rx(&sock, rx)?;
        Ok(DataStream::Kernel(Box::new(KernelStream {
            sock,
            rx: KernelRx::new(keys.clone(), held),
            tx: KernelTx::new(keys),
        })))
    }
}

/// The two kinds of unbuffered rustls connection, to one handshake loop.
trait Handshaking {
    type Data;
    fn process<'c, 'i>(
        &'c mut self,
        incoming: &'i mut [u8],
    ) -> UnbufferedStatus<'c, 'i, Self::Data>;
    fn handshaking(&self) -> bool;
}

impl Handshaking for UnbufferedClientConnection {
    type Data = rustls::client::ClientConnectionData;
    fn process<'c, 'i>(
        &'c mut self,
        incoming: &'i mut [u8],
    ) -> UnbufferedStatus<'c, 'i, Self::Data> {
        self.process_tls_records(incoming)
    }
    fn handshaking(&self) -> bool {
        self.is_handshaking()
    }
}

impl Handshaking for UnbufferedServerConnection {
    type Data = rustls::server::ServerConnectionData;
    fn process<'c, 'i>(
        &'c mut self,
        incoming: &'i mut [u8],
    ) -> UnbufferedStatus<'c, 'i, Self::Data> {
        self.process_tls_records(incoming)
    }
    fn handshaking(&self) -> bool {
        self.is_handshaking()
    }
}

/// What the peer sent behind its last handshake message: records rustls already opened, and
/// raw bytes it did not look at.
#[derive(Default)]
struct Early {
    plain: Vec<u8>,
    raw: Vec<u8>,
}

fn too_long(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("tls handshake: {what} over {HANDSHAKE_MAX} bytes"),
    )
}

/// Drives a rustls handshake to its end on `sock`, every read and write by `deadline`.
fn handshake<C: Handshaking>(
    conn: &mut C,
    sock: &mut TcpStream,
    deadline: Instant,
) -> io::Result<Early> {
    let mut incoming = vec![0u8; 16 << 10];
    let mut filled = 0;
    let mut outgoing = vec![0u8; 16 << 10];
    let mut pending = 0;
    let mut early = Early::default();
    // After an error rustls still hands out the alert that says why: the peer gets it.
    let mut failed: Option<rustls::Error> = None;
    loop {
        let status = conn.process(&mut incoming[..filled]);
        let discard = status.discard;
        let (mut read_more, mut traffic) = (false, false);
        let state = match (status.state, failed.take()) {
            // The alert, once: processing again would meet the same fault.
            (Ok(ConnectionState::EncodeTlsData(mut alert)), Some(e)) => {
                outgoing.resize(pending + 64, 0);
                if let Ok(n) = alert.encode(&mut outgoing[pending..]) {
                    let _ = Until { s: sock, deadline }.write_all(&outgoing[..pending + n]);
                }
                return Err(io::Error::other(e));
            }
            (_, Some(e)) => return Err(io::Error::other(e)),
            (Err(e), None) => {
                failed = Some(e);
                incoming.copy_within(discard..filled, 0);
                filled -= discard;
                continue;
            }
            (Ok(s), None) => s,
        };
        match state {
            ConnectionState::EncodeTlsData(mut e) => loop {
                match e.encode(&mut outgoing[pending..]) {
                    Ok(n) => {
                        pending += n;
                        break;
                    }
                    Err(EncodeError::InsufficientSize(s)) => {
                        if pending + s.required_size > HANDSHAKE_MAX {
                            return Err(too_long("our flight"));
                        }
                        outgoing.resize(pending + s.required_size, 0);
                    }
                    Err(e) => return Err(io::Error::other(e)),
                }
            },
            ConnectionState::TransmitTlsData(t) => {
                Until { s: sock, deadline }.write_all(&outgoing[..pending])?;
                pending = 0;
                t.done();
            }
            ConnectionState::BlockedHandshake => read_more = true,
            ConnectionState::WriteTraffic(_) => traffic = true,
            // The peer spoke right behind its Finished, in the bytes we read with it.
            ConnectionState::ReadTraffic(mut r) => {
                while let Some(record) = r.next_record() {
                    let record = record.map_err(io::Error::other)?;
                    if early.plain.len() + record.payload.len() > HANDSHAKE_MAX {
                        return Err(too_long("early data"));
                    }
                    early.plain.extend_from_slice(record.payload);
                }
            }
            other => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("tls handshake ended in {other:?}"),
                ));
            }
        }
        incoming.copy_within(discard..filled, 0);
        filled -= discard;
        if traffic {
            // A server may send before the client's Finished; we wait for it (client auth).
            if !conn.handshaking() {
                early.raw = incoming[..filled].to_vec();
                return Ok(early);
            }
            read_more = true;
        }
        if read_more {
            if filled == incoming.len() {
                if incoming.len() >= HANDSHAKE_MAX {
                    return Err(too_long("the peer's flight"));
                }
                incoming.resize(incoming.len() * 2, 0);
            }
            let n = Until { s: sock, deadline }.read(&mut incoming[filled..])?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            filled += n;
        }
    }
}

impl Sealing {
    /// Seals up to a batch of `bufs` and writes it whole; returns the plaintext bytes taken.
    fn write_vectored(&mut self, sock: &TcpStream, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.out.clear();
        let n = self.sealer.seal(bufs, SEAL_BATCH, &mut self.out)?;
        if let Err(e) = (&*sock).write_all(&self.out) {
            // Part of a record may be on the wire: nothing sealed after it could be read.
            self.sealer.break_off();
            return Err(e);
        }
        Ok(n)
    }
}

impl Read for DataStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            DataStream::Plain(s) => s.read(buf),
            DataStream::Tls(t) => {
                let sock = &t.sock;
                t.opener
                    .read(&mut [IoSliceMut::new(buf)], |b| (&*sock).read(b))
            }
            DataStream::Kernel(k) => k.rx.read(
                k.sock.as_fd(),
                &mut [IoSliceMut::new(buf)],
                rustix::net::RecvFlags::empty(),
            ),
        }
    }
}

impl Write for DataStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            DataStream::Plain(s) => s.write_vectored(bufs),
            DataStream::Tls(t) => t.seal.write_vectored(&t.sock, bufs),
            DataStream::Kernel(k) => k.tx.write_vectored(&k.sock, bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl kvfabric_rt::admission::Shed for DataStream {
    fn shed(&self) {
        let _ = self.socket().shutdown(Shutdown::Both);
    }
}

impl Socket for DataStream {
    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        self.socket().shutdown(how)
    }
    fn set_timeout(&self, t: Duration) -> io::Result<()> {
        self.socket().set_read_timeout(Some(t))
    }
    fn set_send_timeout(&self, t: Duration) -> io::Result<()> {
        self.socket().set_write_timeout(Some(t))
    }
    fn duplicate(&self) -> io::Result<Self> {
        match self {
            DataStream::Plain(s) => s.try_clone().map(DataStream::Plain),
            // One session cannot be written from two places.
            DataStream::Tls(_) | DataStream::Kernel(_) => Err(io::ErrorKind::Unsupported.into()),
        }
    }
}

/// The sending half of a data connection, shared by whoever holds the connection's turn to
/// write (the sealer's lock is then never contended).
#[derive(Debug)]
pub(crate) struct DataWriter {
    sock: TcpStream,
    seal: Seal,
}

/// Who seals what the writer writes.
#[derive(Debug)]
enum Seal {
    Plain,
    User(Mutex<Sealing>),
    Kernel(Mutex<KernelTx>),
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl std::fmt::Debug for Sealing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sealing")
    }
}

impl DataWriter {
    pub(crate) fn socket(&self) -> &TcpStream {
        &self.sock
    }

    /// A writer for the holder of the turn to write.
    pub(crate) fn lock(&self) -> Out<'_> {
        Out {
            sock: &self.sock,
            seal: match &self.seal {
                Seal::Plain => OutSeal::Plain,
                Seal::User(m) => OutSeal::User(locked(m)),
                Seal::Kernel(m) => OutSeal::Kernel(locked(m)),
            },
        }
    }

    /// `plain` as the bytes to put on the wire (sealed, under TLS in userspace).
    pub(crate) fn wire_bytes(&self, plain: Vec<u8>) -> io::Result<Vec<u8>> {
        let Seal::User(seal) = &self.seal else {
            return Ok(plain);
        };
        let mut seal = locked(seal);
        let mut out = Vec::with_capacity(plain.len() + plain.len() / MAX_PLAIN * 22 + 22);
        seal.sealer
            .seal(&[IoSlice::new(&plain)], plain.len(), &mut out)?;
        Ok(out)
    }

    /// Says close_notify to a TLS peer, if nobody is writing now (best effort: the socket is
    /// shut down next either way).
    pub(crate) fn close_notify(&self) {
        let seal = match &self.seal {
            Seal::Plain => return,
            Seal::Kernel(m) => {
                if let Ok(mut tx) = m.try_lock() {
                    tx.close_notify(self.sock.as_fd());
                }
                return;
            }
            Seal::User(m) => m.try_lock(),
        };
        let Ok(mut seal) = seal else {
            return;
        };
        let mut out = Vec::new();
        if seal.sealer.close_notify(&mut out).is_ok() {
            let _ = rustix::net::send(
                &self.sock,
                &out,
                rustix::net::SendFlags::DONTWAIT | rustix::net::SendFlags::NOSIGNAL,
            );
        }
        seal.sealer.break_off();
    }
}

/// Writes for the holder of the turn to write: straight to the socket, or sealed.
pub(crate) struct Out<'a> {
    sock: &'a TcpStream,
    seal: OutSeal<'a>,
}

enum OutSeal<'a> {
    Plain,
    User(MutexGuard<'a, Sealing>),
    Kernel(MutexGuard<'a, KernelTx>),
}

impl Out<'_> {
    /// Bytes already on the wire's terms (sealed before, or for the kernel to seal), written as
    /// they are.
    pub(crate) fn write_wire(&mut self, bytes: &[u8]) -> io::Result<()> {
        match &mut self.seal {
            OutSeal::Kernel(tx) => tx.write_all(self.sock, bytes),
            seal => {
                let r = self.sock.write_all(bytes);
                if r.is_err()
                    && let OutSeal::User(s) = seal
                {
                    s.sealer.break_off();
                }
                r
            }
        }
    }
}

impl Write for Out<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match &mut self.seal {
            OutSeal::Plain => self.sock.write_vectored(bufs),
            OutSeal::User(s) => s.write_vectored(self.sock, bufs),
            OutSeal::Kernel(tx) => tx.write_vectored(self.sock, bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;
    use std::thread;

    use super::super::tls_record::RecordError;
    use super::*;

    const NAME: &str = "t.default.kvfabric";

    fn tls() -> DataTls {
        DataTls::throwaway(NAME)
    }

    fn deadline() -> Instant {
        Instant::now() + Duration::from_secs(10)
    }

    /// Both ends of one TLS data connection over loopback tcp.
    fn pair(
        client: &DataTls,
        server: &DataTls,
    ) -> (io::Result<DataStream>, io::Result<DataStream>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let server = server.clone();
        let accepted = thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            DataStream::accept(s, Some(&server), deadline())
        });
        let c = DataStream::connect(TcpStream::connect(addr).unwrap(), Some(client), deadline());
        (c, accepted.join().unwrap())
    }

    /// Both ends with records sealed in userspace.
    fn tls_pair() -> (Box<TlsStream>, Box<TlsStream>) {
        let t = tls();
        match pair(&t, &t) {
            (Ok(DataStream::Tls(c)), Ok(DataStream::Tls(s))) => (c, s),
            _ => panic!("tls handshake failed"),
        }
    }

    fn pattern(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// Key updates the writer's sealer made.
    fn sealer_updates(w: &DataWriter) -> u64 {
        match &w.seal {
            Seal::Plain => 0,
            Seal::User(m) => locked(m).sealer.updates,
            Seal::Kernel(m) => locked(m).updates,
        }
    }

    fn record_error(e: &io::Error) -> Option<RecordError> {
        e.get_ref()?.downcast_ref::<RecordError>().cloned()
    }

    #[test]
    fn bytes_cross_both_ways_through_the_split_halves_and_key_updates() {
        let (mut c, mut s) = tls_pair();
        // A key update every 5 records each way (the real limit is millions).
        c.seal.sealer.update_after = 5;
        s.seal.sealer.update_after = 5;
        let data = pattern(3 << 20, 7);
        let echo = thread::spawn(move || {
            let (w, mut r) = DataStream::Tls(s).split().unwrap();
            let mut got = vec![0u8; 3 << 20];
            // Scattered over many destinations, as a chunk's pieces are.
            let mut bufs: Vec<IoSliceMut<'_>> =
                got.chunks_mut(40_000).map(IoSliceMut::new).collect();
            super::super::io::read_exact_vectored(&mut r, &mut bufs).unwrap();
            w.lock().write_all(&got).unwrap();
            (got, sealer_updates(&w), r)
        });
        let (w, mut r) = DataStream::Tls(c).split().unwrap();
        let halves: Vec<IoSlice<'_>> = data.chunks(100_000).map(IoSlice::new).collect();
        super::super::io::write_all_vectored(&mut w.lock(), &mut halves.clone()).unwrap();
        let mut back = vec![0u8; 3 << 20];
        r.read_exact(&mut back).unwrap();
        let (got, server_updates, _r) = echo.join().unwrap();
        assert!(got == data && back == data, "every byte, both ways");
        let client_updates = sealer_updates(&w);
        // 3 MiB = 192 records: an update every 5.
        assert!(
            client_updates >= 30 && server_updates >= 30,
            "{client_updates} {server_updates}"
        );
    }

    #[test]
    fn pieces_of_every_size_arrive_whole() {
        let (c, s) = tls_pair();
        // Pieces around the record size, and runs of tiny ones.
        let sizes = [
            1, 7, 4095, 4096, 4097, 16383, 16384, 16385, 100_000, 3, 64, 64, 64, 40_000,
        ];
        let data = pattern(sizes.iter().sum::<usize>() * 4, 5);
        let total = data.len();
        let reader = thread::spawn(move || {
            let (_w, mut r) = DataStream::Tls(s).split().unwrap();
            let mut got = vec![0u8; total];
            r.read_exact(&mut got).unwrap();
            got
        });
        let (w, _r) = DataStream::Tls(c).split().unwrap();
        let mut pieces = Vec::new();
        let mut at = 0;
        for n in sizes.iter().cycle().take(sizes.len() * 4) {
            pieces.push(IoSlice::new(&data[at..at + n]));
            at += n;
        }
        super::super::io::write_all_vectored(&mut w.lock(), &mut pieces).unwrap();
        assert!(reader.join().unwrap() == data, "every byte, in order");
    }

    /// Writes `wire` as raw bytes on the client's socket and reads what the server makes of it
    /// into a zeroed buffer: the error, and whether any byte landed.
    fn server_reads(
        c: &TlsStream,
        s: Box<TlsStream>,
        wire: &[u8],
        len: usize,
    ) -> (io::Result<()>, bool) {
        (&c.sock).write_all(wire).unwrap();
        c.sock.shutdown(Shutdown::Write).unwrap();
        let (_w, mut r) = DataStream::Tls(s).split().unwrap();
        let mut dst = vec![0u8; len];
        let got = r.read_exact(&mut dst);
        (got, dst.iter().any(|&b| b != 0))
    }

    fn sealed(c: &mut TlsStream, plain: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        c.seal
            .sealer
            .seal(&[IoSlice::new(plain)], plain.len(), &mut out)
            .unwrap();
        out
    }

    #[test]
    fn a_flipped_bit_fails_the_connection_and_lands_no_byte() {
        for at in [0usize, 3, 4, 5, 100, 16_000] {
            let (mut c, s) = tls_pair();
            let plain = pattern(16_384, 3);
            let mut wire = sealed(&mut c, &plain);
            wire[at] ^= 0x10;
            let (got, landed) = server_reads(&c, s, &wire, plain.len());
            let e = got.unwrap_err();
            assert!(record_error(&e).is_some(), "flip at {at}: {e}");
            assert!(!landed, "flip at {at}: plaintext of a bad record landed");
        }
    }

    #[test]
    fn a_replayed_or_reordered_record_fails() {
        let (mut c, s) = tls_pair();
        let first = sealed(&mut c, b"first");
        let mut wire = first.clone();
        wire.extend_from_slice(&first);
        let (got, _) = server_reads(&c, s, &wire, 10);
        assert_eq!(
            record_error(&got.unwrap_err()),
            Some(RecordError::Authentication { seq: 1 })
        );

        let (mut c, s) = tls_pair();
        let a = sealed(&mut c, b"aaaa");
        let b = sealed(&mut c, b"bbbb");
        let (got, landed) = server_reads(&c, s, &[b, a].concat(), 8);
        assert_eq!(
            record_error(&got.unwrap_err()),
            Some(RecordError::Authentication { seq: 0 })
        );
        assert!(!landed);
    }

    #[test]
    fn bad_headers_are_named_and_a_cut_record_is_an_error_not_an_end() {
        let (mut c, s) = tls_pair();
        let mut wire = sealed(&mut c, b"x");
        wire[0] = 22;
        let e = server_reads(&c, s, &wire, 1).0.unwrap_err();
        assert!(
            matches!(
                record_error(&e),
                Some(RecordError::Header { field: "type", .. })
            ),
            "{e}"
        );

        let (mut c, s) = tls_pair();
        let mut wire = sealed(&mut c, b"x");
        wire[3..5].copy_from_slice(&20_000u16.to_be_bytes());
        let e = server_reads(&c, s, &wire, 1).0.unwrap_err();
        assert!(
            matches!(
                record_error(&e),
                Some(RecordError::Header {
                    field: "length",
                    ..
                })
            ),
            "{e}"
        );

        let (mut c, s) = tls_pair();
        let wire = sealed(&mut c, &pattern(1000, 1));
        let e = server_reads(&c, s, &wire[..500], 1000).0.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn close_notify_ends_the_stream_cleanly() {
        let (mut c, s) = tls_pair();
        let mut wire = sealed(&mut c, b"last words");
        c.seal.sealer.close_notify(&mut wire).unwrap();
        (&c.sock).write_all(&wire).unwrap();
        let (_w, mut r) = DataStream::Tls(s).split().unwrap();
        let mut all = Vec::new();
        // Ends at close_notify, though the socket stays open.
        r.read_to_end(&mut all).unwrap();
        assert_eq!(all, b"last words");
    }

    #[test]
    fn a_certificate_of_another_ca_is_refused_both_ways() {
        let (ours, theirs) = (tls(), tls());
        let (c, s) = pair(&theirs, &ours);
        assert!(c.is_err() || s.is_err());
        assert!(s.is_err(), "the target took a stranger's certificate");
        let (c, _s) = pair(&ours, &theirs);
        assert!(c.is_err(), "the initiator took a stranger's target");
    }

    /// Our records against a plain rustls peer (its own record layer): both directions, a key
    /// update each way (theirs asks for ours), and their close_notify.
    #[test]
    fn the_data_port_agrees_on_aes_128_gcm() {
        let (c, s) = tls_pair();
        for t in [&c, &s] {
            assert_eq!(t.seal.sealer.algorithm(), &aws_lc_rs::aead::AES_128_GCM);
        }
    }

    /// A plain rustls server offering only `suite` (the data port's certificate, no client
    /// certificate asked: the records are what is tried here): our records cross both ways
    /// under it, through its KeyUpdate and ours.
    fn through_a_plain_rustls_peer(suite: rustls::SupportedCipherSuite) {
        let t = tls();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let ours = t.server_config();
        let provider = rustls::crypto::CryptoProvider {
            cipher_suites: vec![suite],
            ..(**ours.crypto_provider()).clone()
        };
        let config = std::sync::Arc::new(
            rustls::ServerConfig::builder_with_provider(provider.into())
                .with_protocol_versions(&[&rustls::version::TLS13])
                .unwrap()
                .with_no_client_auth()
                .with_cert_resolver(ours.cert_resolver.clone()),
        );
        let peer = thread::spawn(move || {
            let (sock, _) = l.accept().unwrap();
            let conn = rustls::ServerConnection::new(config).unwrap();
            let mut s = rustls::StreamOwned::new(conn, sock);
            let mut got = vec![0u8; 1 << 20];
            s.read_exact(&mut got).unwrap();
            assert_eq!(s.conn.negotiated_cipher_suite(), Some(suite));
            s.conn.refresh_traffic_keys().unwrap();
            s.write_all(&got).unwrap();
            // Our sealer updated its key when asked: this is read under the newer one.
            let mut tail = [0u8; 4];
            s.read_exact(&mut tail).unwrap();
            assert_eq!(&tail, b"tail");
            s.conn.send_close_notify();
            s.flush().unwrap();
            got
        });
        let DataStream::Tls(mut c) =
            DataStream::connect(TcpStream::connect(addr).unwrap(), Some(&t), deadline()).unwrap()
        else {
            panic!("plaintext")
        };
        c.seal.sealer.update_after = 7;
        let data = pattern(1 << 20, 11);
        let (w, mut r) = DataStream::Tls(c).split().unwrap();
        w.lock().write_all(&data).unwrap();
        let mut back = vec![0u8; 1 << 20];
        r.read_exact(&mut back).unwrap();
        assert!(back == data);
        w.lock().write_all(b"tail").unwrap();
        assert_eq!(r.read(&mut [0u8; 8]).unwrap(), 0, "their close_notify");
        assert!(peer.join().unwrap() == data);
        let updates = sealer_updates(&w);
        assert!(updates >= 9, "{updates}");
    }

    #[test]
    fn a_plain_rustls_peer_reads_and_writes_our_records_in_every_suite() {
        use rustls::crypto::ring::cipher_suite::{
            TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256,
        };
        for suite in [
            TLS13_AES_128_GCM_SHA256,
            TLS13_AES_256_GCM_SHA384,
            TLS13_CHACHA20_POLY1305_SHA256,
        ] {
            through_a_plain_rustls_peer(suite);
        }
    }

    fn kernel_offered() -> bool {
        matches!(RecordLayer::probe(), RecordLayer::Kernel { .. })
    }

    /// One connection whose client and server seal in the kernel (where it offers TLS) or in
    /// userspace, as asked.
    fn layered_pair(client_kernel: bool, server_kernel: bool) -> (DataStream, DataStream) {
        let t = tls();
        let layer = |kernel: bool| t.clone().kernel_records(kernel);
        let (c, s) = pair(&layer(client_kernel), &layer(server_kernel));
        let (c, s) = (c.unwrap(), s.unwrap());
        for (end, kernel) in [(&c, client_kernel), (&s, server_kernel)] {
            let sealed_by_kernel = matches!(end, DataStream::Kernel(_));
            assert_eq!(
                sealed_by_kernel,
                kernel && kernel_offered(),
                "the layer asked for"
            );
            assert!(!matches!(end, DataStream::Plain(_)));
        }
        (c, s)
    }

    /// Both ends update their sending key every `n` records.
    fn update_every(end: &mut DataStream, n: u64) {
        match end {
            DataStream::Tls(t) => t.seal.sealer.update_after = n,
            DataStream::Kernel(k) => k.tx.update_after = n,
            DataStream::Plain(_) => {}
        }
    }

    /// 3 MiB from the client, echoed by the server, every byte checked both ways; the key
    /// updates each side's writer made.
    fn echo(c: DataStream, s: DataStream) -> io::Result<(u64, u64)> {
        let data = pattern(3 << 20, 9);
        let echo = thread::spawn(move || -> io::Result<u64> {
            let (w, mut r) = s.split()?;
            let mut got = vec![0u8; 3 << 20];
            let mut bufs: Vec<IoSliceMut<'_>> =
                got.chunks_mut(40_000).map(IoSliceMut::new).collect();
            super::super::io::read_exact_vectored(&mut r, &mut bufs)?;
            w.lock().write_all(&got)?;
            w.close_notify();
            Ok(sealer_updates(&w))
        });
        let (w, mut r) = c.split()?;
        let pieces: Vec<IoSlice<'_>> = data.chunks(100_000).map(IoSlice::new).collect();
        super::super::io::write_all_vectored(&mut w.lock(), &mut pieces.clone())?;
        let mut back = Vec::new();
        r.read_to_end(&mut back)?;
        let server = echo.join().unwrap()?;
        assert!(back == data, "every byte, both ways, then close_notify");
        Ok((sealer_updates(&w), server))
    }

    /// Kernel TLS where this kernel offers it (the userspace fallback where it does not, which
    /// the pair must then have got): both ways, against itself and against our userspace
    /// records, with key updates from both ends and close_notify through the kernel.
    #[test]
    fn kernel_records_cross_both_ways_against_either_layer() {
        let rekey = matches!(RecordLayer::probe(), RecordLayer::Kernel { rekey: true });
        for (ck, sk) in [(true, true), (true, false), (false, true)] {
            let (c, s) = layered_pair(ck, sk);
            let (cu, su) = echo(c, s).unwrap();
            assert_eq!((cu, su), (0, 0), "no key update asked for");
            if kernel_offered() && !rekey {
                continue;
            }
            let (mut c, mut s) = layered_pair(ck, sk);
            update_every(&mut c, 5);
            update_every(&mut s, 5);
            let (cu, su) = echo(c, s).unwrap();
            // 3 MiB = 192 records each way: an update every 5.
            assert!(cu >= 30 && su >= 30, "{ck}/{sk}: {cu} {su}");
        }
    }

    /// Where the kernel opens the records: a flipped bit fails the read with a typed error and
    /// lands no byte; a replayed record too; a userspace peer's KeyUpdate is taken (or, on a
    /// kernel without rekey, ends the connection with a typed error).
    #[test]
    fn the_kernel_refuses_a_bad_record_and_lands_no_byte() {
        for at in [0usize, 5, 100, 16_000] {
            let (c, s) = layered_pair(false, true);
            let DataStream::Tls(mut c) = c else {
                panic!("userspace client")
            };
            let plain = pattern(16_384, 3);
            let mut wire = sealed(&mut c, &plain);
            wire[at] ^= 0x10;
            (&c.sock).write_all(&wire).unwrap();
            c.sock.shutdown(Shutdown::Write).unwrap();
            let kernel = matches!(s, DataStream::Kernel(_));
            let (_w, mut r) = s.split().unwrap();
            let mut dst = vec![0u8; plain.len()];
            let e = match r.read_exact(&mut dst) {
                // Linux builds a TLS 1.3 record's additional data with type 23 whatever the
                // header says, so it passes a flipped outer type byte; what lands is then
                // still the authenticated plaintext, byte for byte.
                Ok(()) if kernel && at == 0 => {
                    assert!(
                        dst == plain,
                        "the outer type flipped: only the sealed bytes"
                    );
                    continue;
                }
                Ok(()) => panic!("flip at {at}: the record was taken"),
                Err(e) => e,
            };
            assert!(record_error(&e).is_some(), "flip at {at}: {e}");
            assert!(dst.iter().all(|&b| b == 0), "flip at {at}: a byte landed");
            assert!(r.read(&mut dst).is_err(), "broken after");
        }
        let (c, s) = layered_pair(false, true);
        let DataStream::Tls(mut c) = c else {
            panic!("userspace client")
        };
        let first = sealed(&mut c, b"first");
        (&c.sock)
            .write_all(&[first.clone(), first].concat())
            .unwrap();
        let (_w, mut r) = s.split().unwrap();
        let (mut got, mut dst) = (Vec::new(), [0u8; 10]);
        let e = loop {
            match r.read(&mut dst) {
                Ok(0) => panic!("the replay ended the stream without an error"),
                Ok(n) => got.extend_from_slice(&dst[..n]),
                Err(e) => break e,
            }
        };
        assert!(record_error(&e).is_some(), "replay: {e}");
        assert!(b"first".starts_with(&got), "only the first record's bytes");
    }
}
