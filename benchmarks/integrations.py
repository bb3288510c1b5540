"""The trainer integrations, timed: each trainer's own DDP against each usbyte-opt path.

For each trainer (Lightning, Hugging Face Trainer, Accelerate) the example under
``examples/`` is profiled (``usbyte-opt profile <example>:build``, 2 gloo ranks), planned
three times (``optimize``: the ``best`` schedule, which the integration runs on the
usbyte-opt runtime unless stock DDP can express it; ``optimize --mode fence``: ``best`` in
fence mode; ``optimize --strategy ddp-tuned``: stock DDP with planned buckets, which the
integration runs as the trainer's own DDP), and then trained four ways, one after the other
and interleaved over ``--repeat`` rounds, so that load on the shared machine falls on each
alike:

* ``baseline``: the example with ``--baseline``, the trainer's own DDP, no usbyte-opt;
* ``best``: the integration with the ``best`` schedule;
* ``best-fence``: the integration with ``best`` planned in fence mode (``optimize --mode
  fence``): what runs as planned in a trainer, which waits for the averaged gradients at the
  end of backward;
* ``ddp-tuned``: the integration with the ``ddp-tuned`` schedule.

The runtime runs with ``verify=False`` (``--no-verify``): a run is a few dozen steps, and
verification's interleaved windows (settled by about iteration 24) would fall inside it.

Each run reports the median wall time per optimizer step (after warm-up) and a checksum of
the final parameters; the ratios baseline / path are taken within a round. Ranks are started
as torchrun would (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``); with
``--bandwidth 200mbit`` (root) each rank runs in its own network namespace of the lab
(``usbyte_opt.bench.netlab``), joined by a shaped link.

    python benchmarks/integrations.py                      # loopback -> benchmarks/integrations.md
    sudo python benchmarks/integrations.py --bandwidth 200mbit --trainers lightning
    python benchmarks/integrations.py --quick --trainers accelerate   # prints only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = HERE / "integrations.md"
RAW = HERE / "integrations.json"

#: trainer -> (example script, module name of its build() factory)
TRAINERS = {
    "lightning": ("lightning_train.py", "lightning_train"),
    "transformers": ("hf_train.py", "hf_train"),
    "accelerate": ("accelerate_train.py", "accelerate_train"),
}
PATHS = ("baseline", "best", "best-fence", "ddp-tuned")


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "examples"), str(ROOT),
                                         env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


def _cli(*argv: str, timeout: float = 900) -> None:
    p = subprocess.run([sys.executable, "-m", "usbyte_opt", *argv], env=_env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"usbyte-opt {' '.join(argv)} failed ({p.returncode}):\n{p.stderr[-3000:]}")


def plan(trainer: str, work: Path, stable_s: float, gbps: float | None = None) -> dict[str, Path]:
    """Profile the example's bench model and plan both schedules (with ``gbps``: retargeted
    to a link of that rate, the compute and the per-block costs as profiled here)."""
    _, module = TRAINERS[trainer]
    prof = work / f"{trainer}.profile.json"
    _cli("profile", f"{module}:build", "--nproc-per-node", "2", "--device", "cpu",
         "--stable-s", str(stable_s), "-o", str(prof))
    best, tuned = work / f"{trainer}.best.json", work / f"{trainer}.ddp-tuned.json"
    fence = work / f"{trainer}.best-fence.json"
    retarget = ["--bandwidth-gbps", str(gbps)] if gbps else []
    _cli("optimize", str(prof), *retarget, "-o", str(best))
    _cli("optimize", str(prof), *retarget, "--mode", "fence", "-o", str(fence))
    _cli("optimize", str(prof), *retarget, "--strategy", "ddp-tuned", "-o", str(tuned))
    return {"best": best, "best-fence": fence, "ddp-tuned": tuned, "profile": prof}


def train(trainer: str, path: str, schedule: Path | None, steps: int, lab: object | None,
          timeout: float = 900) -> dict:
    """One run of the example on 2 ranks; rank 0's report."""
    from usbyte_opt.launcher import free_port, rank_env

    script, _ = TRAINERS[trainer]
    report = Path(tempfile.mkdtemp(prefix="usbyte-integ-")) / "report.json"
    argv = [sys.executable, str(ROOT / "examples" / script), "--size", "bench", "--steps",
            str(steps), "--report", str(report)]
    if path == "baseline":
        argv.append("--baseline")
    else:  # the plan as planned: verification's windows would fall inside the short run
        argv += ["--schedule", str(schedule), "--no-verify"]
    port = free_port()
    procs = []
    for rank in range(2):
        extra = rank_env(rank, 2, master_port=port)
        cmd = argv
        if lab is not None:
            extra.update(lab.env(rank))  # type: ignore[attr-defined]
            cmd = lab.command(rank, argv)  # type: ignore[attr-defined]
        procs.append(subprocess.Popen(cmd, env=_env(extra), cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit(f"{trainer} {path}: no result within {timeout:.0f} s") from None
    if not report.exists():
        raise SystemExit(f"{trainer} {path} failed:\n" + "\n".join(o[-2000:] for o in outs))
    res = json.loads(report.read_text())
    # A rank that wrote its report and then died at exit (seen once in ~60 runs: gloo's
    # "terminate called without an active exception" at interpreter exit after Accelerate's
    # end_training) has timed every step: the run counts, and the report says so.
    res["exit_codes"] = [p.returncode for p in procs]
    if any(p.returncode for p in procs):
        print(f"{trainer} {path}: exit codes {res['exit_codes']} after the report was written: "
              f"{outs[0].strip().splitlines()[-1] if outs[0].strip() else ''}", flush=True)
    res["log"] = [line for line in outs[0].splitlines() if line.startswith("usbyte-opt (")]
    return res


def _n(k: int, word: str) -> str:
    return f"{k} {word}{'' if k == 1 else 's'}"


def _range(xs: list[float]) -> str:
    """min–max, with the median first from 3 values on."""
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    span = f"{min(xs):.3f}–{max(xs):.3f}"
    return f"{statistics.median(xs):.3f} ({span})" if len(xs) >= 3 else span


def main() -> int:
    ap = argparse.ArgumentParser(description="each trainer's DDP against the usbyte-opt paths")
    ap.add_argument("--trainers", nargs="+", choices=list(TRAINERS), default=list(TRAINERS))
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds of the three paths")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    ap.add_argument("--stable-s", type=float, default=5.0, help="the profiler's --stable-s")
    ap.add_argument("--bandwidth", help="run in the lab at this rate, e.g. 200mbit (root)")
    ap.add_argument("--quick", action="store_true", help="1 round, 8 steps; print only")
    a = ap.parse_args()
    repeat, steps = (1, 8) if a.quick else (a.repeat, a.steps)
    load_before = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="usbyte-integ-plans-"))
    results: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        lab, gbps = None, None
        if a.bandwidth:
            from usbyte_opt.bench.netlab import Lab, parse_rate

            gbps = parse_rate(a.bandwidth) / 1e9
        for trainer in a.trainers:
            plans = plan(trainer, work, a.stable_s, gbps)
            if a.bandwidth and lab is None:
                lab = stack.enter_context(Lab(2, a.bandwidth))
            rounds: list[dict[str, dict]] = []
            for r in range(repeat):
                order = list(PATHS[r % len(PATHS):] + PATHS[:r % len(PATHS)])
                got = {}
                for path in order:
                    got[path] = train(trainer, path, plans.get(path), steps, lab)
                    print(f"{trainer:12s} round {r} {path:9s} {got[path]['median_ms']:8.1f} ms/step  "
                          f"{' '.join(got[path]['log'])}", flush=True)
                rounds.append(got)
            scheds = {p: json.loads(plans[p].read_text()) for p in PATHS[1:]}
            results[trainer] = {"rounds": rounds,
                                "plans": {p: {"strategy": sc.get("strategy"), "mode": sc.get("mode"),
                                              "blocks": len(sc.get("blocks", []))}
                                          for p, sc in scheds.items()}}
    network = f"lab, {a.bandwidth} per direction" if a.bandwidth else "loopback"
    lines = [
        "# The trainer integrations against each trainer's own DDP",
        "",
        f"Written by `python benchmarks/integrations.py{' --bandwidth ' + a.bandwidth if a.bandwidth else ''}"
        f" --repeat {repeat} --steps {steps}` "
        f"({time.strftime('%Y-%m-%d')}, Python {platform.python_version()}, {os.cpu_count()} CPU "
        f"cores; 1-minute load average {load_before:.1f} at the start and "
        f"{os.getloadavg()[0]:.1f} at the end). Network: {network}"
        f"{' (profiled on loopback, planned for the link rate with optimize --bandwidth-gbps)' if a.bandwidth else ''}"
        ". Two gloo ranks, one thread "
        f"each; each example's `--size bench` model, {steps} optimizer steps per run (median "
        f"ms per step after 2 warm-up steps, rank 0), the three runs of a round one after the "
        f"other, {repeat} rounds with the order rotated. The ratio is the trainer's DDP time "
        "over the path's, within a round (above 1: faster than the trainer's DDP); the median "
        "over the rounds (from 3 rounds on) and their range. The runtime path runs the plan as "
        "given (`--no-verify`): verification's "
        "windows would fall inside these short runs. Each cell names the path the "
        "integration took (`runtime` or the trainer's `ddp`) and the plan's blocks and mode.",
        "",
        "| trainer | trainer's DDP ms/step | `best` | vs DDP | `best --mode fence` | vs DDP | "
        "`ddp-tuned` | vs DDP | same parameters |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for trainer, res in results.items():
        rs = res["rounds"]
        base = [r["baseline"]["median_ms"] for r in rs]
        sp = {p: [r["baseline"]["median_ms"] / r[p]["median_ms"] for r in rs] for p in PATHS[1:]}
        same = all(abs(r[p]["param_checksum"] - r["baseline"]["param_checksum"])
                   <= 1e-4 * max(1.0, abs(r["baseline"]["param_checksum"])) for r in rs for p in PATHS[1:])
        cells = []
        for p in PATHS[1:]:
            info = res["plans"][p]
            cells.append(f"{rs[0][p]['path']} ({_n(info['blocks'], 'block')}, {info['mode']}) | "
                         f"**{_range(sp[p])}x**")
        lines.append(f"| {trainer} | {min(base):.1f}–{max(base):.1f} | {' | '.join(cells)} | "
                     f"{'yes' if same else 'NO'} |")
    lines += [
        "",
        "\"same parameters\": the checksum (sum of every parameter after training) of each path "
        "equals the trainer's DDP run's within 1e-4 relative; the tests compare the parameters "
        "themselves (bitwise, or within 1e-6 where a trainer is not deterministic).",
        "",
    ]
    print("\n".join(lines))
    if not a.quick:
        out = OUT if not a.bandwidth else HERE / f"integrations_{a.bandwidth}.md"
        out.write_text("\n".join(lines))
        (RAW if not a.bandwidth else HERE / f"integrations_{a.bandwidth}.json").write_text(
            json.dumps(results, indent=1) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
