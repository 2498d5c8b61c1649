"""The first call with cold caches (issue 38: "first-call compile time reported"): what a new
training job pays before its first step, for flexmask and its peers, on one GPU.

    python -m benchmarks.first_call [--head-dims 64 128] [--providers flexmask fa4 flex] [--out DIR]
                                    [--time-budget-s 200] [--child-timeout-s 150] [--append]
                                    [--full docs/results.md]
    python -m benchmarks.first_call --table benchmarks/results/first_call.csv [--full docs/results.md]

Each (provider, mask, head dim) runs in its own child process whose Triton, Inductor, CuTe DSL,
FA4 and CUDA caches point at a new empty folder, so every kernel it runs is compiled there. The
child times, each step synchronised and apart: compile_mask (flexmask's `compile_mask`,
FlexAttention's compiled `create_block_mask`, FA4's `cu_seqlens` for documents), the first
forward, the first backward, then the second forward + backward (warm, for contrast). Imports
and CUDA's start-up come before the clock; whatever a provider does lazily on its first call
counts. bf16, B = 1, 16/16 heads, S = 8192; masks causal and causal_document (documents of 2K-8K
tokens, benchmarks.peers's split), since different tables may specialise kernels differently.
Providers: flexmask; fa4 (`flash_attn.cute`, its CuTe DSL compiles on first call) and flex
(`torch.compile(flex_attention)` with `create_block_mask`) when importable, else left out with a
one-line note. flexmask's cases run first, then the peers', D = 128 before D = 64; a child still
running when the time budget is spent is stopped and keeps the steps it finished.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from .report import CsvWriter, environment, error_status, read_csv, run_notes, write_marked_block

COLUMNS = ("date", "gpu", "torch", "triton", "command", "case", "head_dim", "provider", "compile_mask_ms",
           "first_fwd_ms", "first_bwd_ms", "warm_fwd_bwd_ms", "status")
TIMES = ("compile_mask_ms", "first_fwd_ms", "first_bwd_ms", "warm_fwd_bwd_ms")
CASES = ("causal", "causal_document")  # benchmarks.peers's families
PROVIDERS = ("flexmask", "fa4", "flex")
HEAD_DIMS = (128, 64)
SEQ_LEN, BATCH, HEADS = 8192, 1, 16
RESULT = "first_call_result: "  # a child's stdout line holding its results so far (JSON)
FULL_START, FULL_END = "<!-- first-call:start -->", "<!-- first-call:end -->"
REPO = Path(__file__).resolve().parents[1]
# cache folders a first call fills, by the variable that moves each one
CACHE_VARS = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUTE_DSL_CACHE_DIR",
              "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "CUDA_CACHE_PATH")


# --- the parent: one cold child per case ---------------------------------------------------------

def plan(providers: Sequence[str], head_dims: Sequence[int]) -> list[dict]:
    """The child specs in run order: flexmask's cases (the issue's figure) before the peers'."""
    specs = []
    for group in (["flexmask"], ["fa4", "flex"]):
        chosen = [p for p in group if p in providers]
        specs += [{"provider": p, "case": case, "head_dim": d} for d in head_dims for case in CASES for p in chosen]
    return specs


def cold_env(cache_root: str) -> dict:
    """This process's environment with every compile cache moved to a new folder under cache_root."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the interpreter compiles nothing: a first call there means nothing
    for name in CACHE_VARS:
        env[name] = os.path.join(cache_root, name.lower())
        os.makedirs(env[name])
    return env


def child_command(spec: dict) -> list[str]:
    return [sys.executable, "-m", "benchmarks.first_call", "--child", json.dumps(spec)]


def run_child(command: Sequence[str], timeout_s: float) -> dict:
    """Run one child with cold caches; its last results line, with its status (see child_result)."""
    with tempfile.TemporaryDirectory(prefix="first_call_", ignore_cleanup_errors=True) as cache_root:
        proc = subprocess.Popen(command, cwd=REPO, env=cold_env(cache_root), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the child and any compile workers it started
            out, err = proc.communicate()
            timed_out = True
    return child_result(out, err, proc.returncode, timeout_s if timed_out else None)


def child_result(stdout: str, stderr: str, returncode: int, timed_out_after: float | None = None) -> dict:
    """The last results line of a child's stdout; a child stopped by its timeout or that died keeps
    the steps it reported, and its status says why the others are missing."""
    lines = [line[len(RESULT):] for line in stdout.splitlines() if line.startswith(RESULT)]
    result = json.loads(lines[-1]) if lines else {}
    if timed_out_after is not None:
        result["status"] = f"timeout after {timed_out_after:.0f} s"
    elif result.get("status") is None:  # it died between two steps (a crash, an abort)
        last = (stderr.strip().splitlines() or [""])[-1][:160]
        result["status"] = f"error: exit {returncode}: {last}"
    return result


def measure(specs: Iterable[dict], env: dict, write: Callable[[dict], None], deadline: float,
            run: Callable[[dict, float], dict], log=print) -> None:
    """A row per spec, written as it comes; a child gets the time left before the deadline."""
    for spec in specs:
        left = deadline - time.monotonic()
        result = run(spec, left) if left > 0 else {"status": "skipped: time budget spent"}
        row = {**env, **spec, **{k: result.get(k) for k in TIMES}, "status": result["status"]}
        write(row)
        log(f"{spec['case']:16s} D={spec['head_dim']:3d} {spec['provider']:9s} "
            + " ".join(f"{k[:-3]} {_cell(row.get(k)):>9}" for k in TIMES) + f"  {row['status']}")


# --- the child: one provider, one mask, one head dim, in a fresh process ------------------------

def child(spec: dict) -> None:
    """Time the first steps of one case, printing the results so far after each (a child stopped
    by its timeout still tells what it finished)."""
    result: dict = {}

    def report(**values) -> None:
        result.update(values)
        print(RESULT + json.dumps(result), flush=True)

    try:
        _child_steps(spec, report)
        report(status="ok")
    except Exception as err:  # the row keeps the steps done and says what failed
        report(status=error_status(err))


def _child_steps(spec: dict, report: Callable[..., None]) -> None:
    import torch

    from . import peers

    why = peers.missing(spec["provider"])  # imports the provider's package before the clock starts
    if why:
        raise RuntimeError(why)
    case = peers.peer_case(spec["case"], SEQ_LEN, BATCH)
    shape = (BATCH, HEADS, SEQ_LEN, spec["head_dim"])
    gen = torch.Generator("cuda").manual_seed(0)
    q, k, v, do = (torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    torch.cuda.synchronize()  # CUDA's start-up is not the provider's

    attn, layout, status = _timed(report, "compile_mask_ms", lambda: peers.make_attn(spec["provider"], case,
                                                                                      (HEADS, HEADS)))
    if attn is None:
        raise RuntimeError(status)
    args = [peers.to_layout(t, layout) for t in (q, k, v)]
    dout = peers.to_layout(do, layout).detach()
    out = _timed(report, "first_fwd_ms", lambda: attn(*args))
    _timed(report, "first_bwd_ms", lambda: out.backward(dout))
    for t in args:
        t.grad = None

    def fwd_bwd():
        attn(*args).backward(dout)

    _timed(report, "warm_fwd_bwd_ms", fwd_bwd)


def _timed(report: Callable[..., None], name: str, fn: Callable):
    """fn's result; its wall time from an idle GPU to the end of its GPU work, reported as `name`."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    value = fn()
    torch.cuda.synchronize()
    report(**{name: (time.perf_counter() - t0) * 1e3})
    return value


# --- tables ----------------------------------------------------------------------------------------

def _num(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _cell(value, spec: str = ".1f") -> str:
    x = _num(value)
    return "-" if x is None else format(x, spec)


def table(rows: Sequence[dict]) -> str:
    """Markdown, a line per row: the cold steps, their sum in seconds, the warm step."""
    if not rows:
        return "(no rows)"
    lines = ["<!-- generated by `python -m benchmarks.first_call --table` from first_call.csv; do not edit by hand -->",
             f"bf16, B = {BATCH}, heads {HEADS}/{HEADS}, S = {SEQ_LEN}; each row in a new process with empty "
             "compile caches; ms, each step synchronised; first call = compile_mask + first forward + first "
             "backward.", "",
             "| mask | D | GPU | provider | compile_mask (ms) | first fwd (ms) | first bwd (ms) | first call (s) "
             "| warm fwd+bwd (ms) | status |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        steps = [_num(r.get(k)) for k in TIMES[:3]]
        total = sum(steps) / 1e3 if None not in steps else None
        card = r.get("gpu", "").replace("NVIDIA ", "").split(" ")[0] or "-"  # rows of several cards share a table
        lines.append(f"| {r['case']} | {r['head_dim']} | {card} | {r['provider']} | "
                     + " | ".join(_cell(r.get(k)) for k in TIMES[:3])
                     + f" | {_cell(total, '.2f')} | {_cell(r.get('warm_fwd_bwd_ms'), '.3f')} | {r['status']} |")
    return "\n".join(lines + ["", "Runs:"] + run_notes(rows))


def write_tables(rows: Sequence[dict], full: str | None) -> None:
    if full:
        write_marked_block(full, table(rows), FULL_START, FULL_END)
    print(table(rows))


# --- command line ----------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS))
    p.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    p.add_argument("--out", default="benchmarks/results", help="folder for first_call.csv")
    p.add_argument("--append", action="store_true", help="add the rows to an existing first_call.csv")
    p.add_argument("--time-budget-s", type=float, default=200.0,
                   help="stop the child running at this time and start no other (its row says so)")
    p.add_argument("--child-timeout-s", type=float, default=150.0, help="stop a child that runs longer")
    p.add_argument("--full", help="write the table between the first-call markers of this file (docs/results.md)")
    p.add_argument("--table", metavar="CSV", help="measure nothing: the table of this CSV's rows")
    p.add_argument("--child", metavar="JSON", help=argparse.SUPPRESS)  # one case, in a child process
    args = p.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    if args.table:
        write_tables(read_csv(args.table), args.full)
        return 0
    deadline = time.monotonic() + args.time_budget_s  # the imports below (FA4's: seconds) count too
    from .cuda_guard import require_cuda

    require_cuda("benchmarks.first_call", "times first calls on a GPU")
    from . import peers

    providers = []
    for name in args.providers:
        why = peers.missing(name)
        if why:
            print(f"note: {name} left out: {why}")
        else:
            providers.append(name)
    env = {k: v for k, v in environment("gpu", argv).items() if k in COLUMNS}
    env["command"] = "python -m benchmarks.first_call " + shlex.join(sys.argv[1:] if argv is None else argv)
    rows: list[dict] = []
    with CsvWriter(os.path.join(args.out, "first_call.csv"), append=args.append, columns=COLUMNS) as writer:

        def write(row):
            writer.write([row])
            rows.append(row)

        measure(plan(providers, args.head_dims), env, write, deadline,
                lambda spec, left: run_child(child_command(spec), min(left, args.child_timeout_s)))
    write_tables(rows, args.full)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
