"""Measure throughput side by side in one run and print one JSON object as the last line.

Raw Mooncake calls and gyre-xfer's wrapper read the same bytes from the same peer process, alternating,
so their ratio is fair; plain TCP sockets and memcpy give the ceilings; shared memory is compared with
memcpy; the snapshot figure is the time from `publish` to a subscriber holding the whole version. The
shared-memory pull figure pulls one snapshot shaped like Qwen3-0.6B from a publisher in a third process,
with the transport's copy threads and piecewise checksums against one copy thread, alternating.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from gyre_xfer.kv import KvPool
from gyre_xfer.mooncake import MooncakeTransport
from gyre_xfer.protocol import RegionDesc
from gyre_xfer.publisher import Publisher
from gyre_xfer.subscriber import Subscriber, SubscriberConfig
from gyre_xfer.transport import Config, Op, check_ranges, open_transport

MiB = 1 << 20


def _median_gbps(nbytes: int, times: list[float]) -> float:
    return nbytes / statistics.median(times) / 1e9


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _alternate(n: int, a: Callable[[], Any], b: Callable[[], Any]) -> tuple[list[float], list[float]]:
    """Time a and b n times each, alternating which goes first so neither gets the warmer cache."""
    ta: list[float] = []
    tb: list[float] = []
    for i in range(n):
        order = ((a, ta), (b, tb)) if i % 2 == 0 else ((b, tb), (a, ta))
        for fn, times in order:
            times.append(_timed(fn))
    return ta, tb


def _tcp_gbps(nbytes: int, reps: int) -> float:
    """Plain loopback TCP: one sender thread, one receiver, recv_into a preallocated buffer."""
    payload = np.ones(nbytes, np.uint8)
    sink = np.empty(nbytes, np.uint8)
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    times: list[float] = []

    def send() -> None:
        conn, _ = srv.accept()
        with conn:
            for _ in range(reps):
                conn.sendall(memoryview(payload))
                conn.recv(1)

    th = threading.Thread(target=send, daemon=True)
    th.start()
    with socket.create_connection(("127.0.0.1", port)) as c:
        view = memoryview(sink)
        for _ in range(reps):
            t0 = time.perf_counter()
            got = 0
            while got < nbytes:
                got += c.recv_into(view[got:], nbytes - got)
            times.append(time.perf_counter() - t0)
            c.sendall(b"k")
    th.join(timeout=30)
    srv.close()
    return _median_gbps(nbytes, times)


def run(quick: bool) -> dict[str, Any]:
    big = 256 * MiB
    snapshot_bytes = 1 << 30
    reps = {1 * MiB: 20 if quick else 50, 16 * MiB: 10 if quick else 20, big: 3 if quick else 9}
    block_reps = 7 if quick else 15
    peer = subprocess.Popen(
        [sys.executable, "-m", "gyre_xfer.bench.peer", str(big), str(snapshot_bytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert peer.stdin is not None and peer.stdout is not None
    try:
        info = json.loads(peer.stdout.readline())
        mc = open_transport(Config(kind="mooncake"))
        assert isinstance(mc, MooncakeTransport)
        engine = mc.engine
        remote = RegionDesc(0, info["nbytes"], info["addr"])
        dst = mc.alloc(big)
        out: dict[str, Any] = {"quick": quick}
        seg = info["endpoint"]
        # warm the connection
        engine.transfer_sync_read(seg, dst.addr, remote.addr, MiB)
        for size, n in reps.items():
            one = [Op(dst, 0, remote, 0, size)]

            def raw(size: int = size) -> None:
                rc = engine.transfer_sync_read(seg, dst.addr, remote.addr, size)
                assert rc == 0, rc

            def wrapped(one: list[Op] = one) -> None:
                res = mc.read(seg, one)
                assert res.ok, res

            raw_t, wrap_t = _alternate(n, raw, wrapped)
            label = f"{size // MiB}mib"
            out[f"raw_{label}_gbps"] = round(_median_gbps(size, raw_t), 3)
            out[f"wrapper_{label}_gbps"] = round(_median_gbps(size, wrap_t), 3)
            out[f"wrapper_over_raw_{label}"] = round(
                out[f"wrapper_{label}_gbps"] / out[f"raw_{label}_gbps"], 3
            )
        # 1,000 scattered 64 KiB blocks
        blk = 64 << 10
        rng = np.random.default_rng(1)
        src_ids = rng.permutation(big // blk)[:1000]
        dst_ids = rng.permutation(big // blk)[:1000]
        locs = [dst.addr + int(d) * blk for d in dst_ids]
        rems = [remote.addr + int(s) * blk for s in src_ids]
        ops = [
            Op(dst, int(d) * blk, remote, int(s) * blk, blk) for s, d in zip(src_ids, dst_ids, strict=True)
        ]
        raw_b, wrap_b = _alternate(
            block_reps,
            lambda: engine.batch_transfer_sync_read(seg, locs, rems, [blk] * 1000),
            lambda: mc.read(seg, ops),
        )
        # the wrapper's own work per 1,000-entry batch, without the transfer: range checks and address lists
        t0 = time.perf_counter()
        for _ in range(20):
            check_ranges(ops)
            _ = (
                [op.region.addr + op.local_offset for op in ops],
                [op.remote.addr + op.remote_offset for op in ops],
            )
        out["wrapper_prep_ms_1000_entries"] = round((time.perf_counter() - t0) / 20 * 1e3, 3)
        out["raw_blocks_gbps"] = round(_median_gbps(1000 * blk, raw_b), 3)
        out["wrapper_blocks_gbps"] = round(_median_gbps(1000 * blk, wrap_b), 3)
        out["wrapper_over_raw_blocks"] = round(out["wrapper_blocks_gbps"] / out["raw_blocks_gbps"], 3)
        # the KV API on the same peer memory: 1 layer, K and V planes of 32 KiB blocks = 64 KiB a block
        half = big // 2
        kv_peer_desc = _peer_pool_desc(mc.kind, seg, remote, half, blk // 2)
        pool = KvPool.allocate(mc, 1, half // (blk // 2), blk // 2)
        kv_t = []
        for _ in range(block_reps):
            kres = pool.pull(kv_peer_desc, [int(s) for s in src_ids], [int(d) for d in dst_ids])
            assert kres.ok, kres.detail
            kv_t.append(kres.elapsed_s)
        out["kv_pull_1000_blocks_gbps"] = round(_median_gbps(1000 * blk, kv_t), 3)
        pool.close()
        # plain TCP and memcpy ceilings, shared memory
        out["tcp_socket_256mib_gbps"] = round(_tcp_gbps(big, reps[big]), 3)
        a = np.ones(big, np.uint8)
        b = np.empty(big, np.uint8)
        b.fill(0)
        shm = open_transport(Config(kind="shm"))
        sdst = shm.register(b)
        sremote = RegionDesc(0, big, 0, info["shm_name"])
        mem_t: list[float] = []
        shm_t: list[float] = []
        for _ in range(reps[big]):  # alternate memcpy and shared memory into the same destination
            mem_t.append(_timed(lambda: ctypes.memmove(b.ctypes.data, a.ctypes.data, big)))
            sres = shm.read(info["shm_endpoint"], [Op(sdst, 0, sremote, 0, big)])
            assert sres.ok, sres.detail
            shm_t.append(sres.elapsed_s)
        out["memcpy_256mib_gbps"] = round(_median_gbps(big, mem_t), 3)
        out["shm_256mib_gbps"] = round(_median_gbps(big, shm_t), 3)
        out["shm_over_memcpy"] = round(out["shm_256mib_gbps"] / out["memcpy_256mib_gbps"], 3)
        out["mooncake_256mib_over_tcp_socket"] = round(
            out["wrapper_256mib_gbps"] / out["tcp_socket_256mib_gbps"], 3
        )
        shm.close()
        # publish -> subscriber holding the whole 1 GiB snapshot
        sub = Subscriber(mc, SubscriberConfig(info["control"]))
        snap_t: list[float] = []
        for rep in range(3 if quick else 5):  # the first two fill both publisher slots and the staging buffer
            t0 = time.perf_counter()
            peer.stdin.write("publish\n")
            peer.stdin.flush()
            words = peer.stdout.readline().split()
            snap = sub.pull(min_version=int(words[1]))
            if rep == 0:
                out["snapshot_1gib_cold_s"] = round(time.perf_counter() - t0, 3)
            if rep < 2:
                continue
            snap_t.append(time.perf_counter() - t0)
            out["snapshot_publish_s"] = float(words[2])
            out["snapshot_pull_s"] = round(snap.elapsed_s, 3)
        out["snapshot_1gib_publish_to_held_s"] = round(statistics.median(snap_t), 3)
        out["snapshot_bytes"] = snap.nbytes
        sub.close()
        mc.close()
        out.update(_shm_pull_figures(3 if quick else 7))
        return out
    finally:
        try:
            peer.stdin.write("quit\n")
            peer.stdin.flush()
            peer.wait(timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            peer.kill()
            peer.wait(timeout=10)


def qwen3_0_6b_shapes() -> dict[str, tuple[int, ...]]:
    """Qwen3-0.6B's tensors (tied embedding): 310 tensors, 1.19 GB in bf16, the largest the 311 MB
    embedding."""
    hidden, inter, q, kv, head = 1024, 3072, 16 * 128, 8 * 128, 128
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (151936, hidden)}
    for i in range(28):
        pre = f"model.layers.{i}."
        shapes |= {
            pre + "self_attn.q_proj.weight": (q, hidden),
            pre + "self_attn.k_proj.weight": (kv, hidden),
            pre + "self_attn.v_proj.weight": (kv, hidden),
            pre + "self_attn.o_proj.weight": (hidden, q),
            pre + "self_attn.q_norm.weight": (head,),
            pre + "self_attn.k_norm.weight": (head,),
            pre + "mlp.gate_proj.weight": (inter, hidden),
            pre + "mlp.up_proj.weight": (inter, hidden),
            pre + "mlp.down_proj.weight": (hidden, inter),
            pre + "input_layernorm.weight": (hidden,),
            pre + "post_attention_layernorm.weight": (hidden,),
        }
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def shm_publisher() -> None:
    """The shared-memory pull figure's publisher (run in its own process): publishes one snapshot of
    random bf16 words shaped like Qwen3-0.6B, prints {"control", "version"}, and serves until stdin ends."""
    tr = open_transport(Config(kind="shm"))
    pub = Publisher(tr)
    rng = np.random.default_rng(2)
    weights = {
        name: rng.integers(0, 2**16, shape, dtype=np.uint16) for name, shape in qwen3_0_6b_shapes().items()
    }
    version = pub.publish(weights, dtypes=dict.fromkeys(weights, "bfloat16"))
    print(json.dumps({"control": pub.address, "version": version}), flush=True)
    for _ in sys.stdin:
        pass
    pub.close()
    tr.close()


def _shm_pull_figures(reps: int) -> dict[str, Any]:
    """`Subscriber.pull` of the Qwen3-0.6B-shaped snapshot over shared memory into staging, checksums
    verified: the default transport (copy threads) against `copy_threads=1`, alternating, medians; and,
    in the same rounds, about the code before copy threads and hash pieces (`copy_threads=1`, a tensor
    hashed in no smaller pieces than the buckets cut it into: the embedding in two)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "from gyre_xfer.bench.run import shm_publisher; shm_publisher()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    opened: list[tuple[Any, Subscriber]] = []
    try:
        info = json.loads(proc.stdout.readline())
        variants = {
            "threads": (Config(kind="shm"), SubscriberConfig(info["control"])),
            "one_thread": (Config(kind="shm", copy_threads=1), SubscriberConfig(info["control"])),
            "whole_tensor_hash_one_thread": (
                Config(kind="shm", copy_threads=1),
                SubscriberConfig(info["control"], hash_piece_bytes=1 << 62),
            ),
        }
        pulls: dict[str, Callable[[], Any]] = {}
        for name, (cfg, sub_cfg) in variants.items():
            tr = open_transport(cfg)
            sub = Subscriber(tr, sub_cfg)
            opened.append((tr, sub))
            snap = sub.pull(min_version=info["version"])  # allocates and faults in the staging
            nbytes, ntensors = snap.nbytes, len(snap.arrays)
            pulls[name] = functools.partial(sub.pull, min_version=info["version"])
        times: dict[str, list[float]] = {name: [] for name in pulls}
        names = list(pulls)
        for i in range(reps):  # a different variant goes first each round
            for name in names[i % len(names) :] + names[: i % len(names)]:
                times[name].append(_timed(pulls[name]))
        med = {name: statistics.median(t) for name, t in times.items()}
        return {
            "shm_pull_qwen3_0_6b_bytes": nbytes,
            "shm_pull_qwen3_0_6b_tensors": ntensors,
            "shm_pull_copy_threads": Config().copy_threads,
            "shm_pull_hash_threads": SubscriberConfig("").hash_threads,
            "cpu_count": os.cpu_count(),
            "shm_pull_qwen3_0_6b_s_threads": round(med["threads"], 3),
            "shm_pull_qwen3_0_6b_s_one_thread": round(med["one_thread"], 3),
            "shm_pull_one_thread_over_threads": round(med["one_thread"] / med["threads"], 3),
            "shm_pull_qwen3_0_6b_s_before": round(med["whole_tensor_hash_one_thread"], 3),
            "shm_pull_before_over_threads": round(med["whole_tensor_hash_one_thread"] / med["threads"], 3),
        }
    finally:
        for tr, sub in opened:
            sub.close()
            tr.close()
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _peer_pool_desc(kind: Any, seg: str, remote: RegionDesc, plane_bytes: int, block: int) -> Any:
    from gyre_xfer.protocol import KvPlane, KvPoolDesc

    return KvPoolDesc(
        kind,
        seg,
        "bench-peer",
        (remote,),
        (KvPlane(0, 0), KvPlane(0, plane_bytes)),
        1,
        plane_bytes // block,
        block,
    )


def main(quick: bool, out_path: str | None) -> None:
    t0 = time.perf_counter()
    result = run(quick)
    result["bench_wall_s"] = round(time.perf_counter() - t0, 1)
    line = json.dumps(result)
    if out_path:
        with open(out_path, "w") as f:
            f.write(json.dumps(result, indent=2) + "\n")
    print(line)
