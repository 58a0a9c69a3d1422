//! TLS on the tcp data port, end to end: two engines with certificates of one CA move every
//! byte both ways through records their own threads seal; a stranger's certificate is
//! refused; a plain rustls client speaks the whole handshake through the target's records;
//! and one flipped bit in one record ends that connection only, landing nothing.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use common::{bytes, config, hello_for, random_region, read_challenge, read_frame, target};
use kvfabric_engine::frame::{FLAG_ERROR, FrameKind, Header, PROTOCOL_VERSION};
use kvfabric_engine::{
    Batch, BlockOp, DataTls, Engine, EngineConfig, Preference, Region, RegionId, TransportKind,
};

const NAME: &str = "tls-test.default.kvfabric";

fn tls() -> DataTls {
    DataTls::throwaway(NAME)
}

fn with_tls(name: &str, tls: &DataTls) -> EngineConfig {
    EngineConfig {
        tls: Some(tls.clone()),
        ..config(name)
    }
}

fn ops(local: RegionId, remote: RegionId, n: u64, len: u64) -> Vec<BlockOp> {
    // Scattered: op i takes remote block n-1-i.
    (0..n)
        .map(|i| BlockOp {
            local_region: local,
            local_offset: i * len,
            remote_region: remote,
            remote_offset: (n - 1 - i) * len,
            len,
        })
        .collect()
}

/// Block i of `local` holds block n-1-i of `remote` (what `ops` moves).
fn assert_reversed(local: &Region, remote: &Region, n: u64, block: u64, what: &str) {
    let (l, r, b) = (bytes(local), bytes(remote), block as usize);
    for i in 0..n as usize {
        let j = n as usize - 1 - i;
        assert!(
            l[i * b..(i + 1) * b] == r[j * b..(j + 1) * b],
            "{what} block {i}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_with_mtls_move_every_byte_and_a_stranger_is_refused() {
    let ca = tls();
    let t = target(with_tls("tls-target", &ca)).await;
    let initiator = Engine::new(with_tls("tls-initiator", &ca)).unwrap();
    let (block, n) = (48 << 10, 160u64);
    let remote = random_region(&t.engine, block * n, 1);
    let local = random_region(&initiator, block * n, 2);
    let peer = initiator
        .connect(
            &t.engine.descriptor(),
            t.engine.data_secret(),
            Preference::Only(TransportKind::Tcp),
            None,
        )
        .await
        .unwrap();
    // Pull: every destination block holds its source block.
    peer.submit(Batch::read(ops(local.id(), remote.id(), n, block)))
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_reversed(&local, &remote, n, block, "pulled");
    // Push fresh bytes back, and a lone small op (the inline write path, sealed too).
    let fresh = random_region(&initiator, block * n, 3);
    peer.submit(Batch::write(ops(fresh.id(), remote.id(), n, block)))
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_reversed(&fresh, &remote, n, block, "pushed");
    let small = vec![BlockOp {
        local_region: local.id(),
        local_offset: 0,
        remote_region: remote.id(),
        remote_offset: 4096,
        len: 4096,
    }];
    let p = Arc::new(peer);
    let p2 = p.clone();
    tokio::task::spawn_blocking(move || p2.run(Batch::write(small)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(bytes(&remote)[4096..8192], bytes(&local)[..4096]);

    // An initiator whose certificate another CA signed gets no connection.
    let stranger = Engine::new(with_tls("tls-stranger", &tls())).unwrap();
    let refused = stranger
        .connect(
            &t.engine.descriptor(),
            t.engine.data_secret(),
            Preference::Only(TransportKind::Tcp),
            None,
        )
        .await;
    assert!(refused.is_err(), "a stranger's certificate was let in");
    // The target serves on.
    p.submit(Batch::read(ops(local.id(), remote.id(), 4, block)))
        .unwrap()
        .wait()
        .await
        .unwrap();
}

/// A rustls client of the target's CA over a blocking socket.
fn rustls_client(
    ca: &DataTls,
    addr: std::net::SocketAddr,
) -> rustls::StreamOwned<rustls::ClientConnection, TcpStream> {
    let sock = TcpStream::connect(addr).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let conn = rustls::ClientConnection::new(ca.client_config(), ca.server_name()).unwrap();
    rustls::StreamOwned::new(conn, sock)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_rustls_client_speaks_through_the_records_and_a_flipped_bit_ends_only_its_connection()
 {
    let ca = tls();
    let t = target(with_tls("tls-target-2", &ca)).await;
    let remote = random_region(&t.engine, 1 << 20, 5);
    let before = bytes(&remote);
    let d = t.engine.descriptor();
    let addr = d.endpoints.tcp.unwrap();
    let secret = t.engine.data_secret().clone();
    let name = d.name.clone();
    let ca2 = ca.clone();
    tokio::task::spawn_blocking(move || {
        // The whole kvfabric handshake through rustls' own record layer: Welcome.
        let mut s = rustls_client(&ca2, addr);
        let challenge = read_challenge(&mut s);
        let hello = hello_for(&challenge, &secret, PROTOCOL_VERSION, &name, None);
        let body = serde_json::to_vec(&hello).unwrap();
        s.write_all(&Header::new(FrameKind::Hello, 0, 0, body.len() as u64).encode())
            .unwrap();
        s.write_all(&body).unwrap();
        let (h, _) = read_frame(&mut s);
        assert_eq!(h.kind, FrameKind::Welcome);
        assert!(!h.has(FLAG_ERROR));

        // A KeepAlive frame sealed by rustls, one bit flipped on the wire.
        let mut frame = Vec::new();
        s.conn
            .writer()
            .write_all(&Header::new(FrameKind::KeepAlive, 0, 0, 0).encode())
            .unwrap();
        s.conn.write_tls(&mut frame).unwrap();
        let last = frame.len() - 3;
        frame[last] ^= 1;
        s.sock.write_all(&frame).unwrap();
        // The target ends this connection: the socket closes (a reset, or the end).
        let mut rest = [0u8; 256];
        loop {
            match s.sock.read(&mut rest) {
                Ok(0) => break,
                Ok(_) => continue,
                Err(e) => {
                    // Not our own read timeout: the target hung up.
                    let waited = matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    );
                    assert!(
                        !waited,
                        "the target kept a connection with a bad record: {e}"
                    );
                    break;
                }
            }
        }
    })
    .await
    .unwrap();
    // Nothing of that connection touched the target's memory, and it serves others.
    assert!(bytes(&remote) == before);
    let initiator = Engine::new(with_tls("tls-initiator-2", &ca)).unwrap();
    let local = initiator.alloc(1 << 20).unwrap();
    let peer = initiator
        .connect(
            &d,
            t.engine.data_secret(),
            Preference::Only(TransportKind::Tcp),
            None,
        )
        .await
        .unwrap();
    peer.submit(Batch::read(ops(local.id(), remote.id(), 16, 64 << 10)))
        .unwrap()
        .wait()
        .await
        .unwrap();
    let (l, r) = (bytes(&local), bytes(&remote));
    assert!(l[..64 << 10] == r[15 * (64 << 10)..]);
}
