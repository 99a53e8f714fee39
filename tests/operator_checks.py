"""Operator checks shared by test modules (tests/ is on the test runner's path, as for kernel_checks)."""

from __future__ import annotations

import pytest

from kvmesh.common.env import env


def engine_settings_from_args(args: list[str]):
    """Feed rendered container args through the real `kvmesh` CLI parser and the same code the
    server runs (configs_from_args), returning what the engine process would be built with."""
    from kvmesh.cli import build_parser
    from kvmesh.services.api.entry import configs_from_args

    expanded = [a.replace("$(POD_NAME)", "pod-0").replace("$(POD_IP)", "10.0.0.7") for a in args]
    ns = build_parser().parse_args(expanded)
    with pytest.MonkeyPatch.context() as mp:  # the pod gets the KV-path secret from the internal Secret
        mp.setenv("KVMESH_KV_AUTH_KEY", "unit-test-kv-auth-key")
        env.cache_clear()  # the process's variables are read once: read them with the secret, and after without
        try:
            return configs_from_args(ns)
        finally:
            env.cache_clear()
