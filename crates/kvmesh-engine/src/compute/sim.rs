//! sim backend (being written).
