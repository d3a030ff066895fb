"""The engine images (docker/Dockerfile.vllm, .sglang, .sglang.gfx942, .atom) cannot be built here:
check each overlays this project on its vendor base, installs it, and runs an entry point that exists.
The SGLang patch they apply is checked against sources shaped like SGLang's two known layouts."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
PATCH = ROOT / "docker/patches/sglang_decode_radix_spec.py"

#: Dockerfile -> (base-image build arg, vendor image its default must name, entry-point module)
IMAGES = {
    "Dockerfile.vllm": ("VLLM_BASE_IMAGE", r"rocm/vllm:rocm[\d.]+_\S+_py3\.1[1-9]\S*_vllm_[\d.]+",
                        "infera.engine.vllm"),
    "Dockerfile.sglang": ("SGLANG_BASE_IMAGE", r"lmsysorg/sglang:v0\.5\.(19|[2-9]\d)\S*-rocm\d+-mi35x",
                          "infera.engine.sglang"),
    "Dockerfile.sglang.gfx942": ("SGLANG_BASE_IMAGE", r"lmsysorg/sglang:v0\.5\.(19|[2-9]\d)\S*-rocm\d+-mi30x",
                                 "infera.engine.sglang"),
    "Dockerfile.atom": ("ATOM_BASE_IMAGE", r"rocm/atom(-dev)?:\S+", "infera.engine.vllm"),
}


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "docker" / name).read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_image_overlays_infera_on_its_vendor_base(name):
    arg, base_pattern, _ = IMAGES[name]
    steps = instructions(name)
    assert steps[0][0] == "ARG" and steps[0][1].startswith(f"{arg}="), "the base image is a build arg"
    assert re.fullmatch(base_pattern, steps[0][1].split("=", 1)[1]), steps[0][1]
    assert steps[1] == ("FROM", f"${{{arg}}}")


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_image_installs_this_project(name):
    steps = instructions(name)
    copies = [rest for word, rest in steps if word == "COPY"]
    assert "pyproject.toml README.md ./" in copies and "libs ./libs" in copies and "services ./services" in copies
    workdir = next(rest for word, rest in steps if word == "WORKDIR")
    installs = [rest for word, rest in steps if word == "RUN" and "pip install ." in rest]
    assert installs and workdir == "/opt/infera-src", "pip install . runs where the sources were copied"
    assert any("sys.version_info >= (3, 11)" in rest for word, rest in steps if word == "RUN"), \
        "the build fails early, saying so, on a base whose Python is older than Infera needs"


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_image_entry_point_exists_and_is_checked_at_build_time(name):
    module = IMAGES[name][2]
    steps = instructions(name)
    entry = next(rest for word, rest in steps if word == "ENTRYPOINT")
    assert entry == f'["python3", "-m", "{module}"]'
    assert any(f"python3 -m {module} --help" in rest for word, rest in steps if word == "RUN")
    package = module.rsplit(".", 1)[0]
    assert package in PACKAGES, f"{package} is not installed by pyproject.toml"
    assert importlib.util.find_spec(module) is not None
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--print-command" in out.stdout


@pytest.mark.parametrize("name, default", [("Dockerfile.sglang", "1"), ("Dockerfile.sglang.gfx942", "0")])
def test_sglang_images_take_the_decode_radix_spec_patch_build_arg(name, default):
    steps = instructions(name)
    args = dict(rest.split("=", 1) for word, rest in steps if word == "ARG")
    assert args["APPLY_SGLANG_DECODE_RADIX_SPEC_PATCH"] == default
    copied = [rest.split()[0] for word, rest in steps if word == "COPY"]
    assert "docker/patches/sglang_decode_radix_spec.py" in copied and PATCH.is_file()
    run = next(rest for word, rest in steps if word == "RUN" and "APPLY_SGLANG_DECODE_RADIX_SPEC_PATCH" in rest)
    assert '"$APPLY_SGLANG_DECODE_RADIX_SPEC_PATCH" = "1"' in run and "sglang_decode_radix_spec.py" in run


# --- the SGLang patch ---------------------------------------------------------------------------
HOOK = '''\
def handle_pd_disaggregation(server_args):
    if server_args.disaggregation_mode == "decode":
        if server_args.disaggregation_decode_enable_radix_cache:
            if server_args.speculative_algorithm is not None:
                raise ValueError(
                    "--disaggregation-decode-enable-radix-cache is incompatible "
                    "with speculative decoding "
                    f"(--speculative-algorithm {server_args.speculative_algorithm})"
                )
            server_args.disable_radix_cache = False
'''
METHOD = '''\
class ServerArgs:
    def _handle_pd(self):
        if self.disaggregation_decode_enable_radix_cache:
            if self.speculative_algorithm not in (None, "DSPARK"):
                raise ValueError(
                    "--disaggregation-decode-enable-radix-cache is incompatible with speculative decoding"
                )
            self.disable_radix_cache = False
'''


class Args:
    disaggregation_mode = "decode"
    disaggregation_decode_enable_radix_cache = True
    disable_radix_cache = True

    def __init__(self, algorithm, topk):
        self.speculative_algorithm, self.speculative_eagle_topk = algorithm, topk


def load_patch():
    spec = importlib.util.spec_from_file_location("sglang_decode_radix_spec", PATCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("source, call", [
    (HOOK, lambda ns, args: ns["handle_pd_disaggregation"](args)),
    (METHOD, lambda ns, args: ns["ServerArgs"]._handle_pd(args)),
])
def test_patch_allows_eagle_nextn_top_k_1_only_on_opt_in(source, call, monkeypatch):
    patched, count = load_patch().patch_source(source)
    assert count == 1
    ns: dict = {}
    exec(compile(patched, "patched.py", "exec"), ns)
    monkeypatch.delenv("SGLANG_EXPERIMENTAL_DECODE_RADIX_SPEC", raising=False)
    with pytest.raises(ValueError, match="incompatible"):
        call(ns, Args("EAGLE", 1))  # no opt-in: SGLang's refusal stands
    monkeypatch.setenv("SGLANG_EXPERIMENTAL_DECODE_RADIX_SPEC", "1")
    for algorithm in ("EAGLE", "NEXTN"):
        args = Args(algorithm, 1)
        call(ns, args)
        assert args.disable_radix_cache is False
    for algorithm, topk in (("EAGLE3", 1), ("EAGLE", 4), ("EAGLE", None), ("NGRAM", 1)):
        with pytest.raises(ValueError, match="incompatible"):
            call(ns, Args(algorithm, topk))
    call(ns, Args(None, None))  # no speculative decoding: unchanged


def test_patch_is_idempotent_and_fails_loudly_when_the_guard_is_missing(tmp_path):
    patch = load_patch()
    once, _ = patch.patch_source(HOOK)
    assert patch.patch_source(once) == (once, 0)
    srt = tmp_path / "sglang" / "srt"
    srt.mkdir(parents=True)
    (srt / "hook.py").write_text(HOOK)
    env = {**os.environ, "PYTHONPATH": ""}
    first = subprocess.run([sys.executable, str(PATCH), str(tmp_path / "sglang")], capture_output=True, text=True,
                           env=env)
    assert first.returncode == 0 and "patched" in first.stdout
    second = subprocess.run([sys.executable, str(PATCH), str(tmp_path / "sglang")], capture_output=True, text=True,
                            env=env)
    assert second.returncode == 0 and "already patched" in second.stdout
    (srt / "hook.py").write_text("def handle_pd_disaggregation(server_args):\n    pass\n")
    missing = subprocess.run([sys.executable, str(PATCH), str(tmp_path / "sglang")], capture_output=True, text=True,
                             env=env)
    assert missing.returncode == 1 and "APPLY_SGLANG_DECODE_RADIX_SPEC_PATCH=0" in missing.stderr
