//! A completions `prompt` read straight from the request body, with bounds, for both servers.
//!
//! Why not a JSON tree: a 64 MiB body holding one list of ~30 million one-digit token ids took
//! ~1 GiB as `serde_json::Value`s (32+ bytes each). Here ids are read as `u32`s into one `Vec`
//! that stops growing at the caller's bound (the engine passes `max_model_len`): the ids past it
//! are counted unread ([`IgnoredAny`] allocates nothing), so the 400 can say how many input
//! tokens there were, as vLLM's context-length error does. vLLM's four forms are read: a string,
//! a list of token ids, a list of strings, a list of token-id lists. Of a batch (a list of
//! strings or of id lists) only the first prompt is read; the others are counted, unread.
//!
//! Also here: [`BoundedVec`], a list that refuses more than `MAX` elements as soon as the next
//! one starts, [`StringOrList`] (`stop`: one string or a bounded list of them), and
//! [`BoundedValue`], a JSON value of at most `MAX` values in all (`kv_transfer_params`).

use std::cell::Cell;
use std::fmt;
use std::marker::PhantomData;

use serde::Deserialize;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

use crate::TokenId;

/// The most `stop` strings and the most `stop_token_ids` one request may carry (vLLM 0.32 has
/// no cap; each stop string is searched for after every token, so far fewer are ever useful).
pub const MAX_STOP: usize = 1024;

/// The first prompt of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    Text(String),
    Ids(Vec<TokenId>),
}

/// A request's `prompt`: its first prompt and how many prompts the request holds (1 unless it
/// is a batch).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptInput {
    pub first: Prompt,
    pub count: usize,
}

/// Why a `prompt` could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptError {
    /// The body is not JSON (not the field's fault).
    Malformed(String),
    /// The body is JSON but not an object.
    NotObject,
    /// The body has no `prompt` (or a null one).
    Missing,
    /// An empty prompt (`[]`, `[[]]`, or `[""]` is not: only lists are checked here).
    Empty,
    /// A token-id list longer than the bound: `tokens` is its full length, counted unread.
    TooLong { tokens: usize, max: usize },
    /// A prompt of the wrong shape or type.
    Invalid(String),
}

/// vLLM's context-length error for a prompt of `tokens` ids (also what the engine's 400 says).
pub fn too_long(max: usize, tokens: usize) -> String {
    format!(
        "This model's maximum context length is {max} tokens. However, your request has {tokens} input tokens. Please reduce the length of the input messages."
    )
}

const BAD_ID: &str = "token ids must be non-negative 32-bit integers";
const BAD_SHAPE: &str =
    "prompt must be a string, a list of token ids, a list of strings, or a list of token-id lists";

/// Reads `prompt` from a request body (an object; other fields are skipped unread), with token-id
/// lists bounded by `max_ids`.
pub fn read_body(body: &[u8], max_ids: usize) -> Result<PromptInput, PromptError> {
    let start = body.iter().find(|b| !b.is_ascii_whitespace());
    if start.is_some_and(|&b| b != b'{') {
        // Any other JSON value, or not JSON: which one, serde_json says.
        return match serde_json::from_slice::<IgnoredAny>(body) {
            Ok(_) => Err(PromptError::NotObject),
            Err(e) => Err(PromptError::Malformed(e.to_string())),
        };
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let r = BodySeed { max_ids }
        .deserialize(&mut de)
        .and_then(|r| de.end().map(|()| r));
    finish(r, max_ids)
}

/// Reads a `prompt` value itself (the JSON text of the field), with the same bounds.
pub fn read_value(json: &str, max_ids: usize) -> Result<PromptInput, PromptError> {
    let mut de = serde_json::Deserializer::from_str(json);
    let r = PromptSeed { max_ids }
        .deserialize(&mut de)
        .map(Some)
        .and_then(|r| de.end().map(|()| r));
    finish(r, max_ids)
}

fn finish(
    r: Result<Option<Read>, serde_json::Error>,
    max: usize,
) -> Result<PromptInput, PromptError> {
    match r {
        Ok(Some(Read::Prompt(p))) => Ok(p),
        Ok(Some(Read::TooLong(tokens))) => Err(PromptError::TooLong { tokens, max }),
        Ok(Some(Read::Empty)) => Err(PromptError::Empty),
        Ok(Some(Read::Null) | None) => Err(PromptError::Missing),
        Err(e) if e.is_data() => Err(PromptError::Invalid(e.to_string())),
        Err(e) => Err(PromptError::Malformed(e.to_string())),
    }
}

/// What one read produced (errors that carry a count are values, not serde errors).
enum Read {
    Prompt(PromptInput),
    TooLong(usize),
    Empty,
    Null,
}

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "lowercase")]
enum Key {
    Prompt,
    #[serde(other)]
    Other,
}

/// The body: an object whose `prompt` is read; `None` if it has none.
struct BodySeed {
    max_ids: usize,
}

impl<'de> DeserializeSeed<'de> for BodySeed {
    type Value = Option<Read>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for BodySeed {
    type Value = Option<Read>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut prompt = None;
        // A repeated key: the last one wins, as in the Python dict vLLM reads.
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Prompt => {
                    prompt = Some(map.next_value_seed(PromptSeed {
                        max_ids: self.max_ids,
                    })?);
                }
                Key::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(prompt)
    }
}

/// The `prompt` value.
struct PromptSeed {
    max_ids: usize,
}

impl<'de> DeserializeSeed<'de> for PromptSeed {
    type Value = Read;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Read, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PromptSeed {
    type Value = Read;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(BAD_SHAPE)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Read, E> {
        Ok(one(Prompt::Text(v.to_owned())))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Read, E> {
        Ok(one(Prompt::Text(v)))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Read, E> {
        Ok(Read::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Read, A::Error> {
        let first = seq.next_element_seed(FirstSeed {
            max_ids: self.max_ids,
        })?;
        match first {
            None => Ok(Read::Empty),
            // A list of token ids: the rest are ids too.
            Some(First::Id(id)) => ids_after(vec![id], &mut seq, self.max_ids),
            // A batch: the first prompt is read, the others counted unread.
            Some(First::Nested(Read::Prompt(p))) => {
                let mut count = 1usize;
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    count += 1;
                }
                Ok(Read::Prompt(PromptInput { count, ..p }))
            }
            Some(First::Nested(other)) => {
                // Too long or empty: the rest of the batch does not matter, but must be consumed.
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(other)
            }
        }
    }
}

fn one(first: Prompt) -> Read {
    Read::Prompt(PromptInput { first, count: 1 })
}

/// Reads the rest of a token-id list after `ids`, stopping at `max` ids: past it the rest are
/// counted unread.
fn ids_after<'de, A: SeqAccess<'de>>(
    mut ids: Vec<TokenId>,
    seq: &mut A,
    max: usize,
) -> Result<Read, A::Error> {
    loop {
        if ids.len() >= max {
            let mut tokens = ids.len();
            while seq.next_element::<IgnoredAny>()?.is_some() {
                tokens += 1;
            }
            return Ok(if tokens > max {
                Read::TooLong(tokens)
            } else {
                one(Prompt::Ids(ids))
            });
        }
        match seq.next_element::<Id>()? {
            Some(Id(id)) => ids.push(id),
            None => return Ok(one(Prompt::Ids(ids))),
        }
    }
}

/// A prompt list's first element: an id (the list is ids), or a whole nested prompt.
enum First {
    Id(TokenId),
    Nested(Read),
}

struct FirstSeed {
    max_ids: usize,
}

impl<'de> DeserializeSeed<'de> for FirstSeed {
    type Value = First;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<First, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for FirstSeed {
    type Value = First;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a token id, a string, or a list of token ids")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<First, E> {
        IdVisitor.visit_u64(v).map(|Id(id)| First::Id(id))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<First, E> {
        IdVisitor.visit_i64(v).map(|Id(id)| First::Id(id))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<First, E> {
        IdVisitor.visit_f64(v).map(|Id(id)| First::Id(id))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<First, E> {
        Ok(First::Nested(one(Prompt::Text(v.to_owned()))))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<First, E> {
        Ok(First::Nested(one(Prompt::Text(v))))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<First, A::Error> {
        match seq.next_element::<Id>()? {
            None => Ok(First::Nested(Read::Empty)),
            Some(Id(id)) => ids_after(vec![id], &mut seq, self.max_ids).map(First::Nested),
        }
    }
}

/// One token id: a non-negative integer that fits a [`TokenId`].
struct Id(TokenId);

impl<'de> Deserialize<'de> for Id {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(IdVisitor)
    }
}

struct IdVisitor;

impl Visitor<'_> for IdVisitor {
    type Value = Id;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(BAD_ID)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Id, E> {
        TokenId::try_from(v).map(Id).map_err(|_| E::custom(BAD_ID))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Id, E> {
        u64::try_from(v)
            .map_err(|_| E::custom(BAD_ID))
            .and_then(|v| self.visit_u64(v))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Id, E> {
        Err(E::custom(BAD_ID))
    }
}

/// A list of at most `MAX` elements: one more is an error as soon as it starts (skipped unread),
/// and the list never grows past `MAX`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoundedVec<T, const MAX: usize>(pub Vec<T>);

impl<T, const MAX: usize> Default for BoundedVec<T, MAX> {
    fn default() -> Self {
        Self(Vec::new())
    }
}

/// The error text for one element too many.
pub fn too_many(max: usize) -> String {
    format!("too many items: at most {max} per request")
}

impl<'de, T: Deserialize<'de>, const MAX: usize> Deserialize<'de> for BoundedVec<T, MAX> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_seq(BoundedVisitor::<T, MAX>(PhantomData))
    }
}

struct BoundedVisitor<T, const MAX: usize>(PhantomData<T>);

impl<'de, T: Deserialize<'de>, const MAX: usize> Visitor<'de> for BoundedVisitor<T, MAX> {
    type Value = BoundedVec<T, MAX>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "a list of at most {MAX} items")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        // No `with_capacity` from the size hint: it is the client's claim, not a bound.
        let mut out = Vec::new();
        loop {
            if out.len() == MAX {
                return match seq.next_element::<IgnoredAny>()? {
                    Some(_) => Err(de::Error::custom(too_many(MAX))),
                    None => Ok(BoundedVec(out)),
                };
            }
            match seq.next_element()? {
                Some(x) => out.push(x),
                None => return Ok(BoundedVec(out)),
            }
        }
    }
}

/// One string or a list of at most `MAX` of them (vLLM's `stop: str | list[str]`), read without
/// buffering (serde's untagged enums copy the value into a tree first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StringOrList<const MAX: usize> {
    One(String),
    Many(Vec<String>),
}

impl<const MAX: usize> StringOrList<MAX> {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Self::One(s) => vec![s],
            Self::Many(v) => v,
        }
    }
}

impl<'de, const MAX: usize> Deserialize<'de> for StringOrList<MAX> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StringOrListVisitor::<MAX>)
    }
}

struct StringOrListVisitor<const MAX: usize>;

impl<'de, const MAX: usize> Visitor<'de> for StringOrListVisitor<MAX> {
    type Value = StringOrList<MAX>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "a string or a list of at most {MAX} strings")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(StringOrList::One(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(StringOrList::One(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        BoundedVisitor::<String, MAX>(PhantomData)
            .visit_seq(seq)
            .map(|v| StringOrList::Many(v.0))
    }
}

/// The most JSON values a `kv_transfer_params` may hold, counted over its whole tree: 262,144
/// (a `remote_block_ids` list for a 4M-token prompt at block size 16), ~10-20 MiB as a tree.
pub const MAX_TRANSFER_VALUES: usize = 262_144;

/// The error text for one JSON value too many.
pub fn too_many_values(max: usize) -> String {
    format!("too many JSON values: at most {max} per field")
}

/// A JSON value of at most `MAX` values in all (every scalar, list and object counts one), built
/// as a [`Value`] tree that stops growing at the bound: one more is an error.
#[derive(Debug, Clone, PartialEq)]
pub struct BoundedValue<const MAX: usize>(pub Value);

impl<'de, const MAX: usize> Deserialize<'de> for BoundedValue<MAX> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let count = Cell::new(0);
        ValueSeed {
            count: &count,
            max: MAX,
        }
        .deserialize(d)
        .map(BoundedValue)
    }
}

#[derive(Clone, Copy)]
struct ValueSeed<'a> {
    count: &'a Cell<usize>,
    max: usize,
}

impl ValueSeed<'_> {
    fn one<E: de::Error>(self, v: Value) -> Result<Value, E> {
        if self.count.get() >= self.max {
            return Err(E::custom(too_many_values(self.max)));
        }
        self.count.set(self.count.get() + 1);
        Ok(v)
    }
}

impl<'de> DeserializeSeed<'de> for ValueSeed<'_> {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ValueSeed<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        self.one(Value::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        self.one(Value::from(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        self.one(Value::from(v))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        self.one(Value::from(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        self.one(Value::String(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        self.one(Value::String(v))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        self.one(Value::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        self.one(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        self.one::<A::Error>(Value::Null)?;
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(self)? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        self.one::<A::Error>(Value::Null)?;
        let mut out = Map::new();
        while let Some(k) = map.next_key::<String>()? {
            let v = map.next_value_seed(self)?;
            out.insert(k, v);
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn ids(n: usize) -> String {
        vec!["1"; n].join(",")
    }

    #[test]
    fn vllms_four_forms_are_read() {
        let p = |b: &str| read_body(b.as_bytes(), 100);
        let text = |s: &str, count| {
            Ok(PromptInput {
                first: Prompt::Text(s.into()),
                count,
            })
        };
        let list = |v: Vec<TokenId>, count| {
            Ok(PromptInput {
                first: Prompt::Ids(v),
                count,
            })
        };
        assert_eq!(p(r#"{"x":[{"a":1}],"prompt":"hi"}"#), text("hi", 1));
        assert_eq!(
            p(r#"{"prompt":[1,2,3],"max_tokens":1}"#),
            list(vec![1, 2, 3], 1)
        );
        assert_eq!(p(r#"{"prompt":["a","b",[9]]}"#), text("a", 3));
        assert_eq!(p(r#"{"prompt":[[4,5],[6]]}"#), list(vec![4, 5], 2));
        assert_eq!(read_value("[7,8]", 2), list(vec![7, 8], 1));
    }

    #[test]
    fn bad_prompts_are_named_errors() {
        let p = |b: &str| read_body(b.as_bytes(), 100);
        assert_eq!(p("{}"), Err(PromptError::Missing));
        assert_eq!(p(" [1]"), Err(PromptError::NotObject));
        assert_eq!(p(r#"{"prompt":null}"#), Err(PromptError::Missing));
        assert_eq!(p(r#"{"prompt":[]}"#), Err(PromptError::Empty));
        assert_eq!(p(r#"{"prompt":[[]]}"#), Err(PromptError::Empty));
        for b in [
            r#"{"prompt":5}"#,
            r#"{"prompt":[1,-2]}"#,
            r#"{"prompt":[1,"a"]}"#,
            r#"{"prompt":[1.5]}"#,
            r#"{"prompt":[4294967296]}"#,
            r#"{"prompt":[{"a":1}]}"#,
            r#"{"prompt":[[1,"x"]]}"#,
        ] {
            assert!(
                matches!(p(b), Err(PromptError::Invalid(_))),
                "{b}: {:?}",
                p(b)
            );
        }
        for b in ["not json", r#"{"prompt":"x"} x"#, r#"{"prompt":[1,"#] {
            assert!(matches!(p(b), Err(PromptError::Malformed(_))), "{b}");
        }
    }

    #[test]
    fn a_token_id_list_stops_growing_at_the_bound_and_counts_the_rest() {
        let max = 1000;
        let at = read_body(format!(r#"{{"prompt":[{}]}}"#, ids(max)).as_bytes(), max).unwrap();
        let Prompt::Ids(v) = at.first else {
            panic!("ids")
        };
        assert_eq!(v.len(), max);
        assert!(v.capacity() <= 2 * max);
        for (n, nested) in [(max + 1, false), (50 * max, false), (max + 1, true)] {
            let body = if nested {
                format!(r#"{{"prompt":[[{}],[1]]}}"#, ids(n))
            } else {
                format!(r#"{{"prompt":[{}]}}"#, ids(n))
            };
            assert_eq!(
                read_body(body.as_bytes(), max),
                Err(PromptError::TooLong { tokens: n, max })
            );
        }
        assert!(too_long(4, 5).starts_with("This model's maximum context length is 4 tokens. However, your request has 5 input tokens."));
    }

    #[test]
    fn bounded_values_count_the_whole_tree() {
        type V = BoundedValue<5>;
        let v: V = serde_json::from_str(r#"{"a":[1,2],"b":null}"#).unwrap();
        assert_eq!(v.0, serde_json::json!({"a": [1, 2], "b": null}));
        for over in [r#"{"a":[1,2,3],"b":null}"#, "[[[[[[]]]]]]", "[1,2,3,4,5]"] {
            let e = serde_json::from_str::<V>(over).unwrap_err();
            assert!(e.to_string().contains("at most 5 per field"), "{over}: {e}");
        }
        let big = format!("[{}]", ids(MAX_TRANSFER_VALUES));
        assert!(serde_json::from_str::<BoundedValue<MAX_TRANSFER_VALUES>>(&big).is_err());
    }

    #[test]
    fn bounded_lists_refuse_one_over() {
        type B = BoundedVec<u32, 3>;
        assert_eq!(
            serde_json::from_str::<B>("[1,2,3]").unwrap().0,
            vec![1, 2, 3]
        );
        let e = serde_json::from_str::<B>("[1,2,3,4]").unwrap_err();
        assert!(e.to_string().contains("at most 3 per request"), "{e}");
        type S = StringOrList<2>;
        assert_eq!(
            serde_json::from_str::<S>(r#""a""#).unwrap().into_vec(),
            vec!["a"]
        );
        assert_eq!(
            serde_json::from_str::<S>(r#"["a","b"]"#)
                .unwrap()
                .into_vec(),
            vec!["a", "b"]
        );
        assert!(serde_json::from_str::<S>(r#"["a","b","c"]"#).is_err());
        assert!(serde_json::from_str::<S>("5").is_err());
        let big = format!("[{}]", vec![r#""""#; 3 * MAX_STOP].join(","));
        let e = serde_json::from_str::<StringOrList<MAX_STOP>>(&big).unwrap_err();
        assert!(e.to_string().contains("at most 1024 per request"), "{e}");
    }
}
