"""Rewrite the benchmark table in ../README.md from results.json (run after `gyre-xfer bench --out`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

HERE = Path(__file__).parent


def table(r: dict[str, float]) -> str:
    rows = [
        ("1 MiB, one transfer", "1mib", ""),
        ("16 MiB, one transfer", "16mib", ""),
        ("256 MiB, one transfer", "256mib", "`wrapper_over_raw_256mib`"),
        ("1,000 x 64 KiB scattered blocks, one batch", "blocks", "`wrapper_over_raw_blocks`"),
    ]
    out = ["| transfer (Mooncake TCP, loopback, two processes) | raw Mooncake | gyre-xfer | wrapper / raw |"]
    out.append("|---|---|---|---|")
    for label, key, name in rows:
        ratio = r[f"wrapper_over_raw_{key}"]
        shown = f"**{ratio}** ({name})" if name else f"{ratio}"
        out.append(f"| {label} | {r[f'raw_{key}_gbps']} GB/s | {r[f'wrapper_{key}_gbps']} GB/s | {shown} |")
    out += [
        "",
        "| other figures, same run | value |",
        "|---|---|",
        f"| wrapper's own work per 1,000-entry batch (range checks, address lists) | {r['wrapper_prep_ms_1000_entries']} ms |",
        f"| `KvPool.pull` of 1,000 scattered blocks (1 layer, K and V planes of 32 KiB) | {r['kv_pull_1000_blocks_gbps']} GB/s |",
        f"| plain TCP socket, 256 MiB | {r['tcp_socket_256mib_gbps']} GB/s (Mooncake wrapper / TCP: {r['mooncake_256mib_over_tcp_socket']}) |",
        f"| memcpy 256 MiB | {r['memcpy_256mib_gbps']} GB/s |",
        f"| shared-memory transport 256 MiB ({r['shm_pull_copy_threads']} copy threads) | {r['shm_256mib_gbps']} GB/s: "
        f"**{r['shm_over_memcpy']}** of memcpy (`shm_over_memcpy`) |",
        f"| 1 GiB snapshot (64 bf16 tensors), publish -> subscriber holds it, warm (median) | {r['snapshot_1gib_publish_to_held_s']} s "
        f"(last run: publish {r['snapshot_publish_s']:.2f} s, pull + verify {r['snapshot_pull_s']} s) |",
        f"| the same, cold (first version: slots and staging allocated) | {r['snapshot_1gib_cold_s']} s |",
        "",
        f"| `Subscriber.pull` over shared memory, Qwen3-0.6B's 310 tensors ({r['shm_pull_qwen3_0_6b_bytes'] / 1e9:.2f} GB bf16), "
        f"checksums verified, warm staging, {r['cpu_count']} cores (medians, alternating) | seconds | this row / default |",
        "|---|---|---|",
        f"| default: {r['shm_pull_copy_threads']} copy threads, {r['shm_pull_hash_threads']} hash threads, tensors hashed in 16 MiB pieces "
        f"| {r['shm_pull_qwen3_0_6b_s_threads']} s | 1 |",
        f"| `copy_threads=1` | {r['shm_pull_qwen3_0_6b_s_one_thread']} s | **{r['shm_pull_one_thread_over_threads']}** (`shm_pull_one_thread_over_threads`) |",
        f"| `copy_threads=1`, a tensor hashed in no smaller pieces than the buckets cut (about the code before) "
        f"| {r['shm_pull_qwen3_0_6b_s_before']} s "
        f"| {r['shm_pull_before_over_threads']} (`shm_pull_before_over_threads`) |",
    ]
    return "\n".join(out) + "\n"


def main() -> None:
    results = json.loads((HERE / "results.json").read_text())
    readme = HERE.parent / "README.md"
    text = readme.read_text()
    start = "<!-- bench:start (written by bench/table.py from bench/results.json) -->\n"
    new, n = re.subn(
        re.escape(start) + r".*?<!-- bench:end -->\n",
        lambda _: start + table(results) + "<!-- bench:end -->\n",
        text,
        flags=re.S,
    )
    assert n == 1, "bench markers not found in README.md"
    readme.write_text(new)


if __name__ == "__main__":
    main()
