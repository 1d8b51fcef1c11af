"""The router's OpenAI-compatible HTTP front (`front.py`): request bodies, connections and
streams bounded, the OpenAI schema, replies and errors."""
