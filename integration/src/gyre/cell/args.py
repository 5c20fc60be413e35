"""The settings of one cell process (`gyre cell --args JSON`), written by `gyre run` and read by the cell and
its SGLang engine: its place in the run (scheduler, id, ports, run directory, the core's addresses), its
engine and what its trainer replica is configured with. The training settings' defaults are the run
config's (`[train]`, `[agent]`, `[cell]`, `[run]`), so a cell started without them trains as a run would.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre_train.defaults import PIPELINE_PARALLEL, TENSOR_PARALLEL

from gyre.config.runconfig import AgentSection, CellSection, EngineSection, RunSection, TrainSection


@dataclass(frozen=True)
class CellArgs:
    sched: str
    cell_id: int
    is_core: bool
    capacity: int
    model_dir: str
    engine_port: int
    run_dir: str
    core: str = ""
    """The core's ROUTER address (satellites; the core writes its own to core.json)."""
    publisher: str = ""
    lr: float = TrainSection.lr
    token_budget: int = TrainSection.token_budget
    chunk_budget: int = TrainSection.chunk_budget
    loss: str = TrainSection.loss
    tis_cap: float = TrainSection.tis_cap
    mismatch_warn: float = TrainSection.mismatch_warn
    temperature: float = AgentSection.temperature
    release_memory: bool = CellSection.release_memory
    startup_timeout_s: float = RunSection.startup_timeout_s
    device: str = CellSection.device
    engine_argv: tuple[str, ...] = ("--max-running-requests", str(EngineSection.max_running))
    """Further `gyre-engine serve` options (`gyre.system.gpus.engine_argv`: memory, CUDA graphs)."""
    host: str = "127.0.0.1"
    """This node's address, which the engine and the trainer core bind and peers dial (`launch.py`)."""
    engine: str = CellSection.engine
    """gyre (gyre-engine) or sglang (`sglang_cell.py`)."""
    sglang_module: str = CellSection.sglang_module
    token_file: str = ""
    """A file holding the run token (a cell started by a cluster's launcher, e.g. SLURM's srun); empty:
    $GYRE_TOKEN, or none (a loopback scheduler without one)."""
    checkpoint: str = ""
    """Core: the checkpoint directory (resumed from if present, saved after every step); empty: none."""
    keep_batches: str = ""
    """Core: where each applied step's micro-batches are kept (`[train] keep_batches`); empty: nowhere."""
    tensor_parallel: int = TENSOR_PARALLEL
    """Tensor-parallel ranks of this cell's trainer replica (`[cell] tensor_parallel`)."""
    pipeline_parallel: int = PIPELINE_PARALLEL
    """Pipeline stages of this cell's trainer replica (`[cell] pipeline_parallel`)."""
    model_backend: str = CellSection.model_backend
    warmup: int = CellSection.warmup
    """Synthetic micro-batches the trainer replica computes at start (`[cell] warmup`; -1: 2 on a GPU,
    0 on the CPU)."""
    trains: bool = True
    """False: a rollout-only cell (a shape no satellite of the core's may have, and the policy never
    trains it): it starts no trainer replica, only follows the core's weights."""

    @property
    def ranks(self) -> int:
        """The trainer replica's ranks (this process is rank 0)."""
        return self.tensor_parallel * self.pipeline_parallel if self.trains else 1
