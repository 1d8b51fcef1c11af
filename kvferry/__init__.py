"""kvferry: disaggregated prefill/decode LLM serving.

Shared package: model definition and loading, config types, the paged K/V pool, the K/V page
wire format, transports and the command line. Generated protobuf stubs live in `kvferry.v1`.
"""

__version__ = "0.1.0"
