# Rendered by sparkforge 0.1.0 from images/ng17e.yaml (variant ng17e <- ng17).
# Do not edit: change the recipe and run `python build.py render ng17e` again.
ARG BASE_IMAGE=nvcr.io/nvidia/vllm:26.02-py3

# ---------------------------------------------------------------- base: the most stable layers
FROM ${BASE_IMAGE} AS base
SHELL ["/bin/bash", "-euo", "pipefail", "-c"]
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONDONTWRITEBYTECODE=1
# Versions of OS packages come from the pinned base image's apt sources.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ccache \
 && rm -rf /var/lib/apt/lists/*
COPY sparkforge/inimage/ /opt/sparkforge/inimage/
# Record the base's own builds of these packages; every later pip install is constrained to them.
RUN python3 -I -B /opt/sparkforge/inimage protect --out /opt/sparkforge/protect torch torchvision torchaudio triton numpy

# ---------------------------------------------------------------- component cutlass (v4.4.0)
FROM base AS component-cutlass
SHELL ["/bin/bash", "-euo", "pipefail", "-c"]
COPY sparkforge/gitfetch.py sparkforge/inimage/proc.py /opt/sparkforge/
# A blob-less mirror per repository URL; a tag is peeled to its commit, a short SHA resolved to the one commit it names.
RUN --mount=type=cache,id=sparkforge-git,target=/var/cache/sparkforge/git,sharing=locked \
    --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca GIT_SSL_CAINFO=/run/secrets/ca SSL_CERT_FILE=/run/secrets/ca; fi; \
    python3 /opt/sparkforge/gitfetch.py --cache /var/cache/sparkforge/git --repo https://github.com/NVIDIA/cutlass.git --ref v4.4.0 --dest /opt/cutlass

# ---------------------------------------------------------------- vLLM source at 600a039f5
FROM base AS vllm-source
SHELL ["/bin/bash", "-euo", "pipefail", "-c"]
COPY sparkforge/gitfetch.py sparkforge/inimage/proc.py /opt/sparkforge/
# A blob-less mirror per repository URL; a tag is peeled to its commit, a short SHA resolved to the one commit it names.
RUN --mount=type=cache,id=sparkforge-git,target=/var/cache/sparkforge/git,sharing=locked \
    --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca GIT_SSL_CAINFO=/run/secrets/ca SSL_CERT_FILE=/run/secrets/ca; fi; \
    python3 /opt/sparkforge/gitfetch.py --cache /var/cache/sparkforge/git --repo https://github.com/vllm-project/vllm.git --ref 600a039f5 --commit 600a039f572ac28128750f0463af428c5a260f1a --dest /workspace/vllm
COPY mods/marlin-sm12x-fp8 /opt/sparkforge/mods/marlin-sm12x-fp8
RUN python3 -I -B /opt/sparkforge/inimage apply /opt/sparkforge/mods/marlin-sm12x-fp8 --root /workspace/vllm --record /opt/sparkforge/record/mods/01-marlin-sm12x-fp8.json

# ---------------------------------------------------------------- compile (depends on no install-phase mod)
FROM vllm-source AS vllm-build
SHELL ["/bin/bash", "-euo", "pipefail", "-c"]
COPY --from=component-cutlass /opt/cutlass /opt/cutlass
ARG TORCH_CUDA_ARCH_LIST='12.0a;12.1a'
ARG MAX_JOBS=8
ARG NVCC_THREADS=2
# Set from the lock: pip then writes hash-based .pyc files, which do not depend on the build's time.
# The lock pins what the runtime installs; the compile's build tools follow the pinned source's
# build requirements (requirements/build.txt, or requirements/build/cuda.txt from vLLM 0.20.0 on),
# constrained only by the base's protected builds.
ARG SOURCE_DATE_EPOCH
WORKDIR /workspace/vllm
RUN --mount=type=cache,id=sparkforge-ccache,target=/root/.ccache \
    --mount=type=cache,id=sparkforge-pip,target=/root/.cache/pip \
    --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca GIT_SSL_CAINFO=/run/secrets/ca SSL_CERT_FILE=/run/secrets/ca; fi; \
    python3 use_existing_torch.py; \
    build_reqs=requirements/build.txt; \
    if [ -f requirements/build/cuda.txt ]; then build_reqs=requirements/build/cuda.txt; fi; \
    python3 -m pip install -c /opt/sparkforge/protect/constraints.txt -r "$build_reqs"; \
    CCACHE_DIR=/root/.ccache \
    SETUPTOOLS_SCM_PRETEND_VERSION=0.17.1rc1.dev158 \
    VLLM_CUTLASS_SRC_DIR=/opt/cutlass \
    python3 -m pip wheel --no-build-isolation --no-deps -w /wheels .

# ---------------------------------------------------------------- the compiled wheel and its records, for the wheel cache
FROM scratch AS wheel-export
COPY --from=vllm-build /wheels/ /wheels/
COPY --from=vllm-build /workspace/vllm/.sparkforge-commit /record/vllm-commit
COPY --from=vllm-build /opt/sparkforge/record/mods/ /record/mods/

# ---------------------------------------------------------------- runtime: installs, then mods, then metadata
FROM base AS runtime
SHELL ["/bin/bash", "-euo", "pipefail", "-c"]
# Set from the lock: hash-based .pyc files from pip, and the build record's time.
ARG SOURCE_DATE_EPOCH
COPY --from=vllm-build /workspace/vllm/.sparkforge-commit /opt/sparkforge/record/vllm-commit
COPY --from=vllm-build /opt/sparkforge/record/mods/ /opt/sparkforge/record/mods/
COPY --from=vllm-build /opt/sparkforge/mods/ /opt/sparkforge/mods/
COPY --from=component-cutlass /opt/cutlass /opt/cutlass
# The vLLM wheel: compiled above.
RUN --mount=type=bind,from=vllm-build,source=/wheels,target=/wheels \
    --mount=type=cache,id=sparkforge-pip,target=/root/.cache/pip \
    --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca GIT_SSL_CAINFO=/run/secrets/ca SSL_CERT_FILE=/run/secrets/ca; fi; \
    python3 -m pip install -c /opt/sparkforge/protect/constraints.txt --no-deps /wheels/vllm-*.whl; \
    python3 -I -B /opt/sparkforge/inimage note-wheel /wheels/vllm-*.whl --origin compiled --out /opt/sparkforge/record/vllm-wheel.json
RUN --mount=type=cache,id=sparkforge-pip,target=/root/.cache/pip \
    --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca GIT_SSL_CAINFO=/run/secrets/ca SSL_CERT_FILE=/run/secrets/ca; fi; \
    python3 -m pip install -c /opt/sparkforge/protect/constraints.txt flashinfer-python==0.6.6 'ray[default]'
RUN python3 -I -B /opt/sparkforge/inimage check-protected /opt/sparkforge/protect
COPY mods/mtp-nvfp4-exclusion /opt/sparkforge/mods/mtp-nvfp4-exclusion
RUN python3 -I -B /opt/sparkforge/inimage apply /opt/sparkforge/mods/mtp-nvfp4-exclusion --record /opt/sparkforge/record/mods/02-mtp-nvfp4-exclusion.json
COPY mods/uf17-eager-allreduce /opt/sparkforge/mods/uf17-eager-allreduce
RUN python3 -I -B /opt/sparkforge/inimage apply /opt/sparkforge/mods/uf17-eager-allreduce --record /opt/sparkforge/record/mods/03-uf17-eager-allreduce.json
COPY mods/fix-qwen35-tp4-marlin /opt/sparkforge/mods/fix-qwen35-tp4-marlin
RUN python3 -I -B /opt/sparkforge/inimage apply /opt/sparkforge/mods/fix-qwen35-tp4-marlin --record /opt/sparkforge/record/mods/04-fix-qwen35-tp4-marlin.json
COPY mods/serve-torchrun /opt/sparkforge/mods/serve-torchrun
RUN python3 -I -B /opt/sparkforge/inimage apply /opt/sparkforge/mods/serve-torchrun --record /opt/sparkforge/record/mods/05-serve-torchrun.json
# The device code of every CUDA extension of vLLM and the components: cubins and PTX per file, which
# the static smoke tier checks against the plan's GPUs before any tag moves. A layer of its own, so a
# change of the GPUs re-runs only this scan.
# hadolint ignore=DL3059
RUN python3 -I -B /opt/sparkforge/inimage kernels scan --gpu 12.0 --gpu 12.1 --dist vllm --dist flashinfer-python --dist ray /opt/cutlass --out /opt/sparkforge/record/kernels.json

# ---------------------------------------------------------------- metadata: the most volatile layers
COPY plan.json /opt/sparkforge/plan.json
# The build record: the plan, each mod's result, and what was really installed.
RUN python3 -I -B /opt/sparkforge/inimage record /opt/sparkforge
ENV VLLM_UF_EAGER_ALLREDUCE=0
LABEL org.opencontainers.image.title="sparkforge vLLM ng17e" \
      org.opencontainers.image.version="0.17.1rc1.dev158" \
      org.opencontainers.image.revision="600a039f572ac28128750f0463af428c5a260f1a" \
      org.opencontainers.image.base.name="nvcr.io/nvidia/vllm:26.02-py3" \
      org.opencontainers.image.base.digest="" \
      io.sparkforge.variant="ng17e" \
      io.sparkforge.chain="ng17e,ng17" \
      io.sparkforge.plan-hash="<plan hash>" \
      io.sparkforge.arch-list="12.0a;12.1a" \
      io.sparkforge.mods="marlin-sm12x-fp8@8bd16ef033b8,mtp-nvfp4-exclusion@15c2aa2e7cb3,uf17-eager-allreduce@3c6bd3b8967f,fix-qwen35-tp4-marlin@6fa6f1a9b64b,serve-torchrun@7247f77f2993" \
      io.sparkforge.tool-version="0.1.0"
