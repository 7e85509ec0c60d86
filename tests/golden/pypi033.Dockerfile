# Rendered by sparkforge 0.1.0 from images/pypi033.yaml (variant pypi033).
# Do not edit: change the recipe and run `python build.py render pypi033` again.
ARG BASE_IMAGE=nvidia/cuda:13.0.2-devel-ubuntu24.04

# ---------------------------------------------------------------- base: the most stable layers
FROM ${BASE_IMAGE} AS base
SHELL ["/bin/bash", "-euo", "pipefail", "-c"]
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONDONTWRITEBYTECODE=1
# Versions of OS packages come from the pinned base image's apt sources.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends git python3 python3-dev python3-venv \
 && rm -rf /var/lib/apt/lists/*
# The image's packages go into a venv, its python3 first on PATH: pip installs the wheel set's versions there,
# beside what the distribution's apt put in the system Python (which it does not let pip replace), and the
# venv still sees the base's own packages.
RUN python3 -m venv --system-site-packages /opt/venv
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH}
COPY sparkforge/inimage/ /opt/sparkforge/inimage/
# Record the base's own builds of these packages; every later pip install is constrained to them.
RUN python3 -I -B /opt/sparkforge/inimage protect --out /opt/sparkforge/protect

# ---------------------------------------------------------------- runtime: installs, then mods, then metadata
FROM base AS runtime
SHELL ["/bin/bash", "-euo", "pipefail", "-c"]
# Set from the lock: hash-based .pyc files from pip, and the build record's time.
ARG SOURCE_DATE_EPOCH
RUN --mount=type=cache,id=sparkforge-pip,target=/root/.cache/pip \
    --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca GIT_SSL_CAINFO=/run/secrets/ca SSL_CERT_FILE=/run/secrets/ca; fi; \
    python3 -m pip install -c /opt/sparkforge/protect/constraints.txt vllm==0.33.0
RUN python3 -I -B /opt/sparkforge/inimage check-protected /opt/sparkforge/protect
COPY mods/uf17-eager-allreduce /opt/sparkforge/mods/uf17-eager-allreduce
RUN python3 -I -B /opt/sparkforge/inimage apply /opt/sparkforge/mods/uf17-eager-allreduce --record /opt/sparkforge/record/mods/01-uf17-eager-allreduce.json
COPY mods/serve-torchrun /opt/sparkforge/mods/serve-torchrun
RUN python3 -I -B /opt/sparkforge/inimage apply /opt/sparkforge/mods/serve-torchrun --record /opt/sparkforge/record/mods/02-serve-torchrun.json
# The device code of every CUDA extension of vLLM and the components: cubins and PTX per file, which
# the static smoke tier checks against the plan's GPUs before any tag moves. A layer of its own, so a
# change of the GPUs re-runs only this scan.
# hadolint ignore=DL3059
RUN python3 -I -B /opt/sparkforge/inimage kernels scan --gpu 12.1 --not-needed _deepselect_C --not-needed _flashmla_C --not-needed _flashmla_extension_C --not-needed _qutlass_C --not-needed _vllm_fa3_C --dist vllm --out /opt/sparkforge/record/kernels.json

# ---------------------------------------------------------------- metadata: the most volatile layers
COPY plan.json /opt/sparkforge/plan.json
# The build record: the plan, each mod's result, and what was really installed.
RUN python3 -I -B /opt/sparkforge/inimage record /opt/sparkforge
ENV VLLM_UF_EAGER_ALLREDUCE=0
LABEL org.opencontainers.image.title="sparkforge vLLM pypi033" \
      org.opencontainers.image.version="0.33.0" \
      org.opencontainers.image.revision="" \
      org.opencontainers.image.base.name="nvidia/cuda:13.0.2-devel-ubuntu24.04" \
      org.opencontainers.image.base.digest="" \
      io.sparkforge.variant="pypi033" \
      io.sparkforge.chain="pypi033" \
      io.sparkforge.plan-hash="<plan hash>" \
      io.sparkforge.arch-list="12.1a" \
      io.sparkforge.mods="uf17-eager-allreduce@3c6bd3b8967f,serve-torchrun@7247f77f2993" \
      io.sparkforge.tool-version="0.1.0"
