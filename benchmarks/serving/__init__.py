"""Helpers of `benchmarks/serve.py`: a serving benchmark whose metrics follow `vllm bench serve`.

One concept per module: records (what one request measured), metrics (the summary maths),
dataset (random prompts), arrivals (request timing), openai_http (the streamed HTTP client),
runner (the run itself), report (table and JSON), servers (starting servers to compare).
For serve_compare.py: peers (vLLM CPU and llama-server installed into a cache folder),
vllm_client (`vllm bench serve` as the client), sweep_table (its tables), plot (its PNG).
"""
