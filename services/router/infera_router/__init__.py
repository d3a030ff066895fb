"""Infera router: keeps the live fleet from discovery and hands each request to a worker.

Behaviour (NATS plane, see docs/architecture.md for the contract):

- ``infera.router.route`` (queue group ``infera-router``): msgpack ``RouteRequest`` in, msgpack
  ``RouteReply`` out. 200 = the ``WorkEnvelope`` is stored on the worker's stream (reply carries
  worker_id, lease_id, router_id); 400 undecodable request; 404 no worker serves the model;
  503 no active worker (or all excluded, or none has a request queue, or JetStream did not
  acknowledge in time - then the request is not retried on another worker, as it may be stored);
  429 every candidate's stream is at its pending limit; 500 unexpected router failure.
  Candidates are the model's ``active`` workers minus ``exclude``, tried in policy order.
- Leases: taken before publishing, dropped by the agent's ``Release`` on
  ``infera.router.release.<router_id>``, by a refused publish, by the worker leaving discovery,
  or after ``--lease-max-age`` seconds (counted: a lost release).
- Load reports (``infera.load.*``): the latest per known worker, forgotten when it leaves.
- Policy ``kv-aware`` (default): asks the kv-indexer (``infera.kv.query``, ``--kv-query-timeout``)
  for each candidate's cached prefix depth and picks the lowest
  ``--kv-overlap-weight`` x uncached prefill blocks + load blocks (``policy_kv_aware``); with no
  answer it routes by load and counts ``infera_router_kv_query_failures_total``. A prompt with no
  full block is ranked without asking (``infera_router_kv_queries_skipped_total``); with
  ``--kv-index local`` the router keeps its own copy of the index instead (``kv_local``). The cost
  breakdown of each pick is logged at debug level (``route_pick``).

Modules: pure core ``state`` (fleet per model), ``leases``, ``policy`` (interface),
``policy_round_robin``, ``policy_least_loaded``, ``policy_kv_aware``, ``kv_view`` (the overlap
query and its answer), ``policies`` (registry by name), ``core`` (decisions); adapters ``service``
(NATS), ``kv_client`` (indexer query), ``kv_local`` (the index kept in the router), ``metrics``,
``settings``, ``main``.
"""
