//! Chat `messages` read with bounds, for both servers (router and engine must read a body the
//! same way, or the router's token ids would not match the engine's).
//!
//! Why a hand-written visitor: a 64 MiB body holds ~1.9 million empty messages; parsed into a
//! JSON tree (or a `Vec` of structs) and rendered, one such request took ~1.4 GiB. Here the
//! sequence stops growing at [`MAX_MESSAGES`]: the next element is skipped unread
//! ([`IgnoredAny`] allocates nothing) and the request fails. Content parts are not collected at
//! all: their text is appended to the message's content as it is read, and the parts of the whole
//! request are counted against [`MAX_CONTENT_PARTS`]. Fields other than `role` and `content` are
//! skipped unread. Memory per request is thus bounded by the text the body carries plus a fixed
//! amount per message (≤ `MAX_MESSAGES`), never by how many JSON values it holds.
//!
//! Text is borrowed from the body where it can be (a string without escapes, read from a byte
//! slice): a large message then costs nothing beyond the body that carries it, and the rendered
//! prompt is the only other copy of it (issue 37: the router's peak for one 60 MiB chat body
//! was 4x it while body, fields, messages and prompt each held a copy).
//!
//! vLLM 0.32 has no message-count cap; 65,536 is far above any real conversation (a 128K-token
//! context filled with one-token messages would still need a chat template that spends no tokens
//! on message framing, which none does).

use std::borrow::Cow;
use std::cell::Cell;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};

/// The most messages one request may carry.
pub const MAX_MESSAGES: usize = 65_536;

/// The most content parts one request may carry, counted over all its messages.
pub const MAX_CONTENT_PARTS: usize = 65_536;

/// One chat message with its content flattened to text: a string as is; a list of text parts
/// joined with `"\n"`, as vLLM joins them for a chat template that takes string content.
/// Both borrow from the input when it is a byte slice or a string and they carry no escapes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TextMessage<'a> {
    pub role: Cow<'a, str>,
    pub content: Cow<'a, str>,
}

/// A request's `messages`, read with the bounds above. Use as the field's type
/// (`messages: Messages`, or `Option<Messages>` when the field is optional).
/// (`#[serde(borrow)]` on the field lets its text borrow from the body.)
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Messages<'a>(pub Vec<TextMessage<'a>>);

/// The error text for one message too many (also what the servers' 400 says).
pub fn too_many_messages() -> String {
    format!("too many messages: at most {MAX_MESSAGES} messages per request")
}

/// The error text for one content part too many.
pub fn too_many_parts() -> String {
    format!("too many content parts: at most {MAX_CONTENT_PARTS} content parts per request")
}

impl<'de: 'a, 'a> Deserialize<'de> for Messages<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_seq(MessagesVisitor(PhantomData))
    }
}

struct MessagesVisitor<'a>(PhantomData<&'a ()>);

impl<'de: 'a, 'a> Visitor<'de> for MessagesVisitor<'a> {
    type Value = Messages<'a>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of messages")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Messages<'a>, A::Error> {
        let parts = Cell::new(0usize);
        // No `with_capacity` from the size hint: it is the client's claim, not a bound.
        let mut out = Vec::new();
        loop {
            if out.len() == MAX_MESSAGES {
                // One more element, skipped unread, is one too many.
                return match seq.next_element::<IgnoredAny>()? {
                    Some(_) => Err(de::Error::custom(too_many_messages())),
                    None => Ok(Messages(out)),
                };
            }
            match seq.next_element_seed(MessageSeed {
                parts: &parts,
                text: PhantomData,
            })? {
                Some(m) => out.push(m),
                None => return Ok(Messages(out)),
            }
        }
    }
}

/// The keys of a message or a content part this module reads; any other is skipped.
#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "lowercase")]
enum Key {
    Role,
    Content,
    Type,
    Text,
    #[serde(other)]
    Other,
}

/// A string borrowed from the input when it can be (serde's own `Cow<str>` always copies).
struct CowStr<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for CowStr<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(CowStrVisitor(PhantomData))
    }
}

struct CowStrVisitor<'a>(PhantomData<&'a ()>);

impl<'de: 'a, 'a> Visitor<'de> for CowStrVisitor<'a> {
    type Value = CowStr<'a>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string")
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<CowStr<'a>, E> {
        Ok(CowStr(Cow::Borrowed(v)))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<CowStr<'a>, E> {
        Ok(CowStr(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<CowStr<'a>, E> {
        Ok(CowStr(Cow::Owned(v)))
    }
}

/// One message; `parts` counts the request's content parts so far; `'a` is what its text may
/// borrow from.
struct MessageSeed<'p, 'a> {
    parts: &'p Cell<usize>,
    text: PhantomData<&'a ()>,
}

impl<'de: 'a, 'a> DeserializeSeed<'de> for MessageSeed<'_, 'a> {
    type Value = TextMessage<'a>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<TextMessage<'a>, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de: 'a, 'a> Visitor<'de> for MessageSeed<'_, 'a> {
    type Value = TextMessage<'a>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a message object with a `role`")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<TextMessage<'a>, A::Error> {
        let mut role: Option<Cow<'a, str>> = None;
        let mut content = Cow::Borrowed("");
        // A repeated key: the last one wins, as in the Python dict vLLM reads.
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Role => role = Some(map.next_value::<CowStr<'a>>()?.0),
                Key::Content => {
                    content = map.next_value_seed(ContentSeed {
                        parts: self.parts,
                        text: PhantomData,
                    })?
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let role = role.ok_or_else(|| de::Error::missing_field("role"))?;
        Ok(TextMessage { role, content })
    }
}

/// A message's `content`: a string, null, or a list of parts, returned as text (a string
/// borrowed when it can be; parts joined into a new one).
struct ContentSeed<'p, 'a> {
    parts: &'p Cell<usize>,
    text: PhantomData<&'a ()>,
}

impl<'de: 'a, 'a> DeserializeSeed<'de> for ContentSeed<'_, 'a> {
    type Value = Cow<'a, str>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Cow<'a, str>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de: 'a, 'a> Visitor<'de> for ContentSeed<'_, 'a> {
    type Value = Cow<'a, str>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string, null, or a list of content parts")
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Cow<'a, str>, E> {
        Ok(Cow::Borrowed(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Cow<'a, str>, E> {
        Ok(Cow::Owned(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Cow<'a, str>, E> {
        Ok(Cow::Owned(v))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Cow<'a, str>, E> {
        Ok(Cow::Borrowed(""))
    }

    fn visit_none<E: de::Error>(self) -> Result<Cow<'a, str>, E> {
        Ok(Cow::Borrowed(""))
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Cow<'a, str>, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Cow<'a, str>, A::Error> {
        let mut text = String::new();
        let mut first = true;
        loop {
            if self.parts.get() == MAX_CONTENT_PARTS {
                return match seq.next_element::<IgnoredAny>()? {
                    Some(_) => Err(de::Error::custom(too_many_parts())),
                    None => Ok(Cow::Owned(text)),
                };
            }
            let Some(part) = seq.next_element_seed(PartSeed {
                text: &mut text,
                first,
            })?
            else {
                return Ok(Cow::Owned(text));
            };
            self.parts.set(self.parts.get() + 1);
            first &= !part;
        }
    }
}

/// One content part, appended to `text` (with a `"\n"` before it unless `first`). Returns
/// whether it added a part (vLLM skips a text part whose `text` is missing or null).
struct PartSeed<'a> {
    text: &'a mut String,
    first: bool,
}

impl PartSeed<'_> {
    fn append(self, t: &str) -> bool {
        if !self.first {
            self.text.push('\n');
        }
        self.text.push_str(t);
        true
    }
}

impl<'de> DeserializeSeed<'de> for PartSeed<'_> {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PartSeed<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a text content part (a string or {\"type\": \"text\", \"text\": ...})")
    }

    /// A plain string in the list is a text part (vLLM accepts it).
    fn visit_str<E: de::Error>(self, v: &str) -> Result<bool, E> {
        Ok(self.append(v))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<bool, A::Error> {
        let mut kind: Option<String> = None;
        let mut text: Option<String> = None;
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Type => kind = map.next_value()?,
                Key::Text => text = map.next_value()?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        // No `type` with a `text` is vLLM's simple text part.
        match kind.as_deref() {
            None | Some("text") => Ok(text.is_some_and(|t| self.append(&t))),
            Some(other) => Err(de::Error::custom(format!(
                "unsupported content part type `{other}` (text only)"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn read(body: &str) -> Result<Messages<'_>, serde_json::Error> {
        serde_json::from_str(body)
    }

    fn msgs(n: usize) -> String {
        format!("[{}]", vec![r#"{"role":"user","content":""}"#; n].join(","))
    }

    fn parts_message(n: usize) -> String {
        format!(
            r#"[{{"role":"user","content":[{}]}}]"#,
            vec![r#"{"type":"text","text":"a"}"#; n].join(",")
        )
    }

    #[test]
    fn strings_nulls_and_text_parts_are_flattened_like_vllm() {
        let m = read(
            r#"[{"role":"system","content":"be brief","name":"x","tool_calls":[{"a":[1,2]}]},
                {"role":"user","content":[{"type":"text","text":"a"},"b",{"text":"c"},{"type":"text"},{"type":"text","text":null}]},
                {"role":"assistant","content":null},{"role":"assistant"}]"#,
        )
        .unwrap();
        let text = |r: &'static str, c: &'static str| TextMessage {
            role: r.into(),
            content: c.into(),
        };
        assert_eq!(
            m.0,
            vec![
                text("system", "be brief"),
                text("user", "a\nb\nc"),
                text("assistant", ""),
                text("assistant", ""),
            ]
        );
    }

    /// Text without escapes is the body's own bytes, not a copy: a 60 MiB message then costs
    /// the router and the engine nothing beyond the body until it is rendered.
    #[test]
    fn plain_text_is_borrowed_from_the_body_and_escaped_text_is_decoded() {
        let body = r#"[{"role":"user","content":"plain"},{"role":"user","content":"a\"b\n"}]"#;
        let m = read(body).unwrap();
        assert!(matches!(m.0[0].role, Cow::Borrowed("user")));
        assert!(matches!(m.0[0].content, Cow::Borrowed("plain")));
        assert_eq!(m.0[1].content, "a\"b\n");
    }

    #[test]
    fn malformed_messages_are_errors() {
        for body in [
            r#""hi""#,
            r#"[{"content":"x"}]"#,
            r#"[{"role":1,"content":"x"}]"#,
            r#"[{"role":"user","content":5}]"#,
            r#"[{"role":"user","content":{"text":"x"}}]"#,
            r#"[{"role":"user","content":[{"type":"image_url","image_url":7}]}]"#,
            r#"[{"role":"user","content":[5]}]"#,
            r#"[5]"#,
        ] {
            assert!(read(body).is_err(), "{body}");
        }
        let e = read(r#"[{"role":"user","content":[{"type":"image_url"}]}]"#).unwrap_err();
        assert!(
            e.to_string()
                .contains("unsupported content part type `image_url`")
        );
    }

    #[test]
    fn exactly_the_message_bound_is_accepted_and_kept_within_it() {
        let body = msgs(MAX_MESSAGES);
        let m = read(&body).unwrap();
        assert_eq!(m.0.len(), MAX_MESSAGES);
        // Grown by doubling to a power of two that is the bound itself: not one slot past it.
        assert!(m.0.capacity() <= MAX_MESSAGES, "{}", m.0.capacity());
    }

    #[test]
    fn one_message_over_the_bound_fails_naming_it() {
        let e = read(&msgs(MAX_MESSAGES + 1)).unwrap_err();
        assert!(e.to_string().contains("at most 65536 messages"), "{e}");
        // Many over: the same error, reached after the bound (the rest is never read).
        let e = read(&msgs(3 * MAX_MESSAGES)).unwrap_err();
        assert!(e.to_string().contains("at most 65536 messages"), "{e}");
    }

    /// One element of a probed sequence: records whether the reader read it (as a message
    /// object) or skipped it unread (`IgnoredAny`, which allocates nothing).
    struct Probe<'a> {
        read: &'a Cell<usize>,
        skipped: &'a Cell<usize>,
    }

    impl<'de> Deserializer<'de> for Probe<'_> {
        type Error = de::value::Error;

        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(de::Error::custom("probe: unexpected read"))
        }

        fn deserialize_map<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
            self.read.set(self.read.get() + 1);
            let fields = [("role", "user")].into_iter();
            v.visit_map(de::value::MapDeserializer::new(fields))
        }

        fn deserialize_ignored_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
            self.skipped.set(self.skipped.get() + 1);
            v.visit_unit()
        }

        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct struct
            enum identifier
        }
    }

    impl<'de, 'a> de::IntoDeserializer<'de, de::value::Error> for Probe<'a> {
        type Deserializer = Self;
        fn into_deserializer(self) -> Self {
            self
        }
    }

    /// `n` probed messages through the reader: (result, read, skipped).
    fn probe(n: usize) -> (Result<Messages<'static>, de::value::Error>, usize, usize) {
        let (read, skipped) = (Cell::new(0), Cell::new(0));
        let items = (0..n).map(|_| Probe {
            read: &read,
            skipped: &skipped,
        });
        let r = Messages::deserialize(de::value::SeqDeserializer::new(items));
        (r, read.get(), skipped.get())
    }

    #[test]
    fn at_the_bound_every_message_is_read_and_one_over_is_skipped_unread() {
        let (r, read, skipped) = probe(MAX_MESSAGES);
        assert_eq!(
            (r.unwrap().0.len(), read, skipped),
            (MAX_MESSAGES, MAX_MESSAGES, 0)
        );
        // One over: the extra element is skipped without being read, and the request fails.
        let (r, read, skipped) = probe(MAX_MESSAGES + 1);
        assert!(
            r.unwrap_err()
                .to_string()
                .contains("at most 65536 messages")
        );
        assert_eq!((read, skipped), (MAX_MESSAGES, 1));
        // Millions over: reading stops at the first extra element; the rest is never touched.
        let (r, read, skipped) = probe(30 * MAX_MESSAGES);
        assert!(r.is_err());
        assert_eq!((read, skipped), (MAX_MESSAGES, 1));
    }

    #[test]
    fn exactly_the_parts_bound_is_accepted() {
        let body = parts_message(MAX_CONTENT_PARTS);
        let m = read(&body).unwrap();
        assert_eq!(m.0[0].content.len(), 2 * MAX_CONTENT_PARTS - 1);
    }

    #[test]
    fn one_part_over_the_bound_fails_naming_it() {
        let e = read(&parts_message(MAX_CONTENT_PARTS + 1)).unwrap_err();
        assert!(e.to_string().contains("at most 65536 content parts"), "{e}");
        // The bound is per request: parts spread over two messages count together.
        let half = format!(
            r#"{{"role":"user","content":[{}]}}"#,
            vec![r#""a""#; MAX_CONTENT_PARTS / 2 + 1].join(",")
        );
        let e = read(&format!("[{half},{half}]")).unwrap_err();
        assert!(e.to_string().contains("at most 65536 content parts"), "{e}");
    }
}
