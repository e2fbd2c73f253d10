//! The worker agent's side of the management API: registration (with the worker token kept under
//! the data directory and reused after a restart), heartbeats, and reporting local instances with
//! their health.
//!
//! `faden worker` and the server's embedded worker both run this; the worker's reverse proxy and
//! tunnel are separate pieces that read [`Agent::instances`].

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use control_client::model::{
    InstanceState, ListResponse, MetricsPort, Model, ModelInstance, ProxyMode, Worker,
};

use control_client::client::{ApiClient, ClientError};

/// File (inside the worker's data directory) that keeps the worker token.
pub const WORKER_TOKEN_FILE: &str = "worker.token";

/// Why the agent could not do its job.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Api(#[from] ClientError),
    #[error("worker token file {path}: {source}")]
    TokenFile {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// What the worker tells the server about itself.
#[derive(Clone, Debug, Serialize)]
pub struct Registration {
    pub name: String,
    pub hostname: String,
    pub ip: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub advertise_address: Option<String>,
    pub port: u16,
    pub metrics_port: MetricsPort,
    pub proxy_mode: ProxyMode,
    pub labels: BTreeMap<String, String>,
}

impl Registration {
    /// Whether the server's record of `worker` already says what this registration says.
    pub fn matches(&self, worker: &Worker) -> bool {
        worker.name == self.name
            && worker.ip == self.ip
            && worker.advertise_address == self.advertise_address
            && worker.port == self.port
            && worker.metrics_port == self.metrics_port
            && worker.proxy_mode == self.proxy_mode
    }
}

impl AgentError {
    /// Whether the server refused the credentials or what they name (401, 403, 404: a wrong
    /// or revoked token, a deleted cluster or worker): retrying soon cannot change that.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            AgentError::Api(ClientError::Refused { status, .. })
                if matches!(status.as_u16(), 401 | 403 | 404)
        )
    }
}

/// A local inference process this worker serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalInstance {
    /// The model name; one the server does not know is reported as an orphan.
    pub model: String,
    /// Its port on 127.0.0.1.
    pub port: u16,
}

/// Heartbeat (and in-flight report) interval of a draining worker that counts its requests.
const DRAINING_BEAT: Duration = Duration::from_secs(1);

/// Counts what a worker has in flight (requests, relayed connections).
pub type InFlight = Arc<dyn Fn() -> u64 + Send + Sync>;

/// A registered worker.
#[derive(Debug)]
pub struct Agent {
    api: ApiClient,
    token: String,
    worker: Worker,
    worker_config: Value,
    /// Instance id → local port, as reported to the server; the worker proxy follows it.
    instances: tokio::sync::watch::Sender<HashMap<i64, u16>>,
    /// Asks [`Agent::run`] to heartbeat and check every instance now (see [`Agent::recheck`]).
    recheck: tokio::sync::Notify,
}

impl Agent {
    /// Registers (or, with a stored token that still works, re-attaches) this worker.
    ///
    /// The token is kept in `token_dir/worker.token` (mode 0600) when a directory is given.
    pub async fn register(
        api: ApiClient,
        registration_token: &str,
        registration: &Registration,
        token_dir: Option<PathBuf>,
    ) -> Result<Self, AgentError> {
        let token_path = token_dir.map(|d| d.join(WORKER_TOKEN_FILE));
        if let Some(path) = &token_path
            && let Some(stored) = read_token(path)?
        {
            match Self::reattach(&api, &stored).await? {
                Some(agent) if registration.matches(&agent.worker) => {
                    tracing::info!(
                        worker_id = agent.worker.id,
                        "reusing the stored worker token"
                    );
                    return Ok(agent);
                }
                Some(_) => tracing::info!("worker settings changed; registering again"),
                None => tracing::info!("stored worker token refused; registering again"),
            }
        }
        let body = serde_json::to_value(registration).map_err(|e| ClientError::Answer {
            what: "registration".into(),
            reason: e.to_string(),
        })?;
        let answer: Value = api
            .json(Method::POST, "/v2/workers", registration_token, Some(&body))
            .await?;
        let token = answer["token"]
            .as_str()
            .ok_or_else(|| ClientError::Answer {
                what: "POST /v2/workers".into(),
                reason: "no token in the answer".into(),
            })?
            .to_owned();
        let worker: Worker =
            serde_json::from_value(answer.clone()).map_err(|e| ClientError::Answer {
                what: "POST /v2/workers".into(),
                reason: e.to_string(),
            })?;
        if let Some(path) = &token_path {
            write_token(path, &token)?;
        }
        tracing::info!(worker_id = worker.id, worker = %worker.name, "registered");
        Ok(Self {
            api,
            token,
            worker,
            worker_config: answer.get("worker_config").cloned().unwrap_or(Value::Null),
            instances: tokio::sync::watch::Sender::new(HashMap::new()),
            recheck: tokio::sync::Notify::new(),
        })
    }

    async fn reattach(api: &ApiClient, token: &str) -> Result<Option<Self>, AgentError> {
        let (status, _) = api
            .call(
                Method::POST,
                "/v2/worker-heartbeat",
                token,
                Some(&json!({})),
            )
            .await?;
        if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
            return Ok(None);
        }
        if !status.is_success() {
            return Err(ClientError::Refused {
                what: "heartbeat".into(),
                status,
                body: String::new(),
            }
            .into());
        }
        let list: ListResponse<Worker> = api.json(Method::GET, "/v2/workers", token, None).await?;
        let Some(worker) = list.items.into_iter().next() else {
            return Ok(None);
        };
        Ok(Some(Self {
            api: api.clone(),
            token: token.to_owned(),
            worker,
            worker_config: Value::Null,
            instances: tokio::sync::watch::Sender::new(HashMap::new()),
            recheck: tokio::sync::Notify::new(),
        }))
    }

    /// Heartbeat and check every instance now, reporting each state even if unchanged: the
    /// worker reconnected (its tunnel is back), so the server may have marked it away.
    pub fn recheck(&self) {
        self.recheck.notify_one();
    }

    /// The worker as registered.
    pub fn worker(&self) -> &Worker {
        &self.worker
    }

    /// The worker token (for the tunnel and the worker proxy's credential check).
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The cluster's worker configuration received at registration (`null` when re-attached).
    pub fn worker_config(&self) -> &Value {
        &self.worker_config
    }

    /// Instance id → local port of the instances reported so far.
    pub fn instances(&self) -> HashMap<i64, u16> {
        self.instances.borrow().clone()
    }

    /// Follows [`Agent::instances`] as instances are reported.
    pub fn instance_updates(&self) -> tokio::sync::watch::Receiver<HashMap<i64, u16>> {
        self.instances.subscribe()
    }

    /// Sends one heartbeat; whether the server says this worker drains.
    pub async fn heartbeat(&self) -> Result<bool, AgentError> {
        let (status, body) = self
            .api
            .call(
                Method::POST,
                "/v2/worker-heartbeat",
                &self.token,
                Some(&json!({})),
            )
            .await?;
        if status.is_success() {
            let draining = serde_json::from_slice::<Value>(&body)
                .is_ok_and(|v| v["maintenance"]["enabled"] == Value::Bool(true));
            return Ok(draining);
        }
        Err(ClientError::Refused {
            what: "heartbeat".into(),
            status,
            body: String::from_utf8_lossy(&body).into_owned(),
        }
        .into())
    }

    /// Tells the server this worker is draining (it is stopping): gateways move its models'
    /// traffic to other workers that run them. `in_flight` is what it still serves. Returns
    /// how many of its instances still take new requests (no other worker runs their model).
    pub async fn drain(&self, in_flight: u64) -> Result<u64, AgentError> {
        let path = format!("/v2/workers/{}/drain", self.worker.id);
        let answer: Value = self
            .api
            .json(
                Method::POST,
                &path,
                &self.token,
                Some(&json!({"in_flight": in_flight})),
            )
            .await?;
        let routed = answer["instances"].as_array().map_or(0, |list| {
            list.iter()
                .filter(|i| i["routed"] == Value::Bool(true))
                .count() as u64
        });
        Ok(routed)
    }

    /// Ends the drain this worker started as it stopped last time (a drain an administrator
    /// started stays: the server refuses to end it for the worker).
    pub async fn end_own_drain(&self) -> Result<(), AgentError> {
        let own = self.worker.maintenance.as_ref().is_some_and(|m| {
            m.enabled && m.requested_by.as_deref() == Some(control_client::model::DRAIN_BY_WORKER)
        });
        if !own {
            return Ok(());
        }
        let path = format!("/v2/workers/{}/drain", self.worker.id);
        let (status, body) = self
            .api
            .call(Method::DELETE, &path, &self.token, None)
            .await?;
        if !status.is_success() {
            return Err(ClientError::Refused {
                what: format!("DELETE {path}"),
                status,
                body: String::from_utf8_lossy(&body).into_owned(),
            }
            .into());
        }
        tracing::info!("the drain of the last stop ended: taking requests again");
        Ok(())
    }

    /// Reports `local` as an instance of this worker (reusing its row after a restart) in
    /// `state`; returns the instance id.
    pub async fn report(
        &self,
        local: &LocalInstance,
        state: InstanceState,
    ) -> Result<i64, AgentError> {
        let models: ListResponse<Model> = self
            .api
            .json(Method::GET, "/v2/models?page=-1", &self.token, None)
            .await?;
        // A model deleted while this worker was away leaves its instance an orphan: still
        // reported (by its model's name) and served until it is adopted or deleted.
        let model = models.items.into_iter().find(|m| m.name == local.model);
        if model.is_none() {
            tracing::warn!(
                model = %local.model,
                "the model does not exist on the server: reporting its instance as an orphan"
            );
        }
        let mine = self.own_instances().await?;
        let existing = mine.items.into_iter().find(|i| {
            i.port == Some(local.port) && i.model_name.as_deref() == Some(local.model.as_str())
        });
        let body = json!({
            "model_id": model.map(|m| m.id),
            "model_name": local.model,
            "worker_id": self.worker.id,
            "port": local.port,
            "state": state,
        });
        let inst: ModelInstance = match existing {
            Some(i) => {
                let path = format!("/v2/model-instances/{}", i.id);
                self.api
                    .json(Method::PUT, &path, &self.token, Some(&body))
                    .await?
            }
            None => {
                self.api
                    .json(
                        Method::POST,
                        "/v2/model-instances",
                        &self.token,
                        Some(&body),
                    )
                    .await?
            }
        };
        self.instances.send_modify(|map| {
            map.insert(inst.id, local.port);
        });
        Ok(inst.id)
    }

    /// Deletes this worker's instances that are not in `locals` (left from an earlier run with
    /// other ports): the worker is the authority on what it runs. The rows it keeps (a restart
    /// with the same instances) join [`Agent::instances`] at once: the gateway may route to them
    /// as soon as this worker is reachable again, before they are reported anew.
    pub async fn prune(&self, locals: &[LocalInstance]) -> Result<usize, AgentError> {
        let mine = self.own_instances().await?;
        let mut removed = 0;
        for inst in mine.items {
            let wanted = locals.iter().find(|l| {
                inst.port == Some(l.port) && inst.model_name.as_deref() == Some(l.model.as_str())
            });
            if let Some(local) = wanted {
                self.instances.send_modify(|map| {
                    map.insert(inst.id, local.port);
                });
                continue;
            }
            let path = format!("/v2/model-instances/{}", inst.id);
            let (status, body) = self
                .api
                .call(Method::DELETE, &path, &self.token, None)
                .await?;
            if !status.is_success() && status != StatusCode::NOT_FOUND {
                return Err(ClientError::Refused {
                    what: format!("DELETE {path}"),
                    status,
                    body: String::from_utf8_lossy(&body).into_owned(),
                }
                .into());
            }
            removed += 1;
        }
        Ok(removed)
    }

    /// This worker's instances as the server lists them (a worker token sees only its own).
    async fn own_instances(&self) -> Result<ListResponse<ModelInstance>, AgentError> {
        Ok(self
            .api
            .json(
                Method::GET,
                "/v2/model-instances?page=-1",
                &self.token,
                None,
            )
            .await?)
    }

    /// Retires the instances this worker reported that the server no longer lists (deleted
    /// properly, an orphan among them): the worker proxy stops serving them at once, and they
    /// are not reported again until the worker restarts. Their engines are the operator's.
    async fn retire_deleted(
        &self,
        locals: &[LocalInstance],
        retired: &mut HashSet<u16>,
    ) -> Result<(), AgentError> {
        if self.instances.borrow().is_empty() {
            return Ok(());
        }
        let mine = self.own_instances().await?;
        let listed: HashSet<i64> = mine.items.iter().map(|i| i.id).collect();
        let mut gone = Vec::new();
        self.instances.send_if_modified(|map| {
            map.retain(|id, port| {
                let keep = listed.contains(id);
                if !keep {
                    gone.push((*id, *port));
                }
                keep
            });
            !gone.is_empty()
        });
        for (id, port) in gone {
            retired.insert(port);
            let model = locals
                .iter()
                .find(|l| l.port == port)
                .map(|l| l.model.as_str());
            tracing::warn!(
                instance_id = id,
                model = model.unwrap_or("?"),
                port,
                "the instance was deleted on the server: no longer serving or reporting it \
                 (stop its engine and take it out of --instance)"
            );
        }
        Ok(())
    }

    /// Runs heartbeats every `interval` and probes each local instance's health every
    /// `probe_interval`, reporting `running` / `unreachable` on change, until `shutdown`.
    /// While the server says this worker drains, each heartbeat is followed by a report of
    /// what `in_flight` counts, every second (a worker that counts nothing, in `direct` mode,
    /// reports nothing: the server then waits its documented grace).
    pub async fn run(
        self: Arc<Self>,
        locals: Vec<LocalInstance>,
        interval: Duration,
        probe_interval: Duration,
        in_flight: Option<InFlight>,
        shutdown: CancellationToken,
    ) {
        let mut states: HashMap<u16, InstanceState> = HashMap::new();
        // Ports of instances deleted on the server: neither served nor reported again.
        let mut retired: HashSet<u16> = HashSet::new();
        // Failed probes in a row per port: a running instance is reported unreachable only
        // at the second, so that one slow answer does not take it out of routing.
        let mut misses: HashMap<u16, u32> = HashMap::new();
        let mut heartbeat = tokio::time::interval(interval);
        let mut probe = tokio::time::interval(probe_interval);
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The last heartbeat failure said, so that one cause is logged once.
        let mut failing: Option<String> = None;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                () = self.recheck.notified() => {
                    tracing::info!("reconnected: checking in and checking every instance now");
                    states.clear();
                    heartbeat.reset_immediately();
                    probe.reset_immediately();
                }
                _ = heartbeat.tick() => {
                    match self.heartbeat().await {
                        Ok(draining) => {
                            if let Err(e) = self.retire_deleted(&locals, &mut retired).await {
                                tracing::debug!(error = %e, "cannot list this worker's instances");
                            }
                            if failing.take().is_some() {
                                tracing::info!("heartbeat accepted again");
                                // Back after a gap: the server may have marked it away.
                                states.clear();
                                probe.reset_immediately();
                            }
                            if draining && let Some(count) = &in_flight {
                                if let Err(e) = self.drain(count()).await {
                                    tracing::warn!(error = %e, "reporting the drain failed");
                                }
                                // Reported every second while draining, so that `drained`
                                // shows soon after the last request ends.
                                heartbeat.reset_after(DRAINING_BEAT.min(interval));
                            }
                        }
                        Err(e) => {
                            let said = e.to_string();
                            if failing.as_deref() == Some(said.as_str()) {
                                tracing::debug!(error = %e, "heartbeat failed again");
                            } else if e.is_refusal() {
                                tracing::error!(
                                    error = %e,
                                    "the server refused this worker's token (revoked, or the \
                                     worker or its cluster was deleted); register it again"
                                );
                            } else {
                                tracing::warn!(error = %e, "heartbeat failed");
                            }
                            failing = Some(said);
                        }
                    }
                }
                _ = probe.tick() => {
                    for local in locals.iter().filter(|l| !retired.contains(&l.port)) {
                        let up = probe_health(local.port).await;
                        let miss = misses.entry(local.port).or_default();
                        *miss = if up { 0 } else { *miss + 1 };
                        let was_running = states.get(&local.port) == Some(&InstanceState::Running);
                        let state = if up || (was_running && *miss < 2) {
                            InstanceState::Running
                        } else {
                            InstanceState::Unreachable
                        };
                        if states.get(&local.port) == Some(&state) {
                            continue;
                        }
                        match self.report(local, state).await {
                            Ok(id) => {
                                tracing::info!(instance_id = id, model = %local.model, port = local.port, %state, "instance state");
                                states.insert(local.port, state);
                            }
                            Err(e) => tracing::warn!(model = %local.model, error = %e, "reporting instance failed"),
                        }
                    }
                }
            }
        }
    }
}

/// Whether an OpenAI-compatible engine answers on `127.0.0.1:port` (`GET /v1/models`, then
/// `/health`), within one second.
pub async fn probe_health(port: u16) -> bool {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    for path in ["/v1/models", "/health"] {
        let Ok(request) =
            Request::get(format!("http://127.0.0.1:{port}{path}")).body(Full::default())
        else {
            return false;
        };
        let ok = tokio::time::timeout(Duration::from_secs(1), client.request(request))
            .await
            .is_ok_and(|r| r.is_ok_and(|r| r.status().is_success()));
        if ok {
            return true;
        }
    }
    false
}

fn read_token(path: &std::path::Path) -> Result<Option<String>, AgentError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text.trim().to_owned()).filter(|t| !t.is_empty())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(AgentError::TokenFile {
            path: path.to_owned(),
            source,
        }),
    }
}

fn write_token(path: &std::path::Path, token: &str) -> Result<(), AgentError> {
    use std::io::Write;
    let err = |source| AgentError::TokenFile {
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    let tmp = path.with_extension("tmp");
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options.open(&tmp).map_err(err)?;
    file.write_all(token.as_bytes()).map_err(err)?;
    file.sync_all().map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}
