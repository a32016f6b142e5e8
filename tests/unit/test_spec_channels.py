"""Speculative decoding's per-channel counters: the Harmony channel tracker over synthetic token
streams, the speculator's booking, /metrics, and the bundled pair through the engine."""

from __future__ import annotations

import pytest

from noesis.planner.sequence import Sequence
from noesis.sampling.params import SamplingParams
from noesis.speculative import SpeculativeConfig
from noesis.speculative.channels import ChannelScheme, HarmonyIds
from noesis.speculative.proposer import NgramProposer
from noesis.speculative.speculator import COUNTERS, Speculator

# A Harmony vocabulary in miniature: the noesis-tiny special ids, and a few words.
SPECIALS = {"<|start|>": 2, "<|end|>": 3, "<|message|>": 4, "<|channel|>": 5,
            "<|constrain|>": 6, "<|return|>": 7, "<|call|>": 8}
WORDS = {100: "assistant", 101: "analysis", 102: "final", 103: "commentary",
         104: " to=functions.calculator ", 105: "json", 106: " hi", 107: "fin", 108: "al",
         109: "user", 110: "mystery", 111: " json"}
START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = range(2, 9)
(ASSISTANT, ANALYSIS, FINAL, COMMENTARY, TO_CALC, JSON, HI, FIN, AL, USER, MYSTERY,
 SPACE_JSON) = range(100, 112)


class FakeTokenizer:
    def token_to_id(self, token: str) -> int | None:
        return SPECIALS.get(token)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        assert not skip_special_tokens
        return "".join(WORDS[t] for t in token_ids)


def channels_of(stream: list[int]) -> list[str]:
    """The channel the tracker gives each position of `stream`, fed one token at a time."""
    tracker = ChannelScheme.of(FakeTokenizer()).tracker()
    out = []
    for end in range(len(stream)):
        out.append(tracker.channel)
        tracker.advance(stream[: end + 1])
    return out


def test_harmony_stream_positions_get_their_message_channel():
    stream = [
        START, ASSISTANT, CHANNEL, ANALYSIS, MESSAGE, HI, HI, END,
        START, ASSISTANT, CHANNEL, COMMENTARY, TO_CALC, CONSTRAIN, JSON, MESSAGE, HI, CALL,
        CHANNEL, FIN, AL, MESSAGE, HI, RETURN,  # no <|start|>; the name split in two tokens
        START, USER, MESSAGE, HI,  # content under no channel
        START, ASSISTANT, CHANNEL, MYSTERY, MESSAGE, HI,  # an unknown channel
    ]
    header = ["header"]
    want = (header * 5 + ["analysis"] * 3 + header * 8 + ["commentary"] * 2 + header * 4
            + ["final"] * 2 + header * 3 + ["other"] * 2 + header * 4 + ["other"])
    assert channels_of(stream) == want


def test_recipient_before_channel_and_every_closer():
    # openai_harmony's order: `<|start|>assistant to=functions.x<|channel|>commentary json`.
    stream = [START, ASSISTANT, TO_CALC, CHANNEL, COMMENTARY, SPACE_JSON, MESSAGE, HI, RETURN, HI]
    assert channels_of(stream)[7:] == ["commentary", "commentary", "header"]
    for closer in (END, CALL, RETURN):
        assert channels_of([CHANNEL, FINAL, MESSAGE, HI, closer, HI])[-1] == "header"


def test_tokenizer_without_harmony_tokens_has_one_text_channel():
    class Plain(FakeTokenizer):
        def token_to_id(self, token: str) -> int | None:
            return None if token == "<|constrain|>" else super().token_to_id(token)

    scheme = ChannelScheme.of(Plain())
    assert scheme.names == ("text",) and HarmonyIds.of(Plain().token_to_id) is None
    tracker = scheme.tracker()
    assert tracker.advance([CHANNEL, FINAL, MESSAGE, HI]) == 4 and tracker.channel == "text"
    harmony = ChannelScheme.of(FakeTokenizer()).names
    assert harmony == ("analysis", "commentary", "final", "header", "other")


def test_a_tracker_refuses_a_shrinking_sequence():
    tracker = ChannelScheme.of(FakeTokenizer()).tracker()
    tracker.advance([START, ASSISTANT])
    with pytest.raises(AssertionError):
        tracker.advance([START])


def new_seq(prompt: list[int]) -> Sequence:
    return Sequence(seq_id=7, request_id="r", token_ids=list(prompt), prompt_len=len(prompt),
                    params=SamplingParams(temperature=0), max_len=64, seed=0)


def take(speculator: Speculator, seq: Sequence, tokens: list[int], proposed: int) -> None:
    """One step as the engine books it: the tokens joined the sequence, then record."""
    seq.token_ids += tokens
    speculator.record(seq, proposed, len(tokens) - 1)


def test_speculator_books_each_row_to_the_channel_of_its_first_position():
    config = SpeculativeConfig(method="ngram", k=4, adaptive=False)
    speculator = Speculator(config, NgramProposer(4, 2), ChannelScheme.of(FakeTokenizer()))
    seq = new_seq([START, USER, MESSAGE, HI, END, START, ASSISTANT])
    assert speculator.wants(seq)  # makes its depth controller, as the engine's step does
    take(speculator, seq, [CHANNEL], 0)  # the prompt's sampled token: a plain row
    take(speculator, seq, [ANALYSIS, MESSAGE, HI], 4)  # header row: 2 of 4 accepted
    take(speculator, seq, [HI, HI, HI, HI, END], 4)  # analysis row: all 4 accepted
    take(speculator, seq, [START], 0)  # a plain step in the header
    take(speculator, seq, [CHANNEL, FINAL, MESSAGE], 3)  # header row crossing into final
    take(speculator, seq, [HI], 2)  # final row: none accepted
    channels = speculator.channels
    assert channels["header"] == dict(verify_rows=2, proposed=7, accepted=4, target_rows=4,
                                      generated=8)
    assert channels["analysis"] == dict(verify_rows=1, proposed=4, accepted=4, target_rows=1,
                                        generated=5)
    assert channels["final"] == dict(verify_rows=1, proposed=2, accepted=0, target_rows=1,
                                     generated=1)
    assert channels["commentary"] == dict.fromkeys(COUNTERS, 0)
    for key in COUNTERS:  # the channels split the totals
        assert speculator.counts[key] == sum(c[key] for c in channels.values())
    assert speculator.counts["generated"] == len(seq.output_ids)
    summary = speculator.summary()
    analysis = summary["channels"]["analysis"]
    assert (analysis["acceptance"], analysis["mean_accepted_length"]) == (1.0, 4.0)
    assert analysis["tokens_per_verify"] == 5.0
    assert summary["channels"]["commentary"]["acceptance"] is None
    assert summary["tokens_per_target_row"] == 14 / 6 and summary["acceptance"] == 8 / 13
    speculator.release(seq)
    assert not speculator._trackers


def test_metrics_serve_one_family_per_counter_with_a_channel_label():
    from noesis.server.metrics import _spec_channel_metrics

    channels = {"analysis": dict(verify_rows=3, proposed=9, accepted=6, target_rows=5,
                                 generated=11),
                "final": dict.fromkeys(COUNTERS, 0)}
    families = {f.name: f for f in _spec_channel_metrics(channels)}
    assert set(families) == {f"noesis_spec_channel_{key}" for key in COUNTERS}
    samples = families["noesis_spec_channel_accepted"].samples
    assert {(s.labels["channel"], s.value) for s in samples} == {("analysis", 6), ("final", 0)}
    assert list(_spec_channel_metrics({})) == []  # speculation off: no families


def test_eval_report_line_prints_each_channel():
    from noesis.cli import _speculative_line

    config = SpeculativeConfig(method="ngram", k=4, adaptive=False)
    speculator = Speculator(config, NgramProposer(4, 2), ChannelScheme.of(FakeTokenizer()))
    seq = new_seq([START, ASSISTANT, CHANNEL, ANALYSIS, MESSAGE])
    speculator.wants(seq)
    take(speculator, seq, [HI, HI, HI], 4)
    lines = _speculative_line(speculator.summary()).splitlines()
    assert "acceptance 50.0% (2/4 proposed tokens)" in lines[1]
    assert "3.00 tokens per target forward per request (3 tokens / 1 rows)" in lines[1]
    analysis = next(line for line in lines if line.startswith("analysis"))
    assert analysis.split() == ["analysis", "4", "2", "50.0%", "1", "2.00", "3.00"]
    assert next(line for line in lines if line.startswith("final")).split()[3] == "-"


def test_bundled_pair_counts_channels_in_the_engine():
    """A Harmony chat prompt through the bundled pair: the counters split by channel add up to
    the totals and to the tokens the request generated, and analysis (the reply's first
    message) is speculated on."""
    from noesis import LLM

    config = SpeculativeConfig(method="draft", draft="models/noesis-tiny-draft", k=4)
    llm = LLM("models/noesis-tiny", device="cpu", dtype="float32", progress=False,
              speculative=config, max_num_seqs=2, max_model_len=512)
    prompt = llm.render_chat([{"role": "user", "content": "What is 12 times 7?"}])
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16))
    engine = llm.engine
    totals, channels = engine.spec_counts, engine.spec_channels
    assert set(channels) == {"analysis", "commentary", "final", "header", "other"}
    for key in COUNTERS:
        assert totals[key] == sum(c[key] for c in channels.values())
    assert totals["generated"] == len(out.token_ids)
    assert totals["proposed"] == out.spec_proposed and totals["accepted"] == out.spec_accepted
    assert channels["analysis"]["verify_rows"] > 0 and channels["analysis"]["accepted"] > 0
    from noesis.engine.stats import EngineStats

    assert EngineStats.of(engine).spec_channels == channels  # what /metrics serves


def test_a_batch_too_wide_for_the_verify_graphs_stays_paused_while_tokens_are_in_flight():
    """With graphs of 8 rows, 4 sequences proposing 3 each (16 rows) pause speculation whether
    or not their last tokens are read back yet; a paused speculator wants no read-back, so the
    engine keeps overlapping its steps (it re-decided on the ready sequences only, and so
    un-paused on every step whose tokens were still in flight)."""
    from noesis.planner.sequence import SequenceStatus

    config = SpeculativeConfig(method="ngram", k=3, adaptive=False)
    speculator = Speculator(config, NgramProposer(4, 2), ChannelScheme.of(FakeTokenizer()))
    speculator.max_rows = 8
    seqs = []
    for i in range(4):
        seq = new_seq([START, USER, MESSAGE, HI, END, HI, END, HI])  # lookup finds END, HI
        seq.seq_id, seq.request_id = i, f"r{i}"
        seq.status, seq.num_computed = SequenceStatus.RUNNING, len(seq.token_ids) - 1
        seqs.append(seq)
    for pending in (1, 0, 1):
        for seq in seqs:
            seq.num_pending = pending
        assert speculator.propose(seqs) == (None, {})
        assert not any(speculator.wants(seq) for seq in seqs)
    seqs[0].num_pending = 0
    assert speculator.propose(seqs[:1])[1].get(0, 0) > 0  # one alone fits: it speculates
