//! A Kubernetes cluster's worker manifests, rendered from the chart values ([`super::values`]).
//!
//! One multi-document YAML: the namespace labelled for privileged pods, the Secret holding the
//! registration token, a `dockerconfigjson` Secret per image credential, and the worker
//! DaemonSets: one per chosen GPU vendor, scheduled by the vendor's PCI-presence label (set by
//! Node Feature Discovery), and a CPU one when no vendor is chosen (or `worker.cpuEnabled`
//! says so). Workers use the host's network, so two on one node would fight over their port:
//! with several DaemonSets each pod keeps away from the others' nodes, and the CPU one from the
//! chosen vendors' nodes.

use serde_json::{Map, Value, json};

use super::values::{KubernetesOptions, PULL_SECRET_PREFIX, chart_values};
use super::vendors::{HostMount, VENDORS, Vendor};
use super::{DATA_DIR, ImageRef, JoinError, shell_quote};
use control_client::model::{Cluster, DEFAULT_WORKER_METRICS_PORT, DEFAULT_WORKER_PORT, ProxyMode};

/// Name of the CPU worker DaemonSet; vendor ones append `-<vendor>`.
pub const DAEMONSET: &str = "faden-worker";

/// Label naming a worker pod's GPU vendor (`cpu` for the CPU worker).
pub const VENDOR_LABEL: &str = "faden.dev/gpu-vendor";

const PULL_POLICIES: &[&str] = &["Always", "IfNotPresent", "Never"];
const POD_SECURITY_MODES: &[&str] = &["enforce", "audit", "warn"];
const POD_SECURITY_LEVELS: &[&str] = &["privileged", "baseline", "restricted"];

/// The chosen vendors, deduplicated, in the table's order (the output does not depend on the
/// order they were asked for).
pub fn canonical(vendors: &[&'static Vendor]) -> Vec<&'static Vendor> {
    VENDORS
        .iter()
        .filter(|v| vendors.iter().any(|c| c.id == v.id))
        .collect()
}

/// What the manifests read from the effective values, checked.
#[derive(Debug)]
struct Chart {
    namespace: String,
    pod_security: Vec<(String, String)>,
    image: String,
    pull_policy: Option<String>,
    pull_secrets: Vec<Value>,
    token_secret: String,
    server_url: String,
    cluster_id: i64,
    node_selector: Map<String, Value>,
    tolerations: Vec<Value>,
    resources: Map<String, Value>,
    proxy_mode: ProxyMode,
    port: u16,
    metrics_port: u16,
    metrics_enabled: bool,
    data_dir: String,
    cpu_enabled: Option<bool>,
    extra_mounts: Vec<Value>,
    extra_volumes: Vec<Value>,
}

/// Reads typed values at dotted paths, collecting every problem.
struct Reader<'v> {
    values: &'v Value,
    problems: Vec<String>,
}

impl<'v> Reader<'v> {
    fn at(&self, path: &str) -> Option<&'v Value> {
        path.split('.')
            .try_fold(self.values, |v, key| v.as_object()?.get(key))
    }

    fn fail(&mut self, path: &str, expected: &str, found: &Value) {
        self.problems.push(format!(
            "chart value {path} must be {expected}, got {found}"
        ));
    }

    fn string(&mut self, path: &str) -> Option<String> {
        match self.at(path)? {
            Value::String(s) => Some(s.clone()),
            other => {
                self.fail(path, "a string", other);
                None
            }
        }
    }

    fn boolean(&mut self, path: &str) -> Option<bool> {
        match self.at(path)? {
            Value::Bool(b) => Some(*b),
            other => {
                self.fail(path, "true or false", other);
                None
            }
        }
    }

    fn port(&mut self, path: &str) -> Option<u16> {
        let value = self.at(path)?;
        match value.as_u64().and_then(|p| u16::try_from(p).ok()) {
            Some(p) if p > 0 => Some(p),
            _ => {
                self.fail(path, "a port (1-65535)", value);
                None
            }
        }
    }

    /// A list of objects (Kubernetes structures passed through as given).
    fn objects(&mut self, path: &str) -> Vec<Value> {
        match self.at(path) {
            None => Vec::new(),
            Some(Value::Array(items)) if items.iter().all(Value::is_object) => items.clone(),
            Some(other) => {
                self.fail(path, "a list of objects", other);
                Vec::new()
            }
        }
    }

    fn object(&mut self, path: &str) -> Map<String, Value> {
        match self.at(path) {
            None => Map::new(),
            Some(Value::Object(map)) => map.clone(),
            Some(other) => {
                self.fail(path, "an object", other);
                Map::new()
            }
        }
    }
}

impl Chart {
    fn read(values: &Value) -> Result<Chart, JoinError> {
        let mut r = Reader {
            values,
            problems: Vec::new(),
        };
        let image = format!(
            "{}/{}:{}",
            r.string("image.registry").unwrap_or_default(),
            r.string("image.repository").unwrap_or_default(),
            r.string("image.tag").unwrap_or_default()
        );
        let pull_policy = r.string("image.pullPolicy");
        if let Some(p) = &pull_policy
            && !PULL_POLICIES.contains(&p.as_str())
        {
            r.problems.push(format!(
                "chart value image.pullPolicy must be one of {}, got {p:?}",
                PULL_POLICIES.join(", ")
            ));
        }
        let mut pod_security = Vec::new();
        for (mode, level) in r.object("podSecurity") {
            match level.as_str() {
                Some(l)
                    if POD_SECURITY_MODES.contains(&mode.as_str())
                        && POD_SECURITY_LEVELS.contains(&l) =>
                {
                    pod_security.push((mode, l.to_owned()));
                }
                _ => r.problems.push(format!(
                    "chart value podSecurity.{mode} must be a mode ({}) set to a level ({}), \
                     got {level}",
                    POD_SECURITY_MODES.join(", "),
                    POD_SECURITY_LEVELS.join(", ")
                )),
            }
        }
        // Plain names are accepted beside Kubernetes' `{name: …}` references.
        let pull_secrets = match r.at("imagePullSecrets") {
            None => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .filter_map(|item| match item {
                    Value::String(name) => Some(json!({"name": name})),
                    Value::Object(o) if o.get("name").is_some_and(Value::is_string) => {
                        Some(item.clone())
                    }
                    other => {
                        r.problems.push(format!(
                            "chart value imagePullSecrets holds {other}: expected a name or \
                             {{\"name\": …}}"
                        ));
                        None
                    }
                })
                .collect(),
            Some(other) => {
                r.fail("imagePullSecrets", "a list", other);
                Vec::new()
            }
        };
        let node_selector = r.object("nodeSelector");
        let proxy_mode = match r.string("worker.proxyMode") {
            None => ProxyMode::Worker,
            Some(text) => ProxyMode::parse(&text).unwrap_or_else(|| {
                r.problems.push(format!(
                    "chart value worker.proxyMode must be direct, worker or tunnel, got {text:?}"
                ));
                ProxyMode::Worker
            }),
        };
        let data_dir = r
            .string("worker.dataDir")
            .unwrap_or_else(|| super::values::HOST_DATA_DIR.to_owned());
        if let Err(e) = super::values::check_absolute(&data_dir) {
            r.problems.push(format!("chart value worker.dataDir: {e}"));
        }
        let chart = Chart {
            namespace: r.string("namespace").unwrap_or_default(),
            pod_security,
            image,
            pull_policy,
            pull_secrets,
            token_secret: r.string("token.secretName").unwrap_or_default(),
            server_url: r.string("server.url").unwrap_or_default(),
            cluster_id: r
                .at("cluster.id")
                .and_then(Value::as_i64)
                .unwrap_or_default(),
            node_selector,
            tolerations: r.objects("tolerations"),
            resources: r.object("resources"),
            proxy_mode,
            port: r.port("worker.port").unwrap_or(DEFAULT_WORKER_PORT),
            metrics_port: r
                .port("worker.metricsPort")
                .unwrap_or(DEFAULT_WORKER_METRICS_PORT),
            metrics_enabled: r.boolean("worker.metricsEnabled").unwrap_or(true),
            data_dir,
            cpu_enabled: r.boolean("worker.cpuEnabled"),
            extra_mounts: r.objects("worker.extraVolumeMounts"),
            extra_volumes: r.objects("worker.extraVolumes"),
        };
        if r.problems.is_empty() {
            Ok(chart)
        } else {
            Err(JoinError::Invalid(r.problems))
        }
    }

    fn labels(&self, extra: &[(&str, &str)]) -> Value {
        let mut labels = json!({
            "app.kubernetes.io/part-of": "faden",
            "app.kubernetes.io/managed-by": "faden",
        });
        if let Value::Object(map) = &mut labels {
            for (k, v) in extra {
                map.insert((*k).to_owned(), json!(v));
            }
        }
        labels
    }

    fn instance(&self) -> String {
        format!("faden-cluster-{}", self.cluster_id)
    }
}

/// The manifests for `cluster` (a Kubernetes cluster) with DaemonSets for `vendors`, as one
/// multi-document YAML text with a header that says how to check and apply it.
pub fn render(
    cluster: &Cluster,
    server_url: &str,
    image: &ImageRef,
    vendors: &[&'static Vendor],
) -> Result<String, JoinError> {
    let options = KubernetesOptions::from_cluster(cluster.k8s_options.as_ref())
        .map_err(JoinError::Invalid)?;
    let values = chart_values(cluster, server_url, image)?;
    let chart = Chart::read(&values)?;
    let vendors = canonical(vendors);
    let cpu = chart.cpu_enabled.unwrap_or(vendors.is_empty());
    if !cpu && vendors.is_empty() {
        return Err(JoinError::NoWorker);
    }
    let token = cluster.registration_token.as_deref().unwrap_or_default();

    let mut docs = vec![namespace(&chart), token_secret(&chart, token)];
    docs.extend(
        options
            .image_credentials
            .iter()
            .enumerate()
            .map(|(i, c)| pull_secret(&chart, i, c)),
    );
    let workers: Vec<Option<&Vendor>> = cpu
        .then_some(None)
        .into_iter()
        .chain(vendors.iter().map(|v| Some(*v)))
        .collect();
    let several = workers.len() > 1;
    docs.extend(
        workers
            .iter()
            .map(|w| daemonset(&chart, *w, &vendors, several)),
    );

    let mut text = header(cluster, &chart, &vendors, cpu);
    for (i, doc) in docs.iter().enumerate() {
        if i > 0 {
            text.push_str("---\n");
        }
        text.push_str(
            &serde_yaml_ng::to_string(doc)
                .map_err(|e| JoinError::Invalid(vec![format!("rendering YAML: {e}")]))?,
        );
    }
    Ok(text)
}

fn header(cluster: &Cluster, chart: &Chart, vendors: &[&Vendor], cpu: bool) -> String {
    let mut what: Vec<String> = vendors.iter().map(|v| v.name.to_owned()).collect();
    if cpu {
        what.insert(0, "CPU".to_owned());
    }
    let mut text = format!(
        "# faden workers for cluster {:?} (id {}) in namespace {}: {} (one DaemonSet each).\n\
         # Check the cluster first; this prints OK when it is ready:\n#\n",
        cluster.name,
        cluster.id,
        chart.namespace,
        what.join(", ")
    );
    for line in env_check(&chart.node_selector, vendors).lines() {
        text.push_str(&format!("#   {line}\n"));
    }
    text.push_str("#\n# Then: kubectl apply -f manifest.yaml\n");
    text
}

/// The cluster check for `vendors`: kubectl reaches the cluster, and for each vendor some node
/// carries its PCI label (and the base node selector), and its RuntimeClass exists where the
/// pods name one. Prints `OK` when nothing is missing.
pub fn env_check(node_selector: &Map<String, Value>, vendors: &[&Vendor]) -> String {
    let base: Vec<String> = node_selector
        .iter()
        .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
        .collect();
    let mut checks = vec![
        "kubectl get namespaces >/dev/null 2>&1 || { echo \"kubectl: cannot reach the cluster\"; exit 1; }".to_owned(),
    ];
    let node_check = |name: &str, selector: Vec<String>| {
        let selector = selector.join(",");
        format!(
            "kubectl get nodes -o name -l {} | grep -q . || {{ echo \"{name}: no node matches {}\"; exit 1; }}",
            shell_quote(&selector),
            selector.replace('"', "")
        )
    };
    if vendors.is_empty() && !base.is_empty() {
        checks.push(node_check("CPU", base.clone()));
    }
    for v in vendors {
        let mut selector = vec![format!("{}=true", v.pci_label())];
        selector.extend(base.iter().cloned());
        checks.push(node_check(v.name, selector));
        if let Some(class) = v.runtime_class {
            checks.push(format!(
                "kubectl get runtimeclass {class} >/dev/null 2>&1 || {{ echo \"{}: no RuntimeClass {class}\"; exit 1; }}",
                v.name
            ));
        }
    }
    checks.push("echo OK".to_owned());
    format!("(\n  {}\n)", checks.join("\n  "))
}

fn namespace(chart: &Chart) -> Value {
    let mut labels = chart.labels(&[]);
    if let Value::Object(map) = &mut labels {
        for (mode, level) in &chart.pod_security {
            map.insert(format!("pod-security.kubernetes.io/{mode}"), json!(level));
        }
    }
    json!({
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": chart.namespace, "labels": labels},
    })
}

fn token_secret(chart: &Chart, token: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": chart.token_secret,
            "namespace": chart.namespace,
            "labels": chart.labels(&[("app.kubernetes.io/instance", &chart.instance())]),
        },
        "stringData": {"token": token},
    })
}

fn pull_secret(chart: &Chart, index: usize, credential: &super::values::ImageCredential) -> Value {
    // kubelet reads `username` and `password` as given; `auth` is only an alternative spelling.
    let auths = match (&credential.username, &credential.password) {
        (Some(u), Some(p)) => {
            json!({credential.registry.clone(): {"username": u, "password": p}})
        }
        _ => json!({}),
    };
    json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/dockerconfigjson",
        "metadata": {
            "name": format!("{PULL_SECRET_PREFIX}{index}"),
            "namespace": chart.namespace,
            "labels": chart.labels(&[("app.kubernetes.io/instance", &chart.instance())]),
        },
        "stringData": {".dockerconfigjson": json!({"auths": auths}).to_string()},
    })
}

fn host_volume(m: &HostMount) -> (Value, Value) {
    let kind = if m.file {
        "FileOrCreate"
    } else {
        "DirectoryOrCreate"
    };
    (
        json!({"name": m.name, "mountPath": m.path, "readOnly": m.read_only}),
        json!({"name": m.name, "hostPath": {"path": m.path, "type": kind}}),
    )
}

fn daemonset(chart: &Chart, vendor: Option<&Vendor>, chosen: &[&Vendor], several: bool) -> Value {
    let (name, vendor_id) = match vendor {
        Some(v) => (format!("{DAEMONSET}-{}", v.id), v.id),
        None => (DAEMONSET.to_owned(), "cpu"),
    };
    let instance = chart.instance();
    let selector = json!({
        "app.kubernetes.io/name": DAEMONSET,
        "app.kubernetes.io/instance": instance,
        VENDOR_LABEL: vendor_id,
    });
    let labels = chart.labels(&[
        ("app.kubernetes.io/name", DAEMONSET),
        ("app.kubernetes.io/instance", &instance),
        ("app.kubernetes.io/component", "worker"),
        (VENDOR_LABEL, vendor_id),
    ]);

    let mut node_selector = chart.node_selector.clone();
    if let Some(v) = vendor {
        node_selector.insert(v.pci_label(), json!("true"));
    }
    let mut affinity = Map::new();
    if vendor.is_none() && !chosen.is_empty() {
        let away: Vec<Value> = chosen
            .iter()
            .map(|v| json!({"key": v.pci_label(), "operator": "DoesNotExist"}))
            .collect();
        affinity.insert(
            "nodeAffinity".to_owned(),
            json!({"requiredDuringSchedulingIgnoredDuringExecution":
                {"nodeSelectorTerms": [{"matchExpressions": away}]}}),
        );
    }
    if several {
        affinity.insert(
            "podAntiAffinity".to_owned(),
            json!({"requiredDuringSchedulingIgnoredDuringExecution": [{
                "topologyKey": "kubernetes.io/hostname",
                "labelSelector": {"matchLabels": {
                    "app.kubernetes.io/name": DAEMONSET,
                    "app.kubernetes.io/instance": instance,
                }},
            }]}),
        );
    }

    let mut args = vec![
        "worker".to_owned(),
        "--server-url".to_owned(),
        chart.server_url.clone(),
        "--proxy-mode".to_owned(),
        chart.proxy_mode.as_str().to_owned(),
        "--data-dir".to_owned(),
        DATA_DIR.to_owned(),
        "--worker-port".to_owned(),
        chart.port.to_string(),
    ];
    let mut ports = Vec::new();
    if chart.proxy_mode != ProxyMode::Tunnel {
        ports.push(json!({"name": "worker", "containerPort": chart.port, "protocol": "TCP"}));
    }
    if chart.metrics_enabled {
        args.extend([
            "--worker-metrics-port".to_owned(),
            chart.metrics_port.to_string(),
        ]);
        ports.push(
            json!({"name": "metrics", "containerPort": chart.metrics_port, "protocol": "TCP"}),
        );
    } else {
        args.push("--disable-worker-metrics".to_owned());
    }

    let mut env = vec![
        json!({"name": "FADEN_TOKEN", "valueFrom": {"secretKeyRef": {"name": chart.token_secret, "key": "token"}}}),
        json!({"name": "FADEN_WORKER_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}),
        json!({"name": "FADEN_WORKER_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}),
    ];
    let vendor_env = vendor.map_or(&[][..], |v| v.env).iter();
    let vendor_k8s_env = vendor.map_or(&[][..], |v| v.k8s_env).iter();
    env.extend(
        vendor_env
            .chain(vendor_k8s_env)
            .map(|(k, v)| json!({"name": k, "value": v})),
    );

    let data = (
        json!({"name": "faden-data", "mountPath": DATA_DIR}),
        json!({"name": "faden-data", "hostPath": {"path": chart.data_dir, "type": "DirectoryOrCreate"}}),
    );
    let (mut mounts, mut volumes): (Vec<Value>, Vec<Value>) = std::iter::once(data)
        .chain(
            vendor
                .map_or(&[][..], |v| v.k8s_mounts)
                .iter()
                .map(host_volume),
        )
        .unzip();
    mounts.extend(chart.extra_mounts.iter().cloned());
    volumes.extend(chart.extra_volumes.iter().cloned());

    let mut container = json!({
        "name": "worker",
        "image": chart.image,
        "command": ["faden"],
        "args": args,
        "env": env,
        "securityContext": {"privileged": true},
        "volumeMounts": mounts,
    });
    if let Value::Object(c) = &mut container {
        if let Some(policy) = &chart.pull_policy {
            c.insert("imagePullPolicy".to_owned(), json!(policy));
        }
        if !ports.is_empty() {
            c.insert("ports".to_owned(), json!(ports));
        }
        if !chart.resources.is_empty() {
            c.insert("resources".to_owned(), json!(chart.resources));
        }
    }
    let mut pod = json!({
        "automountServiceAccountToken": false,
        "enableServiceLinks": false,
        "hostNetwork": true,
        "dnsPolicy": "ClusterFirstWithHostNet",
        "containers": [container],
        "volumes": volumes,
    });
    if let Value::Object(p) = &mut pod {
        if let Some(class) = vendor.and_then(|v| v.runtime_class) {
            p.insert("runtimeClassName".to_owned(), json!(class));
        }
        if !node_selector.is_empty() {
            p.insert("nodeSelector".to_owned(), Value::Object(node_selector));
        }
        if !affinity.is_empty() {
            p.insert("affinity".to_owned(), Value::Object(affinity));
        }
        if !chart.tolerations.is_empty() {
            p.insert("tolerations".to_owned(), json!(chart.tolerations));
        }
        if !chart.pull_secrets.is_empty() {
            p.insert("imagePullSecrets".to_owned(), json!(chart.pull_secrets));
        }
    }

    json!({
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": name, "namespace": chart.namespace, "labels": labels},
        "spec": {
            "selector": {"matchLabels": selector},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    })
}
