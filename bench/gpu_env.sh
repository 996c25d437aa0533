# Sourced by the scripts that run on a lent GPU machine (repository root): compiled Triton, no hub,
# the wheels the device image lacks (carried in .whl) installed to /tmp/site, and this checkout on
# the path.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TRITON_INTERPRET=0
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
