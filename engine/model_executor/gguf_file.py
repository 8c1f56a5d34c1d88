"""Reading a GGUF file without gguf-py's cost: its header (architecture, tensor infos) and a tensor's bytes, by plain
reads or through a read-only map of the file; GGUF tensor names as HF state-dict names
(engine/model_executor/gguf_native.py serves the file's blocks as they are).

llama.cpp's converter reorders the rows of q_proj and k_proj for its RoPE (per head, the two halves interleaved);
a row of any GGML block type holds its own blocks, so the rows are put back in HF's order exactly
(unpermute_rows: transformers' reverse_permute).
"""
from __future__ import annotations

import logging
import mmap
import re
import struct
import warnings
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Optional

import torch

logger = logging.getLogger(__name__)

# served in any GGML type (engine/model_executor/gguf_native.py); only llama permutes q / k rows
ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "phi3", "qwen3moe", "qwen2moe")
_BLOCK = {  # GGUF blk.N.<part> -> HF model.layers.N.<part>
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    # a mixture of experts: the router, and every expert's gate / up / down as one 3-D tensor [E, rows, K]
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    # Qwen2-MoE's shared expert (a dense gated MLP) and its gate (hidden -> 1, kept F32 by llama.cpp like the router)
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_ARCH_BLOCK = {  # where an architecture's names differ from _BLOCK's (gguf-py's tensor map, HF's names)
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},  # fused in the file as in HF
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LINEAR_PARTS = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")


FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class _Info(NamedTuple):
    name: str  # GGUF name
    kind: str  # gguf.GGMLQuantizationType name: Q8_0, Q4_K, F32, F16, BF16, ...
    shape: tuple[int, ...]  # torch order (rows last-dim-inner): ne reversed
    offset: int  # bytes from the file's start
    nbytes: int


def hf_name(gguf_name: str, arch: str = "llama") -> Optional[str]:
    """The HF state-dict name of a GGUF tensor name (None: a tensor the model does not take, rope_freqs)."""
    base, _, suffix = gguf_name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    block = {**_BLOCK, **_ARCH_BLOCK.get(arch, {})}
    if m and m.group(2) in block:
        return f"model.layers.{m.group(1)}.{block[m.group(2)]}.{suffix}"
    return f"{_TOP[base]}.{suffix}" if base in _TOP else None


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # GGUF value
_STRING, _ARRAY = 8, 9  # types (gguf.GGUFValueType) -> struct codes; strings: u64 length + UTF-8, arrays: type, u64 n
_KEYS = ("general.architecture", "general.alignment")  # the only metadata values read; the others are skipped


class _HeaderReader:
    """A little-endian GGUF header (v2, v3) through a read-only map of the file: the metadata values walked over
    without building them (a 49k-token vocabulary is ~100k length fields), only _KEYS read; then the tensor infos.
    gguf.GGUFReader builds every value as numpy objects: 3.6 s for a 1B Llama's header against ~0.1 s here."""

    def __init__(self, data: mmap.mmap):
        self.data, self.pos = data, 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (n,) = self.unpack("Q")
        self.pos += n
        return bytes(self.data[self.pos - n:self.pos]).decode("utf-8", errors="replace")

    def skip(self, kind: int) -> None:
        if kind in _SCALARS:
            self.pos += struct.calcsize(_SCALARS[kind])
        elif kind == _STRING:
            (n,) = self.unpack("Q")  # (not `self.pos += self.unpack(...)`: that adds to the position before it)
            self.pos += n
        elif kind == _ARRAY:
            item, n = self.unpack("IQ")
            if item in _SCALARS:
                self.pos += n * struct.calcsize(_SCALARS[item])
            else:
                for _ in range(n):
                    self.skip(item)
        else:
            raise ValueError(f"GGUF metadata value type {kind} at byte {self.pos}")

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])[0]
        if kind == _STRING:
            return self.string()
        self.skip(kind)  # an array: not needed
        return None


def _read_header(path: Path) -> tuple[str, list[_Info]]:
    """(general.architecture, the tensor infos) of a GGUF file, as gguf.GGUFReader gives them, without its cost."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        r = _HeaderReader(data)
        magic, version, n_tensors, n_kv = r.unpack("4sIQQ")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path.name} is not a little-endian GGUF v2/v3 file (magic {magic!r}, version {version})")
        meta = {}
        for _ in range(n_kv):
            key = r.string()
            (kind,) = r.unpack("I")
            if key in _KEYS:
                meta[key] = r.value(kind)
            else:
                r.skip(kind)
        raw = []
        for _ in range(n_tensors):
            name = r.string()
            (n_dims,) = r.unpack("I")
            dims = r.unpack(f"{n_dims}Q")
            kind, offset = r.unpack("IQ")
            raw.append((name, dims, kind, offset))
        alignment = int(meta.get("general.alignment") or 32)
        start = -(-r.pos // alignment) * alignment  # the tensor data, after the header padded to the alignment
    infos = []
    for name, dims, kind, offset in raw:
        qtype = GGMLQuantizationType(kind)
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        numel = 1
        for n in dims:
            numel *= n
        infos.append(_Info(name, qtype.name, tuple(reversed(dims)), start + offset, numel // block * block_bytes))
    arch = meta.get("general.architecture")
    return arch if isinstance(arch, str) else "", infos


_HEADERS: dict[tuple[str, int, int], tuple[str, list[_Info]]] = {}  # the last file's header (the check, then the load)


def header(path: Path) -> tuple[str, list[_Info]]:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HEADERS:
        _HEADERS.clear()
        _HEADERS[key] = _read_header(path)
    return _HEADERS[key]


def read_bytes(f, info: _Info, start: int = 0, nbytes: Optional[int] = None, buf: Optional[torch.Tensor] = None
          ) -> torch.Tensor:
    """Bytes [start, start + nbytes) of a tensor's data (all of it by default), read, not mapped; into the front of
    `buf` (uint8) when given."""
    nbytes = info.nbytes - start if nbytes is None else nbytes
    buf = torch.empty(nbytes, dtype=torch.uint8) if buf is None else buf[:nbytes]
    f.seek(info.offset + start)
    if f.readinto(memoryview(buf.numpy())) != nbytes:
        raise ValueError(f"GGUF tensor {info.name}: the file ends before its {info.nbytes} bytes")
    return buf


class FileRows:
    """A tensor's rows read from the file when sliced (uint8 [rows, row_bytes]; rows[r0:r1] reads those rows): the
    packers (layers/formats.py row_chunks) take a large linear a chunk at a time, so the load holds one chunk of its
    file bytes beside the packed copy, not all of them (the 1.17B's Q6_K head: 54 MB)."""

    def __init__(self, f, info: _Info, row_bytes: int):
        self.f, self.info, self.shape = f, info, (info.shape[0], row_bytes)

    def __getitem__(self, rows: slice) -> torch.Tensor:
        r0, r1, step = rows.indices(self.shape[0])
        if step != 1:
            raise ValueError("FileRows: contiguous row ranges only")
        rb = self.shape[1]
        return read_bytes(self.f, self.info, r0 * rb, (r1 - r0) * rb).view(r1 - r0, rb)


def is_linear(info: _Info) -> bool:
    """A linear layer's weight (attention, MLP, the head)."""
    return info.name.endswith(".weight") and (info.name.split(".")[-2] in LINEAR_PARTS or info.name == "output.weight")


def row_bytes(info: _Info) -> int:
    """Bytes of one row of a 2-D tensor (its blocks along K)."""
    return info.nbytes // info.shape[0]


def map_rows(path: Path, info: _Info) -> tuple[torch.Tensor, Callable[[], None]]:
    """A 2-D tensor's bytes, uint8 [rows, row_bytes], through a read-only map of the file: nothing is read until a
    row is, and then only its pages (no read-ahead around them); and a release() that unmaps the pages read so far
    (MADV_DONTNEED: they stay in the kernel's page cache, out of the process's resident set). Without it a page
    fault mapped the cached pages around each row too (the file was just read whole): 36 MiB for one request of 144
    tokens, and all ~100 MiB after a few hundred distinct tokens. The file must stay in place, unchanged, while the
    map lives (as for llama.cpp's mmap)."""
    rows = info.shape[0]
    if len(info.shape) != 2 or info.nbytes % rows:
        raise ValueError(f"GGUF tensor {info.name}: {info.nbytes} bytes do not make {rows} rows")
    start = info.offset // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), info.offset + info.nbytes - start, access=mmap.ACCESS_READ, offset=start)
    if hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)
    with warnings.catch_warnings():  # "not writable": the rows are only ever gathered (copied) out of it
        warnings.simplefilter("ignore", UserWarning)
        data = torch.frombuffer(mapped, dtype=torch.uint8)  # keeps the map open as long as it lives
    dontneed = getattr(mmap, "MADV_DONTNEED", None)
    release = (lambda: mapped.madvise(dontneed)) if dontneed is not None else (lambda: None)
    return data[info.offset - start:info.offset - start + info.nbytes].view(rows, -1), release


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's RoPE permutation of q_proj / k_proj (transformers' reverse_permute)."""
    dim = rows // heads // 2
    return torch.arange(rows).view(heads, dim, 2).transpose(1, 2).reshape(rows)


def vector_tensors(path: Path, infos: list[_Info], arch: str, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's float tensors the model holds as floats, HF-named: the 1-D ones (norms, biases; q / k biases
    un-permuted, Gemma's norms shifted back) and a mixture of experts' router and shared expert's gate (2-D, kept
    F32 by llama.cpp)."""
    with open(path, "rb") as f:
        for info in infos:
            name = hf_name(info.name, arch)
            router = name is not None and name.endswith((".mlp.gate.weight", ".mlp.shared_expert_gate.weight"))
            if name is None or (len(info.shape) != 1 and not router):
                continue
            if info.kind not in FLOAT_TYPES:
                raise ValueError(f"GGUF tensor {info.name} is {info.kind}: a 1-D tensor or a router must be F32, "
                                 "F16 or BF16")
            t = read_bytes(f, info).view(FLOAT_TYPES[info.kind]).view(info.shape)
            if arch == "gemma3" and name.endswith("norm.weight"):  # llama.cpp's converter stores Gemma's 1 + w
                t = t.float() - 1.0
            if arch == "llama" and (".q_proj." in name or ".k_proj." in name):  # a bias, permuted as its rows
                heads = hf_config.num_attention_heads if ".q_proj." in name else hf_config.num_key_value_heads
                t = t[unpermute_rows(t.shape[0], heads)]
            yield name, t
