"""`python -m atom.recipes list | show NAME | run NAME [--out DIR] [--force]`

Exit status of `run`: 0 every expected figure met; 1 a figure outside its tolerance;
2 invalid or unknown recipe, engine error, or hardware that does not match; 3 the recipe
is pending (what it needs does not exist yet).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from atom.recipes.runner import HardwareMismatch, RecipePending, find_recipe, list_recipes, run_recipe
from atom.recipes.schema import METRICS, RecipeError

EXIT_PASS, EXIT_FAIL, EXIT_ERROR, EXIT_PENDING = 0, 1, 2, 3


def _hardware(r) -> str:
    hw = r.hardware
    return hw.device if hw.device == "cpu" else f"{hw.device}" + (f" x{hw.min_gpus}" if hw.min_gpus > 1 else "")


def cmd_list(args, out: Console) -> int:
    t = Table(title=f"recipes ({args.dir or 'recipes/'})")
    t.add_column("name", no_wrap=True)
    for c in ("status", "hardware", "model", "workload"):
        t.add_column(c)
    pending = []
    for r in list_recipes(args.dir):
        status = "[green]ready[/]" if r.status == "ready" else "[yellow]pending[/]"
        t.add_row(r.name, status, _hardware(r), escape(r.model.short_label), r.workload.kind)
        if r.status == "pending":
            pending.append(f"[yellow]pending[/] {r.name}: {escape(r.pending_reason)}")
    out.print(t)
    for line in pending:
        out.print(line)
    return EXIT_PASS


def cmd_show(args, out: Console) -> int:
    r = find_recipe(args.name, args.dir)
    out.print(f"[bold]{r.name}[/] ({escape(r.source)}) — {r.status}"
              + (f": {escape(r.pending_reason)}" if r.pending_reason else ""))
    out.print(escape(r.description.strip()))
    out.print(f"hardware: {_hardware(r)}   model: {r.model.label}   workload: {r.workload.kind}")
    t = Table(title="metrics")
    for c in ("metric", "unit", "expected", "meaning"):
        t.add_column(c)
    from atom.viz.tables import format_expected
    for m in r.metrics:
        exp = r.expected.get(m)
        t.add_row(m, METRICS[m][0], format_expected(exp.to_dict() if exp else None), METRICS[m][1])
    out.print(t)
    with open(r.source) as f:
        out.print(f.read(), markup=False, highlight=False)
    return EXIT_PASS


def cmd_run(args, out: Console) -> int:
    from atom.viz.tables import recipe_table
    r = find_recipe(args.name, args.dir)
    folder = args.out or os.path.join("out", "recipes", r.name)
    result = run_recipe(r, folder, force=args.force)
    out.print(recipe_table(result))
    out.print(f"wrote {len(result['files'])} files to {folder}/ (results.json, results.md, plots)")
    failed = [c for c in result["checks"] if not c["ok"]]
    for c in failed:
        out.print(f"[red]FAIL[/] {c['metric']}: {escape(c['why'])}")
    return EXIT_FAIL if failed else EXIT_PASS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m atom.recipes", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="folder of recipe files (default: the repository's recipes/)")
    ap.add_argument("-v", "--verbose", action="store_true", help="log the engine at INFO level")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the recipes and their status")
    p = sub.add_parser("show", help="one recipe: metrics, expectations, the file")
    p.add_argument("name", help="recipe name or path to its YAML file")
    p = sub.add_parser("run", help="run a recipe, check its figures, write results and plots")
    p.add_argument("name", help="recipe name or path to its YAML file")
    p.add_argument("--out", help="output folder (default: out/recipes/NAME)")
    p.add_argument("--force", action="store_true", help="run even on hardware the recipe does not name")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    # piped output (logs, CI) gets a fixed width instead of rich's 80-column fallback
    width = None if sys.stdout.isatty() else 120
    out, err = Console(width=width), Console(stderr=True, width=width)  # errors: one line each (soft_wrap)
    try:
        return {"list": cmd_list, "show": cmd_show, "run": cmd_run}[args.cmd](args, out)
    except RecipePending as e:
        err.print(f"[yellow]pending:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        return EXIT_PENDING
    except HardwareMismatch as e:
        err.print(f"[red]hardware mismatch:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        return EXIT_ERROR
    except RecipeError as e:
        err.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
