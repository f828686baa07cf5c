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
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct KvTransferParams {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub do_remote_decode: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub do_remote_prefill: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_engine_id: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_block_ids: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_request_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_host: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
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
    /// Keys kvmesh does not interpret, passed through unchanged.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}
