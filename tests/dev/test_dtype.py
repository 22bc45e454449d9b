"""The test bed's engine dtype: bf16 only where the CPU computes it natively."""

import pytest

from kvpool_dev.testbed import dtype as d

EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 avx avx2 fma f16c vaes vpclmulqdq
"""
SAPPHIRE_RAPIDS = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile
"""
GRAVITON3 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd sve bf16 i8mm
CPU part\t: 0xd40
"""


def probe_of(bf16: float, fp32: float):
    calls = []

    def probe(name: str) -> float:
        calls.append(name)
        return {"bfloat16": bf16, "float32": fp32}[name]
    return probe, calls


def test_avx2_cpu_gets_float32_without_probing():
    probe, calls = probe_of(1.0, 1.0)
    choice = d.decide(d.cpu_flags(EPYC_AVX2), d.cpu_model(EPYC_AVX2), None, probe)
    assert choice.dtype == "float32" and calls == []
    assert "no native bf16" in choice.describe() and "AMD EPYC" in choice.describe()


@pytest.mark.parametrize("info", [SAPPHIRE_RAPIDS, GRAVITON3])
def test_native_bf16_confirmed_by_the_probe(info):
    probe, calls = probe_of(bf16=180.0, fp32=100.0)
    choice = d.decide(d.cpu_flags(info), d.cpu_model(info), None, probe)
    assert choice.dtype == "bfloat16" and sorted(calls) == ["bfloat16", "float32"]
    assert "180.0" in choice.describe()


def test_flag_without_speed_falls_back_to_float32():
    probe, _ = probe_of(bf16=10.0, fp32=100.0)
    choice = d.decide(d.cpu_flags(SAPPHIRE_RAPIDS), "x", None, probe)
    assert choice.dtype == "float32" and "measured slow" in choice.reason


def test_override_wins_and_bad_values_name_the_variable():
    probe, calls = probe_of(1.0, 1.0)
    assert d.decide(d.cpu_flags(EPYC_AVX2), "x", "BFloat16", probe).dtype == "bfloat16"
    assert calls == []
    with pytest.raises(d.DtypeError, match="KVPOOL_DTYPE='bf8'"):
        d.decide(frozenset(), "x", "bf8", probe)
    with pytest.raises(d.DtypeError, match="--dtype='half'"):
        d.engine_dtype("half")
    assert d.engine_dtype("float32") == "float32"


def test_choose_reads_the_environment():
    assert d.choose({d.ENV: "float16"}).dtype == "float16"


def test_probe_measures_something():
    assert d.matmul_gflops("float32", n=64, seconds=0.01) > 0


def test_bench_order_alternates_arms():
    from kvpool_dev.bench.dtype_bench import order, report

    assert order(2) == ["bfloat16", "float32", "float32", "bfloat16"]
    text = report({"bfloat16": [2.0, 4.0], "float32": [0.5, 0.5]}, 256, "float32")
    assert "float32 / bfloat16: 6.0x" in text

