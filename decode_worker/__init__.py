"""Decode worker: holds reservations, receives K/V pages, runs continuous-batched decoding."""
