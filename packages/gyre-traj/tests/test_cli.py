from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gyre_traj.cli import main

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "branching.jsonl"


def test_inspect_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(EXAMPLE)]) == 0
    out = capsys.readouterr()
    assert "execution query-0-e0" in out.out and "dedup ratio" in out.out
    assert "4 executions" in out.out and "4 drift events" in out.out
    assert "drift: execution" in out.err


def test_inspect_json_and_j_max(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(EXAMPLE), "--json", "--j-max", "2"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 4
    for r in rows:
        assert len(r["selected"]) == 2 and r["dedup_ratio"] > 1
        assert [t["role"] for t in r["selected"]] == ["main", "main"]
        assert r["unique_tokens"] < r["call_tokens"]


def test_pack_writes_microbatches(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "packed"
    assert main(["pack", str(EXAMPLE), "--out", str(out), "--budget", "3000"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["executions"] == 3 and manifest["eval_failed"] == 1  # one evaluation failure left out
    total_w = 0.0
    for mb in manifest["micro_batches"]:
        data = np.load(out / mb["file"])
        assert data["input_ids"].shape == data["position_ids"].shape == data["last_desc"].shape
        assert data["input_ids"].shape[0] == mb["tokens"] <= 3000
        total_w += float(data["weights"].sum())
    assert total_w == pytest.approx(1.0, abs=1e-5)  # token mean per execution, then mean over executions
    assert "left out: 1 evaluation failures" in capsys.readouterr().out


def test_bad_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"kind":"call","execution_id":"e","call_id":"c1","agent_id":"a","role":"main",'
        '"input_delta":{"parent":"c0","keep":1,"append":[]},"output_ids":[],'
        '"output_logprobs":[],"weight_version":0}\n'
    )
    assert main(["inspect", str(bad)]) == 2
    assert "unknown parent call 'c0'" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "missing.jsonl")]) == 2


def test_pack_without_scores_explains(tmp_path: Path) -> None:
    lines = [x for x in EXAMPLE.read_text().splitlines() if '"kind":"score"' not in x]
    f = tmp_path / "unscored.jsonl"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit, match="4 unscored"):
        main(["pack", str(f), "--out", str(tmp_path / "o")])
    assert main(["pack", str(f), "--out", str(tmp_path / "o"), "--unscored", "zero"]) == 0


def test_compact_gives_the_same_inspection(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "compact.msgpack"
    assert main(["compact", str(EXAMPLE), "--out", str(out), "--batch", "5"]) == 0
    said = capsys.readouterr().out
    assert "call batches and 4 scores" in said and str(out) in said
    assert main(["inspect", str(EXAMPLE), "--json"]) == 0
    before = json.loads(capsys.readouterr().out)
    assert main(["inspect", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == before
    assert not list(tmp_path.glob("*.partial"))


def test_compact_refuses_bad_input_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(EXAMPLE.read_text().splitlines()[0] + "\n{not json\n")
    out = tmp_path / "c.msgpack"
    assert main(["compact", str(bad), "--out", str(out)]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob("*.partial"))
    with pytest.raises(SystemExit, match="must differ"):
        main(["compact", str(bad), "--out", str(bad)])


@pytest.mark.slow
def test_bench_quick_prints_json_last() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gyre_traj.cli", "bench", "--quick"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("dedup_ratio", "delta_ingest_s", "full_ingest_s", "copy_s", "peak_rss_mb"):
        assert key in result
    # The live and batched ingests, side by side with the copy of the execution's bytes (the bench
    # checks the live tree call by call against the records and fails if it differs).
    assert result["execution_bytes_live"] > 0 and result["ingest_peak_bytes_live"] > 0
    assert result["ingest_peak_over_bytes"] == round(
        result["ingest_peak_bytes_live"] / result["execution_bytes_live"], 3
    )
    for key in (
        "ingest_over_memcpy_700k_live",
        "ingest_over_memcpy_700k_batched",
        "ingest_over_memcpy_700k_live_cpu",
    ):
        assert result[key] > 0
    assert result["dedup_ratio"] > 1 and result["tree_packed_tokens_j5"] < result["path_expanded_tokens_j5"]


@pytest.mark.parametrize("suffix", [".jsonl", ".msgpack"])
def test_inspect_counts_non_extensions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], suffix: str
) -> None:
    """A call marked `extends` whose input re-renders the earlier output (here: the template's turn
    opening without the think block the policy's output followed) is a branch, not drift; inspect counts
    it as a non-extension. A call that extends exactly, and one not marked, count nothing."""
    from gyre_traj.io import write_records
    from gyre_traj.records import Call, Delta, Role

    def call(cid: str, out: list[int], **kw: object) -> Call:
        return Call(
            execution_id="e",
            call_id=cid,
            agent_id="main",
            role=Role.MAIN,
            output_ids=np.array(out),
            output_logprobs=np.full(len(out), -0.5),
            weight_version=0,
            **kw,  # type: ignore[arg-type]
        )

    sys_user, gen, out1 = [1001, 2001, 2002], [5001, 5002], [6001, 6002, 9]
    c1 = call("c1", out1, input_ids=np.array(sys_user + gen))
    # c2 only appended and carries c1's input + output exactly
    c2 = call("c2", [6003, 9], input_delta=Delta("c1", 8, np.array([2003, *gen])), metadata={"extends": "c1"})
    # c3 only appended, but its input re-rendered c2's turn without the think block (5002) that c2's
    # generation prompt held: it diverges at a context token, inside c2's input
    c3 = call(
        "c3",
        [6004, 9],
        input_delta=Delta("c2", 10, np.array([6003, 9, 2004, *gen])),
        metadata={"extends": "c2", "stripped.billing": "x-anthropic-billing-header: cc_version=1"},
    )
    c4 = call("c4", [6005, 9], input_ids=np.array(sys_user))  # a fresh start (compaction): not marked
    path = tmp_path / f"log{suffix}"
    write_records(path, [c1, c2, c3, c4])
    assert main(["inspect", str(path), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["appended_calls"], row["non_extensions"], row["drifts"]) == (2, 1, 0)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "1 of 2 calls that only appended" in out and "1 non-extensions" in out


def test_a_record_without_metadata_reads(tmp_path: Path) -> None:
    """Logs written before `Call.metadata` existed read as they are (empty metadata)."""
    from gyre_traj.io import read_records
    from gyre_traj.records import Call

    old = tmp_path / "old.jsonl"
    old.write_text(
        '{"kind":"call","execution_id":"e","call_id":"c1","agent_id":"a","role":"main",'
        '"input_ids":[1,2],"output_ids":[3],"output_logprobs":[-0.1],"weight_version":0}\n'
    )
    (rec,) = read_records(old)
    assert isinstance(rec, Call) and rec.metadata == {}
