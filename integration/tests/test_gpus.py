"""Cells on GPUs: `[cell] gpus` (shared GPUs allowed) and `[engine]` options, checked once in the config."""

from __future__ import annotations

import pytest
from gyre.config.runconfig import ConfigError, config_from_dict
from gyre.system import gpus


def test_two_cells_share_gpu_0() -> None:
    cfg = config_from_dict(
        {
            "cell": {"device": "cuda", "gpus": [0, 0]},
            "engine": {"kv_fraction": 0.1},
            "proxy": {"kv_transport": "cuda_ipc"},  # moved calls' prefixes device to device on GPU 0
        }
    )
    assert cfg.proxy.kv_transport == "cuda_ipc" and config_from_dict({}).proxy.kv_transport == "shm"
    assert gpus.cell_gpus(cfg) == [0, 0]
    assert gpus.cell_env(cfg, 1) == {"CUDA_VISIBLE_DEVICES": "0"}
    assert gpus.sharing(cfg) == {0: [0, 1]}


def test_default_is_cell_i_on_gpu_i_and_nothing_on_the_cpu() -> None:
    cuda = config_from_dict({"run": {"cells": 3}, "cell": {"device": "cuda"}})
    assert gpus.cell_gpus(cuda) == [0, 1, 2] and gpus.cell_env(cuda, 2) == {"CUDA_VISIBLE_DEVICES": "2"}
    cpu = config_from_dict({})
    assert gpus.cell_gpus(cpu) == [None, None] and gpus.cell_env(cpu, 0) == {} and gpus.sharing(cpu) == {}


def test_engine_options_reach_the_serve_command(capsys: pytest.CaptureFixture[str]) -> None:
    argv = gpus.engine_argv(
        config_from_dict(
            {
                "engine": {
                    "max_running": 16,
                    "kv_fraction": 0.1,
                    "warmup_tokens": 256,
                    "compile_decode": False,
                    "max_cached_tokens": 65536,
                    "slot_widths": "full",
                    "long_context_tokens": 33280,
                    "long_context_slots": 6,
                    "prefill_chunk": 4608,
                    "keep_graphs": False,
                    "prefill_graphs": False,
                }
            }
        )
    )
    assert argv == [
        "--max-running-requests", "16", "--slot-kv-fraction", "0.1", "--warmup-decode-tokens", "256",
        "--decode-slots", "auto", "--slot-widths", "full", "--max-cached-tokens", "65536",
        "--long-context-tokens", "33280", "--long-context-slots", "6", "--prefill-chunk", "4608",
        "--no-keep-graphs", "--prefill-graph-tokens", "0", "--no-compile-decode",
    ]  # fmt: skip
    plain = gpus.engine_argv(config_from_dict({}))
    assert not {
        "--max-cached-tokens",
        "--long-context-tokens",
        "--long-context-slots",
        "--prefill-chunk",
        "--no-keep-graphs",
        "--prefill-graph-tokens",
    } & set(plain)  # 0: the engine's defaults; graphs kept
    from gyre_engine.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    known = capsys.readouterr().out
    assert all(a in known for a in argv if a.startswith("--"))  # every option is one `serve` knows


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ({"cell": {"gpus": [0, 0]}}, 'needs device = "cuda"'),
        ({"cell": {"device": "cuda", "gpus": [0]}}, "one GPU per cell (2), got 1"),
        ({"cell": {"device": "cuda", "gpus": [0, -1]}}, "GPU indices >= 0"),
        ({"cell": {"device": "cuda", "gpus": [0, True]}}, "GPU indices >= 0"),
        ({"cell": {"device": "cuda", "gpus": "0,0"}}, "gpus must be list"),
        ({"cell": {"device": "cuda", "gpus": [0, 0]}, "engine": {"kv_fraction": 0.5}}, "exceeds 0.8"),
        ({"engine": {"kv_fraction": 0.0}}, "kv_fraction must be in (0, 1)"),
        ({"engine": {"decode_slots": "fast"}}, "decode_slots"),
        ({"engine": {"max_cached_tokens": -1}}, "max_cached_tokens must be >= 0"),
        ({"engine": {"prefill_chunk": -1}}, "prefill_chunk must be >= 0"),
        ({"engine": {"slot_widths": "wide"}}, "slot_widths: bucketed|full"),
        ({"engine": {"long_context_tokens": -1}}, "long_context_tokens and long_context_slots must be >= 0"),
        ({"engine": {"long_context_slots": 4}}, "long_context_slots needs long_context_tokens"),
        ({"engine": {"graphs": 1}}, "unknown key 'graphs'"),
        (
            {"proxy": {"kv_transport": "nvlink"}},
            "[proxy] kv_transport must be one of shm, mooncake, http, cuda_ipc",
        ),
    ],
)
def test_bad_placements_are_refused_naming_the_key(raw: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError) as exc:
        config_from_dict(raw)
    assert says in str(exc.value)
