"""A prepared split as the training loop reads it: the Arrow files of a cache entry, memory-mapped.

The cache entry is written by `datasets` (`save_to_disk`: Arrow stream files listed in `state.json`); reading it
back needs only pyarrow, so a job whose data is already prepared starts without importing `datasets` and pandas
(about half a second). `Rows` answers what the methods and the loop ask of a split, with the values `datasets`
would give: `len`, `column_names`, `select(indices)`, `rows[i]` (a row as a dict), `rows[a:b]` (a dict of column
lists), `rows["column"]` (a list) and iteration over rows.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


class Rows:
    def __init__(self, table):
        self.table = table  # a pyarrow.Table

    @classmethod
    def load(cls, folder: str | Path) -> Rows:
        """The split saved in `folder` (a `datasets` save_to_disk folder), memory-mapped."""
        import pyarrow as pa

        folder = Path(folder)
        state = json.loads((folder / "state.json").read_text())
        tables = [
            pa.ipc.open_stream(pa.memory_map(str(folder / f["filename"]))).read_all() for f in state["_data_files"]
        ]
        return cls(pa.concat_tables(tables) if len(tables) > 1 else tables[0])

    def __len__(self) -> int:
        return self.table.num_rows

    @property
    def column_names(self) -> list[str]:
        return list(self.table.column_names)

    def select(self, indices) -> Rows:
        """The rows at `indices`, in that order: zero-copy slices of runs of consecutive rows (pyarrow's `take` would
        import pandas)."""
        import pyarrow as pa

        runs: list[list[int]] = []  # [start, length]
        for i in indices:
            i = int(i)
            if not 0 <= i < len(self):
                raise IndexError(f"row {i} of {len(self)}")
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1][1] += 1
            else:
                runs.append([i, 1])
        if not runs:
            return Rows(self.table.slice(0, 0))
        parts = [self.table.slice(start, length) for start, length in runs]
        return Rows(parts[0] if len(parts) == 1 else pa.concat_tables(parts))

    def __getitem__(self, key):
        if isinstance(key, str):
            return self.table.column(key).to_pylist()
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step == 1:
                return self.table.slice(start, max(stop - start, 0)).to_pydict()
            return self.select(range(start, stop, step)).table.to_pydict()
        index = int(key)
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {key} of {len(self)}")
        return self.table.slice(index % len(self), 1).to_pylist()[0]

    def __iter__(self) -> Iterator[dict]:
        for batch in self.table.to_batches(max_chunksize=1000):
            yield from batch.to_pylist()

    def __repr__(self) -> str:
        return f"Rows({len(self)} rows: {', '.join(self.column_names)})"
