"""Evaluation: a drafter measured by actually speculating against its verifier, and the results format.

    prompts.py     the evaluation prompt sets
    in_process.py  the in-process evaluator (transformers), with the teacher-forced fidelity check
    vllm.py        the serving evaluator (a running vLLM server's spec-decode counters)
    llamacpp.py    the serving evaluator on a CPU (llama.cpp's llama-server, its own draft counters)
    results.py     the `dspark-acceptance/1` results format (write, read, table, provenance)
    metrics/       the acceptance metrics as an `evaluate` metric module
"""
