"""The record log under real failures: a full filesystem (a small tmpfs mounted for the test), a file size
limit (RLIMIT_FSIZE, which needs no root) and a crash-torn last frame.

Every call is answered either with its record durable in the log or with an error in the API's JSON
shape, and then its record is not in the log, now or later (the old sink answered plain-text 500s and its
buffer later flushed records of calls the client saw fail). A torn tail is moved to a side file before
the sink appends."""

from __future__ import annotations

import asyncio
import errno
import json
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from gyre_proxy.sink import RecordSink
from gyre_traj.io import Codec, read_records
from gyre_traj.records import Call, Role


def _call(i: int, n_in: int = 50) -> Call:
    return Call(
        execution_id="e",
        call_id=f"c{i}",
        agent_id="main",
        role=Role.MAIN,
        input_ids=np.arange(1000, 1000 + n_in, dtype=np.int32),
        output_ids=np.asarray([4000 + i], np.int32),
        output_logprobs=np.asarray([-0.5], np.float32),
        weight_version=0,
    )


def _ids(path: Path) -> list[str]:
    """Call ids in the log, read strictly (a torn or corrupt frame would fail)."""
    return [r.call_id for r in read_records(path, tolerate_torn_tail=False) if isinstance(r, Call)]


# ------------------------------------------------------------------------------ a full filesystem


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs mounted for the test (needs root); skipped where it cannot be mounted."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command here; test_sink_under_a_file_size_limit covers the sink without root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        why = r.stderr.decode(errors="replace").strip() or f"mount exited {r.returncode}"
        pytest.skip(
            f"cannot mount a small tmpfs here ({why}); test_sink_under_a_file_size_limit runs instead"
        )
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(fs: Path) -> Path:
    filler = fs / "filler"
    with open(filler, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def _one_call(url: str, i: int) -> tuple[bool, str]:
    """One call, by API and streaming in turn: (answered, call id). A failure must be an error in the
    API's JSON shape (in-band for a stream)."""
    api, stream = ("anthropic", "openai")[i % 2], bool(i // 2 % 2)
    text = f"call {i}: " + "the disk is full " * 120  # about 2 KB of record per call
    msgs = [{"role": "user", "content": text}]
    hdr = {"x-gyre-execution": f"ex-{i}"}
    if api == "anthropic":
        path, body = "/v1/messages", {"model": "m", "max_tokens": 20, "messages": msgs, "stream": stream}
    else:
        path, body = (
            "/v1/chat/completions",
            {"model": "m", "max_tokens": 20, "messages": msgs, "stream": stream},
        )
    r = httpx.post(f"{url}{path}", json=body, headers=hdr, timeout=60)
    if not stream:
        obj = r.json()  # JSON whatever the status
        if r.status_code == 200:
            return True, obj["id"].split("_", 1)[1] if api == "anthropic" else obj["id"].split("-", 1)[1]
        assert r.status_code == 500
        err = obj["error"]
        assert err["type"] == ("api_error" if api == "anthropic" else "server_error"), obj
        assert "record log could not be written" in err["message"]
        return False, ""
    assert r.status_code == 200
    datas = [
        json.loads(line[5:])
        for line in r.text.splitlines()
        if line.startswith("data:") and line[5:].strip() != "[DONE]"
    ]
    if api == "anthropic":
        call_id = datas[0]["message"]["id"].split("_", 1)[1]
        if datas[-1]["type"] == "message_stop":
            return True, call_id
        assert datas[-1]["type"] == "error" and datas[-1]["error"]["type"] == "api_error", datas[-1]
        return False, ""
    if "error" in datas[-1]:
        assert datas[-1]["error"]["type"] == "server_error"
        return False, ""
    assert r.text.rstrip().endswith("data: [DONE]")
    return True, datas[0]["id"].split("-", 1)[1]


def test_a_full_disk_fails_calls_cleanly_and_leaves_no_late_records(
    small_fs: Path, engine: Any, make_proxy: Any
) -> None:
    engine.default = "noted"
    log = small_fs / "records.msgpack"
    ps = make_proxy([engine.url], record_log=str(log))
    answered = [cid for ok, cid in (_one_call(ps.url, i) for i in range(2)) if ok]
    assert len(answered) == 2
    filler = _fill(small_fs)
    during = [_one_call(ps.url, i) for i in range(2, 18)]
    failed = sum(1 for ok, _ in during if not ok)
    assert failed >= 8, f"the disk was full, yet {16 - failed} of 16 calls were answered"
    answered += [cid for ok, cid in during if ok]
    filler.unlink()
    after = [_one_call(ps.url, i) for i in range(18, 22)]
    assert all(ok for ok, _ in after)
    answered += [cid for _, cid in after]
    assert _ids(log) == answered  # exactly the calls answered, in order; nothing torn, nothing late
    stats = httpx.get(f"{ps.url}/gyre/stats").json()
    assert stats["record_write_failures"] == failed and stats["records_written"] == len(answered)


# ------------------------------------------------------------------------------ a file size limit

_LIMITED = textwrap.dedent(
    """
    import asyncio, json, resource, sys
    import numpy as np
    from gyre_proxy.sink import RecordSink, RecordWriteFailed
    from gyre_traj.records import Call, Role

    def call(i):
        return Call(execution_id="e", call_id=f"c{i}", agent_id="main", role=Role.MAIN,
                    input_ids=np.arange(1000, 1050, dtype=np.int32), output_ids=np.asarray([4000 + i], np.int32),
                    output_logprobs=np.asarray([-0.5], np.float32), weight_version=0)

    async def main():
        sink = RecordSink(sys.argv[1])
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), hard))  # Python ignores SIGXFSZ
        out = []
        for i in range(12):
            if i == 9:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            try:
                await sink.write(call(i))
                out.append(f"c{i}")
            except RecordWriteFailed as exc:
                out.append("failed: " + str(exc))
        sink.close()
        print(json.dumps(out))

    asyncio.run(main())
    """
)


def test_sink_under_a_file_size_limit(tmp_path: Path) -> None:
    """RLIMIT_FSIZE (EFBIG) in a subprocess: writes past the limit fail whole (a write that got partway is
    cut back), none appears later, and writing goes on once the limit is lifted."""
    log = tmp_path / "records.msgpack"
    frame = 4 + len(Codec().encode_msgpack(_call(0)))
    limit = 9 + 3 * frame + frame // 2  # room for three frames and half of a fourth
    r = subprocess.run(
        [sys.executable, "-c", _LIMITED, str(log), str(limit)], capture_output=True, timeout=120
    )
    assert r.returncode == 0, r.stderr.decode()
    out = json.loads(r.stdout.decode().splitlines()[-1])
    assert out[:3] == ["c0", "c1", "c2"]
    assert all(
        o.startswith("failed: the record log could not be written") and "File too large" in o
        for o in out[3:9]
    )
    assert out[9:] == ["c9", "c10", "c11"]
    assert _ids(log) == ["c0", "c1", "c2", "c9", "c10", "c11"]


# ------------------------------------------------------------------------------ a torn last frame


def test_a_torn_tail_is_moved_aside_before_appending(tmp_path: Path) -> None:
    log = tmp_path / "records.msgpack"

    async def write(ids: range) -> RecordSink:
        sink = RecordSink(log)
        for i in ids:
            await sink.write(_call(i))
        await asyncio.to_thread(sink.close)
        return sink

    asyncio.run(write(range(2)))
    whole = log.read_bytes()
    payload = Codec().encode_msgpack(_call(2))
    torn = len(payload).to_bytes(4, "little") + payload[:-7]  # a crash mid-append
    log.write_bytes(whole + torn)
    sink = asyncio.run(write(range(3, 5)))
    assert sink.stats.torn_bytes_moved == len(torn)
    assert (tmp_path / f"records.msgpack.torn-{len(whole)}").read_bytes() == torn
    assert _ids(log) == ["c0", "c1", "c3", "c4"]
    size = log.stat().st_size
    log.write_bytes(log.read_bytes() + torn)  # torn again, at another offset: another side file
    asyncio.run(write(range(5, 6)))
    assert (tmp_path / f"records.msgpack.torn-{size}").read_bytes() == torn
    assert _ids(log) == ["c0", "c1", "c3", "c4", "c5"]


def test_a_file_that_is_not_a_record_log_is_refused(tmp_path: Path) -> None:
    log = tmp_path / "records.msgpack"
    log.write_bytes(b'{"kind": "call"}\n')
    with pytest.raises(ValueError, match="not a gyre msgpack record stream"):
        RecordSink(log)
    assert log.read_bytes() == b'{"kind": "call"}\n'
