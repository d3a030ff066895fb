"""Let an SGLang decode run its radix cache with EAGLE/NEXTN top-k 1 speculative decoding, on opt-in.

Stock SGLang refuses ``--disaggregation-decode-enable-radix-cache`` together with any
``--speculative-algorithm`` while it validates its arguments (``ValueError: ... is incompatible with
speculative decoding``): the decode then has no radix tree, no KV events and no HiCache. This
script, run at image build time (``docker/Dockerfile.sglang``, build arg
``APPLY_SGLANG_DECODE_RADIX_SPEC_PATCH=1``), narrows that one refusal: it still applies unless the
worker's environment has ``SGLANG_EXPERIMENTAL_DECODE_RADIX_SPEC=1`` *and* the algorithm is EAGLE
or NEXTN *and* ``--speculative-eagle-topk`` is 1. Every other check (HiSparse, DCP, fake backend,
SWA/SSM models, ...) is untouched; the worker-agent appends the radix flag under the same
conditions (``infera_worker_agent/recipe_cache.py``).

It finds the guard by its shape, not by line numbers: an ``if <args>.speculative_algorithm ...:``
whose ``raise`` names ``enable-radix-cache is incompatible`` and ``speculative decoding`` (the
check lives in ``server_args.py`` in older releases and in ``arg_groups/pd_disaggregation_hook.py``
in newer ones). Idempotent; exits 1, failing the build, when the guard is not found (a base whose
SGLang changed: build with ``APPLY_SGLANG_DECODE_RADIX_SPEC_PATCH=0``, or update this script).

Usage: ``python3 sglang_decode_radix_spec.py [SGLANG_PACKAGE_DIR]`` (default: the installed one).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

HELPER = "_infera_decode_radix_spec_allowed"
OPT_IN_ENV = "SGLANG_EXPERIMENTAL_DECODE_RADIX_SPEC"
_GUARD = re.compile(r"^(?P<indent>\s*)if (?P<cond>.*?\b(?P<obj>[A-Za-z_][\w.]*)\.speculative_algorithm\b.*?):\s*$")
_LOOKAHEAD = 8  # lines after the guard that hold its raise and message

HELPER_SOURCE = f'''

def {HELPER}(args) -> bool:
    """Added by Infera (docker/patches/sglang_decode_radix_spec.py): the decode radix cache may run
    with speculative decoding when {OPT_IN_ENV}=1 and the algorithm is EAGLE/NEXTN with top-k 1."""
    import os

    if os.environ.get("{OPT_IN_ENV}") != "1":
        return False
    algorithm = str(getattr(args, "speculative_algorithm", None) or "").upper()
    return algorithm in ("EAGLE", "NEXTN") and getattr(args, "speculative_eagle_topk", None) == 1
'''


def patch_source(text: str) -> tuple[str, int]:
    """The source with every matching guard narrowed, and how many were; already patched: (text, 0)."""
    if HELPER in text:
        return text, 0
    lines = text.splitlines(keepends=True)
    count = 0
    for i, line in enumerate(lines):
        m = _GUARD.match(line.rstrip("\n"))
        if m is None:
            continue
        window = "".join(lines[i + 1:i + 1 + _LOOKAHEAD])
        if "raise" not in window or "enable-radix-cache is incompatible" not in window \
                or "speculative decoding" not in window:
            continue
        newline = "\n" if line.endswith("\n") else ""
        lines[i] = f"{m['indent']}if ({m['cond']}) and not {HELPER}({m['obj']}):{newline}"
        count += 1
    if not count:
        return text, 0
    return "".join(lines).rstrip("\n") + "\n" + HELPER_SOURCE, count


def sglang_dir() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("sglang is not installed in this interpreter")
    return Path(next(iter(spec.submodule_search_locations)))


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else sglang_dir()
    patched, already = [], []
    for path in sorted((root / "srt").rglob("*.py")):
        text = path.read_text()
        if "speculative_algorithm" not in text or "enable-radix-cache is incompatible" not in text:
            if HELPER in text:
                already.append(path)
            continue
        new, count = patch_source(text)
        if count:
            path.write_text(new)
            patched.append(path)
        elif HELPER in text:
            already.append(path)
    for path in patched:
        print(f"patched {path}: decode radix cache allowed with EAGLE/NEXTN top-k 1 when {OPT_IN_ENV}=1")
    for path in already:
        print(f"already patched: {path}")
    if not patched and not already:
        print(f"error: no decode-radix/speculative guard found under {root / 'srt'}; this SGLang may not need "
              "the patch or changed its shape: build with APPLY_SGLANG_DECODE_RADIX_SPEC_PATCH=0 or update "
              "docker/patches/sglang_decode_radix_spec.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
