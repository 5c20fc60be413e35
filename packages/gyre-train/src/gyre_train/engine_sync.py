"""Pushing the core's weights to rollout engines through SGLang's native weight-update endpoints.

`SGLangWeightSync` is rank 0 of a torch.distributed weight-update group shared with one or more engines
(SGLang servers, or gyre-engine standing in for them; both through `gyre_engine.client.EngineClient`):

- `connect()` (once, at start): asks every engine to `/init_weights_update_group` with its
  `rank_offset` (engine i starts after the ranks of engines 0..i-1; an SGLang engine with tensor
  parallelism k takes k ranks, `ranks_per_engine`) and the same `world_size` (1 + all engine ranks),
  while this process hosts the group's store at `master_address:master_port` and joins as rank 0. The
  group then stays for the trainer's life: a push reuses it.
- `push(tensors, version)` (after each optimizer step): optionally `/begin_weight_update`, then per
  bucket one `/update_weights_from_distributed` with the names, dtype names and shapes to every engine
  at once, while this process broadcasts each tensor in that order; then `/end_weight_update`.
  `weight_version` is the core's version, so every later record the engines produce carries it.
- `close()`: `/destroy_weights_update_group` on every engine, then the local member.

Tensors go as raw bytes over the group's backend (gloo on the CPU, NCCL between GPUs); no object is
pickled. Every wait has a deadline (`timeout_s`): an engine that does not join or does not receive is a
`WeightSyncError`, never a hang. An engine that refuses an update (SGLang answers 400 at once, for
example to an update outside a session with `session=False`) fails the push at once with its reply,
without waiting for the broadcast's deadline. After a failed push the group may be out of step:
`reconnect()`.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Coroutine, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from gyre_engine.client import EngineClient
from gyre_engine.weight_group import WeightGroup, WeightGroupAborted, WeightGroupError, bind_master

T = TypeVar("T")


class WeightSyncError(RuntimeError):
    """Forming the group or pushing a version failed; the message names each engine and why."""


@dataclass(frozen=True)
class SGLangSyncConfig:
    engines: tuple[str, ...]
    """Base URLs of the engines' native HTTP servers, e.g. ("http://127.0.0.1:30000",)."""
    ranks_per_engine: tuple[int, ...] = ()
    """Ranks each engine takes in the group (SGLang: its tensor-parallel size); default 1 each."""
    master_address: str = "127.0.0.1"
    """Where this process hosts the group's store and listens (every engine must reach it)."""
    master_port: int = 0
    """0: a free port."""
    group_name: str = "gyre-weight-sync"
    backend: str = "gloo"
    """"gloo" (CPU tensors; gyre-engine on the CPU) or "nccl" (trainer and engines on GPUs)."""
    timeout_s: float = 300.0
    """Deadline for forming the group and for each broadcast (engines get it as gyre's `timeout_s`)."""
    wire_dtype: str | None = None
    """Cast every floating tensor to this dtype for the wire (e.g. "bfloat16" when the trainer keeps
    float32 and the engines serve bf16); None: as the trainer holds it."""
    bucket_bytes: int = 0
    """Split a push into `/update_weights_from_distributed` calls of at most this many bytes (engines
    then stage one bucket at a time); 0: one call for the whole model (atomic on gyre-engine)."""
    session: bool = True
    """Wrap every push in /begin_weight_update ... /end_weight_update (SGLang 0.5.23 wants updates inside
    a session; gyre-engine holds generation during it). False for SGLang builds without those routes."""
    flush_cache: bool = True
    push_at_start: bool = True
    """The core pushes its weights (its current version) right after connecting."""
    http_timeout_s: float = 30.0
    """Deadline for the other HTTP calls (begin/end/destroy)."""


@dataclass(frozen=True)
class PushReport:
    version: str
    tensors: int
    nbytes: int
    buckets: int
    seconds: float
    broadcast_s: float
    replies: tuple[str, ...] = field(default=())


def wire_dtype_name(dtype: torch.dtype) -> str:
    """SGLang's dtype field: the torch attribute name ("bfloat16"), not "torch.bfloat16"."""
    return str(dtype).removeprefix("torch.")


class SGLangWeightSync:
    """Rank 0 of a weight-update group with SGLang-protocol engines; see the module docstring."""

    def __init__(self, cfg: SGLangSyncConfig) -> None:
        if not cfg.engines:
            raise ValueError("SGLangSyncConfig.engines is empty")
        ranks = cfg.ranks_per_engine or tuple(1 for _ in cfg.engines)
        if len(ranks) != len(cfg.engines) or any(r < 1 for r in ranks):
            raise ValueError("ranks_per_engine must give a positive rank count for every engine")
        if cfg.wire_dtype is not None and not isinstance(getattr(torch, cfg.wire_dtype, None), torch.dtype):
            raise ValueError(f"wire_dtype {cfg.wire_dtype!r} is not a torch dtype name (e.g. 'bfloat16')")
        if cfg.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend {cfg.backend!r}: use 'gloo' or 'nccl'")
        self.cfg = cfg
        self.ranks = ranks
        self.world_size = 1 + sum(ranks)
        self.offsets = tuple(1 + sum(ranks[:i]) for i in range(len(ranks)))
        self.group: WeightGroup | None = None
        self.address = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="gyre-weight-sync", daemon=True)
        self._thread.start()
        self._clients = [self._call(_make_client(url, cfg.timeout_s + 60.0)) for url in cfg.engines]

    # ---- plumbing: the HTTP side runs on a private event loop thread --------------------------------

    def _submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._submit(coro).result()

    def _gather(self, fn: Any, timeout_s: float) -> list[BaseException | Any]:
        """`fn(client, i)` on every engine at once; each result or exception, in engine order."""

        async def all_of() -> list[Any]:
            return await asyncio.wait_for(
                asyncio.gather(*(fn(c, i) for i, c in enumerate(self._clients)), return_exceptions=True),
                timeout_s,
            )

        try:
            return self._call(all_of())
        except TimeoutError as exc:
            raise WeightSyncError(f"engines did not answer within {timeout_s:g} s") from exc

    def _failures(self, results: list[Any]) -> list[str]:
        return [f"{self.cfg.engines[i]}: {r}" for i, r in enumerate(results) if isinstance(r, BaseException)]

    # ---- the group ----------------------------------------------------------------------------------

    def connect(self) -> None:
        """Form the group with every engine (they join while this process waits as rank 0)."""
        if self.group is not None:
            raise WeightSyncError("already connected; reconnect() to form the group again")
        cfg = self.cfg
        listener = bind_master(cfg.master_address, cfg.master_port)
        port = int(listener.getsockname()[1])
        self.address = f"{cfg.master_address}:{port}"

        async def join(c: EngineClient, i: int) -> Any:
            return await c.init_weights_update_group(
                cfg.master_address,
                port,
                self.offsets[i],
                self.world_size,
                cfg.group_name,
                cfg.backend,
                timeout_s=cfg.timeout_s,
            )

        async def all_join() -> list[Any]:
            return await asyncio.gather(
                *(join(c, i) for i, c in enumerate(self._clients)), return_exceptions=True
            )

        joins = self._submit(all_join())
        cuda = torch.device("cuda", torch.cuda.current_device()) if cfg.backend == "nccl" else None
        try:
            group = WeightGroup.form(
                cfg.master_address, port, 0, self.world_size, cfg.group_name, cfg.backend, cfg.timeout_s,
                listener=listener, cuda_device=cuda,
            )  # fmt: skip
        except WeightGroupError as exc:
            try:
                why = "; ".join(self._failures(joins.result(cfg.timeout_s + 60.0))) or "every engine answered"
            except FutureTimeout:
                why = "no answer"
            raise WeightSyncError(
                f"forming weight group {cfg.group_name!r} failed: {exc} (engines: {why})"
            ) from exc
        try:
            failed = self._failures(joins.result(cfg.timeout_s + 60.0))
        except FutureTimeout:
            failed = ["did not answer /init_weights_update_group"]
        if failed:
            group.close()
            raise WeightSyncError(
                f"engines did not join weight group {cfg.group_name!r}: {'; '.join(failed)}"
            )
        self.group = group

    def push(self, tensors: Mapping[str, torch.Tensor], version: int | str) -> PushReport:
        """Send `tensors` (engine-layout names) to every engine and label them `version`."""
        group = self.group
        if group is None:
            raise WeightSyncError("not connected: call connect() first")
        if not tensors:
            raise WeightSyncError("nothing to push")
        cfg = self.cfg
        t0 = time.perf_counter()
        wire = getattr(torch, cfg.wire_dtype) if cfg.wire_dtype else None
        items: list[tuple[str, torch.Tensor]] = []
        for name, t in tensors.items():
            t = t.detach()
            if wire is not None and t.is_floating_point():
                t = t.to(wire)
            if group.device.type != t.device.type:
                t = t.to(group.device)
            items.append((name, t.contiguous()))
        buckets = _buckets(items, cfg.bucket_bytes)
        label = str(version)
        replies: list[str] = []
        broadcast_s = 0.0
        if cfg.session:
            failed = self._failures(self._gather(lambda c, i: c.begin_weight_update(), cfg.http_timeout_s))
            if failed:  # let the engines that did begin serve on
                self._gather(lambda c, i: c.end_weight_update(), cfg.http_timeout_s)
                raise WeightSyncError(
                    f"pushing version {label}: begin_weight_update failed: {'; '.join(failed)}"
                )
        for k, bucket in enumerate(buckets):
            names = [n for n, _ in bucket]
            dtypes = [wire_dtype_name(t.dtype) for _, t in bucket]
            shapes = [list(t.shape) for _, t in bucket]

            async def update(
                c: EngineClient, i: int, names: list[str] = names, dtypes: list[str] = dtypes,
                shapes: list[list[int]] = shapes,
            ) -> Any:  # fmt: skip
                return await c.update_weights_from_distributed(
                    names,
                    dtypes,
                    shapes,
                    cfg.group_name,
                    weight_version=label,
                    flush_cache=cfg.flush_cache,
                    http_timeout_s=cfg.timeout_s * 2 + 60.0,
                )

            # one future per engine, so an engine that refuses (SGLang answers 400 at once, e.g. outside a
            # session) stops the broadcast now instead of after its timeout
            futures = [self._submit(update(c, i)) for i, c in enumerate(self._clients)]
            tb = time.perf_counter()
            sent_error: WeightGroupError | None = None
            refusal = functools.partial(self._refusal, futures)
            for name, t in bucket:
                try:
                    group.broadcast(t, name, give_up=refusal)
                except WeightGroupError as exc:
                    sent_error = exc
                    break
            broadcast_s += time.perf_counter() - tb
            results = self._results(futures, cfg.timeout_s * 2 + 120.0, label)
            failed = self._failures(results)
            if sent_error is not None or failed:
                lost = (
                    []
                    if sent_error is None or isinstance(sent_error, WeightGroupAborted)
                    else [str(sent_error)]
                )
                why = "; ".join(lost + failed)
                if sent_error is not None:
                    why += "; the group is out of step: reconnect()"
                if cfg.session and k == 0:
                    # no engine has part of this version: close the session so they serve on
                    self._gather(lambda c, i: c.end_weight_update(), cfg.http_timeout_s)
                elif cfg.session:
                    why += (
                        f"; {k} of {len(buckets)} buckets were applied, so the engines hold generation "
                        "inside the update session: push again"
                    )
                raise WeightSyncError(f"pushing version {label} failed: {why}")
            replies += [r.message for r in results]
        if cfg.session:
            self._all_ok("end_weight_update", lambda c, i: c.end_weight_update(), cfg.http_timeout_s)
        return PushReport(
            version=label,
            tensors=len(items),
            nbytes=sum(t.numel() * t.element_size() for _, t in items),
            buckets=len(buckets),
            seconds=time.perf_counter() - t0,
            broadcast_s=broadcast_s,
            replies=tuple(replies),
        )

    def _refusal(self, futures: list[Future[Any]]) -> str | None:
        """An engine's error reply, if one came while the others may still be receiving."""
        for i, f in enumerate(futures):
            if f.done() and f.exception() is not None:
                return f"{self.cfg.engines[i]}: {f.exception()}"
        return None

    def _results(self, futures: list[Future[Any]], timeout_s: float, label: str) -> list[Any]:
        """Each engine's reply or exception, in engine order. Once one engine has refused, the others are
        not waited for (an engine still receiving gives up on its own deadline, as the group is now out
        of step); they count as failed."""
        out: list[Any] = []
        deadline = time.monotonic() + timeout_s
        refused = self._refusal(futures) is not None
        for f in futures:
            try:
                out.append(f.result(0 if refused and not f.done() else max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                if not refused:
                    raise WeightSyncError(f"pushing version {label}: engines did not answer") from None
                out.append(WeightSyncError("did not answer before the push was given up"))
            except Exception as exc:
                out.append(exc)
        return out

    def _all_ok(self, what: str, fn: Any, timeout_s: float) -> None:
        failed = self._failures(self._gather(fn, timeout_s))
        if failed:
            raise WeightSyncError(f"{what} failed: {'; '.join(failed)}")

    def reconnect(self) -> None:
        """Tear the group down on every engine and here, and form it again (after a failed push)."""
        self._leave()
        self.connect()

    def _leave(self) -> list[str]:
        group, self.group = self.group, None
        if group is None:
            return []
        name = self.cfg.group_name
        results = self._gather(lambda c, i: c.destroy_weights_update_group(name), self.cfg.http_timeout_s)
        group.close()
        return self._failures(results)

    def close(self) -> None:
        try:
            self._leave()
        finally:
            for c in self._clients:
                self._call(c.aclose())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()


async def _make_client(url: str, timeout_s: float) -> EngineClient:
    return EngineClient(url, timeout_s=timeout_s)


def _buckets(items: list[tuple[str, torch.Tensor]], limit: int) -> list[list[tuple[str, torch.Tensor]]]:
    if limit <= 0:
        return [items]
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in items:
        n = t.numel() * t.element_size()
        if out[-1] and size + n > limit:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += n
    return out


def engine_tensors(model: torch.nn.Module, model_cfg: Any) -> dict[str, torch.Tensor]:
    """A one-rank core model's weights in the transformers layout engines load: the parameters
    themselves for the transformers backend; converted with gyre-xfer's `megatron_to_hf` for
    Megatron-core, cast back to the model's dtype."""
    whole = {n: p.data for n, p in model.named_parameters()}
    if getattr(model_cfg, "backend", "transformers") == "megatron":
        return megatron_hf(whole, model_cfg)
    return whole


def megatron_hf(whole: dict[str, torch.Tensor], model_cfg: Any) -> dict[str, torch.Tensor]:
    """A whole Megatron-core state dict (one-rank names) in the transformers layout, in its dtype."""
    from gyre_xfer.convert import megatron_to_hf

    dtype = next(iter(whole.values())).dtype
    src = {k: v.detach().cpu().float().numpy() for k, v in whole.items()}
    conv = megatron_to_hf(model_cfg.num_attention_heads, model_cfg.num_key_value_heads, model_cfg.head_dim)
    return {k: torch.from_numpy(v).to(dtype) for k, v in conv(src).items()}
