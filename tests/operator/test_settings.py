"""Operator settings from the environment (what the Helm chart sets)."""

from __future__ import annotations

import pytest

from kvpool_operator.settings import Settings, SettingsError


def test_from_env_reads_prefixed_variables():
    s = Settings.from_env({
        "KVPOOL_CONNECTOR_IMAGE": "reg/vllm:1", "KVPOOL_NAMESPACES": "a, b,,c", "KVPOOL_LOG_FORMAT": "json",
        "KVPOOL_RECONCILE_INTERVAL": "60", "KVPOOL_REDIS_IMAGE": "", "UNRELATED": "x",
    })
    assert s.connector_image == "reg/vllm:1" and s.namespaces == ("a", "b", "c")
    assert s.log_format == "json" and s.reconcile_interval == 60.0
    assert s.redis_image == Settings().redis_image  # empty keeps the default


def test_bad_values_name_the_variable_in_one_line():
    """The operator's pod and `kvpool render` read these: an error names the variable as set."""
    with pytest.raises(SettingsError, match=r"^KVPOOL_LOG_FORMAT='xml': Input should be 'plain', 'json' or 'full'$"):
        Settings.from_env({"KVPOOL_LOG_FORMAT": "xml"})
    with pytest.raises(SettingsError, match=r"^KVPOOL_RECONCILE_INTERVAL='-1': Input should be greater than 0$"):
        Settings.from_env({"KVPOOL_RECONCILE_INTERVAL": "-1"})
    with pytest.raises(SettingsError) as exc:
        Settings.from_env({"KVPOOL_RETRY_DELAY": "soon", "KVPOOL_ALLOWED_HOST_PATH_PREFIXES": "mnt"})
    assert "\n" not in str(exc.value)
    assert "KVPOOL_RETRY_DELAY='soon'" in str(exc.value) and "KVPOOL_ALLOWED_HOST_PATH_PREFIXES='mnt'" in str(exc.value)


def test_a_misspelled_variable_is_named_and_the_engines_own_are_not():
    from kvpool_operator.settings import misspelled

    assert misspelled({"KVPOOL_RETRY_DELAYS": "5", "KVPOOL_REDIS_PASSWORD": "x", "KVPOOL_DTYPE": "bfloat16",
                       "KVPOOL_TEST_POOL_KEY": "k", "OTHER": "1"}) == [
        "KVPOOL_RETRY_DELAYS is not an operator setting (ignored); did you mean KVPOOL_RETRY_DELAY?"]
