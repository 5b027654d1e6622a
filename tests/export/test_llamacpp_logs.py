"""Reading llama.cpp's logs (no build needed): rounds of speculative decoding, the CPU backend variant a run loaded,
and the portable build script's promises (no native flags, no AMX variant, a smoke check before the stamp)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dflashkit.export import llamacpp

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_llamacpp.sh"

LOG = """\
load_backend: loaded CPU backend from /root/.cache/dflashkit/llama.cpp-11434/bin/libggml-cpu-haswell.so
draft candidate 0, pos   0:    330
draft candidate 0, pos   1:   1789
draft candidate 0, pos   2:     28
accepted 2/3 draft tokens, the last target token is: (5)
draft candidate 0, pos   0:     11
draft candidate 0, pos   1:     12
accepted 0/2 draft tokens, the last target token is: (13)
"""


def test_rounds_and_committed_ids_are_read_from_the_log():
    rounds = llamacpp.parse_speculative_log(LOG)
    assert [(r.draft, r.accepted, r.last) for r in rounds] == [([330, 1789, 28], 2, 5), ([11, 12], 0, 13)]
    run = llamacpp.SpecRun(text="", rounds=rounds, log=LOG)
    assert run.generated_ids == [330, 1789, 5, 13] and run.tau == 2.0


@pytest.mark.parametrize(
    ("log", "variant"),
    [
        (LOG, "haswell"),
        ("load_backend: loaded CPU backend from C:\\llama\\ggml-cpu-skylakex.dll\n", "skylakex"),
        (
            "load_backend: loaded CPU backend from ./libggml-cpu-x64.so\nload_backend: loaded CPU backend from "
            "./libggml-cpu-zen4.so\n",
            "zen4",
        ),
        # without the loader's line: the features of the loaded backend, as system_info lists them
        (
            "0.01 I system_info: n_threads = 2 / 2 | CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | "
            "FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |\n",
            "haswell",
        ),
        (
            "system_info: CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | AVX512_VBMI = 1 | "
            "AVX512_VNNI = 1 | AVX512_BF16 = 1 | REPACK = 1 |\n",
            "zen4",
        ),
        ("llama_completion: llama backend init\n", None),
    ],
)
def test_cpu_variant_is_read_from_the_log(log, variant):
    assert llamacpp.cpu_variant(log) == variant
    assert llamacpp.SpecRun(text="", log=log).cpu_variant == variant


def test_missing_build_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMACPP_HOME", str(tmp_path / "nowhere"))
    assert not llamacpp.built()
    with pytest.raises(llamacpp.LlamaCppError, match=r"scripts/build_llamacpp\.sh"):
        llamacpp.run_plain("model.gguf", "hi")


def test_build_script_is_portable_and_smoke_checked():
    text = SCRIPT.read_text()
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    for flag in ("-DGGML_NATIVE=OFF", "-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON"):
        assert flag in text
    assert "-DGGML_NATIVE=ON" not in text
    assert "/ggml_add_cpu_backend_variant(sapphirerapids/d" in text  # the AMX variant is left out
    smoke, stamp = text.index("smoke check"), text.rindex('>"$STAMP"')
    assert smoke < stamp and text.count("llama-completion") >= 2  # Q4_1 and F32 run before the stamp


def _fake_build(home: Path, tools: list[str]) -> None:
    (home / "bin").mkdir(parents=True)
    for name in tools:
        (home / "bin" / name).write_text("#!/bin/sh\n")
        (home / "bin" / name).chmod(0o755)
    (home / ".built").write_text("earlier build\n")


def _script_tools() -> list[str]:
    line = next(x for x in SCRIPT.read_text().splitlines() if x.startswith("TOOLS=("))
    return line.removeprefix("TOOLS=(").removesuffix(")").split()


def _run_script(home: Path) -> subprocess.CompletedProcess:
    """The build script on a fake build in `home`, with a pip and a cmake that fail: a rebuild stops at its first
    step (the sdist download), and nothing is ever downloaded or compiled by a test."""
    fake = home / "fakebin"
    fake.mkdir()
    for name in ("pip", "cmake", "ninja"):
        (fake / name).write_text("#!/bin/sh\necho refused by the test >&2\nexit 3\n")
        (fake / name).chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "HOME": str(home), "LLAMACPP_HOME": str(home), "PIP": str(fake / "pip")}
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)


def test_build_script_is_a_no_op_when_every_tool_is_there(tmp_path):
    _fake_build(tmp_path, _script_tools())
    done = _run_script(tmp_path)
    assert done.returncode == 0 and "already built" in done.stdout
    assert (tmp_path / ".built").is_file()


def test_build_script_builds_again_when_a_listed_tool_is_missing(tmp_path):
    tools = _script_tools()
    assert "llama-batched-bench" in tools  # bench/regen_throughput.py --engine-ceiling runs it
    _fake_build(tmp_path, [t for t in tools if t != "llama-batched-bench"])
    done = _run_script(tmp_path)
    assert "without: llama-batched-bench" in done.stdout and "already built" not in done.stdout
    assert done.returncode != 0 and not (tmp_path / ".built").exists()


BATCHED_BENCH = """\
main: n_kv_max = 8192, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, n_threads = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    76 |     96 |    1 |    172 |    0.152 |   499.49 |    1.798 |    53.39 |    1.950 |    88.19 |
|    76 |     96 |    8 |   1376 |    0.968 |   627.91 |    3.974 |   193.27 |    4.942 |   278.43 |

llama_perf_context_print:        load time =     120.00 ms
"""


def test_batched_bench_table_is_read_as_generated_tokens_per_second():
    rates = llamacpp.parse_batched_bench(BATCHED_BENCH)
    assert set(rates) == {1, 8}
    assert rates[1] == pytest.approx(96 / 1.950) and rates[8] == pytest.approx(8 * 96 / 4.942)  # prefill included
    assert llamacpp.parse_batched_bench("no table here\n| a | b |\n") == {}
