"""A GGUF file's config and tokenizer without transformers' GGUF loaders at every start (issue 42: memory).

transformers builds a GGUF's config through its config classes, whose import pulls in sympy and
torch.distributed.tensor (~100 MiB of resident modules a server keeps), and converts the file's vocabulary into a
tokenizer on every load. Here the config of a Llama-family file (gguf_config) is read from the file's metadata as
transformers' GGUF loader maps it, and the tokenizer (gguf_tokenizer) is converted by transformers once, then kept
under the cache folder as tokenizer.json + tokenizer_config.json (+ chat template) and loaded back with
PreTrainedTokenizerFast, which imports no config class. A file of another architecture, or a cache that cannot be
read or written, takes transformers' path as before.
"""
from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

from engine.model_executor.gguf_file import _ARRAY, _SCALARS, _HeaderReader

logger = logging.getLogger(__name__)

# GGUF <arch>.<key> -> HF config field, as transformers' GGUF loader (integrations/ggml.py) maps them.
_FIELDS = {
    "context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size", "rope.dimension_count": "head_dim",
    "rope.freq_base": "rope_theta", "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
# A mixture of experts' keys (llama.cpp's qwen3moe and qwen2moe, and a llama file with experts: Mixtral).
_EXPERT_FIELDS = {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
                  "expert_feed_forward_length": "moe_intermediate_size", "attention.key_length": "head_dim",
                  "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}
_TOKEN_IDS = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "padding", "unk_token_id": "unknown"}
# What the config class (LlamaConfig, MistralConfig, Qwen2Config) gives a field the file does not state.
_DEFAULTS = {
    "llama": dict(max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
                  attention_bias=False, mlp_bias=False),
    "mistral": dict(max_position_embeddings=4096 * 32, rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1,
                    eos_token_id=2, sliding_window=4096),
    "qwen2": dict(max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=10000.0, use_sliding_window=False),
    # llama.cpp's qwen3moe always renormalises the chosen experts' weights (norm_topk_prob), every layer sparse
    "qwen3_moe": dict(max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=10000.0, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False),
    # llama.cpp's qwen2moe: softmax top-k weights not renormalised, every layer sparse, q / k / v biases
    "qwen2_moe": dict(max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=10000.0, use_sliding_window=False,
                      norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True,
                      shared_expert_intermediate_size=0),
    "mixtral": dict(max_position_embeddings=4096 * 32, rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None),
}
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# Newer families: the mapped fields go through transformers' own config class (its import is light: no sympy), so
# their defaults and derived fields (Gemma 3's layer_types and per-type RoPE) are HF's. model_type as transformers
# names the text model; the extra GGUF keys each reads beyond _FIELDS.
_CONFIG_CLASSES = {"qwen3": ("qwen3", "Qwen3Config"), "gemma3": ("gemma3_text", "Gemma3TextConfig"),
                   "phi3": ("phi3", "Phi3Config")}
_EXTRA_FIELDS = {
    # transformers reads no head_dim for qwen3 (Qwen3Config then says 128): llama.cpp writes it as key_length
    "qwen3": {"attention.key_length": "head_dim"},
    "gemma3": {"attention.key_length": "head_dim", "attention.sliding_window": "sliding_window",
               "final_logit_softcapping": "final_logit_softcapping"},
    "phi3": {"attention.sliding_window": "sliding_window",
             "rope.scaling.original_context_length": "original_max_position_embeddings"},
}
CACHE_FORMAT = 1  # bump when what a cache entry holds changes
_SMALL_ARRAY = 4096


class GGUFConfig:
    """The HF config fields pagedserve reads of a Llama-family GGUF, as transformers' GGUF config gives them."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def __repr__(self) -> str:
        return f"GGUFConfig({', '.join(f'{k}={v!r}' for k, v in sorted(self.__dict__.items()))})"


def read_metadata(path: Path) -> tuple[dict[str, Any], list[str]]:
    """(metadata, tensor names) of a GGUF file: scalar and string values as they are, an array of up to
    _SMALL_ARRAY numbers as a list (Gemma 3's per-layer sliding-window pattern), any other array as its length."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        r = _HeaderReader(data)
        magic, version, n_tensors, n_kv = r.unpack("4sIQQ")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path.name} is not a little-endian GGUF v2/v3 file (magic {magic!r}, version {version})")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = r.string()
            (kind,) = r.unpack("I")
            if kind == _ARRAY:
                item, meta[key] = r.unpack("IQ")
                if item in _SCALARS and meta[key] <= _SMALL_ARRAY:
                    meta[key] = [r.value(item) for _ in range(meta[key])]
                else:
                    r.pos -= 12
                    r.skip(kind)
            else:
                meta[key] = r.value(kind)
        names = []
        for _ in range(n_tensors):
            names.append(r.string())
            (n_dims,) = r.unpack("I")
            r.pos += 8 * n_dims + 12  # dims (u64 each), type (u32), offset (u64)
    return meta, names


def gguf_config(path: Path) -> Optional[Any]:
    """The config of a llama / qwen2 GGUF from its metadata (None for another architecture: transformers builds
    it); a qwen3 / gemma3 / phi3 file's through transformers' config class (_family_config). Like transformers: a llama file named exactly "mistral" is a Mistral, the head is tied when the file
    has no output.weight, the vocabulary's size is the token list's when the file does not state it, and
    rope scaling keys are not read."""
    meta, names = read_metadata(path)
    arch = meta.get("general.architecture")
    if arch in _CONFIG_CLASSES:
        return _family_config(path, arch, meta, names)
    if arch not in ("llama", "qwen2", "qwen3moe", "qwen2moe"):
        return None
    model_type = "mistral" if arch == "llama" and meta.get("general.name") == "mistral" else arch
    if arch == "llama" and meta.get("llama.expert_count"):
        model_type = "mixtral"
    model_type = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}.get(arch, model_type)
    fields: dict[str, Any] = dict(_DEFAULTS[model_type])
    for key, field in _FIELDS.items():
        if f"{arch}.{key}" in meta and not (arch == "qwen2" and field == "head_dim"):  # transformers skips it
            fields[field] = meta[f"{arch}.{key}"]
    for key, field in _EXPERT_FIELDS.items():
        if f"{arch}.{key}" in meta:
            fields[field] = meta[f"{arch}.{key}"]
    if model_type == "mixtral":  # Mixtral's names: the experts' width is its intermediate_size
        fields["num_local_experts"] = fields.pop("num_experts")
    for field, key in _TOKEN_IDS.items():
        if f"tokenizer.ggml.{key}_token_id" in meta:
            fields[field] = meta[f"tokenizer.ggml.{key}_token_id"]
    if "vocab_size" not in fields and "tokenizer.ggml.tokens" in meta:
        fields["vocab_size"] = meta["tokenizer.ggml.tokens"]
    missing = [f for f in _REQUIRED + ("vocab_size",) if f not in fields]
    if missing:
        raise ValueError(f"{path.name}: the GGUF metadata has no {arch}.* key for {', '.join(missing)}")
    fields.setdefault("num_key_value_heads", fields["num_attention_heads"])
    if model_type != "qwen2":
        fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    fields["rope_parameters"] = {"rope_theta": float(fields.pop("rope_theta")), "rope_type": "default"}
    if model_type == "qwen2_moe":
        fields["qkv_bias"] = "blk.0.attn_q.bias" in names
    archs = {"qwen3_moe": ["Qwen3MoeForCausalLM"], "qwen2_moe": ["Qwen2MoeForCausalLM"],
             "mixtral": ["MixtralForCausalLM"]}.get(model_type)
    return GGUFConfig(model_type=model_type, architectures=archs, hidden_act="silu",
                      tie_word_embeddings="output.weight" not in names, dtype=None, **fields)


def _family_config(path: Path, arch: str, meta: dict[str, Any], names: list[str]):
    """A qwen3 / gemma3 / phi3 GGUF's config as transformers' config class builds it from the mapped fields, with
    what llama.cpp's loader reads and transformers' does not: the head size (key_length), the sliding window; for
    Gemma 3 the attention scale (llama.cpp: 1/sqrt(head size), 1/sqrt(hidden / heads) at 27B's 62 layers; the HF
    config's query_pre_attn_scalar, which the file does not hold), the final soft-cap, the local RoPE base and a
    linear RoPE scaling of the global layers; Phi-3's longrope factors (_longrope: tensors the converter writes,
    which transformers' GGUF loader does not read)."""
    import importlib

    model_type, class_name = _CONFIG_CLASSES[arch]
    fields: dict[str, Any] = {}
    for key, field in {**_FIELDS, **_EXTRA_FIELDS[arch]}.items():
        if f"{arch}.{key}" in meta and not (key == "rope.dimension_count"):  # (transformers maps it to None here)
            fields[field] = meta[f"{arch}.{key}"]
    for field, key in _TOKEN_IDS.items():
        if f"tokenizer.ggml.{key}_token_id" in meta:
            fields[field] = meta[f"tokenizer.ggml.{key}_token_id"]
    if "vocab_size" not in fields and "tokenizer.ggml.tokens" in meta:
        fields["vocab_size"] = meta["tokenizer.ggml.tokens"]
    missing = [f for f in _REQUIRED + ("vocab_size",) if f not in fields]
    if missing:
        raise ValueError(f"{path.name}: the GGUF metadata has no {arch}.* key for {', '.join(missing)}")
    theta = fields.pop("rope_theta", None)
    if arch == "phi3" and not fields.get("sliding_window"):
        fields["sliding_window"] = None  # llama.cpp writes 0 for "none" (Phi-4)
    if arch == "gemma3":
        # llama.cpp: no window, no sliding layers; else every 6th layer global unless the file says which
        pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 6)
        n = fields["num_hidden_layers"]
        if not fields.get("sliding_window"):
            fields["layer_types"] = ["full_attention"] * n
        elif isinstance(pattern, list):
            fields["layer_types"] = ["sliding_attention" if swa else "full_attention" for swa in pattern]
        else:
            fields["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        wide = fields["num_hidden_layers"] == 62  # 27B: llama.cpp scales by hidden / heads
        fields["query_pre_attn_scalar"] = (fields["hidden_size"] // fields["num_attention_heads"] if wide
                                           else fields.get("head_dim", 256))
        full: dict[str, Any] = {"rope_type": "default", "rope_theta": float(theta or 1_000_000.0)}
        if meta.get(f"{arch}.rope.scaling.type") == "linear" and meta.get(f"{arch}.rope.scaling.factor", 1.0) != 1.0:
            full = {"rope_type": "linear", "rope_theta": full["rope_theta"],
                    "factor": float(meta[f"{arch}.rope.scaling.factor"])}
        local = float(meta.get(f"{arch}.rope.freq_base_swa", 10_000.0))
        fields["rope_parameters"] = {"sliding_attention": {"rope_type": "default", "rope_theta": local},
                                     "full_attention": full}
    elif theta is not None:
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": float(theta)}
    if arch == "phi3" and "rope_factors_long.weight" in names:
        fields["rope_parameters"] = _longrope(path, meta, fields, theta)
    module = importlib.import_module(f"transformers.models.{model_type.removesuffix('_text')}.configuration_"
                                     f"{model_type.removesuffix('_text')}")
    config = getattr(module, class_name)(tie_word_embeddings="output.weight" not in names, **fields)
    config.architectures = None
    return config


def _longrope(path: Path, meta: dict[str, Any], fields: dict[str, Any], theta) -> dict[str, Any]:
    """A Phi-3 file's longrope ("su") parameters as its HF config held them: llama.cpp's converter writes the long and
    short factors as F32 tensors rope_factors_long / rope_factors_short [head_dim / 2] and the attention factor as
    rope.scaling.attn_factor, which is HF's default for the context lengths (sqrt(1 + ln(s) / ln(original))), so it
    is passed on only where it differs from that."""
    import math

    from engine.model_executor.gguf_file import FLOAT_TYPES, header, read_bytes

    _, infos = header(path)
    factors = {}
    with open(path, "rb") as f:
        for info in infos:
            if info.name in ("rope_factors_long.weight", "rope_factors_short.weight"):
                if info.kind not in FLOAT_TYPES:
                    raise ValueError(f"{path.name}: {info.name} is {info.kind}, not a float tensor")
                factors[info.name.split("_")[2].split(".")[0]] = \
                    read_bytes(f, info).view(FLOAT_TYPES[info.kind]).float().tolist()
    if set(factors) != {"long", "short"}:
        raise ValueError(f"{path.name}: rope_factors_long without rope_factors_short")
    original = fields.get("original_max_position_embeddings")
    if not original:
        raise ValueError(f"{path.name}: longrope factors without phi3.rope.scaling.original_context_length")
    params: dict[str, Any] = {"rope_type": "longrope", "rope_theta": float(theta or 10000.0),
                              "long_factor": factors["long"], "short_factor": factors["short"],
                              "original_max_position_embeddings": original}
    scale = fields.get("max_position_embeddings", original) / original
    default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
    attn = meta.get("phi3.rope.scaling.attn_factor")
    if attn is not None and abs(float(attn) - default) > 1e-6:
        params["attention_factor"] = float(attn)
    return params


def _identity(path: Path) -> dict[str, Any]:
    import tokenizers
    import transformers

    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "format": CACHE_FORMAT,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


def gguf_tokenizer(path: Path, cache: Path):
    """The GGUF's tokenizer (a PreTrainedTokenizerFast): from its conversion under cache/gguf-tokenizers when one
    was kept for this file (same path, size, mtime, library versions), else converted by transformers and kept."""
    identity = _identity(path)
    entry = cache / "gguf-tokenizers" / hashlib.sha256(identity["path"].encode()).hexdigest()[:16]
    try:
        if json.loads((entry / "source.json").read_text()) == identity:
            from transformers import PreTrainedTokenizerFast

            return _with_family_template(PreTrainedTokenizerFast.from_pretrained(str(entry), local_files_only=True),
                                         path)
    except FileNotFoundError:
        pass
    except Exception as e:  # a damaged entry: convert again, and replace it
        logger.warning("the cached tokenizer in %s cannot be read (%s); converting %s's again", entry, e, path.name)
    from transformers import AutoTokenizer

    tokenizer = _with_family_template(
        AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True), path)
    if getattr(tokenizer, "_tokenizer", None) is not None:  # a fast tokenizer: what tokenizer.json holds
        try:
            _keep(tokenizer, identity, entry)
        except OSError as e:
            logger.warning("cannot keep %s's tokenizer under %s (%s): every start converts it again", path.name,
                           entry.parent, e)
    return tokenizer


def _with_family_template(tokenizer, path: Path):
    """A file without tokenizer.chat_template gets its family's HF template (chat_templates.py), as the HF model's
    tokenizer has it."""
    if not getattr(tokenizer, "chat_template", None):
        from engine.model_executor.chat_templates import family_chat_template

        template = family_chat_template(read_metadata(path)[0].get("general.architecture"))
        if template is not None:
            tokenizer.chat_template = template
    return tokenizer


def _keep(tokenizer, identity: dict[str, Any], entry: Path) -> None:
    """Save the tokenizer as entry/, whole or not at all (a folder renamed into place), replacing an older one;
    entries of files that no longer exist are removed."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    _prune(entry.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-", dir=entry.parent))
    try:
        tokenizer.save_pretrained(str(tmp))
        (tmp / "source.json").write_text(json.dumps(identity) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp's folder is private; a cache is shared
        for file in tmp.iterdir():
            os.chmod(file, 0o644)
        if entry.exists():
            shutil.rmtree(entry, ignore_errors=True)
        try:
            os.rename(tmp, entry)
        except OSError:
            if not (entry / "source.json").exists():  # not a concurrent start that kept it first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _prune(folder: Path) -> None:
    for source in folder.glob("*/source.json"):
        try:
            gone = not Path(json.loads(source.read_text())["path"]).exists()
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if gone:
            shutil.rmtree(source.parent, ignore_errors=True)
