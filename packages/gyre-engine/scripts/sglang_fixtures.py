"""Record what SGLang 0.5.23's own HTTP layer sends, as JSON fixtures gyre's parsers are tested against.

SGLang cannot serve without its GPU kernels, so this runs sglang's real server with its scheduler process
replaced by the stand-in in `sglang_standin.py` (next to this script; it says which parts are sglang's
code and which are the stand-in's), sends the requests of `CASES` over HTTP, and writes one JSON file per
case into `--out`:

    {"case", "sglang", "request": {"method", "path", "body"}, "status", "content_type",
     "body": <JSON reply, or null>, "text": <reply text when not JSON>,
     "events": [<each parsed `data:` event of a stream; "[DONE]" as the string>]}

Run it in a venv that has sglang (gyre-engine's `sglang` extra, pinned to 0.5.23; about 11 GB):

    uv venv .venv-sglang --python 3.12
    VIRTUAL_ENV=.venv-sglang uv pip install -e 'packages/gyre-engine[sglang]'
    .venv-sglang/bin/python packages/gyre-engine/scripts/sglang_fixtures.py \\
        --out packages/gyre-engine/tests/fixtures/sglang-0.5.23

The model directory (config and tokenizer only are read) is gyre's tiny model, made with
`gyre_engine.server.model_factory.create_model`, so the fixtures' token ids are that tokenizer's.
Timestamps, latencies, ids and paths are kept as sent; tests must not depend on their values.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
SGLANG_VERSION = "0.5.23"
CONTEXT = 128
API_KEY = "gyre-fixture-api-key-0123456789"
"""The server's `--api-key` (a fixed test value, not a secret): every case sends it as a bearer token
unless it sets its own headers, so the cases of a missing or wrong key show SGLang's answer to those."""
SERVER_ARGS = ["--context-length", str(CONTEXT), "--api-key", API_KEY]
"""sglang server arguments: a short context keeps the too-long-input cases small. (SGLang refuses a request
whose input plus `max_new_tokens` exceeds the context, so every case asks for less.)"""
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [101, 102, 103, 104, 105, 106, 107, 108]
"""Input ids of most cases (the stand-in's output does not depend on them)."""


@dataclass
class Case:
    name: str
    path: str
    body: Any = None
    method: str = "POST"
    stream: bool = False
    then: Callable[[httpx.Client, list[Any]], None] | None = None
    """Called with the events so far after each streamed event (e.g. to abort mid-stream)."""
    doc: str = ""
    headers: dict[str, str] | None = None
    """Request headers instead of the bearer token of `API_KEY` (None: send that token)."""
    raw: bytes | None = None
    """A body sent as these bytes (with `Content-Type: application/json`) instead of `body` as JSON."""


@dataclass
class Recorded:
    case: Case
    status: int
    content_type: str
    body: Any
    text: str | None
    events: list[Any] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "case": self.case.name,
            "doc": self.case.doc,
            "sglang": SGLANG_VERSION,
            "request": self._request(),
            "status": self.status,
            "content_type": self.content_type,
            "body": self.body,
            "text": self.text,
        }
        if self.case.stream:
            out["events"] = self.events
        return out

    def _request(self) -> dict[str, Any]:
        req: dict[str, Any] = {"method": self.case.method, "path": self.case.path, "body": self.case.body}
        if self.case.raw is not None:
            req["raw"] = self.case.raw.decode()
        if self.case.headers is not None:
            req["headers"] = self.case.headers
        return req


def _gen(**kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 64}}
    sp = kw.pop("sampling_params", None)
    if sp is not None:
        body["sampling_params"] = sp
    body.update(kw)
    return body


def _abort_after(n: int) -> Callable[[httpx.Client, list[Any]], None]:
    def then(c: httpx.Client, events: list[Any]) -> None:
        if len(events) == n and isinstance(events[-1], dict):
            rid = events[-1]["meta_info"]["id"]
            c.post("/abort_request", json={"rid": rid}, headers=AUTH)

    return then


LONG = {"max_new_tokens": 100, "ignore_eos": True}
PROXY_SP = {"max_new_tokens": 48, "temperature": 1.0, "top_p": 1.0, "skip_special_tokens": False,
            "no_stop_trim": True, "stream_interval": 4}  # fmt: skip

CASES: list[Case] = [
    # ---- streaming /generate
    Case("stream_default", "/generate", _gen(stream=True, return_logprob=True), stream=True,
         doc="cumulative chunks, one per token; finishes on EOS (matched: the EOS id)"),
    Case("stream_no_logprob", "/generate", _gen(stream=True), stream=True,
         doc="cumulative chunks without logprobs"),
    Case("stream_interval", "/generate",
         _gen(stream=True, return_logprob=True, sampling_params={"max_new_tokens": 11, "stream_interval": 4}),
         stream=True, doc="stream_interval 4: the first token at once, then every 4; finishes by length"),
    Case("stream_stop_string", "/generate",
         _gen(stream=True, return_logprob=True, sampling_params={"max_new_tokens": 64, "stop": ["thanks"]}),
         stream=True, doc="a chunk is held back while its tail could start the stop string; text trimmed"),
    Case("stream_stop_string_no_trim", "/generate",
         _gen(stream=True, sampling_params={"max_new_tokens": 64, "stop": "Goodbye", "no_stop_trim": True}),
         stream=True, doc="no_stop_trim: the text keeps the stop string"),
    Case("stream_abort", "/generate",
         _gen(stream=True, return_logprob=True, rid="gyre-abort-me", sampling_params=LONG), stream=True,
         then=_abort_after(3), doc="/abort_request after the third chunk: a finish of type abort"),
    # what gyre-proxy sends (stream_interval 4, no_stop_trim, special tokens kept, logprobs)
    Case("stream_proxy_request", "/generate",
         _gen(stream=True, return_logprob=True, sampling_params=PROXY_SP), stream=True,
         doc="gyre-proxy's request shape: chunks every 4 tokens, ends on EOS"),
    Case("stream_proxy_stop", "/generate",
         _gen(stream=True, return_logprob=True, sampling_params={**PROXY_SP, "stop": ["thanks"]}),
         stream=True, doc="gyre-proxy's request with a stop sequence (kept in the text: no_stop_trim)"),
    Case("stream_proxy_length", "/generate",
         _gen(stream=True, return_logprob=True, sampling_params={**PROXY_SP, "max_new_tokens": 10}),
         stream=True, doc="gyre-proxy's request cut by max_new_tokens"),
    Case("stream_top_logprobs", "/generate",
         _gen(stream=True, return_logprob=True, top_logprobs_num=3, token_ids_logprob=[5, 9],
              sampling_params={"max_new_tokens": 5}),
         stream=True, doc="top logprobs and token_ids_logprob on each chunk"),
    Case("stream_error_too_long", "/generate",
         {"input_ids": [7] * CONTEXT, "sampling_params": {"max_new_tokens": 4}, "stream": True}, stream=True,
         doc="a request refused after the stream began: an in-band error event"),
    # ---- non-streaming /generate
    Case("generate_logprobs", "/generate",
         _gen(return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True), doc="with logprobs"),
    Case("generate_token_ids_logprob", "/generate",
         _gen(return_logprob=True, token_ids_logprob=[5, 9, 553], sampling_params={"max_new_tokens": 6}),
         doc="token_ids_logprob: logprobs of the given ids at every output position"),
    Case("generate_stop_token_id", "/generate",
         _gen(return_logprob=True, sampling_params={"max_new_tokens": 64, "stop_token_ids": [28]}),
         doc="a stop token id (matched: an int); output_ids keep it"),
    Case("generate_stop_string", "/generate",
         _gen(return_logprob=True, sampling_params={"max_new_tokens": 64, "stop": ["thanks", "zzz"]}),
         doc="a stop string: text cut before it, output_ids through it"),
    Case("generate_nulls", "/generate",
         _gen(return_logprob=None, sampling_params={"max_new_tokens": None, "temperature": None, "stop": None}),
         doc="null for max_new_tokens, temperature, return_logprob: accepted (no length limit)"),
    Case("generate_batch", "/generate",
         {"input_ids": [PROMPT, PROMPT[:4]], "sampling_params": {"max_new_tokens": 3},
          "return_logprob": [True, False]},
         doc="a batch with per-request return_logprob"),
    Case("generate_text", "/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 4}},
         doc="text input"),
    Case("generate_cached", "/generate",
         {"input_ids": PROMPT + [1] * 4, "sampling_params": {"max_new_tokens": 2}},
         doc="a prompt extending an earlier one: cached_tokens"),
    Case("error_unknown_sampling_key", "/generate",
         _gen(sampling_params={"max_new_tokens": 4, "bogus_key": 1}), doc="schema error: {'error': str}"),
    Case("error_no_input", "/generate", {"sampling_params": {"max_new_tokens": 4}}, doc="no input"),
    Case("error_too_long", "/generate",
         {"input_ids": [7] * CONTEXT, "sampling_params": {"max_new_tokens": 4}}, doc="longer than the context"),
    Case("error_token_ids_logprob_out_of_vocab", "/generate",
         _gen(return_logprob=True, token_ids_logprob=[5, 99999]), doc="an id outside the vocabulary"),
    Case("error_bad_temperature", "/generate",
         _gen(sampling_params={"max_new_tokens": 4, "temperature": -1}), doc="a value verify() refuses"),
    # ---- control and info
    Case("model_info", "/model_info", method="GET"),
    Case("get_model_info", "/get_model_info", method="GET"),
    Case("server_info", "/server_info", method="GET"),
    Case("get_server_info", "/get_server_info", method="GET"),
    Case("loads_idle", "/v1/loads", method="GET", doc="load snapshots, nothing running"),
    Case("health", "/health", method="GET"),
    Case("health_generate", "/health_generate", method="GET"),
    Case("ready", "/ready", method="GET"),
    Case("flush_cache", "/flush_cache"),
    Case("abort_unknown_rid", "/abort_request", {"rid": "no-such-request"}),
    Case("update_distributed_outside_session", "/update_weights_from_distributed",
         {"names": ["lm_head.weight"], "dtypes": ["bfloat16"], "shapes": [[2048, 64]], "group_name": "g"},
         doc="refused: updates must run between begin_weight_update and end_weight_update"),
    Case("update_tensor_outside_session", "/update_weights_from_tensor",
         {"serialized_named_tensors": [], "load_format": None}),
    Case("end_weight_update_without_begin", "/end_weight_update", {}),
    Case("begin_weight_update", "/begin_weight_update", {}),
    Case("begin_weight_update_twice", "/begin_weight_update", {}),
    Case("end_weight_update", "/end_weight_update", {}),
    # ---- the API key (SGLang's `--api-key`: a bearer token on every path but the health probes)
    Case("unauthorized_no_key", "/generate", _gen(), headers={}, doc="no Authorization header: 401"),
    Case("unauthorized_wrong_key", "/generate", _gen(), headers={"Authorization": "Bearer not-the-key"},
         doc="a wrong bearer token: 401"),
    Case("unauthorized_not_bearer", "/generate", _gen(), headers={"Authorization": API_KEY},
         doc="the key without the Bearer scheme: 401"),
    Case("unauthorized_control", "/pause_generation", {}, headers={}, doc="a control call without a key"),
    Case("unauthorized_unknown_route", "/no_such_route", {}, headers={},
         doc="an unknown path without a key: the key is checked before routing"),
    Case("health_no_key", "/health", method="GET", headers={}, doc="health probes need no key"),
    Case("health_generate_no_key", "/health_generate", method="GET", headers={},
         doc="health probes need no key"),
    # ---- routing and body errors
    Case("unknown_route", "/no_such_route", {}, doc="an unknown path (with the key)"),
    Case("unknown_route_get", "/no_such_route", method="GET", doc="an unknown path, GET"),
    Case("wrong_method_generate", "/generate", method="GET", doc="GET on a POST-only path"),
    Case("wrong_method_model_info", "/model_info", {}, doc="POST on a GET-only path"),
    Case("error_malformed_json", "/generate", raw=b'{"input_ids": [1, 2', doc="a body that is not JSON"),
    Case("error_wrong_type", "/generate", {"input_ids": "not a list", "sampling_params": {}},
         doc="input_ids of the wrong type"),
]  # fmt: skip


def record(c: httpx.Client, case: Case) -> Recorded:
    headers = AUTH if case.headers is None else case.headers
    if not case.stream:
        if case.raw is not None:
            kw: dict[str, Any] = {
                "content": case.raw,
                "headers": {**headers, "content-type": "application/json"},
            }
        elif case.body is not None:
            kw = {"json": case.body, "headers": headers}
        else:
            kw = {"headers": headers}
        r = c.request(case.method, case.path, **kw)
        ct = r.headers.get("content-type", "")
        try:
            body, text = r.json(), None
        except ValueError:
            body, text = None, r.text
        return Recorded(case, r.status_code, ct, body, text)
    events: list[Any] = []
    with c.stream(case.method, case.path, json=case.body, headers=headers) as r:
        ct = r.headers.get("content-type", "")
        if r.status_code >= 400 or not ct.startswith("text/event-stream"):
            raw = r.read().decode()
            try:
                return Recorded(case, r.status_code, ct, json.loads(raw), None)
            except ValueError:
                return Recorded(case, r.status_code, ct, None, raw)
        raw_lines: list[str] = []
        for line in r.iter_lines():
            raw_lines.append(line)
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            events.append(data if data == "[DONE]" else json.loads(data))
            if case.then is not None:
                case.then(c, events)
    return Recorded(case, r.status_code, ct, None, "\n".join(raw_lines) + "\n", events)


def load_while_running(c: httpx.Client) -> Recorded:
    """/v1/loads while a long request runs (sampled from another thread)."""
    done = threading.Event()

    def long_request() -> None:
        with httpx.Client(base_url=str(c.base_url), timeout=60, headers=AUTH) as c2:
            body = _gen(
                stream=True,
                rid="gyre-load-probe",
                sampling_params={"max_new_tokens": 100, "ignore_eos": True},
            )
            with c2.stream("POST", "/generate", json=body) as r:
                for line in r.iter_lines():
                    if done.is_set() and line.startswith("data:"):
                        c2.post("/abort_request", json={"rid": "gyre-load-probe"})
                        done.clear()

    t = threading.Thread(target=long_request, daemon=True)
    t.start()
    case = Case("loads_busy", "/v1/loads", method="GET", doc="load snapshots while a request runs")
    deadline = time.monotonic() + 30
    rec = record(c, case)
    while rec.body["loads"][0].get("num_running_reqs", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
        rec = record(c, case)
    done.set()
    t.join(30)
    return rec


def wait_up(c: httpx.Client, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sglang server exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        try:
            if c.get("/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"sglang server not up after {timeout_s:g} s:\n{log.read_text()[-4000:]}")


def manifest(model: str) -> dict[str, Any]:
    """What the fixtures were made from, so a test can tell stale fixtures from a broken parser."""
    import hashlib

    tok = Path(model) / "tokenizer.json"
    standin = HERE / "sglang_standin.py"
    sys.path.insert(0, str(HERE))
    from sglang_standin import TEXT

    return {
        "sglang": SGLANG_VERSION,
        "recorded": time.strftime("%Y-%m-%d"),
        "script": "packages/gyre-engine/scripts/sglang_fixtures.py",
        "standin_sha256": hashlib.sha256(standin.read_bytes()).hexdigest(),
        "tokenizer_sha256": hashlib.sha256(tok.read_bytes()).hexdigest(),
        "standin_text": TEXT,
        "prompt": PROMPT,
        "server_args": SERVER_ARGS,
        "cases": {c.name: c.doc for c in CASES},
    }


def record_all(url: str, out: Path, proc: subprocess.Popen[bytes], log: Path, model: str) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "MANIFEST.json").write_text(json.dumps(manifest(model), indent=1) + "\n")
    written = []
    with httpx.Client(base_url=url, timeout=120) as c:
        wait_up(c, proc, log)
        recs = [record(c, case) for case in CASES]
        recs.append(load_while_running(c))
    for rec in recs:
        path = out / f"{rec.case.name}.json"
        path.write_text(json.dumps(rec.as_json(), indent=1) + "\n")
        written.append(path.name)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="fixture directory to write")
    p.add_argument("--model", help="a model directory; default: gyre's tiny model, made in a temp dir")
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or _tiny_model(Path(tmp) / "model")
        port = a.port or _free_port()
        log = Path(tmp) / "server.log"
        with open(log, "w") as fh:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    str(HERE / "sglang_standin.py"),
                    "--model",
                    model,
                    "--port",
                    str(port),
                    *SERVER_ARGS,
                ],
                stdout=fh,
                stderr=subprocess.STDOUT,
            )
        try:
            names = record_all(f"http://127.0.0.1:{port}", a.out, proc, log, model)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(f"wrote {len(names)} fixtures to {a.out}")
    return 0


def _tiny_model(out: Path) -> str:
    from gyre_engine.server.model_factory import create_model

    return str(create_model(out, "tiny"))


def _free_port() -> int:
    from gyre_base.ports import free_port

    return free_port()


if __name__ == "__main__":
    sys.exit(main())
