//! Command-line parsing: good flags build the right run, bad ones give clear errors.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use clap::Parser as _;
use faden_loadtest::cli::{Cli, Plan};
use faden_loadtest::{Arrivals, ClientRoute, LoadModel, Scenario, WorkloadKind};

const BASE: [&str; 5] = [
    "faden-loadtest",
    "--url",
    "http://127.0.0.1:1/v1",
    "--model",
    "m",
];

fn parse(extra: &[&str]) -> Result<Cli, clap::Error> {
    Cli::try_parse_from(BASE.iter().chain(extra))
}

fn err(extra: &[&str]) -> String {
    match parse(extra) {
        Ok(cli) => format!("{:#}", cli.plan(false).expect_err("should fail")),
        Err(e) => e.to_string(),
    }
}

#[test]
fn closed_and_open_loops() {
    let Plan::Run(c) = parse(&["-c", "64", "-d", "10s", "--stream"])
        .unwrap()
        .plan(false)
        .unwrap()
    else {
        panic!()
    };
    assert_eq!(c.load, LoadModel::Closed { concurrency: 64 });
    assert_eq!(c.duration, Some(Duration::from_secs(10)));
    assert!(c.workloads[0].stream);
    assert!(!c.progress);

    let Plan::Run(c) = parse(&[
        "--rate",
        "5000",
        "--max-outstanding",
        "10",
        "--requests",
        "100",
    ])
    .unwrap()
    .plan(true)
    .unwrap() else {
        panic!()
    };
    assert_eq!(
        c.load,
        LoadModel::Open {
            rate: 5000.0,
            max_outstanding: 10
        }
    );
    assert_eq!(
        c.limits(),
        (faden_loadtest::config::MAX_DURATION, Some(100))
    );
    assert!(
        c.progress,
        "a run bounded by requests on a terminal shows progress"
    );

    let Plan::Run(c) = parse(&["-c", "1", "-d", "2s"]).unwrap().plan(true).unwrap() else {
        panic!()
    };
    assert!(!c.progress, "short runs show no progress line");
}

#[test]
fn connect_proxy_flags() {
    let Plan::Run(c) = parse(&[
        "-c",
        "2",
        "--connect-proxy",
        "127.0.0.1:30079",
        "--connect-target",
        "model-1-7.static:0",
        "--proxy-auth",
        "k",
    ])
    .unwrap()
    .plan(false)
    .unwrap() else {
        panic!()
    };
    let p = c.connect_proxy.unwrap();
    assert_eq!(p.addr, "127.0.0.1:30079");
    assert_eq!(p.target.as_deref(), Some("model-1-7.static:0"));
    assert_eq!(p.auth.as_deref(), Some("k"));
    let Plan::Run(c) = parse(&["-c", "2", "--connect-proxy", "127.0.0.1:30079"])
        .unwrap()
        .plan(false)
        .unwrap()
    else {
        panic!()
    };
    let p = c.connect_proxy.unwrap();
    assert_eq!((p.target, p.auth), (None, None));

    let e = err(&["-c", "1", "--connect-target", "model-1-7.static:0"]);
    assert!(e.contains("--connect-proxy"), "{e}");
    let e = err(&["-c", "1", "--proxy-auth", "k"]);
    assert!(e.contains("--connect-proxy"), "{e}");
    let e = err(&[
        "-c",
        "1",
        "--connect-proxy",
        "127.0.0.1:30079",
        "--connect-target",
        "a b",
    ]);
    assert!(e.contains("--connect-target"), "{e}");
    let e = err(&[
        "-c",
        "1",
        "--connect-proxy",
        "127.0.0.1:30079",
        "--compare",
        "http://127.0.0.1:2/v1",
    ]);
    assert!(e.contains("cannot be used with"), "{e}");
}

#[test]
fn bad_flags_are_explained() {
    let e = err(&["-c", "4", "--rate", "10"]);
    assert!(e.contains("cannot be used with"), "{e}");
    let e = err(&[]);
    assert!(e.contains("--concurrency") && e.contains("--rate"), "{e}");
    let e = err(&["-c", "4", "--duration", "0s"]);
    assert!(e.contains("greater than zero"), "{e}");
    let e = err(&["-c", "4", "--duration", "ten"]);
    assert!(e.contains("--duration"), "{e}");
    let e = err(&["-c", "0"]);
    assert!(e.contains("--concurrency"), "{e}");
    let e = err(&["--rate", "0"]);
    assert!(e.contains("greater than zero"), "{e}");
    let e = err(&["-c", "1", "--requests", "0"]);
    assert!(e.contains("--requests"), "{e}");
    let e = err(&["-c", "1", "--max-outstanding", "5"]);
    assert!(e.contains("cannot be used with"), "{e}");
    let e = err(&["-c", "1", "-d", "2h"]);
    assert!(e.contains("safety cap"), "{e}");
    let e = err(&["-c", "1", "--workload", "embeddings", "--stream"]);
    assert!(e.contains("embeddings cannot be streamed"), "{e}");
    let e = err(&["-c", "1", "--mix", "m.yaml", "--stream"]);
    assert!(e.contains("cannot be used with"), "{e}");
    let e = err(&["-c", "1", "--mix", "/nonexistent/mix.yaml"]);
    assert!(e.contains("cannot read --mix"), "{e}");
    let e = err(&[
        "-c",
        "1",
        "--compare",
        "http://127.0.0.1:2/v1",
        "--requests",
        "5",
    ]);
    assert!(e.contains("--compare"), "{e}");
    let e = Cli::try_parse_from(["x", "--url", "https://a/v1", "--model", "m", "-c", "1"])
        .unwrap()
        .plan(false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("https is not supported"), "{e}");
}

#[test]
fn mix_files_in_yaml_and_json() {
    let dir = std::env::temp_dir().join(format!("faden-loadtest-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let yaml = dir.join("mix.yaml");
    std::fs::write(
        &yaml,
        "- workload: chat\n  stream: true\n  weight: 3\n- workload: embeddings\n  prompt_bytes: 100\n",
    )
    .unwrap();
    let json = dir.join("mix.json");
    std::fs::write(&json, r#"[{"workload": "completions", "max_tokens": 7}]"#).unwrap();
    let bad = dir.join("bad.yaml");
    std::fs::write(&bad, "- workload: chat\n  strem: true\n").unwrap();

    let Plan::Run(c) = parse(&["-c", "1", "--mix", yaml.to_str().unwrap()])
        .unwrap()
        .plan(false)
        .unwrap()
    else {
        panic!()
    };
    assert_eq!(c.workloads.len(), 2);
    assert_eq!(c.workloads[0].weight, 3);
    assert_eq!(c.workloads[1].kind, WorkloadKind::Embeddings);
    let Plan::Run(c) = parse(&["-c", "1", "--mix", json.to_str().unwrap()])
        .unwrap()
        .plan(false)
        .unwrap()
    else {
        panic!()
    };
    assert_eq!(c.workloads[0].max_tokens, 7);
    let e = err(&["-c", "1", "--mix", bad.to_str().unwrap()]);
    assert!(e.contains("strem"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn scenarios_several_urls_and_arrivals() {
    let dir = std::env::temp_dir().join(format!("faden-loadtest-scn-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("prefix.yaml");
    std::fs::write(
        &good,
        "prefix:\n  tenants: 8\n  zipf_s: 0.8\n  stream: false\n",
    )
    .unwrap();
    let bad = dir.join("bad.yaml");
    std::fs::write(&bad, "prefix:\n  tenant: 8\n").unwrap();
    let good = good.to_str().unwrap();

    let Plan::Run(c) = parse(&[
        "--url",
        "http://127.0.0.1:2/v1,http://127.0.0.1:3/v1",
        "--route",
        "affinity",
        "--rate",
        "10",
        "--arrivals",
        "poisson",
        "--scenario",
        good,
    ])
    .unwrap()
    .plan(false)
    .unwrap() else {
        panic!()
    };
    assert_eq!(c.url, "http://127.0.0.1:1/v1");
    assert_eq!(
        c.more_urls,
        ["http://127.0.0.1:2/v1", "http://127.0.0.1:3/v1"]
    );
    assert_eq!(c.route, ClientRoute::Affinity);
    assert_eq!(c.arrivals, Arrivals::Poisson);
    let Some(Scenario::Prefix(p)) = &c.scenario else {
        panic!()
    };
    assert_eq!((p.tenants, p.zipf_s, p.stream), (8, 0.8, false));

    let e = err(&["-c", "1", "--scenario", bad.to_str().unwrap()]);
    assert!(e.contains("tenant"), "{e}");
    let e = err(&["-c", "1", "--scenario", good, "--stream"]);
    assert!(e.contains("cannot be used with"), "{e}");
    let e = err(&["-c", "1", "--route", "affinity"]);
    assert!(e.contains("--scenario"), "{e}");
    let e = err(&["-c", "1", "--arrivals", "poisson"]);
    assert!(e.contains("cannot be used with"), "{e}");
    let e = err(&[
        "-c",
        "1",
        "--url",
        "http://127.0.0.1:2/v1",
        "--compare",
        "http://127.0.0.1:3/v1",
    ]);
    assert!(e.contains("--compare takes one --url"), "{e}");
    let e = err(&[
        "-c",
        "1",
        "--url",
        "http://127.0.0.1:2/v1",
        "--connect-proxy",
        "127.0.0.1:4",
    ]);
    assert!(e.contains("--connect-proxy takes one --url"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn compare_plan() {
    let Plan::Compare { a, b, slice } = parse(&[
        "-c",
        "2",
        "--api-key",
        "k1",
        "--compare",
        "http://127.0.0.1:2/v1",
        "--slice",
        "500ms",
    ])
    .unwrap()
    .plan(false)
    .unwrap() else {
        panic!()
    };
    assert_eq!(b.url, "http://127.0.0.1:2/v1");
    assert_eq!(b.api_key.as_deref(), Some("k1"));
    assert_eq!(a.url, "http://127.0.0.1:1/v1");
    assert_eq!(slice, Duration::from_millis(500));
}

#[test]
fn help_explains_every_flag() {
    let help = Cli::try_parse_from(["faden-loadtest", "--help"])
        .unwrap_err()
        .to_string();
    for flag in [
        "--url",
        "--api-key",
        "--model",
        "--concurrency",
        "--rate",
        "--max-outstanding",
        "--duration",
        "--requests",
        "--warmup",
        "--timeout",
        "--workload",
        "--stream",
        "--prompt-bytes",
        "--max-tokens",
        "--mix",
        "--json",
        "--progress",
        "--compare",
        "--slice",
        "--connect-proxy",
        "--connect-target",
        "--proxy-auth",
        "--scenario",
        "--route",
        "--arrivals",
    ] {
        assert!(help.contains(flag), "{flag} missing from --help");
    }
}
