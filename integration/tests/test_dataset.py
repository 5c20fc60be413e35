"""Your own tasks and reward (`[tasks]`), and command-line overrides, without starting a run: the three
readers (JSON lines, Parquet written by pyarrow, directories HuggingFace `datasets` itself saved:
tests/data/hf, made by make_hf_datasets.py), errors that name the file, the row and the column, the
held-out split, the training order, the reward function's loading and every way it can fail (each an
evaluation failure, never a 0), the `[tasks]` checks, `SECTION.KEY=VALUE` overrides and their exit
status, and the README's quick start against the shipped example."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from gyre.cli import main
from gyre.config.runconfig import ConfigError, load_config, parse_override
from gyre.rollout.harnesses import ChatHarness, check_tasks, make_harness
from gyre.rollout.tasks.dataset import Cursor, DatasetTask, held_out, load_tasks, read_tasks
from gyre.rollout.tasks.reward import Reward, RewardError, load_function
from gyre.rollout.tasks.rows import DataError
from gyre_traj.records import EvalStatus

HERE = Path(__file__).resolve().parent
HF = HERE / "data" / "hf"
EXAMPLES = HERE.parent / "examples"
ROOT = HERE.parents[1]


def _row(i: int, **over: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "data_source": "arith",
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"What is {i} + 1?"},
        ],
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        "extra_info": {"index": i},
    }
    row.update(over)
    return {k: v for k, v in row.items() if v is not None}


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---- readers -------------------------------------------------------------------------------------


def test_jsonl_rows_become_tasks(tmp_path: Path) -> None:
    p = _jsonl(tmp_path / "d.jsonl", [_row(1), _row(2, extra_info=None)])
    a, b = read_tasks(str(p))
    assert a.messages == (("system", "Be brief."), ("user", "What is 1 + 1?"))
    assert a.chat() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 1 + 1?"},
    ]
    assert a.prompt == "Be brief.\n\nWhat is 1 + 1?"
    assert (a.ground_truth, a.data_source, a.family, a.extra_info) == ("2", "arith", "arith", {"index": 1})
    assert b.extra_info is None and b.where == f"{p} line 2"


@pytest.mark.parametrize(
    ("row", "column"),
    [
        (_row(0, prompt=None), "'prompt' is missing"),
        (_row(0, prompt="What is 1 + 1?"), "'prompt' must be a non-empty list"),
        (_row(0, prompt=[]), "'prompt' must be a non-empty list"),
        (_row(0, prompt=[{"role": "user"}]), "'prompt[0]' must be a message with role and content"),
        (_row(0, prompt=[{"role": "robot", "content": "x"}]), "'prompt[0].role' must be one of system"),
        (_row(0, prompt=[{"role": "user", "content": 3}]), "'prompt[0].content' must be a string"),
        (_row(0, reward_model=None), "'reward_model.ground_truth' is missing"),
        (_row(0, reward_model={"style": "rule"}), "'reward_model.ground_truth' is missing"),
        (_row(0, reward_model="7"), "'reward_model' must be a table with ground_truth"),
        (_row(0, data_source=None), "'data_source' is missing"),
        (_row(0, data_source=3), "'data_source' must be a string"),
    ],
)
def test_a_bad_row_names_file_line_and_column(tmp_path: Path, row: dict[str, Any], column: str) -> None:
    p = _jsonl(tmp_path / "d.jsonl", [_row(1), _row(2), row])
    with pytest.raises(DataError) as err:
        read_tasks(str(p))
    assert str(err.value).startswith(f"{p} line 3: column {column}")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json\n", "line 1: not JSON"),
        ("[1, 2]\n", "line 1: a row must be a JSON object, got list"),
        ("\n", "no rows"),
    ],
)
def test_unreadable_jsonl(tmp_path: Path, text: str, message: str) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text(text)
    with pytest.raises(DataError, match=re.escape(message)):
        read_tasks(str(p))


def test_unknown_paths_and_suffixes(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file or directory"):
        read_tasks(str(tmp_path / "missing.jsonl"))
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"use a \.jsonl or \.parquet file"):
        read_tasks(str(tmp_path / "d.csv"))
    with pytest.raises(DataError, match=r"no state\.json"):
        read_tasks(str(tmp_path))


def test_parquet_in_verls_layout(tmp_path: Path) -> None:
    """verl's preprocessing writes nested columns: prompt a list of structs, reward_model and extra_info
    structs. The tasks read from Parquet equal those read from the same rows as JSON lines."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_row(i) for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    _jsonl(tmp_path / "d.jsonl", rows)
    from_parquet = read_tasks(str(tmp_path / "d.parquet"))
    from_jsonl = read_tasks(str(tmp_path / "d.jsonl"))
    key = [(t.messages, t.ground_truth, t.data_source, t.extra_info) for t in from_parquet]
    assert key == [(t.messages, t.ground_truth, t.data_source, t.extra_info) for t in from_jsonl]
    assert from_parquet[3].where == f"{tmp_path / 'd.parquet'} row 3"

    bad = [_row(0), {k: v for k, v in _row(1).items() if k != "data_source"}]
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "bad.parquet")  # a null data_source in row 1
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'bad.parquet'} row 1: column 'data_source'")):
        read_tasks(str(tmp_path / "bad.parquet"))
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        read_tasks(str(tmp_path / "junk.parquet"))


def test_parquet_without_pyarrow_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "d.parquet").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if the extra were not installed
    with pytest.raises(DataError, match=re.escape("gyre[data]")):
        read_tasks(str(tmp_path / "d.parquet"))


@pytest.mark.parametrize("name", ["arith", "arith-shuffled"])
def test_datasets_directories_read_as_datasets_reads_them(name: str) -> None:
    """Directories `datasets.Dataset.save_to_disk` wrote (one shuffled and selected before saving): the
    rows equal what `datasets.load_from_disk` read from them (expected.json, recorded when they were made)."""
    expected = json.loads((HF / "expected.json").read_text())[name]
    tasks = read_tasks(str(HF / name))
    assert len(tasks) == len(expected)
    for t, row in zip(tasks, expected, strict=True):
        assert t.chat() == row["prompt"]
        assert t.ground_truth == row["reward_model"]["ground_truth"]
        assert (t.data_source, t.extra_info) == (row["data_source"], row["extra_info"])


def test_a_datasetdict_directory_names_its_splits() -> None:
    with pytest.raises(DataError, match="holds a DatasetDict") as err:
        read_tasks(str(HF / "arith-dict"))
    assert str(HF / "arith-dict" / "train") in str(err.value) and str(HF / "arith-dict" / "test") in str(
        err.value
    )
    assert len(read_tasks(str(HF / "arith-dict" / "test"))) == 1


# ---- splits and order ----------------------------------------------------------------------------


def _section(**kw: Any) -> Any:
    from gyre.config.runconfig import TasksSection

    return TasksSection(**{"reward": "r.py:f", **kw})


def test_held_out_share_by_prompt_hash(tmp_path: Path) -> None:
    rows = [_row(i) for i in range(400)]
    p = _jsonl(tmp_path / "d.jsonl", rows)
    ts = load_tasks(_section(train=str(p), eval_fraction=0.25))
    assert 60 < len(ts.eval) < 140 and len(ts.train) + len(ts.eval) == 400
    assert not {t.messages for t in ts.train} & {t.messages for t in ts.eval}
    # reordered, with duplicates (another extra_info): each prompt stays on its side
    again = _jsonl(
        tmp_path / "e.jsonl", [*reversed(rows), *(_row(i, extra_info={"copy": 1}) for i in range(50))]
    )
    ts2 = load_tasks(_section(train=str(again), eval_fraction=0.25))
    assert {t.messages for t in ts2.eval} == {t.messages for t in ts.eval}
    assert all(held_out(t, 0.25) for t in ts2.eval)


def test_eval_file_and_empty_sides(tmp_path: Path) -> None:
    train = _jsonl(tmp_path / "t.jsonl", [_row(i) for i in range(4)])
    ev = _jsonl(tmp_path / "e.jsonl", [_row(i) for i in range(10, 13)])
    ts = load_tasks(_section(train=str(train), eval=str(ev)))
    assert (len(ts.train), len(ts.eval)) == (4, 3)
    one = _jsonl(tmp_path / "one.jsonl", [_row(1)])
    with pytest.raises(DataError, match=r"eval_fraction = 0\.5 leaves no (training|evaluation) rows of 1"):
        load_tasks(_section(train=str(one), eval_fraction=0.5))


def test_cursor_goes_through_each_epoch_in_a_seeded_order(tmp_path: Path) -> None:
    tasks = read_tasks(str(_jsonl(tmp_path / "d.jsonl", [_row(i) for i in range(7)])))
    c = Cursor(tasks, seed=3)
    drawn = [c.next().task_id for _ in range(21)]
    for e in range(3):
        assert sorted(drawn[7 * e : 7 * e + 7]) == sorted(t.task_id for t in tasks)
    assert drawn[:7] != drawn[7:14]  # a new order each epoch
    again = Cursor(tasks, seed=3)
    assert [again.next().task_id for _ in range(21)] == drawn
    other = Cursor(tasks, seed=4)
    assert [other.next().task_id for _ in range(7)] != drawn[:7]


# ---- the reward function -------------------------------------------------------------------------

REWARDS = """
import math, threading, time

def fixed(data_source, solution_str, ground_truth, extra_info=None):
    return -2.5 if solution_str == ground_truth else 1e6

def with_extras(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 3, "length": len(solution_str), "note": "not a number", "source": data_source}

def echo_info(data_source, solution_str, ground_truth, extra_info=None):
    return float(extra_info["index"])

def raises(data_source, solution_str, ground_truth, extra_info=None):
    raise KeyError("boom")

def nan(data_source, solution_str, ground_truth, extra_info=None):
    return math.nan

def inf(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": math.inf}

def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}

def text(data_source, solution_str, ground_truth, extra_info=None):
    return "1.0"

def slow(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(1.0)
    return 1.0

STUCK = threading.Event()

def stuck(data_source, solution_str, ground_truth, extra_info=None):
    STUCK.wait(60.0)
    return 1.0

def two_args(data_source, solution_str):
    return 1.0

not_callable = 3
"""


@pytest.fixture
def rewards(tmp_path: Path) -> Path:
    p = tmp_path / "my_rewards.py"
    p.write_text(REWARDS)
    return p


def _task(i: int = 1) -> DatasetTask:
    return DatasetTask(f"row-{i}", (("user", f"What is {i} + 1?"),), str(i + 1), "arith", {"index": i})


def _score(reward: Reward, text: str | None, error: str = "") -> Any:
    return asyncio.run(reward.score(_task(), "e0", "g0", text, False, error))


def test_rewards_on_any_scale_and_their_extras(rewards: Path) -> None:
    fixed = Reward.load(f"{rewards}:fixed")
    assert _score(fixed, "2")[0].value == -2.5 and _score(fixed, "3")[0].value == 1e6
    s, extras = _score(Reward.load(f"{rewards}:with_extras"), "four")
    assert (s.status, s.value) == (EvalStatus.OK, 3.0)
    assert extras == {"length": 4.0} and s.detail == "length=4"
    assert _score(Reward.load(f"{rewards}:echo_info"), "x")[0].value == 1.0  # extra_info is passed


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("raises", "raised KeyError: 'boom'"),
        ("nan", "returned nan, not a finite number"),
        ("inf", "returned inf, not a finite number"),
        ("no_score", "returned a dict without 'score' (keys: acc)"),
        ("text", "returned str '1.0', expected a number"),
    ],
)
def test_a_failing_reward_is_an_evaluation_failure_not_a_zero(rewards: Path, name: str, why: str) -> None:
    s, extras = _score(Reward.load(f"{rewards}:{name}"), "2")
    assert s.status is EvalStatus.EVAL_FAILED and s.value is None and extras == {}
    assert s.detail == f"reward {rewards}:{name}: {why}"


def test_a_slow_reward_times_out_as_a_failure(rewards: Path) -> None:
    s, _ = _score(Reward.load(f"{rewards}:slow", timeout_s=0.1), "2")
    assert s.status is EvalStatus.EVAL_FAILED and "took longer than 0.1 s" in s.detail


def test_a_reward_that_never_returns_is_abandoned(rewards: Path) -> None:
    """Its thread is left behind (a daemon): the evaluation ends at the timeout, and the event loop's end
    does not wait for it (a worker of the loop's default executor would be waited for)."""
    import threading

    reward = Reward.load(f"{rewards}:stuck", timeout_s=0.1)
    s, _ = _score(reward, "2")
    try:
        assert s.status is EvalStatus.EVAL_FAILED and "took longer than 0.1 s" in s.detail
        left = [t for t in threading.enumerate() if t.name == "reward"]
        assert left and all(t.daemon and t.is_alive() for t in left)
    finally:
        reward.fn.__globals__["STUCK"].set()


def test_no_output_is_a_failure_and_errors_are_kept(rewards: Path) -> None:
    s, _ = _score(Reward.load(f"{rewards}:fixed"), None, "HarnessError: proxy answered 400")
    assert s.status is EvalStatus.EVAL_FAILED and s.detail == "HarnessError: proxy answered 400"
    s, _ = _score(Reward.load(f"{rewards}:fixed"), "2", "cut")
    assert s.value == -2.5 and s.detail == "cut"


def test_loading_by_module_or_file(rewards: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(rewards.parent))
    assert load_function("my_rewards:fixed")("d", "2", "2") == -2.5
    assert load_function(f"{rewards}:fixed")("d", "2", "2") == -2.5


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("{dir}/my_rewards.py", "expected module:function or path/to/file.py:function"),
        ("{dir}/nowhere.py:f", "no file"),
        ("{dir}/my_rewards.py:missing", "has no 'missing'"),
        ("{dir}/my_rewards.py:not_callable", "not_callable is not a function"),
        ("{dir}/my_rewards.py:two_args", "cannot be called as fn(data_source, solution_str, ground_truth"),
        ("no_such_module_here:f", "importing no_such_module_here raised ModuleNotFoundError"),
        ("{dir}/broken.py:f", "importing {dir}/broken.py raised ZeroDivisionError"),
    ],
)
def test_a_reward_that_cannot_be_loaded_names_why(rewards: Path, spec: str, message: str) -> None:
    (rewards.parent / "broken.py").write_text("x = 1 / 0\n")
    d = str(rewards.parent)
    with pytest.raises(RewardError, match=re.escape(message.format(dir=d))):
        load_function(spec.format(dir=d))


def test_the_examples_reward() -> None:
    fn = load_function(f"{EXAMPLES / 'arith_reward.py'}:compute_score")
    assert fn("arith/add", "The answer is 7", "7") == {"score": 1.0, "has_number": 1.0}
    assert fn("arith/add", "7 or 8", "7") == {"score": 0.0, "has_number": 1.0}  # the last number counts
    assert fn("arith/sub", "no idea", "2", extra_info={"index": 0}) == {"score": -1.0, "has_number": 0.0}


# ---- [tasks] in the config -----------------------------------------------------------------------


def _config(tmp_path: Path, tasks: str, extra: str = "") -> Path:
    p = tmp_path / "conf" / "c.toml"
    p.parent.mkdir(exist_ok=True)
    p.write_text(f"[tasks]\n{tasks}\n{extra}")
    return p


@pytest.mark.parametrize(
    ("tasks", "extra", "message"),
    [
        ('train = "d.jsonl"', "", "[tasks] reward is required with [tasks] train"),
        ('reward = "r.py:f"', "", "[tasks] eval, eval_fraction and reward need [tasks] train"),
        ('train = "d.jsonl"\nreward = "r.py:f"\neval = "e.jsonl"\neval_fraction = 0.1', "", "not both"),
        ('train = "d.jsonl"\nreward = "r.py:f"\neval_fraction = 1.0', "", "eval_fraction must be in [0, 1)"),
        ('train = "d.jsonl"\nreward = "r.py:f"', "[agent]\ntasks = 'code'", "[agent] tasks: leave it unset"),
        ('train = "d.jsonl"\nreward = "r.py:f"', "[eval]\ntasks = 4", "[eval] tasks > 0 with [tasks] train"),
        ("train = 3", "", "[tasks] train must be str, got 3"),
    ],
)
def test_tasks_section_checks(tmp_path: Path, tasks: str, extra: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(_config(tmp_path, tasks, extra))


def test_paths_are_taken_from_the_config_file_and_overrides_from_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = _config(tmp_path, 'train = "data/d.jsonl"\nreward = "r.py:f"\neval = "/abs/e.jsonl"')
    cfg = load_config(p)
    assert cfg.tasks.train == str(p.parent / "data" / "d.jsonl")
    assert cfg.tasks.reward == f"{p.parent / 'r.py'}:f" and cfg.tasks.eval == "/abs/e.jsonl"
    monkeypatch.chdir(tmp_path)
    cfg = load_config(p, ["tasks.train=other.jsonl", "tasks.reward=some.module:fn"])
    assert cfg.tasks.train == str(tmp_path / "other.jsonl") and cfg.tasks.reward == "some.module:fn"


def test_check_tasks_names_the_key_the_file_and_the_row(tmp_path: Path, rewards: Path) -> None:
    d = tmp_path / "conf"
    d.mkdir()
    _jsonl(d / "t.jsonl", [_row(1), _row(2, data_source=None)])
    _jsonl(d / "e.jsonl", [_row(3, prompt=[])])
    cfg = load_config(_config(tmp_path, f'train = "t.jsonl"\nreward = "{rewards}:fixed"'))
    with pytest.raises(
        ConfigError, match=re.escape(f"[tasks] train: {d / 't.jsonl'} line 2: column 'data_source'")
    ):
        check_tasks(cfg)
    _jsonl(d / "t.jsonl", [_row(1)])
    cfg = load_config(_config(tmp_path, f'train = "t.jsonl"\neval = "e.jsonl"\nreward = "{rewards}:fixed"'))
    with pytest.raises(
        ConfigError, match=re.escape(f"[tasks] eval: {d / 'e.jsonl'} line 1: column 'prompt'")
    ):
        check_tasks(cfg)
    cfg = load_config(_config(tmp_path, f'train = "t.jsonl"\nreward = "{rewards}:two_args"'))
    with pytest.raises(ConfigError, match=re.escape("[tasks] reward: ")):
        check_tasks(cfg)
    cfg = load_config(
        _config(tmp_path, f'train = "t.jsonl"\nreward = "{rewards}:fixed"', "[agent]\nharness = 'profile'")
    )
    with pytest.raises(ConfigError, match="the profile harness writes its own tasks"):
        check_tasks(cfg)


def test_the_builtin_harness_draws_your_rows_and_scores_with_your_reward(
    tmp_path: Path, rewards: Path
) -> None:
    import random

    from gyre.rollout.agents.chat import ChatExecution

    d = tmp_path / "conf"
    d.mkdir()
    _jsonl(d / "t.jsonl", [_row(i) for i in range(3)])
    cfg = load_config(_config(tmp_path, f'train = "t.jsonl"\nreward = "{rewards}:raises"'))
    h = make_harness(cfg)
    assert isinstance(h, ChatHarness)
    drawn = [h.task(random.Random(0), f"g{i}") for i in range(3)]
    assert sorted(t.ground_truth for t in drawn) == ["1", "2", "3"]
    ex = h.execution("g0-e0", "g0", drawn[0], 0.0, (0, 0, 0))
    assert isinstance(ex, ChatExecution)
    ex.final_text = "3"
    s = asyncio.run(h.score(ex, False, ""))
    assert s.status is EvalStatus.EVAL_FAILED and "raised KeyError" in s.detail


def test_a_command_agent_gets_the_prompt_text_and_is_rewarded(tmp_path: Path) -> None:
    """A command-line harness on your rows: the agent (a real process) is given the prompt's messages as
    one text; its standard output is the solution the example's reward scores."""
    import random

    from gyre.rollout.harnesses import CliHarness

    d = tmp_path / "conf"
    d.mkdir()
    _jsonl(d / "t.jsonl", [_row(4)])
    # an "agent" that answers the sum it reads in the prompt's last line: "What is 4 + 1?" -> 5
    agent = tmp_path / "agent.py"
    agent.write_text(
        "import re, sys\na, b = re.findall(r'\\d+', sys.argv[1].splitlines()[-1])\nprint(int(a) + int(b))\n"
    )
    cfg = load_config(
        _config(
            tmp_path,
            f'train = "t.jsonl"\nreward = "{EXAMPLES / "arith_reward.py"}:compute_score"',
            f"[run]\nout_dir = '{tmp_path / 'run'}'\n[agent]\nharness = 'command'\n"
            f"command = '{{python}} {agent} {{prompt}}'",
        )
    )
    h = CliHarness(cfg)
    task = h.task(random.Random(0), "s0-q0")
    assert (
        isinstance(task, DatasetTask)
        and h.argv(h.execution("e", "g", task, 0.0, (0, 0, 0)))[-1] == task.prompt
    )
    ex = h.execution("s0-q0-e0", "s0-q0", task, 0.0, (0, 0, 0))

    async def go() -> Any:
        import httpx

        async with httpx.AsyncClient() as http:
            await h.run(http, "http://127.0.0.1:9", ex)
        return await h.score(ex, False, "")

    s = asyncio.run(go())
    assert ex.final_text == "5" and (s.status, s.value) == (EvalStatus.OK, 1.0)


# ---- overrides -----------------------------------------------------------------------------------


def test_overrides_take_the_fields_types() -> None:
    assert parse_override("train.lr=1e-5") == ("train", "lr", 1e-5)
    assert parse_override("batch.queries=16") == ("batch", "queries", 16)
    assert parse_override("agent.temperature=1") == ("agent", "temperature", 1.0)
    assert parse_override("run.out_dir=2024") == ("run", "out_dir", "2024")  # a str field keeps the text
    assert parse_override('run.policy="async"') == ("run", "policy", "async")
    assert parse_override("agent.subagents=true") == parse_override("agent.subagents=True")
    assert parse_override("cell.gpus=[0, 1]") == ("cell", "gpus", [0, 1])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("train.lr=fast", "override 'train.lr=fast': [train] lr must be float, got 'fast'"),
        ("batch.queries=1.5", "[batch] queries must be int, got 1.5"),
        ("train.lrr=1", "[train] unknown key 'lrr'; known: chunk_budget, j_max"),
        ("trian.lr=1", "override 'trian.lr=1': unknown section [trian]"),
        ("train=1", "expected SECTION.KEY=VALUE"),
        ("train.lr", "expected SECTION.KEY=VALUE"),
        ("agent.subagents=yes", "[agent] subagents must be bool, got 'yes'"),
    ],
)
def test_bad_overrides_name_the_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_override(text)


def test_overrides_apply_over_the_file_and_its_checks() -> None:
    cfg = load_config(EXAMPLES / "tiny.toml", ["train.lr=1e-5", "batch.queries=16", "run.policy=async"])
    assert (cfg.train.lr, cfg.batch.queries, cfg.run.policy) == (1e-5, 16, "async")
    with pytest.raises(
        ConfigError, match=re.escape("(with batch.group_size=1): [batch] group_size must be >= 2")
    ):
        load_config(EXAMPLES / "tiny.toml", ["batch.group_size=1"])


@pytest.mark.parametrize("command", ["run", "eval", "compare"])
def test_the_cli_refuses_a_bad_override_with_exit_2(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    extra = ["--checkpoint", str(EXAMPLES)] if command == "eval" else []
    assert main([command, str(EXAMPLES / "tiny.toml"), *extra, "train.lrr=1e-5"]) == 2
    assert "override 'train.lrr=1e-5': [train] unknown key 'lrr'" in capsys.readouterr().err
    assert main([command, str(EXAMPLES / "tiny.toml"), *extra, "batch.queries=many"]) == 2
    assert "[batch] queries must be int, got 'many'" in capsys.readouterr().err


def test_the_cli_refuses_bad_rows_and_checkpoints_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _jsonl(tmp_path / "bad.jsonl", [_row(1, reward_model={"style": "rule"})])
    assert main(["run", str(EXAMPLES / "dataset.toml"), f"tasks.train={bad}"]) == 2
    assert (
        f"[tasks] train: {bad} line 1: column 'reward_model.ground_truth' is missing"
        in capsys.readouterr().err
    )
    assert (
        main(["eval", str(EXAMPLES / "dataset.toml"), "--checkpoint", str(tmp_path), "--out", str(tmp_path)])
        == 2
    )
    assert f"--checkpoint {tmp_path}: not a HuggingFace model directory" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")  # a model directory, as far as gyre eval looks first
    assert (
        main(["eval", str(EXAMPLES / "tiny.toml"), "--checkpoint", str(tmp_path), "--out", str(tmp_path)])
        == 2
    )
    assert "[eval] tasks is 0: say how many held-out tasks, e.g. eval.tasks=32" in capsys.readouterr().err
    args = ["--checkpoint", str(tmp_path), "--out", str(tmp_path), "tasks.eval=", "eval.tasks=0"]
    assert main(["eval", str(EXAMPLES / "dataset.toml"), *args]) == 2
    assert "no evaluation split: set [tasks] eval or [tasks] eval_fraction" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ended:
        main(["run", "--resume", str(tmp_path), "train.lr=1"])
    assert ended.value.code == 2


# ---- the README's quick start is the shipped example ---------------------------------------------


@pytest.mark.parametrize("readme", [ROOT / "README.md", ROOT / "integration" / "README.md"])
def test_the_readme_quick_start_is_the_example(readme: Path) -> None:
    """The quick start's row is the example's first row, its reward function is the example's file
    (without its docstring), and its config lines are in examples/dataset.toml."""
    text = readme.read_text()
    start = text.index("## Bring your own data and reward")
    blocks = re.findall(r"```(\w+)\n(.*?)```", text[start:], re.S)[:4]
    kinds = [k for k, _ in blocks]
    assert kinds == ["json", "python", "toml", "sh"], kinds
    (_, row), (_, reward), (_, toml), (_, commands) = blocks
    first = (EXAMPLES / "arith-train.jsonl").read_text().splitlines()[0]
    assert json.loads(row) == json.loads(first)
    shipped = (EXAMPLES / "arith_reward.py").read_text()
    assert reward.strip() == shipped[shipped.index("import re") :].strip()
    example = (EXAMPLES / "dataset.toml").read_text().splitlines()
    for line in toml.strip().splitlines():
        assert line in example, line
    assert "gyre run integration/examples/dataset.toml" in commands
    assert "gyre eval integration/examples/dataset.toml --checkpoint" in commands
