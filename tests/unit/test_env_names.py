"""check-mods: every runtime env name of a variant must be read by its pinned vLLM source, after its mods.

The names_read tests write small real files; the check-mods tests run the command on the vLLM 0.17.0
release source (PyPI, cached).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sparkforge.repro.checkmods import names_read
from tests.support.paths import IMAGES, ROOT


def tree_with(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / "vllm" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_a_name_is_read_where_a_file_holds_it_as_a_whole_string_literal(tmp_path: Path) -> None:
    tree = tree_with(tmp_path, {
        "envs.py": 'environment_variables = {\n    "VLLM_A": lambda: os.getenv("VLLM_A", "0"),\n}\n',
        "config/x.py": 'import os\nflag = os.environ.get(\'VLLM_B\') == "1"\n',
        "notes.py": '# VLLM_C is mentioned only in a comment\n"""and VLLM_C in a docstring"""\n',
        "longer.py": 'x = os.environ.get("VLLM_D_LONGER")\ny = f"VLLM_{name}"\n',
        "bytes.py": 'k = b"VLLM_E"\n',
    })
    names = ["VLLM_A", "VLLM_B", "VLLM_C", "VLLM_D", "VLLM_E"]
    assert names_read(tree, names) == {"VLLM_A", "VLLM_B"}


def test_files_outside_the_package_and_files_that_do_not_tokenize_read_nothing(tmp_path: Path) -> None:
    tree = tree_with(tmp_path, {"broken.py": 'x = ("VLLM_A"\n', "ok.py": "y = 1\n"})
    (tmp_path / "setup.py").write_text('os.environ.get("VLLM_B")\n')
    (tmp_path / "vllm" / "data.txt").write_text('"VLLM_C"\n')
    assert names_read(tree, ["VLLM_A", "VLLM_B", "VLLM_C"]) == set()


# ------------------------------------------------------------------ check-mods on the real 0.17.0 source


@pytest.fixture
def images(tmp_path: Path) -> Path:
    """ng17 (v0.17.0), and two children: one sets names with the UF17 mod, one sets UF17's name without it."""
    folder = tmp_path / "images"
    folder.mkdir()
    shutil.copy(IMAGES / "ng17.yaml", folder)
    (folder / "envs.yaml").write_text(
        "extends: ng17\nmods: [uf17-eager-allreduce]\n"
        "env: {VLLM_MARLIN_INPUT_DTYPE: fp8, VLLM_SPARKFORGE_NEVER_READ: '1', NCCL_IB_DISABLE: '1'}\n")
    (folder / "nouf17.yaml").write_text("extends: ng17\nmods: [serve-torchrun]\nenv: {VLLM_UF_EAGER_ALLREDUCE: '1'}\n")
    return folder


def rows(stdout: str, variant: str) -> dict[str, str]:
    """The check-mods table's env rows of a variant, by name."""
    out = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[0] == variant and parts[1] == "env":
            out[parts[2]] = line
    return out


@pytest.mark.network
def test_check_mods_fails_on_a_name_the_release_never_reads_and_passes_on_one_it_reads(images: Path, cli) -> None:
    proc = cli("--images", str(images), "check-mods", "envs", "nouf17", timeout=900)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    envs = rows(proc.stdout, "envs")
    assert set(envs) == {"VLLM_MARLIN_INPUT_DTYPE", "VLLM_SPARKFORGE_NEVER_READ", "NCCL_IB_DISABLE",
                         "VLLM_UF_EAGER_ALLREDUCE"}
    # read by the release itself (vllm/envs.py), and by the release with the mod that adds it
    assert " read " in envs["VLLM_MARLIN_INPUT_DTYPE"] and "recipe env" in envs["VLLM_MARLIN_INPUT_DTYPE"]
    assert " read " in envs["VLLM_UF_EAGER_ALLREDUCE"] and "toggle of mod uf17-eager-allreduce" in \
        envs["VLLM_UF_EAGER_ALLREDUCE"]
    # one line naming the name, the variant and the release
    assert (" failed " in envs["VLLM_SPARKFORGE_NEVER_READ"]
            and "envs sets VLLM_SPARKFORGE_NEVER_READ (recipe env), which no .py file of vllm 0.17.0 with its mods "
                "reads" in envs["VLLM_SPARKFORGE_NEVER_READ"]), proc.stdout
    # a name for another program is not vLLM's to read: unverified, not failed
    assert " unverified " in envs["NCCL_IB_DISABLE"]
    # without the mod that adds it, 0.17.0 never reads UF17's name
    (line,) = rows(proc.stdout, "nouf17").values()
    assert " failed " in line and "nouf17 sets VLLM_UF_EAGER_ALLREDUCE" in line and "vllm 0.17.0" in line
    assert "with its mods" not in line  # nouf17 lists no vLLM mod
    assert "2 failed" in proc.stdout


@pytest.mark.network
def test_check_mods_passes_when_every_name_is_read(images: Path, cli) -> None:
    (images / "envs.yaml").write_text("extends: ng17\nmods: [uf17-eager-allreduce]\n"
                                      "env: {VLLM_MARLIN_INPUT_DTYPE: fp8}\n")
    proc = cli("--images", str(images), "check-mods", "envs", "--strict", timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert set(rows(proc.stdout, "envs")) == {"VLLM_MARLIN_INPUT_DTYPE", "VLLM_UF_EAGER_ALLREDUCE"}
    assert "0 failed, 0 unverified" in proc.stdout


def test_where_the_source_is_unverified_so_is_the_env_check(tmp_path: Path) -> None:
    from sparkforge.repro.checkmods import check_env
    from sparkforge.recipe.layout import Layout
    from sparkforge.recipe.planner import plan_variant

    plan = plan_variant(Layout.default(ROOT), "ng16")  # its full commit is unknown
    (row,) = check_env(plan, tmp_path)
    assert (row.mod, row.state) == ("env VLLM_UF_EAGER_ALLREDUCE", "unverified")
    assert "882682ab8" in row.detail
