"""Errors a request can end with (shared by the engine core, the DP ranks and the PD sessions)."""

from __future__ import annotations


class RequestError(Exception):
    """A request the engine refuses (HTTP 400 unless `status` says otherwise). `err_type` overrides the
    flavour's error type name in the body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 err_type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.err_type = err_type


class GenerationFailed(RequestError):
    """An accepted generation that failed inside the engine (a failed KV transfer or bootstrap): HTTP 500
    before the response started, an error frame in a stream."""

    def __init__(self, message: str, err_type: str | None = None) -> None:
        super().__init__(message, status=500, err_type=err_type)
