"""`gyre-train bench`: tree-packed vs path-expanded training, chunked large trees, satellite join."""
