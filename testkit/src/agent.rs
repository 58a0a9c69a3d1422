//! An agent served by a task of this process (tests, `kvfabric bench --through-agent`): its own
//! socket directory, loopback ports, and a registry handed in (e.g. a shared in-memory store).

use std::path::{Path, PathBuf};

use kvfabric_agent::registry::SharedRegistry;
use kvfabric_agent::server::Ready;
use kvfabric_agent::telemetry::Telemetry;
use kvfabric_agent::{Agent, AgentConfig, Listeners};
use tokio::sync::watch;

use crate::error::{Error, Result};

/// Stops on drop or `stop`.
#[derive(Debug)]
pub struct InProcessAgent {
    /// The temporary socket directory, when the agent made its own.
    _tmp: Option<tempfile::TempDir>,
    dir: PathBuf,
    stop: watch::Sender<bool>,
    task: Option<tokio::task::JoinHandle<kvfabric_agent::Result<()>>>,
    pub ready: Ready,
}

impl InProcessAgent {
    /// Serves `config` (its socket directory replaced by a fresh temporary one) with
    /// `registry`; `telemetry` is this process's trace pipeline (`Telemetry::default()`: none).
    pub async fn start(
        mut config: AgentConfig,
        registry: SharedRegistry,
        telemetry: Telemetry,
    ) -> Result<Self> {
        let tmp = tempfile::tempdir().map_err(|e| Error::io("agent socket dir", e))?;
        config.socket_dir = tmp.path().to_path_buf();
        Self::serve(config, registry, telemetry, Some(tmp)).await
    }

    /// Serves `config` in the socket directory it names (one the test made, e.g. a mounted
    /// volume), left in place when the agent stops.
    pub async fn start_in_place(
        config: AgentConfig,
        registry: SharedRegistry,
        telemetry: Telemetry,
    ) -> Result<Self> {
        Self::serve(config, registry, telemetry, None).await
    }

    async fn serve(
        config: AgentConfig,
        registry: SharedRegistry,
        telemetry: Telemetry,
        tmp: Option<tempfile::TempDir>,
    ) -> Result<Self> {
        let dir = config.socket_dir.clone();
        let listeners = Listeners::bind(&config).await?;
        let agent = Agent::start(config, listeners, registry, &telemetry).await?;
        let ready = agent.ready().clone();
        let (stop, mut rx) = watch::channel(false);
        let task = tokio::spawn(agent.serve(async move {
            let _ = rx.wait_for(|s| *s).await;
        }));
        Ok(InProcessAgent {
            _tmp: tmp,
            dir,
            stop,
            task: Some(task),
            ready,
        })
    }

    /// A config for [`InProcessAgent::start`]: `AgentConfig::local` named `name`.
    pub fn config(name: &str) -> AgentConfig {
        AgentConfig::local(name, "/nonexistent")
    }

    pub fn socket_dir(&self) -> &Path {
        &self.dir
    }

    /// Drains like SIGTERM would and returns the agent's result.
    pub async fn stop(mut self) -> Result<()> {
        let _ = self.stop.send(true);
        match self.task.take() {
            Some(t) => t
                .await
                .map_err(|e| Error::io("agent task", std::io::Error::other(e)))?
                .map_err(Error::from),
            None => Ok(()),
        }
    }
}

impl Drop for InProcessAgent {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}
