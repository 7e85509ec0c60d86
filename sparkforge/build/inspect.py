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
    """(build record, labels) of an image in the local engine; the image is created, never started."""
    import docker
    from docker.errors import DockerException, ImageNotFound, NotFound

    problem = dockercli.engine_problem()
    if problem:
        raise BuildError(problem, field="docker")
    try:
        client = docker.from_env(timeout=int(dockercli.LONG))  # the SDK takes whole seconds
        img = client.images.get(image)
    except ImageNotFound:  # the image named is not there: bad input, as an unknown variant is
        raise ConfigError(f"image {image} not found in the local engine", field="IMAGE") from None
    except DockerException as exc:
        raise BuildError(f"cannot reach the Docker engine: {exc}", field="docker") from None
    container = client.containers.create(img, command=["true"], network_mode="none")
    try:
        stream, _ = container.get_archive(RECORD_PATH)
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tf:
            member = tf.extractfile(tf.getmembers()[0])
            data = member.read() if member else b""
    except NotFound:  # an image of another tool, named by the user: bad input too
        raise ConfigError(f"{image} has no {RECORD_PATH}: it was not built by sparkforge", field="IMAGE") from None
    except DockerException as exc:
        raise BuildError(f"cannot read {RECORD_PATH} of {image}: {exc}", field="docker") from None
    finally:
        container.remove(force=True)
    try:
        record = BuildRecord.from_json(data, f"{image}: {RECORD_PATH}")
    except ContractError as exc:
        raise BuildError(str(exc), field="IMAGE") from None
    problem = kernels_problem(record.kernels)
    if problem:
        raise BuildError(f"{image}: {RECORD_PATH}: {problem}", field="IMAGE")
    labels = dict(img.labels or {})
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
