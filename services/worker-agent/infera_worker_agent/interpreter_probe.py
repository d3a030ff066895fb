"""What a Python interpreter has installed, read without running any of the packages' own code.

Run by the agent in its own process, or by the engine's interpreter as ``-c`` source
(``PYTHON -c <this file> MODULE... -- DIST...``, printing one JSON object): that interpreter need
not have Infera, so this file imports nothing but the standard library.

- ``modules``: the ones of the given dotted names that exist. Only the top-level package's spec is
  asked for (which runs none of its code); the rest of the name is looked up on disk under it, so
  asking for ``vllm.entrypoints.openai.api_server`` does not import vLLM (tens of seconds, and
  its import-time warnings).
- ``versions``: the installed version of each given distribution (absent: not installed).
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import sys


def module_exists(name: str) -> bool:
    top, *rest = name.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if not rest:
        return True
    dirs = list(spec.submodule_search_locations or [])
    for part in rest[:-1]:
        dirs = [os.path.join(d, part) for d in dirs if os.path.isdir(os.path.join(d, part))]
    last = rest[-1]
    suffixes = importlib.machinery.all_suffixes()
    return any(os.path.isfile(os.path.join(d, last, "__init__.py"))
               or any(os.path.isfile(os.path.join(d, last + s)) for s in suffixes) for d in dirs)


def installed(dists: list[str]) -> dict[str, str]:
    versions = {}
    for dist in dists:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def probe(modules: list[str], dists: list[str]) -> dict[str, object]:
    return {"modules": [m for m in modules if module_exists(m)], "versions": installed(dists)}


def main(argv: list[str]) -> int:
    cut = argv.index("--") if "--" in argv else len(argv)
    print(json.dumps(probe(argv[:cut], argv[cut + 1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
