# The verifier: owns the target model on a GPU.
#   docker build -f docker/verifier.Dockerfile -t treeserve-verifier .
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN apt-get update && apt-get install -y --no-install-recommends python3.12 python3.12-venv python3.12-dev \
        build-essential && rm -rf /var/lib/apt/lists/* && python3.12 -m venv $VIRTUAL_ENV
# CUDA build of torch first, so nothing later resolves a different one.
RUN pip install torch==2.11.0 --index-url https://download.pytorch.org/whl/cu128
COPY docker/requirements.txt /tmp/requirements.txt
RUN pip install -r /tmp/requirements.txt
WORKDIR /app
COPY pyproject.toml README.md ./
COPY treeserve treeserve
COPY kernels kernels
COPY models models
COPY verifier_service verifier_service
RUN pip install --no-deps .
COPY docker/healthcheck.py /usr/local/bin/treeserve-healthcheck
EXPOSE 50052
ENTRYPOINT ["treeserve", "verifier"]
CMD ["--model", "/models/target", "--device", "cuda", "--host", "0.0.0.0", "--port", "50052"]
