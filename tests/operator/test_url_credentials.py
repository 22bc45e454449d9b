"""No credential, TLS switch or other client option reaches a backend through its URL, however it
is spelled: percent-encoded, in another case, repeated, behind a fragment or as userinfo.

redis-py percent-decodes every query key of a URL and passes it to the connection as an argument
that wins over the tier's own (`?%70assword=x` is the password, `?ssl_cert_reqs=none` turns TLS
verification off). redis-py's own URL parser is the oracle here: whatever the operator's model,
the CRD's CEL rule or the connector's config accepts, redis-py reads as nothing but host, port,
database and TLS on/off. The model and the CRD accept exactly the same URLs.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given, settings as hsettings, strategies as st
from pydantic import ValidationError
from redis.connection import parse_url

from kvpool_connector.config import RedisTierConfig, S3TierConfig
from kvpool_operator import models
from tests.operator.schema_check import crd_accepts, field_schema

SENTINEL = "s3cr3t"
# What redis-py may make of an accepted URL: where the server is, which database, TLS or not.
HARMLESS = {"host", "port", "db", "connection_class"}


REDIS_URL_SCHEMA = field_schema("tiers", "redis", "external", "url")
S3_ENDPOINT_SCHEMA = field_schema("tiers", "s3", "external", "endpoint")


def model_accepts(model: type, **fields: Any) -> bool:
    try:
        model.model_validate(fields)
    except ValidationError:
        return False
    return True


def _spell(text: str) -> st.SearchStrategy[str]:
    """`text` with each character kept, case-flipped or percent-encoded (upper or lower hex)."""
    def variants(c: str) -> list[str]:
        return sorted({c, c.upper(), c.lower(), f"%{ord(c):02X}", f"%{ord(c):02x}"})
    return st.tuples(*(st.sampled_from(variants(c)) for c in text)).map("".join)


KEYS = st.sampled_from(["db", "password", "username", "ssl_cert_reqs", "ssl_check_hostname",
                        "socket_timeout", "health_check_interval", "user"]).flatmap(_spell)
VALUES = st.sampled_from(["0", "3", "none", "false", SENTINEL, ""])
QUERIES = st.lists(st.tuples(KEYS, VALUES), max_size=3).map(
    lambda pairs: "?" + "&".join(f"{k}={v}" for k, v in pairs) if pairs else "")
USERINFO = st.sampled_from(["", "u@", f"u:{SENTINEL}@", f":{SENTINEL}@", f"%75:{SENTINEL}@", "@"])
HOSTS = st.sampled_from(["r", "r.example:6380", "10.0.0.1:6379", "[fd00::1]:6379"])
FRAGMENTS = st.sampled_from(["", "#", "#x", f"#{SENTINEL}", f"#?password={SENTINEL}"])
REDIS_URLS = st.builds(lambda scheme, user, host, path, query, frag: f"{scheme}://{user}{host}{path}{query}{frag}",
                       st.sampled_from(["redis", "rediss"]), USERINFO, HOSTS,
                       st.sampled_from(["", "/", "/0", "/3"]), QUERIES, FRAGMENTS)
S3_URLS = st.builds(lambda scheme, user, host, path, query, frag: f"{scheme}://{user}{host}{path}{query}{frag}",
                    st.sampled_from(["http", "https"]), USERINFO, HOSTS,
                    st.sampled_from(["", "/", "/s3", "/a@b"]), QUERIES, FRAGMENTS)


def redis_reads(url: str) -> set[str] | None:
    """The connection arguments redis-py takes from `url` (None: it refuses the URL)."""
    try:
        return set(parse_url(url))
    except ValueError:
        return None


@hsettings(max_examples=400, deadline=None)
@given(REDIS_URLS)
@example("redis://host/0?%70assword=" + SENTINEL)  # a percent-encoded key redis-py decodes to `password`
@example("rediss://host/0?ssl_cert_reqs=none")
@example("redis://host/0?db=1&PASSWORD=" + SENTINEL)
@example("redis://host/0?d%62=1")
@example("redis://r?%64%62=none")  # `db` that redis-py cannot read as a number
def test_redis_url_carries_nothing_but_the_server(url):
    model = model_accepts(models.ExternalRedis, url=url)
    crd = crd_accepts(REDIS_URL_SCHEMA, url)
    connector = model_accepts(RedisTierConfig, url=url)
    assert model == crd, f"model {'accepts' if model else 'refuses'}, CRD {'accepts' if crd else 'refuses'}: {url}"
    read = redis_reads(url)
    leaky = read is None or not read <= HARMLESS or "#" in url
    if model:
        assert connector, f"the CRD accepts what the connector refuses: {url}"
    for accepted, who in ((model, "model"), (connector, "connector")):
        if accepted:
            assert read is not None and read <= HARMLESS, f"{who} accepts {url}: redis-py reads {sorted(read or ())}"
            assert SENTINEL not in url and "#" not in url, url
    if leaky and read is not None:  # redis-py would take more than the server from it
        assert not connector and not model, url


@hsettings(max_examples=200, deadline=None)
@given(S3_URLS)
@example("https://s3.example/?%70assword=" + SENTINEL)
@example("https://s3.example#" + SENTINEL)
def test_s3_endpoint_carries_nothing_but_the_server(url):
    model = model_accepts(models.ExternalS3, endpoint=url, bucket="kvb")
    crd = crd_accepts(S3_ENDPOINT_SCHEMA, url)
    connector = model_accepts(S3TierConfig, endpoint=url, bucket="kvb")
    assert model == crd, f"model {'accepts' if model else 'refuses'}, CRD {'accepts' if crd else 'refuses'}: {url}"
    if model:
        assert connector, f"the CRD accepts what the connector refuses: {url}"
    for accepted in (model, connector):
        if accepted:
            assert "?" not in url and "#" not in url and SENTINEL not in url, url


@pytest.mark.parametrize("url,message", [
    ("redis://r/0?%70assword=x", "query key 'password'"),
    ("redis://r/0?db=1&db=2&Username=u", "query key 'Username'"),
    ("redis://r/0#x", "fragment"),
    ("redis://u@r/0", "credentials"),
    ("redis://r?%64%62=none", "query key 'db' must be a whole number"),
])
def test_the_connector_names_the_problem(url, message):
    with pytest.raises(ValidationError) as exc:
        RedisTierConfig(url=url)
    assert message in str(exc.value) and "url:" in str(exc.value)
