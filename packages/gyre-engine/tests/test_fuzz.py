"""Fuzzing every gyre-engine endpoint with hypothesis against a real `gyre-engine serve` process
with a run token and 2 MiB body bounds.

Each case is a batch of 1-5 concurrent requests to any route of `routes.ROUTES` (or an unknown one, or a
wrong method): bodies of wrong types, nulls, huge numbers, huge and odd strings, batches, bad `input_ids`,
hostile sampling parameters, streaming and not, bytes that are not JSON, bodies past the bound, missing
or wrong tokens; each client waits for its answer, or leaves after a drawn delay (from at once to
mid-generation), or gives up after `CLIENT_CAP_S`. Every answer must be below 500 and every refusal in
one of SGLang's error shapes (`sglang_error`), with two answers that are correct and not faults: a health
probe's 503 while generation is paused (SGLang's empty 503), and 502 / 504 from the endpoints that dial
a peer named in the body (`/init_weights_update_group`, `/update_weights_from_xfer`) when that peer is not
there. Those are counted and printed. After each batch, the state a batch may have left (paused, a
weight-update session, released memory) is ended as an operator would, then: no generation may be left
in the engine (abandoned: 0), a good request must be answered, and the process must be alive.

The fuzzer does not ask the engine to wait long for a peer (valid timeouts it draws are under a second)
or to open Mooncake (whose ports listen on every interface): both are an operator's legitimate requests,
which the engine honours.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from gyre_base.testing import free_port
from gyre_base.token import bearer
from gyre_engine.protocol import SAMPLING_KEYS
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))  # the shared helpers (tests run with --import-mode=importlib)
from routes import ROUTES  # noqa: E402

TOKEN = "engine-fuzz-token-0123456789abcdef"
BATCHES = 300
"""Cases in the default run; the `long` run fuzzes `LONG_BATCHES`."""
LONG_BATCHES = 1000
CLIENT_CAP_S = 2.0
"""A client that has not been answered by then leaves (counted)."""
IDLE_WAIT_S = 30.0
BODY_LIMIT_MB = 2
USER = [1200 + i * 7 for i in range(9)]
DIALING = {"/init_weights_update_group", "/update_weights_from_xfer", "/import_prefix_xfer"}
HEALTH = {"/health", "/health_generate", "/ready"}


CLOSED = free_port()  # nobody listens there

# ---- values -------------------------------------------------------------------------------------------

huge_ints = st.sampled_from([-(2**63), 2**63 - 1, 2**63, 2**64, -(2**64), 10**30, -(10**30), 2**31, -1, 0])
numbers = st.one_of(
    st.integers(-1000, 1000),
    huge_ints,
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e308, -1e308, 5e-324, -0.0, 0.5, 1.5]),
)
odd_text = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["", " ", "\x00", "\ud800", "<|im_end|>", "<|im_start|>user\n", "\u202e", "é" * 50]),
    st.sampled_from([10_000, 300_000]).map(lambda n: "ab\u00e9 " * (n // 4)),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, odd_text)
anything = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
token_ids = st.integers(0, 2047)
good_ids = st.lists(token_ids, min_size=1, max_size=24)
bad_ids = st.one_of(
    st.lists(
        st.one_of(token_ids, huge_ints, st.integers(-5, -1), st.floats(), st.text(max_size=3)), max_size=8
    ),
    st.just([]),
    st.lists(st.lists(token_ids, max_size=4), min_size=1, max_size=3),  # a batch
    st.just([[1, 2], 3]),
    st.just([[]]),
    st.sampled_from([40_960, 50_000]).map(lambda n: [7] * n),  # at and past the context
    anything,
)

# ---- /generate ----------------------------------------------------------------------------------------

plausible_sampling = st.fixed_dictionaries(
    {},
    optional={
        "max_new_tokens": st.one_of(st.integers(0, 12), st.none(), huge_ints, st.integers(-3, -1)),
        "temperature": st.one_of(st.sampled_from([0.0, 0.7, 1.0]), numbers),
        "top_p": st.one_of(st.sampled_from([0.5, 1.0]), numbers),
        "top_k": st.one_of(st.sampled_from([-1, 1, 5]), huge_ints),
        "min_p": numbers,
        "frequency_penalty": numbers,
        "presence_penalty": numbers,
        "repetition_penalty": numbers,
        "min_new_tokens": st.one_of(st.integers(0, 4), huge_ints),
        "stop": st.one_of(st.none(), odd_text, st.lists(odd_text, max_size=3)),
        "stop_token_ids": st.one_of(st.none(), st.lists(st.one_of(token_ids, huge_ints), max_size=3)),
        "stop_regex": st.one_of(st.none(), st.sampled_from(["a+", "(", "(a*)*b", "[", "x{99999}"]), odd_text),
        "ignore_eos": st.one_of(st.booleans(), anything),
        "skip_special_tokens": st.booleans(),
        "no_stop_trim": st.booleans(),
        "stream_interval": st.one_of(st.none(), st.integers(-2, 5), huge_ints),
        "logit_bias": st.one_of(
            st.none(),
            st.dictionaries(st.one_of(st.integers(-3, 3000).map(str), odd_text), numbers, max_size=3),
        ),
        "sampling_seed": st.one_of(st.none(), st.integers(-5, 5), huge_ints),
        "n": st.one_of(st.integers(0, 3), huge_ints),
        "regex": st.just("a+"),
        "json_schema": st.just("{}"),
        "beam_width": st.integers(0, 3),
        "custom_params": anything,
    },
)
sampling = st.one_of(
    plausible_sampling,
    st.dictionaries(st.sampled_from([*SAMPLING_KEYS, "bogus", ""]), anything, max_size=4),
    anything,
)
plausible_generate = st.fixed_dictionaries(
    {
        "input_ids": st.one_of(good_ids, good_ids, st.lists(good_ids, min_size=1, max_size=3)),
        "sampling_params": plausible_sampling,
    },
    optional={
        "stream": st.booleans(),
        "return_logprob": st.booleans(),
        "top_logprobs_num": st.integers(0, 5),
        "token_ids_logprob": st.lists(token_ids, max_size=3),
        "rid": st.text(min_size=1, max_size=4),
        "return_text_in_logprobs": st.booleans(),
    },
)
hostile_generate = st.fixed_dictionaries(
    {},
    optional={
        "input_ids": st.one_of(good_ids, good_ids, bad_ids),
        "text": odd_text,
        "sampling_params": st.one_of(sampling, st.lists(sampling, max_size=3)),
        "rid": st.one_of(st.text(max_size=6), st.lists(st.text(max_size=3), max_size=3), anything),
        "return_logprob": st.one_of(st.booleans(), st.lists(st.booleans(), max_size=3), anything),
        "logprob_start_len": st.one_of(st.integers(-2, 3), huge_ints, anything),
        "top_logprobs_num": st.one_of(st.integers(-1, 70), huge_ints, anything),
        "token_ids_logprob": st.one_of(st.lists(st.one_of(token_ids, huge_ints), max_size=4), anything),
        "return_text_in_logprobs": st.one_of(st.booleans(), anything),
        "stream": st.one_of(st.booleans(), st.booleans(), anything),
        "bogus_field": anything,
    },
)

# ---- the control endpoints: their own keys with hostile or plausible values ----------------------------

seconds = st.one_of(st.floats(0.05, 0.5), st.sampled_from([0, -1, -1e9, 1e9, 86401]), odd_text, st.none())
control_bodies: dict[str, Any] = {
    "/abort_request": st.fixed_dictionaries({}, optional={"rid": anything, "abort_all": anything}),
    "/pause_generation": st.fixed_dictionaries(
        {}, optional={"mode": st.one_of(st.sampled_from(["abort", "retract", "in_place"]), anything)}
    ),
    "/continue_generation": st.fixed_dictionaries({}, optional={"torch_empty_cache": anything}),
    "/begin_weight_update": st.fixed_dictionaries({}, optional={"selector": anything}),
    "/end_weight_update": st.just({}),
    "/update_weights_from_tensor": st.fixed_dictionaries(
        {},
        optional={
            "serialized_named_tensors": st.one_of(st.lists(odd_text, max_size=2), anything),
            "load_format": st.one_of(
                st.sampled_from(["safetensors", "direct", "flattened_bucket"]), anything
            ),
            "weight_version": anything,
            "flush_cache": anything,
        },
    ),
    "/update_weights_from_disk": st.fixed_dictionaries(
        {}, optional={"model_path": st.one_of(odd_text, st.sampled_from(["/", "/tmp", "/nonexistent"]))}
    ),
    "/init_weights_update_group": st.fixed_dictionaries(
        {},
        optional={
            "master_address": st.sampled_from(["127.0.0.1", "", "::1", "not an address", "999.1.1.1"]),
            "master_port": st.one_of(st.just(CLOSED), st.integers(-1, 70000), huge_ints),
            "rank_offset": st.one_of(st.integers(-1, 3), huge_ints),
            "world_size": st.one_of(st.integers(-1, 3), huge_ints),
            "group_name": odd_text,
            "backend": st.sampled_from(["gloo", "nccl", "mpi", ""]),
            "timeout_s": seconds,
        },
    ),
    "/update_weights_from_distributed": st.fixed_dictionaries(
        {},
        optional={
            "names": st.lists(odd_text, max_size=3),
            "dtypes": st.lists(st.sampled_from(["float32", "bfloat16", "int8", "nope", ""]), max_size=3),
            "shapes": st.lists(st.lists(st.one_of(st.integers(-2, 64), huge_ints), max_size=3), max_size=3),
            "group_name": odd_text,
            "load_format": anything,
        },
    ),
    "/destroy_weights_update_group": st.fixed_dictionaries({}, optional={"group_name": anything}),
    "/release_memory_occupation": st.fixed_dictionaries(
        {},
        optional={
            "tags": st.one_of(st.none(), st.lists(st.sampled_from(["weights", "kv_cache", "x"])), anything)
        },
    ),
    "/resume_memory_occupation": st.fixed_dictionaries({}, optional={"tags": anything}),
    "/export_prefix": st.fixed_dictionaries({}, optional={"input_ids": st.one_of(st.just(USER), bad_ids)}),
    "/get_weights_by_name": st.fixed_dictionaries(
        {},
        optional={
            "name": st.one_of(st.sampled_from(["model.norm.weight", "lm_head.weight"]), odd_text, anything),
            "truncate_size": st.one_of(st.integers(-3, 3), huge_ints, anything),
        },
    ),
    "/update_weights_from_xfer": st.fixed_dictionaries(
        {},
        optional={
            "publisher": st.one_of(st.just(f"tcp://127.0.0.1:{CLOSED}"), odd_text),
            "min_version": st.one_of(st.integers(-1, 3), huge_ints),
            "transport": st.one_of(st.just("shm"), odd_text),
            "timeout_s": seconds,
            "control_timeout_s": seconds,
            "layout": st.one_of(st.sampled_from(["transformers", "megatron"]), anything),
        },
    ),
    "/offer_prefix": st.fixed_dictionaries(
        {},
        optional={
            "input_ids": st.one_of(st.just(USER), bad_ids),
            "transport": st.one_of(st.just("shm"), odd_text),
            "block_tokens": st.one_of(st.integers(-1, 20), huge_ints),
            "lease_s": seconds,
        },
    ),
    "/import_prefix_xfer": st.fixed_dictionaries(
        {}, optional={"offer": st.one_of(anything, st.just({"offer_id": "x"})), "timeout_s": seconds}
    ),
    "/release_prefix_offer": st.fixed_dictionaries(
        {}, optional={"offer_id": anything, "arrived": anything, "failed": anything}
    ),
}


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    body: bytes | None
    headers: dict[str, str]
    leave_after: float | None
    """Seconds after which the client leaves (None: it waits up to CLIENT_CAP_S)."""


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=True).encode("utf-8", "surrogatepass")


raw_bodies = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"", b"null", b"[]", b"{", b'{"a": 1}{', b"\xff\xfe", b'{"input_ids": [1, 2']),
    st.just(b'{"text": "' + b"x" * (BODY_LIMIT_MB * (1 << 20) + 10) + b'"}'),  # past the bound
)


@st.composite
def calls(draw: st.DrawFn) -> Call:
    route = draw(st.sampled_from([*["/generate"] * 12, *(p for p, _ in ROUTES), "/no_such_route"]))
    methods = dict(ROUTES).get(route, ("POST",))
    any_method = st.sampled_from(["GET", "POST", "PUT", "DELETE"])
    method = draw(any_method if draw(st.integers(0, 9)) == 0 else st.sampled_from(methods))
    if route == "/generate":
        shape = st.one_of(plausible_generate, hostile_generate)
    elif route == "/import_prefix":
        shape = st.one_of(st.binary(max_size=256), anything)
    else:
        shape = control_bodies.get(route, st.one_of(st.just({}), anything))
    encoded = shape.map(lambda b: b if isinstance(b, bytes) else _encode(b))
    kind = draw(st.integers(0, 9))
    body = draw(encoded if kind < 8 else raw_bodies if kind == 8 else st.none())
    wrong = [{}, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": TOKEN}]
    auth = draw(st.sampled_from([bearer(TOKEN)] * 27 + wrong))
    leave = draw(st.sampled_from([None, None, None, 0.0, 0.01, 0.1, 0.5]))
    return Call(method, route, body if method != "GET" else None, auth, leave)


# ---- checks -------------------------------------------------------------------------------------------


def sglang_error(status: int, path: str, content_type: str, body: bytes) -> bool:
    """Whether an error reply is in one of the shapes SGLang 0.5.23 answers with."""
    if status == 503 and path in HEALTH:
        return body == b""  # SGLang's unhealthy probe: an empty 503
    if path == "/flush_cache" and status == 400 and content_type.startswith("text/plain"):
        return bool(body)  # SGLang's own: "Flush cache failed." as text
    if not content_type.startswith("application/json"):
        return False
    obj = json.loads(body)
    if not isinstance(obj, dict):
        return False
    if set(obj) == {"error"}:
        err = obj["error"]
        if isinstance(err, str):  # a schema error, or 401 "Unauthorized"
            return bool(err)
        return isinstance(err, dict) and isinstance(err.get("message"), str) and err.get("code") == status
    if obj.get("object") == "error":  # FastAPI's validation error as SGLang words it
        return isinstance(obj.get("message"), str) and obj.get("code") == status == 400
    if set(obj) == {"detail"}:  # an unknown path or method
        return status in (404, 405) and isinstance(obj["detail"], str)
    return obj.get("success") is False and isinstance(obj.get("message"), str)  # a refused control call


def allowed_5xx(status: int, path: str) -> bool:
    return (status == 503 and path in HEALTH) or (status in (502, 504) and path in DIALING)


@dataclass
class Tally:
    answered: Counter[int]
    left: int = 0
    capped: int = 0
    expected_5xx: int = 0


async def send(h: httpx.AsyncClient, c: Call, url: str, tally: Tally) -> None:
    async def exchange() -> None:
        headers = {**c.headers, "content-type": "application/json"}
        async with h.stream(c.method, f"{url}{c.path}", content=c.body, headers=headers) as r:
            raw = b""
            async for part in r.aiter_bytes():
                raw += part
        ct = r.headers.get("content-type", "")
        tally.answered[r.status_code] += 1
        if r.status_code >= 500:
            assert allowed_5xx(r.status_code, c.path), (c, r.status_code, raw[:500])
            tally.expected_5xx += 1
        if r.status_code >= 400:
            assert sglang_error(r.status_code, c.path, ct, raw), (c, r.status_code, raw[:500])
        elif ct.startswith("text/event-stream"):
            check_stream(raw)
        elif c.path == "/generate":
            obj = json.loads(raw)
            for res in obj if isinstance(obj, list) else [obj]:
                check_finish(res)

    if c.leave_after is not None:
        try:
            await asyncio.wait_for(exchange(), c.leave_after)
        except TimeoutError:
            tally.left += 1
        return
    try:
        await asyncio.wait_for(exchange(), CLIENT_CAP_S)
    except TimeoutError:
        tally.capped += 1


def check_finish(res: dict[str, Any]) -> None:
    """A generation that ended by an engine fault (an abort with a 5xx status) is a 5xx in disguise."""
    assert isinstance(res["output_ids"], list), res
    fin = res["meta_info"].get("finish_reason")  # absent (null) on chunks before the last
    assert fin is None or (fin.get("status_code") or 0) < 500, fin


def check_stream(raw: bytes) -> None:
    events = [line[5:].strip() for line in raw.decode().split("\n") if line.startswith("data:")]
    assert events and events[-1] == "[DONE]", raw[-300:]
    for ev in events[:-1]:
        obj = json.loads(ev)
        if "error" in obj:  # reported in-band once the stream began: a refusal, never a fault
            assert isinstance(obj["error"]["message"], str) and 400 <= obj["error"]["code"] < 500, obj
        else:
            check_finish(obj)


STATEFUL = {"/pause_generation", "/begin_weight_update", "/release_memory_occupation"}


async def after_batch(h: httpx.AsyncClient, url: str, batch: list[Call]) -> int:
    """End what a batch may have left (as an operator would), wait until no generation remains, and
    require a good answer; returns the generations still in the engine after IDLE_WAIT_S."""
    auth = bearer(TOKEN)
    if any(c.path in STATEFUL for c in batch):
        for path in ("/continue_generation", "/end_weight_update", "/resume_memory_occupation"):
            await h.post(f"{url}{path}", json={}, headers=auth)
    left = -1
    for _ in range(int(IDLE_WAIT_S / 0.05)):
        info = (await h.get(f"{url}/server_info", headers=auth)).json()
        left = info["running_requests"] + info["waiting_requests"]
        if left == 0:
            break
        await asyncio.sleep(0.05)
    good = {"input_ids": USER, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    r = await h.post(f"{url}/generate", json=good, headers=auth)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2, r.text
    return left


_GEN = _encode({"input_ids": USER, "sampling_params": {"max_new_tokens": 64}})


def _sampled(extra: dict[str, Any]) -> dict[str, Any]:
    return {"input_ids": USER, "sampling_params": {"max_new_tokens": 4, "temperature": 0.7, **extra}}


FOUND: list[list[Call]] = [
    # clients that leave while their requests wait for admission: the engine thread died setting the
    # result of a call the server had cancelled (every later request: 409 "engine thread is not running")
    [Call("POST", "/generate", _GEN, bearer(TOKEN), 0.0) for _ in range(5)],
    # a model_path too long for the file system: a 500 (OSError) instead of a 400
    [
        Call(
            "POST",
            "/update_weights_from_disk",
            _encode({"model_path": "ab\u00e9 " * 2500}),
            bearer(TOKEN),
            None,
        )
    ],
    # a top_k past the vocabulary, and past 2^63: the engine thread died in `sample` (an index out of
    # range; an overflow making a tensor of it), taking the server down
    [
        Call("POST", "/generate", _encode(_sampled({"top_k": k})), bearer(TOKEN), None)
        for k in (2**31, 2**63, 2**64)
    ],
    # a logit_bias key `int()` reads but that is no ASCII token id: '\u00b2' raised a bare ValueError (500)
    [Call("POST", "/generate", _encode(_sampled({"logit_bias": {"\u00b2": 1.0}})), bearer(TOKEN), None)],
    # a prefix asked for by ids past int64: the prefix cache's lookup raised OverflowError (500)
    [
        Call("POST", path, _encode({"input_ids": [2**63]}), bearer(TOKEN), None)
        for path in ("/export_prefix", "/offer_prefix")
    ],
]
"""Batches that found bugs, run first every time."""


@pytest.fixture(scope="module")
def fuzz_server(spawn_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text(TOKEN)
    return spawn_server(
        "--token-file", str(path), "--max-body-mb", str(BODY_LIMIT_MB), "--max-bulk-body-mb", "4"
    )


@pytest.mark.fuzz
@pytest.mark.slow
def test_every_endpoint_fuzz_300_batches(fuzz_server: Any) -> None:
    """300 cases, each a batch of 1-5 concurrent calls (about 900 requests in all): 0 answers of 500 or
    more but the two kinds the module docstring names, every refusal in SGLang's error shape, 0 abandoned
    generations after every batch, a good request answered after every batch, the process alive."""
    _fuzz_every_endpoint(fuzz_server, BATCHES)


@pytest.mark.fuzz
@pytest.mark.long
def test_every_endpoint_fuzz_1000_batches(fuzz_server: Any) -> None:
    """The same with 1,000 cases (about 3,000 requests)."""
    _fuzz_every_endpoint(fuzz_server, LONG_BATCHES)


def _fuzz_every_endpoint(fuzz_server: Any, batches: int) -> None:
    url = fuzz_server.url
    tally = Tally(Counter())
    abandoned: list[int] = []
    loop = asyncio.new_event_loop()
    h = httpx.AsyncClient(timeout=httpx.Timeout(CLIENT_CAP_S + 60, connect=10))
    try:

        @settings(
            max_examples=batches,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate, Phase.shrink],
            suppress_health_check=[
                HealthCheck.too_slow,
                HealthCheck.data_too_large,
                HealthCheck.large_base_example,
            ],
        )
        @given(st.lists(calls(), min_size=1, max_size=5))
        @example(FOUND[0])
        @example(FOUND[1])
        @example(FOUND[2])
        @example(FOUND[3])
        @example(FOUND[4])
        def case(batch: list[Call]) -> None:
            async def go() -> int:
                await asyncio.gather(*(send(h, c, url, tally) for c in batch))
                return await after_batch(h, url, batch)

            left = loop.run_until_complete(go())
            abandoned.append(left)
            assert left == 0, f"{left} generations left in the engine after {batch}"
            assert fuzz_server.proc.poll() is None, "the server process died"

        case()
    finally:
        loop.run_until_complete(h.aclose())
        loop.close()
    sent = sum(tally.answered.values()) + tally.left + tally.capped
    print(
        f"\nengine fuzz: {len(abandoned)} batches, {sent} requests; answers by status "
        f"{dict(sorted(tally.answered.items()))}; {tally.left} clients left on purpose, {tally.capped} gave up "
        f"after {CLIENT_CAP_S:g} s; expected 5xx (health while paused, unreachable peers): "
        f"{tally.expected_5xx}; abandoned generations after a batch: max {max(abandoned)}"
    )
    assert len(abandoned) >= batches and max(abandoned) == 0
    assert fuzz_server.proc.poll() is None
    assert "Traceback" not in fuzz_server.log_path.read_text(), "the server logged an exception"
