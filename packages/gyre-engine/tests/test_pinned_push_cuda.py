"""The weight push through page-locked host memory on a GPU: a publisher fed from CUDA tensors with
page-locked slots (asynchronous device-to-host copies), an engine on CUDA pulling through its gyre-xfer
hub into a page-locked staging buffer, and the update applied to the engine's model with queued
host-to-device copies. Checks that the staging really is page-locked (torch's `is_pinned` on the views
the update copies from), that the model's weights then equal the published ones bit for bit, that a
second push reuses the staging without pinning again, and that a refused registration leaves CUDA usable
on that thread. Skipped without CUDA."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from gyre_engine.protocol import UpdateFromXferRequest  # noqa: E402
from gyre_engine.server.engine import Engine  # noqa: E402
from gyre_engine.server.serve import ServeConfig, load_engine  # noqa: E402
from gyre_engine.server.weights import apply_named_tensors  # noqa: E402
from gyre_engine.server.xfer import XferHub, snapshot_tensors  # noqa: E402
from gyre_xfer.pinning import CudaHostPinning, PinningError, host_pinning  # noqa: E402
from gyre_xfer.publisher import Publisher, PublisherConfig  # noqa: E402
from gyre_xfer.transport import Config, Region, open_transport  # noqa: E402


class CountingPinning(CudaHostPinning):
    """The real CUDA pinning, counting its calls."""

    def __init__(self) -> None:
        super().__init__("cuda")
        self.pins = 0
        self.unpins = 0

    def pin(self, region: Region) -> None:
        super().pin(region)
        self.pins += 1

    def unpin(self, region: Region) -> None:
        super().unpin(region)
        self.unpins += 1


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Engine]:
    e = load_engine(ServeConfig(model=str(model_dir), device="cuda", dtype="bfloat16"))
    yield e
    e.shutdown()


def perturbed(model: Any, scale: float, seed: int) -> dict[str, Any]:
    """The model's parameters plus noise, as fresh CUDA tensors (what a trainer publishes)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, device="cuda", dtype=torch.float32) * scale
        out[name] = (p.detach().float() + noise).to(p.dtype).contiguous()
    return out


def test_push_through_pinned_staging_lands_exact_weights(engine: Engine) -> None:
    assert engine.device.type == "cuda"
    pub_pinning = CountingPinning()
    sub_pinning = CountingPinning()
    pub_tr = open_transport(Config(kind="shm"))
    pub = Publisher(pub_tr, PublisherConfig(pinning=pub_pinning))
    hub = XferHub(pinning=sub_pinning)
    try:
        for round_, seed in enumerate((1, 2, 3)):
            sent = perturbed(engine.model, 0.05, seed)
            version = pub.publish(sent)
            snap = hub.pull_snapshot(UpdateFromXferRequest(publisher=pub.address, min_version=version))
            assert snap.version == version and snap.pinned
            tensors = snapshot_tensors(snap, engine.model, "transformers")
            assert tensors and all(t.is_pinned() for t in tensors.values())
            n = engine.call(
                engine.update_weights,
                lambda tensors=tensors: apply_named_tensors(engine.model, tensors),
                f"v{version}",
            ).result(60)
            assert n == len(sent) and engine.weight_version == f"v{version}"
            params = dict(engine.model.named_parameters())
            for name, t in sent.items():
                assert torch.equal(params[name], t), f"{name} differs after push {round_}"
        # three pushes: the staging pinned once, each of the publisher's two slots once
        assert sub_pinning.pins == 1 and sub_pinning.unpins == 0
        assert pub_pinning.pins == 2 and pub_pinning.unpins == 0
    finally:
        hub.close()
        pub.close()
        pub_tr.close()
    assert sub_pinning.unpins == 1 and pub_pinning.unpins == 2


def test_engine_hub_pins_only_for_cuda() -> None:
    assert isinstance(host_pinning(torch.device("cuda")), CudaHostPinning)
    assert host_pinning(torch.device("cpu")) is None


def test_refused_registration_leaves_cuda_usable() -> None:
    tr = open_transport(Config(kind="shm"))
    pinning = CudaHostPinning("cuda")
    region = tr.alloc(1 << 20)
    try:
        pinning.pin(region)
        with pytest.raises(PinningError, match="cudaHostRegister"):
            pinning.pin(region)  # already registered: the driver refuses
        x = torch.ones(1024, device="cuda")
        assert float((x * 2).sum()) == 2048.0  # the refusal did not become this thread's next error
        assert region.array is not None
        assert torch.from_numpy(region.array).is_pinned()
        pinning.unpin(region)
        assert not torch.from_numpy(region.array).is_pinned()
    finally:
        tr.unregister(region)
        tr.close()
