//! Real Llama-family transformer on CPU (candle) with paged KV blocks.
