"""The test bed's guard: only tests marked `vllm` start engines (make test-fast skips them)."""

import pytest

def test_an_unmarked_test_cannot_start_an_engine(tiny_model):
    from kvpool_dev.testbed.engine import OfflineEngine, VllmServer

    for engine in (OfflineEngine(tiny_model), VllmServer(tiny_model)):
        with pytest.raises(RuntimeError, match="not marked @pytest.mark.vllm"):
            engine.launch()
