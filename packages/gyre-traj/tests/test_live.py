"""The live ingest path (`Forest.add_frame`: one msgpack record at a time, inputs delta-encoded against
the agent's previous call, as the proxy sends them): every call reads back exactly as it went in, and a
bad record is refused with an error naming it while the tree keeps what it had."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from gyre_traj.io import Codec, encode_msgpack_stream
from gyre_traj.records import Call, RecordError
from gyre_traj.synth import SynthConfig, synth_execution
from gyre_traj.tree import Forest

from .helpers import OUT, SYS, TOOL, USER, call, ids

CODEC = Codec()
PROMPT = ids(SYS, 1, 2) + ids(USER, 1)


def _full_inputs(calls: list[Call]) -> dict[str, np.ndarray]:
    """Each call's full input, the deltas applied to their parents' input + output by hand."""
    seq: dict[str, np.ndarray] = {}
    inputs: dict[str, np.ndarray] = {}
    for c in calls:
        if c.input_delta is None:
            assert c.input_ids is not None
            inp = c.input_ids
        else:
            d = c.input_delta
            inp = np.concatenate([seq[d.parent][: d.keep], d.append])
        inputs[c.call_id] = inp
        seq[c.call_id] = np.concatenate([inp, c.output_ids])
    return inputs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_live_path_gives_every_call_back(seed: int) -> None:
    cfg = SynthConfig(
        main_calls=40, max_context=6_000, system_tokens=200, summary_tokens=100, drifts=2, seed=seed
    )
    calls = synth_execution(cfg, "e")
    forest = Forest()
    for c in calls:
        forest.add_frame(CODEC.encode_msgpack(c))
    tree = forest.trees["e"]
    inputs = _full_inputs(calls)
    first_producer: dict[int, str] = {}
    for c in calls:
        got_in, got_out = tree.call_sequence(c.call_id)
        assert np.array_equal(got_in, inputs[c.call_id]), c.call_id
        assert np.array_equal(got_out, c.output_ids), c.call_id
        nodes = tree.path_nodes(tree.calls[c.call_id].end)[got_in.shape[0] :]
        for k, node in enumerate(nodes.tolist()):
            first_producer.setdefault(node, c.call_id)
            if first_producer[node] == c.call_id:  # its logprob is this call's (the first producer's)
                assert tree.logprob[node] == c.output_logprobs[k], (c.call_id, k)
                assert tree.version[node] == c.weight_version
            assert tree.policy[node]
    # The same tree as the whole stream as one call batch, and as full inputs.
    batched = Forest().add_msgpack(encode_msgpack_stream(calls, batch=len(calls))).trees["e"]
    full = synth_execution(SynthConfig(**{**cfg.__dict__, "delta": False}), "e")
    whole = Forest().add_msgpack(encode_msgpack_stream(full)).trees["e"]
    for other in (batched, whole):
        for name in ("ids", "parent", "depth", "policy", "logprob", "version"):
            assert np.array_equal(getattr(tree, name), getattr(other, name)), name
    assert tree.stats.calls == len(calls) and tree.stats.call_tokens == batched.stats.call_tokens


def _tampered(rec: Call, **arrays: np.ndarray) -> bytes:
    """`rec` encoded with some arrays replaced behind the constructor's back, as a corrupt sender would."""
    delta = rec.input_delta
    bad = msgspec.structs.replace(rec, input_delta=None if delta is None else msgspec.structs.replace(delta))
    for name, arr in arrays.items():
        target = bad.input_delta if name == "append" else bad
        msgspec.structs.force_setattr(target, name, arr)
    return CODEC.encode_msgpack(bad)


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        (
            {"append": np.array([3001, -4], np.int32)},
            r"call='c1'.*input ids contain a negative id -4 at position 5",
        ),
        (
            {"output_ids": np.array([4001, -7], np.int32)},
            r"call='c1'.*output ids contain a negative id -7 at position 1",
        ),
        (
            {"output_logprobs": np.array([-0.5, np.nan], np.float32)},
            r"call='c1'.*logprobs must be <= 0 \(and not NaN\)",
        ),
        ({"output_logprobs": np.array([-0.5, 0.25], np.float32)}, r"call='c1'.*logprobs must be <= 0"),
    ],
)
def test_live_path_refuses_a_bad_next_call_and_keeps_the_tree(
    arrays: dict[str, np.ndarray], message: str
) -> None:
    forest = Forest()
    first = call("c0", PROMPT, ids(OUT, 1))
    forest.add_frame(CODEC.encode_msgpack(first))
    nxt = call("c1", None, ids(OUT, 2, 3), delta=("c0", 4, ids(TOOL, 1)))  # the agent's next call
    tree = forest.trees["e"]
    before = (tree.n, tree.ids.copy(), dict(tree.calls), tree.stats.calls, tree.policy_tokens)
    with pytest.raises(RecordError, match=message):
        forest.add_frame(_tampered(nxt, **arrays))
    assert (tree.n, tree.stats.calls, tree.policy_tokens) == (before[0], before[3], before[4])
    assert np.array_equal(tree.ids, before[1]) and tree.calls == before[2]
    # The good record still goes in after the refused one.
    forest.add_frame(CODEC.encode_msgpack(nxt))
    got_in, got_out = tree.call_sequence("c1")
    assert got_in.tolist() == [*PROMPT, *ids(OUT, 1), *ids(TOOL, 1)] and got_out.tolist() == ids(OUT, 2, 3)
    assert tree.logprob[tree.calls["c1"].end] == np.float32(-0.2)


def test_live_path_refuses_bytes_that_do_not_decode() -> None:
    forest = Forest()
    with pytest.raises(RecordError, match=r"^msg 7: "):
        forest.add_frame(b"\x93\x01", name="msg 7")
    assert len(forest) == 0
