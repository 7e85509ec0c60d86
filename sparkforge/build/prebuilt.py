"""The prebuilt vLLM wheel a recipe names (`vllm.source: wheel`): where it lies, fetched or copied into
the download cache, and checked as every command that uses it checks it."""

from __future__ import annotations

import os
import zipfile
from email.parser import HeaderParser
from pathlib import Path

from packaging.version import InvalidVersion, Version

from ..errors import BuildError, ConfigError, DownloadError
from ..files import is_regular
from ..recipe import download
from ..recipe.layout import Layout
from ..recipe.plan import Plan
from .wheels import WheelInput


def planned_wheel(plan: Plan) -> WheelInput:
    """Where the recipe's wheel lies once fetched, without fetching it (render, dry runs)."""
    w = plan.vllm.wheel
    assert w is not None
    path = download.cached(w.sha256, w.filename)
    return WheelInput("recipe", path.parent, path.name, w.sha256)


def recipe_wheel(plan: Plan, layout: Layout, *, ca_cert: Path | None = None) -> WheelInput:
    """The recipe's prebuilt wheel, fetched (or copied) into the cache and checked (checked_wheel)."""
    checked_wheel(plan, layout.images_dir / f"{plan.variant}.yaml", ca_cert=ca_cert)
    return planned_wheel(plan)


def checked_wheel(plan: Plan, recipe: Path, *, ca_cert: Path | None = None) -> Path:
    """The recipe's wheel in the cache, checked: its sha256, a whole zip, its METADATA's version. Only an
    unreachable source is not a ConfigError (DownloadError)."""
    w = plan.vllm.wheel
    assert w is not None
    if w.local and not (is_regular(w.local) and os.access(w.local, os.R_OK)):
        raise ConfigError(f"{w.path} is not a readable regular file in {recipe.parent}", path=recipe,
                          field="vllm.path")
    try:
        path = (download.fetch(w.url, w.sha256, w.filename, ca_cert=ca_cert) if w.url
                else download.take_local(Path(w.local or ""), w.sha256, w.filename))
    except download.HashMismatch as exc:
        raise ConfigError(f"the wheel has sha256 {exc.got}, not {exc.wanted}: pin the wheel you mean",
                          path=recipe, field="vllm.sha256") from None
    except download.DownloadFailed as exc:
        raise DownloadError(f"cannot fetch the wheel: {exc}", path=recipe, field="vllm.url") from None
    except ConfigError as exc:  # the path turned into a FIFO or a folder after the check above
        raise ConfigError(exc.detail, path=recipe, field="vllm.path") from None
    except OSError as exc:
        raise BuildError(f"cannot keep the wheel in the download cache {download.downloads_dir()}: "
                         f"{exc.strerror or exc}", path=recipe, field="vllm") from None
    if broken := _zip_damage(path):
        raise ConfigError(f"{w.filename} is not a whole wheel: {broken}", path=recipe,
                          field="vllm.url" if w.url else "vllm.path")
    found = metadata_version(path)
    if found != Version(plan.vllm.version):
        raise ConfigError(f"{w.filename} holds vllm {found} (its METADATA), but the recipe says version "
                          f"{plan.vllm.version}", path=recipe, field="vllm.version")
    return path


def _zip_damage(path: Path) -> str | None:
    """Why a wheel is not a readable zip archive (every member's CRC is checked), or None."""
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, NotImplementedError) as exc:
        return f"not a zip archive ({exc})"
    return f"{bad} fails its CRC check" if bad else None


def metadata_version(wheel: Path) -> Version | None:
    """The Version field of a wheel's METADATA, or None when it has none that parses."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            name = next((n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")), None)
            if name is None:
                return None
            headers = HeaderParser().parsestr(zf.read(name).decode("utf-8", errors="replace"))
        return Version(headers.get("Version", ""))
    except (zipfile.BadZipFile, InvalidVersion, OSError):
        return None
