"""Write the report: one self-contained HTML page per recipe, its figures inline SVG.

    correctness report PATH... [-o FILE] [--curves CANDIDATE REFERENCE] [--thresholds pipeline|function]
                       [--json]

PATH: lever record files (*.json), or results folders, searched for records (hidden folders left
out: a run's parts, records kept beside the lever's own). Each record is checked against the
record's schema: a file of another format or format version is refused. With -o, one file for the records of
one recipe (records of two recipes are refused, naming both); without it, one report per recipe,
`report.html` in the folder of its records, each path printed. --curves adds the convergence
figure of CANDIDATE against REFERENCE (loss curves as `correctness converge` takes them, in its
order) to the one recipe's report.

The page holds the recipe's verdict from these records (as `correctness run` words it), the device
and versions, and per lever record: its verdict and evidence class, the backends each path ran,
its invariants, err/bound per tensor for every role, the systematic slope against its threshold,
for sliced tensors a heatmap over heads x position blocks, for the optimizer levers err/bound per
parameter tensor by layer and share, and its cases; each figure links to its record field (a JSON
pointer). What each figure shows: docs/report.md.

A report is written only as a new file or over a regular file it may replace: never over one of
its records or curves (`report rec.json -o rec.json`), a read-only file, a device, a FIFO, a folder
or through a symlink out of its folder (correctness.files.output_target).

Exit status: 0 the reports were written; 2 bad input (a missing path, a file that is not a record,
two recipes with -o, an output it may not replace), with one line naming it, and no report written.
"""

import argparse

from correctness.commands import EXIT_OK, emit
from correctness.convergence import THRESHOLDS
from correctness.errors import CorrectnessError
from correctness.files import shown_path
from correctness.report_page import load_records, render_reports, report_inputs, write_reports


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", metavar="PATH", help="lever record files or results folders")
    parser.add_argument("-o", "--output", metavar="FILE",
                        help="write one report here (the records must be of one recipe); default: report.html in"
                        " each recipe's records folder")
    parser.add_argument("--curves", nargs=2, metavar=("CANDIDATE", "REFERENCE"),
                        help="loss curves (log, CSV or JSON, as `correctness converge` reads them) for the"
                        " convergence figure")
    parser.add_argument("--thresholds", choices=sorted(THRESHOLDS), default="pipeline",
                        help="the convergence check's thresholds, as `correctness converge` takes them")


def run(args: argparse.Namespace) -> int:
    records = load_records(args.paths)
    recipes = {loaded.recipe_key for loaded in records}
    if args.curves and len(recipes) > 1 and args.output is None:
        raise CorrectnessError(f"--curves is for one recipe's report; the records are of {len(recipes)} recipes")
    reports = render_reports(records, args.output, tuple(args.curves) if args.curves else None, args.thresholds)
    write_reports(reports, report_inputs(records, [*args.paths, *(args.curves or ())]))
    # The recipe's id is in its records folder's name: the line names the path alone, as `run --report` does.
    lines = [f"report: {shown_path(report.path)} ({len(report.html.encode()):,} bytes, {report.records} records)"
             for report in reports]
    data = {"reports": [{"recipe": report.recipe, "path": str(report.path), "bytes": len(report.html.encode()),
                         "records": report.records} for report in reports]}
    emit(args, lines, data, wrap=False)  # a path whole on its line, however long
    return EXIT_OK
