"""The SGLang launcher's command line (SGLang itself cannot run here) and its readiness wait, against
a gyre-engine server; the default model's tokenizer and chat template; `create-model` for each family."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest
from gyre_engine.cli import main
from gyre_engine.launcher import SGLangConfig, WeightGroup, wait_healthy


def test_command_has_the_flags_a_rollout_cell_needs() -> None:
    cfg = SGLangConfig(
        model_path="/models/qwen3",
        tp=4,
        port=31000,
        mem_fraction_static=0.8,
        weight_version="7",
        weights_cpu_backup=True,
        weight_group=WeightGroup("10.0.0.1", 29500, 1, 5),
        extra_args=("--attention-backend", "fa3"),
    )
    cmd = cfg.command()
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    pairs = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert pairs["--model-path"] == "/models/qwen3" and pairs["--tp-size"] == "4"
    assert pairs["--port"] == "31000" and pairs["--host"] == "127.0.0.1"
    assert "--mem-fraction-static" in cmd and cmd[cmd.index("--mem-fraction-static") + 1] == "0.8"
    assert cmd[cmd.index("--weight-version") + 1] == "7"
    assert "--enable-memory-saver" in cmd and "--enable-weights-cpu-backup" in cmd
    assert cmd[-2:] == ["--attention-backend", "fa3"]
    assert cfg.url == "http://127.0.0.1:31000"
    with pytest.raises(ValueError, match="mem_fraction_static"):
        SGLangConfig("m", mem_fraction_static=1.5).command()


def test_cli_prints_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    main(["sglang-command", "--model", "/m", "--tp", "2"])
    assert "sglang.launch_server --model-path /m --tp-size 2" in capsys.readouterr().out


def test_wait_healthy_against_a_live_server_and_a_dead_port(server: Any) -> None:
    asyncio.run(wait_healthy(server.url, timeout_s=30))
    with pytest.raises(TimeoutError):
        asyncio.run(wait_healthy("http://127.0.0.1:9", timeout_s=1.5, poll_s=0.2))


def test_chat_template_renders_tools_and_thinking(tokenizer: Any) -> None:
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "list files"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "use ls",
            "tool_calls": [{"function": {"name": "bash", "arguments": {"command": "ls"}}}],
        },
        {"role": "tool", "content": "a.txt"},
    ]
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    text = tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
    assert "<tools>\n" in text and '"name": "bash"' in text
    assert '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\na.txt\n</tool_response><|im_end|>" in text
    assert "<think>\nuse ls\n</think>" in text  # reasoning after the last user turn is kept
    assert text.endswith("<|im_start|>assistant\n")
    off = tokenizer.apply_chat_template(
        msgs[:2], add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = tokenizer.apply_chat_template(msgs[:2], tokenize=True, return_dict=True)["input_ids"]
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(msgs[:2], tokenize=False)
    for special in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"):
        assert len(tokenizer(special, add_special_tokens=False)["input_ids"]) == 1


@pytest.mark.parametrize(("family", "cls"), [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")])
def test_create_model_writes_each_family(
    family: str, cls: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    main(["create-model", str(tmp_path / "m"), "--family", family])
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["model_type"] == family and cfg["architectures"] == [cls] and cfg["tie_word_embeddings"]
    from gyre_engine.server.model_factory import create_model

    d = create_model(
        tmp_path / "o", family=family, overrides={"rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    )
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["rms_norm_eps"] == 1e-5 and not cfg["tie_word_embeddings"]
    with pytest.raises(ValueError, match="unknown family 'gpt2'"):
        create_model(tmp_path / "g", family="gpt2")
