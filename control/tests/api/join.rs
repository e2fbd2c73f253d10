//! The join commands of a Docker cluster (`GET /v2/clusters/{id}/join`) and the worker manifests
//! of a Kubernetes cluster (`GET /v2/clusters/{id}/manifests`).

use std::path::Path;

use serde_json::{Value, json};

use crate::common::{TestServer, start, start_with};

/// The `docker run` lines every vendor shares, before the vendor's own.
fn head() -> Vec<&'static str> {
    vec![
        "docker run -d --name faden-worker",
        "--restart=unless-stopped",
        "--privileged",
        "--network=host",
        "--volume faden-data:/var/lib/faden",
        "--volume /data/models:/data/models",
        "--volume /srv/hf:/root/.cache/huggingface:ro",
    ]
}

/// The lines after the vendor's own.
fn tail(url: &str, token: &str) -> Vec<String> {
    vec![
        "ghcr.io/faden/faden:0.1.0".to_owned(),
        "worker".to_owned(),
        format!("--server-url {url}"),
        format!("--token {token}"),
        "--proxy-mode worker".to_owned(),
        "--data-dir /var/lib/faden".to_owned(),
        "--worker-ip 10.0.0.5".to_owned(),
    ]
}

/// Each vendor's own lines of the `docker run` command, as the documents and GPUStack shape
/// them (device flags, runtime, driver mounts, environment).
const VENDOR_LINES: &[(&str, &[&str])] = &[
    ("nvidia", &["--gpus all", "--runtime nvidia"]),
    (
        "amd",
        &[
            "--volume /opt/rocm:/opt/rocm:ro",
            "--volume /opt/rocm/lib:/opt/rocm/lib:ro",
            "--device /dev/kfd",
            "--device /dev/dri",
            "--group-add video",
        ],
    ),
    (
        "ascend",
        &[
            "--volume /usr/local/Ascend/driver:/usr/local/Ascend/driver:ro",
            r#"--env "ASCEND_VISIBLE_DEVICES=$(ls /dev/davinci[0-9]* | sed 's|/dev/davinci||' | paste -sd, -)""#,
            "--runtime ascend",
        ],
    ),
    (
        "hygon",
        &[
            "--volume /opt/hyhal:/opt/hyhal:ro",
            "--volume /opt/dtk:/opt/dtk:ro",
            "--env ROCM_PATH=/opt/dtk",
            "--env ROCM_SMI_LIB_PATH=/opt/hyhal/lib",
        ],
    ),
    ("mthreads", &["--runtime mthreads"]),
    (
        "iluvatar",
        &[
            "--volume /usr/local/corex:/usr/local/corex:ro",
            "--runtime iluvatar",
        ],
    ),
    (
        "cambricon",
        &[
            "--volume /usr/local/neuware:/usr/local/neuware:ro",
            "--volume /usr/bin/cnmon:/usr/bin/cnmon:ro",
        ],
    ),
    (
        "metax",
        &[
            "--volume /opt/mxdriver:/opt/mxdriver:ro",
            "--volume /opt/maca:/opt/maca:ro",
        ],
    ),
];

async fn registration_token(t: &TestServer, id: i64) -> String {
    let cluster = t.admin.get(&format!("/v2/clusters/{id}")).await.expect(200);
    cluster.json()["registration_token"]
        .as_str()
        .unwrap()
        .to_owned()
}

async fn cluster(t: &TestServer, body: Value) -> i64 {
    t.admin.post("/v2/clusters", &body).await.expect(200).json()["id"]
        .as_i64()
        .unwrap()
}

#[tokio::test]
async fn docker_join_commands_per_vendor() {
    let t = start().await;
    let id = cluster(&t, json!({"name": "d"})).await;
    let token = registration_token(&t, id).await;
    let url = t.admin.base().to_owned();
    for (vendor, own) in VENDOR_LINES {
        let query = format!(
            "vendor={vendor}&worker_ip=10.0.0.5&mounts=/data/models,/srv/hf:/root/.cache/huggingface:ro"
        );
        let r = t
            .admin
            .get(&format!("/v2/clusters/{id}/join?{query}"))
            .await
            .expect(200)
            .json();
        let mut lines: Vec<String> = head().into_iter().map(str::to_owned).collect();
        lines.extend(own.iter().map(|l| (*l).to_owned()));
        lines.extend(tail(&url, &token));
        assert_eq!(r["run"], lines.join(" \\\n  "), "{vendor}");
        assert_eq!(r["vendor"], *vendor);
        assert_eq!(
            r["experimental"],
            !["nvidia", "amd", "ascend"].contains(vendor),
            "{vendor}"
        );
        assert_eq!(r["image"], "ghcr.io/faden/faden:0.1.0");
        assert_eq!(r["server_url"], url);
        assert_eq!(r["proxy_mode"], "worker");
        assert_eq!(r["worker_ip"], "10.0.0.5");
        // The test server's URL is a loopback address: other hosts could not reach it.
        assert_eq!(r["warnings"].as_array().unwrap().len(), 1, "{r}");
        let check = r["env_check"].as_str().unwrap();
        assert!(check.starts_with("(\n  docker info"), "{check}");
        assert!(check.ends_with("\n  echo OK\n)"), "{check}");
    }

    // The documented NVIDIA check, whole.
    let r = t
        .admin
        .get(&format!("/v2/clusters/{id}/join?vendor=NVIDIA"))
        .await
        .expect(200)
        .json();
    assert_eq!(
        r["env_check"],
        "(\n  docker info >/dev/null 2>&1 || { echo \"Docker: not running, or this user may not use it\"; exit 1; }\n  nvidia-smi >/dev/null 2>&1 || { echo \"NVIDIA driver: 'nvidia-smi' failed\"; exit 1; }\n  docker info 2>/dev/null | grep -qiE 'runtimes:.* nvidia( |$)' || { echo \"NVIDIA container toolkit: Docker has no 'nvidia' runtime\"; exit 1; }\n  echo OK\n)"
    );
    // Without a worker IP the worker finds the address it reaches the server from.
    assert!(r["worker_ip"].is_null());
    assert!(!r["run"].as_str().unwrap().contains("--worker-ip"));
    t.stop().await;
}

#[tokio::test]
async fn docker_join_takes_the_clusters_registry_proxy_mode_and_options() {
    let t = start_with(tempfile::tempdir().unwrap(), |cfg| {
        cfg.api.server_url = "http://10.0.0.2:30080".to_owned();
        cfg.api.worker_image = "registry.example.com/team/faden:2.0".to_owned();
    })
    .await;
    let id = cluster(
        &t,
        json!({"name": "d", "default_container_registry": "mirror.example.cn/ns/",
               "worker_config": "proxy_mode: tunnel\n"}),
    )
    .await;
    let r = t
        .admin
        .get(&format!(
            "/v2/clusters/{id}/join?vendor=moore-threads&advertise_address=gpu1.example.com\
             &name=gpu%201&mounts=/models%20dir"
        ))
        .await
        .expect(200)
        .json();
    let run = r["run"].as_str().unwrap_or_else(|| panic!("{r}"));
    let token = registration_token(&t, id).await;
    assert_eq!(r["image"], "mirror.example.cn/ns/team/faden:2.0");
    assert_eq!(r["proxy_mode"], "tunnel");
    assert_eq!(r["vendor"], "mthreads");
    assert_eq!(r["warnings"], json!([]));
    // What a shell makes of it (a backslash-newline joins lines): the image (its entrypoint is
    // `faden`), then `worker` with the chosen options.
    let words = shlex::split(&run.replace("\\\n", " ")).unwrap();
    let at = words
        .iter()
        .position(|w| w == "mirror.example.cn/ns/team/faden:2.0")
        .unwrap();
    assert_eq!(
        &words[at + 1..],
        [
            "worker",
            "--server-url",
            "http://10.0.0.2:30080",
            "--token",
            &token,
            "--proxy-mode",
            "tunnel",
            "--data-dir",
            "/var/lib/faden",
            "--advertise-address",
            "gpu1.example.com",
            "--name",
            "gpu 1",
        ]
    );
    assert!(
        words.contains(&"/models dir:/models dir".to_owned()),
        "{words:?}"
    );
    // An explicit proxy mode wins over the cluster's.
    let r = t
        .admin
        .get(&format!(
            "/v2/clusters/{id}/join?vendor=amd&proxy_mode=direct"
        ))
        .await
        .expect(200)
        .json();
    assert!(r["run"].as_str().unwrap().contains("--proxy-mode direct"));
    t.stop().await;
}

#[tokio::test]
async fn join_and_manifests_refuse_bad_requests_in_the_error_shape() {
    let t = start().await;
    let d = cluster(&t, json!({"name": "d"})).await;
    let k = cluster(&t, json!({"name": "k", "provider": "kubernetes"})).await;
    let cases = [
        (
            format!("/v2/clusters/{d}/join"),
            "vendor: choose a GPU vendor",
        ),
        (
            format!("/v2/clusters/{d}/join?vendor=intel"),
            "vendor: unknown GPU vendor \"intel\"; expected one of nvidia, amd, ascend, hygon, \
             mthreads, iluvatar, cambricon, metax",
        ),
        (
            format!("/v2/clusters/{d}/join?vendor=nvidia&mounts=models"),
            "mounts: \"models\": \"models\" is not an absolute path",
        ),
        (
            format!("/v2/clusters/{d}/join?vendor=nvidia&mounts=/x:/var/lib/faden"),
            "is the worker's data directory",
        ),
        (
            format!("/v2/clusters/{d}/join?vendor=nvidia&mounts=/a:/m,/b:/m"),
            "mounts: /m is mounted twice",
        ),
        (
            format!("/v2/clusters/{d}/join?vendor=amd&mounts=/x:/opt/rocm"),
            "mounts: /opt/rocm is mounted twice",
        ),
        (
            format!("/v2/clusters/{d}/join?vendor=nvidia&worker_ip=10.0.0"),
            "worker_ip: \"10.0.0\" is not an IP address",
        ),
        (
            format!("/v2/clusters/{d}/join?vendor=nvidia&proxy_mode=sideways"),
            "proxy_mode: \"sideways\"",
        ),
        (
            format!("/v2/clusters/{d}/join?vendor=nvidia&advertise_address=a%20b"),
            "advertise_address: \"a b\" is not a host name",
        ),
        (
            format!("/v2/clusters/{d}/join?vendor=nvidia&gpu=1"),
            "unknown parameter \"gpu\"",
        ),
        (
            format!("/v2/clusters/{k}/join?vendor=nvidia"),
            "cluster k(id: 2) has provider kubernetes",
        ),
        (
            format!("/v2/clusters/{d}/manifests"),
            "cluster d(id: 1) has provider docker",
        ),
        (
            format!("/v2/clusters/{k}/manifests?vendors=nvidia,intel"),
            "unknown GPU vendor \"intel\"",
        ),
        (
            format!("/v2/clusters/{k}/manifests?vendor=nvidia"),
            "unknown parameter \"vendor\"",
        ),
    ];
    for (path, message) in &cases {
        let r = t.admin.get(path).await.expect(400).json();
        assert_eq!(r["code"], 400, "{path}");
        assert_eq!(r["reason"], "BadRequest", "{path}");
        let text = r["message"].as_str().unwrap();
        assert!(text.contains(message), "{path}: {text}");
    }
    let r = t
        .admin
        .get(&format!("/v2/clusters/{d}/join?vendor=intel"))
        .await
        .expect(400)
        .json();
    assert_eq!(r["field"], "vendor");
    assert_eq!(r["known_vendors"].as_array().unwrap().len(), 8);

    t.admin
        .get("/v2/clusters/99/join?vendor=nvidia")
        .await
        .expect(404);
    t.admin.get("/v2/clusters/99/manifests").await.expect(404);
    let data_plane = t.admin.with_token(t.key("data_plane").await);
    data_plane
        .get(&format!("/v2/clusters/{d}/join?vendor=nvidia"))
        .await
        .expect(403);
    data_plane
        .get(&format!("/v2/clusters/{k}/manifests"))
        .await
        .expect(403);
    t.admin
        .anonymous()
        .get(&format!("/v2/clusters/{k}/manifests"))
        .await
        .expect(401);
    t.stop().await;
}

/// The documents of a multi-document YAML text.
fn documents(text: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(text)
        .map(|doc| serde::Deserialize::deserialize(doc).unwrap())
        .collect()
}

fn kinds(docs: &[Value]) -> Vec<String> {
    docs.iter()
        .map(|d| {
            format!(
                "{}/{}",
                d["kind"].as_str().unwrap(),
                d["metadata"]["name"].as_str().unwrap()
            )
        })
        .collect()
}

fn pod(ds: &Value) -> &Value {
    &ds["spec"]["template"]["spec"]
}

async fn manifests(t: &TestServer, id: i64, query: &str) -> (String, Vec<Value>) {
    let reply = t
        .admin
        .get(&format!("/v2/clusters/{id}/manifests{query}"))
        .await
        .expect(200);
    assert_eq!(reply.headers["content-type"], "application/x-yaml");
    let text = reply.text();
    let docs = documents(&text);
    (text, docs)
}

#[tokio::test]
async fn manifests_per_vendor_set() {
    let t = start().await;
    let id = cluster(&t, json!({"name": "k", "provider": "kubernetes"})).await;
    let token = t
        .admin
        .get(&format!("/v2/clusters/{id}"))
        .await
        .expect(200)
        .json()["registration_token"]
        .clone();

    // No vendor: one CPU-only DaemonSet, on every node.
    let (text, docs) = manifests(&t, id, "").await;
    assert!(
        text.starts_with(
            "# faden workers for cluster \"k\" (id 1) in namespace gpustack-system: CPU"
        ),
        "{text}"
    );
    assert!(text.contains("#     echo OK\n"), "{text}");
    assert_eq!(
        kinds(&docs),
        [
            "Namespace/gpustack-system",
            "Secret/faden-cluster-1-registration",
            "DaemonSet/faden-worker"
        ]
    );
    let labels = &docs[0]["metadata"]["labels"];
    for mode in ["enforce", "audit", "warn"] {
        assert_eq!(
            labels[format!("pod-security.kubernetes.io/{mode}")],
            "privileged"
        );
    }
    assert_eq!(docs[1]["type"], "Opaque");
    assert_eq!(docs[1]["stringData"]["token"], token);
    let cpu = pod(&docs[2]);
    assert!(cpu.get("nodeSelector").is_none(), "{cpu}");
    assert!(cpu.get("affinity").is_none(), "{cpu}");
    assert_eq!(cpu["hostNetwork"], true);
    let container = &cpu["containers"][0];
    assert_eq!(container["image"], "ghcr.io/faden/faden:0.1.0");
    assert_eq!(container["command"], json!(["faden"]));
    assert_eq!(
        container["args"],
        json!([
            "worker",
            "--server-url",
            t.admin.base(),
            "--proxy-mode",
            "worker",
            "--data-dir",
            "/var/lib/faden",
            "--worker-port",
            "10150",
            "--worker-metrics-port",
            "10151"
        ])
    );
    assert_eq!(
        container["env"][0],
        json!({"name": "FADEN_TOKEN", "valueFrom": {"secretKeyRef":
            {"name": "faden-cluster-1-registration", "key": "token"}}})
    );

    // Vendors: one DaemonSet each, selected by the vendor's PCI-presence label; no CPU one.
    let (_, docs) = manifests(&t, id, "?vendors=ascend,nvidia&runtime=amd&runtime=nvidia").await;
    assert_eq!(
        kinds(&docs)[2..],
        [
            "DaemonSet/faden-worker-nvidia",
            "DaemonSet/faden-worker-amd",
            "DaemonSet/faden-worker-ascend"
        ]
    );
    for (ds, pci) in docs[2..].iter().zip(["10de", "1002", "19e5"]) {
        assert_eq!(
            pod(ds)["nodeSelector"],
            json!({format!("feature.node.kubernetes.io/pci-{pci}.present"): "true"})
        );
        // Host network: two workers on one node would share a port.
        assert_eq!(
            pod(ds)["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
                [0]["topologyKey"],
            "kubernetes.io/hostname"
        );
    }
    assert_eq!(pod(&docs[2])["runtimeClassName"], "nvidia");
    assert!(pod(&docs[3]).get("runtimeClassName").is_none());
    let ascend_mounts: Vec<&str> = pod(&docs[4])["containers"][0]["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["mountPath"].as_str().unwrap())
        .collect();
    assert_eq!(
        ascend_mounts,
        [
            "/var/lib/faden",
            "/usr/local/Ascend/driver",
            "/usr/local/Ascend/ascend-toolkit"
        ]
    );

    // One vendor: no anti-affinity needed.
    let (text, docs) = manifests(&t, id, "?vendors=Moore%20Threads").await;
    assert_eq!(kinds(&docs)[2..], ["DaemonSet/faden-worker-mthreads"]);
    assert!(pod(&docs[2]).get("affinity").is_none());
    assert!(text.contains("kubectl get runtimeclass mthreads"), "{text}");
    t.stop().await;
}

#[tokio::test]
async fn manifests_apply_k8s_options_and_merge_helm_values() {
    let t = start().await;
    let body = json!({
        "name": "k",
        "provider": "kubernetes",
        "default_container_registry": "reg.example.com",
        "worker_config": {"proxy_mode": "tunnel", "disable_worker_metrics": true},
        "k8sOptions": {
            "namespace": "gpu",
            "nodeSelector": {"pool": "a100"},
            "volumeMounts": [
                {"name": "models", "mountPath": "/models", "readOnly": true,
                 "volumeSource": {"hostPath": {"path": "/data/models", "type": "Directory"}}},
                {"name": "cache", "mountPath": "/cache",
                 "volumeSource": {"persistentVolumeClaim": {"claimName": "hf-cache"}}},
            ],
            "imageCredentials": [{"registry": "reg.example.com", "username": "u", "password": "p"}],
            "helmValues": {
                "image": {"pullPolicy": "Always"},
                "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                "resources": {"limits": {"memory": "2Gi"}},
                "worker": {"cpuEnabled": true, "port": 20150},
            },
        },
    });
    let id = cluster(&t, body.clone()).await;
    let (_, docs) = manifests(&t, id, "?vendors=nvidia").await;
    assert_eq!(
        kinds(&docs),
        [
            "Namespace/gpu",
            "Secret/faden-cluster-1-registration",
            "Secret/faden-image-pull-secret-0",
            "DaemonSet/faden-worker",
            "DaemonSet/faden-worker-nvidia"
        ]
    );
    assert_eq!(docs[1]["metadata"]["namespace"], "gpu");
    assert_eq!(docs[2]["type"], "kubernetes.io/dockerconfigjson");
    let config: Value =
        serde_json::from_str(docs[2]["stringData"][".dockerconfigjson"].as_str().unwrap()).unwrap();
    assert_eq!(
        config,
        json!({"auths": {"reg.example.com": {"username": "u", "password": "p"}}})
    );

    // helmValues' `worker.cpuEnabled` adds the CPU worker beside the vendor's, kept off the
    // vendor's nodes.
    let cpu = pod(&docs[3]);
    assert_eq!(cpu["nodeSelector"], json!({"pool": "a100"}));
    assert_eq!(
        cpu["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"],
        json!({"nodeSelectorTerms": [{"matchExpressions": [
            {"key": "feature.node.kubernetes.io/pci-10de.present", "operator": "DoesNotExist"}]}]})
    );
    let nvidia = pod(&docs[4]);
    assert_eq!(
        nvidia["nodeSelector"],
        json!({"pool": "a100", "feature.node.kubernetes.io/pci-10de.present": "true"})
    );
    assert_eq!(
        nvidia["imagePullSecrets"],
        json!([{"name": "faden-image-pull-secret-0"}])
    );
    // Lists replace, objects merge, scalars replace.
    assert_eq!(
        nvidia["tolerations"],
        json!([{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}])
    );
    let c = &nvidia["containers"][0];
    assert_eq!(c["image"], "reg.example.com/faden/faden:0.1.0");
    assert_eq!(c["imagePullPolicy"], "Always");
    assert_eq!(c["resources"], json!({"limits": {"memory": "2Gi"}}));
    assert_eq!(
        c["args"],
        json!([
            "worker",
            "--server-url",
            t.admin.base(),
            "--proxy-mode",
            "tunnel",
            "--data-dir",
            "/var/lib/faden",
            "--worker-port",
            "20150",
            "--disable-worker-metrics"
        ])
    );
    // A tunnel worker opens no port of its own; metrics are off.
    assert!(c.get("ports").is_none(), "{c}");
    let mounts: Vec<&str> = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(mounts, ["faden-data", "models", "cache"]);
    assert_eq!(
        nvidia["volumes"][2],
        json!({"name": "cache", "persistentVolumeClaim": {"claimName": "hf-cache"}})
    );
    // The chart values endpoint shows what the manifests were rendered from.
    let values = t
        .admin
        .get(&format!("/v2/clusters/{id}/helm-values"))
        .await
        .expect(200)
        .json();
    assert_eq!(values["worker"]["port"], 20150);
    assert_eq!(values["worker"]["cpuEnabled"], true);
    assert_eq!(values["worker"]["proxyMode"], "tunnel");
    assert_eq!(values["image"]["registry"], "reg.example.com");

    // A protected path is refused by name and the manifests stay as they were.
    let mut bad = body.clone();
    bad["k8sOptions"]["helmValues"]["image"]["tag"] = json!("evil");
    bad["k8sOptions"]["helmValues"]["nodeSelector"] = json!({});
    let r = t
        .admin
        .put(&format!("/v2/clusters/{id}"), &bad)
        .await
        .expect(422)
        .json();
    assert_eq!(r["rejected_paths"], json!(["image.tag", "nodeSelector"]));
    assert!(r["message"].as_str().unwrap().contains("image.tag"), "{r}");
    let (_, again) = manifests(&t, id, "?vendors=nvidia").await;
    assert_eq!(again, docs);

    // Turning the CPU worker off with no vendor leaves nothing to deploy.
    let mut off = body.clone();
    off["k8sOptions"]["helmValues"]["worker"]["cpuEnabled"] = json!(false);
    let r = replace_then_render(&t, id, &off, 400).await;
    let message = r["message"].as_str().unwrap();
    assert!(message.starts_with("no worker to deploy"), "{r}");

    // A value helmValues leaves unusable is named.
    let mut odd = body;
    odd["k8sOptions"]["helmValues"]["worker"]["port"] = json!("http");
    let r = replace_then_render(&t, id, &odd, 422).await;
    assert_eq!(
        r["errors"],
        json!(["chart value worker.port must be a port (1-65535), got \"http\""])
    );
    t.stop().await;
}

/// PUTs `body` as cluster `id` (accepted), then asks for its CPU manifests, answered `status`.
async fn replace_then_render(t: &TestServer, id: i64, body: &Value, status: u16) -> Value {
    t.admin
        .put(&format!("/v2/clusters/{id}"), body)
        .await
        .expect(200);
    t.admin
        .get(&format!("/v2/clusters/{id}/manifests"))
        .await
        .expect(status)
        .json()
}

#[tokio::test]
async fn bad_k8s_options_are_refused_when_the_cluster_is_written() {
    let t = start().await;
    let r = t
        .admin
        .post(
            "/v2/clusters",
            &json!({"name": "k", "provider": "kubernetes", "k8sOptions": {
                "namespace": "Not A Label",
                "volumeMounts": [{"name": "m", "mountPath": "/var/lib/faden",
                                  "volumeSource": {"hostPath": {"path": "/m"}}}],
            }}),
        )
        .await
        .expect(422)
        .json();
    let errors = r["errors"].as_array().unwrap();
    assert_eq!(errors.len(), 2, "{r}");
    assert!(
        errors[0]
            .as_str()
            .unwrap()
            .starts_with("k8sOptions.namespace"),
        "{r}"
    );
    assert!(
        errors[1]
            .as_str()
            .unwrap()
            .contains("worker's data directory"),
        "{r}"
    );
    t.stop().await;
}

/// Every manifest a matrix of vendor sets and options renders, written to a folder and checked
/// against the Kubernetes schemas by `kubernetes-validate --strict` when it is on `PATH`
/// (`scripts/validate-join.sh` installs it and sets `FADEN_REQUIRE_KUBERNETES_VALIDATE=1`, so
/// CI cannot skip it). `FADEN_JOIN_MANIFESTS_DIR` keeps the files.
#[tokio::test]
async fn every_rendered_manifest_validates() {
    let t = start().await;
    let plain = cluster(&t, json!({"name": "plain", "provider": "kubernetes"})).await;
    let full = cluster(
        &t,
        json!({
            "name": "full",
            "provider": "kubernetes",
            "worker_config": {"proxy_mode": "tunnel"},
            "k8sOptions": {
                "namespace": "gpu-workers",
                "nodeSelector": {"example.com/pool": "gpu"},
                "volumeMounts": [
                    {"name": "models", "mountPath": "/models", "readOnly": true,
                     "volumeSource": {"hostPath": {"path": "/data/models", "type": "Directory"}}},
                    {"name": "cache", "mountPath": "/cache",
                     "volumeSource": {"persistentVolumeClaim": {"claimName": "hf", "readOnly": true}}},
                    {"name": "conf", "mountPath": "/etc/extra",
                     "volumeSource": {"configMap": {"name": "extra", "optional": true}}},
                ],
                "imageCredentials": [{"registry": "reg.example.com", "username": "u", "password": "p"},
                                     {"registry": "quay.io"}],
                "helmValues": {
                    "worker": {"cpuEnabled": true},
                    "imagePullSecrets": ["existing-secret"],
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
                    "podSecurity": {"warn": "baseline"},
                },
            },
        }),
    )
    .await;
    let all = "nvidia,amd,ascend,hygon,mthreads,iluvatar,cambricon,metax";
    let mut queries = vec![String::new(), format!("?vendors={all}")];
    queries.extend(all.split(',').map(|v| format!("?vendors={v}")));

    let dir = match std::env::var_os("FADEN_JOIN_MANIFESTS_DIR") {
        Some(d) => {
            std::fs::create_dir_all(&d).unwrap();
            tempfile::tempdir_in(d).unwrap().keep()
        }
        None => tempfile::tempdir().unwrap().keep(),
    };
    let mut files = 0;
    for (name, id) in [("plain", plain), ("full", full)] {
        for query in &queries {
            let (text, docs) = manifests(&t, id, query).await;
            assert!(docs.len() >= 3, "{text}");
            let vendors = query
                .strip_prefix("?vendors=")
                .unwrap_or("cpu")
                .replace(',', "-");
            std::fs::write(dir.join(format!("{name}-{vendors}.yaml")), text).unwrap();
            files += 1;
        }
    }
    assert_eq!(files, 20);
    validate(&dir);
    t.stop().await;
}

fn validate(dir: &Path) {
    let required = std::env::var("FADEN_REQUIRE_KUBERNETES_VALIDATE").is_ok_and(|v| v == "1");
    let mut paths: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    paths.sort();
    let run = std::process::Command::new("kubernetes-validate")
        .arg("--strict")
        .args(&paths)
        .output();
    match run {
        Ok(out) => {
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                out.status.success(),
                "kubernetes-validate failed in {}:\n{text}",
                dir.display()
            );
            assert!(!text.contains("ERROR"), "{text}");
            eprintln!(
                "kubernetes-validate: {} files in {} valid",
                paths.len(),
                dir.display()
            );
        }
        Err(e) if !required => {
            eprintln!("kubernetes-validate not run ({e}); scripts/validate-join.sh runs it");
        }
        Err(e) => panic!("kubernetes-validate: {e}"),
    }
}
