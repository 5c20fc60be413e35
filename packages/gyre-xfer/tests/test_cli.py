"""The `gyre-xfer` command: `doctor` moves real bytes over Mooncake on loopback and says which wheel it uses."""

from __future__ import annotations

import json

import pytest
from gyre_xfer.cli import main


@pytest.mark.mooncake
def test_doctor_reports_a_working_mooncake(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["doctor"])
    assert exit_info.value.code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["mooncake"] == "ok"
    assert report["mooncake_wheel"] == "mooncake-transfer-engine-non-cuda"
    assert all(e.startswith("127.0.0.1:") for e in report["endpoints"])


def test_token_prints_a_new_random_token(capsys: pytest.CaptureFixture[str]) -> None:
    main(["token"])
    main(["token"])
    first, second = capsys.readouterr().out.split()
    assert len(first) == 43 and first != second
