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

Modules: pure core ``state`` (fleet per model), ``leases``, ``policy`` (interface),
``policy_round_robin``, ``policy_least_loaded``, ``policies`` (registry by name), ``core``
(decisions); adapters ``service`` (NATS), ``metrics``, ``settings``, ``main``.
"""
