# The drafter: a small draft model on CPU (or n-gram drafting without a model).
#   docker build -f docker/drafter.Dockerfile -t treeserve-drafter .
FROM python:3.12-slim
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
RUN pip install torch==2.11.0 --index-url https://download.pytorch.org/whl/cpu
COPY docker/requirements.txt /tmp/requirements.txt
RUN pip install -r /tmp/requirements.txt
WORKDIR /app
COPY pyproject.toml README.md ./
COPY treeserve treeserve
COPY kernels kernels
COPY models models
COPY drafter_service drafter_service
RUN pip install --no-deps .
COPY docker/healthcheck.py /usr/local/bin/treeserve-healthcheck
EXPOSE 50053
ENTRYPOINT ["treeserve", "drafter"]
CMD ["--model", "/models/drafter", "--device", "cpu", "--host", "0.0.0.0", "--port", "50053"]
