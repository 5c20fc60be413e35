"""The trainer on each family's model directory (Qwen2, Qwen3, Llama, with non-default forward fields):
the tree-packed forward (explicit position ids, ancestor mask) gives each path's logprobs run alone, a
tree trained chunk by chunk gives the gradient of one micro-batch, a satellite builds the directory's
model from `Welcome` and trains it with the core bit for bit, and a checkpoint exports back to a
directory transformers loads with the same config and logits."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
from pathlib import Path

import pytest
import torch
from gyre_train.chunked import chunked_loss_backward
from gyre_train.data import synthetic_minibatch
from gyre_train.model import (
    ModelConfig,
    attention_implementation,
    build_model,
    load_pretrained,
    pretrained_weights,
)
from gyre_traj.loss import LossConfig, TorchBatch, policy_loss, target_logprobs
from gyre_traj.pack import PackedBatch

pytest.importorskip("gyre_engine.server")
sys.path.insert(0, str(Path(__file__).parent))  # shared helpers (tests run with --import-mode=importlib)
import family_dirs

FAMILIES = sorted(family_dirs.FAMILIES)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: family_dirs.family_dir(root / f, f, seed=2) for f in FAMILIES}


def _loaded(d: Path) -> tuple[ModelConfig, torch.nn.Module]:
    mc = ModelConfig.from_model_dir(d)
    model = build_model(mc)
    load_pretrained(model, mc, d)
    return mc, model


def _in_vocab(b: PackedBatch, vocab: int) -> PackedBatch:
    """A synthetic batch with its token ids folded into the model's vocabulary."""
    return dataclasses.replace(b, input_ids=b.input_ids % vocab, target_ids=b.target_ids % vocab)


def _each_path_alone(model: torch.nn.Module, b: PackedBatch) -> torch.Tensor:
    """Every target's root-to-target chain run alone (plain causal forward, positions 0..n-1)."""
    out = []
    for tp, tid in zip(b.target_pos.tolist(), b.target_ids.tolist(), strict=True):
        chain = [tp]
        while b.parent[chain[-1]] >= 0:
            chain.append(int(b.parent[chain[-1]]))
        ids = torch.as_tensor(b.input_ids[chain[::-1]], dtype=torch.long)[None]
        logits = model(input_ids=ids).logits[0, -1].float()
        out.append(torch.log_softmax(logits, -1)[tid])
    return torch.stack(out)


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_packed_logprobs_equal_each_path_alone(family: str, dirs: dict[str, Path]) -> None:
    mc, model = _loaded(dirs[family])
    b = _in_vocab(synthetic_minibatch(2, seed=4)[0], mc.vocab_size)
    assert b.num_tokens > int(b.position_ids.max()) + 1  # branched: position ids are not the index
    with torch.no_grad():
        packed = target_logprobs(model, TorchBatch.from_packed(b))
        alone = _each_path_alone(model, b)
    torch.testing.assert_close(packed, alone, atol=1e-4, rtol=0)
    # the position ids matter: the index in the packed batch instead gives other logprobs
    tb = TorchBatch.from_packed(b)
    wrong = dataclasses.replace(tb, position_ids=torch.arange(b.num_tokens))
    with torch.no_grad():
        off = target_logprobs(model, wrong)
    assert float((off - alone).abs().max()) > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_tree_gradient_equals_one_microbatch(family: str, dirs: dict[str, Path]) -> None:
    mc, model = _loaded(dirs[family])
    big = _in_vocab(synthetic_minibatch(2, seed=5, token_budget=100_000)[0], mc.vocab_size)
    cfg = LossConfig(mode="tis")
    tb = TorchBatch.from_packed(big)
    model.zero_grad()
    loss, _ = policy_loss(target_logprobs(model, tb), tb, cfg)
    loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    scale = max(float(g.abs().max()) for g in ref.values())
    for kernel in ("dense", "tree"):  # the CPU's mask, and the GPU's tree attention (keyword-passed runs)
        model.zero_grad()
        with attention_implementation(model, kernel):  # type: ignore[arg-type]
            m = chunked_loss_backward(model, big, 128, cfg, kernel)  # type: ignore[arg-type]
        assert m["shared_chunks"] >= 1
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref[n], atol=1e-5 * scale, rtol=1e-4, msg=f"{kernel} {n}")


def test_a_satellite_builds_the_directory_model_and_trains_it_exactly(dirs: dict[str, Path]) -> None:
    from gyre_train.core import Core, CoreConfig
    from gyre_train.satellite import Satellite, SatelliteConfig

    d = dirs["llama"]
    mc = ModelConfig.from_model_dir(d)
    mbs = [_in_vocab(b, mc.vocab_size) for b in synthetic_minibatch(3, seed=8)]
    cfg = CoreConfig(token_budget=512, loss=LossConfig(mode="tis"))

    def loaded_core() -> Core:
        core = Core(build_model(mc), mc, cfg)
        core.load_whole_weights(pretrained_weights(mc, d))
        return core

    alone = loaded_core()
    try:
        alone.train_step(mbs)
        want = {n: p.detach().clone() for n, p in alone.model.named_parameters()}
    finally:
        alone.close()
    core = loaded_core()
    sat = Satellite(SatelliteConfig(core.address, "llama-sat"))
    th = threading.Thread(target=sat.run, daemon=True)
    th.start()
    try:
        assert sat.model_cfg == mc and sat.model_cfg.arch.to_dict() == json.loads(
            (d / "config.json").read_text()
        )
        assert type(sat.model).__name__ == "LlamaForCausalLM"
        core.admit("llama-sat")

        def hold(k: int) -> None:  # keep the core's first claim until the satellite has one too
            if k == 1:
                ev = threading.Event()
                for _ in range(6000):
                    if core.replicas().get("llama-sat", {}).get("claims", 0):
                        break
                    ev.wait(0.01)

        r = core.train_step(mbs, on_progress=hold)
        assert r.by_replica.get("llama-sat", 0) >= 1
        for n, p in core.model.named_parameters():
            torch.testing.assert_close(p.detach(), want[n], atol=0, rtol=0, msg=n)
    finally:
        core.close()
        th.join(timeout=30)
        sat.close()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_checkpoint_exports_back_to_the_same_directory_config(
    family: str, dirs: dict[str, Path], tmp_path: Path
) -> None:
    from gyre_train.cli import main
    from gyre_train.core import Core, CoreConfig
    from transformers import AutoModelForCausalLM

    d = dirs[family]
    mc = ModelConfig.from_model_dir(d)
    core = Core(build_model(mc), mc, CoreConfig())
    try:
        core.load_whole_weights(pretrained_weights(mc, d))
        with torch.no_grad():
            for p in core.model.parameters():
                p.add_(torch.randn_like(p) * 0.01)  # weights no init reproduces
        core.save(tmp_path / "ckpt")
        ids = torch.tensor([[1, 50, 60, 70, 80, 90, 100]])
        with torch.no_grad():
            want = core.model(input_ids=ids).logits
    finally:
        core.close()
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--tokenizer", str(d)]) == 0
    src, out = (
        json.loads((d / "config.json").read_text()),
        json.loads((tmp_path / "out" / "config.json").read_text()),
    )
    assert out == src  # the whole config back (float32 weights: the dtype already said so)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(model).__name__ == mc.architecture and model.config.rms_norm_eps == 1e-5
    assert (
        model.config.rope_parameters["rope_type"] == family_dirs.FAMILIES[family]["rope_scaling"]["rope_type"]
    )
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=0, atol=1e-5)
