"""GGML block weights on a model (issue 53): `--quantization q4_k` / `q4_0` / ... on a float checkpoint, and the
token embeddings that gather their rows from block bytes (a GGUF file's map, or a copy quantized at load).

A linear's blocks go to the weight-format registry (engine/model_executor/layers/formats.py, attach_quantized_linear),
which packs them for its kernel; the embedding keeps the blocks as GGUF lays them out (a step gathers a few rows) and
dequantizes only the rows it gathers. A GGML type without a registry format (Q2_K, Q3_K, the IQ types) is dequantized
by gguf-py (rows_dequantizer), with a warning naming it: never refused.
"""
from __future__ import annotations

import logging
import types
from typing import Callable, Optional

import numpy as np
import torch
from torch import nn

from engine.model_executor.layers import formats
from engine.model_executor.layers.ggml_quantize import fallback_type, quantize_rows

logger = logging.getLogger(__name__)

FLOAT_KINDS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
BLOCK_QUANTIZATIONS = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1", "q4_k": "Q4_K",
                       "q5_k": "Q5_K", "q6_k": "Q6_K"}  # --quantization choice -> GGML type


def registry_format(kind: str) -> Optional["formats.WeightFormat"]:
    """The registry's format for a GGML type name (None: a type without kernels, Q2_K, Q3_K, IQ*). Whether this
    CPU's kernels run it is the registry's matter (attach_quantized_linear warns where they do not)."""
    return formats.get_format(kind)


def rows_dequantizer(kind: str, k: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """raw uint8 [m, row_bytes] of a `kind` tensor with rows of k weights -> float32 [m, k]: a float type viewed, a
    registry format's dequantize, else gguf-py's (numpy) dequantization."""
    if kind in FLOAT_KINDS:
        return lambda raw: raw.view(FLOAT_KINDS[kind]).float()
    fmt = formats.get_format(kind)
    if fmt is not None:
        return lambda raw: fmt.dequantize(raw)[:, :k]
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    return lambda raw: torch.from_numpy(np.ascontiguousarray(
        gguf.quants.dequantize(raw.numpy(), qtype)).reshape(raw.shape[0], -1)[:, :k])


def _block_embedding_forward(self: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.num_embeddings):
        raise IndexError(f"token id out of range [0, {self.num_embeddings}) for a {self._block_kind} embedding")
    raw = self._block_rows[input_ids.reshape(-1)]  # [m, row_bytes]: only these rows' bytes are read (copied)
    rows = self._block_dequantize(raw).to(self._block_dtype)  # [m, embedding_dim]
    if self._block_release is not None:
        self._block_release()
    return rows.view(*input_ids.shape, self.embedding_dim)


def attach_block_embedding(emb: nn.Embedding, rows: torch.Tensor, kind: str, dtype: torch.dtype,
                           release: Optional[Callable[[], None]] = None) -> None:
    """emb gathers its rows from `rows` (uint8 [num_embeddings, row_bytes], a `kind` tensor as GGUF lays it out: a
    read-only map of the file or a copy quantized at load), dequantized to dtype; release(), when given, is called
    after each gather (a map lets go of the pages it read). Its float weight is released."""
    if rows.dim() != 2 or rows.shape[0] != emb.num_embeddings:
        raise ValueError(f"a {kind} embedding of {emb.num_embeddings} x {emb.embedding_dim} got rows "
                         f"{tuple(rows.shape)}")
    emb._block_rows, emb._block_kind, emb._block_dtype, emb._block_release = rows, kind, dtype, release
    emb._block_dequantize = rows_dequantizer(kind, emb.embedding_dim)
    emb.weight = nn.Parameter(emb.weight.new_empty(0), requires_grad=False)
    emb.forward = types.MethodType(_block_embedding_forward, emb)


def warn_dequantized(kind: str, tensors: list[str], held_as: str) -> None:
    logger.warning("GGUF type %s has no kernel in pagedserve on this CPU: %d tensor(s) (%s) dequantized at load and "
                   "held as %s", kind, len(tensors), ", ".join(tensors[:3]) + (", ..." if len(tensors) > 3 else ""),
                   held_as)


@torch.no_grad()
def quantize_model(model: nn.Module, quantization: str) -> dict[str, int]:
    """`--quantization q4_k` (q4_0, ...) on a loaded float model: every CPU nn.Linear (the head included) holds its
    weight as that GGML type's blocks (llama.cpp's fallback type where the row width is not a multiple of the block:
    Q4_K -> Q5_0 for SmolLM2's 576-wide rows), its float weight released as soon as its copy exists; a token
    embedding gathers its rows from blocks of the same type (a tied one from a copy of the head's). Returns how
    many linears each type holds."""
    from engine.model_executor.layers.cpu_linear import _trim_heap

    want = BLOCK_QUANTIZATIONS[quantization]
    linears = [m for m in model.modules() if type(m) is nn.Linear and m.weight.device.type == "cpu"
               and m.weight.numel() > 0]
    embeddings = {e.weight.untyped_storage().data_ptr(): e for e in model.modules()
                  if type(e) is nn.Embedding and e.weight.numel() > 0 and e.max_norm is None}
    counts: dict[str, int] = {}
    for linear in linears:
        w = linear.weight.detach()
        kind = fallback_type(want, w.shape[1])
        fmt = registry_format(kind)
        raw = quantize_rows(w, kind)  # [N, row_bytes]
        emb = embeddings.pop(w.untyped_storage().data_ptr(), None)
        dtype = w.dtype
        formats.attach_quantized_linear(linear, [(fmt, raw)])
        if emb is not None and tuple(emb.weight.shape) == tuple(w.shape):
            attach_block_embedding(emb, raw, kind, dtype)  # the head's blocks, kept as the file would hold them
        counts[kind] = counts.get(kind, 0) + 1
        del w, raw
        _trim_heap()
    for emb in embeddings.values():  # untied: its own copy, the type its rows allow
        w = emb.weight.detach()
        kind = fallback_type(want, w.shape[1])
        attach_block_embedding(emb, quantize_rows(w, kind), kind, w.dtype)
        del w
        _trim_heap()
    logger.info("quantized %d linear layers to GGML blocks (%s)", len(linears),
                ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return counts

