"""Every file a doc or a comment points at is in the repository: no absolute paths, no missing documents."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# A path-like reference: optional folders, then a name with one of the repository's file kinds.
# (Generated outputs, .json and .png under results/, are written, not read: not references.)
REFERENCE = re.compile(r"(?<![\w.$/-])(/?(?:[\w.-]+/)*[\w-]+\.(?:md|py|yaml|yml|toml|sh|cpp|cu|cuh|h))\b")


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / line for line in out.splitlines()]


def _texts() -> list[tuple[Path, str]]:
    """Docs whole; of code, only the comments and docstrings (string literals in code may name anything)."""
    out = []
    for path in _tracked():
        if path.suffix == ".md" or path.name == "Makefile":
            out.append((path, path.read_text(errors="replace")))
        elif path.suffix in (".py", ".cpp", ".cu", ".cuh", ".h", ".sh") and path.exists():
            text = path.read_text(errors="replace")
            if path.suffix in (".py", ".sh"):
                comments = re.findall(r"#[^\n]*", text) + re.findall(r'"""(.*?)"""', text, re.S)
            else:  # C++ / CUDA: // and /* */ (a #include names a header, found by the compiler)
                comments = re.findall(r"//[^\n]*", text) + re.findall(r"/\*.*?\*/", text, re.S)
            out.append((path, "\n".join(comments)))
    return out


def test_every_referenced_file_exists_in_the_repository():
    tracked = _tracked()
    top_level = {p.relative_to(ROOT).parts[0] for p in tracked} | {".", ".."}
    names = {p.name for p in tracked}
    relative = {p.relative_to(ROOT).as_posix() for p in tracked}
    missing = []
    for path, text in _texts():
        for ref in set(REFERENCE.findall(text)):
            if ref.startswith("/"):
                if not ref.startswith("/tmp/"):  # scratch files a command writes are fine
                    missing.append(f"{path.relative_to(ROOT)}: absolute path {ref}")
            elif "/" in ref:
                if ref.startswith("benchmarks/results/"):
                    continue  # a report a script writes (scripts/gpu_check.sh), not a file to read
                if ref.split("/")[0] not in top_level:
                    continue  # another project's path (torch/extension.h), not this repository's
                candidates = {ref, (path.parent.relative_to(ROOT) / ref).as_posix()}
                if not candidates & relative and not any(r.endswith("/" + ref) for r in relative):
                    missing.append(f"{path.relative_to(ROOT)}: {ref}")
            elif ref not in names and ref.endswith(".md"):
                missing.append(f"{path.relative_to(ROOT)}: {ref}")
    assert missing == []
