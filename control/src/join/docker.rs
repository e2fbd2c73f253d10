//! A Docker cluster's join commands: the host check and the `docker run` command of a worker.
//!
//! The container runs `faden worker` on the host's network (the data plane dials the worker's
//! address and port straight), privileged (the GPU vendors' device files and drivers), restarted
//! unless stopped, with its token kept in the named volume `faden-data`.

use std::net::IpAddr;

use serde::Serialize;

use super::values::{check_absolute, worker_settings};
use super::vendors::Vendor;
use super::{DATA_DIR, ImageRef, JoinError, shell_quote};
use control_client::model::{Cluster, ProxyMode};

/// Name of the worker container.
pub const CONTAINER_NAME: &str = "faden-worker";

/// Named volume holding the worker's data directory.
pub const DATA_VOLUME: &str = "faden-data";

/// Extra mounts one command takes at most.
pub const MAX_MOUNTS: usize = 32;

/// An extra volume mount: `HOST[:CONTAINER][:ro|:rw]`, the container path defaulting to the
/// host path (the documents' use: reuse model files already on the host).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mount {
    pub host: String,
    pub container: String,
    pub read_only: bool,
}

impl Mount {
    pub fn parse(text: &str) -> Result<Self, JoinError> {
        let bad = |reason: String| JoinError::bad("mounts", format!("{text:?}: {reason}"));
        let mut parts: Vec<&str> = text.trim().split(':').collect();
        let read_only = match parts.last() {
            Some(&"ro") if parts.len() > 1 => true,
            Some(&"rw") if parts.len() > 1 => false,
            _ => {
                parts.push("rw");
                false
            }
        };
        parts.pop();
        let (host, container) = match parts.as_slice() {
            [host] => (*host, *host),
            [host, container] => (*host, *container),
            _ => {
                return Err(bad(
                    "expected HOST_PATH[:CONTAINER_PATH][:ro|:rw]".to_owned()
                ));
            }
        };
        check_absolute(host).map_err(bad)?;
        check_absolute(container).map_err(bad)?;
        let container = container.trim_end_matches('/');
        if container.is_empty() {
            return Err(bad("the container's root cannot be replaced".to_owned()));
        }
        if container == DATA_DIR || container.starts_with(&format!("{DATA_DIR}/")) {
            return Err(bad(format!("{DATA_DIR} is the worker's data directory")));
        }
        Ok(Self {
            host: host.to_owned(),
            container: container.to_owned(),
            read_only,
        })
    }

    fn volume_arg(&self) -> String {
        let mode = if self.read_only { ":ro" } else { "" };
        format!(
            "--volume {}",
            shell_quote(&format!("{}:{}{mode}", self.host, self.container))
        )
    }
}

/// What the operator chose for one worker.
#[derive(Clone, Debug)]
pub struct DockerRequest {
    pub vendor: &'static Vendor,
    /// `None`: the worker finds the address it reaches the server from.
    pub worker_ip: Option<IpAddr>,
    /// Host name or IP the data plane dials instead of the worker IP.
    pub advertise_address: Option<String>,
    pub mounts: Vec<Mount>,
    /// `None`: the cluster's `worker_config.proxy_mode`, else `worker`.
    pub proxy_mode: Option<ProxyMode>,
    /// Worker name; `None`: the host name.
    pub name: Option<String>,
}

impl DockerRequest {
    /// Checks the mounts together: no container path twice.
    pub fn check(&self) -> Result<(), JoinError> {
        if self.mounts.len() > MAX_MOUNTS {
            return Err(JoinError::bad(
                "mounts",
                format!("at most {MAX_MOUNTS} mounts, got {}", self.mounts.len()),
            ));
        }
        let vendor_paths = self.vendor.docker_mounts.iter().map(|m| m.path);
        let mut seen: Vec<&str> = vendor_paths.collect();
        for m in &self.mounts {
            if seen.contains(&m.container.as_str()) {
                return Err(JoinError::bad(
                    "mounts",
                    format!("{} is mounted twice in the container", m.container),
                ));
            }
            seen.push(&m.container);
        }
        if let Some(a) = &self.advertise_address {
            let ok = !a.is_empty()
                && a.len() <= 253
                && a.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':'));
            if !ok {
                return Err(JoinError::bad(
                    "advertise_address",
                    format!("{a:?} is not a host name or IP address"),
                ));
            }
        }
        if let Some(n) = &self.name
            && (n.trim().is_empty() || n.chars().count() > 255 || n.chars().any(char::is_control))
        {
            return Err(JoinError::bad(
                "name",
                "a worker name is 1-255 characters without control characters",
            ));
        }
        Ok(())
    }
}

/// The answer of `GET /v2/clusters/{id}/join`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DockerJoin {
    pub cluster_id: i64,
    pub vendor: &'static str,
    pub vendor_name: &'static str,
    pub experimental: bool,
    pub image: String,
    pub server_url: String,
    pub proxy_mode: &'static str,
    /// `None`: detected by the worker.
    pub worker_ip: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub advertise_address: Option<String>,
    /// Run on the host first: prints `OK` when the host is ready, else what is missing.
    pub env_check: String,
    /// Starts the worker.
    pub run: String,
    /// What may keep the worker from joining, as far as the server can tell.
    pub warnings: Vec<String>,
}

/// The join commands of `request` for `cluster` (a Docker cluster).
pub fn render(
    cluster: &Cluster,
    server_url: &str,
    image: &ImageRef,
    request: &DockerRequest,
) -> Result<DockerJoin, JoinError> {
    request.check()?;
    let vendor = request.vendor;
    let image = image
        .for_cluster(cluster.default_container_registry.as_deref())
        .to_string();
    let proxy_mode = request
        .proxy_mode
        .or(worker_settings(cluster).proxy_mode)
        .unwrap_or(ProxyMode::Worker);
    let token = cluster.registration_token.as_deref().unwrap_or_default();

    let mut args = vec![
        format!("docker run -d --name {CONTAINER_NAME}"),
        "--restart=unless-stopped".to_owned(),
        "--privileged".to_owned(),
        "--network=host".to_owned(),
        format!("--volume {DATA_VOLUME}:{DATA_DIR}"),
    ];
    args.extend(request.mounts.iter().map(Mount::volume_arg));
    args.extend(vendor.docker_mounts.iter().map(|m| {
        Mount {
            host: m.path.to_owned(),
            container: m.path.to_owned(),
            read_only: m.read_only,
        }
        .volume_arg()
    }));
    args.extend(
        vendor
            .env
            .iter()
            // Constants of the vendor table: nothing in them needs quoting.
            .map(|(k, v)| format!("--env {k}={v}")),
    );
    args.extend(vendor.docker_args.iter().map(|a| (*a).to_owned()));
    if let Some(runtime) = vendor.docker_runtime {
        args.push(format!("--runtime {runtime}"));
    }
    args.push(shell_quote(&image));
    // The image's entrypoint is `faden`: the command is its subcommand.
    args.push("worker".to_owned());
    args.push(format!("--server-url {}", shell_quote(server_url)));
    args.push(format!("--token {}", shell_quote(token)));
    args.push(format!("--proxy-mode {}", proxy_mode.as_str()));
    args.push(format!("--data-dir {DATA_DIR}"));
    if let Some(ip) = request.worker_ip {
        args.push(format!("--worker-ip {ip}"));
    }
    if let Some(a) = &request.advertise_address {
        args.push(format!("--advertise-address {}", shell_quote(a)));
    }
    if let Some(n) = &request.name {
        args.push(format!("--name {}", shell_quote(n)));
    }

    Ok(DockerJoin {
        cluster_id: cluster.id,
        vendor: vendor.id,
        vendor_name: vendor.name,
        experimental: vendor.experimental,
        image,
        server_url: server_url.to_owned(),
        proxy_mode: proxy_mode.as_str(),
        worker_ip: request.worker_ip.map(|ip| ip.to_string()),
        advertise_address: request.advertise_address.clone(),
        env_check: env_check(vendor),
        run: args.join(" \\\n  "),
        warnings: warnings(server_url),
    })
}

fn warnings(server_url: &str) -> Vec<String> {
    let host = server_url
        .split_once("://")
        .map_or(server_url, |(_, rest)| rest)
        .split(['/', '?'])
        .next()
        .unwrap_or("");
    let host = host
        .rsplit_once(':')
        .filter(|(_, port)| port.bytes().all(|b| b.is_ascii_digit()))
        .map_or(host, |(h, _)| h)
        .trim_start_matches('[')
        .trim_end_matches(']');
    let loopback = host == "localhost"
        || host
            .parse::<IpAddr>()
            .is_ok_and(|ip| ip.is_loopback() || ip.is_unspecified());
    if loopback {
        vec![format!(
            "the server URL {server_url} is a loopback address that other hosts cannot reach; \
             start the server with --server-url <an address the workers reach>"
        )]
    } else {
        Vec::new()
    }
}

/// The host check for `vendor`: one subshell (its `exit` does not close the operator's shell)
/// that stops at the first missing piece with a line naming it, and prints `OK` when nothing
/// is missing.
pub fn env_check(vendor: &Vendor) -> String {
    let name = vendor.name;
    let mut checks: Vec<String> = vec![
        "docker info >/dev/null 2>&1 || { echo \"Docker: not running, or this user may not use it\"; exit 1; }".to_owned(),
        format!(
            "{tool} >/dev/null 2>&1 || {{ echo \"{name} driver: '{tool}' failed\"; exit 1; }}",
            tool = vendor.driver_check
        ),
    ];
    if let Some(runtime) = vendor.docker_runtime {
        checks.push(format!(
            "docker info 2>/dev/null | grep -qiE 'runtimes:.* {runtime}( |$)' || {{ echo \"{name} container toolkit: Docker has no '{runtime}' runtime\"; exit 1; }}"
        ));
    }
    for device in vendor
        .docker_args
        .iter()
        .filter_map(|a| a.strip_prefix("--device "))
    {
        checks.push(format!(
            "test -e {device} || {{ echo \"{name}: {device} is missing\"; exit 1; }}"
        ));
    }
    if vendor.id == "ascend" {
        checks.push(format!(
            "ls /dev/davinci[0-9]* >/dev/null 2>&1 || {{ echo \"{name}: no /dev/davinci<N> device\"; exit 1; }}"
        ));
    }
    for m in vendor.docker_mounts {
        checks.push(format!(
            "test -e {path} || {{ echo \"{name}: {path} is missing\"; exit 1; }}",
            path = m.path
        ));
    }
    checks.push("echo OK".to_owned());
    format!("(\n  {}\n)", checks.join("\n  "))
}

#[cfg(test)]
mod tests {
    use super::super::vendors;
    use super::*;

    #[test]
    fn mounts_parse_and_refuse() {
        let m = Mount::parse("/data/models").unwrap();
        assert_eq!(
            (m.host.as_str(), m.container.as_str(), m.read_only),
            ("/data/models", "/data/models", false)
        );
        let m = Mount::parse("/srv/hf:/root/.cache/huggingface:ro").unwrap();
        assert_eq!(
            (m.host.as_str(), m.container.as_str(), m.read_only),
            ("/srv/hf", "/root/.cache/huggingface", true)
        );
        assert!(!Mount::parse("/a:/b:rw").unwrap().read_only);
        assert!(Mount::parse("/a:ro").unwrap().read_only);
        for (bad, why) in [
            ("models", "not an absolute path"),
            ("/a:b", "not an absolute path"),
            ("/a:/b:/c", "expected HOST_PATH"),
            ("/a:/b:rx", "expected HOST_PATH"),
            ("/a/../../etc:/etc", "climbs"),
            ("/x:/var/lib/faden", "data directory"),
            ("/x:/var/lib/faden/sub", "data directory"),
            ("/x:/", "root"),
            ("/a\u{7}b", "control character"),
            ("", "not an absolute path"),
        ] {
            let e = Mount::parse(bad).unwrap_err().to_string();
            assert!(e.starts_with("mounts: "), "{e}");
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }

    #[test]
    fn a_path_with_spaces_is_quoted_for_the_shell() {
        let m = Mount::parse("/data/my models:/models:ro").unwrap();
        assert_eq!(
            shlex::split(&m.volume_arg()).unwrap(),
            ["--volume", "/data/my models:/models:ro"]
        );
    }

    #[test]
    fn loopback_server_urls_are_warned_about() {
        assert_eq!(warnings("http://127.0.0.1:30080").len(), 1);
        assert_eq!(warnings("http://localhost:30080/").len(), 1);
        assert_eq!(warnings("https://[::1]:443").len(), 1);
        assert!(warnings("http://10.0.0.2:30080").is_empty());
        assert!(warnings("https://faden.example.com").is_empty());
    }

    /// Runs the vendor's host check with `tools` on `PATH` (each a script printing `docker
    /// info`'s runtimes line or nothing), the system's own tools after them.
    fn run_check(vendor: &str, tools: &[(&str, &str)]) -> (bool, String) {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        for (name, body) in tools {
            let path = dir.path().join(name);
            std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let script = env_check(vendors::find(vendor).unwrap());
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(&script)
            .env("PATH", format!("{}:/usr/bin:/bin", dir.path().display()))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        (out.status.success(), text)
    }

    #[test]
    fn the_nvidia_check_prints_ok_only_when_everything_is_there() {
        let docker = r#"[ "$1" = info ] && echo " Runtimes: io.containerd.runc.v2 nvidia runc""#;
        let (ok, out) = run_check("nvidia", &[("docker", docker), ("nvidia-smi", "exit 0")]);
        assert!(ok, "{out}");
        assert_eq!(out, "OK");

        let (ok, out) = run_check("nvidia", &[("docker", docker), ("nvidia-smi", "exit 9")]);
        assert!(!ok);
        assert_eq!(out, "NVIDIA driver: 'nvidia-smi' failed");

        let plain = r#"[ "$1" = info ] && echo " Runtimes: io.containerd.runc.v2 runc""#;
        let (ok, out) = run_check("nvidia", &[("docker", plain), ("nvidia-smi", "exit 0")]);
        assert!(!ok);
        assert_eq!(
            out,
            "NVIDIA container toolkit: Docker has no 'nvidia' runtime"
        );

        let (ok, out) = run_check("nvidia", &[("docker", "exit 1"), ("nvidia-smi", "exit 0")]);
        assert!(!ok);
        assert_eq!(out, "Docker: not running, or this user may not use it");
    }

    #[test]
    fn the_amd_check_names_the_missing_device() {
        let (ok, out) = run_check("amd", &[("docker", "exit 0"), ("amd-smi", "exit 0")]);
        // This machine has no AMD GPU: the check stops at the first missing device file.
        assert!(!ok);
        assert_eq!(out, "AMD: /dev/kfd is missing");
    }
}
