//! Request fields read the way vLLM's pydantic models read them in lax mode: an integer field
//! takes `16`, `16.0`, `"16"` or `true`; a float field takes numbers, numeric strings and
//! booleans; a boolean field takes `true`, `0`/`1` and words like `"yes"`/`"off"`. Clients
//! written against vLLM send these, so refusing them would be a compatibility bug. Used with
//! `#[serde(deserialize_with = ...)]` by the engine, and value by value by the router, so both
//! servers accept exactly the same inputs; a wrong value's error names what was expected.

use std::fmt;

use serde::de::{Deserialize, Deserializer, Error, MapAccess, SeqAccess, Unexpected, Visitor};
use serde_json::Value;

/// A JSON scalar (null, boolean, number, string). A list or an object is refused as soon as it
/// starts, unread: these fields hold one value, and reading a 64 MiB list into a `Value` tree
/// first would cost ~30x its size.
struct Scalar(Value);

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ScalarVisitor)
    }
}

struct ScalarVisitor;

impl<'de> Visitor<'de> for ScalarVisitor {
    type Value = Scalar;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a single value (a number, a boolean or a string)")
    }
    fn visit_bool<E: Error>(self, v: bool) -> Result<Scalar, E> {
        Ok(Scalar(Value::Bool(v)))
    }
    fn visit_i64<E: Error>(self, v: i64) -> Result<Scalar, E> {
        Ok(Scalar(Value::from(v)))
    }
    fn visit_u64<E: Error>(self, v: u64) -> Result<Scalar, E> {
        Ok(Scalar(Value::from(v)))
    }
    fn visit_f64<E: Error>(self, v: f64) -> Result<Scalar, E> {
        Ok(Scalar(Value::from(v)))
    }
    fn visit_str<E: Error>(self, v: &str) -> Result<Scalar, E> {
        Ok(Scalar(Value::from(v)))
    }
    fn visit_string<E: Error>(self, v: String) -> Result<Scalar, E> {
        Ok(Scalar(Value::String(v)))
    }
    fn visit_unit<E: Error>(self) -> Result<Scalar, E> {
        Ok(Scalar(Value::Null))
    }
    fn visit_none<E: Error>(self) -> Result<Scalar, E> {
        Ok(Scalar(Value::Null))
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Scalar, D::Error> {
        d.deserialize_any(self)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<Scalar, A::Error> {
        Err(A::Error::invalid_type(Unexpected::Seq, &self))
    }
    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<Scalar, A::Error> {
        Err(A::Error::invalid_type(Unexpected::Map, &self))
    }
}

/// One scalar field as a `Value` (absent or null is `None`); a list or object is refused unread.
pub fn opt_scalar<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Ok(Option::<Scalar>::deserialize(d)?
        .map(|s| s.0)
        .filter(|v| !v.is_null()))
}

/// `Option<i64>`: absent or null is `None`.
pub fn opt_int<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
    match opt_scalar(d)? {
        None => Ok(None),
        Some(v) => int(&v)
            .map(|n| Some(n.clamp(i64::MIN.into(), i64::MAX.into()) as i64))
            .ok_or_else(|| D::Error::custom(format!("Input should be a valid integer, got {v}"))),
    }
}

/// `Option<f64>`: absent or null is `None`.
pub fn opt_float<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    match opt_scalar(d)? {
        None => Ok(None),
        Some(v) => float(&v)
            .map(Some)
            .ok_or_else(|| D::Error::custom(format!("Input should be a valid number, got {v}"))),
    }
}

/// `bool` with null read as `false` (vLLM's `bool | None = False` fields).
pub fn bool_or_false<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    opt_bool(d).map(|b| b.unwrap_or(false))
}

/// `bool` with null read as `true` (`add_generation_prompt`).
pub fn bool_or_true<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    opt_bool(d).map(|b| b.unwrap_or(true))
}

fn opt_bool<'de, D: Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
    match opt_scalar(d)? {
        None => Ok(None),
        Some(v) => boolean(&v)
            .map(Some)
            .ok_or_else(|| D::Error::custom(format!("Input should be a valid boolean, got {v}"))),
    }
}

/// A JSON integer, a float without fraction, a boolean, or a string holding an integer
/// (surrounding spaces, a sign, `_` between digits and a `.000` tail allowed, as in pydantic).
pub fn int(v: &Value) -> Option<i128> {
    match v {
        Value::Bool(b) => Some(i128::from(*b)),
        Value::Number(n) => n
            .as_i64()
            .map(i128::from)
            .or_else(|| n.as_u64().map(i128::from))
            .or_else(|| {
                n.as_f64()
                    .filter(|f| f.fract() == 0.0 && f.abs() < 9.2e18)
                    .map(|f| f as i128)
            }),
        Value::String(s) => int_from_str(s),
        _ => None,
    }
}

fn int_from_str(s: &str) -> Option<i128> {
    let s = s.trim();
    let (neg, digits) = match s.as_bytes().first()? {
        b'-' => (true, &s[1..]),
        b'+' => (false, &s[1..]),
        _ => (false, s),
    };
    let (whole, frac) = digits.split_once('.').unwrap_or((digits, ""));
    if !frac.bytes().all(|b| b == b'0') || !digit_groups(whole) {
        return None;
    }
    let n: i128 = whole.replace('_', "").parse().ok()?;
    Some(if neg { -n } else { n })
}

/// Digits with single underscores between them, as Python's `int()` takes.
fn digit_groups(s: &str) -> bool {
    let b = s.as_bytes();
    b.first().is_some_and(u8::is_ascii_digit)
        && b.last().is_some_and(u8::is_ascii_digit)
        && b.iter().all(|c| c.is_ascii_digit() || *c == b'_')
        && !s.contains("__")
}

/// A JSON number, a boolean, or a string holding a float (`"0.7"`, `" .5 "`, `"1e-1"`).
pub fn float(v: &Value) -> Option<f64> {
    match v {
        Value::Bool(b) => Some(f64::from(u8::from(*b))),
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().replace('_', "").parse().ok(),
        _ => None,
    }
}

/// `true`/`false`, `0`/`1`, or pydantic's words for them, in any case.
pub fn boolean(v: &Value) -> Option<bool> {
    match v {
        Value::Bool(b) => Some(*b),
        Value::Number(n) => match n.as_f64() {
            Some(0.0) => Some(false),
            Some(1.0) => Some(true),
            _ => None,
        },
        Value::String(s) => match s.to_ascii_lowercase().as_str() {
            "0" | "off" | "f" | "false" | "n" | "no" => Some(false),
            "1" | "on" | "t" | "true" | "y" | "yes" => Some(true),
            _ => None,
        },
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The cases checked against pydantic 2 (`int`, `float`, `bool` fields, lax mode).
    #[test]
    fn reads_what_pydantic_reads() {
        for (v, want) in [
            (json!("16"), Some(16)),
            (json!(16.0), Some(16)),
            (json!(" 1_6.00 "), Some(16)),
            (json!("+16"), Some(16)),
            (json!(true), Some(1)),
            (json!("-1"), Some(-1)),
            (json!(16.5), None),
            (json!("16.5"), None),
            (json!("1e1"), None),
            (json!("1__6"), None),
            (json!("0x10"), None),
            (json!(""), None),
            (json!([1]), None),
        ] {
            assert_eq!(int(&v), want, "{v}");
        }
        for (v, want) in [
            (json!("0.7"), Some(0.7)),
            (json!(" .5 "), Some(0.5)),
            (json!("1_0.5"), Some(10.5)),
            (json!(true), Some(1.0)),
            (json!("x"), None),
        ] {
            assert_eq!(float(&v), want, "{v}");
        }
        for (v, want) in [
            (json!("yes"), Some(true)),
            (json!("Y"), Some(true)),
            (json!("off"), Some(false)),
            (json!(0), Some(false)),
            (json!(1.0), Some(true)),
            (json!(2), None),
            (json!(" true "), None),
            (json!(0.5), None),
        ] {
            assert_eq!(boolean(&v), want, "{v}");
        }
    }
}
