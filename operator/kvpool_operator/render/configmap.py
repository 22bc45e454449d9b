"""ConfigMap `<name>-kvpool`: the store config the connector reads (no secrets in it)."""

from __future__ import annotations

import json
from typing import Any

import yaml

from kvpool_operator.render.common import Pool
from kvpool_operator.render.connector import kv_transfer_config, mounted_store_config


def config_data(pool: Pool) -> dict[str, str]:
    """The ConfigMap's data; also what the engine's config checksum covers."""
    data = {"kv-transfer-config.json": json.dumps(kv_transfer_config(pool), separators=(",", ":"))}
    store = mounted_store_config(pool)
    if store is not None:
        data["connector.yaml"] = yaml.safe_dump(store, sort_keys=False)
    return data


def render_configmap(pool: Pool) -> list[dict[str, Any]]:
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": pool.meta(pool.config_map, "engine"),
            "data": config_data(pool),
        }
    ]
