"""Speculative decoding: proposals (n-gram lookup, a draft model), one target forward over each speculating
sequence's k + 1 positions, acceptance that keeps the outputs (greedy) or their distribution (sampling), and a
cost model that turns it off where it would not pay (docs/internals.md, "Speculative decoding")."""
from __future__ import annotations


def build_spec_decoder(config, engine):
    """The engine's SpecDecoder for config.speculative_config, or None (no speculation)."""
    spec = config.speculative_config
    if spec is None:
        return None
    from engine.spec_decode.decoder import SpecDecoder

    draft = None
    if spec.method == "draft_model" and config.tensor_parallel_size > 1:
        raise ValueError("speculative_config: a draft model does not run under tensor parallelism yet; use "
                         "method \"ngram\", or --tensor-parallel-size 1.")
    if spec.method == "draft_model":
        from engine.spec_decode.draft import DraftProposer

        draft = DraftProposer.build(spec, engine)
    return SpecDecoder(spec, config.max_model_len, draft)
