"""The KV prefix index, shared by the kv-indexer service and a router that keeps its own copy.

``index`` / ``prefix``: which workers (and DP ranks) hold which chained block hashes, per model (pure);
``ingest``: one message of the KV event stream (or one raw engine batch) applied to it (pure);
``stream``: the JetStream KV event stream replayed from its start, then followed (the only I/O).
"""
