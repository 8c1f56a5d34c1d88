"""Output processor on the real Scheduler and tokenizer: stops, forks, best_of, beams, block accounting."""
import itertools
import os

import pytest
from tiny_models import load_default_tokenizer

from engine.config import EngineConfig
from engine.output_processor import OutputProcessor
from engine.sample.sampler import Sample
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.sequence import Sequence, SequenceGroup, SequenceStatus

os.environ.setdefault("HF_HUB_OFFLINE", "1")
NUM_BLOCKS = 64


@pytest.fixture(scope="session")
def tokenizer():
    return load_default_tokenizer()


class Harness:
    """A real Scheduler + OutputProcessor; the test plays the model and the sampler."""

    def __init__(self, tokenizer, max_model_len=256):
        config = EngineConfig(block_size=8, max_model_len=max_model_len)
        config.resolve(max_model_len)
        self.tok = tokenizer
        self.eos = tokenizer.eos_token_id
        self.scheduler = Scheduler(config, NUM_BLOCKS, 0)
        self.counter = itertools.count()
        self.proc = OutputProcessor(tokenizer, max_model_len, self.eos, self.counter)

    def add(self, params, prompt="Hello"):
        ids = self.tok.encode(prompt)
        group = SequenceGroup(f"req{next(self.counter)}", [Sequence(next(self.counter), ids)], params, prompt=prompt)
        self.scheduler.add_seq_group(group)
        return group

    def step(self, choose):
        """choose(seqs) -> list[(parent_seq, token_id, logprob)] for the one scheduled group."""
        out = self.scheduler.schedule()
        self.scheduler.update_computed(out)
        (sg,) = out.scheduled
        seqs = sg.group.get_seqs(SequenceStatus.RUNNING)
        samples = [Sample(p.seq_id, t, {t: lp}) for p, t, lp in choose(seqs)]
        self.scheduler.apply(self.proc.process(sg.group, samples))
        self.scheduler.free_finished_seq_groups()
        return self.proc.to_request_output(sg.group)

    def feed(self, group, token_ids, logprob=-0.5):
        """Feed one token per step to a single-sequence group until it finishes or the tokens run out."""
        outputs = []
        for t in token_ids:
            outputs.append(self.step(lambda seqs: [(seqs[0], t, logprob)]))
            if group.is_finished():
                break
        return outputs

    def all_blocks_free(self):
        return self.scheduler.block_manager.get_num_free_device_blocks() == NUM_BLOCKS


def test_stop_string_truncates_and_streams_only_a_prefix(tokenizer):
    harness = Harness(tokenizer)
    group = harness.add(SamplingParams(stop=["world", "zzz"], max_tokens=50))
    outs = harness.feed(group, tokenizer.encode(" Hello wonderful world of tokens"))
    final = outs[-1]
    assert final.finished and final.outputs[0].text == " Hello wonderful "
    assert (final.outputs[0].finish_reason, final.outputs[0].stop_reason) == ("stop", "world")
    # Streamed text only ever grows, and never shows what the stop string later removes.
    texts = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert harness.all_blocks_free() and group.metrics.first_token_time is not None


def test_stop_string_across_tokens_with_include_stop_str(tokenizer):
    harness = Harness(tokenizer)
    group = harness.add(SamplingParams(stop=["lo wo"], include_stop_str_in_output=True))
    outs = harness.feed(group, tokenizer.encode(" Hello wonderful world"))
    assert outs[-1].outputs[0].text == " Hello wo"
    assert outs[-1].outputs[0].stop_reason == "lo wo"


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_ids(tokenizer, include):
    harness = Harness(tokenizer)
    (stop_id,) = tokenizer.encode(" end")
    group = harness.add(SamplingParams(stop_token_ids=[stop_id], include_stop_str_in_output=include))
    outs = harness.feed(group, tokenizer.encode(" one two") + [stop_id] + tokenizer.encode(" three"))
    out = outs[-1].outputs[0]
    assert out.text == (" one two end" if include else " one two")
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert out.token_ids[-1] == stop_id


def test_eos_min_tokens_and_ignore_eos(tokenizer):
    harness = Harness(tokenizer)
    words = tokenizer.encode(" a b c d")
    group = harness.add(SamplingParams(min_tokens=3))
    outs = harness.feed(group, [harness.eos, words[0], harness.eos, words[1], words[2]])
    assert outs[-1].outputs[0].token_ids == [harness.eos, words[0], harness.eos]  # the first EOS came too early
    assert (outs[-1].outputs[0].finish_reason, outs[-1].outputs[0].stop_reason) == ("stop", None)
    group = harness.add(SamplingParams(ignore_eos=True, max_tokens=3))
    outs = harness.feed(group, [harness.eos, harness.eos, harness.eos, harness.eos])
    assert len(outs) == 3 and outs[-1].outputs[0].finish_reason == "length"
    assert harness.all_blocks_free()


def test_max_tokens_and_max_model_len(tokenizer):
    harness = Harness(tokenizer)
    ids = tokenizer.encode(" the quick brown fox jumps over")
    group = harness.add(SamplingParams(max_tokens=4))
    outs = harness.feed(group, ids)
    assert outs[-1].outputs[0].token_ids == ids[:4]
    assert outs[-1].outputs[0].text == tokenizer.decode(ids[:4])
    assert outs[-1].outputs[0].finish_reason == "length"

    prompt_len = len(tokenizer.encode("Hello"))
    harness = Harness(tokenizer, max_model_len=prompt_len + 3)
    group = harness.add(SamplingParams(max_tokens=None))
    outs = harness.feed(group, ids)
    assert len(outs[-1].outputs[0].token_ids) == 3 and outs[-1].outputs[0].finish_reason == "length"
    assert harness.all_blocks_free()


def test_length_cap_flushes_a_half_finished_character(tokenizer):
    harness = Harness(tokenizer)
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1
    group = harness.add(SamplingParams(max_tokens=len(ids) - 1))
    outs = harness.feed(group, ids)
    assert outs[-1].outputs[0].text == tokenizer.decode(ids[:-1])  # "\ufffd"s, as decode gives


def test_n2_forks_share_blocks_and_free_them(tokenizer):
    harness = Harness(tokenizer)
    group = harness.add(SamplingParams(n=2, temperature=1.0, max_tokens=3), prompt="A prompt of a few tokens here")
    a, b = tokenizer.encode(" yes")[0], tokenizer.encode(" no")[0]
    out = harness.step(lambda seqs: [(seqs[0], a, -0.1), (seqs[0], b, -0.2)])
    assert len(group.seqs) == 2 and [o.index for o in out.outputs] == [0, 1]
    first_texts = [o.text for o in out.outputs]
    bm = harness.scheduler.block_manager
    # The child shares the parent's prompt blocks: the same physical ids.
    assert bm.get_block_table(group.seqs[0]) == bm.get_block_table(group.seqs[1])
    out = harness.step(lambda seqs: [(s, a, -0.1) for s in seqs])
    assert bm.get_block_table(group.seqs[0]) != bm.get_block_table(group.seqs[1])  # copy-on-write
    out = harness.step(lambda seqs: [(s, b, -0.1) for s in seqs])
    assert out.finished
    assert sorted(o.text for o in out.outputs) == [" no yes no", " yes yes no"]
    # Each index keeps streaming the same choice.
    assert all(o.text.startswith(t) for o, t in zip(out.outputs, first_texts))
    assert {o.finish_reason for o in out.outputs} == {"length"}
    assert harness.all_blocks_free()


def test_process_returns_the_forks_and_frees_and_leaves_blocks_to_the_engine(tokenizer):
    harness = Harness(tokenizer)
    group = harness.add(SamplingParams(n=2, temperature=1.0, max_tokens=2), prompt="A prompt of a few tokens here")
    bm = harness.scheduler.block_manager
    a, b = tokenizer.encode(" yes")[0], tokenizer.encode(" no")[0]

    def process(samples_of):
        out = harness.scheduler.schedule()
        harness.scheduler.update_computed(out)
        free_before, tables_before = bm.get_num_free_device_blocks(), dict(bm.block_tables)
        actions = harness.proc.process(group, [Sample(s.seq_id, t, {t: -0.1}) for s, t in samples_of(group.seqs)])
        assert (bm.get_num_free_device_blocks(), bm.block_tables) == (free_before, tables_before)  # untouched
        return actions

    parent = group.seqs[0]
    actions = process(lambda seqs: [(seqs[0], a), (seqs[0], b)])
    child = group.seqs[1]
    assert actions.forks == [(parent, child)] and actions.frees == []
    harness.scheduler.apply(actions)
    assert bm.get_block_table(child) == bm.get_block_table(parent)  # shared once the engine applies the fork
    actions = process(lambda seqs: [(s, a) for s in seqs])  # both reach max_tokens
    assert actions.forks == [] and actions.frees == [parent, child]
    harness.scheduler.apply(actions)
    harness.scheduler.free_finished_seq_groups()
    assert harness.all_blocks_free()


def test_best_of_keeps_the_most_likely_and_streams_nothing_before(tokenizer):
    harness = Harness(tokenizer)
    harness.add(SamplingParams(n=1, best_of=3, temperature=1.0, max_tokens=2))
    t = [tokenizer.encode(w)[0] for w in (" red", " green", " blue")]
    out = harness.step(lambda seqs: [(seqs[0], t[0], -2.0), (seqs[0], t[1], -0.5), (seqs[0], t[2], -1.0)])
    assert out.outputs == [] and not out.finished
    out = harness.step(lambda seqs: [(s, harness.eos if i == 0 else t[0], -0.1) for i, s in enumerate(seqs)])
    assert out.finished and len(out.outputs) == 1
    assert out.outputs[0].text == " green red" and out.outputs[0].cumulative_logprob == pytest.approx(-0.6)
    assert harness.all_blocks_free()


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_beam_search_final_ranking_with_length_penalty(tokenizer, length_penalty):
    harness = Harness(tokenizer)
    group = harness.add(SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0.0, max_tokens=3,
                                 length_penalty=length_penalty))
    w = {word: tokenizer.encode(" " + word)[0] for word in "a b c d e f g h".split()}
    last = lambda s: tokenizer.decode(s.output_token_ids[-1:]).strip()  # noqa: E731
    # Step 1: EOS is a finished hypothesis (cum -1.0, length 1); beams "a" and "b" continue, "c" is dropped.
    out = harness.step(lambda seqs: [(seqs[0], harness.eos, -1.0), (seqs[0], w["a"], -0.3), (seqs[0], w["b"], -0.4),
                               (seqs[0], w["c"], -5.0)])
    assert out.outputs == [] and sorted(last(s) for s in group.get_seqs(SequenceStatus.RUNNING)) == ["a", "b"]

    def step2(seqs):
        A, B = sorted(seqs, key=lambda s: last(s))
        return [(A, w["d"], -0.5), (B, w["e"], -0.6), (A, w["f"], -3.0), (B, w["g"], -3.0)]

    harness.step(step2)
    assert sorted(last(s) for s in group.get_seqs(SequenceStatus.RUNNING)) == ["d", "e"]

    def step3(seqs):
        D, E = sorted(seqs, key=lambda s: last(s))
        return [(D, harness.eos, -1.0), (E, w["h"], -0.1), (D, w["f"], -5.0), (E, w["g"], -5.0)]

    out = harness.step(step3)
    assert out.finished
    texts = [o.text for o in out.outputs]
    # Hypotheses: [EOS] cum -1.0 len 1; "a d EOS" cum -1.8 len 3; "b e h" cum -1.1 len 3.
    if length_penalty == 0.0:
        assert texts == ["", " b e h"]
    else:  # scores -1.0, -0.6, -0.367: length wins
        assert texts == [" b e h", " a d"]
    assert harness.all_blocks_free()


def test_beam_search_early_stopping_true_stops_once_width_hypotheses_exist(tokenizer):
    harness = Harness(tokenizer)
    group = harness.add(SamplingParams(n=1, best_of=2, use_beam_search=True, temperature=0.0, max_tokens=10,
                                 early_stopping=True))
    x = tokenizer.encode(" x")[0]
    harness.step(lambda seqs: [(seqs[0], harness.eos, -0.2), (seqs[0], harness.eos, -0.3), (seqs[0], x, -0.1), (seqs[0], x, -0.4)])
    assert group.is_finished() and harness.all_blocks_free()


def test_error_and_abort_reach_the_request_output(tokenizer):
    harness = Harness(tokenizer)
    group = harness.add(SamplingParams())
    harness.scheduler.abort_seq_group(group.request_id)
    group.error = "out of swap space"
    out = harness.proc.to_request_output(group)
    assert out.finished and out.error == "out of swap space" and out.outputs[0].finish_reason == "abort"


@pytest.mark.parametrize("stop_ids", [(), (9,), (9, 11, 13)], ids=["none", "one", "several"])
def test_row_stops_flag_the_rows_a_token_or_a_cap_may_end(stop_ids):
    """The batch's stop data (a steady decode's, kept between steps) flags a row at its stop token, EOS, cap
    (max_tokens, max_model_len) or, every step, stop strings; the other rows skip the stop checks."""
    import numpy as np

    from engine.output_processor import RowStops

    eos, max_model_len = 2, 12
    params = [SamplingParams(ignore_eos=True, stop_token_ids=list(stop_ids), max_tokens=5),  # capped after 5 tokens
              SamplingParams(ignore_eos=not stop_ids, max_tokens=None),  # max_model_len: 12 - 4 = 8 tokens
              SamplingParams(ignore_eos=True, max_tokens=7, stop=["x"])]
    rows = [(SequenceGroup(f"r{i}", [seq], p), [seq]) for i, (p, seq) in
            enumerate(zip(params, (Sequence(i, [5, 6, 7, 8]) for i in range(3))))]
    stops = RowStops(rows, eos, max_model_len)
    hit = stop_ids[-1] if stop_ids else 4
    seen = []
    for step in range(1, 9):
        tokens = np.array([hit if step == 2 else 4, eos if step == 3 else 4, hit], dtype=np.int64)
        seen.append(stops.flagged(tokens))
    assert seen[0] == {2}  # only the stop-string row
    assert seen[1] == ({0, 2} if stop_ids else {2})  # row 0's stop token
    assert seen[2] == ({1, 2} if stop_ids else {2})  # row 1's EOS (counted when it has no stop ids of its own)
    assert seen[4] == {0, 2} and seen[6] == {0, 2} and seen[7] == {0, 1, 2}  # the caps: 5, 7 (max_tokens), 8
