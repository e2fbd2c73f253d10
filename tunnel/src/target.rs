//! The names that pick a model instance: GPUStack's `X-GPUStack-Model-Instance` value and the
//! `CONNECT` target of an instance relay (worker proxy, tunnel stream, proxy port).

/// Reads the instance id of an `X-GPUStack-Model-Instance` value, by GPUStack's rule
/// `^model-\d+-(\d+)(?:-[^.]+)?\..+`.
pub fn parse_instance_id(value: &str) -> Option<i64> {
    parse_instance_name(value).map(|(_, id)| id)
}

/// Reads `(model id, instance id)` of an `X-GPUStack-Model-Instance` value
/// ([`parse_instance_id`]'s rule).
pub fn parse_instance_name(value: &str) -> Option<(i64, i64)> {
    let rest = value.strip_prefix("model-")?;
    let model_digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    if model_digits == 0 {
        return None;
    }
    let (model, rest) = rest.split_at(model_digits);
    let rest = rest.strip_prefix('-')?;
    let id_digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    if id_digits == 0 {
        return None;
    }
    let (id, rest) = rest.split_at(id_digits);
    let rest = match rest.strip_prefix('-') {
        // `-[^.]+` then `.`
        Some(suffix) => {
            let n = suffix.bytes().take_while(|b| *b != b'.').count();
            if n == 0 {
                return None;
            }
            &suffix[n..]
        }
        None => rest,
    };
    let tail = rest.strip_prefix('.')?;
    if tail.is_empty() {
        return None;
    }
    Some((model.parse().ok()?, id.parse().ok()?))
}

/// The `CONNECT` target naming a local instance: `model-<model id>-<instance id>.static:0`, the
/// name `X-GPUStack-Model-Instance` carries plus the port 0 (the worker, not the caller, knows the
/// instance's port).
pub fn relay_target(model_id: i64, instance_id: i64) -> String {
    format!("model-{model_id}-{instance_id}.static:0")
}

/// The instance id of a `CONNECT` target in [`relay_target`] form: a host that
/// [`parse_instance_id`] accepts, made only of lowercase letters, digits, `-` and `.`, and the
/// port exactly `0`. Anything else (addresses, other ports, userinfo, percent-encoding) is
/// `None`.
pub fn parse_relay_target(authority: &str) -> Option<i64> {
    let host = authority.strip_suffix(":0")?;
    let plain = host
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
    if !plain {
        return None;
    }
    parse_instance_id(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_instance_ids_like_gpustack() {
        assert_eq!(parse_instance_id("model-1-23.static"), Some(23));
        assert_eq!(parse_instance_id("model-10-7-abc.svc.cluster"), Some(7));
        assert_eq!(parse_instance_id("model-1-23-x.y"), Some(23));
        assert_eq!(parse_instance_name("model-10-7-abc.svc"), Some((10, 7)));
        for bad in [
            "",
            "model-1-.static",
            "model--2.static",
            "model-1-2",
            "model-1-2.",
            "model-1-2-.static",
            "model-1-2x.static",
            "Model-1-2.static",
            "xmodel-1-2.static",
        ] {
            assert_eq!(parse_instance_id(bad), None, "{bad}");
        }
    }

    #[test]
    fn parses_relay_targets_strictly() {
        assert_eq!(parse_relay_target(&relay_target(1, 23)), Some(23));
        assert_eq!(parse_relay_target("model-10-7-abc.svc.cluster:0"), Some(7));
        for bad in [
            "model-1-23.static",
            "model-1-23.static:",
            "model-1-23.static:80",
            "model-1-23.static:00",
            "model-1-23.static:0:0",
            "Model-1-23.static:0",
            "model-1-23.STATIC:0",
            "a@model-1-23.static:0",
            "model-1-23.static@x:0",
            "model-1-23.static%2f:0",
            "model-1-23.static/x:0",
            "127.0.0.1:0",
            "127.0.0.1:8000",
            "[::1]:0",
            ":0",
            "",
        ] {
            assert_eq!(parse_relay_target(bad), None, "{bad}");
        }
    }
}
