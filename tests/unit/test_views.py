"""What the command line prints: text from files is shown as written, never read as Rich markup."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.support.paths import IMAGES


def test_markup_in_a_description_is_printed_as_written(cli, tmp_path: Path) -> None:
    images = tmp_path / "images"
    shutil.copytree(IMAGES, images)
    (images / "marked.yaml").write_text("extends: ng17\ndescription: '[bold]kept[/bold] and [/] too'\n")
    for args in (("show", "marked"), ("list",)):
        proc = cli("--images", str(images), *args)
        assert proc.returncode == 0, proc.stderr
    proc = cli("--images", str(images), "show", "marked", check=True)
    assert "[bold]kept[/bold] and [/] too" in proc.stdout
