//! kvfabric-operator binary: parse config, start the HTTP server, check the CRD, take the Lease,
//! run the controller until SIGTERM/SIGINT; or `render` (a dry run) and `uninstall` (the chart's
//! uninstall hook).
#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::sync::Arc;

use kvfabric_operator::config::{Cli, Command, KubeVersion, Settings};
use kvfabric_operator::metrics::Metrics;
use kvfabric_operator::reconcile::{Context, check_crd_installed, run_controller};
use kvfabric_operator::server::{Health, Phase, serve};
use kvfabric_operator::{Error, Result, leader, render, uninstall};
use tokio::sync::watch;

use kvfabric_rt::args::EXIT_USAGE as EXIT_CONFIG;

fn fail(e: &Error) -> ExitCode {
    tracing::error!(error = %e, "exiting");
    eprintln!("kvfabric-operator: {e}");
    ExitCode::FAILURE
}

fn usage(e: &Error) -> ExitCode {
    eprintln!("kvfabric-operator: {e}");
    ExitCode::from(EXIT_CONFIG)
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli: Cli = match kvfabric_rt::args::parse() {
        Ok(c) => c,
        Err(exit) => return exit,
    };
    match cli.command {
        Some(Command::Render(args)) => {
            let mut agents = match cli.agents.settings() {
                Ok(a) => a,
                Err(e) => return usage(&e),
            };
            agents.kube = args.kube_version;
            match render::render_file(&args.file, &agents) {
                Ok(yaml) => {
                    print!("{yaml}");
                    ExitCode::SUCCESS
                }
                Err(e) => fail(&e),
            }
        }
        Some(Command::Uninstall(args)) => {
            tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
                .init();
            let run = async {
                let client = kube::Client::try_default().await.map_err(|e| {
                    Error::kube("create client from kubeconfig/in-cluster config", e)
                })?;
                uninstall::uninstall(&client, &args).await
            };
            match run.await {
                Ok(report) => {
                    println!(
                        "kvfabric-operator uninstall: {} fabric(s) found, {} deleted, {} left without the finalizer",
                        report.found, report.deleted, report.unfinalized
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => fail(&e),
            }
        }
        None => {
            let settings = match cli.run.settings(&cli.agents) {
                Ok(s) => s,
                Err(e) => return usage(&e),
            };
            tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(&settings.log_level))
                .init();
            match run(settings).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => fail(&e),
            }
        }
    }
}

async fn on(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
}

async fn run(settings: Settings) -> Result<()> {
    let stop = kvfabric_rt::shutdown::watch();
    let metrics = Arc::new(Metrics::default());
    let health = Health::new(metrics.clone());
    let server = tokio::spawn(serve(
        settings.metrics_addr,
        health.clone(),
        on(stop.clone()),
    ));

    let client = kube::Client::try_default()
        .await
        .map_err(|e| Error::kube("create client from kubeconfig/in-cluster config", e))?;
    check_crd_installed(&client, settings.namespace.as_deref()).await?;
    let mut agents = settings.agents.clone();
    // DRA fields exist in their GA shape from 1.31 on; an older server gets a typed refusal.
    agents.kube = match client.apiserver_version().await {
        Ok(info) => KubeVersion::from_info(&info.major, &info.minor),
        Err(e) => {
            tracing::warn!(error = %e, "reading the API server version failed; assuming a current one");
            None
        }
    };
    tracing::info!(kube = ?agents.kube, image = %agents.image, socket_root = %agents.socket_root, "agent settings");
    let ctx = Arc::new(Context::new(
        client.clone(),
        metrics,
        settings.cleanup.clone(),
        agents,
    ));

    let mut lost_lease = false;
    if let Some((ns, name)) = &settings.lease {
        let identity = std::env::var("POD_NAME")
            .unwrap_or_else(|_| format!("kvfabric-operator-{}", std::process::id()));
        let mut leadership = leader::campaign(client, ns, name, &identity).await?;
        health.set(Phase::Standby);
        tracing::info!(lease = %format!("{ns}/{name}"), %identity, "waiting for the lease");
        tokio::select! {
            r = leadership.acquired() => r?,
            _ = on(stop.clone()) => {
                leadership.release().await;
                return finish(&health, server).await;
            }
        }
        tracing::info!("acquired the lease; starting the controller");
        health.set(Phase::Running);
        let lost = leadership.lost();
        let (lost_tx, lost_rx) = watch::channel(false);
        let trigger = {
            let stop = on(stop.clone());
            async move {
                tokio::select! {
                    _ = stop => {}
                    _ = lost => { let _ = lost_tx.send(true); }
                }
            }
        };
        run_controller(ctx, settings.namespace.clone(), trigger).await;
        lost_lease = *lost_rx.borrow();
        leadership.release().await;
    } else {
        health.set(Phase::Running);
        run_controller(ctx, settings.namespace.clone(), on(stop.clone())).await;
    }
    finish(&health, server).await?;
    if lost_lease {
        // Exit so the kubelet restarts us and we campaign afresh, with empty caches.
        return Err(Error::Leader {
            lease: settings
                .lease
                .map(|(ns, name)| format!("{ns}/{name}"))
                .unwrap_or_default(),
            message: "lost the lease".to_owned(),
        });
    }
    Ok(())
}

async fn finish(health: &Health, server: tokio::task::JoinHandle<Result<()>>) -> Result<()> {
    health.set(Phase::Stopping);
    server.abort();
    match server.await {
        Ok(r) => r,
        Err(_) => Ok(()),
    }
}
