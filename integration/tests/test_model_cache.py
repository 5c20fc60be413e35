"""The benchmark's model cache (bench/model_cache.py): a warm-started model kept between GPU calls on one
machine is found again only by a call that would make the same model, and one cut short is never found."""

from __future__ import annotations

from pathlib import Path

from gyre_engine.server.model_factory import create_model

from .benchmods import bench_module

MADE = {"shape": "tiny", "dtype": "float32", "seed": 7, "warmstart_steps": 4, "lr": 3e-3}


def test_a_kept_model_is_found_by_the_same_request_only(tmp_path: Path) -> None:
    mc = bench_module("model_cache")
    cache = tmp_path / "cache"
    assert mc.find(cache, MADE) is None  # nothing there yet
    mc.clear(cache)
    model = create_model(cache / "model", shape="tiny", seed=7)
    assert mc.find(cache, MADE) is None  # made but not recorded: a call cut short before keep()
    mc.keep(cache, MADE, {"losses": [3.2, 2.9], "seconds": 1.5})
    found = mc.find(cache, MADE)
    assert found is not None
    assert found[0] == model and (found[0] / "config.json").is_file()
    assert found[1] == {"losses": [3.2, 2.9], "seconds": 1.5}
    for key, other in (("seed", 8), ("warmstart_steps", 0), ("shape", "qwen3-0.6b"), ("lr", 3e-4)):
        assert mc.find(cache, {**MADE, key: other}) is None, key


def test_clear_forgets_the_model_and_a_lost_model_is_not_found(tmp_path: Path) -> None:
    mc = bench_module("model_cache")
    cache = tmp_path / "cache"
    mc.clear(cache)
    create_model(cache / "model", shape="tiny", seed=7)
    mc.keep(cache, MADE, None)
    assert mc.find(cache, MADE) is not None
    (cache / "model" / "config.json").unlink()  # the weights' folder lost: made again
    assert mc.find(cache, MADE) is None
    mc.keep(cache, MADE, None)
    mc.clear(cache)
    assert not (cache / "model").exists() and mc.find(cache, MADE) is None
    (cache / "made.json").write_text("{not json")  # a damaged record is no model
    assert mc.find(cache, MADE) is None
