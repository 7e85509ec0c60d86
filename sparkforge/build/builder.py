"""Build stage: a rendered context becomes an image through BuildKit (`docker buildx build`).

The build tags only its candidate (`TAG-candidate`), which the engine resolves to the ID its own image store
uses; `promote` moves the immutable and moving tags only after the smoke tests pass. Builds carry no provenance
attestation (`--provenance=false`): on the containerd store it makes every image an index whose digest changes
with each build (it holds the invocation ID and times), so an unchanged plan would never give the same image.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from collections.abc import Callable

from ..errors import BuildError
from ..files import name_path
from ..recipe.plan import Plan
from . import dockercli
from .render import Context

# Seconds a build may write no line before it is stopped: BuildKit passes on every line a step prints (ninja:
# one per compile unit), so this ends a wedged BuildKit or a stalled download, never a long compile.
BUILD_STALL = 7200.0
_STEP = re.compile(r"^#(\d+) \[([^\]]+)\] (.*)$")
_CACHED = re.compile(r"^#(\d+) CACHED$")
_DONE = re.compile(r"^#(\d+) DONE ([0-9.]+)s$")
_ERROR = re.compile(r"^#(\d+) ERROR: (.*)$")
_OUTPUT = re.compile(r"^#(\d+) [0-9.]+ (.*)$")  # a line a step's command wrote, after its time
SHOWN_LINES = 12  # of a failed step's output, printed above the error
SHOW_AFTER = 1.0  # seconds: a step still running this long after it started is shown, even with no line of its own
STILL_RUNNING = 10.0  # seconds: a step that runs longer has its progress shown again, with its latest line
_MOD_FAILED = re.compile(r"mod ([a-z0-9-]+): FAILED: (.*)$")
_FETCH_FAILED = re.compile(r"gitfetch: (\S+ \S+: .*)$")  # gitfetch.py's one line when a ref cannot be fetched
_BASE_FAILED = re.compile(r"failed to resolve source metadata for (\S+?):? (.*)$")  # BuildKit cannot get FROM


@dataclass
class Step:
    """One step of the build as BuildKit reported it."""

    number: int
    name: str  # e.g. "runtime 5/12"
    command: str
    cached: bool = False
    seconds: float | None = None
    error: str | None = None
    said: str = ""  # while it runs: the last line it wrote, when progress is shown again for a long step

    @property
    def stage(self) -> str:
        return self.name.split(" ")[0]

    @property
    def ran(self) -> bool:
        return (not self.cached and self.seconds is not None and not self.command.startswith("FROM ")
                and not self.name.startswith(("internal", "context ")))  # BuildKit's own, and named contexts


@dataclass(frozen=True)
class BuildOptions:
    network: str | None = None
    ca_cert: Path | None = None
    no_cache: bool = False
    max_jobs: int | None = None
    nvcc_threads: int | None = None
    source_date_epoch: int | None = None
    log_dir: Path = Path("build/logs")
    builder: str | None = None
    output: str | None = None  # instead of INTO_ENGINE: a buildx --output, e.g. type=docker,dest=X.tar
    docker_host: str | None = None  # the engine to build on (DOCKER_HOST), e.g. unix:///run/other/docker.sock
    contexts: tuple[tuple[str, str], ...] = ()  # named build contexts (--build-context NAME=DIR)
    labels: tuple[tuple[str, str], ...] = ()  # --label: set on the image without touching a step's cache


@dataclass
class BuildResult:
    plan: Plan
    image_id: str
    candidate: str
    log_path: Path
    seconds: float
    steps: list[Step] = field(default_factory=list)
    tags: dict[str, str | None] = field(default_factory=dict)  # the image ID each tag asked for (`also`) points to

    @property
    def ran(self) -> list[Step]:
        return [s for s in self.steps if s.ran]


def candidate_tag(plan: Plan) -> str:
    return f"{plan.tag}-candidate"


# How a build goes into the engine: zstd level 1 exports and unpacks in half gzip's time on the containerd store
# (Docker 29's default), which keeps and pushes layers as exported, so nodes pull zstd too (README, performance);
# Docker 23+ and containerd pull zstd by the OCI media types. The classic store ignores it.
INTO_ENGINE = "type=docker,compression=zstd,compression-level=1,oci-mediatypes=true"


def buildx_command(plan: Plan, context: Context, opts: BuildOptions, tag: str | None = None,
                   target: str | None = None) -> list[str]:
    """The exact `docker buildx build` command for a rendered context (of one stage, with target)."""
    epoch = opts.source_date_epoch if opts.source_date_epoch is not None else plan.source_date_epoch
    flags = [("--target", target), *(("--build-context", f"{name}={folder}") for name, folder in opts.contexts),
             ("--tag", tag), ("--builder", opts.builder), ("--network", opts.network),
             ("--secret", f"id=ca,src={opts.ca_cert}" if opts.ca_cert else None),
             *(("--label", f"{key}={value}") for key, value in opts.labels),
             ("--build-arg", f"TORCH_CUDA_ARCH_LIST={plan.build.torch_cuda_arch_list}"),
             ("--build-arg", f"MAX_JOBS={opts.max_jobs or plan.build.max_jobs}"),
             ("--build-arg", f"NVCC_THREADS={opts.nvcc_threads or plan.build.nvcc_threads}"),
             ("--build-arg", f"SOURCE_DATE_EPOCH={epoch}" if epoch is not None else None)]
    cmd = ["docker", "buildx", "build", "--progress=plain", "--output", opts.output or INTO_ENGINE,
           "--provenance=false", "--platform", plan.platform, "--file", str(context.dockerfile),
           *(["--no-cache"] if opts.no_cache else [])]
    for flag, value in flags:
        if value:
            cmd += [flag, value]
    return [*cmd, str(context.path)]


# What registers the emulator an engine runs another architecture's build steps with (binfmt_misc, the F flag).
EMULATION_HINT = ("register QEMU's binfmt handlers on the engine's machine (Debian, Ubuntu: apt-get install "
                  "qemu-user-static; or docker run --privileged --rm tonistiigi/binfmt --install all)")


def engine_arch(host: str | None) -> str:
    """The engine's own architecture, as Docker names it (amd64, arm64)."""
    return dockercli.answered(host) or \
        dockercli.run(["version", "--format", "{{.Server.Arch}}"], what="docker version", host=host).stdout.strip()


def builder_platforms(opts: BuildOptions) -> tuple[str, ...]:
    """The platforms the builder runs build steps for (`docker buildx inspect`: its own, and what binfmt emulates)."""
    inspect = dockercli.run(["buildx", "inspect", *(["--builder", opts.builder] if opts.builder else [])],
                            what="docker buildx inspect", host=opts.docker_host).stdout
    listed = next((line.partition(":")[2] for line in inspect.splitlines() if line.strip().startswith("Platforms:")), "")
    return tuple(p.strip().rstrip("*") for p in listed.split(",") if p.strip())


def require_platform(plan: Plan, opts: BuildOptions) -> None:
    """Raise BuildError, in one line, when the builder can run no build step of the plan's platform."""
    own = engine_arch(opts.docker_host)
    if own == plan.arch:
        return
    platforms = builder_platforms(opts)
    if plan.platform not in platforms:
        raise BuildError(f"the engine is {own} and its builder runs no {plan.platform} steps (it runs "
                         f"{', '.join(platforms) or 'none'}): {EMULATION_HINT}", field="platform")


@dataclass
class _BuildLog:
    """What the plain-progress output of a build says: its steps and the failures sparkforge explains."""

    progress: Callable[[Step, float], None]
    clock: Callable[[], float] = time.monotonic
    start: float = field(default_factory=time.monotonic)
    shown: dict[int, float] = field(default_factory=dict)  # when each step's progress was last shown
    steps: dict[int, Step] = field(default_factory=dict)
    mod_failures: list[tuple[str, str]] = field(default_factory=list)
    fetch_failures: list[str] = field(default_factory=list)
    base_failures: list[tuple[str, str]] = field(default_factory=list)
    outputs: dict[int, deque[str]] = field(default_factory=dict)  # each step's last lines
    # A step that started but is not shown yet: BuildKit says "#N CACHED" (or "#N DONE" of a base the engine
    # holds) at once, so a step is shown only once a line says more, another step's line comes, or SHOW_AFTER
    # seconds pass (feed("")): never a step from the cache, nor a base that was there.
    pending: int | None = None

    def feed(self, line: str) -> None:
        if (n := self.pending) is not None:
            base = self.steps[n].command.startswith("FROM ")
            if line == f"#{n} CACHED" or (base and line.startswith(f"#{n} DONE ")):
                self.pending = None
            elif (line.strip() and not line.startswith(f"#{n} resolve ")) or self.clock() - self.shown[n] >= SHOW_AFTER:
                self.pending = None
                self.progress(self.steps[n], self.shown[n] - self.start)
        if m := _STEP.match(line):
            n = int(m.group(1))
            if n not in self.steps:
                self.steps[n] = Step(n, m.group(2), m.group(3))
                self.shown[n] = self.clock()
                self.pending = n
        elif (m := _CACHED.match(line)) and int(m.group(1)) in self.steps:
            self.steps[int(m.group(1))].cached = True
        elif (m := _DONE.match(line)) and int(m.group(1)) in self.steps:
            self.steps[int(m.group(1))].seconds = float(m.group(2))
        elif (m := _ERROR.match(line)) and int(m.group(1)) in self.steps:
            self.steps[int(m.group(1))].error = m.group(2)
        elif (m := _OUTPUT.match(line)) and int(m.group(1)) in self.steps:
            n = int(m.group(1))
            self.outputs.setdefault(n, deque(maxlen=SHOWN_LINES)).append(m.group(2))
            now = self.clock()
            if now - self.shown.get(n, now) >= STILL_RUNNING:  # a long step: say again what it is doing
                self.shown[n] = now
                self.steps[n].said = m.group(2)
                self.progress(self.steps[n], now - self.start)
        if m := _MOD_FAILED.search(line):
            self.mod_failures.append((m.group(1), m.group(2)))
        elif m := _FETCH_FAILED.search(line):
            self.fetch_failures.append(m.group(1))
        elif m := _BASE_FAILED.search(line):
            self.base_failures.append((m.group(1), m.group(2)))

    def failure(self, plan: Plan, code: int, log_path: Path) -> BuildError:
        """The one line that explains a failed build best, with the failing step's last lines to show above it."""
        tail = f"(build log: {log_path})"
        failed = next((s for s in self.steps.values() if s.error), None)
        if self.mod_failures:
            name, reason = self.mod_failures[0]
            error = BuildError(f"mod {name} failed: {reason} {tail}", field=f"mods: {name}")
        elif self.fetch_failures:
            error = BuildError(f"cannot fetch the source: {self.fetch_failures[0]} {tail}", field=plan.variant)
        elif self.base_failures:
            ref, reason = self.base_failures[0]
            error = BuildError(f"the base image {ref} cannot be pulled from here ({reason[-160:]}); build on a base "
                               f"this engine has with --base IMAGE, or pull it where the registry is reachable {tail}",
                               field="base")
        else:
            where = f"step [{failed.name}] {failed.command[:80]}: {failed.error}" if failed else f"exit code {code}"
            error = BuildError(f"build failed at {where} {tail}", field=plan.variant)
        if failed is not None and not (self.fetch_failures or self.base_failures):  # those say it all
            error.context = (f"step [{failed.name}] {failed.command[:100]}, its last lines:",
                             *self.outputs.get(failed.number, ()))
        return error


BASE_LABEL = "io.sparkforge.base.resolved"  # an undigested plan's base as the engine held it (base_on_engine)


def base_on_engine(plan: Plan, host: str | None) -> str | None:
    """An undigested base as the engine holds it: `REPOSITORY@sha256:...`, else its image ID; None when absent."""
    if plan.base.digest.value is not None:
        return None
    data = dockercli.inspect_images(plan.base.ref, host=host)[plan.base.ref]
    if not data:
        return None
    wanted = plan.base.repository
    digests = [d for d in data.get("RepoDigests") or [] if isinstance(d, str) and d.partition("@")[0] == wanted]
    return digests[0] if digests else str(data.get("Id") or "") or None


def build_image(plan: Plan, context: Context, opts: BuildOptions,
                progress: Callable[[Step, float], None] = lambda step, elapsed: None,
                also: tuple[str, ...] = ()) -> BuildResult:
    """Run BuildKit on a context (log to a file, steps to `progress`); result.tags: the candidate's and `also`'s IDs."""
    candidate = candidate_tag(plan) if opts.output is None else ""  # into the engine; else an exporter's file
    if candidate and not any(key == BASE_LABEL for key, _ in opts.labels) \
            and (resolved := base_on_engine(plan, opts.docker_host)):
        opts = replace(opts, labels=(*opts.labels, (BASE_LABEL, resolved)))
    built = _buildx(plan, context, opts, progress, tag=candidate or None)
    if not candidate:
        return built
    tags = image_ids(candidate, *also)
    if not (image_id := tags[candidate]):
        raise BuildError(f"the build finished but the engine has no image {candidate} (build log: {built.log_path})",
                         field="docker")
    return replace(built, image_id=image_id, candidate=candidate, tags=tags)


def export_stage(plan: Plan, context: Context, opts: BuildOptions, target: str, dest: Path,
                 progress: Callable[[Step, float], None] = lambda step, elapsed: None) -> BuildResult:
    """Build one stage of a context and write its files to dest (BuildKit's local exporter); no image."""
    return _buildx(plan, context, replace(opts, output=f"type=local,dest={dest}"), progress, target=target)


def _buildx(plan: Plan, context: Context, opts: BuildOptions, progress: Callable[[Step, float], None], *,
            tag: str | None = None, target: str | None = None) -> BuildResult:
    """Run `docker buildx build`, its log to a file and each step to progress; a failure is one BuildError."""
    if opts.ca_cert and not opts.ca_cert.is_file():
        raise BuildError("CA bundle not found", path=opts.ca_cert, field="--ca-cert")
    dockercli.require_engine(opts.docker_host)  # a build has no time limit: never start one on a wedged engine
    require_platform(plan, opts)
    cmd = buildx_command(plan, context, opts, tag=tag, target=target)
    opts.log_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + (f"-{target}" if target else "")
    log_path = opts.log_dir / f"{plan.variant}-{plan.plan_hash[:12]}-{stamp}.log"
    reader = _BuildLog(progress)
    env = dict(os.environ, DOCKER_BUILDKIT="1", BUILDKIT_PROGRESS="plain")
    try:
        with open(log_path, "w", encoding="utf-8") as log:
            log.write("$ " + " ".join(cmd) + "\n")
            proc = dockercli.start(cmd[1:], host=opts.docker_host, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, env=env, bufsize=1, errors="replace")
            try:
                for line in dockercli.lines_until_stall(proc, BUILD_STALL, tick=SHOW_AFTER):
                    log.write(line)
                    reader.feed(line.rstrip("\n"))
            except BaseException:  # Ctrl-C, SIGTERM, a failing progress callback: the build stops too
                dockercli.stop(proc)
                dockercli.finish(proc)
                raise
            code = dockercli.finish(proc, timeout=dockercli.EXIT_GRACE)  # its output ended: it is exiting
    except OSError as exc:  # the log on a full disk names no file of its own
        name_path(exc, log_path)
        raise
    if code != 0:
        if not reader.steps:  # no step ran: a missing engine or buildx explains it best
            if problem := dockercli.engine_problem(opts.docker_host):
                raise BuildError(problem, field="docker")
            if dockercli.run(["buildx", "version"], host=opts.docker_host, check=False).returncode != 0:
                raise BuildError("the buildx plugin of the docker CLI is not installed (docker-buildx-plugin)",
                                 field="docker")
        raise reader.failure(plan, code, log_path)
    return BuildResult(plan, "", "", log_path, time.monotonic() - reader.start,
                       sorted(reader.steps.values(), key=lambda s: s.number))


def image_ids(*refs: str) -> dict[str, str | None]:
    """The image ID each tag points to now (None where the tag does not exist), in one call."""
    return {ref: data["Id"] if data else None for ref, data in dockercli.inspect_images(*refs).items()}


def current_image(ref: str) -> str | None:
    """The image ID a tag points to now, or None."""
    return image_ids(ref)[ref]


def _hex12(image_id: str) -> str:
    return image_id.removeprefix("sha256:")[:12]


def kept_tag(tag: str, image_id: str) -> str:
    """The tag that keeps an image of the plan reachable when the immutable tag names another: `TAG.<12 hex
    of the image ID>` (a variant name holds no `.`, so no other variant's tag reads like it)."""
    return f"{tag}.{_hex12(image_id)}"


def promote(result: BuildResult, now: dict[str, str | None], *,
            move: bool = False) -> tuple[tuple[str, ...], str | None]:
    """After the smoke tests passed: the immutable, then the moving tag to the image; (tags set, line to say).

    The immutable tag never moves silently: when it names another image (the same plan gave other bytes:
    `--no-cache` of a compiled variant, a base's tag moved), the new image is kept as kept_tag and no tag moves;
    with `move`, the old image is kept as its kept_tag first, so history, `deploy --to` and rollback reach it."""
    plan = result.plan
    before = now.get(plan.tag)
    refs: tuple[str, ...] = (plan.tag, plan.moving_tag)
    replaced = None
    if before and before != result.image_id:
        old, new, old_kept = _hex12(before), _hex12(result.image_id), kept_tag(plan.tag, before)
        if move:
            dockercli.run(["tag", before, old_kept])
            replaced = f"{plan.tag} moved from image {old} to {new}; {old} stays as {old_kept}"
        else:
            refs = (kept_tag(plan.tag, result.image_id),)
            replaced = (f"{plan.tag} already names image {old}, an earlier build of this plan; this build made "
                        f"{new}, kept as {refs[0]}; neither tag moved (build --move-tag moves them, keeping {old} as "
                        f"{old_kept})")
    for ref in refs:
        if now.get(ref) != result.image_id:
            dockercli.run(["tag", result.image_id, ref])
    if now.get(result.candidate):
        drop_candidate(result)
    return refs, replaced


def drop_candidate(result: BuildResult) -> None:
    """Remove the candidate tag (and with it the image, when no other tag names it)."""
    dockercli.run(["image", "rm", "--no-prune", result.candidate], check=False)
