"""Infera kv-indexer: a prefix index of the fleet's KV caches, built from the engines' KV events.

Behaviour (NATS plane; see the service README):

- Consumes the JetStream stream ``INFERA_KV_EVENTS`` (``KvRelay`` messages relayed by worker-agents)
  from its start at every start, so a restart rebuilds the in-memory index by replay.
- Index keys are chained block hashes computed from the events' ``token_ids``
  (``infera_common.block_hash``), never the engines' hashes; values are the targets
  ``(worker_id, dp_rank)`` holding the block, per model and block size.
- ``infera.kv.query`` (queue group ``infera-kv-indexer``): msgpack ``OverlapQuery`` in, msgpack
  ``OverlapReply`` out: the matched prefix depth of each target, and the model's workers whose
  events never arrived (``unseen``).

Modules: pure ``prefix`` (one model's bitmask index and prefix matching), ``index`` (targets,
event application, discovery bookkeeping), ``ingest`` (decode + apply one stream message);
adapters ``service`` (NATS), ``metrics``, ``settings``, ``main``.
"""
