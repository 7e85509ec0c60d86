"""Golden Dockerfiles: what the template renders for each shipped variant, kept in tests/golden.

The test compares; only `make golden` (this module run as a script) writes them, printing the diff.
"""

from __future__ import annotations

import difflib
import re
import sys

from sparkforge.recipe.layout import Layout
from sparkforge.recipe.planner import plan_variant
from sparkforge.build.render import render_dockerfile
from tests.support.paths import IMAGES, ROOT, shipped_files

GOLDEN = ROOT / "tests" / "golden"


def shipped() -> list[str]:
    """The variants the project ships: a recipe a user added and git does not track has no golden file yet."""
    tracked = shipped_files(IMAGES)
    return sorted(p.stem for p in IMAGES.glob("*.yaml") if tracked is None or p in tracked)


def rendered(variant: str) -> str:
    """The Dockerfile of a shipped variant. The plan hash covers the tooling too; a golden file is about
    the template, so the hash is masked (tags and hashes have tests of their own)."""
    layout = Layout.default()
    return re.sub(r'(io\.sparkforge\.plan-hash=)"[0-9a-f]{64}"', r'\1"<plan hash>"',
                  render_dockerfile(plan_variant(layout, variant), layout))


def delta(variant: str) -> str:
    """The unified diff from the golden file to what renders now ('' when they agree)."""
    golden = GOLDEN / f"{variant}.Dockerfile"
    old = golden.read_text() if golden.exists() else ""
    return "".join(difflib.unified_diff(old.splitlines(True), rendered(variant).splitlines(True),
                                        f"{golden.name} (golden)", f"{golden.name} (rendered now)"))


def main() -> int:
    for variant in shipped():
        change = delta(variant)
        if change:
            (GOLDEN / f"{variant}.Dockerfile").write_text(rendered(variant))
            print(f"golden: rewrote tests/golden/{variant}.Dockerfile:\n{change}")
        else:
            print(f"golden: tests/golden/{variant}.Dockerfile unchanged")
    stale = sorted(set(p.stem for p in GOLDEN.glob("*.Dockerfile")) - set(shipped()))
    for name in stale:
        (GOLDEN / f"{name}.Dockerfile").unlink()
        print(f"golden: removed tests/golden/{name}.Dockerfile (no such variant)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
