//! `kv_transfer_params`: the per-request KV transfer instructions vLLM and llm-d put in request and
//! response bodies (NIXL P/D keys, bi-directional keys, llm-d P2P keys). Unknown keys are kept so a
//! router passes through what it does not understand.

use serde::{Deserialize, Serialize};

/// llm-d P2P: where the consumer engine pulls a missing prefix from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteKvSource {
    pub kv_request_id: String,
    pub remote_host: String,
    pub remote_port: u16,
}

/// llm-d: marks a prefill engine as producer for a named decoder request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteDecoder {
    pub kv_request_id: String,
}

/// llm-d P/D: the decoder's pointer to the prefiller that holds the prompt KV.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemotePrefiller {
    pub kv_request_id: String,
    pub remote_host: String,
    pub remote_port: u16,
}

/// Every key of `kv_transfer_params` kvmesh understands, plus the rest verbatim.
///
/// NIXL P/D keys (`do_remote_*`, `remote_engine_id`, `remote_block_ids`, `remote_host`,
/// `remote_port`, `remote_request_id`, `tp_size`), bi-directional keys (`remote_num_tokens`,
/// `remote_blocks_expiry_time`) and llm-d P2P keys (`remote_kv_source`, `remote_decoder`,
/// `remote_prefiller`). The loosely typed NIXL fields keep an explicit JSON `null` as
/// `Some(Value::Null)`, so params pass through a router byte-for-byte in meaning and shape.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct KvTransferParams {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub do_remote_decode: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub do_remote_prefill: Option<bool>,
    #[serde(
        default,
        deserialize_with = "keep_null",
        skip_serializing_if = "Option::is_none"
    )]
    pub remote_engine_id: Option<serde_json::Value>,
    #[serde(
        default,
        deserialize_with = "keep_null",
        skip_serializing_if = "Option::is_none"
    )]
    pub remote_block_ids: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_request_id: Option<String>,
    #[serde(
        default,
        deserialize_with = "keep_null",
        skip_serializing_if = "Option::is_none"
    )]
    pub remote_host: Option<serde_json::Value>,
    #[serde(
        default,
        deserialize_with = "keep_null",
        skip_serializing_if = "Option::is_none"
    )]
    pub remote_port: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_size: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_num_tokens: Option<u64>,
    /// Unix seconds after which a retained decoder block set may no longer be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_blocks_expiry_time: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_kv_source: Option<RemoteKvSource>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_decoder: Option<RemoteDecoder>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_prefiller: Option<RemotePrefiller>,
    /// kvmesh: the router's predicted time (ms) for the pull `remote_kv_source` names, link
    /// sharing included. The engine derives the pull's deadline from it (a multiple, between a
    /// floor and its flat budget), so a stalling source costs about the prediction, not the flat
    /// timeout. Untrusted like every key here: the engine clamps it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvmesh_predicted_pull_ms: Option<f64>,
    /// Keys kvmesh does not interpret, passed through unchanged.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// Deserializes a present field as `Some(value)` even when the value is `null` (serde's default
/// would turn `null` into `None` and the key would vanish on re-serialization).
fn keep_null<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<serde_json::Value>, D::Error> {
    serde_json::Value::deserialize(d).map(Some)
}

/// An illegal combination of llm-d keys.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("kv_transfer_params: {0}")]
pub struct TransferParamsError(String);

impl KvTransferParams {
    /// The exact `kv_transfer_params` of a P/D prefill leg
    /// (`docs/protocols.md#pd-and-bi-directional-transfer`): ask the prefill engine
    /// to keep the KV for a remote decoder, with the remote fields explicitly `null`.
    pub fn prefill_leg() -> Self {
        KvTransferParams {
            do_remote_decode: Some(true),
            do_remote_prefill: Some(false),
            remote_engine_id: Some(serde_json::Value::Null),
            remote_block_ids: Some(serde_json::Value::Null),
            remote_host: Some(serde_json::Value::Null),
            remote_port: Some(serde_json::Value::Null),
            ..Default::default()
        }
    }

    /// llm-d P2P consumer params: pull the prefix from `host:port` under `kv_request_id`.
    pub fn pull_from(kv_request_id: impl Into<String>, host: impl Into<String>, port: u16) -> Self {
        KvTransferParams {
            remote_kv_source: Some(RemoteKvSource {
                kv_request_id: kv_request_id.into(),
                remote_host: host.into(),
                remote_port: port,
            }),
            ..Default::default()
        }
    }

    /// Whether no key at all is set.
    pub fn is_empty(&self) -> bool {
        *self == KvTransferParams::default()
    }

    /// `remote_host` when it is a string (NIXL sends a string; `null` or absent gives `None`).
    pub fn remote_host_str(&self) -> Option<&str> {
        self.remote_host.as_ref().and_then(|v| v.as_str())
    }

    /// `remote_port` when it is an integer in port range.
    pub fn remote_port_u16(&self) -> Option<u16> {
        self.remote_port
            .as_ref()
            .and_then(|v| v.as_u64())
            .and_then(|p| u16::try_from(p).ok())
    }

    /// Checks llm-d's rule: at most one of `remote_kv_source`, `remote_decoder`,
    /// `remote_prefiller`, except the pair `remote_decoder` + `remote_kv_source`.
    pub fn validate_llmd_keys(&self) -> Result<(), TransferParamsError> {
        let set = [
            ("remote_kv_source", self.remote_kv_source.is_some()),
            ("remote_decoder", self.remote_decoder.is_some()),
            ("remote_prefiller", self.remote_prefiller.is_some()),
        ];
        let present: Vec<&str> = set.iter().filter(|(_, on)| *on).map(|(k, _)| *k).collect();
        match present.as_slice() {
            [] | [_] | ["remote_kv_source", "remote_decoder"] => Ok(()),
            more => Err(TransferParamsError(format!(
                "keys {} cannot be combined (only remote_decoder + remote_kv_source may)",
                more.join(" + ")
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn round_trip(v: serde_json::Value) -> (KvTransferParams, serde_json::Value) {
        let p: KvTransferParams = serde_json::from_value(v).unwrap();
        let back = serde_json::to_value(&p).unwrap();
        (p, back)
    }

    #[test]
    fn prefill_leg_is_exactly_the_nixl_prefill_request() {
        let v = serde_json::to_value(KvTransferParams::prefill_leg()).unwrap();
        assert_eq!(
            v,
            json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                   "remote_block_ids": null, "remote_host": null, "remote_port": null})
        );
        let (p, back) = round_trip(v.clone());
        assert_eq!(p, KvTransferParams::prefill_leg());
        assert_eq!(back, v, "explicit nulls survive a pass-through");
    }

    #[test]
    fn nixl_prefill_response_passes_through_verbatim() {
        let v = json!({
            "do_remote_prefill": true, "do_remote_decode": false,
            "remote_block_ids": [1, 2, 3], "remote_engine_id": "e-7f3",
            "remote_request_id": "cmpl-1", "remote_host": "10.0.0.5", "remote_port": 5600,
            "tp_size": 1, "remote_num_tokens": 96, "remote_blocks_expiry_time": 1764452000.25
        });
        let (p, back) = round_trip(v.clone());
        assert_eq!(back, v);
        assert_eq!(p.remote_host_str(), Some("10.0.0.5"));
        assert_eq!(p.remote_port_u16(), Some(5600));
        assert_eq!(p.tp_size, Some(1));
        assert!(p.extra.is_empty(), "every NIXL key is typed");
    }

    #[test]
    fn bidirectional_decode_response_keys_are_typed() {
        let v = json!({"do_remote_decode": true, "remote_block_ids": [[4, 5]],
                       "remote_num_tokens": 130, "remote_blocks_expiry_time": 1.5e9});
        let (p, back) = round_trip(v.clone());
        assert_eq!(back, v);
        assert_eq!(p.do_remote_decode, Some(true));
        assert_eq!(p.remote_num_tokens, Some(130));
        assert_eq!(p.remote_blocks_expiry_time, Some(1.5e9));
    }

    #[test]
    fn llmd_keys_round_trip_and_unknown_keys_are_preserved() {
        let v = json!({
            "remote_kv_source": {"kv_request_id": "u-1", "remote_host": "10.1.2.3", "remote_port": 7777},
            "remote_decoder": {"kv_request_id": "u-1"},
            "vendor_x": {"nested": [1, null, "a"]}, "flag": false
        });
        let (p, back) = round_trip(v.clone());
        assert_eq!(back, v);
        assert_eq!(
            p.remote_kv_source,
            Some(RemoteKvSource {
                kv_request_id: "u-1".into(),
                remote_host: "10.1.2.3".into(),
                remote_port: 7777
            })
        );
        assert_eq!(p.extra.len(), 2);
        assert!(
            p.validate_llmd_keys().is_ok(),
            "decoder + kv_source is the legal pair"
        );

        let v = json!({"remote_prefiller": {"kv_request_id": "r", "remote_host": "h", "remote_port": 1}});
        let (p, back) = round_trip(v.clone());
        assert_eq!(back, v);
        assert!(p.validate_llmd_keys().is_ok());
    }

    #[test]
    fn illegal_llmd_combinations_are_named() {
        let mut p = KvTransferParams::pull_from("r", "h", 7777);
        p.remote_prefiller = Some(RemotePrefiller {
            kv_request_id: "r".into(),
            remote_host: "h".into(),
            remote_port: 1,
        });
        let e = p.validate_llmd_keys().unwrap_err().to_string();
        assert!(e.contains("remote_kv_source + remote_prefiller"), "{e}");
    }

    #[test]
    fn empty_params_serialize_to_an_empty_object() {
        assert!(KvTransferParams::default().is_empty());
        assert_eq!(
            serde_json::to_value(KvTransferParams::default()).unwrap(),
            json!({})
        );
        assert!(!KvTransferParams::pull_from("a", "b", 1).is_empty());
    }
}
