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
from ..bench import default_strategies
from ..bench.worker import TORCH_FSDP2
from ..console import plural
from ..env import AUTO
from ..errors import UsageError, UsbyteError
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
    compiled = result.get("compile")
    if compiled:
        split = compiled.get("split") or {}
        link += f"; compiled ({compiled['backend']}" + "".join(
            f", {s}: {v['pieces']} pieces in {plural(v['graphs'], 'graph')}"
            for s, v in split.items()) + ")"
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
    """The run's notes, one warning each, wrapped within 100 columns (shared with ``demo``):
    a plot that could not be drawn says how to get matplotlib (the ``plot`` extra), a machine
    whose speed changed says so."""
    for n in result.get("notes") or ():
        console.warn_wrapped(n)


#: The ``--help`` panel of the options most runs leave alone (each in full in docs/bench.md).
MORE = "More options (each in full in docs/bench.md, Options)"


def bench(
    model: Annotated[str, typer.Argument(
        help="Built-in name (lab-cnn, lab-vgg, lab-transformer, cnn, mlp, ...) or "
             "package.module:factory, called as factory(batch_size) and returning (model, "
             "inputs, loss_fn) (docs/profiles.md, The model factory).")],
    nproc_per_node: Annotated[int, typer.Option(
        "--nproc-per-node", "-n", min=1, help="Ranks on this machine (per node with "
                                              "--nodes).")] = 2,
    nodes: Annotated[int, typer.Option(
        "--nodes", min=1, help="Nodes to emulate here (with --bandwidth: the two-level "
                               "lab).")] = 1,
    bandwidth: Annotated[Optional[str], typer.Option(
        "--bandwidth", help="Lab link rate (200mbit, 1gbit; root only).")] = None,
    iterations: Annotated[int, typer.Option(
        "--iterations", "-k", min=1, help="Timed iterations per strategy.")] = 20,
    strategies: Annotated[str, typer.Option(
        "--strategies", "-s",
        help=f"Comma-separated; also {AUTO}, {TORCH_FSDP2}, the sharded ones and their -zero2 "
             "forms.")] = ", ".join(default_strategies()),
    profile: Annotated[Optional[Path], typer.Option(
        "--profile", "-p", dir_okay=False, exists=True, help="Use this profile, not a new "
                                                             "one.")] = None,
    batch_size: Annotated[Optional[int], typer.Option(
        "--batch-size", "-b", min=1, help="Per-rank batch size (default: the model's)."
    )] = None,
    output_dir: Annotated[Optional[Path], typer.Option(
        "--output-dir", "-o", file_okay=False, help="Report folder (default: "
                                                    "bench-results/NAME-NETWORK).")] = None,
    rounds: Annotated[int, typer.Option(
        "--rounds", min=1, rich_help_panel=MORE, help="Turns per strategy, at least.")] = 4,
    max_rounds: Annotated[int, typer.Option(
        "--max-rounds", min=1, rich_help_panel=MORE, help="Turns at most, while not told from "
                                                          "DDP's.")] = 12,
    reference: Annotated[bool, typer.Option(
        "--reference/--no-reference", rich_help_panel=MORE,
        help="Also time training without communication.")] = True,
    device: Annotated[Optional[str], typer.Option(
        "--device", rich_help_panel=MORE, help="cpu or cuda (default: cuda if available).")] = None,
    timeout_s: Annotated[float, typer.Option(
        "--timeout-s", min=10.0, rich_help_panel=MORE, help="Hard limit of the run.")] = 1800.0,
    emulate: Annotated[Optional[str], typer.Option(
        "--emulate", metavar="NxRATE[@ALPHA]", rich_help_panel=MORE,
        help="One rank on an emulated link of N ranks (8x1gbit).")] = None,
    verify: Annotated[bool, typer.Option(
        "--verify/--no-verify", rich_help_panel=MORE,
        help="The runtime keeps DDP's buckets where faster.")] = False,
    compile_backend: Annotated[Optional[str], typer.Option(
        "--compile", metavar="BACKEND", rich_help_panel=MORE,
        help="Profile and train every strategy compiled by torch.compile with this backend "
             "(inductor, aot_eager); torch DDP with its own DDPOptimizer, the runtime split at "
             "its plan's blocks.")] = None,
    cut_probes: Annotated[int, typer.Option(
        "--cut-probes", min=0, rich_help_panel=MORE,
        help="With --compile: cut places timed (0: cuts free).")] = 12,
    cut_probe_s: Annotated[float, typer.Option(
        "--cut-probe-s", min=0.0, rich_help_panel=MORE,
        help="With --compile: their time cap (s).")] = 120.0,
    wide: common.Wide = False,
    as_json: common.Json = False,
) -> None:
    """Train MODEL with DDP and with each strategy's schedule; report measured against
    predicted, and each one's optimizer state per rank (docs/bench.md).

    `sudo usbyte-opt bench lab-cnn --nodes 2 --nproc-per-node 2 --bandwidth 200mbit`:
    two nodes of two ranks in the lab, joined by a 200 Mbit/s link.

    `usbyte-opt bench lab-cnn -n 1 --emulate 8x1gbit -s ddp,best`: one rank on an emulated
    link of 8 ranks at 1 Gbit/s (no root, no second machine)."""
    from ..bench import BenchConfig, default_out_dir, run_bench

    cfg = BenchConfig(model=model, nproc=nproc_per_node, nodes=nodes, bandwidth=bandwidth,
                      iterations=iterations,
                      strategies=tuple(s.strip() for s in strategies.split(",") if s.strip()),
                      profile=str(profile) if profile else None, batch_size=batch_size,
                      out_dir=output_dir, rounds=rounds, max_rounds=max_rounds,
                      reference=reference, device=device,
                      timeout_s=timeout_s, verify=verify, emulate=emulate)
    if compile_backend:
        import dataclasses

        cfg.profiling = dataclasses.replace(cfg.profiling, compile=compile_backend,
                                            cut_probes=cut_probes, cut_probe_s=cut_probe_s)
    try:  # the option values, checked before any work: a bad one is a usage error (exit code 2)
        from ..bench import check_emulate

        check_emulate(emulate, nproc_per_node, nodes, bandwidth)
        cfg.strategy_list()
        from ..bench.netlab import check_nodes

        check_nodes(nodes, nproc_per_node)
        if bandwidth:
            from ..bench.netlab import parse_rate

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
