"""Credentials from where a config names them: an environment variable or a mounted file.

The one lookup of every secret the store reads (the pool key, a Redis password, S3 keys):
configs name the source, never the value, so no secret sits in a manifest or a log. Its
own module, importing nothing of the store, so the key handling (sealing.py) and the tiers
both use it without importing each other.
"""

from __future__ import annotations

import os


def secret(env_name: str | None, file_name: str | None = None, field: str = "",
           optional: bool = False) -> str | None:
    """A secret from an environment variable or a file. A named but missing source is an
    error, or None when `optional` (a rotation's previous key that is not set)."""
    if file_name:
        try:
            with open(file_name) as f:
                value = f.read().strip()
        except FileNotFoundError:
            if optional:
                return None
            raise ValueError(f"{field}_file: cannot read {file_name}: no such file") from None
        except OSError as e:
            raise ValueError(f"{field}_file: cannot read {file_name}: {e.strerror}") from e
        return value or (None if optional else value)
    if env_name:
        val = os.environ.get(env_name)
        if val is None or (optional and not val):
            if optional:
                return None
            raise ValueError(f"{field}_env: environment variable {env_name} is not set")
        return val
    return None
