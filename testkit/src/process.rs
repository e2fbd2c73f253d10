//! Running the real `faden` binary in tests: start it with port 0 and read the bound address
//! from its log, as an operator's script would.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::Client;

/// A running child process and the log lines it printed so far.
#[derive(Debug)]
pub struct Running {
    pub child: Child,
    /// The log up to the line [`start`] waited for.
    pub log: Vec<String>,
    /// The lines printed after it, as they arrive.
    pub later: Arc<Mutex<Vec<String>>>,
}

impl Running {
    /// Whether any line so far (before or after the ready line) contains `marker`.
    pub fn printed(&self, marker: &str) -> bool {
        self.log.iter().any(|l| l.contains(marker))
            || self.later.lock().iter().any(|l| l.contains(marker))
    }

    /// The value of `key=` on the last log line containing `marker` (say, another bound
    /// address on the ready line).
    pub fn log_field(&self, marker: &str, key: &str) -> Option<String> {
        let prefix = format!("{key}=");
        self.log
            .iter()
            .rev()
            .find(|l| l.contains(marker))?
            .split_whitespace()
            .find_map(|w| w.strip_prefix(&prefix))
            .map(str::to_owned)
    }
}

/// Starts `program args…` and waits (up to 30 s) for a log line containing `ready_marker`;
/// returns the value of `key=` on that line (for example the bound address).
pub async fn start(
    program: &Path,
    args: &[&str],
    envs: &[(&str, &str)],
    ready_marker: &str,
    key: &str,
) -> (Running, String) {
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env("FADEN_LOG", "info")
        .env_remove("FADEN_ADMIN_KEY")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("spawn");
    let stderr = child.stderr.take().expect("stderr");
    let mut lines = BufReader::new(stderr).lines();
    let mut log = Vec::new();
    let found = tokio::time::timeout(Duration::from_secs(30), async {
        while let Ok(Some(line)) = lines.next_line().await {
            log.push(line.clone());
            if line.contains(ready_marker) {
                let value = line
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix(&format!("{key}=")))
                    .map(str::to_owned);
                return value;
            }
        }
        None
    })
    .await;
    let value = match found {
        Ok(Some(v)) => v,
        _ => panic!(
            "{program:?} did not report {ready_marker:?}; log:\n{}",
            log.join("\n")
        ),
    };
    // Keep draining stderr so the child never blocks on a full pipe; tests may wait for a line.
    let later = Arc::new(Mutex::new(Vec::new()));
    let kept = later.clone();
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            kept.lock().push(line);
        }
    });
    (Running { child, log, later }, value)
}

/// The log line `faden server` prints once it serves, with its bound addresses.
const SERVER_READY: &str = "faden server ready";

/// A running `faden server` and what tests need from it.
#[derive(Debug)]
pub struct FadenServer {
    /// The process, and its log up to the ready line.
    pub running: Running,
    /// The bound API address (`api=` on the ready line).
    pub api: SocketAddr,
    /// The bound gateway address (`gateway=` on the ready line).
    pub gateway: SocketAddr,
    /// The admin key the server keeps in `DATA_DIR/admin.key`, trimmed.
    pub admin_key: String,
    /// A client for [`Self::api_url`] holding the admin key (plain HTTP: of no use when the
    /// API serves TLS).
    pub admin: Client,
}

/// Starts `bin server --data-dir DATA_DIR --host 127.0.0.1` on `ports` (API, gateway and proxy
/// port, in this order; 0 for an ephemeral one), followed by `extra_args` and with `envs` set
/// (as [`start`] does), and waits for its ready line. `bin` is the `faden` binary: only the
/// faden crate's own tests know it, as `env!("CARGO_BIN_EXE_faden")`.
///
/// A fixed port is for a server that must come back on the same addresses after a restart
/// (see [`crate::free_port`]); the restart reuses `data_dir`, so the admin key stays the same.
pub async fn start_faden_server(
    bin: &Path,
    data_dir: &Path,
    ports: [u16; 3],
    extra_args: &[&str],
    envs: &[(&str, &str)],
) -> FadenServer {
    let [api_port, gateway_port, proxy_port] = ports.map(|p| p.to_string());
    let mut args = vec![
        "server",
        "--data-dir",
        data_dir.to_str().expect("data dir is not UTF-8"),
        "--host",
        "127.0.0.1",
        "--api-port",
        &api_port,
        "--port",
        &gateway_port,
        "--proxy-port",
        &proxy_port,
    ];
    args.extend_from_slice(extra_args);
    let (running, api) = start(bin, &args, envs, SERVER_READY, "api").await;
    let gateway = running
        .log_field(SERVER_READY, "gateway")
        .unwrap_or_else(|| {
            panic!(
                "no gateway= on the ready line; log:\n{}",
                running.log.join("\n")
            )
        });
    let admin_key = std::fs::read_to_string(data_dir.join("admin.key"))
        .expect("reading admin.key")
        .trim()
        .to_owned();
    let api: SocketAddr = api.parse().expect("api= is not an address");
    FadenServer {
        admin: Client::new(format!("http://{api}")).with_token(&admin_key),
        api,
        gateway: gateway.parse().expect("gateway= is not an address"),
        admin_key,
        running,
    }
}

impl FadenServer {
    /// The API's base URL over plain HTTP, such as `http://127.0.0.1:40123`.
    pub fn api_url(&self) -> String {
        format!("http://{}", self.api)
    }

    /// Kills the server (`SIGKILL`, nothing drains) and waits until it is gone.
    pub async fn kill(&mut self) {
        self.running.child.start_kill().unwrap();
        self.running.child.wait().await.unwrap();
    }
}
