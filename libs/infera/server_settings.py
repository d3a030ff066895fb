"""``python -m infera.server``'s settings: the frontend's, the router's and the kv-indexer's, in one model.

Every flag is declared once, in its service's settings or in ``infera_common.settings``; this class
only joins them (the runbooks' ``--host``, ``--port``, ``--router-tokenizer-path``, ``--router-policy``,
``--session-affinity``, ``--pd-prefill-guard-release``, the plane flags, ...), names its own default
for ``--metrics-port`` (none: /metrics is on ``--port``) and adds the one flag only the server has,
``--router-backend``.
"""

from __future__ import annotations


from typing import ClassVar

from pydantic import Field, field_validator

from infera_frontend.settings import FrontendSettings
from infera_kv_indexer.settings import KvIndexerSettings
from infera_router.settings import RouterSettings

#: The router implementations this build has.
ROUTER_BACKENDS = ("python",)


class ServerSettings(FrontendSettings, RouterSettings, KvIndexerSettings):
    model_config = FrontendSettings.model_config
    # /metrics is served on --port with the frontend's, router's and index's series together; a
    # --metrics-port adds a separate endpoint
    metrics_service: ClassVar[str] = "server"

    router_backend: str = Field(
        "python",
        description="The router implementation. This build's router is the Python one (policies kv-aware, "
        "round-robin, least-loaded); other values are refused.",
    )

    @field_validator("router_backend")
    @classmethod
    def _python_router_only(cls, value: str) -> str:
        if value not in ROUTER_BACKENDS:
            raise ValueError(
                f"this build's router is the Python one: --router-backend {value} is not available; pass "
                "--router-backend python (or leave the flag out)"
            )
        return value

    def needs_nats(self) -> bool:
        """True when a plane goes over NATS: then the services connect to --nats-url; otherwise they talk
        through an in-process bus and no NATS server is needed."""
        return bool(self.nats_uses())
