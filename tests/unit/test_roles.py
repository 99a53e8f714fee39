"""Each role's policy (kvmesh/common/roles.py): what the connectors and the shutdown ask of a role."""

from __future__ import annotations

import pytest

from kvmesh.common.roles import POLICIES, ROLES, policy_for

pytestmark = pytest.mark.unit


def test_every_role_has_one_policy_named_for_it():
    assert tuple(POLICIES) == ROLES and all(policy_for(r).role == r for r in ROLES)


def test_prefill_serves_reads_and_decode_pulls():
    assert policy_for("prefill").serves_remote_reads and not policy_for("prefill").pulls_remote_kv
    assert policy_for("decode").pulls_remote_kv and not policy_for("decode").serves_remote_reads
    assert policy_for("prefill").drain_waits_for_leases and not policy_for("decode").drain_waits_for_leases


def test_an_unknown_role_is_refused_by_name():
    with pytest.raises(ValueError, match="role must be one of"):
        policy_for("encode")
