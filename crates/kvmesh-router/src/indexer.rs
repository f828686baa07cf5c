//! Feeds the prefix index from engines' KV-event streams (being written).
