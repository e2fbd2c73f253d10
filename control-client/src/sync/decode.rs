//! Reads list answers and watch events into changes.
//!
//! Two kinds of bad input are told apart:
//! - Text that is not a JSON event at all (not JSON, no numeric `type`) means the stream itself
//!   is broken: the caller drops the stream and re-lists ([`serde_json::Error`] is returned).
//! - A well-formed event that faden cannot use (an unknown `type` such as GPUStack's `4`, or an
//!   object that does not fit the wire type) is *skipped* and counted: one odd object must not
//!   take the whole routing table down, and re-listing would not help because the list carries
//!   the same object. The object then keeps its previous state (or stays absent) until a later
//!   event or list fixes it; the warn log and the counter make that visible. List items are
//!   read the same way, one by one.

use serde::Deserialize;
use serde_json::Value;

use super::resource::{Change, Resource};
use crate::model::EventType;

/// One decoded watch event.
#[derive(Debug)]
pub(crate) struct Event<T> {
    pub(crate) action: Action<T>,
    /// The event's store revision (faden only).
    pub(crate) revision: Option<u64>,
}

/// What to do with an event.
#[derive(Debug)]
pub(crate) enum Action<T> {
    Apply(Change<T>),
    Skip(Skipped),
}

/// Why an event (or list item) was skipped.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Skipped {
    #[error("unknown event type {0}")]
    UnknownType(i64),
    #[error("object {id:?} does not fit the wire type: {error}")]
    BadObject {
        id: Option<i64>,
        error: serde_json::Error,
    },
    #[error("delete event without an id")]
    NoId,
}

/// The envelope of a watch event, read before its `data` so that a bad object can be skipped.
#[derive(Deserialize)]
struct Envelope {
    #[serde(rename = "type")]
    kind: i64,
    #[serde(default)]
    data: Value,
    #[serde(default)]
    id: Option<i64>,
    #[serde(default)]
    revision: Option<u64>,
}

/// Decodes one event's JSON text.
pub(crate) fn event<T: Resource>(json: &[u8]) -> Result<Event<T>, serde_json::Error> {
    // serde would also read a struct from an array (`[1, {...}]`): only objects are events.
    if !json.trim_ascii_start().starts_with(b"{") {
        return Err(serde::de::Error::custom(
            "a watch event must be a JSON object",
        ));
    }
    let envelope: Envelope = serde_json::from_slice(json)?;
    let kind = u8::try_from(envelope.kind)
        .ok()
        .and_then(EventType::from_code);
    let action = match kind {
        None => Action::Skip(Skipped::UnknownType(envelope.kind)),
        Some(EventType::Created | EventType::Updated) => match T::deserialize(&envelope.data) {
            Ok(object) => Action::Apply(Change::Upsert(object)),
            Err(error) => Action::Skip(Skipped::BadObject {
                id: object_id(&envelope.data).or(envelope.id),
                error,
            }),
        },
        // Only the id matters for a delete, so a delete is never skipped for a bad object.
        Some(EventType::Deleted) => match object_id(&envelope.data).or(envelope.id) {
            Some(id) => Action::Apply(Change::Delete(id)),
            None => Action::Skip(Skipped::NoId),
        },
    };
    Ok(Event {
        action,
        revision: envelope.revision,
    })
}

fn object_id(data: &Value) -> Option<i64> {
    data.get("id").and_then(Value::as_i64)
}

/// A list answer: only `items` is needed (pagination is ignored, `page=-1` asks for all).
#[derive(Deserialize)]
struct RawList {
    items: Vec<Value>,
}

/// Decodes a list answer, skipping the items that do not fit the wire type.
pub(crate) fn list<T: Resource>(json: &[u8]) -> Result<(Vec<T>, Vec<Skipped>), serde_json::Error> {
    let raw: RawList = serde_json::from_slice(json)?;
    let mut items = Vec::with_capacity(raw.items.len());
    let mut skipped = Vec::new();
    for value in raw.items {
        match T::deserialize(&value) {
            Ok(item) => items.push(item),
            Err(error) => skipped.push(Skipped::BadObject {
                id: object_id(&value),
                error,
            }),
        }
    }
    Ok((items, skipped))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{InstanceState, ModelInstance, Worker};

    const INSTANCE: &str = r#"{"id":5,"model_id":1,"state":"running","port":40000,"extra":true}"#;

    fn decode(json: &str) -> Event<ModelInstance> {
        event(json.as_bytes()).unwrap()
    }

    #[test]
    fn created_and_updated_upsert() {
        for kind in [1, 2] {
            let e = decode(&format!(r#"{{"type":{kind},"data":{INSTANCE},"id":5}}"#));
            let Action::Apply(Change::Upsert(inst)) = e.action else {
                panic!("expected an upsert, got {e:?}");
            };
            assert_eq!(
                (inst.id, inst.state, inst.port),
                (5, InstanceState::Running, Some(40000))
            );
            assert_eq!(e.revision, None);
        }
    }

    #[test]
    fn delete_uses_data_id_then_event_id() {
        let e = decode(&format!(
            r#"{{"type":3,"data":{INSTANCE},"id":9,"revision":12}}"#
        ));
        assert!(matches!(e.action, Action::Apply(Change::Delete(5))));
        assert_eq!(e.revision, Some(12));
        let e = decode(r#"{"type":3,"data":{"name":"x"},"id":9}"#);
        assert!(matches!(e.action, Action::Apply(Change::Delete(9))));
        let e = decode(r#"{"type":3,"id":4}"#);
        assert!(matches!(e.action, Action::Apply(Change::Delete(4))));
        let e = decode(r#"{"type":3,"data":null}"#);
        assert!(matches!(e.action, Action::Skip(Skipped::NoId)));
    }

    #[test]
    fn odd_events_are_skipped_not_fatal() {
        let e = decode(r#"{"type":4,"data":{}}"#);
        assert!(matches!(e.action, Action::Skip(Skipped::UnknownType(4))));
        let e = decode(r#"{"type":2,"data":{"id":7,"state":"running"},"revision":3}"#);
        assert!(matches!(
            e.action,
            Action::Skip(Skipped::BadObject { id: Some(7), .. })
        ));
        assert_eq!(
            e.revision,
            Some(3),
            "a skipped event still advances the revision"
        );
    }

    #[test]
    fn broken_text_is_an_error() {
        for text in ["not json", "{\"data\":{}}", "{\"type\":\"1\"}", "[1,2]"] {
            assert!(event::<Worker>(text.as_bytes()).is_err(), "{text}");
        }
    }

    #[test]
    fn list_skips_items_that_do_not_fit() {
        let json = format!(r#"{{"items":[{INSTANCE},{{"id":6}}],"pagination":{{}}}}"#);
        let (items, skipped) = list::<ModelInstance>(json.as_bytes()).unwrap();
        assert_eq!(items.len(), 1);
        assert!(matches!(
            skipped[..],
            [Skipped::BadObject { id: Some(6), .. }]
        ));
        assert!(list::<ModelInstance>(b"{\"data\":[]}").is_err());
    }
}
