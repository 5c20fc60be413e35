"""The `gyre run` configuration: a TOML or YAML file loaded into frozen dataclasses with defaults.

Every section and key is checked: an unknown section or key, a wrong type or an out-of-range value is a
`ConfigError` naming it (`[agent] turns must be >= 1`), so a typo never silently runs the default. What
only the harnesses know (which harness, its command line, whether its CLI is installed here) is theirs to
check: `rollout.harnesses.check_harness`, which `gyre run` and the `gyre` command call once the file is
loaded; so are your `[tasks]` rows and reward function (`rollout.harnesses.check_tasks`). Any key may be
overridden on the command line, `SECTION.KEY=VALUE`, with the same checks (`parse_override`). The field docstrings are the reference; `integration/examples/tiny.toml` shows every section.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from gyre_base import tables
from gyre_proxy.config import KV_TRANSPORTS, ProxyConfig
from gyre_sched.policy import WaterLevelConfig
from gyre_sched.workload import DriverConfig
from gyre_train.defaults import CHUNK_BUDGET, MISMATCH_WARN, PIPELINE_PARALLEL, TENSOR_PARALLEL
from gyre_train.modelconfig import ModelConfig
from gyre_train.protocol import CellShape, satellite_refusal
from gyre_traj.pack import PackConfig

POLICIES = ("elastic", "colocate", "colocate-runahead", "async")
"""The gyre-sched policies `gyre run` can use (their meaning: gyre-sched's README, "Policies")."""
WHOLE_POOL = ("colocate", "colocate-runahead")
"""Policies that train whole batches only, whatever `[driver] streaming` says."""


def default_of(cls: type, name: str) -> Any:
    """The default of field `name` of the dataclass `cls`: a setting the run config shares with the package
    that declares it takes its default from there (`slots` dataclasses included)."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


class ConfigError(tables.ConfigError):
    """A configuration that cannot be used, with the offending section and key in the message. A
    `ValueError`, and a `gyre_base.tables.ConfigError`: the section checks are gyre-base's, raising
    this class."""


@dataclass(frozen=True)
class RunSection:
    policy: str = "elastic"
    """Who decides the cells' roles (gyre-sched's policies): elastic (water level), colocate (the report's:
    whole pool, batches in cohorts), colocate-runahead (whole pool, batches start under a tail) or async
    (a fixed split)."""
    cells: int = 2
    """Cells, each a gyre-engine rollout server or a trainer replica; cell 0 is the trainer core."""
    steps: int = 2
    """Optimizer steps to run; the run ends when the last one is applied and reached the engines."""
    seed: int = 0
    out_dir: str = "gyre-run"
    """Where logs, records, metrics.json and the plot go (created; a policy subdirectory for compare)."""
    model_dir: str = ""
    """A gyre-engine model directory; empty: a random-init model of `model_shape`, created under out_dir."""
    model_shape: str = "tiny"
    """`gyre-engine create-model --shape`: tiny (the embedded default), mini, small or qwen3-0.6b."""
    model_dtype: str = "float32"
    """dtype of a created model (float32 or bfloat16)."""
    deadline_s: float = 900.0
    """The whole run fails (every process stopped) if it has not finished this long after its first rollout
    began (the start-up before it is held to `startup_timeout_s`)."""
    startup_timeout_s: float = 180.0
    """Processes that are not up within this long are an error."""
    ray_address: str = ""
    """Empty: every process on this machine (the local launcher). Else a Ray cluster's address ("auto",
    "HOST:PORT", "ray://HOST:PORT"; the `gyre[ray]` extra): the scheduler, the proxy and each cell (with
    its GPUs) are placed through one placement group (`ray_resources` pins them to nodes), bind their
    node's address (the proxy: loopback, on the node of `gyre run`), and share a run token
    ($GYRE_TOKEN, or a new one); out_dir must be on a filesystem every node sees. `gyre run --ray`."""
    nodes_dir: str = ""
    """With `node_agents`: the directory (on a filesystem every node sees) where the other nodes' `gyre
    node` agents announce themselves and take the processes to start (SLURM: examples/slurm/)."""
    node_agents: int = 0
    """Nodes besides this one that run `gyre node` (0: none, every process here or on Ray): the
    scheduler and the proxy stay here, cell i goes to node 1 + i mod node_agents."""
    bind_host: str = "127.0.0.1"
    """With `node_agents`: the address of this node that the scheduler binds and the other nodes' cells
    dial; the run token keeps others out (the proxy and the trajectory service stay on loopback)."""
    ray_resources: dict[str, dict[str, float]] = field(default_factory=dict)
    """With `ray_address`: Ray custom resources each part's bundle asks for besides its CPU and GPUs, by
    part name ("sched", "proxy", "cell-0", "cell-1", ...), e.g. `{ "cell-1" = { node2 = 1 } }` to put
    cell 1 on the node started with `--resources '{"node2": 1}'`. A part left out goes wherever Ray
    packs it, except the proxy: it must land on the node of `gyre run`, whose harnesses call it on
    loopback. The trajectory service, the rollout driver and the sampler run in `gyre run` itself."""


@dataclass(frozen=True)
class BatchSection:
    queries: int = 2
    """Groups (tasks) per optimizer step."""
    group_size: int = 2
    """Executions per task; advantages are taken within a group."""


@dataclass(frozen=True)
class AgentSection:
    turns: int = 3
    """Model calls of one execution when it does not time out (the built-in harness is scripted; on your
    own `[tasks]` rows it makes one call)."""
    max_tokens: int = 12
    """max_tokens of each model call."""
    temperature: float = 1.0
    median_s: float = 2.0
    """Execution duration profile (lognormal, as gyre-sched's workloads): median of a task's scale in
    seconds (the simulator's workload for this run takes it from here, `predict.sim_workload`; gyre-sched's
    own default, `durations.median_h`, is a cluster's profile in hours) ..."""
    sigma: float = 0.8
    """... its log-space spread (the heavy tail) ..."""
    exec_sigma: float = 0.3
    """... and the spread of the executions inside a group."""
    model_fraction: float = 0.5
    """Share of the nominal duration the simulator counts as model time; the harness sleeps the rest
    (1 - model_fraction) as tool time between calls."""
    timeout_s: float = 8.0
    """Hard timeout of one execution; a timed-out one is scored on what it produced (flagged)."""
    request_timeout_s: float = 60.0
    """Give up one HTTP call after this long (inside the execution's timeout)."""
    scripted_fallback: bool = False
    """When the model makes no tool call, run the task's next scripted tool itself (for a random model,
    which rarely emits a parseable call); off: the model's answer ends the execution."""
    harness: str = "builtin"
    """Who runs an execution: builtin (this package's tool-using agent, `agent.py` / `branching.py`),
    profile (executions shaped like the report's long agent runs, `[profile]`),
    claude-code (one real Claude Code CLI process per execution) or command (any command-line agent from
    `command`); README "Harnesses"."""
    tasks: str = "qa"
    """qa: the built-in question families (`tasks/qa.py`, scored on the final answer); code: write code in
    the working directory, scored by hidden unit tests (`tasks/coding.py`; claude-code and command only).
    Your own rows and reward instead: `[tasks]` (leave this unset)."""
    command: str = ""
    """command harness: the agent's command line, split like a shell's (no shell runs it), with
    `{prompt}` (required) and `{workdir}` replaced in each word; its environment names the execution's
    Anthropic and OpenAI base URLs; its standard output, stripped, is the final answer. Example:
    `python -m gyre.rollout.agents.openai_agent {prompt}`."""
    claude_bin: str = ""
    """claude-code: the `claude` executable; empty: $GYRE_CLAUDE_BIN, else the pinned install at
    packages/gyre-proxy/.claude-code, else `claude` on PATH."""
    compact_tokens: int = 0
    """builtin: once a call's context (its input and output tokens) passes this, the agent asks for a
    summary (role main_summary) and restarts from it; 0: never."""
    subagents: bool = False
    """builtin: each tool step is delegated to a sub-agent (its own conversation, role subagent) whose
    answer returns to the main agent as the tool's result."""
    call_retries: int = 0
    """builtin: a reply cut at max_tokens, or with an unparseable tool call, is sent again unchanged up to
    this many times (the cut reply stays in the tree as a dead branch)."""


@dataclass(frozen=True)
class DriverSection:
    max_ahead: int = default_of(DriverConfig, "max_ahead")
    """Batches rollout may run ahead of the trainer: batch k starts once k - steps applied <= this
    (gyre-sched's `driver.max_ahead`, and its default)."""
    report_s: float = 0.2
    """How often the water level and ready groups go to the scheduler."""
    streaming: bool = True
    """Stream each step: the trajectory service opens it on gyre-train's core and hands it every group
    as soon as the group is scored and its records have arrived, so training starts under the batch's
    tail (True); or submit the step whole once its batch is complete (False). The Colocate variants
    train whole batches only either way (`Config.streams`)."""


@dataclass(frozen=True)
class TrainSection:
    lr: float = 1e-4
    token_budget: int = default_of(PackConfig, "token_budget")
    """Most tokens in one tree-packed micro-batch (gyre-traj's `PackConfig.token_budget`, and its default).
    An execution with a path longer than this cannot be trained: it is set aside (named in steps.jsonl
    under `over_budget`)."""
    chunk_budget: int = CHUNK_BUDGET
    """Train a micro-batch with more tokens than this in chunks of at most this many, the shared prefix
    computed once (gyre-train's `CoreConfig.chunk_budget`): activation memory is one chunk's, so
    token_budget can hold long paths; 0: off."""
    loss: str = "ppo"
    """ppo or tis (gyre-traj's policy loss)."""
    tis_cap: float = 0.0
    """Truncated importance sampling of the train-inference mismatch (verl's TIS); 0: off. With loss = ppo,
    each token's term is weighted by min(exp(trainer - behaviour logprob), tis_cap), the clipped ratio
    taken to the trainer's own logprob (gyre-traj's `LossConfig.ppo_tis_cap`); with loss = tis, the cap
    of that loss (0 there: gyre-traj's default, 2.0)."""
    mismatch_warn: float = MISMATCH_WARN
    """The core logs a warning for a step whose train-inference mismatch (mean |trainer - behaviour
    logprob| over its on-policy tokens, `mismatch.abs_mean` in steps.jsonl) is above this; 0: never
    (gyre-train's `CoreConfig.mismatch_warn`, and its default)."""
    j_max: int = 5
    """Trajectories selected per execution."""
    keep_batches: bool = False
    """Keep every applied step's micro-batches in the run directory (`batches/`, gyre-train's
    `batchlog`), so a benchmark can train the same batches again alone."""


@dataclass(frozen=True)
class LogSection:
    """Where each applied step's scalars go besides steps.jsonl and metrics.json: TensorBoard event files
    under out_dir/tb/ always; Weights & Biases with a project (the `gyre[wandb]` extra)."""

    wandb_project: str = ""
    """A Weights & Biases project to log every step's scalars to; empty: none."""
    wandb_mode: str = "offline"
    """offline (written under out_dir/wandb/, uploaded later with `wandb sync`), online (needs a login)
    or disabled."""
    wandb_entity: str = ""
    """The W&B entity (team or user); empty: the login's default."""


@dataclass(frozen=True)
class EvalSection:
    tasks: int = 0
    """Held-out tasks scored at each evaluation (greedy, through the proxy and engines); 0 = none. With
    `[tasks]`: rows of its evaluation split (all of them when it has fewer)."""
    every: int = 5
    """Evaluate at weight versions 0, every, 2 x every, ... and the last; the step after an evaluation
    point is held until it is done, so every evaluation sees one weight version."""
    seed: int = 0
    """Which held-out tasks (the same set at every evaluation)."""
    max_tokens: int = 48
    """max_tokens of each evaluation call."""


@dataclass(frozen=True)
class TasksSection:
    """Your own tasks and reward, in verl's conventions (README "Bring your own data and reward"): each row
    has `prompt` (a list of chat messages, {role, content}), `reward_model.ground_truth`, `data_source`
    and, optionally, `extra_info`. Relative paths are taken from the directory of the file that names
    them (the current directory for a command-line override)."""

    train: str = ""
    """The training rows: a .jsonl file, a .parquet file (the `gyre[data]` extra) or a directory that
    HuggingFace `datasets` saved with `save_to_disk`; empty: the built-in tasks (`[agent] tasks`)."""
    eval: str = ""
    """The evaluation rows, in the same forms; empty: `eval_fraction` of the training rows are held out."""
    eval_fraction: float = 0.0
    """With no `eval` file: the share of the training rows held out for evaluation (never trained on),
    chosen by a hash of each row's content, so a row and its duplicates fall on one side and the split
    stays put when rows are added or reordered."""
    reward: str = ""
    """The reward function, `module:function` (importable) or `path/to/file.py:function`, with verl's
    `custom_reward_function` signature `fn(data_source, solution_str, ground_truth, extra_info=None)`,
    returning a finite number or a dict with a finite `score` (its other keys are logged). A reward that
    raises, or returns anything else, is an evaluation failure, not a 0."""
    reward_timeout_s: float = 60.0
    """A reward call not done within this long is an evaluation failure (it runs on a thread)."""


@dataclass(frozen=True)
class CellSection:
    capacity: int = 8
    """Concurrent executions one rollout cell serves at full speed (the scheduler's water level unit)."""
    release_memory: bool = True
    """Release the engine's memory while its cell trains (gyre-engine's /release_memory_occupation)."""
    device: str = "cpu"
    """cpu, or cuda: each cell sees one GPU alone (CUDA_VISIBLE_DEVICES; which one: `gpus`) for its
    engine and its replica, and training uses FlexAttention."""
    gpus: list[int] = field(default_factory=list)
    """With device = "cuda": the GPU index of each cell, one per cell; cells may share a GPU (`[0, 0]`:
    two cells on GPU 0). Empty: cell i takes GPU i (`gyre.system.gpus`)."""
    engine: str = "gyre"
    """The cell's rollout engine: gyre (gyre-engine), or sglang (an SGLang server started through
    gyre-engine's launcher and driven through SGLang's endpoints only: weights by its distributed update,
    memory release and resume, pause and continue; a moved call is re-prefilled)."""
    sglang_module: str = "sglang.launch_server"
    """engine = "sglang": what `python -m` runs, SGLang's server or, where SGLang cannot serve (no
    supported GPU), gyre_engine.standin (gyre-engine with SGLang's flags and endpoints only)."""
    tensor_parallel: list[int] = field(default_factory=list)
    """Tensor-parallel ranks of each cell's trainer replica, one entry per cell (`[2, 1]`: the core on two
    ranks, cell 1 on one); empty: every cell on gyre-train's default, one rank. A cell of more than one
    rank is one torch.distributed job (gyre-train's multi-rank cell, `model_backend = "megatron"`): the
    cell's process is rank 0 (its engine, its scheduler link, the core or the satellite) and starts the
    other ranks as its children (`logs/cell-<id>.rank<r>.log`); it trains, switches, receives weights
    and hands gradients over as one replica. A satellite trains in the core's shape (its rank r hands
    its gradient slice to core rank r) or on one rank beside a core of one pipeline stage (it hands its
    whole gradient; each core rank adds its own shard of it); a cell of another shape (several ranks,
    not the core's) is rollout only: allowed where the policy never trains it (async, a cell at or past
    `[sched] async_train_cells`)."""
    pipeline_parallel: list[int] = field(default_factory=list)
    """Pipeline stages of each cell's trainer replica, one entry per cell, as `tensor_parallel`; empty:
    one stage each. A cell's ranks are tensor_parallel x pipeline_parallel."""
    model_backend: str = default_of(ModelConfig, "backend")
    """The trainers' model: transformers (the family's transformers class) or megatron (Megatron-core
    GPTModel, gyre-train's `megatron` extra; needed by cells of more than one rank)."""
    warmup: int = -1
    """Synthetic micro-batches each cell's trainer replica (the core, a satellite) computes at start, beside
    its engine's start-up, their gradients thrown away and nothing applied, so the first step does not
    compile the attention kernels; -1: 2 on a GPU, 0 on the CPU (where nothing is compiled)."""


@dataclass(frozen=True)
class EngineSection:
    """Options of each cell's `gyre-engine serve` (its memory and its CUDA-graph start-up)."""

    max_running: int = 64
    """Requests decoding at once at most (`--max-running-requests`; also the largest graph bucket)."""
    kv_fraction: float = 0.2
    """Device memory for the decode slots' KV, as a fraction of the GPU's (`--slot-kv-fraction`); the
    cells sharing a GPU must leave room for each other and the trainers (checked: <= 0.8 together)."""
    slot_widths: str = ""
    """Columns a decode step attends over (`--slot-widths`): "bucketed" (a CUDA graph per length bucket,
    captured on first use) or "full" (the whole slot buffer: every graph captured at start-up; for
    contexts that keep growing); "": the engine's default (bucketed)."""
    max_cached_tokens: int = 0
    """Tokens of finished calls' KV each engine keeps for prefix reuse (`--max-cached-tokens`; 0: the
    engine's own default). This memory comes on top of `kv_fraction`: size both for the live contexts."""
    host_cached_tokens: int = 0
    """Tokens of cached prefixes each engine keeps in host memory when they leave the GPU (past
    `max_cached_tokens`, under `min_free_gib`, or a long slot taken for another context), copied back
    when a call extends them instead of computed again (`--host-cached-tokens`; 0: dropped). Host memory:
    layers x 2 x KV heads x head dim x bytes per token (112 KiB for the Qwen3-0.6B shape in bf16)."""
    prefill_chunk: int = 0
    """Tokens each engine prefills in a step at admission at most, and the chunk of a longer prefill
    (`--prefill-chunk`; 0: the engine's default, 2,048). A call whose uncached tokens fit starts at
    once; a longer one goes through the engine's one chunked prefill, a chunk at a time beside the
    decoding rows, and the calls behind it that need that prefill wait. For agents, size it to a
    call's new tokens (its previous output and a tool output)."""
    min_free_gib: float = 0.0
    """GiB of the GPU (every process on it) each engine keeps free by dropping its least recently used
    prefix-cache entries first (`--min-free-gib`; 0: off): rows longer than a slot, the other cells and
    the trainers then take memory from the caches, not from a step that would fail."""
    long_context_tokens: int = 0
    """Tokens of each long slot (`--long-context-tokens`; 0: none). A call whose context plus its
    `max_new_tokens` does not fit a decode slot is prefilled chunk by chunk into a long slot of this many
    tokens (layers x 2 x KV heads x head dim x this many elements each) and decodes there, every long
    slot's row in one step; between calls the prefix cache holds that slot, and the execution's next
    call takes it over without a copy. Without long slots such a call decodes in the engine's lanes,
    whose KV grows with it (and is copied whole when another row joins the lane)."""
    long_context_slots: int = 0
    """Long slots per engine (`--long-context-slots`; 0: the engine's default, one), all allocated at the
    first long call and kept; a long call waits while every one is busy. Their memory comes on top of
    `kv_fraction`."""
    warmup_tokens: int = 1024
    """CUDA graphs captured before serving, for rows up to this length (`--warmup-decode-tokens`; 0: each
    graph on first use)."""
    compile_decode: bool = True
    """Capture the decode step over a `torch.compile`d forward (minutes of start-up per engine for a
    0.6B model); false: capture the eager forward (seconds)."""
    decode_slots: str = "auto"
    """auto (CUDA graphs on CUDA), graphs, eager or off (`--decode-slots`)."""
    keep_graphs: bool = True
    """The weights and whole-width slot buffers keep their device addresses across the release at each
    switch to training (CUDA virtual memory), so the decode graphs are not captured again after the switch
    back; false: freed and allocated anew, the graphs captured again at first use (`--no-keep-graphs`)."""
    prefill_graphs: bool = True
    """With whole-width slots: an agent's next calls (prefix-cached, a few hundred new tokens together) are
    prefilled straight into the decode slots as one CUDA graph replay rather than kernel by kernel;
    false: as before (`--prefill-graph-tokens 0`)."""


@dataclass(frozen=True)
class SchedSection:
    ready_fraction: float = 0.5
    """elastic: ready groups must stay at this fraction of the batch ..."""
    hold_s: float = 0.5
    """... for this long before a cell moves to training."""
    train_complete_steps: bool = default_of(WaterLevelConfig, "train_complete_steps")
    """elastic, for a step whose batch is complete: the core stays in training for it when demand returns,
    and goes to train it at once, whatever the water level, where the next batch waits for it (the
    driver's `max_ahead` holds it back) (gyre-sched's `WaterLevelConfig`); false: the report's rules
    alone."""
    async_train_cells: int = 1
    """async: cells that train for the whole run (the core first)."""
    heartbeat_s: float = 1.0
    failure_timeout_s: float = 30.0
    """A cell silent this long is failed (generous: 2 loaded CPU cores)."""
    drain_timeout_s: float = 10.0
    switch_timeout_s: float = 120.0


@dataclass(frozen=True)
class ProxySection:
    pick_wait_s: float = 30.0
    """A call waits this long for a rollout engine (none while the whole pool trains) before 529."""
    drain_grace_s: float = 0.0
    """Seconds a draining engine's calls may finish before they are moved."""
    kv_transport: str = default_of(ProxyConfig, "kv_transport")
    """How a moved call's cached prefix goes to its next engine (gyre-proxy's `--kv-transport`): shm,
    mooncake, http, or cuda_ipc (device to device between gyre-engines on one GPU: cells sharing a GPU;
    an engine short of free GPU memory offers over shared memory instead)."""


@dataclass(frozen=True)
class SurviveSection:
    restart: bool = True
    """Restart what dies and go on (supervise.py): a satellite cell or the proxy in place, anything else by
    a new attempt of the run from the core's checkpoint; false: the run fails at once on any dead part,
    naming it (the behaviour before supervision)."""
    max_restarts: int = 5
    """Restarts of one part, and new attempts of the run, before the run fails."""
    backoff_s: float = 1.0
    """Wait before the n-th restart of a part: backoff_s x 2^(n-1), at most 30 s."""


@dataclass(frozen=True)
class ProfileSection:
    """`[agent] harness = "profile"`: executions shaped like the report's long agent runs (many calls,
    contexts growing by tool outputs, outputs of hundreds of tokens, compaction and sub-agents, a heavy
    tail ending at the timeout), for measuring the system at that shape. Each execution's plan is drawn
    from these lognormals (median, log-space sigma, clipped to [min, max]) with the run's seed; its tool
    time is the duration profile's (`[agent] median_s`, `sigma`, `exec_sigma`, `model_fraction`) spread
    over its calls."""

    calls_median: float = 16.0
    """Main-agent calls of an execution (it may end earlier at `context_max` or the timeout) ..."""
    calls_sigma: float = 0.5
    calls_min: int = 8
    calls_max: int = 40
    output_median: float = 150.0
    """Output tokens of each call (sampled by the model to exactly this length: `ignore_eos`) ..."""
    output_sigma: float = 0.6
    output_min: int = 50
    output_max: int = 400
    tool_tokens_median: float = 1500.0
    """Tokens of the tool output that follows each call ..."""
    tool_tokens_sigma: float = 0.6
    tool_tokens_min: int = 512
    tool_tokens_max: int = 4096
    prompt_tokens: int = 1024
    """Tokens of the task's prompt (one per group: its executions share it)."""
    context_max: int = TrainSection.token_budget
    """An execution whose context would pass this ends with its next call (at most `[train] token_budget`,
    so that every execution can be trained; the default is that budget's)."""
    compact_tokens: int = 12288
    """Once a call's context passes this, the agent compacts (a summary call, role main_summary) and
    goes on from the task and the summary; 0: never."""
    subagent_share: float = 0.15
    """Share of tool steps delegated to a sub-agent (two calls of its own, role subagent)."""
    tool_s_sigma: float = 0.6
    """Spread of each call's tool time around the execution's mean (lognormal weights)."""


@dataclass(frozen=True)
class Config:
    run: RunSection = field(default_factory=RunSection)
    batch: BatchSection = field(default_factory=BatchSection)
    agent: AgentSection = field(default_factory=AgentSection)
    driver: DriverSection = field(default_factory=DriverSection)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    tasks: TasksSection = field(default_factory=TasksSection)
    cell: CellSection = field(default_factory=CellSection)
    sched: SchedSection = field(default_factory=SchedSection)
    proxy: ProxySection = field(default_factory=ProxySection)
    engine: EngineSection = field(default_factory=EngineSection)
    survive: SurviveSection = field(default_factory=SurviveSection)
    profile: ProfileSection = field(default_factory=ProfileSection)
    log: LogSection = field(default_factory=LogSection)

    def __post_init__(self) -> None:
        r, b, a, t = self.run, self.batch, self.agent, self.train
        _check(r.policy in POLICIES, f"[run] policy must be one of {', '.join(POLICIES)}, got {r.policy!r}")
        _check(r.cells >= 2, "[run] cells must be >= 2 (a core and at least one rollout cell)")
        _check(r.steps >= 1, "[run] steps must be >= 1")
        _check(r.deadline_s > 0 and r.startup_timeout_s > 0, "[run] deadline_s and startup_timeout_s > 0")
        _check_resources(r.ray_resources, r.cells)
        _check(r.node_agents >= 0, "[run] node_agents must be >= 0")
        _check(not r.node_agents or bool(r.nodes_dir), "[run] node_agents needs [run] nodes_dir")
        _check(not (r.node_agents and r.ray_address), "[run] node_agents and ray_address: one or the other")
        _check(b.queries >= 1, "[batch] queries must be >= 1")
        _check(b.group_size >= 2, "[batch] group_size must be >= 2 (advantages need two scores)")
        _check(a.turns >= 1, "[agent] turns must be >= 1")
        _check(a.max_tokens >= 1, "[agent] max_tokens must be >= 1")
        _check(a.temperature > 0, "[agent] temperature must be > 0 (logprobs of sampled tokens)")
        _check(a.median_s > 0 and a.sigma >= 0 and a.exec_sigma >= 0, "[agent] duration profile >= 0")
        _check(0 < a.model_fraction <= 1, "[agent] model_fraction must be in (0, 1]")
        _check(a.timeout_s > 0 and a.request_timeout_s > 0, "[agent] timeouts must be > 0")
        _check(a.compact_tokens >= 0 and a.call_retries >= 0, "[agent] compact_tokens, call_retries >= 0")
        _check(self.driver.max_ahead >= 0, "[driver] max_ahead must be >= 0")
        _check(self.driver.report_s > 0, "[driver] report_s must be > 0")
        _check(
            t.lr >= 0 and t.token_budget >= 64, "[train] lr >= 0 (0: a control run) and token_budget >= 64"
        )
        _check(self.eval.tasks >= 0 and self.eval.every >= 1, "[eval] tasks must be >= 0 and every >= 1")
        _check(t.chunk_budget >= 0, "[train] chunk_budget must be >= 0 (0: off)")
        _check(t.loss in ("ppo", "tis"), f"[train] loss must be ppo or tis, got {t.loss!r}")
        _check(t.j_max >= 0, "[train] j_max must be >= 0")
        _check(t.tis_cap >= 0, "[train] tis_cap must be >= 0 (0: off)")
        _check(t.mismatch_warn >= 0, "[train] mismatch_warn must be >= 0 (0: never)")
        _check(
            self.log.wandb_mode in ("offline", "online", "disabled"),
            f"[log] wandb_mode must be offline, online or disabled, got {self.log.wandb_mode!r}",
        )
        _check(self.cell.capacity >= 1, "[cell] capacity must be >= 1")
        _check(
            self.cell.engine in ("gyre", "sglang"),
            f"[cell] engine must be gyre or sglang, got {self.cell.engine!r}",
        )
        _check(
            self.cell.device in ("cpu", "cuda"),
            f"[cell] device must be cpu or cuda, got {self.cell.device!r}",
        )
        self._check_placement()
        _check(
            r.model_shape in ("tiny", "mini", "small", "qwen3-0.6b"),
            "[run] model_shape must be tiny, mini, small or qwen3-0.6b",
        )
        _check(r.model_dtype in ("float32", "bfloat16"), "[run] model_dtype must be float32 or bfloat16")
        s = self.sched
        _check(0 < s.ready_fraction <= 1, "[sched] ready_fraction must be in (0, 1]")
        _check(s.hold_s >= 0, "[sched] hold_s must be >= 0")
        _check(1 <= s.async_train_cells < r.cells, "[sched] async_train_cells must be in [1, cells)")
        self._check_ranks()
        _check(self.proxy.pick_wait_s > 0, "[proxy] pick_wait_s must be > 0")
        _check(self.survive.max_restarts >= 0, "[survive] max_restarts must be >= 0")
        self._check_profile()
        self._check_tasks()
        _check(self.survive.backoff_s >= 0, "[survive] backoff_s must be >= 0")

    def _check_profile(self) -> None:
        p = self.profile
        for name in ("calls", "output", "tool_tokens"):
            lo, hi = getattr(p, f"{name}_min"), getattr(p, f"{name}_max")
            med, sig = getattr(p, f"{name}_median"), getattr(p, f"{name}_sigma")
            _check(1 <= lo <= hi, f"[profile] {name}_min must be >= 1 and <= {name}_max")
            _check(med > 0 and sig >= 0, f"[profile] {name}_median must be > 0 and {name}_sigma >= 0")
        _check(p.prompt_tokens >= 1, "[profile] prompt_tokens must be >= 1")
        _check(p.context_max > p.prompt_tokens, "[profile] context_max must exceed prompt_tokens")
        _check(
            self.agent.harness != "profile" or p.context_max <= self.train.token_budget,
            f"[profile] context_max ({p.context_max}) is over [train] token_budget "
            f"({self.train.token_budget}): its longest executions could not be trained; raise token_budget "
            "(with [train] chunk_budget to bound the trainer's memory)",
        )
        _check(p.compact_tokens >= 0, "[profile] compact_tokens must be >= 0")
        _check(0 <= p.subagent_share <= 1, "[profile] subagent_share must be in [0, 1]")
        _check(p.tool_s_sigma >= 0, "[profile] tool_s_sigma must be >= 0")

    def _check_tasks(self) -> None:
        k = self.tasks
        _check(0 <= k.eval_fraction < 1, "[tasks] eval_fraction must be in [0, 1)")
        _check(k.reward_timeout_s > 0, "[tasks] reward_timeout_s must be > 0")
        if not k.train:
            _check(
                not (k.eval or k.eval_fraction or k.reward),
                "[tasks] eval, eval_fraction and reward need [tasks] train (your training rows)",
            )
            return
        _check(
            bool(k.reward), '[tasks] reward is required with [tasks] train, e.g. "reward.py:compute_score"'
        )
        _check(
            not (k.eval and k.eval_fraction),
            "[tasks] eval and eval_fraction: give an evaluation file or a held-out fraction, not both",
        )
        _check(
            self.agent.tasks == default_of(AgentSection, "tasks"),
            "[agent] tasks: leave it unset with [tasks] train (the rows are the tasks)",
        )
        _check(
            self.eval.tasks == 0 or bool(k.eval) or k.eval_fraction > 0,
            "[eval] tasks > 0 with [tasks] train needs [tasks] eval or [tasks] eval_fraction",
        )

    def _check_placement(self) -> None:
        c, e = self.cell, self.engine
        _check(c.warmup >= -1, "[cell] warmup must be >= 0, or -1 (2 on a GPU, 0 on the CPU)")
        _check(
            self.proxy.kv_transport in KV_TRANSPORTS,
            f"[proxy] kv_transport must be one of {', '.join(KV_TRANSPORTS)}, got {self.proxy.kv_transport!r}",
        )
        _check(e.max_running >= 1 and e.warmup_tokens >= 0, "[engine] max_running >= 1, warmup_tokens >= 0")
        _check(0 < e.kv_fraction < 1, "[engine] kv_fraction must be in (0, 1)")
        _check(e.slot_widths in ("", "bucketed", "full"), "[engine] slot_widths: bucketed|full")
        _check(e.min_free_gib >= 0, "[engine] min_free_gib must be >= 0 (0: off)")
        _check(e.max_cached_tokens >= 0, "[engine] max_cached_tokens must be >= 0 (0: the engine's default)")
        _check(e.host_cached_tokens >= 0, "[engine] host_cached_tokens must be >= 0 (0: none)")
        _check(e.prefill_chunk >= 0, "[engine] prefill_chunk must be >= 0 (0: the engine's default)")
        _check(
            e.long_context_tokens >= 0 and e.long_context_slots >= 0,
            "[engine] long_context_tokens and long_context_slots must be >= 0 (0: none; the engine's default)",
        )
        _check(
            e.long_context_tokens > 0 or e.long_context_slots == 0,
            "[engine] long_context_slots needs long_context_tokens (the tokens each long slot holds)",
        )
        _check(
            e.decode_slots in ("auto", "graphs", "eager", "off"),
            "[engine] decode_slots: auto|graphs|eager|off",
        )
        if not c.gpus:
            return
        _check(c.device == "cuda", '[cell] gpus needs device = "cuda"')
        _check(
            len(c.gpus) == self.run.cells,
            f"[cell] gpus must name one GPU per cell ({self.run.cells}), got {len(c.gpus)}",
        )
        _check(
            all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in c.gpus),
            f"[cell] gpus must be GPU indices >= 0, got {c.gpus!r}",
        )
        most = max(c.gpus.count(g) for g in c.gpus)
        _check(
            most * e.kv_fraction <= 0.8,
            f"[engine] kv_fraction {e.kv_fraction} x {most} engines on one GPU exceeds 0.8 of its memory",
        )

    def _check_ranks(self) -> None:
        c, n = self.cell, self.run.cells
        _check(
            c.model_backend in ("transformers", "megatron"),
            f"[cell] model_backend must be transformers or megatron, got {c.model_backend!r}",
        )
        for key in ("tensor_parallel", "pipeline_parallel"):
            v = getattr(c, key)
            _check(not v or len(v) == n, f"[cell] {key} must give one entry per cell ({n}), got {len(v)}")
            _check(
                all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v),
                f"[cell] {key} entries must be integers >= 1, got {v!r}",
            )
        _check(
            c.model_backend != "megatron" or c.engine == "gyre",
            '[cell] model_backend = "megatron" needs engine = "gyre" (it loads Megatron-core\'s layout)',
        )
        shapes = [self.cell_shape(i) for i in range(n)]
        if all(s == (1, 1) for s in shapes):
            return
        _check(
            c.model_backend == "megatron",
            '[cell] tensor_parallel / pipeline_parallel above 1 need [cell] model_backend = "megatron"',
        )
        _check(
            c.device == "cpu",
            "[cell] tensor_parallel / pipeline_parallel above 1 run on the CPU (gloo) only: multi-rank "
            'cells on GPUs are not wired into `gyre run` yet (device = "cpu")',
        )
        for i in range(1, n):
            refusal = self.satellite_refusal(i)
            _check(
                refusal is None or not self.may_train(i),
                f"[cell] tensor_parallel / pipeline_parallel: cell {i} is {shapes[i][0]} x {shapes[i][1]}, "
                f"the core {shapes[0][0]} x {shapes[0][1]}: {refusal}; such a cell must be rollout only "
                f'(policy = "async" with cell {i} >= [sched] async_train_cells)',
            )

    def cell_shape(self, i: int) -> tuple[int, int]:
        """(tensor_parallel, pipeline_parallel) of cell `i`'s trainer replica."""
        c = self.cell
        tp = c.tensor_parallel[i] if c.tensor_parallel else TENSOR_PARALLEL
        pp = c.pipeline_parallel[i] if c.pipeline_parallel else PIPELINE_PARALLEL
        return tp, pp

    def satellite_refusal(self, i: int) -> str | None:
        """Why cell `i`'s trainer replica cannot train beside the core's (gyre-train's rule: the core's
        shape, or one rank beside a core of one pipeline stage); None if it can."""
        tp, pp = self.cell_shape(i)
        ctp, cpp = self.cell_shape(0)
        return satellite_refusal(CellShape(tp, pp), CellShape(ctp, cpp))

    def may_train(self, i: int) -> bool:
        """Whether the policy may ever switch cell `i` to training (async trains a fixed set)."""
        return self.run.policy != "async" or i < self.sched.async_train_cells

    @property
    def checkpoints(self) -> bool:
        """Whether the core saves a checkpoint after every step (what `--resume`, a new attempt and the
        exported `policy/` start from): not when its model is split over pipeline stages, which
        gyre-train does not checkpoint (a tensor-parallel core's checkpoint is the one-rank model's)."""
        return self.cell_shape(0)[1] == 1

    @property
    def streams(self) -> bool:
        """Whether this run streams steps: `[driver] streaming`, unless the policy trains whole batches."""
        return self.driver.streaming and self.run.policy not in WHOLE_POOL

    def with_policy(self, policy: str, out_dir: str) -> Config:
        return dataclasses.replace(self, run=dataclasses.replace(self.run, policy=policy, out_dir=out_dir))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def part_names(cells: int) -> list[str]:
    """The names of the processes a launcher places for a run of `cells` cells, in start order."""
    return ["sched", "proxy", *(f"cell-{i}" for i in range(cells))]


def _check_resources(table: dict[str, Any], cells: int) -> None:
    """`[run] ray_resources`: part name -> {resource: amount > 0}; CPU and GPU are the run's own."""
    names = part_names(cells)
    for name, res in table.items():
        key = f"[run] ray_resources.{name}"
        _check(name in names, f"{key}: not a part of this run (parts: {', '.join(names)})")
        _check(isinstance(res, dict), f"{key} must be a table of resource = amount, got {res!r}")
        for rname, amount in res.items():
            _check(
                rname not in ("CPU", "GPU"),
                f"{key}.{rname}: CPU and GPU are set by the run (1 CPU per part, [cell] device's GPUs)",
            )
            ok = isinstance(amount, int | float) and not isinstance(amount, bool) and amount > 0
            _check(ok, f"{key}.{rname} must be a number > 0, got {amount!r}")


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


_SECTIONS = get_type_hints(Config)
"""Section name -> its dataclass (every field of `Config` is a section)."""


def config_from_dict(raw: dict[str, Any]) -> Config:
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in _SECTIONS:
            raise ConfigError(f"unknown section [{key}]; known: {', '.join(_SECTIONS)}")
        kwargs[key] = tables.dataclass_from_table(_SECTIONS[key], key, value, error=ConfigError)
    return Config(**kwargs)


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Read a .toml, .yaml/.yml or .json file, then apply command-line `overrides` (`SECTION.KEY=VALUE`,
    `parse_override`); errors name the file (or the override) and the key. Relative `[tasks]` paths are
    made absolute: from the file's directory, or the current one for an override."""
    p = Path(path)
    raw = _read(p)
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the top level must be a table of sections")
    try:
        _anchor(raw, p.parent)
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc}") from exc
    apply_overrides(raw, overrides)
    try:
        return config_from_dict(raw)
    except ConfigError as exc:
        said = f" (with {' '.join(overrides)})" if overrides else ""
        raise ConfigError(f"{p}{said}: {exc}") from exc


def _read(p: Path) -> Any:
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {p}: {exc.strerror or exc}") from exc
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            return yaml.safe_load(text) or {}
        if p.suffix == ".json":
            return json.loads(text)
        if p.suffix == ".toml":
            return tomllib.loads(text)
        raise ConfigError(f"{p}: use a .toml, .yaml, .yml or .json file")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{p}: {exc}") from exc
    except ImportError as exc:  # pragma: no cover - pyyaml is a dependency
        raise ConfigError(f"{p}: YAML needs pyyaml ({exc})") from exc
    except Exception as exc:
        if type(exc).__module__.startswith("yaml"):
            raise ConfigError(f"{p}: {exc}") from exc
        raise


# ---- paths and command-line overrides ------------------------------------------------------------

_PATHS = ("train", "eval")
"""The `[tasks]` keys that hold a path (and `reward`'s `file.py` part)."""


def _anchor(raw: dict[str, Any], base: Path) -> None:
    """Make the relative paths of `raw`'s `[tasks]` absolute from `base` (in place; bad types are left
    for the table check)."""
    t = raw.get("tasks")
    if not isinstance(t, dict):
        return
    for key in _PATHS:
        v = t.get(key)
        if isinstance(v, str) and v and not Path(v).expanduser().is_absolute():
            t[key] = str((base / v).resolve())
    r = t.get("reward")
    if isinstance(r, str) and ":" in r:
        where, _, fn = r.rpartition(":")
        if where.endswith(".py") and not Path(where).expanduser().is_absolute():
            t["reward"] = f"{(base / where).resolve()}:{fn}"


def parse_override(text: str) -> tuple[str, str, Any]:
    """`SECTION.KEY=VALUE` (Hydra's and verl's habit: `train.lr=1e-5`) as (section, key, value), the value
    read as its field's type: a str field takes the text as it is (or a quoted TOML string), any other a
    TOML value (`1e-5`, `16`, `true`, `[0, 1]`). A malformed override, an unknown section or key, or a
    value of the wrong type is a `ConfigError` naming it."""
    name, eq, value = text.partition("=")
    section, dot, key = name.strip().partition(".")
    if not eq or not dot or not section or not key:
        raise ConfigError(f"override {text!r}: expected SECTION.KEY=VALUE, e.g. train.lr=1e-5")
    if section not in _SECTIONS:
        raise ConfigError(f"override {text!r}: unknown section [{section}]; known: {', '.join(_SECTIONS)}")
    cls = _SECTIONS[section]
    want = {f.name: type(_default(f)) for f in dataclasses.fields(cls)}
    if key not in want:
        raise ConfigError(
            f"override {text!r}: [{section}] unknown key {key!r}; known: {', '.join(sorted(want))}"
        )
    parsed = _toml_value(value)
    if want[key] is str:
        parsed = parsed if isinstance(parsed, str) else value
    elif want[key] is bool and value.strip() in ("True", "False"):
        parsed = value.strip() == "True"
    elif parsed is _NOT_TOML:
        parsed = value
    try:  # the file's own check, on this one key
        tables.dataclass_from_table(cls, section, {key: parsed}, error=ConfigError)
    except ConfigError as exc:
        raise ConfigError(f"override {text!r}: {exc}") from exc
    return section, key, parsed


_NOT_TOML = object()


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _toml_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return _NOT_TOML


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str], base: Path | None = None) -> None:
    """Apply `overrides` (`parse_override`) to the raw table `raw`, in place; their relative `[tasks]`
    paths are taken from `base` (the current directory)."""
    for text in overrides:
        section, key, value = parse_override(text)
        table = raw.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"override {text!r}: [{section}] must be a table, got {type(table).__name__}")
        table[key] = value
        if section == "tasks":
            _anchor({"tasks": table}, base or Path.cwd())
