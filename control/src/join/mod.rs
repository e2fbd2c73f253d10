//! Adding workers to a cluster: what the management API hands an operator.
//!
//! - [`docker`]: for a Docker cluster, per GPU vendor, the shell command that checks a host
//!   (it prints `OK` when the host is ready) and the `docker run` command that starts a worker.
//! - [`kubernetes`]: for a Kubernetes cluster, the manifests: the namespace with its
//!   pod-security labels, the Secret holding the registration token, and one worker DaemonSet per
//!   chosen GPU vendor (a CPU-only one when none is chosen).
//! - [`values`]: the chart values both are rendered from, with `k8sOptions.helmValues` merged
//!   over them by [`crate::helm`]'s rules.
//! - [`vendors`]: the GPU vendors and what each needs on its host.
//!
//! Everything here is pure: a cluster and the server's settings in, text out.

pub mod docker;
pub mod kubernetes;
pub mod values;
pub mod vendors;

use std::fmt;

use crate::helm::HelmError;

/// The worker image when the server is not told another (`faden server --worker-image`).
pub const DEFAULT_WORKER_IMAGE: &str = concat!("ghcr.io/faden/faden:", env!("CARGO_PKG_VERSION"));

/// Where the worker keeps its token inside its container (`--data-dir`), so that a restarted
/// container keeps its registration.
pub const DATA_DIR: &str = "/var/lib/faden";

/// Registry of an image reference that names none (Docker's rule).
pub const DOCKER_HUB: &str = "docker.io";

/// An image reference `[registry/]repository:tag`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageRef {
    /// The registry host (and perhaps a path below it); `None`: Docker Hub.
    pub registry: Option<String>,
    pub repository: String,
    pub tag: String,
}

impl ImageRef {
    /// Parses `[registry/]repository:tag`. The first path segment is a registry when it holds a
    /// `.` or a `:` or is `localhost` (Docker's rule). A tag is required and a digest refused:
    /// the chart values carry `repository` and `tag` apart, and an untagged image would be
    /// whatever `latest` is on the day a node pulls it.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text.is_empty() {
            return Err("the image reference is empty".to_owned());
        }
        if let Some(bad) = text.chars().find(|c| !c.is_ascii_graphic()) {
            return Err(format!(
                "{text:?}: {bad:?} has no place in an image reference"
            ));
        }
        if text.contains('@') {
            return Err(format!("{text:?}: pin the image by tag, not by digest"));
        }
        let (registry, rest) = match text.split_once('/') {
            Some((head, rest))
                if head.contains('.') || head.contains(':') || head == "localhost" =>
            {
                (Some(head.to_owned()), rest)
            }
            _ => (None, text),
        };
        let Some((repository, tag)) = rest.rsplit_once(':') else {
            return Err(format!("{text:?}: the image needs a tag (repository:tag)"));
        };
        if repository.is_empty() || tag.is_empty() || repository.contains(':') {
            return Err(format!("{text:?}: expected [registry/]repository:tag"));
        }
        Ok(Self {
            registry,
            repository: repository.to_owned(),
            tag: tag.to_owned(),
        })
    }

    /// The image as a cluster's workers pull it: from the cluster's default container registry
    /// when it has one, else from the image's own registry.
    pub fn for_cluster(&self, cluster_registry: Option<&str>) -> ImageRef {
        let registry = cluster_registry
            .map(|r| r.trim().trim_end_matches('/'))
            .filter(|r| !r.is_empty())
            .map(|r| {
                // The registry field is a host (and path), not a URL.
                r.strip_prefix("https://")
                    .or_else(|| r.strip_prefix("http://"))
                    .unwrap_or(r)
                    .to_owned()
            })
            .or_else(|| self.registry.clone());
        ImageRef {
            registry,
            ..self.clone()
        }
    }

    /// The registry, Docker Hub when the reference names none.
    pub fn registry(&self) -> &str {
        self.registry.as_deref().unwrap_or(DOCKER_HUB)
    }
}

impl fmt::Display for ImageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}:{}", self.registry(), self.repository, self.tag)
    }
}

/// Why join commands or manifests cannot be rendered.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum JoinError {
    /// A query parameter is missing or wrong (unknown vendor, bad mount, bad address).
    #[error("{parameter}: {reason}")]
    BadParameter {
        parameter: &'static str,
        reason: String,
    },
    /// The cluster's provider has no such join flow.
    #[error("cluster {name}(id: {id}) has provider {provider}: {hint}")]
    WrongProvider {
        id: i64,
        name: String,
        provider: String,
        hint: &'static str,
    },
    /// The chosen vendors and `worker.cpuEnabled` leave no DaemonSet to render.
    #[error(
        "no worker to deploy: no GPU vendor is chosen and helmValues sets worker.cpuEnabled to \
         false; choose a vendor or leave the CPU worker on"
    )]
    NoWorker,
    /// `k8sOptions.helmValues` cannot be merged.
    #[error(transparent)]
    Helm(#[from] HelmError),
    /// The cluster's own options (`k8sOptions`, or a value `helmValues` left behind) cannot
    /// be rendered; every problem is listed.
    #[error("{}", .0.join("; "))]
    Invalid(Vec<String>),
}

impl JoinError {
    pub(crate) fn bad(parameter: &'static str, reason: impl Into<String>) -> Self {
        Self::BadParameter {
            parameter,
            reason: reason.into(),
        }
    }
}

/// Quotes `word` for a POSIX shell when it needs quoting; plain words stay as they are.
pub(crate) fn shell_quote(word: &str) -> String {
    // shlex refuses only NUL, and every input is checked for control characters before it gets
    // here.
    shlex::try_quote(word).map_or_else(|_| "''".to_owned(), |q| q.into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_references_split_as_docker_reads_them() {
        let cases = [
            (
                "ghcr.io/faden/faden:0.1.0",
                Some("ghcr.io"),
                "faden/faden",
                "0.1.0",
            ),
            ("faden/faden:v1", None, "faden/faden", "v1"),
            (
                "localhost:5000/faden:dev",
                Some("localhost:5000"),
                "faden",
                "dev",
            ),
            ("faden:1", None, "faden", "1"),
        ];
        for (text, registry, repository, tag) in cases {
            let image = ImageRef::parse(text).unwrap();
            assert_eq!(image.registry.as_deref(), registry, "{text}");
            assert_eq!(image.repository, repository, "{text}");
            assert_eq!(image.tag, tag, "{text}");
        }
        assert_eq!(
            ImageRef::parse("faden/faden:v1").unwrap().to_string(),
            "docker.io/faden/faden:v1"
        );
        for bad in [
            "",
            "faden/faden",
            "localhost:5000/faden",
            "faden@sha256:abc",
            "faden :1",
            "faden:",
            ":1",
        ] {
            assert!(ImageRef::parse(bad).is_err(), "{bad:?}");
        }
        assert!(ImageRef::parse(DEFAULT_WORKER_IMAGE).is_ok());
    }

    #[test]
    fn a_cluster_registry_replaces_the_image_registry() {
        let image = ImageRef::parse("ghcr.io/faden/faden:1").unwrap();
        assert_eq!(image.for_cluster(None).to_string(), "ghcr.io/faden/faden:1");
        assert_eq!(
            image.for_cluster(Some(" ")).to_string(),
            "ghcr.io/faden/faden:1"
        );
        assert_eq!(
            image
                .for_cluster(Some("https://reg.example.com/mirror/"))
                .to_string(),
            "reg.example.com/mirror/faden/faden:1"
        );
    }

    #[test]
    fn shell_quoting_leaves_plain_words_alone() {
        assert_eq!(shell_quote("/data/models"), "/data/models");
        assert_eq!(shell_quote("http://a:1/x"), "http://a:1/x");
        let quoted = shell_quote("/data/my models");
        assert_eq!(shlex::split(&quoted).unwrap(), ["/data/my models"]);
        let nasty = "x'; rm -rf / #";
        assert_eq!(shlex::split(&shell_quote(nasty)).unwrap(), [nasty]);
    }
}
