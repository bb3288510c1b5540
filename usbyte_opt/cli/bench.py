"""``usbyte-opt bench MODEL``: real training side by side with DDP, measured against predicted.

Profiles MODEL on real ranks (or takes ``--profile``), plans every strategy, trains the same
model with PyTorch DDP (and PyTorch FSDP2, ``fsdp2``) and with the runtime under each
strategy's schedule (the sharded ones in ZeRO-1 mode), and prints the measured iteration time
beside the prediction and each strategy's optimizer-state bytes per rank. ``--bandwidth 200mbit`` runs the ranks in the
lab (network namespaces joined by a tbf-shaped veth link; root only); with ``--nodes 2
--nproc-per-node 2`` the two-level lab (one namespace per node); ``--emulate 8x1gbit`` trains
one rank whose collectives occupy an emulated link (:mod:`usbyte_opt.collectives.emulate`)
and predicts with that link. The domain work is
:func:`usbyte_opt.bench.run_bench`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from .. import console
from ..bench import SHARDED_STRATEGIES, default_strategies
from ..bench.worker import TORCH_DDP, TORCH_FSDP2
from ..console import plural
from ..env import AUTO
from ..errors import UsageError, UsbyteError
from ..planning.strategies import load_builtin
from . import common

#: The columns of the result table shown without ``--wide`` ("vs DDP" with its interval);
#: ``--wide`` shows all of :data:`usbyte_opt.bench.report.COLUMNS`, as the Markdown report does.
DEFAULT_COLUMNS = ("strategy", "measured ms", "state MB", "predicted ms", "error", "vs DDP",
                   "vs bound")


def render(result: dict[str, Any], title: str, wide: bool = False) -> None:
    """Print the result table and where the files went (shared with ``demo``)."""
    from ..bench.report import COLUMNS, table_rows

    keep = list(range(len(COLUMNS))) if wide else [COLUMNS.index(c) for c in DEFAULT_COLUMNS]
    c = result["comm"]
    link = ("no communication (one rank)" if result.get("single_rank") else
            f"emulated {result['emulated']}" if result.get("emulated") else
            f"all-reduce alpha {c['alpha_ms']:.3f} ms, {c['algbw_gbs'] * 1e3:.1f} MB/s")
    console.table(
        f"{title}: {result['name']} on {plural(result['world_size'], 'rank')}, {result['network']['description']}; "
        f"compute {result['forward_ms'] + result['backward_ms']:.1f} ms, {link}",
        [COLUMNS[i] for i in keep], [[row[i] for i in keep] for row in table_rows(result)],
        justify_right_from=2 if wide else 1,
        caption=(f"{result['iterations']} timed iterations per strategy, at least; vs DDP: its time "
                 "over the strategy's, 95% interval; error = (measured − predicted) / measured"
                 + ("" if result["correct"] is None else
                                 f"; training {'matches' if result['correct'] else 'DIFFERS FROM'} "
                                 f"{result['reference']}")
                 + ("" if wide else "; --wide for every column")))
    if result.get("single_rank"):
        console.info(result["single_rank"])


def notes(result: dict[str, Any]) -> None:
    """The run's notes, one warning line each (shared with ``demo``): a plot that could not be
    drawn says how to get matplotlib (the ``plot`` extra), a machine whose speed changed
    says so."""
    for n in result.get("notes") or ():
        console.warn(n)


def bench(
    model: Annotated[str, typer.Argument(
        help="Built-in name (cnn, transformer, mlp, lab-cnn, lab-vgg, lab-transformer, ...) or "
             "package.module:factory.")],
    nproc_per_node: Annotated[int, typer.Option(
        "--nproc-per-node", "-n", min=1, help="Ranks to start on this machine, per node "
                                              "with --nodes (ignored under torchrun). One "
                                              "rank has nothing to schedule: it checks the "
                                              "flow and the runtime's own cost.")] = 2,
    nodes: Annotated[int, typer.Option(
        "--nodes", min=1, help="Nodes to emulate on this machine, each of --nproc-per-node "
                               "ranks (ranks numbered as torchrun does). With --bandwidth the "
                               "two-level lab: one namespace per node, its ranks over its "
                               "loopback, the nodes over the shaped link (root only); without, "
                               "the ranks grouped as nodes on loopback, nothing shaped (checks "
                               "the flow, not the network).")] = 1,
    bandwidth: Annotated[Optional[str], typer.Option(
        "--bandwidth", help="Run in the lab at this link rate (200mbit, 1gbit; root only). "
                            "Default: the ordinary network.")] = None,
    iterations: Annotated[int, typer.Option(
        "--iterations", "-k", min=1, help="Timed steady-state iterations per strategy.")] = 20,
    strategies: Annotated[str, typer.Option(
        "--strategies", "-s",
        help=f"Comma-separated, among {', '.join(load_builtin())}, {AUTO}, {TORCH_FSDP2} and "
             f"the sharded {', '.join(SHARDED_STRATEGIES)}; {TORCH_DDP} is PyTorch DDP itself, "
             f"ddp-tuned stock DDP with the planned buckets, {TORCH_FSDP2} PyTorch FSDP2 "
             "(fully_shard on every module with parameters of its own, then the root; not "
             f"planned, not predicted, not in the default), {AUTO} the runtime planning in the "
             "run (no profile given to it), the others the usbyte-opt runtime with their "
             f"schedule: {', '.join(SHARDED_STRATEGIES)} in sharded mode (ZeRO-1: each rank "
             "keeps the optimizer state of its shard), and each of those with the suffix "
             "-zero2: the same schedule as ZeRO-2 (no flat gradient buffer). "
             "state MB: the optimizer state of the rank holding most of it.")]
        = ", ".join(default_strategies()),
    profile: Annotated[Optional[Path], typer.Option(
        "--profile", "-p", dir_okay=False, exists=True, help="Use this profile instead of "
                                                             "profiling first.")] = None,
    batch_size: Annotated[Optional[int], typer.Option(
        "--batch-size", "-b", min=1, help="Per-rank batch size (default: the model's own)."
    )] = None,
    output_dir: Annotated[Optional[Path], typer.Option(
        "--output-dir", "-o", file_okay=False, help="Where report.md, plot.png, result.json, "
                                                    "traces go (default: NAME-NETWORK in "
                                                    "bench-results/).")] = None,
    rounds: Annotated[int, typer.Option(
        "--rounds", min=1, help="Interleaved turns per strategy, at least (each turn against "
                                "DDP's in the same round: a pair of windows).")] = 4,
    max_rounds: Annotated[int, typer.Option(
        "--max-rounds", min=1, help="Add turns, up to this many, for strategies whose time "
                                    "against DDP's is not distinguishable yet (95% interval "
                                    "containing 1).")] = 12,
    reference: Annotated[bool, typer.Option(
        "--reference/--no-reference", help="Also time training without communication.")] = True,
    device: Annotated[Optional[str], typer.Option(
        "--device", help="cpu or cuda (default: cuda if available).")] = None,
    timeout_s: Annotated[float, typer.Option(
        "--timeout-s", min=10.0, help="Hard limit of the ranks' run (killed past it).")] = 1800.0,
    emulate: Annotated[Optional[str], typer.Option(
        "--emulate", metavar="NxRATE[@ALPHA]",
        help="Train one rank (--nproc-per-node 1) whose every collective occupies an emulated "
             "link of N ranks: one serial channel, busy alpha + ring bytes / RATE per "
             "collective (8x1gbit, 16x25gbit, 8x1gbit@50us; alpha 50us by default). The "
             "profile's communication, the predictions and the bound are that link's; DDP's "
             "buckets go through it by a comm hook, the runtime's blocks by its channel. "
             "Sharded strategies, fsdp2 and auto are left out. Not with --bandwidth or "
             "--nodes.")] = None,
    verify: Annotated[bool, typer.Option(
        "--verify/--no-verify", help="Let the runtime verify each plan against DDP's buckets in "
                                     "the run and keep the faster (off: every strategy measured "
                                     "as planned).")] = False,
    wide: common.Wide = False,
    as_json: common.Json = False,
) -> None:
    """Train MODEL with DDP and with each strategy's schedule; report measured against predicted,
    and each one's optimizer state per rank.

    Two nodes of two ranks in the lab, nodes joined by a 200 Mbit/s link:
    sudo usbyte-opt bench lab-cnn --nodes 2 --nproc-per-node 2 --bandwidth 200mbit

    One rank on an emulated link of 8 ranks at 1 Gbit/s (no root, no second machine):
    usbyte-opt bench lab-cnn --nproc-per-node 1 --emulate 8x1gbit --strategies ddp,best"""
    from ..bench import BenchConfig, default_out_dir, run_bench

    cfg = BenchConfig(model=model, nproc=nproc_per_node, nodes=nodes, bandwidth=bandwidth,
                      iterations=iterations,
                      strategies=tuple(s.strip() for s in strategies.split(",") if s.strip()),
                      profile=str(profile) if profile else None, batch_size=batch_size,
                      out_dir=output_dir, rounds=rounds, max_rounds=max_rounds,
                      reference=reference, device=device,
                      timeout_s=timeout_s, verify=verify, emulate=emulate)
    try:  # the option values, checked before any work: a bad one is a usage error (exit code 2)
        from ..bench import check_emulate

        check_emulate(emulate, nproc_per_node, nodes, bandwidth)
        cfg.strategy_list()
        from ..bench.lab import check_nodes

        check_nodes(nodes, nproc_per_node)
        if bandwidth:
            from ..bench.lab import parse_rate

            parse_rate(bandwidth)
    except UsageError:
        raise
    except UsbyteError as e:
        raise UsageError(str(e)) from None
    cfg.out_dir = common.check_output_dir(output_dir or default_out_dir(cfg), "--output-dir")
    result = run_bench(cfg, progress=None if as_json else console.info)
    if result is None:
        return  # a rank > 0 under torchrun: rank 0 reports
    if as_json:
        console.emit_json(result)
        return
    render(result, "bench", wide=wide)
    notes(result)
    console.info(f"wrote {result['report']}" + (f", {result['plot']}" if result["plot"] else "")
                 + f" and {Path(result['out_dir']) / 'result.json'}")


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)
