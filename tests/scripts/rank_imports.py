"""One rank of a run, started by torchrun from the run folder alone, with the planner, the hardware probe and the
model resolver made to fail if called; then reports which parts of ft it imported.

torchrun ... tests/scripts/rank_imports.py RUN_DIR OUT_PREFIX  -> OUT_PREFIX-RANK.json: {"modules": [...]}
"""

import json
import os
import sys

import finetune.catalog
import finetune.hardware
import finetune.plan.planner
from finetune.rank import main


def forbidden(*args, **kwargs):
    raise AssertionError("a rank planned, probed the hardware or resolved the model again")


finetune.hardware.probe = finetune.plan.planner.plan = finetune.catalog.resolve = forbidden
run_dir, prefix = sys.argv[1], sys.argv[2]
try:
    main([run_dir])
finally:
    with open(f"{prefix}-{os.environ.get('RANK', '0')}.json", "w") as f:
        json.dump({"modules": sorted(m for m in sys.modules if m.startswith("finetune"))}, f)
