"""The GPU sweep: every (shape, mask case) against every provider, one CSV row each.

Per configuration: the canonical intervals are built once on the GPU; FLOPs and density come
from them; each provider prepares its mask outside the timed region, runs one forward +
backward (warm-up and compilation; its peak memory; the outputs of the correctness
cross-check), then forward, backward and forward+backward are timed with do_bench. flexmask's outputs and gradients are compared with FlexAttention's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from . import checks, families, flops, timing
from .providers import GIB, Prepared, Provider, Setup, registry

CHECKED = ("flexmask", "flex")  # the pair of the correctness cross-check; never cut by the time budget


@dataclass
class Options:
    shapes: list[tuple[int, int]]  # (seqlen, head_dim), in run order
    sweep_shapes: list[tuple[int, int]]  # where the sliding-window sweep runs
    families: list[str]
    providers: list[str]
    directions: list[str]
    tokens: int = 32768
    batch: int | None = None  # fixed batch size; default max(1, tokens // seqlen)
    heads: int = 16
    kv_heads: int | None = None
    dtype: torch.dtype = torch.bfloat16
    warmup: int = 25
    rep: int = 100
    build_reps: int = 10
    dense_budget_gb: float = 8.0
    tol: float | None = None
    time_budget_s: float | None = None
    seed: int = 0
    device: str = "cuda"

    def batch_for(self, seqlen: int) -> int:
        return self.batch if self.batch is not None else max(1, self.tokens // seqlen)


def plan(opts: Options) -> list[tuple[families.Case, int, int]]:
    """(case, batch, head_dim) in run order: for each shape its families, then its sweep."""
    items = []
    shapes = list(opts.shapes) + [s for s in opts.sweep_shapes if s not in opts.shapes]
    for seqlen, head_dim in shapes:
        batch = opts.batch_for(seqlen)
        names = list(opts.families) if (seqlen, head_dim) in opts.shapes else []
        if (seqlen, head_dim) in opts.sweep_shapes:
            names.append(families.SWEEP)
        for case in families.cases_for(names, seqlen, batch, opts.heads, opts.seed):
            items.append((case, batch, head_dim))
    return items


def _raise_recompile_limits() -> None:
    """Each shape and mask broadcast pattern compiles FlexAttention anew; the default limit of 8
    would silently fall back to eager (slow, and O(S^2) memory)."""
    import torch._dynamo.config as dynamo_config

    for name, value in (("recompile_limit", 256), ("cache_size_limit", 256),
                        ("accumulated_recompile_limit", 4096), ("accumulated_cache_size_limit", 4096)):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), value))


def _error_status(err: BaseException) -> str:
    if isinstance(err, torch.OutOfMemoryError):
        return "OOM"
    first = (str(err).strip().splitlines() or [""])[0][:160]
    return f"ERROR: {type(err).__name__}: {first}"


def _timing_columns(row: dict, times: dict[str, timing.Timing], flop: dict[str, float]) -> None:
    for direction, t in times.items():
        row[f"{direction}_ms"] = t.median
        row[f"{direction}_p20_ms"] = t.p20
        row[f"{direction}_p80_ms"] = t.p80
        row[f"{direction}_tflops"] = flops.tflops(flop[direction], t.median)


def _measure(provider: Provider, setup: Setup, q, k, v, dout, opts: Options, flop: dict, row: dict):
    """Prepare, warm up (keeping the outputs for the cross-check), time; fills `row`."""
    prep: Prepared = provider.prepare(setup)
    row["mask_build_ms"] = prep.build_ms
    row["mask_build_from_intervals_ms"] = prep.build_iv_ms
    row["mask_bytes"] = prep.mask_bytes
    for key, value in prep.info.items():
        row[f"tiles_{key}"] = value
    outputs, peak = timing.with_peak_memory(lambda: checks.forward_backward(prep.attn, q, k, v, dout),
                                            setup.device)
    row["peak_extra_mem_mb"] = None if peak is None else peak / 2**20
    if provider.name not in CHECKED:
        outputs = None
    times = timing.bench_gpu(prep.attn, q, k, v, dout, opts.directions, opts.warmup, opts.rep)
    _timing_columns(row, times, flop)
    row["status"] = "ok"
    return outputs


def _cross_check(row: dict, got: dict | None, want: dict | None, tol: float) -> None:
    if got is None:
        return
    finite = all(bool(torch.isfinite(t).all()) for t in got.values())
    if want is None:
        row["check"] = "pass (finite; no FlexAttention result)" if finite else "FAIL: non-finite output"
        return
    errs = checks.cross_check(got, want)
    row["check_against"] = "flex"
    row["tolerance"] = tol
    for name, err in errs.items():
        row[f"err_{name}"] = err
    worst = max(errs.values())
    if not finite:
        row["check"] = "FAIL: non-finite output"
    elif not worst <= tol:
        row["check"] = f"FAIL: rel err {worst:.3g} > {tol:.3g}"
    else:
        row["check"] = "pass"


def run_config(case: families.Case, batch: int, head_dim: int, opts: Options, env: dict,
               providers: list[Provider], over_budget, log) -> list[dict]:
    device = torch.device(opts.device)
    s, heads = case.seqlen, opts.heads
    kv_heads = opts.kv_heads or heads
    iv = case.make().intervals(s, s, device)
    pairs = flops.attending_pairs(iv, s, batch, heads)
    flop = flops.attention_flops(pairs, head_dim)
    base = dict(env, family=case.family, params=case.params, batch=batch, heads=heads, kv_heads=kv_heads,
                seqlen=s, head_dim=head_dim, dtype=str(opts.dtype).removeprefix("torch."),
                density=flops.density(pairs, batch, heads, s, s))
    setup = Setup(case, iv, batch, heads, kv_heads, s, head_dim, opts.dtype, device,
                  build_reps=opts.build_reps, dense_budget_bytes=opts.dense_budget_gb * GIB)
    gen = torch.Generator(device=device).manual_seed(opts.seed)

    def rand(h):
        return torch.randn(batch, h, s, head_dim, device=device, dtype=opts.dtype, generator=gen)

    q, k, v = (rand(h).requires_grad_(True) for h in (heads, kv_heads, kv_heads))
    dout = rand(heads)
    tol = opts.tol if opts.tol is not None else checks.cross_check_tolerance(opts.dtype)

    names = [p.name for p in providers]
    check_after = "flex" if "flex" in names else "flexmask"
    rows, outputs = {}, {}
    for provider in providers:
        if not provider.applies(case):
            continue
        row = dict(base, provider=provider.name)
        rows[provider.name] = row
        reason = provider.skip_reason(setup)
        if reason is None and provider.name not in CHECKED and over_budget():
            reason = "time budget"
        if reason is not None:
            row["status"] = f"SKIP: {reason}"
            continue
        try:
            outputs[provider.name] = _measure(provider, setup, q, k, v, dout, opts, flop, row)
        except Exception as err:  # noqa: BLE001 (OOM, or a provider that cannot run this configuration)
            row["status"] = _error_status(err)
            for t in (q, k, v):
                t.grad = None
        torch.cuda.empty_cache()
        if provider.name == check_after and "flexmask" in rows:
            _cross_check(rows["flexmask"], outputs.pop("flexmask", None), outputs.pop("flex", None), tol)
            torch.cuda.empty_cache()

    flex = rows.get("flex", {})
    for row in rows.values():
        for direction in opts.directions:
            mine, theirs = row.get(f"{direction}_ms"), flex.get(f"{direction}_ms")
            if mine and theirs:
                row[f"{direction}_vs_flex"] = theirs / mine
    fm = rows.get("flexmask")
    if fm is not None:
        errs = ", ".join(f"{n}={fm[f'err_{n}']:.2e}" for n in checks.TENSORS if f"err_{n}" in fm)
        log(f"{case.family} {case.params} S={s} D={head_dim}: flexmask {fm.get('status')}; "
            f"vs FlexAttention rel err {errs or '-'} (tol {tol:g}): {fm.get('check', '-')}")
    return list(rows.values())


def is_failure(row: dict) -> bool:
    """A flexmask row that did not run, or whose cross-check failed, fails the sweep."""
    if row.get("provider") != "flexmask":
        return False
    status = str(row.get("status", ""))
    return not (status == "ok" or status.startswith("SKIP")) or str(row.get("check", "")).startswith("FAIL")


def _rows_without_measurement(case, batch, head_dim, opts, env, providers, status: str) -> list[dict]:
    return [dict(env, family=case.family, params=case.params, batch=batch, heads=opts.heads,
                 kv_heads=opts.kv_heads or opts.heads, seqlen=case.seqlen, head_dim=head_dim,
                 dtype=str(opts.dtype).removeprefix("torch."), provider=p.name, status=status)
            for p in providers if p.applies(case)]


def run(opts: Options, env: dict, writer, start_time: float, progress: bool = True) -> tuple[list[dict], int]:
    """Run the sweep, writing rows as they come. Returns (rows, number of failures)."""
    from tqdm import tqdm

    _raise_recompile_limits()
    providers = [p for name, p in registry().items() if name in opts.providers]

    def over_budget() -> bool:
        return opts.time_budget_s is not None and time.monotonic() - start_time > opts.time_budget_s

    items = plan(opts)
    all_rows, failures = [], 0
    bar = tqdm(items, desc="benchmarks", unit="config", disable=not progress, dynamic_ncols=True)
    for case, batch, head_dim in bar:
        bar.set_postfix_str(f"{case.family} S={case.seqlen} D={head_dim}")
        if over_budget():
            rows = _rows_without_measurement(case, batch, head_dim, opts, env, providers, "SKIP: time budget")
        else:
            try:
                rows = run_config(case, batch, head_dim, opts, env, providers, over_budget, bar.write)
            except Exception as err:  # noqa: BLE001 (the configuration itself failed: inputs, intervals)
                rows = _rows_without_measurement(case, batch, head_dim, opts, env, providers, _error_status(err))
                bar.write(f"{case.family} S={case.seqlen} D={head_dim}: {_error_status(err)}")
            torch.cuda.empty_cache()
        failures += sum(is_failure(r) for r in rows)
        writer.write(rows)
        all_rows.extend(rows)
    return all_rows, failures
