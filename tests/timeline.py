"""Where a test run's time went, from the lines PYTEST_TIMELINE=<file> made tests/conftest.py write:
per worker, its files in order with their wall seconds and its idle end; then the files that took
longest. `python -m tests.timeline FILE [--write-durations tests/durations.json]`: also write each
file's seconds, the order tests/conftest.py hands files out in (longest first)."""
from __future__ import annotations

import argparse
import json
from collections import defaultdict


def main(path: str, durations: str | None = None) -> None:
    with open(path, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    t0, t1 = min(r["start"] for r in rows), max(r["end"] for r in rows)
    per_file: dict[str, float] = defaultdict(float)
    by_worker: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        per_file[r["test"].split("::")[0]] += r["end"] - r["start"]
        by_worker[r["worker"]].append(r)
    print(f"{len(rows)} tests in {t1 - t0:.0f} s")
    for worker, tests in sorted(by_worker.items()):
        tests.sort(key=lambda r: r["start"])
        spans, current = [], None
        for r in tests:
            name = r["test"].split("::")[0]
            if current and current[0] == name:
                current[2] = r["end"]
            else:
                current = [name, r["start"], r["end"]]
                spans.append(current)
        busy = sum(r["end"] - r["start"] for r in tests)
        print(f"\n{worker}: busy {busy:.0f} s, done at {tests[-1]['end'] - t0:.0f} s")
        for name, start, end in spans:
            if end - start >= 20:
                print(f"  {start - t0:6.0f} - {end - t0:6.0f} s  {end - start:5.0f} s  {name}")
    print("\nlongest files (s):")
    for name, seconds in sorted(per_file.items(), key=lambda kv: -kv[1])[:25]:
        print(f"  {seconds:6.0f}  {name}")


    if durations:
        ordered = {name: round(seconds, 1) for name, seconds in sorted(per_file.items(), key=lambda kv: -kv[1])}
        with open(durations, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(ordered, indent=1) + "\n")
        print(f"\nwrote {durations}: {len(ordered)} files")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("timeline", help="the file PYTEST_TIMELINE named")
    parser.add_argument("--write-durations", metavar="JSON", help="write each file's wall seconds here")
    args = parser.parse_args()
    main(args.timeline, args.write_durations)
