"""One image reference, `[REGISTRY[:PORT]/]REPOSITORY[:TAG][@DIGEST]`, parsed once and formatted back.

A colon after the last slash starts the tag; the first path part is a registry when it has a dot or a port, or
is `localhost`, as Docker reads it. Parsing checks nothing: callers validate what the user gave.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class ImageRef:
    repository: str  # with its registry when it names one: 127.0.0.1:5000/sparkforge/vllm
    tag: str | None = None  # None: no tag given ("" when the reference ends in a bare colon)
    digest: str | None = None  # sha256:...

    @classmethod
    def parse(cls, text: str) -> ImageRef:
        name, at, digest = text.partition("@")
        colon = name.rfind(":")
        if colon > name.rfind("/"):
            return cls(name[:colon], name[colon + 1:], digest if at else None)
        return cls(name, None, digest if at else None)

    @property
    def registry(self) -> str | None:
        """The registry host (with its port) the repository names, or None for Docker Hub."""
        first, sep, _ = self.repository.partition("/")
        return first if sep and ("." in first or ":" in first or first == "localhost") else None

    @property
    def path(self) -> str:
        """The repository without its registry: sparkforge/vllm."""
        registry = self.registry
        return self.repository[len(registry) + 1:] if registry else self.repository

    @property
    def name(self) -> str:
        """REPOSITORY[:TAG], without the digest."""
        return self.repository if self.tag is None else f"{self.repository}:{self.tag}"

    def with_tag(self, tag: str | None) -> ImageRef:
        return replace(self, tag=tag)

    def __str__(self) -> str:
        return self.name if self.digest is None else f"{self.name}@{self.digest}"


def is_attestation(entry: dict[str, Any]) -> bool:
    """Whether an image index entry is BuildKit's attestation manifest (by annotation, or platform unknown/unknown)."""
    notes, platform = entry.get("annotations"), entry.get("platform")
    return ((isinstance(notes, dict) and notes.get("vnd.docker.reference.type") == "attestation-manifest")
            or (isinstance(platform, dict) and platform.get("os") == "unknown"))
