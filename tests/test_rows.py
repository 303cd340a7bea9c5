"""finetune/data/rows.py: a prepared split read with pyarrow alone gives what `datasets` gives for every access the
training code makes, and reading one does not import `datasets` or pandas."""

from __future__ import annotations

import subprocess
import sys

import pytest

from finetune.data.rows import Rows
from tests.helpers import REPO


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path_factory.mktemp("split")
    data = {
        "input_ids": [[i, i + 1, i + 2][: 1 + i % 3] for i in range(2500)],
        "labels": [[-100] * (i % 2) + [i] for i in range(2500)],
        "text": [f"row {i}" if i % 7 else None for i in range(2500)],
        "margin": [i / 3 if i % 5 else None for i in range(2500)],
    }
    ds = datasets.Dataset.from_dict(data)
    # several Arrow files, as a large split is saved
    ds.save_to_disk(str(folder), max_shard_size=20_000)
    return folder, datasets.load_from_disk(str(folder))


def test_rows_match_datasets_for_every_access_the_loop_makes(saved):
    folder, ds = saved
    rows = Rows.load(folder)
    assert len(rows) == len(ds) and rows.column_names == ds.column_names
    for indices in ([5, 2, 2, 2499, 0], list(range(100, 140)), [7], [], list(range(2400, 2500)) + [1]):
        assert rows.select(indices)[:] == ds.select(indices)[:]
    assert rows.select([9, 3]).select([1])[:] == ds.select([9, 3]).select([1])[:]
    for i in (0, 1, 1234, -1, -2500):
        assert rows[i] == ds[i]
    for part in (slice(0, 3), slice(10, 2500, 97), slice(-4, None), slice(5, 5)):
        assert rows[part] == ds[part]
    for column in ds.column_names:
        assert rows[column] == ds[column]
    assert list(rows) == list(ds)


def test_out_of_range_rows_raise_index_error(saved):
    rows = Rows.load(saved[0])
    for bad in (2500, -2501):
        with pytest.raises(IndexError):
            rows[bad]
    with pytest.raises(IndexError):
        rows.select([0, 2500])


def test_reading_a_split_imports_neither_datasets_nor_pandas(saved):
    code = (
        "import sys\nfrom finetune.data.rows import Rows\n"
        f"r = Rows.load({str(saved[0])!r})\n"
        "r.select([3, 1, 2])[:]; r[0]; r['labels']; r[1:9:2]; list(r)\n"
        "print(sorted(m for m in ('datasets', 'pandas') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.strip() == "[]"
