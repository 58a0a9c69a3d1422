//! SIGTERM and SIGINT, so servers drain and exit cleanly.

use tokio::signal::unix::{SignalKind, signal as unix_signal};
use tokio::sync::watch;

/// Resolves on the first SIGTERM or SIGINT.
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
            tracing::info!("shutdown signal received");
        }
        (Err(e), _) | (_, Err(e)) => {
            // Without handlers the process still dies on the signal, just without draining.
            tracing::warn!(error = %e, "cannot install signal handlers; no graceful drain");
            std::future::pending::<()>().await
        }
    }
}

/// The same as a channel many tasks can wait on: it turns `true` at the signal.
pub fn watch() -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        signal().await;
        let _ = tx.send(true);
    });
    rx
}
