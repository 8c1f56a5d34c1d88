#!/usr/bin/env python
"""Write openapi.yaml from the app's own schema: create_app(...).openapi(), built from the routes and the pydantic
models (server/routes.py, server/protocol.py, server/protocol_responses.py). No model is loaded.

    python scripts/openapi.py           # rewrite openapi.yaml
    python scripts/openapi.py --check   # exit 1 if openapi.yaml differs from what this writes

tests/server/test_openapi.py compares the committed file with the app's schema.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
from types import SimpleNamespace

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
HEADER = ("# pagedserve's HTTP API, written by scripts/openapi.py from the app's pydantic models.\n"
          "# tests/server/test_openapi.py fails when this and create_app(...).openapi() disagree.\n")


def render() -> str:
    from server.app import create_app

    # The schema reads no engine state: a stand-in with the three facts create_app copies is enough.
    engine = SimpleNamespace(config=SimpleNamespace(model_name="model", max_model_len=1), vocab_size=1)
    spec = create_app(engine).openapi()
    return HEADER + yaml.safe_dump(spec, sort_keys=False, allow_unicode=True, width=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when openapi.yaml is stale")
    args = parser.parse_args(argv)
    path, text = ROOT / "openapi.yaml", render()
    if args.check:
        if path.read_text() != text:
            print("openapi.yaml is stale: run python scripts/openapi.py", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
