"""KV-cache rules of the recipes: decode radix cache, HiCache on decode, KV cache dtype. Pure.

SGLang facts these rules rest on (sglang ``server_args`` / ``arg_groups/pd_disaggregation_hook.py``):
a decode server runs a chunk cache (no radix tree, so no KV events to route by) unless
``--disaggregation-decode-enable-radix-cache``; it then turns the radix cache on, and refuses the
flag with ``--enable-hisparse``, with ``--disaggregation-transfer-backend fake`` and with any
``--speculative-algorithm``. Decode HiCache is ``--enable-hierarchical-cache`` *and* that radix
flag (the scheduler's ``enable_decode_hicache``). The speculative flags are
``--speculative-algorithm`` (EAGLE, EAGLE3, NEXTN, STANDALONE, NGRAM, ...; NEXTN is SGLang's name
for EAGLE over a model's own MTP layers) and ``--speculative-eagle-topk``. The transfer backend
default is mooncake; ``mooncake_tcp`` is Mooncake with TCP forced.

The opt-in ``SGLANG_EXPERIMENTAL_DECODE_RADIX_SPEC=1`` is read by the SGLang patch the
``docker/Dockerfile.sglang`` image applies (``docker/patches/sglang_decode_radix_spec.py``): with
it, EAGLE/NEXTN with top-k 1 may run with the decode radix cache. The agent asks for the top-k
explicitly: without ``--speculative-eagle-topk`` SGLang picks one itself later.
"""

from __future__ import annotations

import re

from infera_common.schemas import Role
from infera_worker_agent.engine_cmd import flag_value, has_flag
from infera_worker_agent.recipe_types import NOTHING, RecipeContext, RecipeRefusal, RuleResult, note

RADIX_FLAG = "--disaggregation-decode-enable-radix-cache"
HICACHE_FLAG = "--enable-hierarchical-cache"
DISABLE_RADIX_FLAG = "--disable-radix-cache"
BACKEND_FLAG = "--disaggregation-transfer-backend"
SPEC_ALGO_FLAG = "--speculative-algorithm"
SPEC_TOPK_FLAG = "--speculative-eagle-topk"
SPEC_OPT_IN_ENV = "SGLANG_EXPERIMENTAL_DECODE_RADIX_SPEC"
SPEC_RADIX_ALGOS = ("EAGLE", "NEXTN")
MOONCAKE_BACKENDS = ("mooncake", "mooncake_tcp")
DEFAULT_BACKEND = "mooncake"
KV_DTYPE_FLAG = "--kv-cache-dtype"
DEFAULT_KV_DTYPE = "fp8_e4m3"  # both engines' name for FP8 E4M3 KV (SGLang and vLLM --kv-cache-dtype choices)
#: 0.5.18's decode path calls storage-hit methods it lacks: the first request crashes.
DECODE_HICACHE_MIN_SGLANG = (0, 5, 19)


def transfer_backend(args) -> str:
    return flag_value(args, BACKEND_FLAG) or DEFAULT_BACKEND


def spec_blocker(ctx: RecipeContext) -> str | None:
    """Why speculative decoding keeps the decode radix cache off; None without speculative decoding
    or when the opt-in conditions hold."""
    algo = flag_value(ctx.args, SPEC_ALGO_FLAG)
    if algo is None:
        return None
    topk = flag_value(ctx.args, SPEC_TOPK_FLAG)
    opted_in = ctx.env.get(SPEC_OPT_IN_ENV) == "1"
    if opted_in and algo.upper() in SPEC_RADIX_ALGOS and topk is not None and topk.strip() == "1":
        return None
    why = []
    if not opted_in:
        why.append(f"{SPEC_OPT_IN_ENV}=1 is not set")
    if algo.upper() not in SPEC_RADIX_ALGOS:
        why.append(f"the algorithm is {algo}, not EAGLE or NEXTN")
    if topk is None or topk.strip() != "1":
        why.append(f"{SPEC_TOPK_FLAG} is {topk if topk is not None else 'not given'}, not 1")
    return (f"speculative decoding ({SPEC_ALGO_FLAG} {algo}): SGLang runs the decode radix cache with it only "
            f"on the patched image with {SPEC_OPT_IN_ENV}=1, EAGLE/NEXTN and {SPEC_TOPK_FLAG} 1; here "
            + ", ".join(why))


def decode_radix_rule(ctx: RecipeContext) -> RuleResult:
    """KV events on + an SGLang Mooncake decode leg: append the decode radix flag (the events come
    from the radix tree), unless speculative decoding or the user's flags say otherwise."""
    if ctx.engine != "sglang" or ctx.role is not Role.DECODE:
        return NOTHING
    skip = "decode radix cache: not appended: "
    if has_flag(ctx.args, RADIX_FLAG):
        return note(f"decode radix cache: {RADIX_FLAG} already on the command line")
    if not ctx.kv_events:
        return note(skip + "KV events are off (--no-enable-kv-events); the decode keeps SGLang's chunk cache")
    backend = transfer_backend(ctx.args)
    if backend not in MOONCAKE_BACKENDS:
        return note(skip + f"{BACKEND_FLAG} is {backend}, not mooncake")
    if has_flag(ctx.args, DISABLE_RADIX_FLAG):
        return note(skip + f"{DISABLE_RADIX_FLAG} is given")
    if has_flag(ctx.args, "--enable-hisparse"):
        return note(skip + "SGLang refuses it with --enable-hisparse")
    if (blocker := spec_blocker(ctx)) is not None:
        return note(skip + blocker + "; speculative decode keeps its chunk cache")
    return RuleResult(args=(RADIX_FLAG,), notes=(
        f"decode radix cache: appended {RADIX_FLAG} (KV events on, Mooncake decode leg): the decode's cache "
        "is visible to KV-aware routing",))


def hicache_decode_rule(ctx: RecipeContext) -> RuleResult:
    """``--enable-hierarchical-cache`` on an SGLang decode implies the decode radix flag (even with
    KV events off, which stay off); refused with ``--disable-radix-cache``, with an SGLang older than
    0.5.19, and with speculative decoding outside the opt-in."""
    if ctx.engine != "sglang" or ctx.role is not Role.DECODE or not has_flag(ctx.args, HICACHE_FLAG):
        return NOTHING
    if has_flag(ctx.args, DISABLE_RADIX_FLAG):
        raise RecipeRefusal(
            f"{HICACHE_FLAG} on a decode needs the decode radix cache ({RADIX_FLAG}), and {DISABLE_RADIX_FLAG} "
            f"turns the radix cache off: drop {DISABLE_RADIX_FLAG}, or drop {HICACHE_FLAG} from the decode leg"
        )
    notes = []
    version = ctx.host.sglang_version
    release = release_tuple(version) if version is not None else None
    if version is None:
        notes.append(f"decode HiCache: SGLang is not installed for this interpreter, so its version "
                     f"(>= {_dotted(DECODE_HICACHE_MIN_SGLANG)} needed) was not checked")
    elif release is None:
        notes.append(f"decode HiCache: SGLang version {version!r} is not understood, so it was not checked")
    elif release < DECODE_HICACHE_MIN_SGLANG:
        raise RecipeRefusal(
            f"{HICACHE_FLAG} on a decode needs SGLang >= {_dotted(DECODE_HICACHE_MIN_SGLANG)}, and SGLang {version} "
            "is installed: 0.5.18 and older lack the storage-hit methods the decode HiCache path calls and crash on "
            f"the first request. Use an image with SGLang >= {_dotted(DECODE_HICACHE_MIN_SGLANG)} "
            f"(docker/Dockerfile.sglang), or drop {HICACHE_FLAG} from the decode leg"
        )
    if (blocker := spec_blocker(ctx)) is not None:
        raise RecipeRefusal(f"{HICACHE_FLAG} on a decode needs the decode radix cache, which is off under {blocker}. "
                            f"Set those, or drop {HICACHE_FLAG} from the decode leg")
    if has_flag(ctx.args, RADIX_FLAG):
        return RuleResult(notes=(*notes, f"decode HiCache: {RADIX_FLAG} kept as given"))
    return RuleResult(args=(RADIX_FLAG,), notes=(*notes, (
        f"decode HiCache: appended {RADIX_FLAG}, its prerequisite (KV events "
        f"{'on' if ctx.kv_events else 'stay off'})")))


def kv_cache_dtype_rule(ctx: RecipeContext) -> RuleResult:
    """FP8 (E4M3) KV cache unless the user chose a dtype: twice the KV capacity of BF16."""
    if ctx.engine not in ("sglang", "vllm") or has_flag(ctx.args, KV_DTYPE_FLAG):
        return NOTHING
    return RuleResult(args=(KV_DTYPE_FLAG, DEFAULT_KV_DTYPE), notes=(
        f"KV cache dtype: {KV_DTYPE_FLAG} {DEFAULT_KV_DTYPE} (the default; give {KV_DTYPE_FLAG} to choose another)",))


_RELEASE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)")


def release_tuple(version: str) -> tuple[int, ...] | None:
    """The release numbers of a version (``0.5.19.post1`` / ``0.5.19rc0`` -> (0, 5, 19)); pre-releases
    and local builds of a release count as that release. None when it starts with no number."""
    m = _RELEASE.match(version)
    if m is None:
        return None
    parts = tuple(int(p) for p in m.group(1).split("."))
    return parts + (0,) * (3 - len(parts)) if len(parts) < 3 else parts


def _dotted(release: tuple[int, ...]) -> str:
    return ".".join(map(str, release))
