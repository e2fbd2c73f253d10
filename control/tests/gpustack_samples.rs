//! faden's wire types read every object a real GPUStack 2.3.0 server sent (recorded in
//! `tests/fixtures/gpustack/`, copied from `shared/gpustack-samples/`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use control_client::model::{ApiKey, Cluster, ListResponse, Model, ModelInstance, Worker};
use serde::de::DeserializeOwned;
use serde_json::Value;

fn fixtures() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpustack");
    let mut out = Vec::new();
    for dir in [root.clone(), root.join("fake-gpu")] {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "json")
                && !path.to_string_lossy().contains("timeline")
            {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

fn parse<T: DeserializeOwned>(file: &Path, value: &Value) -> T {
    serde_json::from_value(value.clone())
        .unwrap_or_else(|e| panic!("{}: {e}\n{value:#}", file.display()))
}

/// Parses a single object or a list answer of `T`; returns how many objects were read.
fn read_all<T: DeserializeOwned>(file: &Path, body: &Value) -> usize {
    if body.get("items").is_some() {
        let list: ListResponse<T> = parse(file, body);
        list.items.len()
    } else {
        let _: T = parse(file, body);
        1
    }
}

#[test]
fn every_recorded_object_parses() {
    let mut counts = std::collections::BTreeMap::<&str, usize>::new();
    for file in fixtures() {
        let text = std::fs::read_to_string(&file).unwrap();
        let record: Value = serde_json::from_str(&text).unwrap();
        let Some(req) = record.get("request") else {
            continue;
        };
        let path = req["path"].as_str().unwrap_or("");
        let status = record["response"]["status"].as_u64().unwrap_or(0);
        let body = &record["response"]["body"];
        if status >= 400 {
            // GPUStack's error shape, which faden answers with too.
            assert!(
                body["code"].is_u64() && body["reason"].is_string() && body["message"].is_string(),
                "{}",
                file.display()
            );
            *counts.entry("errors").or_default() += 1;
            continue;
        }
        let base = path.split('?').next().unwrap_or(path);
        let segments: Vec<&str> = base.trim_start_matches('/').split('/').collect();
        let n = match segments.as_slice() {
            ["v2", "clusters"] | ["v2", "clusters", _] => {
                ("clusters", read_all::<Cluster>(&file, body))
            }
            ["v2", "workers"] | ["v2", "workers", _] => {
                ("workers", read_all::<Worker>(&file, body))
            }
            ["v2", "models"] | ["v2", "models", _] => ("models", read_all::<Model>(&file, body)),
            ["v2", "model-instances"] | ["v2", "model-instances", _] => {
                ("model-instances", read_all::<ModelInstance>(&file, body))
            }
            ["v2", "api-keys"] | ["v2", "api-keys", _] => {
                ("api-keys", read_all::<ApiKey>(&file, body))
            }
            _ => ("other", 0),
        };
        *counts.entry(n.0).or_default() += n.1;
    }
    eprintln!("objects read: {counts:?}");
    for kind in [
        "clusters",
        "workers",
        "models",
        "model-instances",
        "api-keys",
        "errors",
    ] {
        assert!(
            counts.get(kind).copied().unwrap_or(0) > 0,
            "no {kind} in the fixtures: {counts:?}"
        );
    }
}

#[test]
fn gpustack_specifics_are_understood() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpustack");
    let read = |name: &str| -> Value {
        let v: Value =
            serde_json::from_str(&std::fs::read_to_string(root.join(name)).unwrap()).unwrap();
        v["response"]["body"].clone()
    };
    // Capitalised provider, omitted nulls.
    let cluster: Cluster = serde_json::from_value(read("cluster-get.json")).unwrap();
    assert_eq!(cluster.provider, control_client::model::Provider::Docker);
    // Worker: null metrics_port falls back to the default; proxy mode and state read.
    let worker: Worker = serde_json::from_value(read("worker-get.json")).unwrap();
    assert_eq!(
        worker.metrics_port,
        control_client::model::MetricsPort::default()
    );
    // A worker without metrics (`--disable-worker-metrics`) is stored with -1.
    let mut quiet = read("worker-get.json");
    quiet["metrics_port"] = (-1).into();
    let quiet: Worker = serde_json::from_value(quiet).unwrap();
    assert_eq!(
        quiet.metrics_port,
        control_client::model::MetricsPort::Disabled
    );
    assert_eq!(serde_json::to_value(quiet).unwrap()["metrics_port"], -1);
    // API key: scope ["*"] is the widest scope.
    let key: ApiKey = serde_json::from_value(read("api-key-create.json")).unwrap();
    assert_eq!(key.scope, control_client::model::Scope::All);
    assert!(key.value.is_some());
}
