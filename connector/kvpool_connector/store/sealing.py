"""Pool keys: what makes a shared tier trustworthy storage.

A shared tier (disk, Redis, S3) is untrusted: whoever can write it could change model
outputs, whoever can read it could read prompts (KV can be inverted). Everything the store
puts there is derived from the pool key, a secret every engine of the pool holds:

- object names: BLAKE3 keyed hash of the caller's key, so nobody without the pool key can
  compute the name of a prompt's chunks (or tell two pools' chunks apart from their names);
- integrity: GMAC (AES-256-GCM authenticating header and payload without encrypting) under
  a per-object key and nonce derived (BLAKE3 keyed) from a random 16-byte salt in the
  header, checked before a byte is served; GMAC runs at ~20 GB/s on CPUs with AES and
  carry-less multiply instructions (4x BLAKE3, 10x HMAC-SHA256), so authenticating costs
  little next to the I/O;
- confidentiality (optional): AES-256-GCM encrypting the payload, with the same per-object
  derivation (its own subkey) and the header as associated data.
A fresh key per object means no nonce is ever reused and no per-key message limit applies.
Subkeys come from the secret with BLAKE3's key derivation mode, one context per purpose.

Rotation: a `Keyring` holds the current key (all writes) and optionally the previous one
(reads only). Objects found under the previous key are served but never sealed again under
the current one into a shared tier: a key is also rotated because it leaked, and what its
holder forged must become a miss once the previous key is removed (docs/connector.md,
Key rotation).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import blake3
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .credentials import secret

MIN_SECRET_CHARS = 32
TAG_SIZE = 16
SALT_SIZE = 16
NAME_SIZE = 32
_CONTEXT = "kvpool.dev 2026-12 store v2 "
_NAME_CACHE = 1 << 16  # names of recent keys: lookups of one prefix repeat every step


class PoolKeyError(ValueError):
    """A pool key that cannot be used (missing, too short); the message names the field."""


class PoolKey:
    """One generation of the pool key and the subkeys derived from it."""

    def __init__(self, secret: bytes) -> None:
        def derive(purpose: str) -> bytes:
            return blake3.blake3(secret, derive_key_context=_CONTEXT + purpose).digest()

        self._name_key = derive("object names")
        self._mac_key = derive("object mac")
        self._enc_key = derive("object encryption")
        self.id = derive("key id")[:8]  # for logs and tests; never a secret
        self._names: dict[bytes, bytes] = {}

    @classmethod
    def ephemeral(cls) -> PoolKey:
        """A random key for a store without shared tiers (its cpu tier lives in-process)."""
        return cls(os.urandom(32))

    def object_name(self, key: bytes) -> bytes:
        name = self._names.get(key)
        if name is None:
            name = blake3.blake3(key, key=self._name_key).digest()
            if len(self._names) >= _NAME_CACHE:
                self._names.clear()
            self._names[key] = name
        return name

    def _params(self, salt: bytes, encrypt: bool) -> tuple[bytes, bytes]:
        """(AES-256 key, 12-byte nonce) of one object, from its random salt."""
        key_material = blake3.blake3(salt, key=self._enc_key if encrypt else self._mac_key
                                     ).digest(length=44)
        return key_material[:32], key_material[32:]

    def authenticator(self, salt: bytes, tag: bytes | None = None):
        """A streaming GMAC: authenticate_additional_data() with header and payload, then
        finalize(); with `tag` it verifies (finalize raises InvalidTag), else `.tag` holds
        the new tag."""
        key, nonce = self._params(salt, False)
        mode = modes.GCM(nonce, tag) if tag is not None else modes.GCM(nonce)
        c = Cipher(algorithms.AES(key), mode)
        return c.decryptor() if tag is not None else c.encryptor()

    def checker(self, salt: bytes, header: bytes, encrypted: bool):
        """A streaming check of an object whose tag arrives last: the header is already
        authenticated; then authenticate_additional_data(piece) for a MAC'd payload or
        update_into(piece, out) for a ciphertext, and finalize_with_tag(tag), which raises
        InvalidTag."""
        key, nonce = self._params(salt, encrypted)
        check = Cipher(algorithms.AES(key), modes.GCM(nonce)).decryptor()
        check.authenticate_additional_data(header)
        return check

    def mac(self, salt: bytes, parts) -> bytes:
        auth = self.authenticator(salt)
        for p in parts:
            auth.authenticate_additional_data(p)
        auth.finalize()
        return auth.tag

    def encrypt_into(self, salt: bytes, header: bytes, payload, out: memoryview) -> None:
        """Ciphertext of payload followed by the GCM tag into out (len(payload) + 16 bytes)."""
        key, nonce = self._params(salt, True)
        AESGCM(key).encrypt_into(nonce, payload, header, out)

    def decrypt_into(self, salt: bytes, header: bytes, sealed, out: memoryview) -> None:
        """Plaintext of ciphertext+tag into out; InvalidTag (out then holds garbage)."""
        key, nonce = self._params(salt, True)
        AESGCM(key).decrypt_into(nonce, sealed, header, out)

    def decryptor(self, salt: bytes, header: bytes, tag: bytes):
        """A streaming GCM decryptor; finalize() raises InvalidTag on a bad tag."""
        key, nonce = self._params(salt, True)
        d = Cipher(algorithms.AES(key), modes.GCM(nonce, tag)).decryptor()
        d.authenticate_additional_data(header)
        return d


@dataclass(frozen=True)
class Keyring:
    current: PoolKey
    previous: PoolKey | None = None
    encrypt: bool = False
    refuse_plaintext: bool = False  # MAC-only objects of a shared tier are misses

    @classmethod
    def from_config(cls, security, needs_key: bool) -> Keyring:
        """The keys a store config names; `needs_key`: the store has shared tiers."""
        cur = secret(security.key_env, security.key_file, "security.key")
        if cur is None:
            if needs_key:
                raise PoolKeyError(
                    "security.key_env or security.key_file: shared tiers (disk, redis, s3) "
                    "need a pool key (a secret of at least 32 characters every engine of the "
                    "pool holds); the operator generates one per pool")
            return cls(PoolKey.ephemeral(), None, security.encrypt)
        prev = secret(security.previous_key_env, security.previous_key_file,
                      "security.previous_key", optional=True)
        return cls(_pool_key(cur, "security.key"),
                   _pool_key(prev, "security.previous_key") if prev else None,
                   security.encrypt, security.refuse_plaintext)

    def generations(self) -> list[PoolKey]:
        return [self.current] + ([self.previous] if self.previous is not None else [])


def _pool_key(value: str, field: str) -> PoolKey:
    if len(value) < MIN_SECRET_CHARS:
        raise PoolKeyError(f"{field}: the pool key must have at least {MIN_SECRET_CHARS} "
                        f"characters, got {len(value)}")
    return PoolKey(value.encode())
