nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
A="--prompts 4 --max-new-tokens 256 --max-depth 15 --methods ngram-16 dynamic-16 server\ default --temperatures 0 1"
bash .scratch/s33/gpu_e2e.sh mamba2-2.7b m27 m27_direct --prompts 4 --max-new-tokens 256 --max-depth 15 --paths grpc --methods ngram-16 dynamic-16 "server default" --temperatures 0 1
bash .scratch/s33/gpu_e2e.sh mamba2-2.7b m27 m27_grpcio --grpcio-only --prompts 4 --max-new-tokens 256 --max-depth 15 --paths grpc --methods ngram-16 dynamic-16 "server default" --temperatures 0 1
bash .scratch/s33/gpu_e2e.sh hybrid-8b h8 h8 --prompts 4 --max-new-tokens 256 --max-depth 15 --paths grpc inproc --methods ngram-16 "server default" --temperatures 0
