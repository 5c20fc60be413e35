"""The transport layer on its own: Mooncake with its metadata server instead of the P2P handshake,
range checks before any byte moves, shared memory peers that vanish, large shared-memory batches copied
in pieces on several threads, and errors that say what to install."""

from __future__ import annotations

import gc
import itertools
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

import msgspec
import numpy as np
import pytest
from gyre_base.testing import free_port
from gyre_xfer import mooncake as mc_mod
from gyre_xfer import shm as shm_mod
from gyre_xfer.errors import OutOfRangeError, TransportUnavailableError
from gyre_xfer.kv import KvPool
from gyre_xfer.protocol import KvPoolDesc, RegionDesc
from gyre_xfer.transport import Config, EntryStatus, Op, Region, Transport, open_transport
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from .conftest import Peer
from .peer_proc import block_pattern


@pytest.fixture
def metadata_server() -> Iterator[str]:
    """Mooncake's own HTTP metadata server (shipped in its wheel), in its own process on loopback."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mooncake.http_metadata_server",
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--log-level",
            "ERROR",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/metadata"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.mooncake
def test_mooncake_through_a_metadata_server(metadata_server: str) -> None:
    a = open_transport(
        Config(kind="mooncake", hostname=f"127.0.0.1:{free_port()}", metadata_server=metadata_server)
    )
    b = open_transport(
        Config(kind="mooncake", hostname=f"127.0.0.1:{free_port()}", metadata_server=metadata_server)
    )
    try:
        src = b.alloc(1 << 20)
        assert src.array is not None
        src.array[:] = np.arange(1 << 20) % 241
        dst = a.alloc(1 << 20)
        res = a.read(b.endpoint, [Op(dst, 0, src.desc, 0, 1 << 20)])
        assert res.ok
        assert dst.array is not None and np.array_equal(dst.array, src.array)
    finally:
        a.close()
        b.close()


@pytest.mark.slow
@pytest.mark.mooncake
def test_peer_restarted_under_the_same_name_is_reached_again(
    metadata_server: str, spawn: Callable[..., Peer]
) -> None:
    """With a metadata server a restarted peer keeps its name: its stale keys are replaced, and the
    reader, told of the new incarnation, rebuilds its engine and reaches the new process."""
    name = f"127.0.0.1:{free_port()}"
    pool_args = {
        "layers": 1,
        "blocks": 4,
        "block_nbytes": 4096,
        "hostname": name,
        "metadata_server": metadata_server,
    }
    reader = open_transport(
        Config(
            kind="mooncake",
            hostname=f"127.0.0.1:{free_port()}",
            metadata_server=metadata_server,
            progress_timeout_s=2,
        )
    )
    try:
        pool = KvPool.allocate(reader, 1, 4, 4096)
        first = spawn("kvpool", "mooncake", **pool_args)
        desc = msgspec.json.decode(first.info, type=KvPoolDesc)
        assert pool.pull(desc, [1], [0]).ok
        first.proc.kill()
        first.proc.wait(timeout=10)
        gone = pool.pull(desc, [1], [0])
        assert [b.status for b in gone.blocks] == [EntryStatus.PEER_GONE]  # found out via the metadata server
        second = spawn("kvpool", "mooncake", **pool_args)  # same name: its stale keys are cleared
        desc2 = msgspec.json.decode(second.info, type=KvPoolDesc)
        assert desc2.endpoint == desc.endpoint and desc2.incarnation != desc.incarnation
        res = pool.pull(desc2, [2, 3], [0, 1])
        assert res.ok, res.detail
        assert np.array_equal(pool.block(0, 1, 1), block_pattern(0, 1, 3, 4096))
        assert isinstance(reader, mc_mod.MooncakeTransport) and reader.reopens == 1
        pool.close()
    finally:
        reader.close()


@pytest.mark.parametrize("kind", [pytest.param("mooncake", marks=pytest.mark.mooncake), "shm"])
def test_ranges_are_checked_before_any_byte_moves(kind: str) -> None:
    a = open_transport(Config(kind=kind))
    b = open_transport(Config(kind=kind))
    try:
        src = b.alloc(4096)
        assert src.array is not None
        src.array[:] = 9
        dst = a.alloc(4096)
        ops = [
            Op(dst, 0, src.desc, 0, 1024),
            Op(dst, 4000, src.desc, 0, 1024),  # local overflow
            Op(dst, 1024, src.desc, 4000, 1024),  # remote overflow
            Op(dst, 2048, src.desc, 0, 0),  # empty is fine
            Op(dst, 3072, src.desc, 3072, 1024),
        ]
        res = a.read(b.endpoint, ops)
        assert res.statuses == (
            EntryStatus.OK,
            EntryStatus.OUT_OF_RANGE,
            EntryStatus.OUT_OF_RANGE,
            EntryStatus.OK,
            EntryStatus.OK,
        )
        assert "exceeds region" in res.detail and "exceeds peer region" in res.detail
        assert dst.array is not None
        assert (
            (dst.array[:1024] == 9).all()
            and (dst.array[1024:3072] == 0).all()
            and (dst.array[3072:] == 9).all()
        )
        with pytest.raises(OutOfRangeError, match="2 of 5 entries failed"):
            res.raise_for_status(b.endpoint, "reading")
    finally:
        a.close()
        b.close()


def test_shm_peer_that_went_away_is_peer_gone() -> None:
    a = open_transport(Config(kind="shm"))
    b = open_transport(Config(kind="shm"))
    src = b.alloc(4096)
    desc = src.desc
    b.close()  # unlinks its segments, as a process exit with cleanup would
    dst = a.alloc(4096)
    res = a.read(b.endpoint, [Op(dst, 0, desc, 0, 4096)])
    assert res.statuses == (EntryStatus.PEER_GONE,)
    other_host = a.read("shm:elsewhere:boot", [Op(dst, 0, desc, 0, 1)])
    assert other_host.statuses == (EntryStatus.FAILED,) and "not on this host" in other_host.detail
    a.close()


def test_shm_peer_segments_freed_by_their_owner_are_unmapped_here() -> None:
    """A reader keeps peer segments mapped for later reads, but not one its owner removed: its next read
    drops it, even one of a segment it has mapped already (a reader that kept every peer segment mapped
    held all of their memory)."""
    a = open_transport(Config(kind="shm"))
    b = open_transport(Config(kind="shm"))

    def mapped() -> str:
        gc.collect()  # views earlier tests left in reference cycles
        with open("/proc/self/maps") as f:
            return f.read()

    try:
        dst = a.alloc(1 << 16)
        first, second = b.alloc(1 << 16), b.alloc(1 << 16)
        name = first.desc.shm_name
        assert a.read(b.endpoint, [Op(dst, 0, first.desc, 0, 1 << 16)]).ok
        assert a.read(b.endpoint, [Op(dst, 0, second.desc, 0, 1 << 16)]).ok
        assert a.read(b.endpoint, [Op(dst, 0, first.desc, 0, 1 << 16)]).ok  # mapped once, read again
        assert name in mapped()
        b.unregister(first)  # the owner frees it (its segment is unlinked)
        del first
        assert a.read(b.endpoint, [Op(dst, 0, second.desc, 0, 1 << 16)]).ok  # already mapped: a cache hit
        assert second.desc.shm_name in mapped()
        assert name not in mapped()
    finally:
        a.close()
        b.close()


@pytest.mark.mooncake
def test_torch_tensors_register_without_copies() -> None:
    torch = pytest.importorskip("torch")
    a = open_transport(Config(kind="mooncake"))
    b = open_transport(Config(kind="mooncake"))
    try:
        src_t = torch.arange(1024, dtype=torch.float32).to(torch.bfloat16)
        src = b.register(src_t)
        dst_t = torch.zeros(1024, dtype=torch.bfloat16)
        dst = a.register(dst_t)
        assert a.read(b.endpoint, [Op(dst, 0, src.desc, 0, src.nbytes)]).ok
        assert torch.equal(dst_t, src_t)
    finally:
        a.close()
        b.close()


class _LinkerFailure(MetaPathFinder):
    """Stands in for the dynamic linker of a machine without libibverbs1 (whether or not this one has
    it): importing `mooncake.engine` raises the exact ImportError Python gives when the shared library
    cannot be loaded."""

    def __init__(self, message: str) -> None:
        self.message = message

    def find_spec(self, fullname: str, path: object, target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname == "mooncake.engine":
            raise ImportError(self.message)
        return None


NO_LIBIBVERBS = "libibverbs.so.1: cannot open shared object file: No such file or directory"


def test_missing_libibverbs_names_the_apt_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "mooncake.engine", raising=False)
    finder = _LinkerFailure(NO_LIBIBVERBS)
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    with pytest.raises(TransportUnavailableError, match=r"apt-get install -y libibverbs1"):
        mc_mod.load_engine_class()


def test_unavailable_reason_says_what_to_install_and_none_when_mooncake_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(sys.modules, "mooncake.engine", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_LinkerFailure(NO_LIBIBVERBS), *sys.meta_path])
    mc_mod.unavailable_reason.cache_clear()
    try:
        assert "Debian's libibverbs1" in (why := mc_mod.unavailable_reason() or "")
        assert "apt-get install -y libibverbs1" in why
        monkeypatch.undo()  # this machine as it is
        mc_mod.unavailable_reason.cache_clear()
        try:
            mc_mod.load_engine_class()
        except TransportUnavailableError as e:
            assert mc_mod.unavailable_reason() == str(e)
        else:
            assert mc_mod.unavailable_reason() is None
    finally:
        mc_mod.unavailable_reason.cache_clear()


@pytest.mark.slow
@pytest.mark.parametrize("required", [False, True], ids=["skips", "fails-under-GYRE_REQUIRE_MOONCAKE"])
def test_mooncake_tests_skip_naming_libibverbs1_where_it_is_missing_and_fail_in_ci(
    tmp_path: Path, required: bool
) -> None:
    """A machine without Debian's libibverbs1, whatever this one has: a `mooncake` package on PYTHONPATH
    whose engine fails to import as the real wheel's does there. A test marked `mooncake` (run by pytest in
    a subprocess) is skipped with the apt-get line; with GYRE_REQUIRE_MOONCAKE=1, as CI runs, it fails."""
    (tmp_path / "mooncake").mkdir()
    (tmp_path / "mooncake" / "__init__.py").write_text("")
    (tmp_path / "mooncake" / "engine.py").write_text(f"raise ImportError({NO_LIBIBVERBS!r})\n")
    env = {k: v for k, v in os.environ.items() if k != "GYRE_REQUIRE_MOONCAKE"}
    env["PYTHONPATH"] = str(tmp_path)
    if required:
        env["GYRE_REQUIRE_MOONCAKE"] = "1"
    node = f"{Path(__file__).with_name('test_cli.py')}::test_doctor_reports_a_working_mooncake"
    r = subprocess.run(
        [sys.executable, "-m", "pytest", node, "-q", "-rse", "-p", "no:cacheprovider"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "apt-get install -y libibverbs1" in r.stdout, r.stdout + r.stderr
    if required:
        assert r.returncode == 1 and "1 error" in r.stdout, r.stdout
    else:
        assert r.returncode == 0 and "1 skipped" in r.stdout, r.stdout


def test_missing_wheel_names_the_extras(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake", None)  # as if no mooncake wheel were installed
    monkeypatch.delitem(sys.modules, "mooncake.engine", raising=False)
    with pytest.raises(
        TransportUnavailableError, match=r"gyre-xfer\[mooncake\]'.*gyre-xfer\[mooncake-cuda13\]"
    ):
        mc_mod.load_engine_class()


def test_default_transport_is_shared_memory_and_needs_no_mooncake(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake", None)  # as if no Mooncake wheel (or libibverbs1) were here
    monkeypatch.delitem(sys.modules, "mooncake.engine", raising=False)
    assert Config().kind == "shm"
    a, b = open_transport(), open_transport()
    try:
        src = b.alloc(64)
        assert src.array is not None
        src.array[:] = 7
        dst = a.alloc(64)
        assert a.read(b.endpoint, [Op(dst, 0, src.desc, 0, 64)]).ok and dst.array is not None
        assert (dst.array == 7).all()
    finally:
        a.close()
        b.close()
    with pytest.raises(TransportUnavailableError, match=r"gyre-xfer\[mooncake\]"):
        open_transport(Config(kind="mooncake"))  # asked for by name: an error that says what to install


def test_wheel_is_reported() -> None:
    assert mc_mod.installed_wheel() == "mooncake-transfer-engine-non-cuda"


def test_unknown_transport_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown transport kind"):
        open_transport(Config(kind="carrier-pigeon"))


def test_region_desc_for_unallocated_memory_is_refused_by_shm_peers() -> None:
    a = open_transport(Config(kind="shm"))
    try:
        dst = a.alloc(16)
        res = a.read(a.endpoint, [Op(dst, 0, RegionDesc(5, 16, 0, ""), 0, 16)])
        assert res.statuses == (EntryStatus.FAILED,) and "not in shared memory" in res.detail
    finally:
        a.close()


def test_shm_peers_map_only_gyre_segments() -> None:
    """A descriptor naming the segment directory itself, a name outside gyre's, or a gyre name that is
    not a file is a FAILED entry with the reason; mapping it used to raise IsADirectoryError out of the
    transfer (and mapped any file in /dev/shm the process could open)."""
    import os

    from gyre_xfer.shm import SHM_DIR

    a = open_transport(Config(kind="shm"))
    folder = os.path.join(SHM_DIR, f"gyre-{os.getpid()}-dirtest-1")
    os.mkdir(folder)
    try:
        dst = a.alloc(16)
        for name, why in ((".", "not a gyre"), ("..", "not a gyre"), ("other-app", "not a gyre")):
            res = a.read(a.endpoint, [Op(dst, 0, RegionDesc(5, 16, 0, name), 0, 16)])
            assert res.statuses == (EntryStatus.FAILED,) and why in res.detail, name
        res = a.read(a.endpoint, [Op(dst, 0, RegionDesc(5, 16, 0, os.path.basename(folder)), 0, 16)])
        assert res.statuses == (EntryStatus.FAILED,) and "cannot map peer segment" in res.detail
    finally:
        os.rmdir(folder)
        a.close()


def test_sweep_removes_segments_of_dead_processes(tmp_path: object) -> None:
    import os
    from pathlib import Path

    from gyre_xfer.shm import sweep_orphans

    d = Path(str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (d / f"gyre-{dead.pid}-abcd-1").write_bytes(b"x")
    (d / f"gyre-{os.getpid()}-abcd-1").write_bytes(b"x")
    (d / "someone-else").write_bytes(b"x")
    assert sweep_orphans(str(d)) == [str(d / f"gyre-{dead.pid}-abcd-1")]
    assert sorted(p.name for p in d.iterdir()) == [f"gyre-{os.getpid()}-abcd-1", "someone-else"]


# ---- shared memory: large batches copied in pieces on several threads --------------------------------

SHM_N = 1 << 16
SMALL_PIECE = 4099  # odd: pieces start and end at odd offsets


@pytest.fixture(scope="module")
def shm_pairs() -> Iterator[dict[int, tuple[Transport, Transport, Region, Region]]]:
    """Per copy_threads: (reader/writer transport, peer transport, a region of each)."""
    out = {}
    for threads in (1, 2, 3, 8):
        a = open_transport(Config(kind="shm", copy_threads=threads))
        b = open_transport(Config(kind="shm"))
        out[threads] = (a, b, a.alloc(SHM_N), b.alloc(SHM_N))
    yield out
    for a, b, _, _ in out.values():
        a.close()
        b.close()


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every batch threaded, in pieces of SMALL_PIECE bytes (the defaults need batches of 64 MiB)."""
    monkeypatch.setattr(shm_mod, "COPY_PIECE_BYTES", SMALL_PIECE)
    monkeypatch.setattr(shm_mod, "COPY_THREADED_MIN_BYTES", 1)


@st.composite
def copy_batches(draw: st.DrawFn) -> list[tuple[int, int, int]]:
    """(destination offset, source offset, length): in-range entries with disjoint destinations (some
    several pieces long, at odd offsets), mixed with entries reaching past either region."""
    out: list[tuple[int, int, int]] = []
    pos = draw(st.integers(0, 7))
    for _ in range(draw(st.integers(0, 8))):
        n = draw(st.one_of(st.integers(0, 40), st.integers(SMALL_PIECE - 2, 4 * SMALL_PIECE + 3)))
        if draw(st.integers(0, 4)) == 0:  # out of range on one side or the other
            if draw(st.booleans()):
                out.append((draw(st.integers(0, SHM_N)), SHM_N - draw(st.integers(0, 5)), n + 6))
            else:
                out.append((SHM_N - draw(st.integers(0, 5)), draw(st.integers(0, SHM_N)), n + 6))
            continue
        if pos + n > SHM_N:
            break
        out.append((pos, draw(st.integers(0, SHM_N - n)), n))
        pos += n + draw(st.integers(0, 9))
    return out


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(copy_batches(), st.sampled_from([1, 2, 3, 8]), st.booleans())
@example([(1, 3, 3 * SMALL_PIECE + 1), (SHM_N - 2, 0, 10), (4 * SMALL_PIECE, 5, SMALL_PIECE)], 2, True)
def test_shm_threaded_batches_copy_exactly_and_keep_each_entrys_status(
    small_pieces: None,
    shm_pairs: dict[int, tuple[Transport, Transport, Region, Region]],
    batch: list[tuple[int, int, int]],
    threads: int,
    reading: bool,
) -> None:
    a, b, mine, theirs = shm_pairs[threads]
    src, dst = (theirs, mine) if reading else (mine, theirs)
    assert src.array is not None and dst.array is not None
    src.array[:] = np.random.default_rng(len(batch)).integers(0, 256, SHM_N, dtype=np.uint8)
    dst.array[:] = 0
    if reading:
        ops = [Op(mine, d, theirs.desc, s, n) for d, s, n in batch]
        res = a.read(b.endpoint, ops)
    else:
        ops = [Op(mine, s, theirs.desc, d, n) for d, s, n in batch]
        res = a.write(b.endpoint, ops)
    want = np.zeros(SHM_N, np.uint8)
    expected = []
    for d, s, n in batch:
        if d + n <= SHM_N and s + n <= SHM_N:
            want[d : d + n] = src.array[s : s + n]
            expected.append(EntryStatus.OK)
        else:
            expected.append(EntryStatus.OUT_OF_RANGE)
    assert list(res.statuses) == expected
    assert np.array_equal(dst.array, want)
    assert ("exceeds" in res.detail) == (EntryStatus.OUT_OF_RANGE in expected)


class _Recorder:
    """Stands in for the transport's memmove: records (thread, destination, length) of each call, and
    holds its first two calls until both have arrived (proof that two threads copy at once)."""

    def __init__(self, meet: bool = True) -> None:
        self.calls: list[tuple[threading.Thread, int, int]] = []
        self.meeting = threading.Barrier(2, timeout=60) if meet else None
        self.turn = itertools.count()
        self.real = shm_mod._memmove

    def __call__(self, dst: int, src: int, n: int) -> int:
        self.calls.append((threading.current_thread(), dst, n))
        if self.meeting is not None and next(self.turn) < 2:
            self.meeting.wait()
        return int(self.real(dst, src, n))


def _big_batch(dst: Region, src: Region) -> list[Op]:
    """About 70 MiB (over the 64 MiB at which batches go to threads), odd lengths and offsets, one entry
    out of range and one empty."""
    MiB = 1 << 20
    return [
        Op(dst, 1, src.desc, 3, 40 * MiB + 7),
        Op(dst, 41 * MiB, src.desc, 0, 16),
        Op(dst, 42 * MiB + 5, src.desc, 41 * MiB + 1, 30 * MiB + 1),
        Op(dst, 0, src.desc, src.nbytes - 8, 16),  # out of range
        Op(dst, 80 * MiB, src.desc, 0, 0),
    ]


def _check_big_batch(dst: Region, src: Region, ops: list[Op], statuses: tuple[EntryStatus, ...]) -> None:
    assert dst.array is not None and src.array is not None
    ok = EntryStatus.OK
    assert statuses == (ok, ok, ok, EntryStatus.OUT_OF_RANGE, ok)
    for op in ops[:3]:
        got = dst.array[op.local_offset : op.local_offset + op.length]
        assert np.array_equal(got, src.array[op.remote_offset : op.remote_offset + op.length])
    assert dst.array[0] == 0 and (dst.array[40 * (1 << 20) + 8 : 41 * (1 << 20)] == 0).all()


def _read_big_batch(a: Transport, b: Transport, seed: int) -> tuple[Region, list[Op]]:
    """`a` reads `_big_batch` from 96 MiB of random bytes of `b` into a region of its own, checked with
    `_check_big_batch`; returns the source region and the batch."""
    src = b.alloc(96 << 20)
    dst = a.alloc(96 << 20)
    assert src.array is not None
    src.array[:] = np.random.default_rng(seed).integers(0, 256, src.nbytes, dtype=np.uint8)
    ops = _big_batch(dst, src)
    res = a.read(b.endpoint, ops)
    _check_big_batch(dst, src, ops, res.statuses)
    return src, ops


@pytest.mark.parametrize("threads", [2, 4])
def test_shm_large_batches_copy_in_pieces_on_several_threads(
    monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """At the real sizes: entries cut into 16 MiB pieces, copied by the calling thread and its helpers,
    at least two at once; byte-exact; the helpers are gone after close()."""
    rec = _Recorder()
    monkeypatch.setattr(shm_mod, "_memmove", rec)
    a = open_transport(Config(kind="shm", copy_threads=threads))
    b = open_transport(Config(kind="shm"))
    try:
        _read_big_batch(a, b, seed=5)
        lengths = sorted(n for _, _, n in rec.calls)
        assert max(lengths) == shm_mod.COPY_PIECE_BYTES == 16 << 20
        assert len(lengths) == 3 + 2 + 1 and sum(lengths) == 70 * (1 << 20) + 24  # 40+7, 16 B, 30+1
        copiers = {t for t, _, _ in rec.calls}  # the first two met in `rec`: at least two at once
        assert len(copiers) >= 2
        helpers = copiers - {threading.main_thread()}
        assert helpers and all(t.name.startswith("gyre-xfer-copy") for t in helpers)
        assert len(helpers) <= threads - 1
    finally:
        a.close()
        b.close()
    assert not any(t.is_alive() for t in helpers)  # close() stopped the pool


def test_shm_copy_threads_1_copies_each_entry_whole_on_the_calling_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rec = _Recorder(meet=False)
    monkeypatch.setattr(shm_mod, "_memmove", rec)
    a = open_transport(Config(kind="shm", copy_threads=1))
    b = open_transport(Config(kind="shm"))
    try:
        src, ops = _read_big_batch(a, b, seed=6)
        assert src.array is not None
        assert [n for _, _, n in rec.calls] == [ops[0].length, 16, ops[2].length, 0]
        assert {t for t, _, _ in rec.calls} == {threading.main_thread()}
        # small batches stay on the calling thread whatever copy_threads says
        c = open_transport(Config(kind="shm", copy_threads=8))
        try:
            rec.calls.clear()
            small = c.alloc(1 << 20)
            assert c.read(b.endpoint, [Op(small, 0, src.desc, 9, 1 << 20)]).ok
            assert [(t, n) for t, _, n in rec.calls] == [(threading.main_thread(), 1 << 20)]
            assert small.array is not None and np.array_equal(small.array, src.array[9 : 9 + (1 << 20)])
        finally:
            c.close()
    finally:
        a.close()
        b.close()


def test_shm_a_copy_that_raises_on_a_helper_thread_is_that_entrys_failed_status(
    small_pieces: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exception of a helper's memmove becomes its entry's FAILED status with the message; every
    other entry still arrives whole."""
    rec = _Recorder()
    rec.turn = itertools.count(1)  # only the caller's first call waits in `rec`; the helper's waits below
    meeting = rec.meeting
    assert meeting is not None
    raised: list[int] = []

    def flaky(dst: int, src: int, n: int) -> int:
        if threading.current_thread() is not threading.main_thread() and not raised:
            meeting.wait()  # the caller is at its first piece: this helper copies alongside it
            raised.append(dst)
            raise OSError("the page is gone")
        return rec(dst, src, n)

    monkeypatch.setattr(shm_mod, "_memmove", flaky)
    a = open_transport(Config(kind="shm", copy_threads=2))
    b = open_transport(Config(kind="shm"))
    try:
        src = b.alloc(SHM_N)
        dst = a.alloc(SHM_N)
        assert src.array is not None and dst.array is not None
        src.array[:] = np.random.default_rng(7).integers(0, 256, SHM_N, dtype=np.uint8)
        piece = SMALL_PIECE
        ops = [
            Op(dst, 0, src.desc, 1, 3 * piece),
            Op(dst, 3 * piece, src.desc, SHM_N - 1, 2),  # out of range
            Op(dst, 3 * piece + 1, src.desc, 7, 2 * piece + 5),
            Op(dst, 6 * piece, src.desc, 0, 100),
        ]
        res = a.read(b.endpoint, ops)
        assert len(raised) == 1
        bad = next(
            i
            for i, op in enumerate(ops)
            if dst.addr + op.local_offset <= raised[0] < dst.addr + op.local_offset + op.length
        )
        want = [EntryStatus.OK, EntryStatus.OUT_OF_RANGE, EntryStatus.OK, EntryStatus.OK]
        want[bad] = EntryStatus.FAILED
        assert list(res.statuses) == want
        assert f"entry {bad}: copy failed: OSError: the page is gone" in res.detail
        assert "exceeds peer region" in res.detail
        for i, op in enumerate(ops):
            if want[i] is EntryStatus.OK:
                got = dst.array[op.local_offset : op.local_offset + op.length]
                assert np.array_equal(got, src.array[op.remote_offset : op.remote_offset + op.length])
        with pytest.raises(OutOfRangeError, match=r"FAILED, OUT_OF_RANGE.*copy failed"):  # the worst entry
            res.raise_for_status(b.endpoint, "reading")
    finally:
        a.close()
        b.close()


def test_shm_threaded_batches_from_several_callers_at_once(small_pieces: None) -> None:
    """Callers sharing one transport (and its helper threads) each get their own bytes and statuses."""
    a = open_transport(Config(kind="shm", copy_threads=3))
    b = open_transport(Config(kind="shm"))
    try:
        src = b.alloc(SHM_N)
        dst = a.alloc(SHM_N)
        assert src.array is not None and dst.array is not None
        src.array[:] = np.random.default_rng(8).integers(0, 256, SHM_N, dtype=np.uint8)
        quarter = SHM_N // 4
        results: dict[int, tuple[EntryStatus, ...]] = {}

        def caller(k: int) -> None:
            for _ in range(20):
                ops = [
                    Op(dst, k * quarter + 1, src.desc, (3 - k) * quarter, quarter - 1),
                    Op(dst, 0, src.desc, SHM_N, 1),  # out of range
                ]
                results[k] = a.read(b.endpoint, ops).statuses

        callers = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
        for t in callers:
            t.start()
        for t in callers:
            t.join(timeout=60)
        assert results == {k: (EntryStatus.OK, EntryStatus.OUT_OF_RANGE) for k in range(4)}
        for k in range(4):
            got = dst.array[k * quarter + 1 : (k + 1) * quarter]
            assert np.array_equal(got, src.array[(3 - k) * quarter : (4 - k) * quarter - 1])
    finally:
        a.close()
        b.close()
