//! GPUStack's own fields, accepted by name. A GPUStack 2.3 worker sends whole GPUStack objects
//! (its registration, its status, the model instances it updates) and reads them back: the
//! fields faden uses are parsed as usual, the other fields GPUStack defines are kept verbatim
//! beside them (what a worker `PUT`s it `GET`s back), and any other key is still refused.

use axum::extract::{FromRequest, Request};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::error::ApiError;
use super::extract::{parse_json, read_body};

/// The GPUStack fields a request body may carry beside the ones faden parses.
pub(super) trait GpuStackFields {
    const GPUSTACK: &'static [&'static str];
}

/// A JSON body parsed strictly as `T`, with the GPUStack fields `T` lists taken out first.
#[derive(Debug)]
pub(super) struct GpuStackBody<T> {
    pub(super) body: T,
    pub(super) gpustack: Map<String, Value>,
}

impl<S: Send + Sync, T: DeserializeOwned + GpuStackFields> FromRequest<S> for GpuStackBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, _state: &S) -> Result<Self, ApiError> {
        let bytes = read_body(req).await?;
        let mut object: Map<String, Value> = parse_json(&bytes)?;
        let gpustack = T::GPUSTACK
            .iter()
            .filter_map(|field| object.remove_entry(*field))
            .collect();
        // Parsed again from what is left, so that errors name fields exactly as for any body.
        let rest = serde_json::to_vec(&object)
            .map_err(|e| ApiError::bad_request(format!("malformed JSON: {e}")))?;
        Ok(Self {
            body: parse_json(&rest)?,
            gpustack,
        })
    }
}

/// A stored object and the GPUStack fields it was written with (only fields of a
/// [`GpuStackFields`] list ever get there).
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Stored<T> {
    #[serde(flatten)]
    pub(super) object: T,
    #[serde(flatten)]
    pub(super) gpustack: Map<String, Value>,
}

/// GPUStack's worker fields that faden keeps but does not use (`WorkerCreate`, and
/// `WorkerStatusPublic` for status reports). `state_message` is faden's own field (the server
/// writes it); what a worker sends for it is ignored.
pub(super) const WORKER: &[&str] = &[
    "status",
    "system_reserved",
    "machine_id",
    "owner_principal_id",
    "external_id",
    "worker_version",
    "gateway_endpoint",
];

/// GPUStack's model fields that faden keeps but does not use (`ModelCreate`).
pub(super) const MODEL: &[&str] = &[
    "source",
    "huggingface_repo_id",
    "huggingface_filename",
    "model_scope_model_id",
    "model_scope_file_path",
    "local_path",
    "access_policy",
    "backend",
    "backend_parameters",
    "backend_version",
    "categories",
    "cpu_offloading",
    "disaggregation",
    "distributable",
    "distributed_inference_across_workers",
    "enable_model_route",
    "env",
    "extended_kv_cache",
    "gather",
    "generic_proxy",
    "gpu_selector",
    "gpu_type_selector",
    "image_name",
    "lora_list",
    "meta",
    "native_anthropic_api",
    "owner_principal_id",
    "placement_strategy",
    "restart_on_error",
    "revision_history_limit",
    "roles",
    "run_command",
    "scaling_schedule",
    "speculative_config",
    "worker_selector",
];

/// GPUStack's model instance fields that faden keeps but does not use (`ModelInstanceUpdate`).
pub(super) const INSTANCE: &[&str] = &[
    "source",
    "huggingface_repo_id",
    "huggingface_filename",
    "model_scope_model_id",
    "model_scope_file_path",
    "local_path",
    "worker_name",
    "worker_advertise_address",
    "worker_ip",
    "worker_ifname",
    "pid",
    "ports",
    "download_progress",
    "resolved_path",
    "draft_model_source",
    "draft_model_download_progress",
    "draft_model_resolved_path",
    "restart_count",
    "last_restart_time",
    "computed_resource_claim",
    "cache_config",
    "gpu_type",
    "gpu_indexes",
    "gpu_addresses",
    "backend",
    "backend_version",
    "api_detected_backend_version",
    "injected_backend_parameters",
    "distributed_servers",
    "owner_principal_id",
    "mounted_loras",
    "role",
    "group_id",
    "spec_digest",
    "named_ports",
    "router_peer_snapshot",
    "draining_since",
];

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use control_client::model::{Model, ModelInstance, Worker};

    /// The kept fields never shadow one of faden's: a stored row must not hold a key twice.
    #[test]
    fn kept_fields_are_not_fadens_own() {
        let worker: Worker = serde_json::from_value(serde_json::json!({
            "id": 1, "name": "w", "cluster_id": 1, "state": "ready",
            "created_at": "2026-01-01T00:00:00Z", "updated_at": "2026-01-01T00:00:00Z",
            "ifname": "lo", "advertise_address": "a", "proxy_address": "p"
        }))
        .unwrap();
        let instance: ModelInstance = serde_json::from_value(serde_json::json!({
            "id": 1, "model_id": 1, "state": "running",
            "created_at": "2026-01-01T00:00:00Z", "updated_at": "2026-01-01T00:00:00Z"
        }))
        .unwrap();
        let model = Model {
            id: 1,
            name: "m".into(),
            cluster_id: Some(1),
            description: Some("d".into()),
            replicas: Some(1),
            ready_replicas: Some(1),
            route_policy: None,
            created_at: None,
            updated_at: None,
        };
        for (own, kept) in [
            (serde_json::to_value(worker).unwrap(), WORKER),
            (serde_json::to_value(instance).unwrap(), INSTANCE),
            (serde_json::to_value(model).unwrap(), MODEL),
        ] {
            let Value::Object(own) = own else { panic!() };
            for field in kept {
                assert!(!own.contains_key(*field), "{field} is faden's own");
            }
        }
    }
}
