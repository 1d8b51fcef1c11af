"""Prefill worker: runs prompts, samples the first token, ships K/V to a decode worker."""
