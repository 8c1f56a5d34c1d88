"""Incremental detokenization equals tokenizer.decode of the whole output, token by token."""
import os
import random

import pytest
from tiny_models import load_default_tokenizer

from engine.detokenizer import Detokenizer
from engine.sequence import Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tokenizer():
    return load_default_tokenizer()


def stream(detok: Detokenizer, prompt: list[int], outputs: list[int], skip: bool) -> tuple[Sequence, list[str]]:
    seq = Sequence(0, prompt)
    pieces = []
    for t in outputs:
        seq.output_token_ids.append(t)
        pieces.append(detok.decode_next(seq, skip))
    pieces.append(detok.flush(seq))
    return seq, pieces


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_sequences_match_full_decode(tokenizer, skip):
    detok = Detokenizer(tokenizer)
    rng = random.Random(1 if skip else 2)
    vocab = len(tokenizer)
    num_special = max(detok.special_ids) + 1
    for _ in range(400):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 10))]
        outputs = []
        for _ in range(rng.randrange(1, 30)):
            r = rng.random()
            if r < 0.4:
                outputs.append(rng.randrange(vocab))
            elif r < 0.9:  # single-byte pieces: multi-byte characters split across tokens
                outputs.append(rng.randrange(num_special, num_special + 256))
            else:
                outputs.append(rng.randrange(num_special))
        seq, pieces = stream(detok, prompt, outputs, skip)
        assert seq.output_text == tokenizer.decode(outputs, skip_special_tokens=skip)
        assert "".join(pieces) == seq.output_text
        # The stream keeps a bounded tail of ids (for forks and the final flush), never the whole output re-decoded.
        assert len(seq.detok.ids) <= 5 + len(outputs)


def test_multibyte_characters_are_never_emitted_half_done(tokenizer):
    detok = Detokenizer(tokenizer)
    text = "Grüße aus 日本 🎉🎉 and ëmojis 👩‍💻 done"
    ids = tokenizer.encode(text)
    prompt = tokenizer.encode("Say:")
    # One token per byte piece too: encode a string whose characters are split over several tokens.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    seq, pieces = stream(detok, prompt, ids, True)
    assert seq.output_text == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[-1] == ""  # nothing was left over for the final flush


def test_spaces_and_special_tokens_like_decode(tokenizer):
    detok = Detokenizer(tokenizer)
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = tokenizer.encode("  two  spaces,\nnew line") + [im_end] + tokenizer.encode(" after") + [im_start]
    for skip in (True, False):
        seq, _ = stream(detok, tokenizer.encode("Hello"), ids, skip)
        assert seq.output_text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert "<|im_end|>" not in stream(detok, [1], ids, True)[0].output_text


def test_prompt_ending_mid_character(tokenizer):
    detok = Detokenizer(tokenizer)
    ids = tokenizer.encode("日本")
    # Split the bytes of 日 between prompt and output: the output must decode on its own.
    seq, _ = stream(detok, ids[:1], ids[1:], True)
    assert seq.output_text == tokenizer.decode(ids[1:])


def test_forked_sequences_detokenize_independently(tokenizer):
    detok = Detokenizer(tokenizer)
    seq = Sequence(0, tokenizer.encode("Once"))
    for t in tokenizer.encode(" upon a"):
        seq.output_token_ids.append(t)
        detok.decode_next(seq)
    child = seq.fork(1)
    for s, word in ((seq, " time"), (child, " hill")):
        for t in tokenizer.encode(word):
            s.output_token_ids.append(t)
            detok.decode_next(s)
    assert (seq.output_text, child.output_text) == (" upon a time", " upon a hill")
