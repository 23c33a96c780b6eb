"""Time validating a 1M-row workload (target: a few seconds on 2 cores).

Run from the repository root: ``python -m benchmarks.bench_validate``.
"""

from __future__ import annotations

import time

from data.schemas import WORKLOAD
from data.validate import validate_table
from tests.test_data_validate import big_workload


def main() -> None:
    table = big_workload(250_000)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        validate_table(table, WORKLOAD, "bench")
        best = min(best, time.perf_counter() - t0)
    print(f"validate {table.num_rows:,} workload rows: {best:.2f} s ({table.num_rows / best:,.0f} rows/s)")


if __name__ == "__main__":
    main()
