"""`python -m gyre_engine` is `gyre-engine`."""

from gyre_engine.cli import main

main()
