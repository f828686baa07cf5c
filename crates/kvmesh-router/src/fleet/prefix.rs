//! The scheduler's view of the prefix index: a small trait so the gateway can be tested with a
//! fake, implemented by `kvmesh_index::PrefixIndex`.

use kvmesh_core::ChainKey;
use kvmesh_index::{EndpointId, EndpointMatch, PrefixIndex};

/// Longest consecutive prefix per endpoint and tier for a request's block keys.
pub trait PrefixLookup: Send + Sync {
    /// Matches for `keys` (endpoints holding nothing may be absent), sorted by endpoint id.
    fn find_matches(&self, keys: &[ChainKey]) -> Vec<EndpointMatch>;
    /// Forgets an endpoint that left the fleet.
    fn remove_endpoint(&self, endpoint: EndpointId);
}

impl PrefixLookup for PrefixIndex {
    fn find_matches(&self, keys: &[ChainKey]) -> Vec<EndpointMatch> {
        PrefixIndex::find_matches(self, keys)
    }

    fn remove_endpoint(&self, endpoint: EndpointId) {
        PrefixIndex::remove_endpoint(self, endpoint)
    }
}

/// The match of `endpoint` in `matches` (sorted by endpoint id), or zeros.
pub fn match_of(matches: &[EndpointMatch], endpoint: EndpointId) -> EndpointMatch {
    matches
        .binary_search_by_key(&endpoint, |m| m.endpoint)
        .map(|i| matches[i])
        .unwrap_or(EndpointMatch {
            endpoint,
            gpu_blocks: 0,
            cpu_blocks: 0,
            any_blocks: 0,
        })
}
