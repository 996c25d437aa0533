# The orchestrator: Ray actors + the public Generation service (CPU only).
#   docker build -f docker/orchestrator.Dockerfile -t treeserve-orchestrator .
FROM python:3.12-slim
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 RAY_AUTH_MODE=disabled
RUN pip install torch==2.11.0 --index-url https://download.pytorch.org/whl/cpu
COPY docker/requirements.txt /tmp/requirements.txt
RUN pip install -r /tmp/requirements.txt
WORKDIR /app
COPY pyproject.toml README.md ./
COPY treeserve treeserve
COPY orchestrator orchestrator
# the verifier's client (an engine's VerifyStream on a verifier's direct port)
COPY verifier_service verifier_service
RUN pip install --no-deps .
COPY docker/healthcheck.py /usr/local/bin/treeserve-healthcheck
EXPOSE 50051
ENTRYPOINT ["treeserve", "orchestrator"]
CMD ["--verifier", "verifier:50052", "--drafter", "drafter:50053", "--tokenizer", "/models/target", \
     "--host", "0.0.0.0", "--port", "50051"]
