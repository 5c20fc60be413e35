"""A stand-in for SGLang 0.5.23's scheduler process, and `serve`: sglang's real server with it.

sglang's `launch_server` takes the scheduler process function as an argument (`run_scheduler_process_func`);
this module passes `run_standin_scheduler`, which speaks the scheduler's side of sglang's IPC (its msgspec
structs over its ZeroMQ sockets, made by sglang's `SchedulerIpcChannels`) without a model. Everything
else is sglang's own: the FastAPI app, the TokenizerManager, the DetokenizerManager process and, inside
this process, `Req` (finish rules), `SchedulerOutputStreamer` (chunk contents, `stream_interval`, holding
a chunk back while its tail could start a stop string), `SchedulerLogprobResultProcessor` (the first
token's logprobs) and the load-snapshot writer behind `/v1/loads`. What is the stand-in's own: the tokens
(`TEXT`, then EOS), their logprob values, `cached_tokens` (longest common prefix with a finished
context, where sglang asks its radix cache), the numbers in `/server_info`'s internal state and in the
load snapshots, and replies to weight updates (the session rule as sglang's `SchedulerWeightUpdater`
words it; inside a session an update fails: there is no model to load into).

    python sglang_standin.py --model DIR --port P    # serves until killed (sglang installed)
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

SGLANG_VERSION = "0.5.23"
TEXT = " The answer is 42. Goodbye, and thanks for all the fish."
"""What the stand-in model says (then EOS), token by token."""
TOKEN_DELAY_S = 0.01
"""Seconds between two decode steps of the stand-in scheduler."""


# --------------------------------------------------------------------------------------------------
# The stand-in scheduler (runs in the process sglang spawns for its scheduler)
# --------------------------------------------------------------------------------------------------


def _fake_logprob(pos: int, tid: int) -> float:
    """A deterministic, irregular logprob for token `tid` at output position `pos`."""
    return -round(0.05 + ((tid * 31 + pos * 17) % 97) / 37.0, 6)


class _LogitsOut:
    """The fields of sglang's `LogitsProcessorOutput` that its logprob processor reads, for one row."""

    def __init__(self, req: Any, token: int, pos: int) -> None:
        k = req.logprob.top_logprobs_num if req.return_logprob else 0
        self.next_token_logprobs = [_fake_logprob(pos, token)]
        self.input_token_logprobs: tuple[float, ...] = ()
        top = [token] + [(token + 1 + j * 7) % 1000 for j in range(max(0, k - 1))]
        self.next_token_top_logprobs_val = [[_fake_logprob(pos, t) for t in top[:k]]] if k else None
        self.next_token_top_logprobs_idx = [top[:k]] if k else None
        ids = req.logprob.token_ids_logprob
        self.next_token_token_ids_logprobs_val = [[_fake_logprob(pos, t) for t in ids]] if ids else None
        self.next_token_token_ids_logprobs_idx = [list(ids)] if ids else None
        self.input_top_logprobs_val: list[Any] = [[]]
        self.input_top_logprobs_idx: list[Any] = [[]]
        self.input_token_ids_logprobs_val: list[Any] = [[]]
        self.input_token_ids_logprobs_idx: list[Any] = [[]]


def run_standin_scheduler(
    server_args: Any,
    port_args: Any,
    gpu_id: int,
    tp_rank: int,
    pp_rank: int,
    dp_rank: Any,
    pipe_writer: Any,
    *_: Any,
) -> None:
    """Takes the place of sglang's `run_scheduler_process` (same signature, same handshake)."""
    from sglang.srt.runtime_context import SpawnRanks, publish

    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=None))
    StandinScheduler(server_args, port_args, pipe_writer).run()


class StandinScheduler:
    """Generates `TEXT` + EOS for every request, one token a step, through sglang's own request and output
    machinery; answers the control messages a client of the native API sends."""

    def __init__(self, server_args: Any, port_args: Any, pipe_writer: Any) -> None:
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.managers.load_snapshot import create_load_snapshot_writer
        from sglang.srt.managers.scheduler_components.ipc_channels import SchedulerIpcChannels
        from sglang.srt.managers.scheduler_components.logprob_result_processor import (
            SchedulerLogprobResultProcessor,
        )
        from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
        from sglang.srt.runtime_context import get_serving
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        from sglang.srt.utils.hf_transformers_utils import get_tokenizer

        self.server_args = server_args
        self.model_config = ModelConfig.from_server_args(server_args)
        self.tokenizer = get_tokenizer(get_serving().tokenizer_path)
        self.ipc = SchedulerIpcChannels.create(
            port_args=port_args,
            is_rank_zero=True,
            skip_tokenizer_init=False,
            metrics_enabled=False,
            enable_scripted_runtime=False,
        )
        self.streamer = SchedulerOutputStreamer(
            send_to_detokenizer=self.ipc.send_to_detokenizer,
            tree_cache=_NoTreeCache(),
            server_args=server_args,
            is_generation=True,
            spec_algorithm=SpeculativeAlgorithm.NONE,
            disaggregation_mode=DisaggregationMode.NULL,
            enable_hicache_storage=lambda: False,
        )
        self.logprobs = SchedulerLogprobResultProcessor(model_config=self.model_config)
        self.script = list(self.tokenizer.encode(TEXT, add_special_tokens=False))
        self.eos = int(self.tokenizer.eos_token_id)  # a chat model's end of turn (<|im_end|> here)
        self.max_total_num_tokens = 65536
        self.max_req_len = self.model_config.context_len
        self.running: list[Any] = []
        self.history: list[list[int]] = []  # finished contexts, for cached_tokens (a radix-cache stand-in)
        self.session_open = False
        self.weight_version = "default"
        self.total_prefill_uncached = 0
        self.decode_moments = [0.0] * 6  # sglang's Scheduler.decode_moment_totals
        self.last_step = time.perf_counter()
        self.load_writer = create_load_snapshot_writer(port_args, 1, 0, publish_interval=1)
        self.started = time.time()
        pipe_writer.send(
            {
                "status": "ready",
                "max_total_num_tokens": self.max_total_num_tokens,
                "max_req_input_len": self.max_req_len - 1,
                "startup_time": {},
            }
        )

    # ---- the loop -------------------------------------------------------------------------------

    def run(self) -> None:
        import zmq
        from sglang.srt.managers.io_struct import sock_recv

        sock = self.ipc.recv_from_tokenizer
        while True:
            while sock.poll(0 if self.running else 50):
                self.dispatch(sock_recv(sock, zmq.NOBLOCK))
            if self.running:
                self.step()
                time.sleep(TOKEN_DELAY_S)
            self.publish_load()

    def dispatch(self, msg: Any) -> None:
        from sglang.srt.managers import io_struct as io

        if isinstance(msg, io.BatchTokenizedGenerateReqInput):
            for sub in msg:
                self.add(sub)
        elif isinstance(msg, io.TokenizedGenerateReqInput):
            self.add(msg)
        elif isinstance(msg, io.AbortReq):
            self.abort(msg)
        else:
            reply = self.control(msg)
            if reply is not None:
                self.ipc.send_to_tokenizer.send_output(reply, msg)

    def add(self, recv: Any) -> None:
        """What sglang's `Scheduler._handle_generate_request` does for a plain text request."""
        from sglang.srt.managers.schedule_batch import Req

        recv.unwrap_pickle_fields()
        req = Req(
            recv.rid,
            recv.input_text,
            recv.input_ids,
            recv.sampling_params,
            return_logprob=recv.return_logprob,
            top_logprobs_num=recv.top_logprobs_num,
            token_ids_logprob=recv.token_ids_logprob,
            stream=recv.stream,
            eos_token_ids=self.model_config.hf_eos_token_id,
            vocab_size=self.model_config.vocab_size,
            http_worker_ipc=recv.http_worker_ipc,
            time_stats=recv.time_stats,
        )
        req.tokenizer = self.tokenizer
        # Scheduler.init_req_max_new_tokens
        max_new = req.sampling_params.max_new_tokens
        max_new = 1 << 30 if max_new is None else max_new
        req.sampling_params.max_new_tokens = max(
            0, min(max_new, self.max_req_len - len(req.origin_input_ids) - 1)
        )
        # Scheduler._handle_generate_request: logprob_start_len
        if not recv.return_logprob:
            recv.logprob_start_len = -1
        if recv.logprob_start_len == -1:
            if recv.return_logprob and recv.token_ids_logprob is None:
                req.logprob_start_len = len(req.origin_input_ids)
            else:
                req.logprob_start_len = -1
        else:
            req.logprob_start_len = recv.logprob_start_len
        self.running.append(req)

    def abort(self, msg: Any) -> None:
        """Scheduler.abort_request for running requests: they end at their next step."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        for req in self.running:
            if not req.finished() and (msg.abort_all or req.rid.startswith(msg.rid)):
                req.to_finish = FINISH_ABORT(msg.abort_message, 503) if msg.abort_message else FINISH_ABORT()

    def next_token(self, req: Any) -> int:
        """`TEXT`'s tokens, then EOS (again and again under ignore_eos)."""
        cycle = [*self.script, self.eos]
        return cycle[len(req.output_ids) % len(cycle)]

    def step(self) -> None:
        """One scheduler step: a prefill for new requests (first token), a decode step for the others."""
        from sglang.srt.managers.schedule_batch import compute_extend_logprob_start_len
        from sglang.srt.managers.scheduler import _accumulate_decode_moment

        now = time.perf_counter()
        decoding = sum(1 for r in self.running if len(r.output_ids) > 0)
        _accumulate_decode_moment(self.decode_moments, decoding, int((now - self.last_step) * 1e6), decoding)
        self.last_step = now
        by_logprob: dict[bool, list[Any]] = {True: [], False: []}
        for req in self.running:
            token = self.next_token(req)
            pos = len(req.output_ids)
            first = pos == 0
            if first:
                ctx = list(req.origin_input_ids)
                req.cached_tokens = max((_common(ctx, h) for h in self.history), default=0)
                if req.cached_tokens == len(ctx):  # sglang recomputes at least the last token
                    req.cached_tokens -= 1
                self.total_prefill_uncached += len(ctx) - req.cached_tokens
            req.output_ids.append(token)
            req.update_finish_state(1)
            if req.return_logprob:
                out = _LogitsOut(req, token, pos)
                if first:
                    extend = len(req.origin_input_ids) - req.cached_tokens
                    start = compute_extend_logprob_start_len(
                        logprob_start_len=req.logprob_start_len,
                        prefix_len=req.cached_tokens,
                        extend_len=extend,
                        full_untruncated_fill_len=len(req.origin_input_ids),
                    )
                    self.logprobs.add_logprob_return_values(0, req, 0, [token], extend - start, out)
                else:
                    req.logprob.output_token_logprobs_val.append(out.next_token_logprobs[0])
                    req.logprob.output_token_logprobs_idx.append(token)
                    if out.next_token_top_logprobs_val is not None:
                        req.logprob.output_top_logprobs_val.append(out.next_token_top_logprobs_val[0])
                        req.logprob.output_top_logprobs_idx.append(out.next_token_top_logprobs_idx[0])
                    if out.next_token_token_ids_logprobs_val is not None:
                        req.logprob.output_token_ids_logprobs_val.append(
                            out.next_token_token_ids_logprobs_val[0]
                        )
                        req.logprob.output_token_ids_logprobs_idx.append(
                            out.next_token_token_ids_logprobs_idx[0]
                        )
            by_logprob[bool(req.return_logprob)].append(req)
        for flag, reqs in by_logprob.items():
            if reqs:
                self.streamer.stream_output(reqs, flag)
        for req in [r for r in self.running if r.finished()]:
            self.running.remove(req)
            self.history.append(list(req.origin_input_ids) + list(req.output_ids))

    # ---- control messages -----------------------------------------------------------------------

    def control(self, msg: Any) -> Any:
        from sglang.srt.managers import io_struct as io

        if isinstance(msg, io.GetInternalStateReq):
            return self.internal_state()
        if isinstance(msg, io.FlushCacheReqInput):
            self.history.clear()
            return io.FlushCacheReqOutput(success=True)
        if isinstance(msg, io.BeginWeightUpdateReqInput):
            if self.session_open:
                return io.BeginWeightUpdateReqOutput(
                    success=False,
                    message="a weight-update session is already open; call end_weight_update() first",
                )
            self.session_open = True
            return io.BeginWeightUpdateReqOutput(success=True, message="Success")
        if isinstance(msg, io.EndWeightUpdateReqInput):
            if not self.session_open:
                return io.EndWeightUpdateReqOutput(
                    success=False,
                    message="no weight-update session is open; call begin_weight_update() first",
                )
            self.session_open = False
            return io.EndWeightUpdateReqOutput(success=True, message="Success")
        if isinstance(msg, io.UpdateWeightsFromDistributedReqInput):
            if not self.session_open:
                return io.UpdateWeightsFromDistributedReqOutput(
                    success=False,
                    message="update_weights_from_distributed must run between "
                    "begin_weight_update() and end_weight_update()",
                )
            return io.UpdateWeightsFromDistributedReqOutput(
                success=False, message="Failed to receive weights: the stand-in scheduler has no model"
            )
        if isinstance(msg, io.UpdateWeightsFromTensorReqInput):
            if not self.session_open:
                return io.UpdateWeightsFromTensorReqOutput(
                    success=False,
                    message="update_weights_from_tensor must run between "
                    "begin_weight_update() and end_weight_update()",
                )
            return io.UpdateWeightsFromTensorReqOutput(
                success=False, message="the stand-in scheduler has no model"
            )
        return None

    def internal_state(self) -> Any:
        """SchedulerInternalStateController.get_internal_state, with the stand-in's numbers."""
        from sglang.srt.managers.io_struct import GetInternalStateReqOutput
        from sglang.srt.managers.scheduler_components.memory_usage import build_memory_usage
        from sglang.srt.runtime_context import get_context
        from sglang.srt.utils.msgspec_utils import msgspec_to_builtins

        state = get_context().resolved_server_args_dict()
        state["world_size"] = 1
        state["startup_time"] = {}
        state["effective_max_running_requests_per_dp"] = 256
        state["last_gen_throughput"] = 0.0
        state["memory_usage"] = build_memory_usage(
            weight_gb=0.0,
            kv_cache_gb=0.0,
            startup_available_gb=0.0,
            token_capacity=self.max_total_num_tokens,
            token_capacity_swa=None,
            target_graph_memory_usage={},
            draft_graph_memory_usage=None,
        )
        state.pop("custom_sigquit_handler", None)
        return GetInternalStateReqOutput(internal_state=msgspec_to_builtins(state))

    def publish_load(self) -> None:
        from sglang.srt.managers.load_snapshot import LoadSnapshot, QueueMetrics

        used = sum(len(r.origin_input_ids) + len(r.output_ids) for r in self.running)
        self.load_writer.write(
            LoadSnapshot(
                timestamp=time.time(),
                dp_rank=0,
                num_running_reqs=len(self.running),
                num_waiting_reqs=0,
                num_used_tokens=used,
                num_total_tokens=used,
                num_active_tokens=used,
                max_total_num_tokens=self.max_total_num_tokens,
                max_running_requests=256,
                token_usage=round(used / self.max_total_num_tokens, 4),
                total_prefill_uncached_tokens=self.total_prefill_uncached,
                decode_moments=list(self.decode_moments) if self.decode_moments[0] > 0 else None,
                queues=QueueMetrics(waiting=0, grammar=0, paused=0, retracted=0, prealloc_ready=0),
            )
        )


class _NoTreeCache:
    cache_controller = None


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def serve(model: str, port: int, extra: list[str]) -> None:
    """sglang's `launch_server` (blocks), with the stand-in scheduler process."""
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(
        ["--model-path", model, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
         "--skip-server-warmup", "--log-level", "warning", *extra]
    )  # fmt: skip
    launch_server(args, run_scheduler_process_func=run_standin_scheduler)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="sglang's server with a stand-in scheduler")
    p.add_argument("--model", required=True, help="a model directory (config.json and a tokenizer)")
    p.add_argument("--port", type=int, required=True)
    a, extra = p.parse_known_args(argv)
    serve(a.model, a.port, extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
