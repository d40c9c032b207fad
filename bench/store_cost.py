"""The SQLite record store's cost per call (`--response-store`), alone and shared by several API
processes (`--api-server-count`): 10,000 puts of 2 KB records into a fresh file (the mean while
it fills), then 2,000 gets at 10,000 records. Run it under two packages to compare them:

    PYTHONPATH=<other checkout> python bench/store_cost.py
    python bench/store_cost.py
"""

from __future__ import annotations

import tempfile
import time

import metrale
from metrale.server.stores.sqlite import SqliteStore

RECORDS, GETS = 10_000, 2_000


def main() -> None:
    directory = tempfile.mkdtemp(prefix="store-cost-")
    record = {"x": "y" * 2000}
    for shared in (False, True):
        store = SqliteStore(f"{directory}/shared-{shared}.db", shared=shared)
        start = time.perf_counter()
        for i in range(RECORDS):
            store.put("response", f"k{i}", record)
        put_us = (time.perf_counter() - start) / RECORDS * 1e6
        start = time.perf_counter()
        for i in range(GETS):
            store.get("response", f"k{i * 3}")
        get_us = (time.perf_counter() - start) / GETS * 1e6
        store.close()
        print(f"{metrale.__file__} shared={shared}: put {put_us:.0f} us, get {get_us:.0f} us")


if __name__ == "__main__":
    main()
