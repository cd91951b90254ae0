"""The README's figures, measured and written into its table (`make figures`).

Each measurement runs in a fresh clone of this repository under a temporary folder, as a new user
gets it: `install` (make install), `demo` (make demo after the install: data and the pipeline),
`repro` (a second `dvc repro`, nothing changed), `test-fast` (make test-fast), `ci` (`.ci/run`:
lint, install, side environments and `make test`, whose pytest summary is the `test` row).
Rows not measured keep their figures; each row says when and on which CPU it was measured.

    python -m benchmarks.figures                  # every figure (the ci one takes about 40 minutes)
    python -m benchmarks.figures install demo     # some of them
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
START, END = "<!-- figures: written by make figures -->", "<!-- figures end -->"
#: row key -> what the row measures, as the table says it
ROWS = {
    "install": "`make install`: a new `.venv` from `requirements.lock` (fresh clone)",
    "demo": "`make demo` after the install (demo data, then the pipeline: six stages and registration)",
    "repro": "a second `.venv/bin/dvc repro` with nothing changed (every stage skipped)",
    "test-fast": "`make test-fast` (the quick tier)",
    "test": "`make test` (the whole suite; real dvc, prefect, mlflow, PostgreSQL, mpirun)",
    "ci": "`bash .ci/run` on a fresh clone (Debian packages, lint, install, side environments, `make test`)",
}
SUMMARY = re.compile(r"=+ (?P<line>\d+ passed.*? in (?P<seconds>[\d.]+)s).* =+")


def machine() -> str:
    """The CPU model, whether it has AMX (speed ratios differ with it) and the core count, as lscpu says."""
    text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = re.search(r"Model name:\s*(.+)", text)
    amx = "AMX" if "amx_tile" in text else "no AMX"
    return f"{model.group(1).strip() if model else 'unknown CPU'} ({amx}), {os.cpu_count()} cores"


def timed(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> tuple[float, str]:
    """Seconds `cmd` took and its output; a failure stops the run, quoting the output's end."""
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    seconds = time.monotonic() - start
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed in {cwd} (exit {proc.returncode}):\n{out[-3000:]}")
    return seconds, out


def pytest_summary(out: str) -> str:
    found = list(SUMMARY.finditer(out))
    return f"pytest: {found[-1].group('line')}" if found else "no pytest summary"


def measure(what: list[str], work: Path) -> dict[str, str]:
    """The figure of each row in `what`, measured in clones under `work`."""
    figures: dict[str, str] = {}
    clone = work / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    if {"install", "demo", "repro", "test-fast"} & set(what):
        installed, _ = timed(["make", "install"], clone)
        figures["install"] = f"{installed:.0f} s"
    if {"demo", "repro"} & set(what):
        seconds, _ = timed(["make", "demo"], clone)
        whole = installed + seconds
        figures["demo"] = f"{seconds:.0f} s (a fresh clone's `make demo`, the install included: {whole:.0f} s)"
    if "repro" in what:
        path = f"{clone / '.venv/bin'}{os.pathsep}{os.environ['PATH']}"
        seconds, _ = timed([str(clone / ".venv/bin/dvc"), "repro"], clone, {"PATH": path})
        figures["repro"] = f"{seconds:.1f} s"
    if "test-fast" in what:
        seconds, out = timed(["make", "test-fast"], clone)
        figures["test-fast"] = f"{seconds:.0f} s ({pytest_summary(out)})"
    if {"ci", "test"} & set(what):
        ci = work / "ci"
        subprocess.run(["git", "clone", "-q", str(REPO), str(ci)], check=True)
        seconds, out = timed(["bash", ".ci/run"], ci, {"CI": "true"})
        figures["ci"] = f"{seconds:.0f} s"
        figures["test"] = pytest_summary(out)
    return figures  # with what the asked rows needed first (the install before the demo)


def table(old: dict[str, str], new: dict[str, str], stamp: str) -> str:
    lines = ["| step | figure | measured |", "|---|---|---|"]
    for key, label in ROWS.items():
        row = f"| {label} | {new[key]} | {stamp} |" if key in new else old.get(key)
        lines.append(row or f"| {label} | not measured yet | |")
    return "\n".join(lines)


def rewrite(new: dict[str, str], stamp: str, readme: Path = README) -> None:
    """Put `new` into the README's table between its markers, keeping the rows not measured."""
    text = readme.read_text()
    head, rest = text.split(START)
    body, tail = rest.split(END)
    old = {key: line for line in body.strip().splitlines() for key, label in ROWS.items()
           if line.startswith(f"| {label} |")}
    readme.write_text(f"{head}{START}\n{table(old, new, stamp)}\n{END}{tail}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="*", help=f"rows to measure, of {', '.join(ROWS)} (default: all)")
    args = parser.parse_args(argv)
    what = args.what or list(ROWS)
    if unknown := sorted(set(what) - set(ROWS)):
        parser.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    with tempfile.TemporaryDirectory(prefix="figures-") as work:
        new = measure(what, Path(work))
    rewrite(new, f"{datetime.date.today()}, {machine()}")
    for key, figure in new.items():
        print(f"{key}: {figure}")


if __name__ == "__main__":
    main()
