"""The environment `make setup` builds: imports that used to break, and the tool binaries."""

from __future__ import annotations

import json
import subprocess
import sys


def test_vllm_and_transformers_import_together():
    # torchvision beside the CPU torch build breaks this import ("torchvision::nms").
    code = "import vllm; from transformers import LlamaConfig; import torch; print(torch.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("+cpu")


def test_helm_version(helm):
    out = subprocess.run([str(helm), "version", "--short"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("v4."), out.stdout


def test_kubectl_client_version(kubectl):
    out = subprocess.run([str(kubectl), "version", "--client", "-o", "json"],
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["clientVersion"]["minor"].startswith("35")


def test_redis_fixture_password(redis_server):
    import redis

    good = redis.Redis.from_url(redis_server.url, password=redis_server.password)
    good.set("kvpool:probe", b"\x00\x01payload")
    assert good.get("kvpool:probe") == b"\x00\x01payload"
    bad = redis.Redis.from_url(redis_server.url, password="wrong-" + redis_server.password)
    try:
        bad.ping()
    except (redis.exceptions.AuthenticationError, redis.exceptions.ResponseError) as exc:
        assert "WRONGPASS" in str(exc) or "invalid" in str(exc).lower()
    else:
        raise AssertionError("a wrong password was accepted")


def test_s3_fixture_put_get_list(s3_server):
    s3 = s3_server.client()
    s3.put_object(Bucket=s3_server.bucket, Key="probe/a", Body=b"hello")
    s3.put_object(Bucket=s3_server.bucket, Key="probe/b", Body=b"world")
    assert s3.get_object(Bucket=s3_server.bucket, Key="probe/a")["Body"].read() == b"hello"
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=s3_server.bucket, Prefix="probe/")["Contents"]]
    assert keys == ["probe/a", "probe/b"]


def test_generated_tiny_model_has_chat_template(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert "<|user|>" in text and text.endswith("<|assistant|>\n")
    ids = tok("The quick brown fox")["input_ids"]
    assert tok.decode(ids) == "The quick brown fox"
