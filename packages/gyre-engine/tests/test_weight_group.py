"""`gyre_engine.weight_group`: a member built here meets one built the way SGLang builds its weight-update
group (torch's rendezvous, `PrefixStore(group_name)` and torch's own group helper) in another process;
a rank that never comes and a broadcast that never comes are timeouts, not hangs; listeners bind the
given address."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
from gyre_engine.weight_group import WeightGroup, WeightGroupError, WeightGroupTimeout, bind_master

torch = pytest.importorskip("torch")

# An SGLang-style member (what SGLang's init_custom_process_group does, written out for this test).
SGLANG_STYLE_RANK = textwrap.dedent(
    """
    import datetime, json, os, sys, torch, torch.distributed as dist
    from torch.distributed.distributed_c10d import (
        Backend, PrefixStore, _new_process_group_helper, _world, rendezvous)
    port, name = int(sys.argv[1]), sys.argv[2]
    timeout = datetime.timedelta(seconds=30)
    store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(
        2, 1, [], Backend("gloo"), PrefixStore(name, store), group_name=name, timeout=timeout)
    _world.pg_group_ranks[pg] = {0: 0, 1: 1}
    t = torch.zeros(6, dtype=torch.bfloat16)
    dist.broadcast(t, src=0, group=pg)
    print(json.dumps(t.float().tolist()), flush=True)
    # gone without the interpreter's teardown: with the group's gloo threads still up at exit, torch
    # aborted now and then ("terminate called without an active exception", status -6; about 1 in 13
    # runs of this file beside a busy CPU), after the broadcast this test checks had arrived
    os._exit(0)
    """
)


def test_meets_a_member_built_by_torchs_group_helper() -> None:
    listener = bind_master("127.0.0.1")
    port = listener.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", SGLANG_STYLE_RANK, str(port), "sglang-style"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        group = WeightGroup.form("127.0.0.1", port, 0, 2, "sglang-style", "gloo", 30.0, listener=listener)
        group.broadcast(torch.arange(6, dtype=torch.bfloat16) / 4, "t")
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err[-2000:]
    assert json.loads(out.strip().splitlines()[-1]) == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25]
    group.close()


def test_timeouts_and_bad_arguments() -> None:
    listener = bind_master("127.0.0.1")
    port = listener.getsockname()[1]
    assert listener.getsockname()[0] == "127.0.0.1"
    with pytest.raises(WeightGroupTimeout, match="could not connect to the others within 1 s"):
        WeightGroup.form("127.0.0.1", port, 0, 2, "alone", "gloo", 1.0, listener=listener)
    with pytest.raises(WeightGroupError, match="needs a CUDA device"):
        WeightGroup.form("127.0.0.1", port, 1, 2, "g", "nccl", 1.0)
    with pytest.raises(WeightGroupError, match="does not fit world_size"):
        WeightGroup.form("127.0.0.1", port, 2, 2, "g", "gloo", 1.0)

    listener = bind_master("127.0.0.1")
    port = listener.getsockname()[1]
    got: dict[str, object] = {}

    def receiver() -> None:
        g = WeightGroup.form("127.0.0.1", port, 1, 2, "quiet", "gloo", 8.0)
        buf = torch.empty(3)
        g.broadcast(buf, "first")
        got["first"] = buf.tolist()
        try:
            g.broadcast(torch.empty(3), "second", timeout_s=1.0)
        except WeightGroupTimeout as exc:
            got["second"] = str(exc)
        g.close()

    th = threading.Thread(target=receiver)
    th.start()
    sender = WeightGroup.form("127.0.0.1", port, 0, 2, "quiet", "gloo", 8.0, listener=listener)
    sender.broadcast(torch.tensor([1.0, 2.0, 3.0]), "first")  # then rank 0 goes quiet
    th.join(60)
    assert not th.is_alive()
    assert got["first"] == [1.0, 2.0, 3.0]
    assert "second: could not receive it from rank 0 within 1 s" in str(got["second"])
    sender.close()
    with pytest.raises(WeightGroupError, match="is closed"):
        sender.broadcast(torch.empty(1))
