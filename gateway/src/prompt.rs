//! The shape of a request's prompt, as the routing policy sees it: an estimate of its tokens and
//! the chained hashes of its whole blocks, computed without a tokenizer.
//!
//! The prompt is rendered canonically, whatever the order of the JSON members: for each chat
//! message its `role`, a newline, its text (a string, or the `text` of each text part; other
//! parts, such as images, by their JSON), a newline; for a completion its `prompt` (a string,
//! strings one after another, or token ids). The rendering is cut into blocks of
//! [`BLOCK_BYTES`] bytes; block `i`'s hash covers block `i` and, through the hash of block
//! `i - 1`, everything before it, so two prompts share block hashes exactly as far as their
//! renderings share whole blocks (xxh3: the same on every gateway and build).
//!
//! What the approximation costs: a token is taken as [`BYTES_PER_TOKEN`] bytes (the engine's
//! tokenizer decides the real count and its own block edges), so a prefix is matched to within
//! a block of 256 bytes (~64 tokens) and prompts shorter than one block get no affinity (there
//! is little to cache in them anyway). The engine's chat template adds its own markers; they
//! are the same for every request of a model, so what two renderings share here the engine's
//! prompts share too.

use std::borrow::Cow;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Bytes taken for one token.
pub const BYTES_PER_TOKEN: usize = 4;
/// Tokens per block.
pub const BLOCK_TOKENS: usize = 64;
/// Bytes per block of the rendering.
pub const BLOCK_BYTES: usize = BLOCK_TOKENS * BYTES_PER_TOKEN;
/// Blocks hashed at most (a 1.6 MB prompt): the rest of a longer one still counts in `tokens`.
pub const MAX_BLOCKS: usize = 6144;

/// What the policy knows of a prompt.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PromptShape {
    /// Estimated prompt tokens (rendered bytes / [`BYTES_PER_TOKEN`], rounded up).
    pub tokens: u64,
    /// Chained hashes of the rendering's whole blocks, first block first.
    pub blocks: Vec<u64>,
}

impl PromptShape {
    /// The shape of a rendering given whole (tests, benchmarks).
    pub fn of(rendering: &[u8]) -> Self {
        let mut h = BlockHasher::default();
        h.feed(rendering);
        h.finish()
    }
}

/// Cuts a rendering into blocks as it is fed, and hashes each whole block chained to the one
/// before it. Holds at most one partial block.
/// Inline, so that a prompt shorter than a block (most requests of a plain API benchmark)
/// allocates nothing.
#[derive(Debug)]
pub struct BlockHasher {
    partial: [u8; BLOCK_BYTES],
    partial_len: usize,
    previous: u64,
    blocks: Vec<u64>,
    bytes: u64,
}

impl Default for BlockHasher {
    fn default() -> Self {
        Self {
            partial: [0; BLOCK_BYTES],
            partial_len: 0,
            previous: 0,
            blocks: Vec::new(),
            bytes: 0,
        }
    }
}

impl BlockHasher {
    pub fn feed(&mut self, mut bytes: &[u8]) {
        self.bytes += bytes.len() as u64;
        if self.partial_len > 0 {
            let take = (BLOCK_BYTES - self.partial_len).min(bytes.len());
            self.partial[self.partial_len..self.partial_len + take].copy_from_slice(&bytes[..take]);
            self.partial_len += take;
            bytes = &bytes[take..];
            if self.partial_len < BLOCK_BYTES {
                return;
            }
            let block = self.partial;
            self.push(&block);
            self.partial_len = 0;
        }
        while bytes.len() >= BLOCK_BYTES {
            let (block, rest) = bytes.split_at(BLOCK_BYTES);
            self.push(block);
            bytes = rest;
        }
        self.partial[..bytes.len()].copy_from_slice(bytes);
        self.partial_len = bytes.len();
    }

    fn push(&mut self, block: &[u8]) {
        if self.blocks.len() < MAX_BLOCKS {
            self.previous = xxh3_64_with_seed(block, self.previous);
            self.blocks.push(self.previous);
        }
    }

    pub fn finish(self) -> PromptShape {
        PromptShape {
            tokens: self.bytes.div_ceil(BYTES_PER_TOKEN as u64),
            blocks: self.blocks,
        }
    }
}

/// Feeds a chat request's `messages` array into a [`BlockHasher`] as it is deserialized.
#[derive(Debug)]
pub struct Messages<'h>(pub &'h mut BlockHasher);

/// Feeds a completion request's `prompt` into a [`BlockHasher`] as it is deserialized.
#[derive(Debug)]
pub struct Prompt<'h>(pub &'h mut BlockHasher);

impl<'de> DeserializeSeed<'de> for Messages<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Messages<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array of messages")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Message(&mut *self.0))?.is_some() {}
        Ok(())
    }

    // Not an array: the engine will say what is wrong with it; nothing to hash.
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        IgnoredAny.visit_map(map).map(|_| ())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
}

/// One message: its role and content are collected (JSON may put them in any order), then fed.
struct Message<'h>(&'h mut BlockHasher);

impl<'de> DeserializeSeed<'de> for Message<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Message<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a message")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut role: Option<Cow<'de, str>> = None;
        let mut content: Option<Cow<'de, [u8]>> = None;
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            match key.as_ref() {
                "role" => role = Some(map.next_value::<Text<'de>>()?.0),
                "content" if content.is_none() => content = Some(map.next_value_seed(Content)?),
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        // Fed in rendering order, whatever the members' order.
        let hasher = self.0;
        hasher.feed(role.as_deref().unwrap_or("").as_bytes());
        hasher.feed(b"\n");
        hasher.feed(content.as_deref().unwrap_or(b""));
        hasher.feed(b"\n");
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<(), A::Error> {
        IgnoredAny.visit_seq(seq).map(|_| ())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
}

/// A message's `content` as rendered: a string (borrowed from the body unless it had escapes),
/// or the `text` of its text parts and the JSON of its other parts, one after another.
struct Content;

impl<'de> DeserializeSeed<'de> for Content {
    type Value = Cow<'de, [u8]>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Content {
    type Value = Cow<'de, [u8]>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a message content")
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(v.as_bytes()))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v.as_bytes().to_vec()))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::new();
        while let Some(part) = seq.next_element::<Part<'de>>()? {
            match part {
                Part::Text(text) => out.extend_from_slice(text.as_bytes()),
                Part::Other(json) => out.extend_from_slice(json.get().as_bytes()),
            }
        }
        Ok(Cow::Owned(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        IgnoredAny.visit_map(map).map(|_| Cow::Borrowed(&b""[..]))
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(b""))
    }
    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(b""))
    }
    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(b""))
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(b""))
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(b""))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(b""))
    }
}

/// One content part: a text part's text, or any other part as its JSON.
enum Part<'a> {
    Text(Cow<'a, str>),
    Other(Box<serde_json::value::RawValue>),
}

impl<'de> serde::Deserialize<'de> for Part<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        // Read as JSON text once; a text part is then read from it (parts are small).
        let raw = Box::<serde_json::value::RawValue>::deserialize(deserializer)?;
        #[derive(serde::Deserialize)]
        struct TextPart<'a> {
            #[serde(rename = "type")]
            kind: Option<Cow<'a, str>>,
            #[serde(borrow)]
            text: Option<Cow<'a, str>>,
        }
        if let Ok(TextPart {
            kind,
            text: Some(text),
        }) = serde_json::from_str::<TextPart<'_>>(raw.get())
            && kind.as_deref().is_none_or(|k| k == "text")
        {
            return Ok(Part::Text(Cow::Owned(text.into_owned())));
        }
        Ok(Part::Other(raw))
    }
}

/// A string, borrowed from the body unless it had escapes.
struct Text<'a>(Cow<'a, str>);

impl<'de> serde::Deserialize<'de> for Text<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> Visitor<'de> for Visit {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(v.to_owned())))
            }
            fn visit_unit<E>(self) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Borrowed("")))
            }
        }
        deserializer.deserialize_any(Visit)
    }
}

impl<'de> DeserializeSeed<'de> for Prompt<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Prompt<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a prompt")
    }

    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        self.0.feed(v.as_bytes());
        Ok(())
    }

    // Token ids: each as its decimal text and a space (ids are not bytes of text, but equal
    // id sequences render alike, which is all the hash needs).
    fn visit_u64<E>(self, v: u64) -> Result<(), E> {
        self.0.feed(format!("{v} ").as_bytes());
        Ok(())
    }

    fn visit_i64<E>(self, v: i64) -> Result<(), E> {
        self.0.feed(format!("{v} ").as_bytes());
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Prompt(&mut *self.0))?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        IgnoredAny.visit_map(map).map(|_| ())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages(json: &str) -> PromptShape {
        let mut h = BlockHasher::default();
        let mut de = serde_json::Deserializer::from_str(json);
        Messages(&mut h).deserialize(&mut de).unwrap();
        h.finish()
    }

    fn long(n: usize, c: char) -> String {
        std::iter::repeat_n(c, n).collect()
    }

    #[test]
    fn blocks_are_chained_and_whole() {
        let a = PromptShape::of(&[b'a'; BLOCK_BYTES * 3 + 10]);
        assert_eq!(a.blocks.len(), 3);
        assert_eq!(a.tokens, (BLOCK_BYTES as u64 * 3 + 10).div_ceil(4));
        // The same first block, a different second: the first hash only is shared.
        let mut other = vec![b'a'; BLOCK_BYTES];
        other.extend(std::iter::repeat_n(b'b', BLOCK_BYTES * 2));
        let b = PromptShape::of(&other);
        assert_eq!(a.blocks[0], b.blocks[0]);
        assert_ne!(a.blocks[1], b.blocks[1]);
        assert_ne!(a.blocks[2], b.blocks[2]);
        // Fed in any pieces, the same.
        let mut h = BlockHasher::default();
        for piece in [b'a'; BLOCK_BYTES * 3 + 10].chunks(7) {
            h.feed(piece);
        }
        assert_eq!(h.finish(), a);
        assert!(PromptShape::of(b"short").blocks.is_empty());
    }

    #[test]
    fn chat_renders_canonically_whatever_the_member_order() {
        let system = long(600, 's');
        let a = messages(&format!(
            r#"[{{"role":"system","content":"{system}"}},{{"role":"user","content":"hi"}}]"#
        ));
        let b = messages(&format!(
            r#"[{{"content":"{system}","role":"system","name":"x"}},{{"content":[{{"type":"text","text":"hi"}}],"role":"user"}}]"#
        ));
        assert_eq!(a, b);
        assert_eq!(a.tokens, (6 + 1 + 600 + 1 + 4 + 1 + 2 + 1_u64).div_ceil(4));
        // A conversation that grows keeps the blocks it had.
        let c = messages(&format!(
            r#"[{{"role":"system","content":"{system}"}},{{"role":"user","content":"hi"}},{{"role":"assistant","content":"{}"}}]"#,
            long(900, 'x')
        ));
        assert_eq!(c.blocks[..a.blocks.len()], a.blocks[..]);
        assert!(c.blocks.len() > a.blocks.len());
        // Escapes are read as the text they stand for.
        let d = messages(&format!(
            r#"[{{"role":"system","content":"{}\n{}"}}]"#,
            long(300, 's'),
            long(300, 's')
        ));
        let e = messages(&format!(
            "[{{\"role\":\"system\",\"content\":\"{}\\u000a{}\"}}]",
            long(300, 's'),
            long(300, 's')
        ));
        assert_eq!(d, e);
    }

    #[test]
    fn other_shapes_hash_nothing_and_fail_nothing() {
        for json in [r#"{}"#, r#""text""#, "3", "null", r#"[1, "a", null, [2]]"#] {
            let shape = messages(json);
            assert!(shape.blocks.is_empty(), "{json}");
        }
    }

    #[test]
    fn completion_prompts() {
        let text = long(700, 'p');
        let shape = |json: &str| {
            let mut h = BlockHasher::default();
            let mut de = serde_json::Deserializer::from_str(json);
            Prompt(&mut h).deserialize(&mut de).unwrap();
            h.finish()
        };
        assert_eq!(
            shape(&format!(r#""{text}""#)),
            PromptShape::of(text.as_bytes())
        );
        assert_eq!(
            shape(&format!(r#"["{text}"]"#)),
            PromptShape::of(text.as_bytes())
        );
        let ids: Vec<String> = (0..300).map(|i| i.to_string()).collect();
        let a = shape(&format!("[{}]", ids.join(",")));
        assert!(!a.blocks.is_empty());
        assert_eq!(a, shape(&format!("[{}]", ids.join(", "))));
    }
}
