"""The warm start: transcripts rendered by gyre-proxy's own renderer and parsed back by its parser,
tree-packed training on them with the right targets, determinism from the seed, and the cache."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from gyre.rollout.tasks import qa as tasks
from gyre.rollout.warmstart import (
    TranscriptMaker,
    WarmStartConfig,
    _torch_batch,
    cache_key,
    cached_dir,
    pack_shared,
    transcripts,
    warm_start,
)

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gyre_engine.server.model_factory import create_model

    return create_model(tmp_path_factory.mktemp("ws") / "tiny", "tiny", seed=0)


def test_transcripts_are_what_the_proxy_renders_and_parses(model_dir: Path) -> None:
    from gyre_proxy.toolparse import BlockKind, parse

    maker = TranscriptMaker(model_dir, 32)
    tok = maker.renderer.tok
    rng = random.Random(0)
    for fam in tasks.FAMILIES:
        task = tasks.make_task(rng, "t", family=fam)
        for choice in task.fam.choices:
            tr = maker.make(task, choice)
            (s1, e1), (s2, e2) = tr.targets
            assert e2 == tr.ids.size and e1 < s2
            step = task.call(choice)
            result, err = tasks.run_tool(task, step.name, step.arguments)
            blocks = parse(tok.decode(tr.ids[s1:e1].tolist(), skip_special_tokens=False))
            assert [(b.kind, b.name) for b in blocks] == [(BlockKind.TOOL, task.fam.tool)] and not err
            assert json.loads(blocks[0].text) == {task.fam.param: choice}
            # the answer is the tool's result (the task's answer only for the question's own choice)
            assert tok.decode(tr.ids[s2:e2].tolist(), skip_special_tokens=False) == result + "<|im_end|>"
            assert (result == task.answer) is (choice == task.choice)
            between = tok.decode(tr.ids[e1:s2].tolist(), skip_special_tokens=False)
            assert result in between  # the tool's output: context only
    # the whole prompt of the first call is the model's own chat template (what the proxy is tested on)
    from gyre.rollout.agents.agent import SYSTEM
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir)
    text = hf.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.prompt}],
        tokenize=False, add_generation_prompt=True, enable_thinking=False,
    )  # fmt: skip
    assert tok.decode(tr.ids[:s1].tolist(), skip_special_tokens=False) == text


def test_shared_prefix_packing_gives_each_transcript_its_own_logprobs(model_dir: Path) -> None:
    from gyre_traj.loss import target_logprobs
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    batch = transcripts(TranscriptMaker(model_dir, 32), 3, WarmStartConfig(seed=4))
    with torch.no_grad():
        packed = target_logprobs(model, _torch_batch(pack_shared(batch)))
        alone = []
        for t in batch:
            lp = torch.log_softmax(model(input_ids=torch.tensor(t.ids.tolist())[None]).logits[0], -1)
            for s, e in t.targets:
                alone.append(lp[s - 1 : e - 1].gather(1, torch.tensor(t.ids[s:e].tolist())[:, None])[:, 0])
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=1e-5)
    # every call of the batch weighs the same in the loss, whatever its length
    weights, at = pack_shared(batch)["target_weights"], 0
    for t in batch:
        for s, e in t.targets:
            assert np.isclose(weights[at : at + e - s].sum(), 1 / (2 * len(batch)))
            at += e - s
    assert at == weights.size


def test_the_teacher_prefers_the_default_and_rarely_makes_the_questions_choice() -> None:
    """The warm start's calls make the family's default choice half the time and each other choice a
    quarter (never looking at what the question asks), so the warm-started model's greedy call is the
    default, which no question asks for, and a sampled call is right about one time in four: the reward
    varies within a group, which is RL's signal."""
    from gyre.rollout.warmstart import teacher_choices

    rng_tasks = random.Random(2)
    todo = [tasks.make_task(rng_tasks, f"t{i}", "train") for i in range(4000)]
    assert all(t.choice != t.fam.choices[0] for t in todo)  # no question asks for the default
    picks = teacher_choices(todo, WarmStartConfig(seed=3))
    default = np.mean([p == t.fam.choices[0] for t, p in zip(todo, picks, strict=True)])
    right = np.mean([p == t.choice for t, p in zip(todo, picks, strict=True)])
    assert 0.47 < default < 0.53 and 0.22 < right < 0.28, (default, right)
    assert all(p in t.fam.choices for t, p in zip(todo, picks, strict=True))
    cued = teacher_choices(todo, WarmStartConfig(seed=3, cue_share=1.0))
    assert cued == [t.choice for t in todo]


def test_deterministic_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors.numpy import load_file

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = WarmStartConfig(shape="tiny", steps=3, batch=2, warmup=1, seed=5)
    first, meta = warm_start(cfg, say=lambda _: None, progress=False)
    assert (
        not meta["cached"]
        and first == cached_dir(cfg)
        and str(first).startswith(str(tmp_path / "cache" / "gyre"))
    )
    again, meta2 = warm_start(cfg, say=lambda _: None)
    assert again == first and meta2["cached"]
    other, _ = warm_start(
        WarmStartConfig(shape="tiny", steps=3, batch=2, warmup=1, seed=6), say=lambda _: None, progress=False
    )
    assert other != first and cache_key(cfg) != cache_key(
        WarmStartConfig(shape="tiny", steps=3, batch=2, warmup=1, seed=6)
    )
    # the same config trained again elsewhere gives the same weights
    from gyre.rollout.warmstart import train

    train(cfg, tmp_path / "again", progress=False)
    a, b = (
        load_file(str(first / "model.safetensors")),
        load_file(str(tmp_path / "again" / "model.safetensors")),
    )
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert not all(np.array_equal(a[k], load_file(str(other / "model.safetensors"))[k]) for k in a)
