"""The engine: one thread owns the model, the running batch and the prefix cache, and steps them.

Other threads talk to it only through `call(fn)`, which runs `fn` on the engine thread between two steps
and returns a future; so a weight update, pause, abort or cache export never lands inside a step, and no
token is computed with two weight versions. Each step admits waiting requests (chunked prefill that
reuses the longest cached prefix), then one batched decode step per lane of running requests
(`lanes.py`: rows of similar length share a left-padded batch). On CUDA, rows decode first in fixed slots of
a preallocated KV cache whose step is captured as CUDA graphs (`slots.py`), several steps per replay
when no row needs truncation or logit processing; the lanes take what does not fit there. A context too long
for a slot is prefilled chunk by chunk into a long slot of its own and decodes there, all long slots' rows
in one step (`long_kv.py`); while
other requests decode, a chunked prefill gets at most `prefill_share` of the engine's time. Each layer's
q/k/v and gate/up projections run as one GEMM each (`fused.py`), and on CUDA each RMS norm as one kernel
(`norms.py`); with `fuse_rotary`, each layer's rotary embedding of its queries and keys as one
(`rotary.py`).
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, get_args

import torch
from gyre_xfer.pinning import host_pinning

from gyre_engine.protocol import FinishReason, ProtocolError
from gyre_engine.server import vmem
from gyre_engine.server.batch import LongRowKV, RowKV, buffer_row, cache_kwarg, cache_layers
from gyre_engine.server.fused import FusedProjections
from gyre_engine.server.lanes import Lane, Lanes
from gyre_engine.server.long_kv import copy_prefix, prefill_into
from gyre_engine.server.norms import available as norms_available
from gyre_engine.server.norms import fuse_rms_norms
from gyre_engine.server.prefill import (
    group_forward,
    prefill_chunk,
    prefill_group,
    prefill_packed,
    start_cache,
)
from gyre_engine.server.prefix_cache import PrefixCache, PrefixHit
from gyre_engine.server.request import (
    EngineRequest,
    Running,
    Sink,
    TokenEvent,
    abort_reason,
    as_stop_list,
    compile_stop_regex,
)
from gyre_engine.server.rotary import available as rotary_available
from gyre_engine.server.rotary import fuse_rotary
from gyre_engine.server.sampling import RowLogprobs, SamplerState, sample, validate_params
from gyre_engine.server.slot_prefill import SlotPrefill
from gyre_engine.server.slots import SlotBatch, compile_fn

log = logging.getLogger(__name__)
T = TypeVar("T")


LONG_RETRY_S = 5.0
"""Seconds between tries to allocate the long slots when a try found no room."""


class EngineUnavailable(RuntimeError):
    """The engine cannot take this now (paused, weights or KV released, updating); retry later."""


@dataclass(frozen=True)
class EngineStats:
    prefill_tokens_computed: int
    prefill_tokens_cached: int
    decode_steps: int
    decode_tokens: int
    decode_time_s: float
    prefill_time_s: float
    cache_returns: int
    memory_evicted_tokens: int = 0
    host_cached_tokens: int = 0
    host_spilled_tokens: int = 0
    host_hit_tokens: int = 0
    step_time_s: float = 0.0
    command_time_s: float = 0.0
    waiting_s: dict[str, float] = field(default_factory=dict)
    prefill_passes: int = 0


WaitReason = Literal["rows", "prefill_budget", "chunked_prefill", "long_slot", "long_memory", "behind"]
WAIT_REASONS: tuple[WaitReason, ...] = get_args(WaitReason)
"""What keeps a request waiting at a step's admission: every row taken (`max_running_requests`), the
step's `prefill_chunk` budget spent, the chunked prefill busy with another request, every long slot busy,
the long slots not allocated for want of memory, or earlier waiting requests that go first (the chunked
prefill is kept for one of them, or the idle long slots are: `_admit_waiting`)."""


@dataclass
class _Partial:
    """A request in chunked prefill: `cache` covers `ctx[:pos]`; `cached` of those came from the prefix cache.
    `cache` is a DynamicCache, or the long slots' batch, whose slot `row` the prefill writes into, or for
    a row of a packed pass the cached prefix itself (a `RowKV`)."""

    r: Running
    ctx: list[int]
    cache: Any
    pos: int
    cached: int
    row: int = -1


class Engine:
    """Continuous-batching generation over a transformers causal LM; see the module docstring."""

    @dataclass
    class Config:
        max_running_requests: int = 64
        """Rows in the decode batch at most; further requests wait."""
        max_cached_tokens: int = 1 << 20
        """Budget of the prefix cache, in tokens (summed over entries)."""
        host_cached_tokens: int = 0
        """Budget of the prefix cache's host tier, in tokens (0: none): what leaves the device (past
        `max_cached_tokens`, under `min_free_bytes`, or a long slot's context when the slot is taken for
        another) is copied to host memory instead of dropped, and a later call that extends it copies it
        back rather than computing it again."""
        prefill_chunk: int = 2048
        """Tokens per prefill forward pass: a step prefills fresh (and prefix-cached) prompts up to this
        many tokens, and one chunk of this many of the chunked prefill (a long or prefix-cached prompt
        that does not fit) when `prefill_share` gives it its turn."""
        enable_prefix_cache: bool = True
        """Reuse the KV of earlier sequences that share a prefix with a new prompt."""
        decode_slots: str = "auto"
        """Decode in fixed slots of a static KV cache: "graphs" (CUDA graphs per batch/length bucket),
        "eager" (same slots, no graphs: for tests), "off" (left-padded lanes only), "auto" (graphs on
        CUDA, off elsewhere)."""
        compile_decode: bool = True
        """Capture the slot step over a `torch.compile`d forward (fused elementwise kernels); on CUDA."""
        compile_prefill: bool = False
        """Run fresh prompts' left-padded prefill pass through torch.compile (dynamic shapes, compiled on
        first use); on CUDA. Off by default: compiling the whole model takes minutes for a 0.6B model
        (about 90 s per compilation on this project's CPU, and a group of one prompt compiles again), and
        the first requests wait for it. If compilation fails, prefill runs eagerly from then on."""
        pin_host_weights: bool = False
        """Allocate the pinned host copies that `release_memory_occupation` moves the weights into at
        start (CUDA), so the first release costs what later ones do (allocating 1.2 GB of pinned memory
        took about 1.2 s on the H200); a cell that switches roles sets it."""
        min_free_bytes: int = 0
        """On CUDA: the device memory (all processes on the GPU together) kept free. Before each step that
        would run with less, the prefix cache drops least-recently-used entries (the allocator's freed
        blocks returned to the driver) until there is this much again or the cache is empty; counted in
        `memory_evicted_tokens`. Rows growing outside the slots, a second engine or a trainer on the
        same GPU then take memory from the cache, not from a step that would fail (0: off)."""
        slot_kv_fraction: float = 0.2
        """Bound of the slots' KV buffer, as a fraction of the device's memory (CUDA)."""
        cached_free_bytes: int = 4 << 30
        """Free blocks the CUDA caching allocator may keep after a step that prefilled (prefill passes leave
        activations and concatenated KV of many sizes behind); past this the engine returns them to the
        driver (`torch.cuda.empty_cache`), so another engine or a trainer on the same GPU can have them.
        Measured on the H200 with 16 rows of 14k tokens: 26 GiB cached beside 50 GiB of tensors without it."""
        slot_widths: str = "bucketed"
        """Columns a slot step attends over: "bucketed" (the length bucket of the longest row: a graph per
        bucket, captured on first use, all dropped when the buffer grows) or "full" (the whole buffer,
        allocated at once: a graph per batch bucket, captured at warm-up; for contexts that keep growing).
        The long slots follow it: with "full" their graphs are captured when their buffer is allocated."""
        slot_max_len: int | None = None
        """Tokens per slot at most (default: from `slot_kv_fraction` on CUDA, the context length else);
        longer rows continue in the lanes."""
        fuse_projections: bool = True
        """Run each layer's q/k/v and gate/up projections as one GEMM each (`fused.py`; parameters and
        their names unchanged)."""
        fuse_norms: bool = True
        """Run each RMS norm of the model as one Triton kernel where Triton runs (`norms.py`; CUDA), not
        transformers' seven."""
        fuse_rotary: bool = False
        """Run each layer's rotary embedding of its queries and keys as one Triton kernel where Triton
        runs (`rotary.py`; CUDA), not transformers' ten; the same values, bit for bit in bf16. Off until
        its CUDA test has run on a GPU (its arithmetic is checked in Triton's interpreter)."""
        keep_graphs: bool = True
        """On CUDA with the driver's virtual memory management: keep the weights and the whole-width slot
        buffers (`slot_widths = "full"`, the long slots) at fixed device addresses (`vmem.py`), so that
        `release_memory_occupation` gives their memory back and a resume maps new memory at the same
        addresses: the decode graphs captured before a release replay after it, none captured again. The
        graphs' own memory pools stay allocated while released. Off: released buffers are freed and
        allocated anew, and their graphs captured again at first use."""
        run_steps: int = 8
        """Decode steps per graph replay when no slot row needs logit processing, truncation (top-k/p,
        min-p) or top logprobs: greedy rows and rows sampled at their temperature. Each step's tokens
        feed the next on the device and the host reads them back once per run. A row that finishes
        inside a run wastes the rest of it; 1 turns runs off."""
        long_context_tokens: int = 0
        """Tokens each long slot holds (0: no long slots). A request whose context plus `max_new_tokens`
        does not fit a decode slot (`slot_max_len`) but fits here is prefilled chunk by chunk straight
        into a long slot (a row of one buffer for all of them: 2 x layers x KV heads x head dim x this
        many elements per slot; 112 KiB a token for the Qwen3-0.6B shape in bf16) and decodes there, the
        long slots' rows in one step; when it finishes the prefix cache keeps the slot's KV itself, which
        the next call extending that context takes over (no copy). A row that reaches the end of its long
        slot finishes (`length`)."""
        long_context_slots: int = 1
        """Long slots (the rows of one buffer); further long requests wait for a free one. The buffer is
        allocated at the first long call (not at start, where a trainer's warm-up on the same GPU may
        need the room) and again as soon as the KV cache is resumed after a release, so another engine
        or a trainer on the same GPU cannot take its memory in between. If the first allocation finds
        too little free memory, the prefix cache's copies on the device go to the host tier (or are
        dropped) and it tries again; failing that, long requests wait and it tries again later, while
        the other requests run on."""
        prefill_graph_tokens: int = 256
        """With full-width decode slots (`slot_widths = "full"`): prefix-cached calls whose rests come to
        at most this many new tokens together (up to 8 calls) are prefilled straight into free decode
        slots in one pass, replayed as a CUDA graph per token bucket (32, 64, ... up to this; captured at
        warm-up) rather than launched kernel by kernel (`slot_prefill.py`). 0: off."""
        prefill_share: float = 0.4
        """While other requests decode, a chunked prefill (a long or prefix-cached prompt whose uncached
        rest does not fit `prefill_chunk`, that many tokens per chunk; a rest that fits is prefilled at
        admission) gets at most this share of the engine's time: decode steps run between its
        chunks until their time makes up the rest, so their time per token stays within 1 / (1 -
        share) of what it is alone. 1: a chunk every step, whatever it costs the others."""

    def __init__(self, model: Any, tokenizer: Any, config: Engine.Config | None = None) -> None:
        self.model = model.eval()
        self._cache_kw = cache_kwarg(model)
        self.tokenizer = tokenizer
        self.config = config or Engine.Config()
        self.device = next(model.parameters()).device
        mc = model.config.get_text_config()
        self.vocab_size = int(mc.vocab_size)
        self.context_len = int(getattr(mc, "max_position_embeddings", 1 << 30))
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = mc.eos_token_id if eos is None else eos
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.weight_version = "0"
        self.paused = False
        self.updating = False
        self.released: set[str] = set()
        self._host: dict[str, torch.Tensor] = {}
        """Pinned host copies of the weights while released ("weights"), allocated at the first release
        and reused: page-locked copies run at the bus's speed, where `model.to("cpu")` paid for fresh
        pageable memory every time (1.2 GB: about 1 s on the H200 against 0.02 s pinned)."""
        self._pending_bump = False
        self._cmds: queue.Queue[tuple[Callable[[], Any], Future[Any]]] = queue.Queue()
        self._waiting: deque[Running] = deque()
        self.fused = FusedProjections(self.model) if self.config.fuse_projections else None
        if self.config.fuse_norms and norms_available(self.device):
            fuse_rms_norms(self.model)
        if self.config.fuse_rotary and rotary_available(self.device):
            fuse_rotary(self.model)
        self._keep = self.config.keep_graphs and vmem.supported(self.device)
        self.kept: vmem.KeptWeights | None = None
        """The weights at fixed device addresses (`keep_graphs`), moved there before any graph is captured."""
        if self._keep:
            self.kept = self._keep_weights()
        if self.config.pin_host_weights and self.device.type == "cuda":
            if self.kept is not None:
                self.kept.pin_host()
            else:
                for name, t in self._tensors().items():
                    self._host[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.slots = self._make_slots()
        self.slot_prefill = (
            SlotPrefill(self.slots, self.config.prefill_graph_tokens)
            if self.slots is not None and self.slots.full_width and self.config.prefill_graph_tokens > 0
            else None
        )
        self.lanes = Lanes(self.device, slots=self.slots)
        if self.config.long_context_tokens > 0 and self.slots is None:
            log.warning("long slots off: they decode as slots do, and decode slots are off here")
        self._partial: _Partial | None = None
        self._prefill_credit = 0.0
        """Seconds of prefill the chunked prefill may still spend before decode steps catch up (see
        `prefill_share`); negative while it must wait."""
        self._placing: list[Running] = []
        self._long_copies = 0
        """Cached prefixes copied into a long slot (a hit held elsewhere than in the slot taken)."""
        self._long_at_once = 0
        """Long requests whose rest was prefilled at once at admission (not through the chunked prefill)."""
        self.prefix = PrefixCache(
            self.config.max_cached_tokens, self.config.host_cached_tokens, host_pinning(self.device)
        )
        self._long_retry_at = 0.0
        """When a long slots' allocation that found no room may be tried again (monotonic seconds)."""
        self._held: dict[WaitReason, int] = {}
        """The requests this step's admission left waiting, by what held them."""
        self._waiting_s: dict[WaitReason, float] = dict.fromkeys(WAIT_REASONS, 0.0)
        """Request-seconds of steps spent waiting since start, by what held them (`WAIT_REASONS`)."""
        self.compiled_prefill: Any = None
        """The compiled `group_forward` (None: eager; compiled on the first prefill when enabled)."""
        self._compile_prefill = self.config.compile_prefill and self.device.type == "cuda"
        self._stats: dict[str, float] = {
            "prefill_tokens_computed": 0,
            "prefill_tokens_cached": 0,
            "decode_steps": 0,
            "decode_tokens": 0,
            "decode_time_s": 0.0,
            "prefill_time_s": 0.0,
            "prefill_passes": 0,
            "cache_returns": 0,
            "memory_evicted_tokens": 0,
            "step_time_s": 0.0,
            "command_time_s": 0.0,
        }
        self._kv_token_bytes = SlotBatch.token_bytes(model)
        self.prefix.reserve_host(self._kv_token_bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gyre-engine", daemon=True)

    def _make_slots(self) -> SlotBatch | None:
        mode = self.config.decode_slots
        if mode not in ("auto", "graphs", "eager", "off"):
            raise ValueError(f"decode_slots must be auto, graphs, eager or off, not {mode!r}")
        if not 0.0 < self.config.prefill_share <= 1.0:
            raise ValueError(f"prefill_share must be in (0, 1], not {self.config.prefill_share}")
        if self.config.prefill_graph_tokens < 0:
            raise ValueError(f"prefill_graph_tokens must be >= 0, not {self.config.prefill_graph_tokens}")
        if self.config.slot_widths not in ("bucketed", "full"):
            raise ValueError(f"slot_widths must be bucketed or full, not {self.config.slot_widths!r}")
        cuda = self.device.type == "cuda"
        if mode == "off" or (mode == "auto" and not cuda):
            return None
        why = SlotBatch.unsupported(self.model)
        if why is not None:
            log.warning("decode slots off: %s", why)
            return None
        graphs = mode in ("auto", "graphs")
        if graphs and not cuda:
            raise ValueError("decode_slots='graphs' needs a CUDA model")
        slots = self.config.max_running_requests
        max_len = self.config.slot_max_len
        if max_len is None:
            if cuda:
                total = torch.cuda.get_device_properties(self.device).total_memory
                per_token = SlotBatch.token_bytes(self.model) * slots
                max_len = int(total * self.config.slot_kv_fraction) // per_token
            else:
                max_len = self.context_len
        max_len = min(max_len, self.context_len)
        if max_len < 16:
            log.warning("decode slots off: %d tokens per slot is too few", max_len)
            return None
        log.info("decode slots: %d slots of up to %d tokens, graphs=%s", slots, max_len, graphs)
        return SlotBatch(
            self.model,
            slots,
            max_len,
            use_graphs=graphs,
            compile_model=graphs and self.config.compile_decode,
            full_width=self.config.slot_widths == "full",
            keep_addresses=self._keep,
        )

    def warmup_decode(self, max_tokens: int) -> float:
        """Capture the decode graphs for rows of up to `max_tokens` tokens (run it on the engine thread,
        idle: `engine.call(engine.warmup_decode, n)`); returns the seconds it took. A no-op without
        graph slots."""
        t0 = time.perf_counter()
        if self.slots is not None and self.slots.use_graphs and not self.lanes.requests():
            with torch.inference_mode():
                self.slots.warmup(max_tokens, self._run_lengths())
            if self.slot_prefill is not None:
                self.slot_prefill.warmup()
        return time.perf_counter() - t0

    def _run_lengths(self) -> tuple[int, ...]:
        """The run lengths a slot step is captured for: 1, and `run_steps` when runs are on."""
        return (1, self.config.run_steps) if self.config.run_steps > 1 else (1,)

    def slot_stats(self) -> dict[str, Any]:
        if self.slots is None:
            return {"enabled": False}
        long = self._long_batch()
        return {
            "enabled": True,
            "graphs": self.slots.use_graphs,
            "compiled": self.slots.compile_model,
            "prefill_compiled": self.compiled_prefill is not None,
            "slots": self.slots.slots,
            "max_len": self.slots.max_len,
            "capacity": self.slots.capacity,
            "long_slots": long.slots if long is not None else 0,
            "long_rows": len(long) if long is not None else 0,
            "long_capacity": long.capacity if long is not None else 0,
            "long_prefix_copies": self._long_copies,
            "long_prefills_at_once": self._long_at_once,
            **{f"long_{k}": v for k, v in (long.stats if long is not None else {}).items()},
            **self.slots.stats,
            **(self.slot_prefill.stats if self.slot_prefill is not None else {}),
        }

    # ----------------------------------------------------------------- lifecycle and calls
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is in flight (their sinks get an abort), then stop the thread; bounded by `timeout`."""
        if self._thread.is_alive():
            try:
                self.call(self._abort_all_now, "engine shutting down").result(timeout)
            except TimeoutError:
                log.warning("engine did not finish its step within %.0f s; stopping anyway", timeout)
        self._stop.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def call(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run `fn(*args)` on the engine thread between two steps. Cancelling the future before the
        engine thread takes the call drops it; once taken, it runs to its end."""
        fut: Future[T] = Future()
        if not self._thread.is_alive():
            fut.set_exception(EngineUnavailable("engine thread is not running"))
            return fut
        self._cmds.put((lambda: fn(*args), fut))
        return fut

    def stats(self) -> EngineStats:
        st = self._stats
        return EngineStats(
            prefill_tokens_computed=int(st["prefill_tokens_computed"]),
            prefill_tokens_cached=int(st["prefill_tokens_cached"]),
            decode_steps=int(st["decode_steps"]),
            decode_tokens=int(st["decode_tokens"]),
            decode_time_s=st["decode_time_s"],
            prefill_time_s=st["prefill_time_s"],
            prefill_passes=int(st["prefill_passes"]),
            cache_returns=int(st["cache_returns"]),
            memory_evicted_tokens=int(st["memory_evicted_tokens"]),
            host_cached_tokens=self.prefix.host_held_tokens,
            host_spilled_tokens=self.prefix.spilled_tokens,
            host_hit_tokens=self.prefix.host_hit_tokens,
            step_time_s=st["step_time_s"],
            command_time_s=st["command_time_s"],
            waiting_s={str(why): t for why, t in self._waiting_s.items()},
        )

    def counts(self) -> tuple[int, int]:
        return len(self._in_flight()), len(self._waiting)

    # ----------------------------------------------------------------- requests
    def check_request(self, req: EngineRequest) -> None:
        """Raise ProtocolError for a request no state of the engine could serve."""
        if not req.input_ids:
            raise ProtocolError("input_ids is empty")
        if len(req.input_ids) >= self.context_len:  # before the scan below: cheap, and what SGLang says
            raise ProtocolError(
                f"The input ({len(req.input_ids)} tokens) is longer than the model's context length ({self.context_len} tokens)."
            )
        self.check_token_ids(req.input_ids)
        if not 0 <= req.top_logprobs_num <= 64:
            raise ProtocolError("top_logprobs_num must be in [0, 64]")
        for t in req.token_ids_logprob or ():
            if not 0 <= t < self.vocab_size:
                raise ProtocolError(
                    f"token_ids_logprob contains out-of-vocabulary token id {t}; valid range is [0, {self.vocab_size})"
                )
        validate_params(req.params, self.vocab_size)
        compile_stop_regex(req.params.stop_regex)
        if (req.params.stop or req.params.stop_regex) and self.tokenizer is None:
            raise ProtocolError("stop strings need a tokenizer; this engine has none")

    def submit(self, req: EngineRequest, sink: Sink) -> Future[None]:
        """Queue a request; the future fails with ProtocolError / EngineUnavailable if it is refused."""
        self.check_request(req)
        return self.call(self._admit, req, sink)

    def _admit(self, req: EngineRequest, sink: Sink) -> None:
        if self.released:
            raise EngineUnavailable(f"memory released ({', '.join(sorted(self.released))}); resume it first")
        if self.paused or self.updating:
            raise EngineUnavailable(
                "generation is paused" if self.paused else "a weight update is in progress"
            )
        if any(r.rid == req.rid for r in (*self._in_flight(), *self._waiting)):
            raise ProtocolError(f"a request with rid {req.rid!r} is already running")
        seed = req.params.sampling_seed
        sampler = SamplerState(
            req.params,
            self.vocab_size,
            self.eos_ids,
            req.input_ids,
            -1 if seed is None else seed & ((1 << 62) - 1),
        )
        stops, regex = as_stop_list(req.params.stop), compile_stop_regex(req.params.stop_regex)
        self._waiting.append(Running(req, sink, sampler, self.context_len, stops, self._decode_ids, regex))

    def _decode_ids(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise ProtocolError("stop strings need a tokenizer; this engine has none")
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    # ----------------------------------------------------------------- the loop
    def _can_step(self) -> bool:
        return not (self.paused or self.updating or self.released) and bool(
            self._in_flight() or self._waiting
        )

    def _run(self) -> None:
        """The thread: its death would leave a server up that answers but never generates, so anything
        escaping the loop ends the process loudly (`THREAD_DIED`)."""
        try:
            self._loop()
        except BaseException:
            _die()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                cmd = self._cmds.get(timeout=0.0 if self._can_step() else 0.05)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                fn, fut = cmd
                # a call its caller cancelled before it ran (it timed out, or its client left) is dropped
                if fut.set_running_or_notify_cancel():
                    t0 = time.perf_counter()
                    try:
                        fut.set_result(fn())
                    except Exception as exc:  # handed to the caller through the future
                        fut.set_exception(exc)
                    self._stats["command_time_s"] += time.perf_counter() - t0
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            if self._can_step():
                t0 = time.perf_counter()
                self._held.clear()
                try:
                    self._step()
                except Exception as exc:
                    log.exception("engine step failed; failing the running requests")
                    self._abort_all_now(f"engine error: {exc}", 500, "InternalServerError")
                dt = time.perf_counter() - t0
                self._stats["step_time_s"] += dt
                for why, n in self._held.items():
                    self._waiting_s[why] += n * dt

    def _step(self) -> None:
        """Prefill fresh prompts up to `prefill_chunk` tokens (one padded pass) and prefix-cached prompts
        whose rest fits, then the next `prefill_chunk`-token chunk of the chunked prefill (a long or
        prefix-cached prompt, continued across steps as `prefill_share` allows, so running requests keep
        decoding); then decode every lane once."""
        t0 = time.perf_counter()
        self._keep_memory_free()
        joining: list[tuple[Running, RowKV, int]] = []
        group, budget = self._admit_waiting(joining)
        if group:
            self._prefill_group(group, joining)
        chunked = self._partial is not None and self._prefill_turn()
        if chunked:
            self._advance_partial(self.config.prefill_chunk, joining)
        self._placing = [r for r, _, _ in joining]  # prefilled, not yet in a lane: aborted if placing fails
        self.lanes.place(joining)
        self._placing = []
        if chunked or budget < self.config.prefill_chunk:  # some prefill ran (and its rows were placed)
            self._return_cached_free()
            self._stats["prefill_time_s"] += time.perf_counter() - t0
        self.lanes.evict_full_slots()
        self._finish_full_long_slots()
        t1 = time.perf_counter()
        for lane in self.lanes.lanes:
            self._decode(lane)
        self.lanes.prune()
        share = self.config.prefill_share
        if self._partial is not None and share < 1.0:
            self._prefill_credit += (time.perf_counter() - t1) * share / (1.0 - share)

    def _admit_waiting(self, joining: list[tuple[Running, RowKV, int]]) -> tuple[list[Running], int]:
        """Take waiting requests, in queue order, while rows and the `prefill_chunk` budget last: fresh
        prompts that fit the budget (returned, for one padded prefill pass, with the budget left),
        prefix-cached prompts whose rest fits (prefilled now, into `joining`), long contexts whose rest
        fits (prefilled now into the long slot claimed for them, beside a chunked prefill under way: an
        agent's next call is mostly its cached context and a tool output), and the chunked prefill (a
        long slot claimed for a long context) when none is under way. A request that cannot start keeps
        its place, and the requests behind it that can start now do, first come first served for each
        of the two scarce things: a request waiting for the chunked prefill keeps it from those behind
        it, and the long requests waiting keep idle long slots from those behind them: one each for
        those whose rest fits (they wait for a slot alone), one between those that wait for the chunked
        prefill (they start one at a time). So a long call whose rest fits starts in an idle slot while
        an earlier call waits for the chunked prefill, as long as the slots kept for those ahead remain."""
        budget = self.config.prefill_chunk
        group: list[Running] = []
        packed: list[_Partial] = []  # prefix-cached prompts whose rest fits: one packed pass after the scan
        admitted: list[Running] = []
        chunked_ahead = False  # an earlier request waits for the chunked prefill
        long_ahead = 0  # earlier long requests whose rest fits that wait for a slot: one kept for each
        long_chunked = False  # an earlier long request waits for the chunked prefill: one slot kept for it
        running = len(self._in_flight())
        waiting = list(self._waiting)
        try:
            for i, r in enumerate(waiting):
                if (
                    running + len(joining) + len(group) + len(packed) >= self.config.max_running_requests
                    or budget <= 0
                ):
                    self._hold("rows" if budget > 0 else "prefill_budget", len(waiting) - i)
                    break
                n = r.context_length()
                long = self._wants_long(r, n)
                hit = self._lookup(r, n)
                if not long and hit.kv is None and n <= budget:
                    admitted.append(r)
                    group.append(r)  # fresh short prompts share one padded forward pass
                    budget -= n
                    continue
                # the rest of a prefix-cached prompt, or of a long context, that fits the budget is
                # prefilled now (a long one into the long slot it claims, beside a chunked prefill under
                # way); otherwise it needs the chunked prefill: one at a time, first come first served,
                # and while it cannot start it keeps its place and those behind it that fit go on
                at_once = n - hit.length <= budget
                if not at_once and (chunked_ahead or self._partial is not None):
                    self._hold("chunked_prefill" if self._partial is not None else "behind")
                    chunked_ahead = True
                    long_chunked |= long
                    continue
                cache: Any
                if long:
                    claim = self._claim_long_slot(hit, joining, long_ahead + long_chunked)
                    if isinstance(claim, str):  # no idle slot (or none past those kept), or no memory
                        self._hold(claim)
                        if at_once:
                            long_ahead += 1
                        else:  # it comes first for the chunked prefill, once it has a slot
                            chunked_ahead = long_chunked = True
                        continue
                    cache, row, pos = claim  # pos is hit.length
                else:  # a packed row keeps its prefix as it is: `_prefill_packed` copies it where it runs
                    prefix, row, pos = self._on_device(hit.kv), -1, hit.length
                    cache = prefix if at_once and pos > 0 else start_cache(prefix)
                admitted.append(r)
                if pos:
                    self.prefix.used(hit)
                p = _Partial(r, r.context(), cache, pos, pos, row)
                if at_once and not long and pos > 0:
                    packed.append(p)
                    budget -= len(p.ctx) - pos
                elif at_once:
                    budget -= self._advance(p, budget, joining)
                    self._long_at_once += long
                else:
                    running += 1
                    self._partial = p
            if packed:
                self._prefill_packed(packed, joining)
        finally:  # those admitted leave the queue (also when a prefill failed half-way)
            if admitted:
                gone = {id(r) for r in admitted}
                self._waiting = deque(r for r in self._waiting if id(r) not in gone)
                for r in admitted:
                    r.hit = None  # its views would keep an entry's memory for as long as the call runs
        return group, budget

    def _hold(self, why: WaitReason, n: int = 1) -> None:
        """Count `n` requests left waiting this step for `why`."""
        self._held[why] = self._held.get(why, 0) + n

    def _lookup(self, r: Running, n: int) -> PrefixHit:
        """The longest cached prefix of `r`'s context (`n` tokens; at most `n - 1`, so one is computed).
        A request that waits is asked about at every step: while nothing came into or left the cache since
        the last time, that answer stands (a lookup compares the context with every entry that starts
        like it: about 0.3 ms for 15 entries of 8-25k tokens on this project's CPU)."""
        if not self.config.enable_prefix_cache:
            return PrefixHit(0, None)
        if r.hit is None or r.hit_version != self.prefix.version:
            r.hit, r.hit_version = self.prefix.lookup(r.context_array(), limit=n - 1), self.prefix.version
        return r.hit

    def _prefill_turn(self) -> bool:
        """Whether the chunked prefill may run a chunk now: always while nothing decodes, else once the
        decode steps since its last chunk make up `1 - prefill_share` of the time."""
        return not self.lanes.requests() or self._prefill_credit >= 0.0

    def _in_flight(self) -> list[Running]:
        """Requests past admission: decoding in a lane, or half-way through a chunked prefill."""
        return self.lanes.requests() + ([self._partial.r] if self._partial is not None else [])

    # ----------------------------------------------------------------- long slots
    def _wants_long(self, r: Running, n: int) -> bool:
        """Whether `r`, whose context is `n` tokens, is served from a long slot: there are long slots, its
        context plus its new tokens do not fit a decode slot, and its context fits a long slot."""
        cap = self.config.long_context_tokens
        if cap <= 0 or self.slots is None:
            return False
        return n + r.req.max_new_tokens > self.slots.max_len and n < cap

    def _long_batch(self) -> SlotBatch | None:
        """The long slots' batch (None before the first long request)."""
        lane = self.lanes.long
        return lane.batch if lane is not None and isinstance(lane.batch, SlotBatch) else None

    def _claim_long_slot(
        self, hit: PrefixHit, joining: list[tuple[Running, RowKV, int]], keep: int = 0
    ) -> tuple[SlotBatch, int, int] | WaitReason:
        """The long slots' batch, an idle slot of it (neither decoding nor being prefilled) holding `hit`'s
        prefix, and how many tokens of the context it covers: the slot the prefix cache picks
        (`PrefixCache.take_long_slot`: the hit's own slot when the call extends that slot's whole context,
        nothing copied; else an idle one, into which a hit held elsewhere is copied). Taken only while more
        than `keep` slots are idle (those are kept for the long requests that wait ahead); else why not:
        `long_memory` (the slots have no memory yet), `long_slot` (none is idle), `behind` (the idle ones
        are kept)."""
        batch = self._long_batch()
        if batch is None:
            batch = self._new_long_batch()
        if not batch.capacity and not self._allocate_long_batch(batch):
            return "long_memory"  # no room yet: the request waits
        buf = batch.kv
        busy = set(batch.slot_of)
        # rows prefilled into a long slot this step, not yet placed in the batch
        busy |= {kv.row for _, kv, _ in joining if isinstance(kv, LongRowKV) and kv.buf is buf}
        p = self._partial
        if p is not None and p.cache is batch:
            busy.add(p.row)
        idle = [s for s in range(batch.slots) if s not in busy]
        if len(idle) <= keep:
            return "behind" if idle else "long_slot"
        slot, here = self.prefix.take_long_slot(buf, idle, hit)
        if hit.kv is not None and not here:  # a hit in the slot taken is in place already
            copy_prefix(batch.row_buffer(slot), hit.kv)
            self._long_copies += 1
        return batch, slot, hit.length

    def _on_device(self, kv: RowKV | None) -> RowKV | None:
        """`kv` on the engine's device (a hit from the prefix cache's host tier is copied there)."""
        if kv is None or not kv.keys or kv.keys[0].device == self.device:
            return kv
        return RowKV([k.to(self.device) for k in kv.keys], [v.to(self.device) for v in kv.values])

    def _new_long_batch(self) -> SlotBatch:
        assert self.slots is not None
        cap = min(self.config.long_context_tokens, self.context_len)
        n = max(1, self.config.long_context_slots)
        log.info("long slots: %d of %d tokens", n, cap)
        batch = SlotBatch(
            self.model,
            n,
            cap,
            use_graphs=self.slots.use_graphs,
            compile_model=self.slots.compile_model,
            full_width=self.config.slot_widths == "full",
            dedicated=True,
            keep_addresses=self._keep,
        )
        self.lanes.long = Lane(batch)
        return batch

    def _allocate_long_batch(self, batch: SlotBatch) -> bool:
        """Allocate the long slots' buffer, all slots at once; with graphs of full widths, capture every
        graph of its steps now (each batch bucket and run length; sampled steps on first use, as the
        decode slots'), so none is captured later in the middle of decoding. Bucketed widths capture a
        length bucket's graph when a step first needs it. Without the room, even once the prefix cache's
        device copies are out: False, and no new try for `LONG_RETRY_S`."""
        if time.monotonic() < self._long_retry_at:
            return False
        try:
            try:
                batch.allocate()
            except torch.OutOfMemoryError:
                gone = self.prefix.evict(self.prefix.held_tokens)  # to the host tier, if there is one
                self._stats["memory_evicted_tokens"] += gone
                torch.cuda.empty_cache()
                batch.allocate()
        except torch.OutOfMemoryError:
            batch.release()
            self._long_retry_at = time.monotonic() + LONG_RETRY_S
            free = self.device_free_bytes()
            log.warning(
                "no room for the long slots (%.1f GiB, %.1f GiB free on %s): long requests wait; "
                "trying again in %.0f s",
                batch.buffer_bytes() / 2**30,
                (free or 0) / 2**30,
                self.device,
                LONG_RETRY_S,
            )
            return False
        if batch.use_graphs and batch.full_width:
            with torch.inference_mode():
                batch.warmup(batch.max_len, self._run_lengths())
        return True

    def _finish_full_long_slots(self) -> None:
        """Rows that filled their long slot finish (`length`); their KV goes to the prefix cache."""
        lane = self.lanes.long
        if lane is None or not lane.reqs:
            return
        batch = lane.batch
        assert isinstance(batch, SlotBatch)
        full = batch.full_rows()
        for i in full:
            r = lane.reqs[i]
            if self.config.enable_prefix_cache:
                self.prefix.insert(r.context()[:-1], batch.finished_kv(i), owned=True)
        finished = [lane.reqs[i] for i in full]
        if full:
            lane.drop(full)
        for r in finished:
            self._finish(r, FinishReason(type="length", length=len(r.output)), [], [], None)

    def _advance_partial(self, budget: int, joining: list[tuple[Running, RowKV, int]]) -> int:
        """Prefill the next `budget` tokens of the request in chunked prefill (sampling its first token
        once its context is covered), charging the chunk's time to `prefill_share`. Returns the tokens
        computed."""
        p = self._partial
        assert p is not None
        t0 = time.perf_counter()
        # a chunk that runs while nothing decodes owes nothing; one beside decoding rows is paid back by
        # their decode steps before the next (`prefill_share`)
        owed = min(self._prefill_credit, 0.0) if self.lanes.requests() else 0.0
        done = self._advance(p, budget, joining)
        if p.pos == len(p.ctx):
            self._partial = None
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the chunk's time is charged to the prefill's share
        self._prefill_credit = owed - (time.perf_counter() - t0) if self.lanes.requests() else 0.0
        return done

    @torch.inference_mode()
    def _advance(self, p: _Partial, budget: int, joining: list[tuple[Running, RowKV, int]]) -> int:
        """Prefill the next `budget` tokens of `p`; when its context is covered, sample its first token.
        Returns the tokens computed."""
        end = min(len(p.ctx), p.pos + max(budget, 1))
        self._stats["prefill_passes"] += 1
        if isinstance(p.cache, SlotBatch):
            logits = prefill_into(self.model, self._cache_kw, p.ctx, p.cache.row_buffer(p.row), p.pos, end)
        else:
            logits = prefill_chunk(self.model, self._cache_kw, p.ctx, p.cache, p.pos, end, self.device)
        done, p.pos = end - p.pos, end
        if p.pos == len(p.ctx):
            self._count_prefill(p.r, len(p.ctx) - p.cached, p.cached)
            first = sample(logits, [p.r.sampler], [p.r.req.top_logprobs_num], [p.r.req.token_ids_logprob])
            top = first.top[0] if first.top else None
            if isinstance(p.cache, SlotBatch):
                row: RowKV = buffer_row(p.cache.kv, len(p.ctx), p.row)
            else:
                row = RowKV(*cache_layers(p.cache))
            self._started(p.r, p.ctx, row, first.tokens[0], first.logprobs[0], top, joining)
        return done

    @torch.inference_mode()
    def _prefill_packed(self, parts: list[_Partial], joining: list[tuple[Running, RowKV, int]]) -> None:
        """The rests of prefix-cached prompts (each `cache` the cached prefix, covering `ctx[:pos]`) in one
        packed pass, straight into free decode slots where they fit (`slot_prefill.py`); each row's first
        token sampled from its own last logits."""
        self._stats["prefill_passes"] += 1
        logits, rows = self._packed_pass(parts)
        first = sample(
            logits,
            [p.r.sampler for p in parts],
            [p.r.req.top_logprobs_num for p in parts],
            [p.r.req.token_ids_logprob for p in parts],
        )
        for i, p in enumerate(parts):
            p.pos = len(p.ctx)
            self._count_prefill(p.r, len(p.ctx) - p.cached, p.cached)
            top = first.top[i] if first.top else None
            self._started(p.r, p.ctx, rows[i], first.tokens[i], first.logprobs[i], top, joining)

    def _packed_pass(self, parts: list[_Partial]) -> tuple[torch.Tensor, list[RowKV]]:
        """The packed pass of `_prefill_packed`: each row's last logits and its KV."""
        sp = self.slot_prefill
        if sp is not None and sp.fits([(len(p.ctx), len(p.ctx) - p.pos) for p in parts]):
            try:
                logits, in_slots = sp.run([(p.cache, p.ctx, p.pos) for p in parts])
                return logits, list(in_slots)
            except Exception:  # (the free slots it wrote into hold no row)
                log.exception("prefill into the decode slots failed; prefilling as before from now on")
                self.slot_prefill = None
        caches = [start_cache(p.cache) for p in parts]
        rows = [(p.ctx, p.pos, c) for p, c in zip(parts, caches, strict=True)]
        logits = prefill_packed(self.model, self._cache_kw, rows, self.device)
        return logits, [RowKV(*cache_layers(c)) for c in caches]

    @torch.inference_mode()
    def _prefill_group(self, group: list[Running], joining: list[tuple[Running, RowKV, int]]) -> None:
        ctxs = [r.context() for r in group]
        self._stats["prefill_passes"] += 1
        if self._compile_prefill and self.compiled_prefill is None:
            self.compiled_prefill = compile_fn(group_forward)
        try:
            rows, logits = prefill_group(self.model, self._cache_kw, ctxs, self.device, self.compiled_prefill)
        except Exception:
            if self.compiled_prefill is None:
                raise
            log.exception("compiled prefill failed; prefilling eagerly from now on")
            self.compiled_prefill, self._compile_prefill = None, False
            rows, logits = prefill_group(self.model, self._cache_kw, ctxs, self.device)
        first = sample(
            logits,
            [r.sampler for r in group],
            [r.req.top_logprobs_num for r in group],
            [r.req.token_ids_logprob for r in group],
        )
        for i, (r, ctx, row) in enumerate(zip(group, ctxs, rows, strict=True)):
            self._count_prefill(r, len(ctx), 0)
            top = first.top[i] if first.top else None
            self._started(r, ctx, row, first.tokens[i], first.logprobs[i], top, joining)

    def _count_prefill(self, r: Running, computed: int, cached: int) -> None:
        self._stats["prefill_tokens_computed"] += computed
        self._stats["prefill_tokens_cached"] += cached
        if r.cached_tokens < 0:
            r.cached_tokens = cached

    def _started(
        self,
        r: Running,
        ctx: list[int],
        row: RowKV,
        token: int,
        logprob: float,
        top: RowLogprobs | None,
        joining: list[tuple[Running, RowKV, int]],
    ) -> None:
        """After prefill: finish at once, or go to `joining` (placed into a decode lane after the prefills)."""
        tops = [top] if top is not None else None
        if r.req.max_new_tokens == 0:
            self._store_prefix(ctx, row)
            self._finish(r, FinishReason(type="length", length=0), [], [], None)
            return
        r.output.append(token)
        finish = r.finish_reason(token)
        if finish is not None:
            self._store_prefix(ctx, row)
            self._finish(r, finish, [token], [logprob], tops)
        else:
            self._emit(r, [token], [logprob], tops, None)
            joining.append((r, row, token))

    @torch.inference_mode()
    def _decode(self, lane: Lane) -> None:
        """One decode step (or one run of several) for the rows of one lane; finished rows leave it."""
        t0 = time.perf_counter()
        reqs = lane.reqs
        batch = lane.batch
        old = list(batch.lengths)
        tops: list[RowLogprobs] | None = None
        if isinstance(batch, SlotBatch) and all(
            (r.sampler.greedy or (r.sampler.untruncated and batch.device_sampling))
            and not r.sampler.needs_row_processing
            and not r.req.wants_row_logprobs
            for r in reqs
        ):  # the head (argmax, or a draw at the row's temperature) runs inside the captured step
            toks, lps = batch.step_run(
                self._run_length(reqs, batch),
                [0.0 if r.sampler.greedy else r.req.params.temperature for r in reqs],
                [r.sampler.seed for r in reqs],
            )
            for step in toks:  # tokens past a row's finish are dropped with the row
                for r, token in zip(reqs, step, strict=True):
                    r.sampler.observe(token)
        else:  # `sample` observes its tokens
            s = sample(
                batch.step(self.model),
                [r.sampler for r in reqs],
                [r.req.top_logprobs_num for r in reqs],
                [r.req.token_ids_logprob for r in reqs],
            )
            toks, lps, tops = [s.tokens], [s.logprobs], s.top
        steps = len(toks)
        self._stats["decode_time_s"] += time.perf_counter() - t0
        self._stats["decode_steps"] += steps
        self._stats["decode_tokens"] += steps * len(reqs)
        done: list[int] = []
        for i, r in enumerate(reqs):
            for k in range(steps):
                token = toks[k][i]
                r.output.append(token)
                finish = r.finish_reason(token)
                if finish is not None or k + 1 == steps:
                    break
            got = [toks[j][i] for j in range(k + 1)]
            got_lps = [lps[j][i] for j in range(k + 1)]
            top = [tops[i]] if tops is not None else None
            if finish is None:
                batch.next_tokens[i] = token
                self._emit(r, got, got_lps, top, None)
                continue
            if isinstance(batch, SlotBatch):
                if k + 1 < steps:  # finished inside a run: its KV past the finish is dropped
                    batch.set_length(i, old[i] + k + 1)
                if self.config.enable_prefix_cache:
                    self.prefix.insert(r.context()[:-1], batch.finished_kv(i), owned=True)
            else:
                self._store_prefix(r.context()[:-1], batch.row_kv(i))
            self._finish(r, finish, got, got_lps, top)
            done.append(i)
        if done:
            lane.drop(done)

    def _run_length(self, reqs: list[Running], batch: SlotBatch) -> int:
        """Steps of the next run: `run_steps` when every row has room for them and some row wants at
        least three quarters of them (else single steps waste less), 1 otherwise."""
        n = self.config.run_steps
        if n <= 1 or not batch.can_run(n):
            return 1
        want = max(r.req.max_new_tokens - len(r.output) for r in reqs)
        return n if 4 * want >= 3 * n else 1

    def _store_prefix(self, tokens: list[int], kv: RowKV) -> None:
        if self.config.enable_prefix_cache:
            self.prefix.insert(tokens, kv)

    def _emit(
        self,
        r: Running,
        tokens: list[int],
        lps: list[float],
        top: list[RowLogprobs] | None,
        finish: FinishReason | None,
    ) -> None:
        ev = TokenEvent(
            r.rid,
            tokens,
            lps,
            top,
            finish,
            len(r.req.input_ids),
            max(r.cached_tokens, 0),
            self.weight_version,
        )
        try:
            r.sink(ev)
        except Exception:
            log.exception("sink of request %s failed", r.rid)

    def _finish(
        self,
        r: Running,
        finish: FinishReason,
        tokens: list[int],
        lps: list[float],
        top: list[RowLogprobs] | None,
    ) -> None:
        self._emit(r, tokens, lps, top, finish)

    # ----------------------------------------------------------------- control (engine thread only)
    def abort(self, rid: str, message: str = "Abort in waiting queue") -> bool:
        """Abort one request by rid; False if no such request is in flight."""
        return self._abort_where(lambda r: r.rid == rid, message)

    def abort_request(self, req: EngineRequest, message: str = "Abort request") -> bool:
        """Abort the request made of `req` itself (not another that reuses its rid); False if it is no
        longer in flight."""
        return self._abort_where(lambda r: r.req is req, message)

    def _abort_where(self, match: Callable[[Running], bool], message: str) -> bool:
        for r in list(self._waiting):
            if match(r):
                self._waiting.remove(r)
                self._finish(r, abort_reason(message), [], [], None)
                return True
        if self._partial is not None and match(self._partial.r):
            r, self._partial = self._partial.r, None
            self._finish(r, abort_reason("Abort request"), [], [], None)
            return True
        found = self.lanes.find_where(match)
        if found is not None:
            lane, i = found
            r = lane.reqs[i]
            lane.drop([i])
            self.lanes.prune()
            self._finish(r, abort_reason("Abort request"), [], [], None)
            return True
        return False

    def _clear_in_flight(self) -> list[Running]:
        """Drop every admitted request's KV (lanes and the chunked prefill); returns them, oldest first."""
        partial = [self._partial.r] if self._partial is not None else []
        self._partial = None
        placed = self.lanes.clear()
        lost = [r for r in self._placing if all(r is not p for p in placed)]
        self._placing = []
        return partial + placed + lost

    def _abort_all_now(
        self, message: str = "Abort all requests", status: int = 200, err_type: str = "abort"
    ) -> int:
        victims = list(self._waiting) + self._clear_in_flight()
        self._waiting.clear()
        for r in victims:
            self._finish(r, abort_reason(message, status, err_type), [], [], None)
        return len(victims)

    def abort_all(self, message: str = "Abort all requests") -> int:
        return self._abort_all_now(message)

    def pause(self, mode: str) -> int:
        """Stop stepping. abort: end every request; retract: drop their KV and requeue them (they are
        re-prefilled on continue); in_place: keep everything as it is. Returns requests affected."""
        if mode not in ("abort", "retract", "in_place"):
            raise ProtocolError(f"unknown pause mode {mode!r}; expected abort, retract or in_place")
        self.paused = True
        if mode == "abort":
            return self._abort_all_now("Abort because generation was paused")
        if mode == "retract":
            retracted = self._clear_in_flight()
            self._waiting.extendleft(reversed(retracted))
            return len(retracted)
        return len(self._in_flight()) + len(self._waiting)

    def resume_generation(self) -> None:
        self.paused = False

    def flush_cache(self) -> None:
        """Drop the prefix cache; refused while requests run (as SGLang does)."""
        if self._in_flight() or self._waiting:
            raise EngineUnavailable("Cache not flushed: there are running or waiting requests")
        self.prefix.clear()

    def begin_weight_update(self) -> bool:
        """Open the weight-update session (no step runs until it ends); False if one is open."""
        if self.updating:
            return False
        self.updating = True
        return True

    def end_weight_update(self) -> str | None:
        """Close the session; the new weight version, or None if no session was open."""
        if not self.updating:
            return None
        self.updating = False
        if self._pending_bump:
            self._bump_version(None)
        return self.weight_version

    def _bump_version(self, version: str | None) -> None:
        self._pending_bump = False
        if version is not None:
            self.weight_version = version
        elif self.weight_version.isdigit():
            self.weight_version = str(int(self.weight_version) + 1)
        else:
            self.weight_version = f"{self.weight_version}+1"

    def update_weights(
        self, apply: Callable[[], int], version: str | None, flush: bool = True, abort_all: bool = False
    ) -> int:
        """Apply a weight update between two steps (`apply` checks and copies, returning the count)."""
        if "weights" in self.released:
            raise EngineUnavailable("weights are released; resume_memory_occupation first")
        if abort_all:
            self._abort_all_now("Abort for a weight update")
        n = apply()
        if self.fused is not None:
            self.fused.refresh()  # a no-op for updates that copy into the parameters
        for batch in self._slot_batches():
            batch.check_weights()
        if flush:
            self.prefix.clear()
        if self.updating and version is None:
            self._pending_bump = True
        else:
            self._bump_version(version)
        return n

    def check_token_ids(self, ids: list[int], what: str = "input_ids") -> None:
        """ProtocolError (a 400) unless every id of `ids` is in the vocabulary [0, vocab_size)."""
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise ProtocolError(f"{what} has {bad}, outside the vocabulary [0, {self.vocab_size})")

    def device_free_bytes(self) -> int | None:
        """Free memory of the engine's GPU (every process's use counted); None off CUDA."""
        if self.device.type != "cuda":
            return None
        return int(torch.cuda.mem_get_info(self.device)[0])

    def _keep_memory_free(self) -> None:
        """Evict prefix-cache entries while the GPU has less than `min_free_bytes` free (see the setting):
        those that hold memory of their own (a long slot's cached context frees nothing)."""
        want = self.config.min_free_bytes
        if want <= 0 or not self.prefix.held_tokens:
            return
        free = self.device_free_bytes()
        if free is None or free >= want:
            return
        gone = self.prefix.evict(-(-(want - free) // self._kv_token_bytes))
        self._stats["memory_evicted_tokens"] += gone
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        where = "moved to the host tier or dropped" if self.prefix.host_tokens else "dropped"
        log.info("%d MiB free of the %d MiB kept: %d cached tokens %s", free >> 20, want >> 20, gone, where)

    def _return_cached_free(self) -> None:
        """The allocator's free cached blocks back to the driver once they pass `cached_free_bytes`."""
        if self.device.type != "cuda":
            return
        if torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device) > (
            self.config.cached_free_bytes
        ):
            torch.cuda.empty_cache()
            self._stats["cache_returns"] += 1

    def release_memory(self, tags: list[str] | None) -> None:
        tags = _check_tags(tags)
        if self._in_flight() or self._waiting:
            raise EngineUnavailable("release_memory_occupation needs an idle engine; pause or abort first")
        if "kv_cache" in tags:
            self.prefix.clear()
            for batch in self._slot_batches():
                batch.release()
        if "weights" in tags and self.device.type == "cuda":
            if self.kept is not None:  # the same addresses come back: graphs and fused groups hold
                self.kept.release()
            else:
                for batch in self._slot_batches():
                    batch.drop_graphs()
                self._offload_weights()
                if self.fused is not None:
                    self.fused.drop()
            torch.cuda.empty_cache()
        self.released |= set(tags)
        if self.device.type == "cuda":  # what a released engine still holds, for whoever needs the room
            host_stats: dict[str, Any] = getattr(torch.cuda, "host_memory_stats", dict)()
            pinned = int(host_stats.get("allocated_bytes.current", 0))
            log.info(
                "released %s: %d MiB of tensors still allocated, %d MiB reserved; %d MiB of pinned host "
                "memory in torch's host allocator; the host tier's %d MiB (%s, kept)",
                ",".join(sorted(tags)),
                torch.cuda.memory_allocated(self.device) >> 20,
                torch.cuda.memory_reserved(self.device) >> 20,
                pinned >> 20,
                self.prefix.host_bytes >> 20,
                "page-locked" if self.prefix.host_pinned else "pageable",
            )

    def resume_memory(self, tags: list[str] | None) -> None:
        tags = _check_tags(tags)
        if "weights" in tags and "weights" in self.released and self.device.type == "cuda":
            if self.kept is not None:
                self.kept.restore()
            else:
                self._restore_weights()
            if self.fused is not None:
                self.fused.refresh()
            for batch in self._slot_batches():
                batch.check_weights()
        if "kv_cache" in tags and "kv_cache" in self.released:
            self._reserve_kv()
        self.released -= set(tags)

    def _reserve_kv(self) -> None:
        """Allocate again the KV buffers that are held whole while the engine serves (the long slots' once
        a long call has used them, the decode slots' with full widths), before any call needs them (see
        `long_context_slots`); their graphs are captured at first use. Not enough free memory for them is
        an error that says so."""
        whole = [b for b in self._slot_batches() if b.dedicated or b.full_width]
        try:
            for batch in whole:
                batch.allocate()
        except torch.OutOfMemoryError as exc:
            need = sum(b.buffer_bytes() for b in whole)
            free = self.device_free_bytes()
            have = "" if free is None else f", {free / 2**30:.1f} GiB free on {self.device}"
            for batch in whole:
                batch.release()
            raise EngineUnavailable(
                f"resuming the KV cache needs {need / 2**30:.1f} GiB for the decode and long slots{have}: "
                "another process on this GPU holds the rest"
            ) from exc

    def _slot_batches(self) -> list[SlotBatch]:
        """The decode slots and the long slots."""
        long = self._long_batch()
        return ([self.slots] if self.slots is not None else []) + ([long] if long is not None else [])

    def _tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer of the model by name (shared ones once)."""
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in [*self.model.named_parameters(), *self.model.named_buffers()]:
            if id(t) not in seen:
                seen.add(id(t))
                out[name] = t
        return out

    def _keep_weights(self) -> vmem.KeptWeights | None:
        """Move the weights (the fused projections' tensors with them) to kept device addresses; None,
        with a warning, where the GPU has too little free memory for the moment both copies exist (the
        weights then move to the host and back at each release, and the graphs are captured again)."""
        tensors = [*self._tensors().values(), *(self.fused.tensors() if self.fused is not None else [])]
        need = vmem.storage_bytes(tensors) + KEEP_MARGIN
        free = self.device_free_bytes()
        if free is not None and free < need:
            log.warning(
                "weights not moved to kept device addresses: the move needs %.1f GiB free on %s, %.1f "
                "GiB are; the decode graphs will be captured again after each memory release",
                need / 2**30,
                self.device,
                free / 2**30,
            )
            return None
        kept = vmem.KeptWeights(tensors, self.device)
        torch.cuda.empty_cache()  # the weights' old memory back to the driver
        log.info("weights at kept device addresses: %d MiB", kept.nbytes >> 20)
        return kept

    def _offload_weights(self) -> None:
        """Copy the weights into their pinned host copies and point the model at those (device memory
        freed once nothing else holds it)."""
        tensors = self._tensors()
        for name, t in tensors.items():
            host = self._host.get(name)
            if host is None or host.shape != t.shape or host.dtype != t.dtype:
                host = self._host[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t.data, non_blocking=True)
        torch.cuda.synchronize(self.device)
        for name, t in tensors.items():
            t.data = self._host[name]

    def _restore_weights(self) -> None:
        """Back onto the device from the pinned copies (the pinned copies stay for the next release)."""
        for t in self._tensors().values():
            t.data = t.data.to(self.device, non_blocking=True)
        torch.cuda.synchronize(self.device)


KEEP_MARGIN = 256 << 20
"""Free device memory beyond a second copy of the weights that moving them to kept addresses asks for."""

THREAD_DIED = 70
"""Exit status of a server whose engine thread died (EX_SOFTWARE)."""


def _die() -> None:
    try:
        sys.stderr.write(f"gyre-engine: the engine thread died; the process exits ({THREAD_DIED})\n")
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
    finally:
        os._exit(THREAD_DIED)


def _check_tags(tags: list[str] | None) -> list[str]:
    if tags is None:
        return ["weights", "kv_cache"]
    bad = [t for t in tags if t not in ("weights", "kv_cache")]
    if bad:
        raise ProtocolError(f"unknown memory tags {bad}; expected 'weights' and/or 'kv_cache'")
    return list(tags)
