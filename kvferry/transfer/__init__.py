"""K/V transports: how a prefill worker's pages reach a decode worker's pool.

Each transport is one package here holding both of its ends: `send.py`, its `KvSender`
(`kvferry/transfer/sender.py`), run by the prefill worker; `receive.py`, its end on the
decode worker, writing into the decode engine's `KvSink` (`kvferry/transfer/sink.py`). The
package's `__init__.py` exports `make_sender(options)` and `add_receiver(server, sink,
faults)` (`kvferry/transfer/transport.py` says what they take and return).
`kvferry.settings.KV_TRANSPORTS` names every transport (`--kv-transport` offers exactly these):
adding one is a package here and one line there (docs/contributing.md walks through it). What
every transport shares: the chunk layout and checks of `wire.py`.
"""
