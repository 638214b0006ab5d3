# rollq worker image (CPU build of vLLM). For GPUs, build with EXTRAS=gpu on a CUDA base image.
# Untested here: this machine has no Docker engine.
FROM python:3.11-slim
ARG EXTRAS=cpu
# Where pip finds the CPU build of torch (PyTorch's CPU wheel index), if not on PyPI's default.
ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL} PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY rollq ./rollq
RUN pip install --no-cache-dir ".[${EXTRAS}]" \
 && pip uninstall -y torchvision torchaudio torchcodec || true
ENTRYPOINT ["rollq"]
CMD ["pool", "--workers", "1"]
