//! Request classification: which API a path names, and which model a body asks for.

use std::borrow::Cow;

use http::Method;
use serde::Deserialize;
use serde::de::DeserializeSeed;

use crate::error::{ErrorKind, GatewayError};
use crate::prompt::{self, BlockHasher, PromptShape};

/// An OpenAI-compatible inference API the gateway forwards.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Api {
    ChatCompletions,
    Completions,
    Responses,
    Embeddings,
    Rerank,
    Score,
    AudioTranscriptions,
    AudioTranslations,
    AudioSpeech,
    ImagesGenerations,
    ImagesEdits,
    ImagesVariations,
    Moderations,
}

impl Api {
    /// Every API, in metrics order.
    pub const ALL: &'static [Api] = &[
        Api::ChatCompletions,
        Api::Completions,
        Api::Responses,
        Api::Embeddings,
        Api::Rerank,
        Api::Score,
        Api::AudioTranscriptions,
        Api::AudioTranslations,
        Api::AudioSpeech,
        Api::ImagesGenerations,
        Api::ImagesEdits,
        Api::ImagesVariations,
        Api::Moderations,
    ];

    /// The path after `/v1/`, as sent upstream (also the metrics label).
    pub fn suffix(self) -> &'static str {
        match self {
            Api::ChatCompletions => "chat/completions",
            Api::Completions => "completions",
            Api::Responses => "responses",
            Api::Embeddings => "embeddings",
            Api::Rerank => "rerank",
            Api::Score => "score",
            Api::AudioTranscriptions => "audio/transcriptions",
            Api::AudioTranslations => "audio/translations",
            Api::AudioSpeech => "audio/speech",
            Api::ImagesGenerations => "images/generations",
            Api::ImagesEdits => "images/edits",
            Api::ImagesVariations => "images/variations",
            Api::Moderations => "moderations",
        }
    }

    /// The canonical upstream path.
    pub fn upstream_path(self) -> &'static str {
        match self {
            Api::ChatCompletions => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
            Api::Responses => "/v1/responses",
            Api::Embeddings => "/v1/embeddings",
            Api::Rerank => "/v1/rerank",
            Api::Score => "/v1/score",
            Api::AudioTranscriptions => "/v1/audio/transcriptions",
            Api::AudioTranslations => "/v1/audio/translations",
            Api::AudioSpeech => "/v1/audio/speech",
            Api::ImagesGenerations => "/v1/images/generations",
            Api::ImagesEdits => "/v1/images/edits",
            Api::ImagesVariations => "/v1/images/variations",
            Api::Moderations => "/v1/moderations",
        }
    }

    /// [`Api::upstream_path`] as a parsed `PathAndQuery` (parsed once, cloned without a copy).
    pub fn upstream_path_and_query(self) -> http::uri::PathAndQuery {
        static PARSED: std::sync::LazyLock<Vec<http::uri::PathAndQuery>> =
            std::sync::LazyLock::new(|| {
                Api::ALL
                    .iter()
                    .map(|a| http::uri::PathAndQuery::from_static(a.upstream_path()))
                    .collect()
            });
        PARSED[self.index()].clone()
    }

    /// The API whose [`Api::upstream_path`] is exactly `path`.
    pub fn from_upstream_path(path: &[u8]) -> Option<Api> {
        Api::ALL
            .iter()
            .copied()
            .find(|a| a.upstream_path().as_bytes() == path)
    }

    /// Index into [`Api::ALL`].
    pub fn index(self) -> usize {
        // `ALL` lists the variants in declaration order (tested).
        self as usize
    }
}

/// What a request path names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    Inference(Api),
    Models,
    Healthz,
    Readyz,
    Metrics,
}

impl Target {
    /// The one method this target answers.
    pub fn method(self) -> Method {
        match self {
            Target::Inference(_) => Method::POST,
            _ => Method::GET,
        }
    }
}

/// Classifies a path. `/v1-openai/*` is an alias of `/v1/*`; matching ignores ASCII case and one
/// trailing slash, as GPUStack's gateway does.
pub fn classify(path: &str) -> Option<Target> {
    let path = path
        .strip_suffix('/')
        .filter(|p| !p.is_empty())
        .unwrap_or(path);
    let fixed = [
        ("/healthz", Target::Healthz),
        ("/readyz", Target::Readyz),
        // What vLLM, SGLang and TGI serve, and what tools probing an OpenAI-compatible server
        // (guidellm) call first: answered like `/readyz`.
        ("/health", Target::Readyz),
        ("/metrics", Target::Metrics),
    ];
    for (p, t) in fixed {
        if path.eq_ignore_ascii_case(p) {
            return Some(t);
        }
    }
    let rest = strip_prefix_ci(path, "/v1/").or_else(|| strip_prefix_ci(path, "/v1-openai/"))?;
    if rest.eq_ignore_ascii_case("models") {
        return Some(Target::Models);
    }
    Api::ALL
        .iter()
        .find(|api| rest.eq_ignore_ascii_case(api.suffix()))
        .map(|api| Target::Inference(*api))
}

fn strip_prefix_ci<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let head = s.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| &s[prefix.len()..])
}

/// What the gateway reads from a JSON request body, in one pass: the top-level `model`, and
/// whether the body asks for a stream without choosing its `stream_options` (where the gateway
/// may add `include_usage`). serde skips every other member without building it.
#[derive(Default)]
struct RequestProbe<'a> {
    /// The prompt's shape (`messages` or `prompt`), when asked for ([`ProbeSeed`]).
    prompt: Option<BlockHasher>,
    /// The OpenAI `user` member: a session hint.
    user: Option<BorrowedStr<'a>>,
    model: Option<BorrowedStr<'a>>,
    model_seen: bool,
    stream: Option<bool>,
    stream_seen: bool,
    stream_options_seen: bool,
    /// `stream` is not a boolean or null, or `stream` or `stream_options` appears twice: the
    /// body is left as it is.
    stream_unclear: bool,
}

/// The members [`RequestProbe`] reads.
enum ProbeKey {
    Model,
    Stream,
    StreamOptions,
    Messages,
    Prompt,
    User,
    Other,
}

impl<'de> Deserialize<'de> for ProbeKey {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl serde::de::Visitor<'_> for Visit {
            type Value = ProbeKey;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a member name")
            }
            fn visit_str<E>(self, v: &str) -> Result<ProbeKey, E> {
                Ok(match v {
                    "model" => ProbeKey::Model,
                    "stream" => ProbeKey::Stream,
                    "stream_options" => ProbeKey::StreamOptions,
                    "messages" => ProbeKey::Messages,
                    "prompt" => ProbeKey::Prompt,
                    "user" => ProbeKey::User,
                    _ => ProbeKey::Other,
                })
            }
        }
        deserializer.deserialize_identifier(Visit)
    }
}

/// A `stream` value: `Some` of a boolean, `None` for null, `Err(())` for anything else (read
/// through and dropped).
struct StreamValue(Result<Option<bool>, ()>);

impl<'de> Deserialize<'de> for StreamValue {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::{IgnoredAny, MapAccess, SeqAccess, Visitor};
        struct Visit;
        impl<'de> Visitor<'de> for Visit {
            type Value = StreamValue;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("any value")
            }
            fn visit_bool<E>(self, v: bool) -> Result<StreamValue, E> {
                Ok(StreamValue(Ok(Some(v))))
            }
            fn visit_unit<E>(self) -> Result<StreamValue, E> {
                Ok(StreamValue(Ok(None)))
            }
            fn visit_none<E>(self) -> Result<StreamValue, E> {
                Ok(StreamValue(Ok(None)))
            }
            fn visit_i64<E>(self, _: i64) -> Result<StreamValue, E> {
                Ok(StreamValue(Err(())))
            }
            fn visit_u64<E>(self, _: u64) -> Result<StreamValue, E> {
                Ok(StreamValue(Err(())))
            }
            fn visit_f64<E>(self, _: f64) -> Result<StreamValue, E> {
                Ok(StreamValue(Err(())))
            }
            fn visit_str<E>(self, _: &str) -> Result<StreamValue, E> {
                Ok(StreamValue(Err(())))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<StreamValue, A::Error> {
                IgnoredAny.visit_seq(seq).map(|_| StreamValue(Err(())))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<StreamValue, A::Error> {
                IgnoredAny.visit_map(map).map(|_| StreamValue(Err(())))
            }
        }
        deserializer.deserialize_any(Visit)
    }
}

/// Reads a [`RequestProbe`], hashing the prompt as it passes when `shape` is set.
struct ProbeSeed<'a> {
    shape: bool,
    _body: std::marker::PhantomData<&'a ()>,
}

impl<'de: 'a, 'a> DeserializeSeed<'de> for ProbeSeed<'a> {
    type Value = RequestProbe<'a>;

    fn deserialize<D: serde::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de: 'a, 'a> serde::de::Visitor<'de> for ProbeSeed<'a> {
    type Value = RequestProbe<'a>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        use serde::de::{Error, IgnoredAny};
        let mut probe = RequestProbe::default();
        let mut prompt_seen = false;
        while let Some(key) = map.next_key::<ProbeKey>()? {
            match key {
                ProbeKey::Model => {
                    if probe.model_seen {
                        return Err(A::Error::duplicate_field("model"));
                    }
                    probe.model_seen = true;
                    probe.model = map.next_value()?;
                }
                ProbeKey::Stream => {
                    let StreamValue(v) = map.next_value()?;
                    probe.stream_unclear |= probe.stream_seen || v.is_err();
                    probe.stream_seen = true;
                    probe.stream = v.unwrap_or(None);
                }
                ProbeKey::StreamOptions => {
                    map.next_value::<IgnoredAny>()?;
                    probe.stream_unclear |= probe.stream_options_seen;
                    probe.stream_options_seen = true;
                }
                // The first of `messages` and `prompt` is the prompt.
                ProbeKey::Messages | ProbeKey::Prompt if self.shape && !prompt_seen => {
                    prompt_seen = true;
                    let mut hasher = BlockHasher::default();
                    if matches!(key, ProbeKey::Messages) {
                        map.next_value_seed(prompt::Messages(&mut hasher))?;
                    } else {
                        map.next_value_seed(prompt::Prompt(&mut hasher))?;
                    }
                    probe.prompt = Some(hasher);
                }
                ProbeKey::User if probe.user.is_none() => {
                    probe.user = map.next_value::<Option<BorrowedStr<'a>>>()?;
                }
                ProbeKey::Messages | ProbeKey::Prompt | ProbeKey::User | ProbeKey::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(probe)
    }
}

/// What the gateway reads from a JSON request body ([`read_json_request`]).
#[derive(Debug)]
pub struct JsonRequest<'a> {
    /// The prompt's shape, when asked for and the body has `messages` or `prompt`.
    pub prompt: Option<PromptShape>,
    /// The OpenAI `user` member, when a non-empty string: a session hint.
    pub user: Option<Cow<'a, str>>,
    /// The top-level `model` (borrowed from the body unless it had escapes); `None` when it
    /// is missing, `null` or empty.
    pub model: Option<Cow<'a, str>>,
    /// `"stream": true` and no `stream_options` member at all (not even `null`), each once: the
    /// one case where [`crate::usage::add_include_usage`] may add `include_usage`.
    pub streamed_without_options: bool,
}

/// A JSON string borrowed from the body unless it has escapes. (`Option<Cow<str>>` would
/// always copy: serde borrows a `Cow` only as a field's own type.)
struct BorrowedStr<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for BorrowedStr<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Cow<'de, str>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Cow::Borrowed(v))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Cow::Owned(v.to_owned()))
            }
            fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
                Ok(Cow::Owned(v))
            }
        }
        deserializer.deserialize_str(Visit).map(BorrowedStr)
    }
}

/// Reads the top-level `model` of a JSON object body, and whether the body asks for a stream
/// without `stream_options`, in one pass. The whole document is validated (a malformed body is
/// refused here rather than by the engine), nothing else is allocated, and the body itself is
/// never re-serialised.
///
/// The body must be UTF-8 (serde skips the strings of other fields without checking them) and
/// an object.
pub fn read_json_request(body: &[u8]) -> Result<JsonRequest<'_>, GatewayError> {
    read_json_request_with(body, false)
}

/// [`read_json_request`], hashing the prompt's blocks in the same pass when `shape` is set
/// ([`crate::prompt`]).
pub fn read_json_request_with(body: &[u8], shape: bool) -> Result<JsonRequest<'_>, GatewayError> {
    let invalid = |e: &dyn std::fmt::Display| {
        GatewayError::new(
            ErrorKind::InvalidJson,
            format!("request body is not a valid JSON object: {e}"),
        )
    };
    let text = std::str::from_utf8(body).map_err(|e| invalid(&e))?;
    if !text
        .trim_start_matches([' ', '\t', '\n', '\r'])
        .starts_with('{')
    {
        return Err(invalid(&"expected an object"));
    }
    let mut de = serde_json::Deserializer::from_str(text);
    let probe = ProbeSeed {
        shape,
        _body: std::marker::PhantomData,
    }
    .deserialize(&mut de)
    .and_then(|probe| de.end().map(|()| probe))
    .map_err(|e| invalid(&e))?;
    Ok(JsonRequest {
        prompt: probe.prompt.map(BlockHasher::finish),
        user: probe.user.map(|u| u.0).filter(|u| !u.is_empty()),
        model: probe.model.map(|m| m.0).filter(|m| !m.is_empty()),
        streamed_without_options: probe.stream == Some(true)
            && !probe.stream_options_seen
            && !probe.stream_unclear,
    })
}

/// The top-level `model` of a JSON object body ([`read_json_request`]); missing, `null` or
/// empty is an error.
pub fn model_from_json(body: &[u8]) -> Result<Cow<'_, str>, GatewayError> {
    read_json_request(body)?.model.ok_or_else(missing_model)
}

/// The error for a request that names no model.
pub(crate) fn missing_model() -> GatewayError {
    GatewayError::new(
        ErrorKind::MissingModel,
        "you must provide a model parameter",
    )
}

/// Reads the `model` field of a `multipart/form-data` body (audio transcriptions, image edits).
pub fn model_from_multipart<'a>(
    content_type: &str,
    body: &'a [u8],
) -> Result<Cow<'a, str>, GatewayError> {
    let bad = |m: &'static str| GatewayError::new(ErrorKind::BadRequest, m);
    let boundary = content_type
        .split(';')
        .map(str::trim)
        .find_map(|p| {
            let (k, v) = p.split_once('=')?;
            k.trim()
                .eq_ignore_ascii_case("boundary")
                .then(|| v.trim().trim_matches('"'))
        })
        .filter(|b| !b.is_empty())
        .ok_or_else(|| bad("multipart body without a boundary"))?;
    let delimiter = format!("--{boundary}");
    let finder = memchr::memmem::Finder::new(delimiter.as_bytes());
    let mut parts = finder.find_iter(body).peekable();
    while let Some(start) = parts.next() {
        let part_start = start + delimiter.len();
        let part_end = parts.peek().copied().unwrap_or(body.len());
        let part = &body[part_start..part_end];
        let Some(head_end) = memchr::memmem::find(part, b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&part[..head_end]);
        let is_model = head.lines().any(|line| {
            let Some((name, value)) = line.split_once(':') else {
                return false;
            };
            name.trim().eq_ignore_ascii_case("content-disposition")
                && value
                    .split(';')
                    .any(|p| p.trim() == "name=\"model\"" || p.trim() == "name=model")
        });
        if !is_model {
            continue;
        }
        let value = &part[head_end + 4..];
        let value = value.strip_suffix(b"\r\n").unwrap_or(value);
        let value = std::str::from_utf8(value)
            .map_err(|_| bad("multipart model field is not UTF-8"))?
            .trim();
        if value.is_empty() {
            return Err(missing_model());
        }
        return Ok(Cow::Borrowed(value));
    }
    Err(missing_model())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parsed_upstream_paths_match_each_api() {
        for (i, api) in Api::ALL.iter().enumerate() {
            assert_eq!(*api as usize, i, "Api::ALL is in declaration order");
            assert_eq!(api.upstream_path_and_query().as_str(), api.upstream_path());
            assert_eq!(api.index(), i);
            assert_eq!(
                Api::from_upstream_path(api.upstream_path().as_bytes()),
                Some(*api)
            );
        }
    }

    #[test]
    fn only_canonical_paths_name_an_api_exactly() {
        for path in [
            "/v1/chat/completions/",
            "/V1/chat/completions",
            "/v1-openai/embeddings",
            "/v1/models",
            "",
        ] {
            assert_eq!(Api::from_upstream_path(path.as_bytes()), None, "{path}");
        }
    }

    #[test]
    fn classifies_paths() {
        assert_eq!(
            classify("/v1/chat/completions"),
            Some(Target::Inference(Api::ChatCompletions))
        );
        assert_eq!(
            classify("/V1-OpenAI/Chat/Completions/"),
            Some(Target::Inference(Api::ChatCompletions))
        );
        assert_eq!(classify("/v1/models"), Some(Target::Models));
        assert_eq!(classify("/v1-openai/models"), Some(Target::Models));
        assert_eq!(classify("/metrics"), Some(Target::Metrics));
        assert_eq!(classify("/health"), Some(Target::Readyz));
        assert_eq!(classify("/v1/chat"), None);
        assert_eq!(classify("/v2/chat/completions"), None);
        assert_eq!(classify("/"), None);
        assert_eq!(classify(""), None);
        for api in Api::ALL {
            assert_eq!(classify(api.upstream_path()), Some(Target::Inference(*api)));
        }
    }

    #[test]
    fn reads_model_without_touching_the_rest() {
        let body = br#"{"messages":[{"role":"user","content":"hi \"model\": x"}],"model":"llama","x":{"model":"no"}}"#;
        assert_eq!(model_from_json(body).unwrap(), "llama");
        // Borrowed from the body, copied only when it had to be unescaped.
        assert!(matches!(model_from_json(body).unwrap(), Cow::Borrowed(_)));
        let escaped = br#"{"model":"a\u0062c"}"#;
        assert_eq!(model_from_json(escaped).unwrap(), "abc");
        assert!(matches!(model_from_json(escaped).unwrap(), Cow::Owned(_)));
    }

    #[test]
    fn reads_stream_without_options_in_the_same_pass() {
        let streamed = |b: &[u8]| read_json_request(b).unwrap().streamed_without_options;
        assert!(streamed(br#" {"model":"m","stream":true,"messages":[]}"#));
        assert!(!streamed(br#"{"stream":false,"model":"m","stream":true}"#));
        for unchanged in [
            &br#"{"model":"m"}"#[..],
            br#"{"model":"m","stream":false}"#,
            br#"{"model":"m","stream":null}"#,
            br#"{"model":"m","stream":true,"stream_options":null}"#,
            br#"{"model":"m","stream":true,"stream_options":{}}"#,
            br#"{"model":"m","stream":true,"stream_options":{"include_usage":false}}"#,
            br#"{"model":"m","stream":"yes"}"#,
            br#"{"model":"m","stream":1}"#,
            br#"{"model":"m","stream":[true]}"#,
            br#"{"model":"m","stream":{"a":true}}"#,
            br#"{"model":"m","stream":true,"stream":true}"#,
            br#"{"model":"m","stream":true,"stream_options":1,"stream_options":2}"#,
        ] {
            assert!(
                !streamed(unchanged),
                "{}",
                String::from_utf8_lossy(unchanged)
            );
        }
        // Escaped member names are the names.
        assert!(streamed(br#"{"model":"m","str\u0065am":true}"#));
    }

    #[test]
    fn model_errors() {
        let kind = |b: &[u8]| model_from_json(b).unwrap_err().kind;
        assert_eq!(kind(b"{}"), ErrorKind::MissingModel);
        assert_eq!(kind(br#"{"model":null}"#), ErrorKind::MissingModel);
        assert_eq!(kind(br#"{"model":""}"#), ErrorKind::MissingModel);
        assert_eq!(kind(b"{"), ErrorKind::InvalidJson);
        assert_eq!(kind(b""), ErrorKind::InvalidJson);
        assert_eq!(kind(b"[1]"), ErrorKind::InvalidJson);
        assert_eq!(kind(br#"{"model":1}"#), ErrorKind::InvalidJson);
        assert_eq!(
            kind(br#"{"model":"a","model":"b"}"#),
            ErrorKind::InvalidJson
        );
        assert_eq!(kind(br#"{"model":"a"} trailing"#), ErrorKind::InvalidJson);
    }

    /// Found by fuzzing (`model_json`): invalid UTF-8 inside a skipped string, and a top-level
    /// array, were accepted although the document is not a valid JSON object.
    #[test]
    fn model_body_must_be_a_utf8_object() {
        let kind = |b: &[u8]| model_from_json(b).unwrap_err().kind;
        assert_eq!(
            kind(b"{\"messages\":[{\"content\":\"\xff\xfe\"}],\"model\":\"m\"}"),
            ErrorKind::InvalidJson
        );
        assert_eq!(kind(br#"["llama"]"#), ErrorKind::InvalidJson);
        assert_eq!(kind(br#" ["llama", 1]"#), ErrorKind::InvalidJson);
        assert_eq!(
            model_from_json(b" \n{\"model\":\"gr\xc3\xbc\"}").unwrap(),
            "gr\u{fc}"
        );
    }

    #[test]
    fn reads_multipart_model() {
        let body = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\nRIFF....model\r\n--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1\r\n--XyZ--\r\n";
        let ct = "multipart/form-data; boundary=XyZ";
        assert_eq!(model_from_multipart(ct, body).unwrap(), "whisper-1");
        let no_model =
            b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nabc\r\n--XyZ--\r\n";
        assert_eq!(
            model_from_multipart(ct, no_model).unwrap_err().kind,
            ErrorKind::MissingModel
        );
        assert_eq!(
            model_from_multipart("multipart/form-data", body)
                .unwrap_err()
                .kind,
            ErrorKind::BadRequest
        );
    }
}
