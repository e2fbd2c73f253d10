use super::suggest::{closest_known, edit_distance};
use super::*;
use proptest::prelude::*;
use serde_json::json;

/// The example from the product documentation, verbatim.
const EXAMPLE: &str = r#"debug: false
tools_download_base_url: https://mirror.your_company.com
pipx_path: "/usr/local/bin/pipx"
cache_dir: "/var/lib/gpustack/cache"
log_dir: "/var/lib/gpustack/log"
bin_dir: "/var/lib/gpustack/bin"
image_name_override: "gpustack/gpustack:main"
image_repo: "gpustack/gpustack"
worker_ifname: en0
worker_port: 10150
worker_metrics_port: 10151
disable_worker_metrics: false
service_port_range: "40000-40063"
ray_port_range: "41000-41999"
proxy_mode: worker
system_reserved:
  ram: 0
  vram: 0
huggingface_token: xxxxxx
enable_hf_transfer: false
insecure_tls: false
"#;

fn errors(text: &str) -> ConfigErrors {
    match parse_yaml(text) {
        Ok(config) => panic!("expected errors for {text:?}, got {config:?}"),
        Err(e) => e,
    }
}

fn only_issue(text: &str) -> ConfigIssue {
    let mut e = errors(text);
    assert_eq!(e.issues.len(), 1, "{e:?}");
    e.issues.remove(0)
}

fn keys(e: &ConfigErrors) -> Vec<&str> {
    e.issues.iter().map(|i| i.key.as_str()).collect()
}

#[test]
fn documented_example_parses_every_option() {
    let config = parse_yaml(EXAMPLE).unwrap();
    let expected = WorkerConfig {
        debug: Some(false),
        tools_download_base_url: Some("https://mirror.your_company.com".into()),
        pipx_path: Some("/usr/local/bin/pipx".into()),
        cache_dir: Some("/var/lib/gpustack/cache".into()),
        log_dir: Some("/var/lib/gpustack/log".into()),
        bin_dir: Some("/var/lib/gpustack/bin".into()),
        image_name_override: Some("gpustack/gpustack:main".into()),
        image_repo: Some("gpustack/gpustack".into()),
        worker_ifname: Some("en0".into()),
        worker_port: Some(10150),
        worker_metrics_port: Some(10151),
        disable_worker_metrics: Some(false),
        service_port_range: Some(PortRange {
            start: 40000,
            end: 40063,
        }),
        ray_port_range: Some(PortRange {
            start: 41000,
            end: 41999,
        }),
        proxy_mode: Some(ProxyMode::Worker),
        system_reserved: Some(SystemReserved {
            ram: Some(0.0),
            vram: Some(0.0),
        }),
        huggingface_token: Some("xxxxxx".into()),
        enable_hf_transfer: Some(false),
        insecure_tls: Some(false),
    };
    assert_eq!(config, expected);
    // Every documented key is known, and every known key is in the example.
    let documented: Vec<&str> = EXAMPLE
        .lines()
        .filter(|l| !l.starts_with(' '))
        .filter_map(|l| l.split(':').next())
        .collect();
    assert_eq!(documented, KNOWN_KEYS);
}

#[test]
fn empty_documents_are_the_default_config() {
    for text in [
        "",
        "  \n",
        "# nothing here\n",
        "null",
        "~",
        "{}",
        "---\n",
        "---\n{}\n",
    ] {
        assert_eq!(
            parse_yaml(text).unwrap(),
            WorkerConfig::default(),
            "{text:?}"
        );
    }
}

#[test]
fn null_values_mean_unset() {
    let config = parse_yaml("cache_dir:\nworker_port: null\nsystem_reserved: ~\n").unwrap();
    assert_eq!(config, WorkerConfig::default());
}

#[test]
fn syntax_error_reports_line_and_column() {
    let issue = only_issue("debug: false\nworker_port: [1, 2\nproxy_mode: worker\n");
    assert_eq!(issue.key, "");
    assert!(issue.message.starts_with("invalid YAML"), "{issue:?}");
    assert!(issue.line.is_some() && issue.column.is_some(), "{issue:?}");
    assert!(!issue.message.contains('\n'));

    let issue = only_issue("debug: false\n  bad: indent\n");
    assert_eq!(issue.line, Some(2), "{issue:?}");

    // End of input is reported inside the text, at the end of the last line.
    let issue = only_issue("debug: true\nworker_port");
    assert_eq!((issue.line, issue.column), (Some(2), Some(12)), "{issue:?}");
}

#[test]
fn duplicate_keys_are_rejected() {
    let issue = only_issue("debug: true\ndebug: false\n");
    assert!(issue.message.contains("duplicate"), "{issue:?}");
}

#[test]
fn three_distinct_problems_give_three_issues() {
    let e = errors("worker_port: 0\nproxy_mode: sideways\nwokrer_ifname: en0\ndebug: true\n");
    assert_eq!(keys(&e), ["worker_port", "proxy_mode", "wokrer_ifname"]);
    let lines: Vec<_> = e.issues.iter().map(|i| i.line).collect();
    assert_eq!(lines, [Some(1), Some(2), Some(3)]);
    assert!(e.issues[2].message.contains("\"worker_ifname\""), "{e:?}");
}

#[test]
fn top_level_must_be_a_mapping() {
    for text in ["- debug\n- true\n", "42", "\"debug\"", "!tag {}"] {
        let issue = only_issue(text);
        assert_eq!(issue.key, "", "{text:?}");
        assert!(issue.message.contains("must be a mapping"), "{issue:?}");
    }
}

#[test]
fn ports_must_be_integers_in_range() {
    for ok in [1, 10150, 65535] {
        let config = parse_yaml(&format!("worker_port: {ok}")).unwrap();
        assert_eq!(config.worker_port, Some(ok));
    }
    for bad in [
        "0",
        "65536",
        "-1",
        "1.5",
        "\"10150\"",
        "[1]",
        "{a: 1}",
        "true",
    ] {
        let issue = only_issue(&format!("worker_metrics_port: {bad}"));
        assert_eq!(issue.key, "worker_metrics_port", "{bad}");
        assert!(issue.message.contains("port"), "{issue:?}");
    }
}

#[test]
fn port_ranges_parse_and_validate() {
    let ok = [
        ("40000-40063", (40000, 40063)),
        (" 1 - 2 ", (1, 2)),
        ("5-5", (5, 5)),
        ("1-65535", (1, 65535)),
    ];
    for (text, (start, end)) in ok {
        assert_eq!(
            text.parse::<PortRange>(),
            Ok(PortRange { start, end }),
            "{text}"
        );
    }
    let bad = [
        "2-1",
        "0-10",
        "1-70000",
        "99999999999-1",
        "abc",
        "1-",
        "-5",
        "+1-2",
        "1-2-3",
        "1 2",
        "",
    ];
    for text in bad {
        assert!(text.parse::<PortRange>().is_err(), "{text:?}");
        let issue = only_issue(&format!("ray_port_range: {text:?}"));
        assert_eq!(issue.key, "ray_port_range");
    }
    let issue = only_issue("service_port_range: 40000");
    assert!(issue.message.contains("\"40000-40063\""), "{issue:?}");
    assert_eq!(
        PortRange::new(3, 2),
        Err("start 3 is greater than end 2".into())
    );
    let range = PortRange::new(10, 12).unwrap();
    assert_eq!(
        (range.len(), range.contains(11), range.contains(13)),
        (3, true, false)
    );
}

#[test]
fn proxy_mode_is_case_insensitive_and_checked() {
    assert_eq!(
        parse_yaml("proxy_mode: Tunnel").unwrap().proxy_mode,
        Some(ProxyMode::Tunnel)
    );
    let issue = only_issue("proxy_mode: sideways");
    assert!(
        issue.message.contains("direct, worker, tunnel"),
        "{issue:?}"
    );
    assert_eq!(only_issue("proxy_mode: 3").key, "proxy_mode");
}

#[test]
fn system_reserved_checks_each_entry() {
    let config = parse_yaml("system_reserved:\n  ram: 2\n  vram: 1.5\n").unwrap();
    let expected = SystemReserved {
        ram: Some(2.0),
        vram: Some(1.5),
    };
    assert_eq!(config.system_reserved, Some(expected));
    let partial = parse_yaml("system_reserved: {vram: 4}").unwrap();
    assert_eq!(partial.system_reserved.unwrap().ram, None);

    let e = errors("system_reserved:\n  ram: -1\n  vram: .nan\n  gpu: 1\n");
    assert_eq!(
        keys(&e),
        [
            "system_reserved.ram",
            "system_reserved.vram",
            "system_reserved.gpu"
        ]
    );
    assert!(e.issues[0].message.contains("negative"), "{e:?}");
    assert!(e.issues[2].message.contains("unknown"), "{e:?}");

    assert_eq!(only_issue("system_reserved: 5").key, "system_reserved");
    assert_eq!(
        only_issue("system_reserved: {ram: 2Gi}").key,
        "system_reserved.ram"
    );
    let zero = parse_yaml("system_reserved: {ram: -0.0}").unwrap();
    assert!(
        zero.system_reserved
            .unwrap()
            .ram
            .unwrap()
            .is_sign_positive()
    );
}

#[test]
fn tools_url_needs_http_scheme_and_host() {
    for ok in [
        "https://mirror.example.com",
        "http://10.0.0.1:8080/tools",
        "HTTPS://X",
    ] {
        let config = parse_yaml(&format!("tools_download_base_url: {ok}")).unwrap();
        assert_eq!(config.tools_download_base_url.as_deref(), Some(ok));
    }
    for bad in [
        "ftp://mirror",
        "mirror.example.com",
        "https://",
        "\"https://a b\"",
        "1",
    ] {
        let issue = only_issue(&format!("tools_download_base_url: {bad}"));
        assert_eq!(issue.key, "tools_download_base_url", "{bad}");
    }
}

#[test]
fn wrong_types_say_what_was_found() {
    let issue = only_issue("debug: yes");
    assert_eq!(issue.message, "expected true or false, got string \"yes\"");
    let issue = only_issue("huggingface_token: 12345");
    assert!(issue.message.contains("quote it"), "{issue:?}");
    let issue = only_issue("cache_dir: !custom /tmp");
    assert!(issue.message.contains("!custom"), "{issue:?}");
}

#[test]
fn unknown_keys_suggest_the_closest_option() {
    let issue = only_issue("worker-port: 10150");
    assert_eq!(issue.key, "worker-port");
    assert_eq!(
        issue.message,
        "unknown option; did you mean \"worker_port\"?"
    );
    let issue = only_issue("Debug: true");
    assert!(issue.message.contains("\"debug\""), "{issue:?}");
    let issue = only_issue("completely_unrelated: 1");
    assert!(issue.message.contains("known options: debug,"), "{issue:?}");
    let issue = only_issue("system_reserved: {rma: 1}");
    assert!(issue.message.contains("\"ram\""), "{issue:?}");
    let issue = only_issue("1: x");
    assert_eq!(issue.key, "1");
}

#[test]
fn positions_point_at_values_and_nested_keys() {
    let issue = only_issue("debug: false\nworker_port:   0   # comment\n");
    assert_eq!((issue.line, issue.column), (Some(2), Some(16)));

    let e = errors("# header\n\nsystem_reserved:\n  ram: -1\n  # note\n  gpu: 1\n");
    let positions: Vec<_> = e.issues.iter().map(|i| (i.line, i.column)).collect();
    assert_eq!(positions, [(Some(4), Some(8)), (Some(6), Some(3))]);

    // Flow style: the nearest enclosing key.
    let issue = only_issue("debug: true\nsystem_reserved: {ram: -1}\n");
    assert_eq!((issue.line, issue.column), (Some(2), Some(1)));

    // Quoted keys and a value on the next line (position of the key).
    let issue = only_issue("\"worker_port\": 0\n");
    assert_eq!((issue.line, issue.column), (Some(1), Some(16)));
    let issue = only_issue("'debug':\n  - 1\n");
    assert_eq!((issue.line, issue.column), (Some(1), Some(1)));

    // A whole document indented: still found.
    let issue = only_issue("  debug: true\n  bogus: 1\n");
    assert_eq!((issue.line, issue.column), (Some(2), Some(3)));

    // Block scalar contents that look like keys are not mistaken for them.
    let text = "huggingface_token: |\n  bogus: 1\nbogus: 2\n";
    let issue = only_issue(text);
    assert_eq!(issue.line, Some(3));
}

#[test]
fn merge_keys_are_applied() {
    let config = parse_yaml("<<: {debug: true, worker_port: 1}\nworker_port: 2\n").unwrap();
    assert_eq!((config.debug, config.worker_port), (Some(true), Some(2)));
    assert_eq!(only_issue("<<: 5").key, "");
}

#[test]
fn json_objects_follow_the_same_rules() {
    let e = from_json(&json!({
        "worker_port": 0,
        "proxy_mode": "x",
        "bogus": 1,
        "system_reserved": {"ram": -2}
    }))
    .unwrap_err();
    let mut found = keys(&e);
    found.sort_unstable();
    assert_eq!(
        found,
        ["bogus", "proxy_mode", "system_reserved.ram", "worker_port"]
    );
    assert!(
        e.issues
            .iter()
            .all(|i| i.line.is_none() && i.column.is_none())
    );

    assert_eq!(from_json(&json!(null)).unwrap(), WorkerConfig::default());
    assert_eq!(from_json(&json!([1])).unwrap_err().issues[0].key, "");
    let yaml = parse_yaml(EXAMPLE).unwrap();
    assert_eq!(from_json(&yaml.to_json()).unwrap(), yaml);
    let ram = from_json(&json!({"system_reserved": {"ram": 1.25}})).unwrap();
    assert_eq!(ram.system_reserved.unwrap().ram, Some(1.25));
}

#[test]
fn api_values_may_be_yaml_text_or_an_object() {
    let from_text = from_api_value(&json!("worker_port: 1\n")).unwrap();
    let from_object = from_api_value(&json!({"worker_port": 1})).unwrap();
    assert_eq!(from_text, from_object);
    assert!(from_api_value(&json!("worker_port: 0")).is_err());
}

#[test]
fn display_is_one_line_naming_every_key() {
    let e = errors("worker_port: 0\nsystem_reserved: {ram: -1}\n\"a\\nb\": 1\n");
    let text = e.to_string();
    assert!(!text.contains('\n'), "{text}");
    for key in ["worker_port", "system_reserved.ram", "a\\nb"] {
        assert!(text.contains(key), "{key} missing from {text}");
    }
    assert!(errors("[").to_string().contains("(document)"));
}

#[test]
fn issues_serialize_without_unknown_positions() {
    let e = from_json(&json!({"bogus": true})).unwrap_err();
    let value = serde_json::to_value(&e).unwrap();
    assert_eq!(value["issues"][0]["key"], "bogus");
    assert!(value["issues"][0].get("line").is_none());
    let e = errors("bogus: true");
    let value = serde_json::to_value(&e).unwrap();
    assert_eq!(
        (
            value["issues"][0]["line"].clone(),
            value["issues"][0]["column"].clone()
        ),
        (json!(1), json!(1))
    );
}

#[test]
fn serialized_forms_match_what_operators_write() {
    let config = parse_yaml(EXAMPLE).unwrap();
    let value = config.to_json();
    assert_eq!(value["service_port_range"], "40000-40063");
    assert_eq!(value["system_reserved"], json!({"ram": 0, "vram": 0}));
    assert_eq!(value["proxy_mode"], "worker");
    let yaml = config.to_yaml();
    assert!(yaml.contains("service_port_range: 40000-40063\n"), "{yaml}");
    assert!(yaml.contains("  ram: 0\n"), "{yaml}");
    assert_eq!(parse_yaml(&yaml).unwrap(), config);
    assert_eq!(WorkerConfig::default().to_json(), json!({}));
    assert_eq!(
        parse_yaml(&WorkerConfig::default().to_yaml()).unwrap(),
        WorkerConfig::default()
    );
}

#[test]
fn deserialize_runs_validation() {
    let ok: WorkerConfig = serde_yaml_ng::from_str(EXAMPLE).unwrap();
    assert_eq!(ok, parse_yaml(EXAMPLE).unwrap());
    let err = serde_json::from_value::<WorkerConfig>(json!({"worker_port": 0})).unwrap_err();
    assert!(err.to_string().contains("worker_port"), "{err}");
    let range: PortRange = serde_json::from_value(json!("1-2")).unwrap();
    assert_eq!(range, PortRange { start: 1, end: 2 });
}

#[test]
fn overlay_prefers_the_higher_layer() {
    let cluster =
        parse_yaml("worker_port: 1\ndebug: true\nsystem_reserved: {ram: 1, vram: 1}").unwrap();
    let local = parse_yaml("worker_port: 2\nsystem_reserved: {ram: 4}").unwrap();
    let flags = WorkerConfig {
        proxy_mode: Some(ProxyMode::Tunnel),
        ..WorkerConfig::default()
    };
    let effective = WorkerConfig::builtin_defaults()
        .overlay(&cluster)
        .overlay(&local)
        .overlay(&flags);
    assert_eq!(effective.worker_port, Some(2));
    assert_eq!(effective.debug, Some(true));
    assert_eq!(effective.proxy_mode, Some(ProxyMode::Tunnel));
    assert_eq!(
        effective.worker_metrics_port,
        Some(DEFAULT_WORKER_METRICS_PORT)
    );
    // Options replace whole: vram is not inherited from the cluster's mapping.
    assert_eq!(
        effective.system_reserved,
        Some(SystemReserved {
            ram: Some(4.0),
            vram: None
        })
    );
}

#[test]
fn builtin_defaults_are_a_valid_document() {
    let defaults = WorkerConfig::builtin_defaults();
    assert_eq!(parse_yaml(&defaults.to_yaml()).unwrap(), defaults);
}

#[test]
fn deep_values_are_reported_not_walked() {
    let mut deep = json!(1);
    for _ in 0..1000 {
        deep = json!({ "x": deep });
    }
    let e =
        from_json(&json!({"system_reserved": {"ram": deep.clone()}, "debug": deep})).unwrap_err();
    assert_eq!(keys(&e), ["debug", "system_reserved.ram"]);
    assert!(
        e.issues
            .iter()
            .all(|i| i.message.ends_with("got a mapping")),
        "{e:?}"
    );
}

#[test]
fn keys_starting_with_indicator_characters_are_located() {
    let issue = only_issue("debug: true\n-odd: 1\n");
    assert_eq!((issue.key.as_str(), issue.line), ("-odd", Some(2)));
}

#[test]
fn edit_distance_basics() {
    assert_eq!(edit_distance("", "abc"), 3);
    assert_eq!(edit_distance("kitten", "sitting"), 3);
    assert_eq!(edit_distance("ram", "ram"), 0);
    assert_eq!(closest_known("vrma", SYSTEM_RESERVED_KEYS), Some("vram"));
    assert_eq!(closest_known("xy", SYSTEM_RESERVED_KEYS), None);
}

// ------------------------------------------------------------------ property tests

fn arb_text() -> impl Strategy<Value = String> {
    let fragment = prop_oneof![
        prop::sample::select(KNOWN_KEYS).prop_map(str::to_owned),
        prop::sample::select(vec![
            ": ",
            ":",
            "\n",
            "\n  ",
            "- ",
            "{",
            "}",
            "[",
            "]",
            ",",
            "\"",
            "'",
            "#",
            "&a ",
            "*a",
            "!t ",
            "<<: ",
            "|\n",
            ">\n",
            "---\n",
            "~",
            "null",
            "0",
            "-1",
            "1.5",
            "40000-40063",
            "ram",
            "vram",
            "\t",
            "\\",
            "\u{feff}",
            "é",
        ])
        .prop_map(str::to_owned),
        "\\PC{0,6}",
    ];
    prop::collection::vec(fragment, 0..40).prop_map(|parts| parts.concat())
}

fn arb_scalar() -> impl Strategy<Value = serde_json::Value> {
    prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        (-70_000i64..70_000).prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        (-1e6f64..1e6).prop_map(serde_json::Value::from),
        prop::sample::select(vec![
            "40000-40063",
            "2-1",
            "worker",
            "TUNNEL",
            "https://m.example",
            "ftp://x",
            "",
        ])
        .prop_map(serde_json::Value::from),
        "\\PC{0,12}".prop_map(serde_json::Value::from),
    ]
}

fn arb_value() -> impl Strategy<Value = serde_json::Value> {
    prop_oneof![
        4 => arb_scalar(),
        1 => prop::collection::vec(arb_scalar(), 0..3).prop_map(serde_json::Value::from),
        1 => prop::collection::btree_map(arb_key(), arb_scalar(), 0..4)
            .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
    ]
}

fn arb_key() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(KNOWN_KEYS).prop_map(str::to_owned),
        prop::sample::select(SYSTEM_RESERVED_KEYS).prop_map(str::to_owned),
        "[a-z_]{1,16}",
        "[a-z_.-]{1,16}",
        // `<<` is YAML's merge key, resolved by the parser before validation.
        "\\PC{1,8}".prop_filter("the merge key is not an option", |k| k != "<<"),
    ]
}

fn arb_port_range() -> impl Strategy<Value = PortRange> {
    (1u16..=65535, 1u16..=65535).prop_map(|(a, b)| PortRange {
        start: a.min(b),
        end: a.max(b),
    })
}

fn arb_gib() -> impl Strategy<Value = f64> {
    prop_oneof![(0u32..4096).prop_map(f64::from), 0.0f64..1e9]
}

fn arb_config() -> impl Strategy<Value = WorkerConfig> {
    let text = || proptest::option::of(".{0,30}");
    let port = || proptest::option::of(1u16..=65535);
    let flag = || proptest::option::of(any::<bool>());
    let url = proptest::option::of("https?://[a-z0-9.:/_-]{1,20}");
    let reserved = proptest::option::of(
        (
            proptest::option::of(arb_gib()),
            proptest::option::of(arb_gib()),
        )
            .prop_map(|(ram, vram)| SystemReserved { ram, vram }),
    );
    let mode = proptest::option::of(prop::sample::select(ProxyMode::ALL));
    (
        (flag(), url, text(), text(), text(), text(), text()),
        (text(), text(), port(), port(), flag()),
        (
            proptest::option::of(arb_port_range()),
            proptest::option::of(arb_port_range()),
        ),
        (mode, reserved, text(), flag(), flag()),
    )
        .prop_map(|(a, b, c, d)| WorkerConfig {
            debug: a.0,
            tools_download_base_url: a.1,
            pipx_path: a.2,
            cache_dir: a.3,
            log_dir: a.4,
            bin_dir: a.5,
            image_name_override: a.6,
            image_repo: b.0,
            worker_ifname: b.1,
            worker_port: b.2,
            worker_metrics_port: b.3,
            disable_worker_metrics: b.4,
            service_port_range: c.0,
            ray_port_range: c.1,
            proxy_mode: d.0,
            system_reserved: d.1,
            huggingface_token: d.2,
            enable_hf_transfer: d.3,
            insecure_tls: d.4,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn arbitrary_text_never_panics(text in arb_text()) {
        match parse_yaml(&text) {
            Ok(config) => prop_assert_eq!(parse_yaml(&config.to_yaml()).ok(), Some(config)),
            Err(e) => {
                prop_assert!(!e.issues.is_empty());
                let line_count = text.split('\n').count();
                for issue in &e.issues {
                    prop_assert!(issue.line.is_none_or(|l| (1..=line_count).contains(&l)));
                    prop_assert!(issue.column.is_none_or(|c| c >= 1));
                }
                prop_assert!(!e.to_string().contains('\n'));
            }
        }
    }

    #[test]
    fn arbitrary_unicode_never_panics(text in any::<String>()) {
        let _ = parse_yaml(&text);
        let _ = from_api_value(&serde_json::Value::String(text));
    }

    #[test]
    fn every_unknown_key_is_named(
        entries in prop::collection::btree_map(arb_key(), arb_value(), 0..12)
    ) {
        let object = serde_json::Value::Object(entries.clone().into_iter().collect());
        let text = serde_yaml_ng::to_string(&object).unwrap();
        let unknown: Vec<&String> =
            entries.keys().filter(|k| !KNOWN_KEYS.contains(&k.as_str())).collect();
        for result in [parse_yaml(&text), from_json(&object)] {
            match result {
                Ok(_) => prop_assert!(unknown.is_empty(), "accepted {:?}", unknown),
                Err(e) => {
                    for key in &unknown {
                        let issue = e.issues.iter().find(|i| &&i.key == key);
                        prop_assert!(issue.is_some(), "{:?} not reported in {:?}", key, e);
                    }
                }
            }
        }
        // Plain keys written by the serializer are located on their own line.
        if let Err(e) = parse_yaml(&text) {
            let lines: Vec<&str> = text.lines().collect();
            for issue in e.issues.iter().filter(|i| unknown.contains(&&i.key)) {
                if issue.key.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
                    let line = issue.line.unwrap_or(0);
                    prop_assert!(line >= 1, "{:?} in {}", issue, text);
                    prop_assert!(lines[line - 1].contains(&issue.key), "{:?} in {}", issue, text);
                }
            }
        }
    }

    #[test]
    fn valid_configs_round_trip(config in arb_config()) {
        let yaml = config.to_yaml();
        prop_assert_eq!(parse_yaml(&yaml), Ok(config.clone()), "yaml:\n{}", yaml);
        prop_assert_eq!(from_json(&config.to_json()), Ok(config.clone()));
        prop_assert_eq!(from_api_value(&serde_json::Value::String(yaml)), Ok(config));
    }

    #[test]
    fn overlay_is_per_option_precedence(lower in arb_config(), higher in arb_config()) {
        let merged = lower.overlay(&higher).to_json();
        let mut expected = lower.to_json();
        if let (Some(target), Some(source)) =
            (expected.as_object_mut(), higher.to_json().as_object())
        {
            for (key, value) in source {
                target.insert(key.clone(), value.clone());
            }
        }
        prop_assert_eq!(merged, expected);
        prop_assert_eq!(lower.overlay(&WorkerConfig::default()), lower.clone());
        prop_assert_eq!(WorkerConfig::default().overlay(&lower), lower);
    }
}
