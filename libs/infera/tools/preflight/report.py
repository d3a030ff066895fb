"""Each host's findings as JSON in the dump directory, and the fleet's report: the hosts' files
combined, values that differ across hosts flagged (``consistency``), rendered as one HTML page."""

from __future__ import annotations

import html
import json
from collections import Counter
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from infera.tools.preflight.finding import Finding, worst

#: values that should be the same on every host: (section, details key, what it is)
SAME_EVERYWHERE = (
    ("gpu", "gpu_count", "GPU count"),
    ("gpu", "gfx", "GPU gfx target"),
    ("gpu", "driver", "amdgpu driver"),
    ("firmware", "mec", "MEC firmware"),
)

Sections = dict[str, list[Finding]]


def write_host(dump: Path, host: str, image: str, sections: Sections) -> Path:
    dump.mkdir(parents=True, exist_ok=True)
    path = dump / f"{host}.json"
    record = {"host": host, "image": image, "generated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "sections": {name: [asdict(f) for f in found] for name, found in sections.items()}}
    path.write_text(json.dumps(record, indent=1))
    return path


def load_hosts(dump: Path) -> list[dict[str, Any]]:
    hosts = []
    for path in sorted(dump.glob("*.json")):
        try:
            record = json.loads(path.read_text())
            record["sections"] = {k: [Finding(**f) for f in v] for k, v in record["sections"].items()}
        except (ValueError, KeyError, TypeError) as exc:
            record = {"host": path.stem, "image": "?", "generated": "?",
                      "sections": {"report": [Finding("fail", f"unreadable {path.name}: {exc}")]}}
        hosts.append(record)
    return hosts


def consistency(hosts: list[dict[str, Any]]) -> None:
    """Add a warning to each host whose value of a ``SAME_EVERYWHERE`` detail is not the fleet's most
    common one (to every host holding a value when no value is the most common)."""
    for section, key, what in SAME_EVERYWHERE:
        values = {h["host"]: f.details[key] for h in hosts for f in h["sections"].get(section, []) if key in f.details}
        counts = Counter(values.values())
        if len(counts) < 2:
            continue
        top = counts.most_common(1)[0][1]
        tied = list(counts.values()).count(top) > 1
        for h in hosts:
            value = values.get(h["host"])
            if value is not None and (tied or counts[value] < top):
                h["sections"][section].append(Finding("warn", f"{what} {value} differs across the fleet",
                                                      {"fleet": {str(k): v for k, v in counts.items()}}))


def render(hosts: list[dict[str, Any]]) -> str:
    names = sorted({name for h in hosts for name in h["sections"]}, key=lambda n: _order(hosts, n))
    esc = html.escape
    rows = []
    for h in hosts:
        levels = {n: worst(found) for n, found in h["sections"].items()}
        cells = "".join(f'<td class="{levels[n]}">{levels[n]}</td>' if n in levels else "<td></td>" for n in names)
        rows.append(f"<tr><th>{esc(h['host'])}</th><td>{esc(str(h.get('image')))}</td>{cells}</tr>")
    detail = []
    for h in hosts:
        detail.append(f"<h2>{esc(h['host'])} <small>{esc(str(h.get('generated')))}</small></h2><ul>")
        for name, found in h["sections"].items():
            for f in found:
                detail.append(f'<li class="{f.level}"><b>{esc(name)}</b> {esc(f.level)}: {esc(f.message)}</li>')
        detail.append("</ul>")
    head = "".join(f"<th>{esc(n)}</th>" for n in names)
    return ("<!doctype html><meta charset=utf-8><title>Infera preflight</title><style>"
            "td.fail,li.fail{color:#b00}td.warn,li.warn{color:#a60}td.info{color:#070}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px}</style>"
            f"<h1>Infera preflight: {len(hosts)} host(s)</h1><table><tr><th>host</th><th>image</th>{head}</tr>"
            + "".join(rows) + "</table>" + "".join(detail))


def _order(hosts: list[dict[str, Any]], name: str) -> int:
    for h in hosts:
        if name in h["sections"]:
            return list(h["sections"]).index(name)
    return 0
