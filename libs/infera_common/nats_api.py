"""The OpenAI API on NATS request/reply: the wire contract between the frontend and NATS clients.

Subjects (``infera_common.subjects``), served by every frontend in queue group ``FRONTEND_QUEUE``
so several frontends share the load:

- ``API_CHAT_COMPLETIONS`` (``infera.api.v1.chat.completions``) and ``API_COMPLETIONS``
  (``infera.api.v1.completions``): request data = the OpenAI JSON body, exactly as it would be
  POSTed; optional NATS header ``X-Request-Id`` (echoed; generated when absent).
- ``API_MODELS`` / ``API_WORKERS``: empty request; the reply is the JSON of ``GET /v1/models`` /
  ``GET /v1/workers``.

Replies (every reply carries ``X-Request-Id`` on completion subjects):

- not streaming (no ``"stream": true``): ONE message, data = the JSON response body, header
  ``Infera-Status: <HTTP status>``. A status >= 400 means the data is an OpenAI error body
  ``{"error": {"message", "type", "param", "code"}}`` (and ``Infera-Kind: error`` is set).
- streaming (``"stream": true``): SEVERAL messages to the request's reply subject: each SSE event's
  JSON payload with header ``Infera-Kind: data`` (no ``data: `` framing, no ``[DONE]``), then a
  final empty message with ``Infera-Kind: end``. A failure, before or during the stream, is a
  final message with ``Infera-Kind: error``, ``Infera-Status: <status>`` and an OpenAI error body.

A streaming client therefore subscribes to its own inbox, publishes the request with that inbox
as reply subject, and reads until ``end`` or ``error``. ``infera.client.InferaClient`` does this.

A client that bounds its wait (any client: a NATS request has no connection whose loss the frontend
would see) may ask with the request header ``Infera-Alive-Every: <seconds>`` (``ALIVE_EVERY_MIN`` to
``ALIVE_EVERY_MAX``) for an empty message with ``Infera-Kind: alive`` that often while the frontend
works on the request (none after the last message), so that its own timeout measures the
frontend's silence, not the engine's pace (a long non-streaming answer, a first token behind a long
queue). Such a client reads its inbox as a streaming one does, skipping ``alive`` messages. Each is
sent as a NATS request: a client may answer it (an empty message to its reply subject); when no one
is subscribed to the reply subject any more, NATS answers "no responders" and the frontend cancels
the request, as it does for an HTTP client that disconnects.
"""

from __future__ import annotations

HEADER_STATUS = "Infera-Status"
HEADER_KIND = "Infera-Kind"
HEADER_REQUEST_ID = "X-Request-Id"

KIND_DATA = "data"
KIND_END = "end"
KIND_ERROR = "error"
KIND_ALIVE = "alive"

#: the request header asking for ``alive`` messages, and the seconds it may say
HEADER_ALIVE_EVERY = "Infera-Alive-Every"
ALIVE_EVERY_MIN = 0.1
ALIVE_EVERY_MAX = 3600.0
