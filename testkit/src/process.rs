//! Running the real `faden` binary in tests: start it with port 0 and read the bound address
//! from its log, as an operator's script would.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// A running child process and the log lines it printed so far.
#[derive(Debug)]
pub struct Running {
    pub child: Child,
    pub log: Vec<String>,
}

impl Running {
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
    // Keep draining stderr so the child never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (Running { child, log }, value)
}
