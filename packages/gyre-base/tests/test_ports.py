"""`gyre_base.ports`: picks lie below the kernel's ephemeral range and bind; the kernel's own picks never
land there; a port something holds is never handed out; no room below the range falls back to the
kernel's pick."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from gyre_base import ports


def _range_file(tmp_path: Path, lo: int, hi: int) -> Path:
    p = tmp_path / "ip_local_port_range"
    p.write_text(f"{lo}\t{hi}\n")
    return p


def test_picks_lie_below_the_ephemeral_range_and_bind() -> None:
    lo, hi = ports.ephemeral_range()
    span = ports.pick_range()
    if span is None:
        pytest.skip(f"this machine's ephemeral range {lo}-{hi} leaves no room below it")
    picked = ports.free_ports("127.0.0.1", 20)
    assert len(set(picked)) == 20
    for p in picked:
        assert span[0] <= p < span[1] < hi
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free: the child that gets it can bind it


def test_the_kernels_own_picks_never_land_where_free_port_picks() -> None:
    """What made a pick unsafe: outgoing connections and port-0 binds take ports from the ephemeral range,
    and a port picked there and closed can be theirs before the child binds it."""
    span = ports.pick_range()
    if span is None:
        pytest.skip("no room below this machine's ephemeral range")
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(64)
        clients = [socket.create_connection(srv.getsockname()) for _ in range(50)]
        try:
            taken = [c.getsockname()[1] for c in clients]
        finally:
            for c in clients:
                c.close()
        assert not [p for p in [*taken, srv.getsockname()[1]] if span[0] <= p < span[1]]


def test_a_held_port_is_never_handed_out(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = _range_file(tmp_path, 32768, 60999)
    start, end = ports.pick_range(path) or (0, 0)
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        for p in range(start, end):  # a port in the pick range that this test can hold
            try:
                held.bind(("127.0.0.1", p))
                break
            except OSError:
                continue
        held.listen(1)
        port = held.getsockname()[1]
        assert not ports.binds("127.0.0.1", port)

        class Rigged:  # offers the held port twice, then the ports after it
            def __init__(self) -> None:
                self.offers = [port, port, *range(port + 1, port + 60)]

            def randrange(self, a: int, b: int) -> int:
                return self.offers.pop(0)

        monkeypatch.setattr(ports, "_rng", Rigged())
        got = ports.free_port("127.0.0.1", path=path)
        assert got != port and start <= got < end


def test_no_room_below_the_range_falls_back_to_the_kernels_pick(tmp_path: Path) -> None:
    lo, hi = ports.ephemeral_range()
    path = _range_file(tmp_path, 10500, 65000)  # below 10000 is not picked from: 500 ports, too few
    assert ports.pick_range(path) is None
    p = ports.free_port("127.0.0.1", path=path)
    assert lo <= p <= hi  # where the kernel picks on this machine


def test_an_unreadable_range_is_linuxs_default(tmp_path: Path) -> None:
    assert ports.ephemeral_range(tmp_path / "missing") == ports.DEFAULT_EPHEMERAL
    bad = tmp_path / "bad"
    bad.write_text("not numbers")
    assert ports.ephemeral_range(bad) == ports.DEFAULT_EPHEMERAL
    assert ports.pick_range(tmp_path / "missing") == (20768, 32768)
