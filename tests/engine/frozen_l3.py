"""``kvtier ARGS`` on a store whose writes freeze while the file ``$KVTIER_TEST_FREEZE``
exists, as on a frozen filesystem (``fsfreeze``) or a hung disk: each L3 commit (the
writer's batches) and each side-table write (meta, counters) waits until the file is
gone. Reads are left alone. A test starts it as a process of its own
(``python -m tests.engine.frozen_l3 serve ...``), creates the file when the freeze
should begin, and sends signals."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.engine.cli.main import main
from kvtier.tiers.l3.lmdb_tables import LmdbTables
from kvtier.tiers.l3.lmdb_txn import PageTables

FROZEN = Path(os.environ["KVTIER_TEST_FREEZE"])


def frozen(write: Callable[..., Any]) -> Callable[..., Any]:
    def waits(*args: Any, **kwargs: Any) -> Any:
        while FROZEN.exists():
            time.sleep(0.02)
        return write(*args, **kwargs)

    return waits


PageTables.write = frozen(PageTables.write)  # the one transaction of a writer's batch (tiers.l3.writer)
LmdbTables.put_meta = frozen(LmdbTables.put_meta)
LmdbTables.add_persistent_counters = frozen(LmdbTables.add_persistent_counters)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
