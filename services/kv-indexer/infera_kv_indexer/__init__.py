"""Infera kv-indexer: a prefix index of the fleet's KV caches, built from the engines' KV events.

Behaviour (NATS plane; see the service README):

- Consumes the JetStream stream ``INFERA_KV_EVENTS`` (``KvRelay`` messages relayed by worker-agents)
  from its start at every start, so a restart rebuilds the in-memory index by replay
  (``--kv-event-transport nats``).
- Reads the ZMQ publishers (one per DP rank) of every worker registered on ``--kv-event-transport
  zmq`` directly, replaying each from seq 0 when it is first followed and filling sequence gaps
  from its replay socket; on ``--kv-event-transport zmq`` JetStream is not used at all.
- Index keys are chained block hashes computed from the events' ``token_ids``
  (``infera_common.block_hash``), never the engines' hashes; values are the targets
  ``(worker_id, dp_rank)`` holding the block, per model and block size.
- ``infera.kv.query`` (queue group ``infera-kv-indexer``): msgpack ``OverlapQuery`` in, msgpack
  ``OverlapReply`` out: the matched prefix depth of each target, and the model's workers whose
  events never arrived (``unseen``).

Modules: the index (``prefix``, ``index``, ``ingest``) and the stream follower (``stream``) are
``infera_common.kv_index``, shared with a router on ``--kv-index local``; here pure ``query``
and ``zmq_plan`` (a worker record's publishers; what a record change means); adapters ``service``
(lifecycle, discovery, queries), ``zmq_follow`` (ZMQ readers, over ``infera_common.kv_zmq``),
``metrics``, ``settings``, ``main``.
"""
