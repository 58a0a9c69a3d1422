//! Both sockets served until shutdown: the CSI socket (Identity and Node) and the kubelet's
//! registration socket. Servers take bound listeners, so tests bind in a temporary directory.

use std::future::Future;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Server;

use crate::node::Node;
use crate::pb::csi::identity_server::IdentityServer;
use crate::pb::csi::node_server::NodeServer;
use crate::pb::registration::registration_server::RegistrationServer;
use crate::registration::{Outcome, Registration};
use crate::{Error, Result};

/// Binds a Unix socket at `path`, replacing a socket a previous run left there (never a file
/// of another kind), with the directory made if needed.
pub fn bind(path: &Path) -> Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(Error::io(format!("create {}", dir.display())))?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path).map_err(Error::io(
            format!("remove the old socket {}", path.display()),
        ))?,
        Ok(_) => {
            return Err(Error::Config {
                field: "socket",
                value: path.display().to_string(),
                reason: "exists and is not a socket".to_owned(),
            });
        }
        Err(_) => {}
    }
    UnixListener::bind(path).map_err(Error::io(format!("bind {}", path.display())))
}

fn served(socket: &Path) -> impl FnOnce(tonic::transport::Error) -> Error {
    let socket = socket.display().to_string();
    move |source| Error::Serve { socket, source }
}

/// Serves the CSI API on `csi` and the registration API on `registration` (each a listener and
/// its path, the same on the node: the kubelet is told the CSI socket's) until `shutdown`
/// resolves, or until the kubelet refuses the registration (an error).
pub async fn serve(
    node: Node,
    csi: (UnixListener, PathBuf),
    registration: (UnixListener, PathBuf),
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    let (service, mut heard) = Registration::new(csi.1.clone());
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let csi_server = Server::builder()
        .add_service(IdentityServer::new(node.clone()))
        .add_service(NodeServer::new(node))
        .serve_with_incoming_shutdown(UnixListenerStream::new(csi.0), stopped(stop_rx.clone()));
    let registration_server = Server::builder()
        .add_service(RegistrationServer::new(service))
        .serve_with_incoming_shutdown(
            UnixListenerStream::new(registration.0),
            stopped(stop_rx.clone()),
        );
    let refused = async {
        let said = heard
            .wait_for(|o: &Outcome| matches!(o, Some(Err(_))))
            .await
            .map(|o| o.clone());
        match said {
            Ok(Some(Err(reason))) => reason,
            // The service is gone (shut down): nothing more will be said.
            _ => std::future::pending().await,
        }
    };
    let ended = async {
        let outcome = tokio::select! {
            () = shutdown => Ok(()),
            e = refused => Err(Error::NotRegistered(e)),
        };
        stop_tx.send_replace(true);
        outcome
    };
    let (outcome, csi_result, registration_result) =
        tokio::join!(ended, csi_server, registration_server);
    csi_result.map_err(served(&csi.1))?;
    registration_result.map_err(served(&registration.1))?;
    outcome
}
