"""Run by `test_testing.py` in a pytest of its own (not collected here: no `test_` prefix), with
$GYRE_TOKEN set in its environment: what the plugin's fixtures give a test."""

from __future__ import annotations

import ipaddress
import os

from gyre_base.token import TOKEN_ENV


def test_no_token_clears_it(no_token: None) -> None:
    assert TOKEN_ENV not in os.environ


def test_without_the_fixture_it_is_there() -> None:
    assert os.environ.get(TOKEN_ENV) == "base-test-token-0123456789abcdef"


def test_beyond_loopback_is_not_loopback(beyond_loopback: str) -> None:
    assert not ipaddress.ip_address(beyond_loopback).is_loopback
