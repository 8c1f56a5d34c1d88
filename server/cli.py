"""`pagedserve serve [MODEL] ...`: vLLM's flag names -> EngineConfig -> AsyncLLMEngine -> uvicorn."""
from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from engine.config import BLOCK_SIZES, QUANTIZATIONS, EngineConfig, PreemptionMode, SchedulingPolicy
from engine.generation_config import generation_defaults
from engine.platform.openmp import apply_serving_default
from server.reasoning import PARSERS as REASONING_PARSERS
from server.tools import PARSERS

API_KEY_ENV = "PAGEDSERVE_API_KEY"
# oneDNN keeps every GEMM primitive it builds, and torch's ideep layer keeps another LRU of them, 1024
# entries each by default. A serving batch has a new token count at almost every step, so each new count
# adds ~0.3 MiB per linear shape, for many minutes: the RSS drift of the soak (docs/reliability.md).
# 64 entries fill within seconds; building a primitive on a miss costs nothing measurable next to the GEMM.
# Both are read once, when the first primitive is built: set before the model loads; an explicit setting wins.
NATIVE_CACHE_ENV = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}
logger = logging.getLogger("pagedserve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="OpenAI-compatible LLM server with a paged KV cache.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over HTTP")
    serve.add_argument("model", nargs="?", default=None,
                       help="HF folder or .gguf file; omitted: the bundled SmolLM2-135M-Instruct")
    serve.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                       help="the model as vLLM's api_server takes it: the same as MODEL")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="the id clients put in `model`")
    serve.add_argument("--api-key", default=None,
                       help=f"require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize (env {API_KEY_ENV})")
    serve.add_argument("--tokenizer", default=None)
    serve.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    serve.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    serve.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    serve.add_argument("--quantization", default=None, choices=list(QUANTIZATIONS),
                       help="int8: the weights quantized at load to llama.cpp's Q8_0 blocks (int8, a float16 scale "
                            "per 32) and multiplied in int8 (CPU only; about half the bytes a decode step reads). "
                            "q4_k, q4_0, q4_1, q5_0, q5_1, q5_k, q6_k: the same with llama.cpp's blocks of that "
                            "type (its quantize_row_*_ref; Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0 where a row is "
                            "not a multiple of 256). "
                            "fp8: the decoder's linears quantized at load to e4m3 with a scale per output channel, "
                            "activations per token, through torch's scaled matmul (GPUs of compute capability 8.9+: "
                            "Ada, Hopper; bfloat16 activations; on a CPU a slow reference, for checking). "
                            "Default: float weights, except a quantized .gguf (Q4_K_M, Q8_0, ...), served as its "
                            "blocks are; none: such a file dequantized to --dtype")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--block-size", type=int, default=None, choices=list(BLOCK_SIZES),
                       help="tokens per KV cache block (default: 128 on CPU, 16 on CUDA; CUDA takes 8, 16 or 32)")
    serve.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    serve.add_argument("--swap-space", type=float, default=4.0, help="GiB of host memory for swapped-out blocks")
    serve.add_argument("--kv-cache-space", type=float, default=4.0, help="GiB of KV cache on CPU")
    serve.add_argument("--num-gpu-blocks-override", type=int, default=None,
                       help="KV cache blocks, instead of sizing them from memory")
    serve.add_argument("--num-cpu-blocks-override", type=int, default=None,
                       help="host swap blocks, instead of sizing them from --swap-space (0: no swap)")
    serve.add_argument("--max-num-seqs", type=int, default=256)
    serve.add_argument("--max-num-batched-tokens", type=int, default=None)
    serve.add_argument("--enable-prefix-caching", action="store_true")
    serve.add_argument("--enable-chunked-prefill", action="store_true",
                       help="mix decodes and prompt chunks in each step (--max-num-batched-tokens default: 512)")
    serve.add_argument("--preemption-mode", default=None, choices=[m.value for m in PreemptionMode])
    serve.add_argument("--scheduling-policy", default="fcfs", choices=[p.value for p in SchedulingPolicy],
                       help="priority: a request's lower `priority` runs first and may preempt running ones")
    serve.add_argument("--max-logprobs", type=int, default=20,
                       help="the most alternatives a logprobs field may ask for (-1: no bound; a request's -1 asks "
                            "for the whole vocabulary)")
    serve.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="usage carries prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache "
                            "served (vLLM's flag)")
    serve.add_argument("--generation-config", default="auto",
                       help="auto: a request's unset temperature, top_p, top_k, min_p, repetition_penalty (and "
                            "max_tokens, capped by max_new_tokens) default to the model folder's "
                            "generation_config.json, as vLLM's; vllm: to OpenAI's; or a folder holding such a file")
    serve.add_argument("--override-generation-config", default=None,
                       help='JSON of generation_config.json keys laid over --generation-config\'s, e.g. '
                            '\'{"temperature": 0.5}\' (vLLM\'s)')
    serve.add_argument("--chat-template", default=None,
                       help="a Jinja chat template, or a file holding one, instead of the tokenizer's")
    serve.add_argument("--tool-call-parser", default="hermes", choices=list(PARSERS),
                       help="how tool calls are written in the model's output (server/tools.py)")
    serve.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                       help="split a chat reply's <think>...</think> out of its content into reasoning_content "
                            "(deepseek_r1: the reply starts in its reasoning; qwen3: only inside a <think> it opens); "
                            "tool calls and structured outputs apply to the content after it (server/reasoning.py)")
    serve.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="ranks that each hold 1/N of the model (torch.distributed: gloo on CPU, NCCL on CUDA); "
                            "started here, or by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: rank 0 "
                            "serves HTTP)")
    serve.add_argument("--distributed-timeout", type=float, default=120.0,
                       help="seconds the tensor-parallel ranks wait for each other to start, and in any collective")
    serve.add_argument("--engine-core-process", action=argparse.BooleanOptionalAction, default=None,
                       help="run the engine core (scheduler, model, sampler, output processing) in a process of its "
                            "own, reached over ZMQ: the HTTP server's event loop no longer shares the GIL with the "
                            "steps. If the core process dies, /health answers 503 and the server exits with status 1. "
                            "Default: on where the engine runs on CUDA (a GPU host's cores serve both processes), "
                            "off on the CPU (the API server and the core would share the cores the model runs on)")
    serve.add_argument("--enforce-eager", action="store_true",
                       help="run every step op by op in Python (the reference path). By default a CPU step "
                            "(decode and prefill) runs all its layers in one compiled call (the eager arithmetic "
                            "in its order, the MLP's gate/up linear and activation fused into one kernel on AVX-512: "
                            "the same tokens and logprobs); on CUDA a decode-only step replays a CUDA graph captured at start for "
                            "its batch size (the same tokens); tensor-parallel steps always run eagerly")
    serve.add_argument("--grammar-cache-mb", type=float, default=16.0,
                       help="MiB of compiled structured-output grammars kept, least recently used dropped first")
    serve.add_argument("--stream-interval", type=int, default=1,
                       help="a streamed request gets an event every N tokens (and with its first and last): fewer, "
                            "larger events, less API-server work a token at high concurrency (vLLM's, SGLang's flag)")
    serve.add_argument("--speculative-config", default=None,
                       help='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
                            '"prompt_lookup_max": 4, "prompt_lookup_min": 1} (prompt lookup) or {"model": PATH, '
                            '"num_speculative_tokens": 4} (a draft model with the same tokenizer; pagedserve\'s '
                            '"draft_num_layers": N keeps its first N layers). Greedy outputs stay the same, sampled '
                            'ones keep their distribution; it turns itself off where it would not pay')
    serve.add_argument("--shutdown-timeout", type=float, default=10.0,
                       help="seconds in-flight requests get to finish on SIGINT/SIGTERM before they are aborted")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--disable-log-stats", action="store_true", help="no periodic throughput/cache line")
    serve.add_argument("--log-stats-interval", type=float, default=5.0, help="seconds between stats lines while busy")
    # vLLM command lines start here unchanged: its flags that have nothing to change in pagedserve are accepted.
    same = serve.add_argument_group("vLLM's flags accepted as they are (nothing to change here)")
    same.add_argument("--trust-remote-code", action="store_true",
                      help="no code of a checkpoint runs here: the model classes are pagedserve's own")
    same.add_argument("--enable-auto-tool-choice", action="store_true",
                      help="tool_choice auto is always on, the calls parsed by --tool-call-parser")
    same.add_argument("--disable-log-requests", action="store_true", help="request contents are never logged here")
    same.add_argument("--kv-cache-dtype", default="auto", choices=["auto"], help="the KV cache is in --dtype")
    same.add_argument("--tokenizer-mode", default="auto", choices=["auto"],
                      help="the HF tokenizer (fast where the model has one)")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line, with --model (vLLM's api_server) folded into MODEL."""
    parser = build_parser()
    args = parser.parse_args(argv)
    flag = getattr(args, "model_flag", None)
    if flag is not None:
        if args.model is not None and args.model != flag:
            parser.error(f"MODEL ({args.model}) and --model ({flag}) name different models: give one")
        args.model = flag
    return args


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine flags, one to one onto EngineConfig's fields."""
    return EngineConfig(
        model=args.model, served_model_name=args.served_model_name, tokenizer=args.tokenizer, dtype=args.dtype,
        device=args.device, seed=args.seed, load_format=args.load_format, quantization=args.quantization,
        max_model_len=args.max_model_len,
        block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization, swap_space=args.swap_space,
        kv_cache_space=args.kv_cache_space, num_gpu_blocks_override=args.num_gpu_blocks_override,
        num_cpu_blocks_override=args.num_cpu_blocks_override,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching, enable_chunked_prefill=args.enable_chunked_prefill,
        preemption_mode=args.preemption_mode,
        scheduling_policy=args.scheduling_policy, max_logprobs=args.max_logprobs,
        tensor_parallel_size=args.tensor_parallel_size, distributed_timeout=args.distributed_timeout,
        enforce_eager=args.enforce_eager, grammar_cache_mb=args.grammar_cache_mb,
        stream_interval=args.stream_interval, speculative_config=args.speculative_config,
        generation_config=args.generation_config, override_generation_config=args.override_generation_config,
    )


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from engine.frontend.async_engine import AsyncLLMEngine
    from engine.distributed.group import StartupError, torchrun_env
    from server.app import create_app

    try:
        chat_template = _read_chat_template(args.chat_template)
        config = config_from_args(args)
        default_sampling = generation_defaults(config.model, config.generation_config,
                                               config.override_generation_config)
        launch = torchrun_env()
        if launch is not None and launch[0] != 0:  # a torchrun rank other than 0: no HTTP, the worker loop
            return _serve_as_worker(config, *launch)
        if wants_core_process(args.engine_core_process, config, torchrun=launch is not None):
            from engine.frontend.core_client import RemoteEngineCore

            engine = AsyncLLMEngine(RemoteEngineCore.start(config), log_stats=not args.disable_log_stats,
                                    stats_interval_s=args.log_stats_interval)
        else:
            engine = AsyncLLMEngine.from_config(
                config, log_stats=not args.disable_log_stats, stats_interval_s=args.log_stats_interval
            )
    except (ValueError, StartupError) as exc:  # a flag or a launch that cannot work: say why, no traceback
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return 2
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    # In-flight requests get the timeout minus a margin in which the ones still running are ended with a
    # 503 (error event + [DONE] on streams) and their blocks freed; uvicorn's own timeout then ends nothing.
    cut_after_s = max(0.0, args.shutdown_timeout - min(1.0, args.shutdown_timeout / 4))
    app = create_app(engine, api_key=api_key, served_model_name=config.model_name,
                     shutdown_timeout_s=cut_after_s, chat_template=chat_template,
                     tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                     enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                     default_sampling=default_sampling)
    if default_sampling:
        logger.info("a request's unset sampling fields default to the model's generation_config.json (and "
                    "--override-generation-config): %s (--generation-config vllm for OpenAI's)", default_sampling)
    logger.info("serving %s on http://%s:%d (max_model_len=%s)", config.model_name, args.host, args.port,
                engine.config.max_model_len)
    # uvicorn owns SIGINT/SIGTERM while serving: it stops accepting, gives in-flight requests the timeout,
    # then runs the lifespan shutdown, which aborts what is left and stops the engine loop. Afterwards it
    # re-raises the signal to the handler it found; a no-op one lets a clean shutdown exit 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _after_graceful_shutdown)
    # The model, torch and transformers leave ~400k objects in the collector's care; one full
    # collection of them takes ~0.2 s holding the GIL, a stall of every stream and of /health.
    # Freeze what exists now: later full collections then only walk objects made while serving.
    gc.collect()
    gc.freeze()
    server = _draining_server(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                       timeout_graceful_shutdown=max(1, args.shutdown_timeout)),  # type: ignore[arg-type]
        on_exit=lambda: engine.begin_shutdown(cut_after_s),
    )
    # An engine that stopped for good (faults that outlived its resets) ends the process with status 1, so
    # the supervisor (Docker's restart policy, systemd, Kubernetes) starts a fresh one (docs/reliability.md).
    engine.on_dead = lambda: os.kill(os.getpid(), signal.SIGTERM)
    server.run()
    if engine.errored:
        logger.error("exiting with status 1: the engine stopped (%s)", engine.unavailable_reason)
        return 1
    return 0


def wants_core_process(flag: Optional[bool], config: EngineConfig, torchrun: bool) -> bool:
    """--engine-core-process as given, else on for a CUDA engine started here (--device cuda or auto, with a GPU
    torch sees). Measured on an H200 host (16 cores, docs/benchmarks.md "GPU (CUDA)"): the split served 1.05x /
    1.37x / 1.45x the tokens of one process at 1 / 64 / 256 streams; on a 2-vCPU CPU machine one process is the
    faster at 1 and 8 streams."""
    if flag is not None:
        return flag
    if torchrun or config.device == "cpu":
        return False
    import torch

    return torch.cuda.is_available()  # without a GPU a --device cuda engine fails in this process, saying why


def _serve_as_worker(config: EngineConfig, rank: int, world: int) -> int:
    """Rank `rank` of a torchrun launch: hold this rank's shard and follow rank 0's steps until it stops."""
    from engine.worker.tp_workers import run_worker

    if world != config.tensor_parallel_size:
        raise ValueError(f"--tensor-parallel-size {config.tensor_parallel_size} does not match WORLD_SIZE {world}.")
    logger.info("tensor-parallel rank %d of %d: following rank 0's steps (no HTTP here)", rank, world)
    # torchrun forwards SIGTERM/SIGINT to every rank: rank 0 drains its requests first, then stops this one (or
    # its sockets close when it exits), so the requests in flight are not lost to a rank that left first.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    return run_worker(config, rank, world, os.environ.get("MASTER_ADDR", "127.0.0.1"),
                      int(os.environ.get("MASTER_PORT", "29500")), from_env=True)


def _read_chat_template(value: Optional[str]) -> Optional[str]:
    """--chat-template: a file's text when the value names a file, else the value itself (vLLM's rule)."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{" not in value:
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template.")
    return value


def _draining_server(config: Any, on_exit: Callable[[], None]) -> Any:
    """A uvicorn.Server that also tells the engine at the signal itself: uvicorn runs the lifespan shutdown
    only after the connections are done, too late to end the streams still open."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            on_exit()

    return DrainingServer(config)


def _after_graceful_shutdown(signum: int, frame: object) -> None:
    logger.info("shut down cleanly after %s", signal.Signals(signum).name)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for name, value in NATIVE_CACHE_ENV.items():
        os.environ.setdefault(name, value)
    apply_serving_default()  # OpenMP workers spin across a step's gaps, sleep between steps (engine/platform/openmp.py)
    if args.command == "serve":
        return serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
