"""The `--kv-transfer-config` contract at engine start: an invalid connector config stops
the engine with a message naming the field (never a silently disabled cache)."""

from __future__ import annotations

import pytest

from kvpool_dev.testbed.engine import OfflineEngine

from .conftest import kv_config

pytestmark = [pytest.mark.vllm]


def test_invalid_config_fails_engine_start_naming_the_field(tiny_model, baseline):
    """(Every other invalid value is covered, without an engine, in tests/connector.)"""
    cfg = kv_config([{"type": "cpu", "size": "64Mi"}], "startup")
    cfg["kv_connector_extra_config"]["chunk_tokens"] = 200
    message = ("kv_connector_extra_config.chunk_tokens: 200 is not a multiple of vLLM's "
               "block size 128")
    eng = OfflineEngine(tiny_model, kv_transfer_config=cfg)
    with pytest.raises(RuntimeError):
        eng.start()
    try:
        assert message in eng.log_path.read_text(errors="replace")
    finally:
        eng.stop()
