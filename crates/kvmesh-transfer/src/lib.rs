//! kvmesh P2P KV transfer protocol: framing, producer server, consumer client.
