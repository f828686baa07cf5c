//! The router's precise prefix index: which endpoint holds which block in which tier (no I/O).
