"""The trajectory tree against a plain reference model (every call stored separately, a naive set of
prefixes), driven by a hypothesis state machine that makes executions with compaction, sub-agents,
retries and re-tokenization drift; packing invariants are checked on the same trees."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from gyre_traj import native
from gyre_traj.io import Codec
from gyre_traj.pack import PackConfig, PackItem, pack
from gyre_traj.records import Role
from gyre_traj.select import SelectionConfig, select
from gyre_traj.tree import ExecutionTree, Forest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from .helpers import OUT, SYS, TOOL, USER, call

# Small alphabets steer toward shared prefixes and accidental collisions (a retry that samples the
# same first tokens, a tool output equal to an earlier one).
outputs = st.lists(st.integers(0, 2), min_size=0, max_size=5).map(lambda xs: [OUT + x for x in xs])
tools = st.lists(st.integers(0, 2), min_size=1, max_size=4).map(lambda xs: [TOOL + x for x in xs])


@dataclass
class Agent:
    name: str
    role: Role
    summary_role: Role
    system: list[int]
    ctx: list[int]
    last_call: str | None = None
    last_len: int = 0  # length of last call's input + output
    last_out: list[int] = field(default_factory=list)


class TreeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tree = ExecutionTree("e")
        self.full_tree = ExecutionTree("e")  # the same calls, every input in full
        self.live = Forest()  # the same records as the proxy sends them, one msgpack message each
        self.fast = Forest()  # the same messages through the live path (`Forest.ingest_frame`)
        self.fast_python = Forest()  # ... with its native half turned off (the same forest without it)
        self.codec = Codec()
        self.calls: dict[str, tuple[list[int], list[int]]] = {}
        self.agents: list[Agent] = []
        self.n = 0
        self.compactions = 0

    def _record(
        self,
        agent: Agent,
        role: Role,
        inp: list[int],
        out: list[int],
        use_delta: bool,
        keep: int | None = None,
    ) -> str:
        cid = f"c{self.n}"
        self.n += 1
        if use_delta and agent.last_call is not None:
            k = keep if keep is not None else min(agent.last_len, len(inp))
            prev = self.calls[agent.last_call]
            prev_seq = prev[0] + prev[1]
            k = min(k, len(prev_seq))
            while k > 0 and prev_seq[:k] != inp[:k]:
                k -= 1
            rec = call(
                cid,
                None,
                out,
                role=role,
                agent=agent.name,
                delta=(agent.last_call, k, inp[k:]),
                t=float(self.n),
            )
        else:
            rec = call(cid, inp, out, role=role, agent=agent.name, t=float(self.n))
        self.tree.add(rec)
        frame = self.codec.encode_msgpack(rec)
        back = self.live.add_frame(frame)
        assert self.codec.encode_msgpack(back) == self.codec.encode_msgpack(rec)  # decoded as sent
        assert self.fast.ingest_frame(frame) == self.tree.calls[cid]
        with native.use_native(False):
            assert self.fast_python.ingest_frame(frame) == self.tree.calls[cid]
        self.full_tree.add(call(cid, inp, out, role=role, agent=agent.name, t=float(self.n)))
        self.calls[cid] = (inp, out)
        return cid

    def _step(self, agent: Agent, inp: list[int], out: list[int], use_delta: bool) -> None:
        cid = self._record(agent, agent.role, inp, out, use_delta)
        agent.last_call, agent.last_len, agent.last_out = cid, len(inp) + len(out), out
        agent.ctx = inp + out

    @initialize(out=outputs)
    def start_main(self, out: list[int]) -> None:
        main = Agent("main", Role.MAIN, Role.MAIN_SUMMARY, [SYS + 1, SYS + 2], [SYS + 1, SYS + 2, USER + 1])
        self.agents.append(main)
        self._step(main, main.ctx, out, False)

    @rule(out=outputs, shared_system=st.booleans())
    def start_subagent(self, out: list[int], shared_system: bool) -> None:
        system = [SYS + 1, SYS + 2] if shared_system else [SYS + 7]
        sub = Agent(
            f"sub{len(self.agents)}", Role.SUBAGENT, Role.SUBAGENT_SUMMARY, system, [*system, USER + 5]
        )
        self.agents.append(sub)
        self._step(sub, sub.ctx, out, False)

    @rule(data=st.data(), tool=tools, out=outputs, use_delta=st.booleans())
    def step(self, data: st.DataObject, tool: list[int], out: list[int], use_delta: bool) -> None:
        agent = data.draw(st.sampled_from(self.agents))
        before = len(self.tree.stats.drifts)
        self._step(agent, agent.ctx + tool, out, use_delta)
        assert len(self.tree.stats.drifts) == before  # an honest continuation never drifts

    @rule(data=st.data(), out=outputs)
    def step_without_new_input(self, data: st.DataObject, out: list[int]) -> None:
        """An agent's next call that appends nothing to its context (and, with an empty output, carries
        no tokens at all), its delta keeping the whole of the previous call."""
        agent = data.draw(st.sampled_from(self.agents))
        self._step(agent, agent.ctx, out, True)

    @rule(data=st.data(), out=outputs, use_delta=st.booleans(), adopt=st.booleans())
    def retry(self, data: st.DataObject, out: list[int], use_delta: bool, adopt: bool) -> None:
        """Re-send an agent's last input; the harness keeps the first answer or adopts the retry's."""
        agent = data.draw(st.sampled_from(self.agents))
        assert agent.last_call is not None
        inp = self.calls[agent.last_call][0]
        before = len(self.tree.stats.drifts)
        cid = self._record(agent, agent.role, inp, out, use_delta, keep=len(inp))
        if adopt:
            agent.last_call, agent.last_len, agent.last_out = cid, len(inp) + len(out), out
            agent.ctx = inp + out
        assert len(self.tree.stats.drifts) == before  # a retry is a branch, never new drift

    @rule(data=st.data(), summary=outputs, use_delta=st.booleans())
    def compact(self, data: st.DataObject, summary: list[int], use_delta: bool) -> None:
        agent = data.draw(st.sampled_from(self.agents))
        cid = self._record(agent, agent.summary_role, [*agent.ctx, USER + 9], summary, use_delta)
        agent.last_call, agent.last_len = cid, len(agent.ctx) + 1 + len(summary)
        # Each compaction's new prompt is its own text (a harness words it with the summary inside):
        # with one fixed prompt token, a summary equal to the start of an output that once followed that
        # same prompt (a call that added no input) makes the next call look like a drift of that output.
        self.compactions += 1
        agent.ctx = [*agent.system, USER + 100 + self.compactions, *summary]
        agent.last_out = []

    @precondition(lambda self: any(len(a.last_out) > 0 for a in self.agents))
    @rule(data=st.data(), tool=tools, out=outputs, new_tok=st.integers(5, 6))
    def drift(self, data: st.DataObject, tool: list[int], out: list[int], new_tok: int) -> None:
        agent = data.draw(st.sampled_from([a for a in self.agents if a.last_out]))
        k = len(agent.ctx) - len(agent.last_out)
        ctx = list(agent.ctx)
        ctx[k + len(agent.last_out) - 1] = OUT + new_tok  # re-tokenized last assistant token
        pos, tok = k + len(agent.last_out) - 1, OUT + new_tok
        self._step(agent, ctx + tool, out, True)
        # Reported by this call, or by the earlier call that first carried the same contradiction.
        assert any(d.position == pos and d.got == tok for d in self.tree.stats.drifts)

    # ------------------------------------------------------------------------------------ invariants

    @invariant()
    def every_call_reconstructs_exactly(self) -> None:
        for cid, (inp, out) in self.calls.items():
            got_in, got_out = self.tree.call_sequence(cid)
            assert got_in.tolist() == inp and got_out.tolist() == out, cid

    @invariant()
    def live_path_reads_back_what_went_in(self) -> None:
        """Records fed one msgpack message at a time (`Forest.add_frame`) give every call back exactly,
        and the same tree, per-token arrays included, as the same calls added as objects."""
        if not self.calls:
            return
        live = self.live.trees["e"]
        for cid, (inp, out) in self.calls.items():
            got_in, got_out = live.call_sequence(cid)
            assert got_in.tolist() == inp and got_out.tolist() == out, cid
        for name in ("ids", "parent", "depth", "policy", "logprob", "version"):
            assert np.array_equal(getattr(live, name), getattr(self.tree, name)), name
        assert live.calls == self.tree.calls and live.order == self.tree.order

    @invariant()
    def ingest_frame_builds_the_same_tree(self) -> None:
        """The same messages through `Forest.ingest_frame` (an agent's next call read from its bytes
        straight into the tree, anything else decoded in full), with its native half in use (when
        built) and turned off, build the same tree as the calls added as objects: per-token arrays,
        calls, order and ingest statistics (drifts included)."""
        if not self.calls:
            return
        for forest in (self.fast, self.fast_python):
            fast = forest.trees["e"]
            for name in ("ids", "parent", "depth", "policy", "logprob", "version"):
                assert np.array_equal(getattr(fast, name), getattr(self.tree, name)), name
            assert fast.calls == self.tree.calls and fast.order == self.tree.order
            assert fast.stats == self.tree.stats

    @invariant()
    def unique_tokens_equal_naive_prefix_set(self) -> None:
        prefixes = {tuple(i + o)[: k + 1] for i, o in self.calls.values() for k in range(len(i) + len(o))}
        assert self.tree.n == len(prefixes)
        assert self.full_tree.n == len(prefixes)

    @invariant()
    def policy_flags_match_reference(self) -> None:
        policy = {
            tuple(i + o)[: k + 1] for i, o in self.calls.values() for k in range(len(i), len(i) + len(o))
        }
        for cid, (inp, out) in self.calls.items():
            seq = inp + out
            nodes = self.tree.path_nodes(self.tree.calls[cid].end)
            flags = self.tree.policy[nodes].tolist()
            assert flags == [tuple(seq[: k + 1]) in policy for k in range(len(seq))], cid

    @invariant()
    def packing_trains_each_policy_token_once(self) -> None:
        other = ExecutionTree("linear")
        other.add(call("x0", [SYS + 1, USER + 1], [OUT + 1, OUT + 2], execution="linear"))
        for j_max in (None, 2):
            sel = select(self.tree, SelectionConfig(j_max=j_max))
            expected = {int(n) for n in sel.loss_nodes if self.tree.parent[n] != -1}
            items = [PackItem(self.tree, sel, 1.0), PackItem(other, select(other), -1.0)]
            for mode in ("tree", "paths"):
                for budget in (10_000, 16):
                    longest = max((int(self.tree.depth[lf.end]) + 1 for lf in sel.leaves), default=0)
                    if longest > budget:
                        continue
                    batches = pack(items, PackConfig(token_budget=budget, mode=mode))
                    seen: list[int] = []
                    wsum = {"e": 0.0, "linear": 0.0}
                    for b in batches:
                        b.validate()
                        assert b.num_tokens <= budget
                        seg_of_target = b.segment[b.target_pos]
                        for k in range(b.num_loss_tokens):
                            name = b.executions[seg_of_target[k]]
                            wsum[name] += float(b.weights[k])
                            if name == "e":
                                seen.append(int(b.target_nodes[k]))
                                # the target is predicted from its parent's position
                                assert (
                                    b.input_ids[b.target_pos[k]]
                                    == self.tree.ids[self.tree.parent[b.target_nodes[k]]]
                                )
                    assert sorted(seen) == sorted(expected)  # each exactly once
                    live = [n for n, w in wsum.items() if w > 0]
                    for n in live:
                        assert abs(wsum[n] - 1.0 / len(live)) < 1e-5


TreeMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestTree = TreeMachine.TestCase


def test_dense_mask_is_ancestor_relation() -> None:
    """The preorder mask (kv <= q <= last_desc[kv]) equals the ancestor-or-self relation."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        t = ExecutionTree("e")
        seqs: list[list[int]] = []
        for i in range(8):
            base = seqs[rng.integers(len(seqs))] if seqs else []
            cut = int(rng.integers(0, len(base) + 1))
            seq = base[:cut] + rng.integers(OUT, OUT + 3, size=int(rng.integers(1, 6))).tolist()
            seqs.append(seq)
            t.add(call(f"c{i}", seq, []))
        sel = select(t, SelectionConfig(j_max=None))
        (b,) = pack([PackItem(t, sel, 1.0)], PackConfig(token_budget=10_000))
        anc = np.zeros((b.num_tokens, b.num_tokens), bool)
        for q in range(b.num_tokens):
            k = q
            while k >= 0:
                anc[q, k] = True
                k = int(b.parent[k])
        assert np.array_equal(b.dense_mask(), anc)
