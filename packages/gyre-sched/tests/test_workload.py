"""Workloads are read section by section with gyre-base's strict table loader: its errors name the
section and the key, and the workload module raises the loader's own `ConfigError`."""

from __future__ import annotations

import pytest
from gyre_base.tables import ConfigError
from gyre_sched import workload


def test_the_workload_loader_raises_the_tables_error() -> None:
    assert workload.ConfigError is ConfigError


def test_workload_sections_use_it() -> None:
    with pytest.raises(ConfigError, match=r"^\[async\] train_cells must be int, got '1'$"):
        workload.workload_from_dict({"async": {"train_cells": "1"}})
    with pytest.raises(ConfigError, match=r"^\[elastic\] must be a table, got list$"):
        workload.workload_from_dict({"elastic": []})
    w = workload.workload_from_dict({"async": {"train_cells": 2}, "run": {"timeout_h": 3}})
    assert w.async_.train_cells == 2 and w.run.timeout_h == 3.0
