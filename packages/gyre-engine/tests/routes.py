"""Every route gyre-engine serves, with its methods (checked against the app itself in
`test_auth.py::test_the_route_list_is_the_apps`), for tests that must cover them all."""

from __future__ import annotations

ROUTES: list[tuple[str, tuple[str, ...]]] = [
    ("/generate", ("POST",)),
    ("/v1/loads", ("GET",)),
    ("/abort_request", ("POST",)),
    ("/pause_generation", ("POST",)),
    ("/continue_generation", ("POST",)),
    ("/begin_weight_update", ("POST",)),
    ("/end_weight_update", ("POST",)),
    ("/update_weights_from_tensor", ("POST",)),
    ("/update_weights_from_disk", ("POST",)),
    ("/init_weights_update_group", ("POST",)),
    ("/update_weights_from_distributed", ("POST",)),
    ("/destroy_weights_update_group", ("POST",)),
    ("/release_memory_occupation", ("POST",)),
    ("/resume_memory_occupation", ("POST",)),
    ("/flush_cache", ("GET", "POST")),
    ("/model_info", ("GET",)),
    ("/get_model_info", ("GET",)),
    ("/get_server_info", ("GET",)),
    ("/get_weights_by_name", ("GET", "POST")),
    ("/server_info", ("GET",)),
    ("/health", ("GET",)),
    ("/health_generate", ("GET",)),
    ("/ready", ("GET",)),
    ("/export_prefix", ("POST",)),
    ("/import_prefix", ("POST",)),
    ("/update_weights_from_xfer", ("POST",)),
    ("/offer_prefix", ("POST",)),
    ("/import_prefix_xfer", ("POST",)),
    ("/release_prefix_offer", ("POST",)),
]
