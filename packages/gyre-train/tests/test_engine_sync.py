"""The core pushing its weights through SGLang's weight-update endpoints to a real `gyre-engine serve`
process (the tiny Qwen3 of `gyre-engine create-model`), over a gloo group on loopback.

After each step the engine's greedy output and its logprobs are those of transformers on the core's
updated weights, and its weight_version is the core's version; a push with a wrong name or shape is
refused and the engine keeps serving the old version (and the group stays usable); a trainer that never
broadcasts is a timeout error on the engine, and an engine rank that never joins is a timeout error on
the trainer; neither hangs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from gyre_base.testing import free_port
from gyre_engine.client import EngineClient, EngineError
from gyre_engine.protocol import SamplingParams
from gyre_train.core import Core, CoreConfig, OptimConfig
from gyre_train.data import synthetic_minibatch
from gyre_train.engine_sync import SGLangSyncConfig, SGLangWeightSync, WeightSyncError
from gyre_train.model import ModelConfig, build_model
from gyre_traj.pack import PackedBatch

PROMPT = [5, 17, 300, 41, 999, 7, 123]
N = 10
GREEDY = SamplingParams(max_new_tokens=N, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "model"
    subprocess.run(
        [sys.executable, "-m", "gyre_engine", "create-model", str(out)],
        check=True,
        capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return out


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("logs") / "engine.log"
    with open(log_path, "wb") as log:
        cmd = [sys.executable, "-m", "gyre_engine", "serve", "--model", str(model_dir), "--port", str(port)]
        proc = subprocess.Popen(
            [*cmd, "--device", "cpu"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        try:
            deadline = time.monotonic() + 120
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"engine exited: {log_path.read_text()[-2000:]}")
                try:
                    if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError("engine did not become ready in 120 s")
                time.sleep(0.3)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(20)


def engine_config(model_dir: Path) -> ModelConfig:
    """gyre-train's ModelConfig of the engine's tiny model, with another seed (other initial weights)."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir)
    return ModelConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=hf.num_key_value_heads,
        head_dim=hf.head_dim,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=hf.tie_word_embeddings,
        seed=7,
    )


def in_vocab(mbs: list[PackedBatch], vocab: int) -> list[PackedBatch]:
    return [
        dataclasses.replace(b, input_ids=b.input_ids % vocab, target_ids=b.target_ids % vocab) for b in mbs
    ]


def reference(model_dir: Path, weights: dict[str, torch.Tensor]) -> tuple[list[int], list[float]]:
    """transformers on `weights` (the engine's config): greedy tokens and their logprobs."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    missing, unexpected = m.load_state_dict(weights, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)  # tied
    with torch.no_grad():
        out = m.generate(
            torch.tensor([PROMPT]),
            attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
            max_new_tokens=N,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        ids = out[0].tolist()
        logits = m(out).logits[0, len(PROMPT) - 1 : -1].float()
    new = ids[len(PROMPT) :]
    lps = torch.log_softmax(logits, -1).gather(1, torch.tensor(new)[:, None])[:, 0]
    return new, lps.tolist()


async def served(url: str) -> tuple[list[int], list[float], str]:
    async with EngineClient(url, timeout_s=60) as c:
        r = await c.generate(PROMPT, GREEDY, return_logprob=True)
    lps = [float(e[0]) for e in (r.meta_info.output_token_logprobs or [])]
    return list(r.output_ids), lps, r.meta_info.weight_version


def assert_serves(url: str, model_dir: Path, weights: dict[str, torch.Tensor], version: str) -> list[int]:
    ids, lps, wv = asyncio.run(served(url))
    ref_ids, ref_lps = reference(model_dir, weights)
    assert wv == version
    assert ids == ref_ids
    np.testing.assert_allclose(lps, ref_lps, atol=1e-4, rtol=0)
    return ids


def snapshot(core: Core) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in core.model.named_parameters()}


@pytest.fixture(scope="module")
def core(engine: str, model_dir: Path) -> Iterator[Core]:
    mc = engine_config(model_dir)
    sync = SGLangSyncConfig((engine,), group_name="gyre-test", timeout_s=30.0)
    cfg = CoreConfig(token_budget=512, engines=sync, optim=OptimConfig(lr=3e-2))
    c = Core(build_model(mc), mc, cfg)  # forms the group and pushes version 0
    yield c
    c.close()


def test_each_version_reaches_the_engine(core: Core, engine: str, model_dir: Path) -> None:
    assert core.last_push is not None and core.last_push.version == "0"
    before = assert_serves(engine, model_dir, snapshot(core), "0")
    rep = core.train_step(in_vocab(synthetic_minibatch(4, seed=1), core.model_cfg.vocab_size))
    assert rep.version == 1 and rep.engine_push is not None and rep.engine_push.version == "1"
    assert rep.engine_push.tensors == len(list(core.model.parameters()))
    after = assert_serves(engine, model_dir, snapshot(core), "1")
    assert after != before  # the step changed what the engine generates (lr 3e-2 on the tiny model)
    rep = core.train_step(in_vocab(synthetic_minibatch(4, seed=2), core.model_cfg.vocab_size))
    assert_serves(engine, model_dir, snapshot(core), "2")


def test_wrong_names_and_shapes_are_refused(core: Core, engine: str, model_dir: Path) -> None:
    sync = core.engine_sync
    assert sync is not None
    good = snapshot(core)
    version = str(core.version)
    renamed = dict(good)
    renamed["model.norm.weight_typo"] = renamed.pop("model.norm.weight")
    with pytest.raises(WeightSyncError, match=r"unknown parameter name model\.norm\.weight_typo"):
        sync.push(renamed, "bad-name")
    assert_serves(engine, model_dir, good, version)
    reshaped = dict(good)
    reshaped["model.norm.weight"] = torch.ones(good["model.norm.weight"].shape[0] + 1)
    with pytest.raises(WeightSyncError, match=r"shape of model.norm.weight is \[65\], the model's is \[64\]"):
        sync.push(reshaped, "bad-shape")
    assert_serves(engine, model_dir, good, version)
    # the refused broadcasts were drained: the same group still carries a good push
    halved = {k: v * 0.5 if k.endswith("norm.weight") else v for k, v in good.items()}
    rep = sync.push(halved, "halved")
    assert rep.version == "halved"
    assert_serves(engine, model_dir, halved, "halved")
    core.push_to_engines()  # back to the core's weights and version
    assert_serves(engine, model_dir, good, version)


def test_a_trainer_that_never_broadcasts_is_a_timeout(core: Core, engine: str, model_dir: Path) -> None:
    sync = SGLangWeightSync(SGLangSyncConfig((engine,), group_name="silent", timeout_s=2.0))
    try:
        sync.connect()

        async def update_without_broadcast() -> None:
            async with EngineClient(engine, timeout_s=60) as c:
                await c.begin_weight_update()
                with pytest.raises(EngineError) as err:
                    await c.update_weights_from_distributed(
                        ["model.norm.weight"], ["float32"], [[64]], "silent", weight_version="never"
                    )
                assert err.value.status == 504
                assert "could not receive it from rank 0 within 2 s" in err.value.message
                assert "nothing applied" in err.value.message
                with pytest.raises(EngineError, match="no weight update group 'silent'"):
                    await c.update_weights_from_distributed(
                        ["model.norm.weight"], ["float32"], [[64]], "silent"
                    )
                await c.end_weight_update()

        asyncio.run(update_without_broadcast())
    finally:
        sync.close()
    assert_serves(engine, model_dir, snapshot(core), str(core.version))


@pytest.mark.timeout(150)  # the old push waited for the broadcast's 300 s deadline
def test_a_push_an_engine_refuses_fails_at_once_with_its_reply(
    core: Core, engine: str, model_dir: Path
) -> None:
    """Without a session (`session=False`, for SGLang builds without /begin_weight_update), an engine that
    needs one (SGLang 0.5.23, and gyre-engine answering as it does) refuses the update with a 400 before
    receiving anything: the push fails at once with that reply, instead of broadcasting into a group
    nobody receives from until the deadline. After reconnect() the group works again."""
    sync = SGLangWeightSync(
        SGLangSyncConfig((engine,), group_name="nosession", timeout_s=300.0, session=False)
    )
    try:
        sync.connect()
        weights = snapshot(core)
        with pytest.raises(WeightSyncError) as err:
            sync.push(weights, "refused")
        msg = str(err.value)
        assert "HTTP 400: update_weights_from_distributed must run between begin_weight_update()" in msg
        assert "reconnect()" in msg
        assert_serves(engine, model_dir, weights, str(core.version))  # nothing changed on the engine
        sync.reconnect()
    finally:
        sync.close()
    core.push_to_engines()  # the core's own group still works
    assert_serves(engine, model_dir, snapshot(core), str(core.version))


def test_an_engine_rank_that_never_joins_is_a_timeout(engine: str) -> None:
    # the engine is told the group has two engine ranks after it; only it comes, so both sides time out
    sync = SGLangWeightSync(
        SGLangSyncConfig((engine,), ranks_per_engine=(2,), group_name="short", timeout_s=2.0)
    )
    try:
        with pytest.raises(WeightSyncError, match="could not connect to the others within 2 s") as err:
            sync.connect()
        assert "HTTP 504" in str(err.value)  # the engine's side timed out too
        assert sync.group is None
    finally:
        sync.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning", "ignore::FutureWarning")
def test_a_megatron_core_pushes_the_transformers_layout(engine: str, model_dir: Path) -> None:
    """A Megatron-core core (CPU, its own one-process default group) next to the weight-update group: its
    weights reach the engine converted to the transformers layout, and the engine serves them."""
    megatron = pytest.importorskip("gyre_train.megatron")
    mc = dataclasses.replace(engine_config(model_dir), backend="megatron")
    sync = SGLangSyncConfig((engine,), group_name="gyre-megatron", timeout_s=30.0)
    core = Core(build_model(mc), mc, CoreConfig(token_budget=512, engines=sync, optim=OptimConfig(lr=3e-2)))
    try:

        def hf() -> dict[str, torch.Tensor]:
            return {k: torch.from_numpy(v) for k, v in megatron.hf_state_dict(core.model, mc).items()}

        before = assert_serves(engine, model_dir, hf(), "0")
        core.train_step(in_vocab(synthetic_minibatch(4, seed=3), mc.vocab_size))
        after = assert_serves(engine, model_dir, hf(), "1")
        assert after != before
    finally:
        core.close()
