"""No silent surprises on a machine without a GPU (issue 18): GPU-scale shapes, GPU-only
providers and GPU-only scripts stop at once with one line that says what runs on the CPU, and
the training example's tiny runs write into a temporary folder, not into benchmarks/results/.
CUDA is hidden with monkeypatch, so these run the same on a GPU machine."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def stop_message(main, argv) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    message = info.value.code
    assert isinstance(message, str) and "\n" not in message, message
    return message


BENCH_RUN_CASES = [
    # the issue's command: both reasons in one line
    ("--shapes 32K:128 --families causal,document --providers flexmask,flex",
     ["--providers flex runs on a GPU only", "sequence length 32768 is a GPU-scale shape"]),
    ("--seqlens 150,2048", ["sequence length 2048"]),
    ("--quick --sweep-shapes 8K:64", ["sequence length 8192"]),
    ("--providers sdpa_cudnn,sdpa_mask", ["--providers sdpa_cudnn,sdpa_mask run on a GPU only"]),
    ("--full", ["--full is the GPU sweep"]),
]


@pytest.mark.parametrize("argv, parts", BENCH_RUN_CASES, ids=[c[0] for c in BENCH_RUN_CASES])
def test_benchmarks_run_stops_on_gpu_requests(no_cuda, argv, parts):
    from benchmarks import run

    message = stop_message(run.main, argv.split())
    assert message.startswith("no CUDA device: ") or message.startswith("--quick: ")
    for part in parts:
        assert part in message, message
    assert "`python -m benchmarks.run --quick`" in message


def test_benchmarks_run_cpu_sizes_are_accepted(no_cuda):
    from benchmarks import run

    args = run.build_parser().parse_args(["--seqlens", "150,1024", "--providers", "flexmask"])
    assert run.cpu_mode_problem(args, cuda=False) is None


@pytest.mark.parametrize("module, argv", [
    ("benchmarks.speed_check", []), ("tools.tune_configs", []), ("tools.tune_variants", []),
    ("benchmarks.compile", ["--devices", "cuda"]), ("benchmarks.first_call", []),
    ("tools.backward_thread_cost", []), ("tools.backward_thread_cost", ["--variants"]), ("tools.backward_gqa", []),
    ("tools.backward_gqa", ["--long"]), ("tools.backward_q_rows", []), ("tools.forward_ab", []), ("tools.forward_ab", ["--switch", "early_q"]),
    ("tools.backward_ab", []), ("tools.host_parts", []), ("tools.step_kernels", []),
])
def test_gpu_scripts_stop_with_one_line(no_cuda, module, argv):
    import importlib

    main = importlib.import_module(module).main
    message = stop_message(main, argv)
    assert module in message and "no CUDA device" in message, message


@pytest.mark.parametrize("argv, length", [
    (["train"], 8192), (["parity"], 8192), (["scale"], 131072), (["scale", "--tiny", "--seq-lens", "64", "4096"], 4096),
])
def test_training_example_stops_at_gpu_sizes(no_cuda, argv, length):
    from examples import train_packed_lm

    message = stop_message(train_packed_lm.main, argv)
    assert f"{length}-token sequences are a GPU run" in message
    assert f"python -m examples.train_packed_lm {argv[0]} --tiny" in message


def test_training_example_device_cuda_without_cuda(no_cuda):
    from examples import train_packed_lm

    message = stop_message(train_packed_lm.main, ["train", "--device", "cuda"])
    assert "no CUDA device" in message and "--tiny" in message


def test_tiny_runs_write_to_a_temporary_folder(monkeypatch, tmp_path):
    from examples import train_packed_lm

    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))

    def out_dir(*argv):
        return train_packed_lm.default_out_dir(train_packed_lm.parse_args(list(argv)))

    tiny = Path(out_dir("parity", "--tiny"))
    assert tiny.parent == tmp_path and tiny.is_dir() and not any(tiny.iterdir())
    assert out_dir("parity", "--tiny", "--out-dir", "here") == "here"
    assert out_dir("parity") is None  # a GPU run: $OUT or benchmarks/results/, as documented
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    assert out_dir("scale", "--tiny") is None  # results_dir() then reads $OUT


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_issue_command_stops_at_once():
    """The command of the issue, as a user types it: one line on stderr, within seconds."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "benchmarks.run", "--shapes", "32K:128", "--families", "causal,document",
           "--providers", "flexmask,flex"]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and proc.stdout == ""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("no CUDA device:"), proc.stderr
    assert time.monotonic() - start < 60

