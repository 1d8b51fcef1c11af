"""The router's view of its workers: each worker (`worker.py`) with its clients (`client.py`,
`prefill_client.py`, `decode_client.py`) and its prefix-cache mirror, the set of them with
their health and load (`registry.py`), their discovery by DNS, and the leases the router
renews on decode reservations."""
