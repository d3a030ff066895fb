"""Counters of the simulated KV transfers, read by /metrics and /server_info (so a test or an operator
can see that the bytes really crossed between the two engines)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PdStats:
    bytes_sent: int = 0  # KV bytes this prefill engine wrote to decode engines
    bytes_received: int = 0  # KV bytes this decode engine read from prefill engines
    transfers_sent: int = 0  # complete KV transfers, prefill side
    transfers_received: int = 0  # complete KV transfers, decode side
    bootstrap_failed: int = 0  # requests failed before their KV started to move (SGLang's counter)
    transfer_failed: int = 0  # requests failed while waiting for / moving their KV
    failures: dict[tuple[str, str], int] = field(default_factory=dict)  # (side, kind) -> rooms failed

    def failed(self, side: str, kind: str) -> None:
        """One room failed: on the prefill side when its room ends failed, on the decode side when a
        decode request could not get its KV."""
        self.failures[(side, kind)] = self.failures.get((side, kind), 0) + 1

    @property
    def rooms_failed(self) -> int:
        return sum(self.failures.values())

    def as_dict(self) -> dict:
        return {
            "kv_bytes_sent": self.bytes_sent,
            "kv_bytes_received": self.bytes_received,
            "kv_transfers_sent": self.transfers_sent,
            "kv_transfers_received": self.transfers_received,
            "rooms_failed": self.rooms_failed,
            "bootstrap_failed": self.bootstrap_failed,
            "transfer_failed": self.transfer_failed,
            "failures": [{"side": side, "kind": kind, "count": n} for (side, kind), n in sorted(self.failures.items())],
        }
