"""Read what an image says about itself: its build record and labels, without running it."""

from __future__ import annotations

import io
import tarfile

from ..errors import BuildError, ConfigError
from ..inimage.contract import BuildRecord, ContractError
from . import dockercli

RECORD_PATH = "/opt/sparkforge/build-record.json"


def read_record(image: str) -> tuple[BuildRecord, dict]:
    """(build record, labels) of an image in the local engine; the image is created, never started."""
    import docker
    from docker.errors import DockerException, ImageNotFound, NotFound

    problem = dockercli.engine_problem()
    if problem:
        raise BuildError(problem, field="docker")
    try:
        client = docker.from_env(timeout=dockercli.LONG)
        img = client.images.get(image)
    except ImageNotFound:  # the image named is not there: bad input, as an unknown variant is
        raise ConfigError(f"image {image} not found in the local engine", field="IMAGE") from None
    except DockerException as exc:
        raise BuildError(f"cannot reach the Docker engine: {exc}", field="docker") from None
    container = client.containers.create(img.id, command=["true"], network_mode="none")
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
    labels = dict(img.labels or {})
    return record, labels
