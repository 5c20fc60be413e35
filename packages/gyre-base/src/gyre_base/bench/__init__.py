"""`gyre-base bench`: what the run token costs a ZeroMQ link (CURVE + ZAP against NULL), side by side."""
