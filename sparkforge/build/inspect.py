"""Read what an image says about itself: its build record and labels, without running it."""

from __future__ import annotations

import io
import tarfile
from typing import Any

from ..errors import BuildError, ConfigError
from ..inimage.contract import BuildRecord, ContractError
from ..inimage.fatbin import TARGET_RE
from ..recipe.fields import GPU_RE
from . import dockercli

RECORD_PATH = "/opt/sparkforge/build-record.json"


def read_record(image: str) -> tuple[BuildRecord, dict[str, str]]:
    """(build record, labels) of an image in the local engine: a container of it is created, never started, and
    the record copied out of it (`docker create`, `docker cp`), then the container is removed."""
    problem = dockercli.engine_problem()
    if problem:
        raise BuildError(problem, field="docker")
    data = dockercli.inspect_images(image)[image]
    if data is None:  # the image named is not there: bad input, as an unknown variant is
        raise ConfigError(f"image {image} not found in the local engine", field="IMAGE")
    labels = {str(k): str(v) for k, v in ((data.get("Config") or {}).get("Labels") or {}).items()}
    platform = "/".join(str(data[k]) for k in ("Os", "Architecture", "Variant") if data.get(k))
    created = dockercli.run(["create", "--network", "none", *(["--platform", platform] if platform else []),
                             str(data["Id"]), "true"], what="docker create")
    container = created.stdout.strip().splitlines()[-1] if created.stdout.strip() else ""
    try:
        copied = dockercli.run(["cp", f"{container}:{RECORD_PATH}", "-"], what="docker cp", text=False, check=False)
    finally:
        dockercli.remove_container(container)
    if copied.returncode != 0:
        why = dockercli.last_line(copied.stderr, f"exit code {copied.returncode}")
        if "Could not find the file" in why or "No such container:path" in why:  # an image of another tool
            raise ConfigError(f"{image} has no {RECORD_PATH}: it was not built by sparkforge", field="IMAGE")
        raise BuildError(f"cannot read {RECORD_PATH} of {image}: {why}", field="docker")
    try:
        with tarfile.open(fileobj=io.BytesIO(copied.stdout)) as tf:
            member = tf.extractfile(tf.getmembers()[0])
            record_data = member.read() if member else b""
    except (tarfile.TarError, IndexError) as exc:
        raise BuildError(f"cannot read {RECORD_PATH} of {image}: docker cp gave no file ({exc})",
                         field="docker") from None
    try:
        record = BuildRecord.from_json(record_data, f"{image}: {RECORD_PATH}")
    except ContractError as exc:
        raise BuildError(str(exc), field="IMAGE") from None
    problem = kernels_problem(record.kernels)
    if problem:
        raise BuildError(f"{image}: {RECORD_PATH}: {problem}", field="IMAGE")
    return record, labels


def kernels_problem(kernels: object) -> str | None:
    """Why an image's kernel record cannot be shown (the field and what is wrong), or None. An image may
    come from anywhere: its GPUs and targets are checked here, where they are read, as a recipe's are."""
    if kernels is None:
        return None
    if not isinstance(kernels, dict):
        return "kernels: not a JSON object"
    gpus = kernels.get("gpus") or []
    if not isinstance(gpus, list):
        return "kernels.gpus: not a list"
    for i, gpu in enumerate(gpus):
        if not (isinstance(gpu, str) and GPU_RE.fullmatch(gpu)):
            return f"kernels.gpus[{i}]: {gpu!r} is not a compute capability such as '12.1'"
    for key, kind in (("not_needed", list), ("extensions", list), ("without_device_code", int)):
        if not isinstance(kernels.get(key, kind()), kind):
            return f"kernels.{key}: not a JSON {'list' if kind is list else 'number'}"
    for i, ext in enumerate(kernels.get("extensions", [])):
        where = f"kernels.extensions[{i}]"
        if not (isinstance(ext, dict) and isinstance(ext.get("path"), str)):
            return f"{where}: not an extension with a path"
        for key in ("cubins", "ptx"):
            names = ext.get(key)
            if not (isinstance(names, list) and all(isinstance(n, str) and TARGET_RE.fullmatch(n) for n in names)):
                return f"{where}.{key}: not a list of targets such as sm_121 or compute_120f"
        coverage = ext.get("coverage") or {}
        if not (isinstance(coverage, dict) and all(isinstance(c, dict) and _coverage_ok(c) for c in coverage.values())):
            return f"{where}.coverage: not what a kernel scan writes"
    return None


def _coverage_ok(cov: dict[str, Any]) -> bool:
    lists = all(isinstance(cov.get(k, []), list) and all(isinstance(x, str) for x in cov.get(k, []))
                for k in ("examples", "only_in", "unread"))
    return lists and type(cov.get("missing", 0)) is int and type(cov.get("kernels") or 0) is int
