"""Command line of the mock engine: SGLang- and vLLM-style flags (plain argparse) → EngineConfig → serve.

Flags a real engine has but the mock does not simulate (`--tp 8`, `--trust-remote-code`, ...) are
accepted and ignored with one warning line, so a runbook command line can be pointed at the mock.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from infera_mock_engine.config import DEFAULT_PORTS, FLAVORS, EngineConfig, default_context_length, read_model_config
from infera_mock_engine.kv_events_config import KvEventsConfigError, parse_kv_events_config
from infera_mock_engine.lora import LoraConfigError, parse_sglang_paths, parse_vllm_modules
from infera_mock_engine.lora import check as lora_check
from infera_mock_engine.pd_config import SGLANG_MODES, TRANSFER_BACKENDS, DisaggConfigError, build_disagg_config

log = logging.getLogger("infera_mock_engine")


def _rank_list(text: str) -> tuple[int, ...]:
    try:
        ranks = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected DP ranks separated by commas, e.g. 0,2 (got {text!r})") from None
    if min(ranks) < 0:
        raise argparse.ArgumentTypeError(f"a DP rank is 0 or more (got {text!r})")
    return ranks


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be within 0..65535, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infera-mock-engine",
        description="Simulated LLM engine speaking the SGLang and vLLM HTTP APIs with a GPU-like timing model. "
        "Usage: infera-mock-engine --model-path DIR [flags]  (or vLLM-style: infera-mock-engine [serve] DIR [flags]). "
        "Unknown real-engine flags are accepted and ignored with a warning.",
        allow_abbrev=False,
    )
    p.add_argument("--model-path", "--model", dest="model_path",
                   help="local model directory holding tokenizer.json (SGLang --model-path, vLLM --model)")
    p.add_argument("--tokenizer-path", "--tokenizer", dest="tokenizer_path",
                   help="directory holding tokenizer.json (default: the model path)")
    p.add_argument("--served-model-name", nargs="+", dest="served_model_name",
                   help="name(s) the API answers to; the first is reported (default: the model path as given)")
    p.add_argument("--host", default=EngineConfig.host, help="address to bind (default %(default)s)")
    p.add_argument("--port", type=_port, default=None,
                   help=f"port to listen on (default {DEFAULT_PORTS['sglang']} for the sglang flavour, "
                   f"{DEFAULT_PORTS['vllm']} for vllm; 0 = any free port)")
    p.add_argument("--engine-flavor", "--engine-flavour", choices=FLAVORS, default=EngineConfig.engine_flavor,
                   help="which engine to imitate: error shapes, metric names, default port (default %(default)s)")
    p.add_argument("--speedup", "--speedup-ratio", type=_positive_float, default=EngineConfig.speedup,
                   help="divide every simulated step time by this (default %(default)s)")
    p.add_argument("--max-running-requests", "--max-num-seqs", type=_positive_int,
                   default=EngineConfig.max_running_requests, dest="max_running_requests",
                   help="most sequences running at once (default %(default)s)")
    p.add_argument("--max-num-batched-tokens", "--chunked-prefill-size", type=_positive_int,
                   default=EngineConfig.max_num_batched_tokens, dest="max_num_batched_tokens",
                   help="prefill tokens per scheduler step (default %(default)s)")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="SGLang's flag: each step starts when the engine's event loop gets to it, so a busy or "
                   "slow-waking host lengthens every step. Default (SGLang's overlap schedule): a step starts when "
                   "the one before was due to end, the host being late by up to one step costing nothing")
    p.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", type=_positive_int, default=None,
                   dest="num_kv_blocks",
                   help=f"KV cache blocks (default {EngineConfig.num_kv_blocks}, or --max-total-tokens / page size)")
    p.add_argument("--max-total-tokens", type=_positive_int, default=None,
                   help="KV cache capacity in tokens (SGLang); sets --num-kv-blocks = this / page size")
    p.add_argument("--page-size", "--block-size", type=_positive_int, default=EngineConfig.page_size,
                   dest="page_size", help="tokens per KV block (default %(default)s)")
    p.add_argument("--context-length", "--max-model-len", type=_positive_int, default=None, dest="context_length",
                   help="context length (default: config.json max_position_embeddings)")
    p.add_argument("--startup-delay", type=_non_negative_float, default=EngineConfig.startup_delay,
                   help="seconds /health answers 503 after start, simulating a cold start (default %(default)s)")
    p.add_argument("--enable-metrics", action="store_true",
                   help="accepted for SGLang compatibility; /metrics is always served")
    p.add_argument("--mock-output-len", type=_positive_int, default=EngineConfig.mock_output_len,
                   help="tokens generated when a request sets no max_tokens; the output then ends with "
                   "finish_reason 'stop' as if EOS was sampled (default %(default)s, SGLang's max_new_tokens "
                   "default)")
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="publish KV cache events on ZMQ, as the real engine of the chosen flavour does: "
                   "'{\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": "
                   "\"tcp://*:5558\", \"topic\": \"\", \"buffer_steps\": 10000, \"hwm\": 100000}'; "
                   "vLLM also needs \"enable_kv_cache_events\": true, SGLang ignores it. An endpoint with * "
                   "binds (tcp://*:0 = a free port, reported by /kv_event_sources and /server_info), "
                   "tcp://host:port connects")
    p.add_argument("--dp-size", "--dp", "--data-parallel-size", "-dp", type=_positive_int, default=1, dest="dp_size",
                   help="data-parallel ranks, each with its own scheduler and KV cache (default 1); a request is "
                   "pinned with routed_dp_rank/data_parallel_rank (SGLang body) or X-data-parallel-rank (vLLM "
                   "header), a disaggregated SGLang request goes to bootstrap_room %% dp_size, others round-robin")
    p.add_argument("--hang-ranks", type=_rank_list, default=None, metavar="R[,R...]",
                   help="mock only: the DP ranks a simulated GPU hang (SIGUSR1) stops, e.g. 1 (default: every "
                   "rank); with plain data parallelism each rank is its own scheduler, so one can hang alone")
    p.add_argument("--disaggregation-mode", choices=SGLANG_MODES, default=None,
                   help="SGLang prefill/decode disaggregation role (default null = aggregated); see README")
    p.add_argument("--disaggregation-bootstrap-port", type=_port, default=None,
                   help="SGLang: port of the prefill engine's bootstrap server, which also carries the simulated "
                   "KV transfer (default 8998; 0 = any free port, reported by /server_info)")
    p.add_argument("--disaggregation-transfer-backend", choices=TRANSFER_BACKENDS, default=None,
                   help="SGLang: accepted and reported; every backend is simulated by a TCP transfer (default mooncake)")
    p.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help="vLLM: '{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_producer|kv_consumer|kv_both\"}' "
                   "sets the disaggregation role (bootstrap port from VLLM_MOONCAKE_BOOTSTRAP_PORT, default 8998)")
    p.add_argument("--kv-bytes-per-token", type=_positive_int, default=None,
                   help="bytes the simulated KV transfer moves per prompt token (default from config.json: "
                   "2 x layers x KV heads x head dim x 2 bytes; 23040 for SmolLM2-135M)")
    p.add_argument("--kv-transfer-bandwidth", type=_positive_float, default=None, metavar="BYTES_PER_S",
                   help="cap the simulated KV transfer at this many bytes/s (default: no cap)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' as the engine of --engine-flavor does (vLLM: also "
                   "from VLLM_API_KEY); health and metrics stay open")
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (vLLM and SGLang)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="SPEC",
                   help="vLLM: LoRA adapters, each name=path or '{\"name\": ..., \"path\": ..., "
                   "\"base_model_name\": ...}'; a request names one as its model (weights are not read)")
    p.add_argument("--lora-paths", nargs="+", default=None, metavar="SPEC",
                   help="SGLang: LoRA adapters, each PATH, NAME=PATH or '{\"lora_name\": ..., \"lora_path\": ...}' "
                   "(implies --enable-lora); a request names one as model 'SERVED:NAME'")
    p.add_argument("--log-level", default="info", type=str.lower,
                   choices=["debug", "info", "warning", "error", "critical"], help="log level (default info)")
    return p


def _split_positional(argv: list[str]) -> tuple[str | None, list[str]]:
    """`[serve] MODEL --flags` (vLLM style): the leading bare word is the model."""
    args = list(argv)
    if args and args[0] == "serve":
        args.pop(0)
    if args and not args[0].startswith("-"):
        return args[0], args[1:]
    return None, args


def parse_args(argv: Sequence[str] | None = None) -> tuple[EngineConfig, str]:
    """Parse a command line into the resolved config and the log level; exits 2 on a bad one."""
    parser = build_parser()
    positional, rest = _split_positional(list(sys.argv[1:] if argv is None else argv))
    ns, unknown = parser.parse_known_args(rest)
    if positional and ns.model_path and positional != ns.model_path:
        parser.error(f"two models given: positional {positional!r} and --model-path {ns.model_path!r}")
    model = ns.model_path or positional
    if not model:
        parser.error("no model given: pass --model-path DIR (SGLang style) or --model DIR (vLLM style); "
                     "DIR must hold the model's tokenizer.json")
    model_dir = Path(model).expanduser()
    if not model_dir.is_dir():
        parser.error(f"model path {model!r} is not a local directory (the mock engine needs the model's "
                     "tokenizer.json on disk; it downloads nothing)")
    tok_dir = Path(ns.tokenizer_path).expanduser() if ns.tokenizer_path else model_dir
    if not (tok_dir / "tokenizer.json").is_file():
        parser.error(f"{tok_dir / 'tokenizer.json'} not found: the mock engine needs the model's tokenizer.json")
    if ns.hang_ranks and max(ns.hang_ranks) >= ns.dp_size:
        parser.error(f"--hang-ranks {max(ns.hang_ranks)}: this engine has DP ranks 0..{ns.dp_size - 1} (--dp-size)")
    model_config = read_model_config(model_dir)
    kv_events, kv_ignored = None, []
    if ns.kv_events_config is not None:
        try:
            kv_events, kv_ignored = parse_kv_events_config(ns.kv_events_config, ns.engine_flavor)
        except KvEventsConfigError as e:
            parser.error(f"--kv-events-config: {e}")
    try:
        disagg = build_disagg_config(
            ns.engine_flavor, mode=ns.disaggregation_mode, bootstrap_port=ns.disaggregation_bootstrap_port,
            transfer_backend=ns.disaggregation_transfer_backend, kv_transfer_config=ns.kv_transfer_config,
            kv_bytes=ns.kv_bytes_per_token, bandwidth=ns.kv_transfer_bandwidth, model_config=model_config,
            env=os.environ,
        )
    except DisaggConfigError as e:
        parser.error(str(e))
    served = tuple(ns.served_model_name or [model])
    try:
        lora_modules = parse_vllm_modules(ns.lora_modules or [])
        lora_check(lora_modules, ns.enable_lora or bool(ns.lora_paths), served, "--lora-modules")
        lora_modules += parse_sglang_paths(ns.lora_paths or [])
        lora_check(lora_modules, True, served, "--lora-paths")
    except LoraConfigError as e:
        parser.error(str(e))
    num_blocks = ns.num_kv_blocks
    if num_blocks is None:
        num_blocks = max(1, ns.max_total_tokens // ns.page_size) if ns.max_total_tokens else EngineConfig.num_kv_blocks
    config = EngineConfig(
        model_path=model,
        tokenizer_path=str(ns.tokenizer_path or model),
        served_model_names=served,
        host=ns.host,
        port=DEFAULT_PORTS[ns.engine_flavor] if ns.port is None else ns.port,
        engine_flavor=ns.engine_flavor,
        speedup=ns.speedup,
        max_running_requests=ns.max_running_requests,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        disable_overlap_schedule=ns.disable_overlap_schedule,
        num_kv_blocks=num_blocks,
        page_size=ns.page_size,
        context_length=ns.context_length or default_context_length(model_config, tok_dir),
        startup_delay=ns.startup_delay,
        enable_metrics=ns.enable_metrics,
        mock_output_len=ns.mock_output_len,
        kv_events=kv_events,
        kv_events_ignored=tuple(kv_ignored),
        kv_hash_seed=os.environ.get("PYTHONHASHSEED"),
        dp_size=ns.dp_size,
        hang_ranks=ns.hang_ranks,
        disagg=disagg,
        ignored_args=tuple(unknown),
        model_config=model_config,
        api_key=ns.api_key or (os.environ.get("VLLM_API_KEY") or None if ns.engine_flavor == "vllm" else None),
        enable_lora=ns.enable_lora or bool(ns.lora_paths),
        lora_modules=lora_modules,
    )
    return config, ns.log_level


def _install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def main(argv: Sequence[str] | None = None) -> int:
    config, level = parse_args(argv)
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if config.ignored_args:
        log.warning("ignoring flags the mock engine does not simulate: %s", " ".join(config.ignored_args))
    for key in config.kv_events_ignored:
        if key == "enable_kv_cache_events":
            log.warning("--kv-events-config: SGLang ignores enable_kv_cache_events; it publishes only with "
                        "\"publisher\": \"zmq\"")
        else:
            log.warning("--kv-events-config: ignoring unknown key %r (as SGLang does)", key)
    import signal
    import socket

    from infera_mock_engine.listen import bind_socket

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # until the event loop installs its own handler

    # Listen before the heavy imports: a busy port fails at once, and clients can connect immediately
    # (their connections queue until the app serves them; /health says 503 until then).
    try:
        sock = bind_socket(config.host, config.port)
    except (OSError, socket.gaierror) as e:
        log.error("cannot listen on %s:%d: %s", config.host, config.port, e)
        return 1
    bootstrap_sock = None
    if config.disagg.serves_prefill:  # the prefill's bootstrap port fails as fast as the HTTP port
        try:
            bootstrap_sock = bind_socket(config.host, config.disagg.bootstrap_port)
        except (OSError, socket.gaierror) as e:
            log.error("cannot listen on the bootstrap port %s:%d: %s", config.host, config.disagg.bootstrap_port, e)
            return 1
    from infera_mock_engine.server import run_forever

    from infera_mock_engine.kv_publisher import PublisherError
    from infera_mock_engine.pd_bootstrap import BootstrapError

    _install_uvloop()
    try:
        asyncio.run(run_forever(config, sock, bootstrap_sock))
    except KeyboardInterrupt:
        pass
    except (PublisherError, BootstrapError) as e:
        log.error("%s", e)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
