//! Why the engine's P2P consumer or producer could not be built from its config.

use kvmesh_transfer::{AllowListError, BindError, IpNetError};

/// Why the P2P consumer or producer could not be built from the engine's config.
#[derive(Debug, thiserror::Error)]
pub enum P2pConfigError {
    #[error("--p2p-allowed-peers: {0}")]
    AllowList(#[from] AllowListError),
    #[error("--p2p-allowed-consumers: {0}")]
    AllowedConsumers(#[from] IpNetError),
    #[error("p2p producer: {0}")]
    Unprotected(BindError),
    #[error("cannot listen on {addr} (p2p): {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
}
