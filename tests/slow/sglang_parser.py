"""SGLang's own argument parser and validators, loaded for parsing only (no GPU, no model weights).

``make test-slow`` installs ``sglang`` with ``--no-deps`` plus the ``slow-sglang`` extra (the light
modules its argument code imports, and the CPU ``torch==2.13.0`` wheel SGLang pins). One module of
its import chain cannot be satisfied here: ``sglang.srt.utils.common`` imports
``torchvision.io.decode_jpeg`` (image inputs), and PyPI's torchvision wheels are CUDA builds that fail
to import beside the CPU torch (``operator torchvision::nms does not exist``). While that one import
runs, and only when no working torchvision is installed, a stand-in ``torchvision.io`` whose
``decode_jpeg`` raises is visible; it is removed again right after, so ``transformers`` (imported
first) and everything after see no torchvision at all. Nothing here decodes an image.

What is loaded is SGLang's code as installed: ``prepare_server_args`` (argparse over ``ServerArgs``:
flag names, types, choices) and, from the resolution pipeline the launcher runs next, the
model-independent validators of the flags the agent writes: ``handle_pd_disaggregation`` (decode radix
cache vs chunk cache, its refusals), ``handle_hicache`` and ``KVEventsConfig`` (the
``--kv-events-config`` schema) with the publisher's per-DP-rank port offset.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import io
import importlib.metadata
import importlib.util
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
PATCH_SCRIPT = ROOT / "docker" / "patches" / "sglang_decode_radix_spec.py"
PD_HOOK_MODULE = "sglang.srt.arg_groups.pd_disaggregation_hook"


@dataclass(frozen=True)
class Sglang:
    version: str
    prepare_server_args: Callable[[list[str]], Any]
    handle_pd_disaggregation: Callable[[Any], None]  # stock
    patched_handle_pd_disaggregation: Callable[[Any], None]  # as docker/Dockerfile.sglang ships it
    handle_hicache: Callable[[Any], None]
    resolving_view: Callable[[Any], Any]
    kv_events_config: Callable[[str], Any]  # KVEventsConfig.from_cli
    offset_endpoint_port: Callable[[str | None, int], str | None]

    def parse(self, argv: list[str]) -> Any:
        """``prepare_server_args(argv)``; argparse's refusal (usage on stderr, exit 2) becomes an
        AssertionError that quotes SGLang's error line."""
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                return self.prepare_server_args(list(argv))
        except SystemExit as exc:
            lines = [line for line in err.getvalue().splitlines() if line.strip()]
            raise AssertionError(f"SGLang {self.version}'s parser refused the command line (exit {exc.code}): "
                                 f"{lines[-1] if lines else '(no message)'}\n  argv: {argv}") from None


def installed() -> bool:
    return importlib.util.find_spec("sglang") is not None


def _working_torchvision() -> bool:
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        importlib.import_module("torchvision.io")
    except Exception:  # noqa: BLE001 - a CUDA build beside the CPU torch: RuntimeError at import
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        return False
    return True


def _import_server_args():
    if "sglang.srt.server_args" in sys.modules or _working_torchvision():
        return importlib.import_module("sglang.srt.server_args")
    importlib.import_module("transformers")  # before the stand-in, so it records "no torchvision"
    package, tv_io = types.ModuleType("torchvision"), types.ModuleType("torchvision.io")

    def decode_jpeg(*_args, **_kwargs):
        raise RuntimeError("torchvision stand-in of tests/slow/sglang_parser.py: no image decoding here")

    tv_io.decode_jpeg = decode_jpeg
    package.io = tv_io
    package.__spec__ = importlib.machinery.ModuleSpec("torchvision", None, is_package=True)
    tv_io.__spec__ = importlib.machinery.ModuleSpec("torchvision.io", None)
    sys.modules.update({"torchvision": package, "torchvision.io": tv_io})
    try:
        return importlib.import_module("sglang.srt.server_args")
    finally:
        for name in ("torchvision", "torchvision.io"):
            if sys.modules.get(name) in (package, tv_io):
                del sys.modules[name]


def patched_pd_hook(stock_module) -> types.ModuleType:
    """SGLang's PD argument hook with the decode-radix/speculative patch of ``docker/Dockerfile.sglang``
    applied (the same ``patch_source`` the image build runs), as a separate module: the installed
    file is not touched."""
    spec = importlib.util.spec_from_file_location("_infera_sglang_decode_radix_spec", PATCH_SCRIPT)
    patch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(patch)
    source = Path(stock_module.__file__).read_text()
    patched, count = patch.patch_source(source)
    if count != 1:
        raise AssertionError(f"docker/patches/sglang_decode_radix_spec.py narrowed {count} guards in "
                             f"{stock_module.__file__}, expected exactly 1")
    module = types.ModuleType(f"{PD_HOOK_MODULE}__infera_patched")
    module.__file__ = stock_module.__file__
    module.__package__ = "sglang.srt.arg_groups"
    exec(compile(patched, f"{stock_module.__file__} (patched)", "exec"), module.__dict__)  # noqa: S102
    return module


def load() -> Sglang:
    server_args = _import_server_args()
    pd_hook = importlib.import_module(PD_HOOK_MODULE)
    hicache = importlib.import_module("sglang.srt.arg_groups.hicache_hook")
    overrides = importlib.import_module("sglang.srt.arg_groups.overrides")
    kv_events = importlib.import_module("sglang.srt.disaggregation.kv_events")
    return Sglang(
        version=importlib.metadata.version("sglang"),
        prepare_server_args=server_args.prepare_server_args,
        handle_pd_disaggregation=pd_hook.handle_pd_disaggregation,
        patched_handle_pd_disaggregation=patched_pd_hook(pd_hook).handle_pd_disaggregation,
        handle_hicache=hicache.handle_hicache,
        resolving_view=overrides.resolving_view,
        kv_events_config=kv_events.KVEventsConfig.from_cli,
        offset_endpoint_port=kv_events.ZmqEventPublisher.offset_endpoint_port,
    )
