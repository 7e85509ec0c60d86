# Rendered by sparkforge 0.1.0 from images/ngc2610.yaml (variant ngc2610).
# Do not edit: change the recipe and run `python build.py render ngc2610` again.
ARG BASE_IMAGE=nvcr.io/nvidia/vllm:26.10-py3

# ---------------------------------------------------------------- base: the most stable layers
FROM ${BASE_IMAGE} AS base
SHELL ["/bin/bash", "-euo", "pipefail", "-c"]
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONDONTWRITEBYTECODE=1
COPY sparkforge/inimage/ /opt/sparkforge/inimage/
# Record the base's own builds of these packages; every later pip install is constrained to them.
# The vLLM the base carries is kept (and protected): it must be the release the recipe names.
RUN python3 -I -B /opt/sparkforge/inimage protect --out /opt/sparkforge/protect torch torchvision torchaudio triton numpy vllm \
 && python3 -I -B /opt/sparkforge/inimage base-vllm 0.31.0

# ---------------------------------------------------------------- runtime: installs, then mods, then metadata
FROM base AS runtime
SHELL ["/bin/bash", "-euo", "pipefail", "-c"]
# Set from the lock: hash-based .pyc files from pip, and the build record's time.
ARG SOURCE_DATE_EPOCH
# No vLLM install: the base's own is kept (checked in the base stage).
RUN python3 -I -B /opt/sparkforge/inimage check-protected /opt/sparkforge/protect
COPY mods/uf17-eager-allreduce /opt/sparkforge/mods/uf17-eager-allreduce
RUN python3 -I -B /opt/sparkforge/inimage apply /opt/sparkforge/mods/uf17-eager-allreduce --record /opt/sparkforge/record/mods/01-uf17-eager-allreduce.json
COPY mods/serve-torchrun /opt/sparkforge/mods/serve-torchrun
RUN python3 -I -B /opt/sparkforge/inimage apply /opt/sparkforge/mods/serve-torchrun --record /opt/sparkforge/record/mods/02-serve-torchrun.json
# The device code of every CUDA extension of vLLM and the components: cubins and PTX per file, which
# the static smoke tier checks against the plan's GPUs before any tag moves. A layer of its own, so a
# change of the GPUs re-runs only this scan.
# hadolint ignore=DL3059
RUN python3 -I -B /opt/sparkforge/inimage kernels scan --gpu 12.1 --not-needed _deepselect_C --not-needed _flashmla_C --not-needed _flashmla_extension_C --not-needed _vllm_fa3_C --dist vllm --out /opt/sparkforge/record/kernels.json

# ---------------------------------------------------------------- metadata: the most volatile layers
COPY plan.json /opt/sparkforge/plan.json
# The build record: the plan, each mod's result, and what was really installed.
RUN python3 -I -B /opt/sparkforge/inimage record /opt/sparkforge
ENV VLLM_UF_EAGER_ALLREDUCE=0
LABEL org.opencontainers.image.title="sparkforge vLLM ngc2610" \
      org.opencontainers.image.version="0.31.0" \
      org.opencontainers.image.revision="" \
      org.opencontainers.image.base.name="nvcr.io/nvidia/vllm:26.10-py3" \
      org.opencontainers.image.base.digest="" \
      io.sparkforge.variant="ngc2610" \
      io.sparkforge.chain="ngc2610" \
      io.sparkforge.plan-hash="<plan hash>" \
      io.sparkforge.arch-list="12.1a" \
      io.sparkforge.mods="uf17-eager-allreduce@3c6bd3b8967f,serve-torchrun@7247f77f2993" \
      io.sparkforge.tool-version="0.1.0"
