"""The JSON file the bench scripts write: the device, the run's constants, the rows."""

from __future__ import annotations

import json


def write_rows(path: str, rows: list[dict], **meta) -> None:
    """``{"device": <this GPU>, **meta, "rows": rows}`` to ``path``."""
    import torch

    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), **meta, "rows": rows}, f, indent=1)
