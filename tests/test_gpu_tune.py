"""`specgen tune` on a GPU: a small search of a block-sparse spec (its kernels walk
a block map built for each config's tiles), checked against fp64 before it
reports. The spec is a copy in a temporary folder; nothing in the checkout is
written.

    python -m pytest -q -m gpu tests/test_gpu_tune.py
"""

import json

import pytest
import yaml

from .helpers import ROOT

pytestmark = pytest.mark.gpu


def _sm() -> str:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


@pytest.mark.parametrize("name", ["fmha_document_mask", "fmha_prefix_lm"])
def test_tune_searches_a_block_sparse_spec_with_a_map_per_tile_shape(name, tmp_path):
    from specgen.commands.tune import run_tune

    target = _sm()
    data = yaml.safe_load((ROOT / "specs" / f"{name}.yaml").read_text())
    # Two tile shapes, so each config needs its own map; both launch orders.
    data["autotune"] = {target: {"tile_m": [64], "tile_n": [64, 128], "occupancy": [2],
                                 "tile_order": ["per_head", "global"]}}
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    before = spec.read_text()
    code = run_tune(spec, target, "prefill", tmp_path / "results", tmp_path / "gen", seqs=[1024],
                    dry_run=True, confirm=2)
    assert code == 0 and spec.read_text() == before  # --dry-run leaves the spec
    report = json.loads(next((tmp_path / "results").rglob(f"tune-{name}-{target}.json")).read_text())
    (length,) = report["lengths"]
    assert length["seq"] == 1024 and not length["failures"], length["failures"]
    assert len(length["measurements"]) == 4 and len(length["confirmed"]) == 2
    assert all(m["tflops"] > 1 for m in length["measurements"])
    # The chosen config ran the chunked-prefill check (its own map, at a q_offset) and passed.
    assert report["chosen"]["checked"] and all(err < 2e-2 for err in report["chosen"]["checked"].values())
