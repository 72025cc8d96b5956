"""kvoffload.vllm.KVOffloadConnector through vLLM 0.33's own layout resolution
(resolve_kv_cache_layout): the connector's BLHNC is taken where every backend supports
it, and dropped for the backends' first choice where one does not (as on vLLM's CPU
backend, which tests/vllm/vllm_engine_test.py runs); canonical_layout keeps
OffloadingConnector's. VLLM_KV_CACHE_LAYOUT still wins."""

import types

import pytest

import vllm_env

if vllm_env.LIGHT:
    pytest.skip("the light vLLM bundle has no vllm.config", allow_module_level=True)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

from kvoffload.vllm import KVOffloadConnector


def resolved(connector, supported, monkeypatch, env=None, extra=None):
    """The layout vLLM resolves for a model whose backends support ``supported``."""
    if env is None:
        monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    else:
        monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", env)
    path = None if connector == "OffloadingConnector" else "kvoffload.vllm"
    transfer = types.SimpleNamespace(kv_connector=connector, kv_connector_module_path=path,
                                     kv_connector_extra_config=extra or {})
    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(kv_cache_layout=None),
                                   attention_config=types.SimpleNamespace(hisparse_config=None),
                                   kv_transfer_config=transfer)
    return resolve_kv_cache_layout(config, [supported]).name


def test_the_factory_finds_the_connector_by_its_module_path():
    transfer = types.SimpleNamespace(kv_connector="KVOffloadConnector", kv_connector_module_path="kvoffload.vllm")
    assert KVConnectorFactory.get_connector_class(transfer) is KVOffloadConnector
    assert issubclass(KVOffloadConnector, OffloadingConnector)


@pytest.mark.parametrize("supported,want", [
    (["LBHNC", "BLHNC"], "BLHNC"),   # GPU backends that take any layout: the connector's
    (["LBNHC", "LBHNC", "BLHNC"], "BLHNC"),
    (["LBHNC"], "LBHNC"),            # vLLM's CPU backend: its own, with a warning
    (["LBNHC", "LBHNC"], "LBNHC"),
])
def test_vllm_takes_blhnc_where_every_backend_supports_it(supported, want, monkeypatch):
    assert resolved("KVOffloadConnector", supported, monkeypatch) == want
    # vLLM's own connector asks for LBHNC.
    assert resolved("OffloadingConnector", supported, monkeypatch) == "LBHNC"


def test_the_environment_variable_still_wins(monkeypatch):
    assert resolved("KVOffloadConnector", ["LBHNC", "BLHNC"], monkeypatch, env="LBHNC") == "LBHNC"
    with pytest.raises(ValueError, match="VLLM_KV_CACHE_LAYOUT=BLHNC does not satisfy"):
        resolved("KVOffloadConnector", ["LBHNC"], monkeypatch, env="BLHNC")


def test_canonical_layout_keeps_offloading_connectors_layout(monkeypatch):
    # vLLM's canonical per-layer pages refuse a packed (BLHNC) cache.
    assert resolved("KVOffloadConnector", ["LBHNC", "BLHNC"], monkeypatch, extra={"canonical_layout": True}) == "LBHNC"
    assert resolved("KVOffloadConnector", ["LBHNC", "BLHNC"], monkeypatch, extra={"canonical_layout": False}) == "BLHNC"
