//! The intermediate tree that YAML and JSON input both convert to.

/// A parsed document reduced to what validation needs. Both input formats convert to this, so the
/// rules live in one place.
#[derive(Debug)]
pub(super) enum Node {
    Null,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    Seq,
    /// Entries in document order; non-string YAML keys are rendered as text (they are never
    /// known keys, so they are reported as unknown).
    Map(Vec<(String, Node)>),
    /// A YAML value with a custom tag (`!foo 1`): never a valid option value.
    Tagged(String),
}

/// How deep [`Node`] conversion looks into mappings: options are at depth 1 and
/// `system_reserved.ram` at depth 2. Deeper mappings are only ever reported as "a mapping", so
/// their contents are not converted (which also bounds recursion on hostile input).
pub(super) const NODE_DEPTH: usize = 2;

impl Node {
    pub(super) fn from_yaml(value: &serde_yaml_ng::Value, depth: usize) -> Node {
        use serde_yaml_ng::Value;
        match value {
            Value::Null => Node::Null,
            Value::Bool(b) => Node::Bool(*b),
            Value::Number(n) => Node::number(n.as_u64(), n.as_i64(), n.as_f64()),
            Value::String(s) => Node::Str(s.clone()),
            Value::Sequence(_) => Node::Seq,
            Value::Mapping(_) if depth == 0 => Node::Map(Vec::new()),
            Value::Mapping(map) => Node::Map(
                map.iter()
                    .map(|(k, v)| (yaml_key_text(k), Node::from_yaml(v, depth - 1)))
                    .collect(),
            ),
            Value::Tagged(tagged) => Node::Tagged(tagged.tag.to_string()),
        }
    }

    pub(super) fn from_json(value: &serde_json::Value, depth: usize) -> Node {
        use serde_json::Value;
        match value {
            Value::Null => Node::Null,
            Value::Bool(b) => Node::Bool(*b),
            Value::Number(n) => Node::number(n.as_u64(), n.as_i64(), n.as_f64()),
            Value::String(s) => Node::Str(s.clone()),
            Value::Array(_) => Node::Seq,
            Value::Object(_) if depth == 0 => Node::Map(Vec::new()),
            Value::Object(map) => Node::Map(
                map.iter()
                    .map(|(k, v)| (k.clone(), Node::from_json(v, depth - 1)))
                    .collect(),
            ),
        }
    }

    /// Integers stay exact (ports must not be rounded); everything else is a float.
    fn number(unsigned: Option<u64>, signed: Option<i64>, float: Option<f64>) -> Node {
        match (unsigned, signed, float) {
            (Some(u), _, _) => Node::Int(i128::from(u)),
            (None, Some(i), _) => Node::Int(i128::from(i)),
            (None, None, f) => Node::Float(f.unwrap_or(f64::NAN)),
        }
    }

    /// How the value reads in an error message: `string "yes"`, `integer 0`, `a list`, ...
    pub(super) fn describe(&self) -> String {
        match self {
            Node::Null => "null".to_owned(),
            Node::Bool(b) => format!("boolean {b}"),
            Node::Int(i) => format!("integer {i}"),
            Node::Float(f) => format!("number {f}"),
            Node::Str(s) => format!("string {:?}", truncate(s, 40)),
            Node::Seq => "a list".to_owned(),
            Node::Map(_) => "a mapping".to_owned(),
            Node::Tagged(tag) => format!("a value tagged {tag}"),
        }
    }

    /// Hint appended to "expected a string" errors for unquoted scalars YAML typed otherwise.
    pub(super) fn quote_hint(&self) -> &'static str {
        match self {
            Node::Bool(_) | Node::Int(_) | Node::Float(_) => " (quote it to make it a string)",
            _ => "",
        }
    }
}

fn yaml_key_text(key: &serde_yaml_ng::Value) -> String {
    use serde_yaml_ng::Value;
    match key {
        Value::String(s) => s.clone(),
        Value::Null => "null".to_owned(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::Sequence(_) => "<list>".to_owned(),
        Value::Mapping(_) => "<mapping>".to_owned(),
        Value::Tagged(t) => format!("{} {}", t.tag, yaml_key_text(&t.value)),
    }
}

pub(super) fn truncate(text: &str, max_chars: usize) -> String {
    if text.chars().count() <= max_chars {
        return text.to_owned();
    }
    let mut cut: String = text.chars().take(max_chars).collect();
    cut.push('…');
    cut
}
