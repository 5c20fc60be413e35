"""The packed prefill of prefix-cached prompts (`prefill.prefill_packed`) on a GPU, in bfloat16, where each
row's attention is flash attention over its own cache: each row's last logits and KV against the same
row's rest prefilled alone on top of its cache (`prefill.prefill_chunk`, the path the engine took for one
call at a time). Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from gyre_engine.server.batch import RowKV, cache_kwarg, cache_layers  # noqa: E402
from gyre_engine.server.prefill import prefill_chunk, prefill_packed, start_cache  # noqa: E402


def test_packed_rows_equal_each_row_prefilled_alone_on_a_gpu(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda").eval()
    kw, dev = cache_kwarg(model), torch.device("cuda")
    shapes = [(300, 40), (1200, 7), (64, 513), (900, 1)]  # (cached, rest)
    ctxs = [[(97 * i + 13 * j) % 1500 + 10 for j in range(c + r)] for i, (c, r) in enumerate(shapes)]
    with torch.inference_mode():
        prefixes = []
        for ctx, (c, _) in zip(ctxs, shapes, strict=True):
            cache = start_cache(None)
            prefill_chunk(model, kw, ctx, cache, 0, c, dev)
            prefixes.append(RowKV(*cache_layers(cache)))
        alone = []
        for ctx, kv, (c, _) in zip(ctxs, prefixes, shapes, strict=True):
            cache = start_cache(kv)
            alone.append(
                (prefill_chunk(model, kw, ctx, cache, c, len(ctx), dev)[0], RowKV(*cache_layers(cache)))
            )
        caches = [start_cache(kv) for kv in prefixes]
        logits = prefill_packed(
            model, kw, [(ctx, c, cache) for ctx, (c, _), cache in zip(ctxs, shapes, caches, strict=True)], dev
        )
    for (want, want_kv), got, cache in zip(alone, logits, caches, strict=True):
        assert float((got.float() - want.float()).abs().max()) < 0.1
        assert int(got.argmax()) == int(want.argmax())
        row = RowKV(*cache_layers(cache))
        assert row.length == want_kv.length
        for a, b in zip(row.keys + row.values, want_kv.keys + want_kv.values, strict=True):
            assert float((a.float() - b.float()).abs().max()) < 0.05
