"""K/V eviction in the decode step (StreamingLLM, H2O): decode_worker/evict/plugin.py."""
