use serde_json::json;

use crate::common::start;

#[tokio::test]
async fn client_mistakes_are_4xx_in_the_error_shape() {
    let t = start().await;
    let send = |method: &str, path: &str, body: &'static str| {
        let c = t.admin.clone();
        let (method, path) = (
            http::Method::from_bytes(method.as_bytes()).unwrap(),
            path.to_owned(),
        );
        async move { c.send(method, &path, body).await }
    };
    let cases: &[(&str, &str, &str, u16)] = &[
        ("POST", "/v2/clusters", "{", 400),
        ("POST", "/v2/clusters", "", 400),
        ("POST", "/v2/clusters", "[1,2]", 422),
        ("POST", "/v2/clusters", "{\"name\": 7}", 422),
        (
            "POST",
            "/v2/clusters",
            "{\"name\": \"x\", \"extra\": 1}",
            422,
        ),
        (
            "POST",
            "/v2/clusters",
            "{\"name\": \"x\", \"provider\": 3}",
            422,
        ),
        (
            "POST",
            "/v2/models",
            "{\"name\": \"x\", \"replicas\": -1}",
            422,
        ),
        (
            "POST",
            "/v2/model-instances",
            "{\"model_id\": \"one\"}",
            422,
        ),
        (
            "POST",
            "/v2/api-keys",
            "{\"name\": \"x\", \"scope\": \"root\"}",
            422,
        ),
        (
            "POST",
            "/v2/api-keys",
            "{\"name\": \"x\", \"expires_at\": \"tomorrow\"}",
            422,
        ),
        ("GET", "/v2/clusters/abc", "", 400),
        ("GET", "/v2/clusters/-1", "", 400),
        ("GET", "/v2/clusters/99999999999999999999", "", 400),
        ("GET", "/v2/clusters?perPage=x", "", 400),
        ("GET", "/v2/clusters?watch=maybe", "", 400),
        ("GET", "/v2/clusters?unknown=1", "", 400),
        ("GET", "/v2/nothing", "", 404),
        ("PATCH", "/v2/clusters", "", 405),
        ("DELETE", "/v2/clusters", "", 405),
    ];
    for (method, path, body, status) in cases {
        let r = send(method, path, body).await;
        assert_eq!(
            r.status.as_u16(),
            *status,
            "{method} {path} {body}: {}",
            r.text()
        );
        let j = r.json();
        assert_eq!(j["code"], *status, "{j}");
        assert!(j["reason"].is_string() && j["message"].is_string(), "{j}");
    }
    // Over the body limit: 413, and the server carries on.
    let big = format!("{{\"name\": \"{}\"}}", "x".repeat(2 << 20));
    let r = t.admin.send(http::Method::POST, "/v2/clusters", big).await;
    assert_eq!(r.status, 413, "{}", r.text());
    assert_eq!(r.json()["reason"], "PayloadTooLarge");
    t.admin
        .post("/v2/clusters", &json!({"name": "still-fine"}))
        .await
        .expect(200);
    // Missing or wrong auth on every resource.
    for path in [
        "/v2/clusters",
        "/v2/workers",
        "/v2/models",
        "/v2/model-instances",
        "/v2/api-keys",
        "/v2/credentials",
    ] {
        t.admin.anonymous().get(path).await.expect(401);
        t.admin
            .with_token("fdn_0000000000000000_00000000000000000000000000000000")
            .get(path)
            .await
            .expect(401);
    }
    t.stop().await;
}
