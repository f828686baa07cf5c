//! KV-event transport over ZMQ: publisher with replay, subscriber with gap detection.
