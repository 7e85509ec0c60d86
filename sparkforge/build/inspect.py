"""Read what an image says about itself: its build record and labels, without running it."""

from __future__ import annotations

import io
import tarfile

from ..errors import BuildError, ConfigError
from ..inimage.contract import BuildRecord, ContractError, KernelRecord
from ..inimage.fatbin import TARGET_RE
from ..recipe.fields import GPU_RE
from . import dockercli

RECORD_PATH = "/opt/sparkforge/build-record.json"


def read_record(image: str) -> tuple[BuildRecord, dict[str, str]]:
    """(build record, labels) of an image in the local engine, copied out of a container never started."""
    data = dockercli.inspect_images(image)[image]
    if data is None:  # the image named is not there: bad input, as an unknown variant is
        raise ConfigError(f"image {image} not found in the local engine", field="IMAGE")
    labels = {str(k): str(v) for k, v in ((data.get("Config") or {}).get("Labels") or {}).items()}
    platform = "/".join(str(data[k]) for k in ("Os", "Architecture", "Variant") if data.get(k))
    created = dockercli.run(["create", "--network", "none", *(["--platform", platform] if platform else []),
                             str(data["Id"]), "true"], what="docker create")
    container = dockercli.last_line(created.stdout, "")
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
    if problem := kernels_problem(record.kernels):
        raise BuildError(f"{image}: {RECORD_PATH}: {problem}", field="IMAGE")
    return record, labels


def kernels_problem(kernels: KernelRecord | None) -> str | None:
    """Why an image's kernel record cannot be shown (its GPUs and targets checked as a recipe's are), or None."""
    if kernels is None:
        return None
    for i, gpu in enumerate(kernels.gpus):
        if not GPU_RE.fullmatch(gpu):
            return f"kernels.gpus[{i}]: {gpu!r} is not a compute capability such as '12.1'"
    for i, ext in enumerate(kernels.extensions):
        for key, names in (("cubins", ext.cubins), ("ptx", ext.ptx)):
            if not all(TARGET_RE.fullmatch(n) for n in names):
                return f"kernels.extensions[{i}].{key}: not a list of targets such as sm_121 or compute_120f"
    return None
