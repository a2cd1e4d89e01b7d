"""Where the kit's shipped files live: `constitutions/`, `data/`, `recipes/`, `runs/`.

The kit is used from its repository (an editable install), so these are folders beside the
`kitchen` package. `KITCHEN_HOME` points elsewhere, e.g. at a copy of the repository's data.
"""

from __future__ import annotations

import os
from pathlib import Path

HOME = Path(os.environ.get("KITCHEN_HOME") or Path(__file__).resolve().parent.parent)
CONSTITUTIONS = HOME / "constitutions"
DATA = HOME / "data"
PROFILES = DATA / "profiles"
RECIPES = HOME / "recipes"
RUNS = Path(os.environ.get("KITCHEN_RUNS") or HOME / "runs")
DEFAULT_CONSTITUTION = CONSTITUTIONS / "concierge.yaml"
