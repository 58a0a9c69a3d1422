//! Resolves on SIGTERM or SIGINT, so servers can drain and exit cleanly.

use tokio::signal::unix::{SignalKind, signal as unix_signal};

pub async fn signal() {
    match (
        unix_signal(SignalKind::terminate()),
        unix_signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        (Err(e), _) | (_, Err(e)) => {
            // Without handlers the process still dies on the signal, just without draining.
            tracing::warn!(error = %e, "cannot install signal handlers; no graceful drain");
            std::future::pending::<()>().await
        }
    }
}
