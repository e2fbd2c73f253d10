use serde_json::json;

use crate::common::start;

#[tokio::test]
async fn name_is_required_and_unique() {
    let t = start().await;
    let r = t
        .admin
        .post("/v2/clusters", &json!({"description": "x"}))
        .await
        .expect(422);
    assert!(
        r.json()["message"].as_str().unwrap().contains("name"),
        "{}",
        r.text()
    );
    t.admin
        .post("/v2/clusters", &json!({"name": "  "}))
        .await
        .expect(422);
    let c = t.cluster("prod").await;
    assert_eq!(c["provider"], "docker");
    assert_eq!(c["state"], "ready");
    assert!(
        c["registration_token"]
            .as_str()
            .unwrap()
            .starts_with("gpustack_")
    );
    let r = t
        .admin
        .post("/v2/clusters", &json!({"name": "prod"}))
        .await
        .expect(409);
    assert_eq!(r.json()["reason"], "Conflict");
    // Renaming onto a taken name is a conflict too.
    let other = t.cluster("dev").await;
    t.admin
        .put(
            &format!("/v2/clusters/{}", other["id"]),
            &json!({"name": "prod"}),
        )
        .await
        .expect(409);
    t.stop().await;
}

#[tokio::test]
async fn put_replaces_the_whole_cluster() {
    let t = start().await;
    let created = t
        .admin
        .post(
            "/v2/clusters",
            &json!({"name": "a", "description": "first", "provider": "kubernetes",
                    "worker_config": "debug: true\n", "default_container_registry": "reg.example.com"}),
        )
        .await
        .expect(200)
        .json();
    assert_eq!(created["worker_config"], json!({"debug": true}));
    let id = created["id"].as_i64().unwrap();
    // Omitted fields return to their defaults; name is still required.
    t.admin
        .put(&format!("/v2/clusters/{id}"), &json!({"description": "x"}))
        .await
        .expect(422);
    let replaced = t
        .admin
        .put(&format!("/v2/clusters/{id}"), &json!({"name": "b"}))
        .await
        .expect(200)
        .json();
    assert_eq!(replaced["name"], "b");
    assert!(replaced.get("description").is_none(), "{replaced}");
    assert!(replaced.get("worker_config").is_none(), "{replaced}");
    assert!(
        replaced.get("default_container_registry").is_none(),
        "{replaced}"
    );
    assert_eq!(replaced["provider"], "docker");
    // The registration token and creation time survive a replace.
    assert_eq!(
        replaced["registration_token"],
        created["registration_token"]
    );
    assert_eq!(replaced["created_at"], created["created_at"]);
    // A GET body can be PUT back as it is (read-only fields are accepted and ignored).
    let got = t
        .admin
        .get(&format!("/v2/clusters/{id}"))
        .await
        .expect(200)
        .json();
    t.admin
        .put(&format!("/v2/clusters/{id}"), &got)
        .await
        .expect(200);
    t.admin
        .put("/v2/clusters/999", &json!({"name": "z"}))
        .await
        .expect(404);
    t.stop().await;
}

#[tokio::test]
async fn delete_is_refused_while_models_or_workers_remain() {
    let t = start().await;
    let c = t.cluster("busy").await;
    let id = c["id"].as_i64().unwrap();
    let model = t
        .admin
        .post("/v2/models", &json!({"name": "m", "cluster_id": id}))
        .await
        .expect(200)
        .json();
    t.register(&c, "w1").await;
    let r = t
        .admin
        .delete(&format!("/v2/clusters/{id}"))
        .await
        .expect(409)
        .json();
    assert_eq!(r["models"], 1);
    assert_eq!(r["workers"], 1);
    assert!(
        r["message"]
            .as_str()
            .unwrap()
            .contains("1 model(s) and 1 worker(s)"),
        "{r}"
    );
    t.admin
        .delete(&format!("/v2/models/{}", model["id"]))
        .await
        .expect(204);
    let workers = t.admin.get("/v2/workers").await.expect(200).json();
    let wid = workers["items"][0]["id"].as_i64().unwrap();
    t.admin
        .delete(&format!("/v2/workers/{wid}"))
        .await
        .expect(204);
    t.admin
        .delete(&format!("/v2/clusters/{id}"))
        .await
        .expect(204);
    t.admin.get(&format!("/v2/clusters/{id}")).await.expect(404);
    t.admin
        .delete(&format!("/v2/clusters/{id}"))
        .await
        .expect(404);
    t.stop().await;
}

#[tokio::test]
async fn shuihua_needs_a_registry_that_is_not_docker_hub() {
    let t = start().await;
    let post = |body| {
        let c = t.admin.clone();
        async move { c.post("/v2/clusters", &body).await }
    };
    let r = post(json!({"name": "s", "provider": "shuihua"}))
        .await
        .expect(422);
    assert!(
        r.text().contains("default_container_registry is required"),
        "{}",
        r.text()
    );
    for hub in [
        "docker.io",
        "index.docker.io",
        "registry-1.docker.io",
        "myorg/images",
        "library",
    ] {
        let r =
            post(json!({"name": "s", "provider": "SHUIHUA", "default_container_registry": hub}))
                .await
                .expect(422);
        assert!(r.text().contains("Docker Hub"), "{hub}: {}", r.text());
    }
    let ok = post(json!({"name": "s", "provider": "shuihua", "default_container_registry": "cr.example.cn/ns"}))
        .await
        .expect(200)
        .json();
    assert_eq!(ok["provider"], "shuihua");
    // Other providers may use Docker Hub.
    post(json!({"name": "d", "provider": "docker", "default_container_registry": "docker.io"}))
        .await
        .expect(200);
    post(json!({"name": "bad", "provider": "aws"}))
        .await
        .expect(422);
    t.stop().await;
}

#[tokio::test]
async fn worker_config_errors_name_the_key_and_position() {
    let t = start().await;
    let r = t
        .admin
        .post(
            "/v2/clusters",
            &json!({"name": "w", "worker_config": "worker_port: 70000\nservice_port_range: \"40000-x\"\nbogus_key: 1\n"}),
        )
        .await
        .expect(422)
        .json();
    let issues = r["worker_config_errors"].as_array().unwrap();
    let keys: Vec<&str> = issues.iter().map(|i| i["key"].as_str().unwrap()).collect();
    assert!(keys.contains(&"worker_port"), "{r}");
    assert!(keys.contains(&"service_port_range"), "{r}");
    assert!(keys.contains(&"bogus_key"), "{r}");
    let syntax = t
        .admin
        .post(
            "/v2/clusters",
            &json!({"name": "w", "worker_config": "debug: true\n  bad: [\n"}),
        )
        .await
        .expect(422)
        .json();
    let issue = &syntax["worker_config_errors"][0];
    assert!(
        issue["line"].as_u64().is_some() && issue["column"].as_u64().is_some(),
        "{syntax}"
    );
    // An object is validated the same way.
    t.admin
        .post(
            "/v2/clusters",
            &json!({"name": "w", "worker_config": {"proxy_mode": "carrier-pigeon"}}),
        )
        .await
        .expect(422);
    let ok = t
        .admin
        .post(
            "/v2/clusters",
            &json!({"name": "w", "worker_config": {"proxy_mode": "tunnel", "worker_port": 10150}}),
        )
        .await
        .expect(200)
        .json();
    assert_eq!(ok["worker_config"]["proxy_mode"], "tunnel");
    t.stop().await;
}

#[tokio::test]
async fn helm_values_merge_per_key_replace_lists_and_reject_derived_paths() {
    let t = start().await;
    let body = json!({
        "name": "k",
        "provider": "kubernetes",
        "default_container_registry": "reg.example.com",
        "k8sOptions": {"helmValues": {
            "image": {"pullPolicy": "Always"},
            "tolerations": [{"key": "gpu"}],
            "resources": {"limits": {"cpu": "2"}}
        }}
    });
    let c = t.admin.post("/v2/clusters", &body).await.expect(200).json();
    let id = c["id"].as_i64().unwrap();
    let values = t
        .admin
        .get(&format!("/v2/clusters/{id}/helm-values"))
        .await
        .expect(200)
        .json();
    // Map merge: the override sits beside the derived keys of the same map.
    assert_eq!(values["image"]["pullPolicy"], "Always");
    assert_eq!(values["image"]["registry"], "reg.example.com");
    assert!(values["image"]["repository"].is_string());
    // Lists replace.
    assert_eq!(values["tolerations"], json!([{"key": "gpu"}]));
    assert_eq!(values["resources"]["limits"]["cpu"], "2");
    assert_eq!(values["server"]["url"].as_str().unwrap(), t.admin.base());

    // A PUT touching derived paths is rejected with every path named, and nothing changes.
    let bad = json!({"name": "k", "provider": "kubernetes", "k8sOptions": {"helmValues": {
        "image": {"repository": "evil/image", "tag": "x"},
        "server": {"url": "http://elsewhere"},
        "token": {"secretName": "other"}
    }}});
    let r = t
        .admin
        .put(&format!("/v2/clusters/{id}"), &bad)
        .await
        .expect(422)
        .json();
    assert_eq!(
        r["rejected_paths"],
        json!([
            "image.repository",
            "image.tag",
            "server.url",
            "token.secretName"
        ])
    );
    let still = t
        .admin
        .get(&format!("/v2/clusters/{id}/helm-values"))
        .await
        .expect(200)
        .json();
    assert_eq!(still["image"]["pullPolicy"], "Always");
    // Replacing a protected subtree with a scalar is a rejection of that subtree.
    let r = t
        .admin
        .put(
            &format!("/v2/clusters/{id}"),
            &json!({"name": "k", "k8sOptions": {"helmValues": {"image": "x"}}}),
        )
        .await
        .expect(422)
        .json();
    assert_eq!(r["rejected_paths"], json!(["image"]));
    t.admin
        .put(
            &format!("/v2/clusters/{id}"),
            &json!({"name": "k", "k8sOptions": {"helmValues": [1]}}),
        )
        .await
        .expect(422);
    t.admin
        .get("/v2/clusters/999/helm-values")
        .await
        .expect(404);
    t.stop().await;
}
