"""The device runs' variants (`scripts/variants/*/*.sh`, run by `scripts/h200_lease.sh var` /
`var_thr` inside a copy of `atom/`) each edit the source with sed and check the edit took: every
one must still apply to the current tree, or a lease call loses that run ("variant failed").
A change to a default (a fusion list, a table) has to carry the variants that edit it along."""
from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = sorted((REPO / "scripts" / "variants").glob("*/*.sh"))


def test_there_are_variants():
    assert len(SCRIPTS) >= 10


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_variant_applies_to_the_current_tree(script, tmp_path):
    shutil.copytree(REPO / "atom", tmp_path / "atom")
    done = subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{script.name} no longer applies: {done.stderr[-500:]}"
