"""`gyre-xfer bench`: wrapper against raw Mooncake, plain TCP, memcpy and shared memory, side by side."""
