"""The extraArgs guard against secret flags, checked against vLLM's own parser: every spelling it
refuses is one vLLM's `vllm serve` parser reads as --api-key, --hf-token or --config, and the
flags it lets through set none of them. Before, `--api_key`, `--api-ke` and `--hf_token` passed."""

from __future__ import annotations

import functools

import pytest

from kvpool_operator.models import SECRET_ARG_PATTERN, secret_arg
from tests.operator.schema_check import crd_accepts, field_schema

REFUSED = ["--api-key=sk", "--api_key=sk", "--api-ke=sk", "--api_k=sk", "--api-key.x=sk", "--hf-token=t",
           "--hf_token=t", "--hf-tok=t", "--hf_t=t", "--config=/m/c.yaml"]
ALLOWED = ["--api-server-count=1", "--hf-config-path=/m", "--config-format=hf", "--host=0.0.0.0",
           "--hf-overrides={}", "--enable-prompt-tokens-details"]


@functools.cache
def vllm_parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def secrets_read(arg: str) -> dict[str, object]:
    """What vLLM's `vllm serve` parser sets of the secret flags' destinations for `arg`."""
    args = vllm_parser().parse_args(["--model", "m", arg])
    defaults = vllm_parser().parse_args(["--model", "m"])
    return {dest: getattr(args, dest) for dest in ("api_key", "hf_token", "config")
            if getattr(args, dest, None) != getattr(defaults, dest, None)}


@pytest.mark.parametrize("arg", REFUSED)
def test_every_refused_spelling_is_a_secret_flag_to_vllm(arg):
    assert secrets_read(arg), f"vLLM does not read {arg} as a secret flag: the guard need not refuse it"
    assert secret_arg(arg)


@pytest.mark.parametrize("arg", ALLOWED)
def test_flags_that_set_no_secret_pass(arg):
    assert secrets_read(arg) == {}
    assert not secret_arg(arg)


def test_the_crd_rule_and_the_model_read_one_pattern():
    schema = field_schema("model")
    for arg in REFUSED + ALLOWED:
        pool_model = {"name": "m", "gpus": 1, "tensorParallelSize": 1, "extraArgs": [arg]}
        assert crd_accepts(schema, pool_model) is not secret_arg(arg), arg
    assert "'" not in SECRET_ARG_PATTERN and "\\" not in SECRET_ARG_PATTERN  # a plain CEL string literal
    # ambiguous prefixes (vLLM's parser exits on them) are refused as well: no spelling is left to try
    assert secret_arg("--conf=/m/c.yaml") and secret_arg("--a")
