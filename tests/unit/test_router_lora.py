"""The router's view of a pod's LoRA adapters, from the pod's /metrics text, and how it scores them."""

from __future__ import annotations

import pytest

from kvmesh.services.router.config import PodSpec, ScoringWeights, lora_paths
from kvmesh.services.router.policy import Pod, score_pods
from kvmesh.services.router.scrape import LoRAState, parse_lora_state

pytestmark = pytest.mark.unit

METRICS = """\
# HELP vllm:lora_requests_info Running stats on LoRA requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql,chat",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",waiting_lora_adapters="x"} 1.6e9
# HELP kvmesh:lora_adapter_info The LoRA adapters the pod has registered.
# TYPE kvmesh:lora_adapter_info gauge
kvmesh:lora_adapter_info{key="sql@ab",lora_name="sql",model_name="m"} 1.0
kvmesh:lora_adapter_info{key="chat@cd",lora_name="chat",model_name="m"} 1.0
kvmesh:lora_adapter_info{key="gone@ef",lora_name="gone",model_name="m"} 0.0
vllm:num_requests_running{model_name="m"} 2.0
"""


def test_a_pods_adapters_come_from_its_metrics():
    st = parse_lora_state(METRICS)
    assert st.registered == {"sql", "chat"}  # a series at 0 is not an adapter the pod holds
    assert st.active == {"sql", "chat"}  # the latest lora_requests_info series only (vLLM keeps old ones)
    assert st.max_loras == 4
    assert dict(st.keys) == {"sql": "sql@ab", "chat": "chat@cd"}
    assert parse_lora_state("vllm:num_requests_running 1\n") == LoRAState()  # LoRA off: nothing


def test_a_pod_holding_the_adapter_on_its_device_wins_a_tie():
    pods = [Pod(PodSpec(f"http://p{i}", "both")) for i in range(2)]
    w = ScoringWeights()
    for _ in range(8):  # with equal load and no hit, the rotation would alternate
        assert score_pods(pods, {}, 100, 16, w, resident={"http://p1"}).pod.url == "http://p1"


def test_router_lora_modules_are_name_equals_path():
    assert lora_paths(("a=/x/a", "b=/y")) == {"a": "/x/a", "b": "/y"}
    with pytest.raises(ValueError, match="NAME=PATH"):
        lora_paths(("nopath",))
