"""benchmarks/gpu_check.sh and bench_gpu.py: the single-GPU check runs on a CPU in a small shape,
so the script a GPU session runs cannot rot while no GPU is around."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest

from kitchen import decide, paths

from .conftest import load_benchmark

SCRIPT = paths.HOME / "benchmarks" / "gpu_check.sh"


def test_gpu_check_runs_on_a_cpu_in_small_shape(tmp_path):
    """`gpu_check.sh --cpu --small` runs every step of the GPU check with the modules the GPU
    machine lacks made unimportable: the CUDA tests collect, both methods train the policy
    adapter (and only it) at every iteration, both decoding paths are timed, the GPU recipe runs
    an iteration with a checkpoint, and the record reads back as a throughput record."""
    env = os.environ | {
        "OUT": str(tmp_path),
        "OMP_NUM_THREADS": "1",
        "KITCHEN_PYTHON": sys.executable,
    }
    out = subprocess.run(
        ["bash", str(SCRIPT), "--cpu", "--small"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = (tmp_path / "gpu_check.log").read_text()
    assert out.returncode == 0, log[-4000:]
    assert "all steps passed" in log
    assert "tests collected" in log and "test_gpu_memory_of_shared_base" in log

    doc = json.loads((tmp_path / "cpu-small.json").read_text())
    assert set(doc["phases"]) == {"nf4", "lora", "recipe"}
    assert all(v.startswith("ok") for v in doc["phases"].values()), doc["phases"]
    for method in (doc, doc["lora"]):
        assert len(method["iterations"]) == 2
        assert all(
            r["step_samples"] > 0 and r["update_tokens_per_s"] > 0 for r in method["iterations"]
        )
        assert all(r["review_lines"] > 0 for r in method["iterations"])
        assert method["policy_adapter_moved"] and not method["grm_adapter_moved"]
        assert method["rollout_fast_ran"] == "fast" and method["rollout_generate_ran"] == "generate"
        assert (
            method["rollout_fast_tokens_per_s"] > 0 and method["rollout_generate_tokens_per_s"] > 0
        )
    assert doc["quantization"] == "nf4" and doc["lora"]["quantization"] == "none"
    assert doc["qlora_vs_lora"]["update_tokens_per_s"] > 0
    recipe = doc["recipe"]
    assert recipe["recipe"].endswith("gpu_qwen_qlora.yaml")
    assert recipe["metrics_parquet"] is False  # polars was made unimportable, as on the GPU
    (row,) = recipe["iterations"]
    assert row["checkpoint"] and row["train/step_samples"] > 0 and "eval/success" in row

    rec = decide.read_throughput(tmp_path / "cpu-small.json")
    assert rec.device == "cpu" and rec.parameters == doc["parameters"]
    assert rec.rollout_tokens_per_s == doc["iterations"][1]["rollout_tokens_per_s"]
    assert rec.command.startswith("benchmarks/gpu_check.sh --cpu --small")
    assert not list((paths.DATA / "throughput").glob("cpu-small*"))


def test_a_small_run_is_never_written_as_a_shipped_record():
    """A smoke run's figures are not measurements: `--small` refuses data/throughput/."""
    bench = load_benchmark("bench_gpu")
    with pytest.raises(SystemExit, match="smoke run"):
        bench.main(["--small", "--cpu", "--out-dir", str(paths.DATA / "throughput")])


def test_gpu_names_give_the_file_names_decide_suggests():
    bench = load_benchmark("bench_gpu")
    assert bench.gpu_slug("NVIDIA H200") == "h200"
    assert bench.gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert bench.gpu_slug("cpu") == "cpu"


def test_slim_wheel_keeps_the_cuda_13_and_cpu_libraries(tmp_path):
    """`gpu_check.sh --slim-wheel` drops bitsandbytes' libraries for other CUDA, ROCm and XPU
    versions from the wheel and from its RECORD, and keeps everything else."""
    wheel = tmp_path / "bitsandbytes-0.0.0-py3-none-manylinux_2_24_x86_64.whl"
    libs = ["cpu", "cuda118", "cuda128", "cuda130", "cuda132", "rocm70", "xpu2025"]
    files = {"bitsandbytes/__init__.py": b"x = 1\n"}
    files |= {f"bitsandbytes/libbitsandbytes_{v}.so": v.encode() for v in libs}
    record = "".join(f"{n},sha256=0,1\n" for n in files) + "bitsandbytes-0.0.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("bitsandbytes-0.0.0.dist-info/RECORD", record)
    out = subprocess.run(
        ["bash", str(SCRIPT), "--slim-wheel", str(wheel)],
        env=os.environ | {"KITCHEN_PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        rows = z.read("bitsandbytes-0.0.0.dist-info/RECORD").decode().splitlines()
        assert z.read("bitsandbytes/libbitsandbytes_cuda130.so") == b"cuda130"
    kept = {f"bitsandbytes/libbitsandbytes_{v}.so" for v in ("cpu", "cuda130", "cuda132")}
    expected = kept | {"bitsandbytes/__init__.py", "bitsandbytes-0.0.0.dist-info/RECORD"}
    assert names == expected
    assert {r.split(",")[0] for r in rows} == expected
    assert "kept libbitsandbytes_cpu.so, libbitsandbytes_cuda130.so" in out.stdout
