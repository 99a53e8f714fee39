"""Each role's policy (kvmesh/common/roles.py): what the connectors and the shutdown ask of a role."""

from __future__ import annotations

import time

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


def test_prefill_drain_steps_until_nothing_is_held():
    """services/prefill/drain.py: every step may free blocks; the wait ends as soon as none are held."""
    from kvmesh.services.prefill.drain import hand_over

    held = [3]
    steps = []

    def step() -> None:
        steps.append(1)
        held[0] -= 1

    assert hand_over(step, lambda: held[0] > 0, time.monotonic() + 60, pause_s=0) is True
    assert len(steps) == 3 and held[0] == 0


def test_prefill_drain_gives_up_at_the_deadline():
    from kvmesh.services.prefill.drain import hand_over

    steps = []
    assert hand_over(lambda: steps.append(1), lambda: True, time.monotonic() + 0.05, pause_s=0.01) is False
    assert steps  # it stepped while it waited
    assert hand_over(lambda: steps.append(1), lambda: True, time.monotonic() - 1) is False


def test_each_role_command_defaults_to_its_role():
    """`kvmesh prefill|decode` are built in their rooms (services/prefill, services/decode) with their
    role as the default; `kvmesh serve` runs both, and only it has the simulation flags."""
    from kvmesh.cli import build_parser

    p = build_parser()
    for cmd, role in (("serve", "both"), ("prefill", "prefill"), ("decode", "decode")):
        assert p.parse_args([cmd]).role == role
    assert p.parse_args(["serve", "--simulate"]).simulate is True
    with pytest.raises(SystemExit):
        p.parse_args(["prefill", "--simulate"])


def test_the_decode_admission_answers_400_naming_the_field():
    from kvmesh.services.decode.admission import admit_kv_transfer_params
    from kvmesh.services.errors import APIError

    admit_kv_transfer_params(None)
    admit_kv_transfer_params({"do_remote_prefill": True, "remote_block_ids": []})
    with pytest.raises(APIError) as e:
        admit_kv_transfer_params({"do_remote_prefill": True, "remote_block_ids": [1, 1]})
    assert e.value.status == 400 and e.value.param == "kv_transfer_params" and "duplicates" in str(e.value)
